"""The training loops the engine tests share: random token batches; our engine's steps on one rank
of a DP world (each rank its rows of the global batch); and the single-process reference they are
held to, torch.optim.AdamW on a transformers model with Megatron's weight-decay rule, gradient
accumulation and clip_grad_norm_. Both take the same batches, so the engine must give the same
losses, grad norms and weights (within tests/fp32_bounds.py's bounds)."""
import torch


def random_batches(seed: int, steps: int, accum: int, rows: int, seq: int, vocab: int) -> list:
    """[step][micro-batch] -> (tokens, labels) of the global batch, `rows` x `seq` each (a DP rank
    takes its rows): one generator for all, so the same seed gives the same data at any DP."""
    gen = torch.Generator().manual_seed(seed)
    return [[(torch.randint(0, vocab, (rows, seq), generator=gen), torch.randint(0, vocab, (rows, seq), generator=gen))
             for _ in range(accum)] for _ in range(steps)]


def train_engine_steps(ps, model, engine, batches: list, lr) -> tuple[list[float], list[float]]:
    """Our `model` and its offload `engine` on this rank (`ps`: init_parallel's state) through
    `batches` (random_batches' layout, the same on every rank): each DP rank its share of each
    micro-batch's rows, on its device; `lr(step)` is the step's rate. Returns (losses averaged over
    the global batch, the engine's grad norms before clipping), one per step, the same on every rank."""
    from zo_megatron.parallel import collectives

    losses, norms = [], []
    for step, micro_batches in enumerate(batches):
        accum = len(micro_batches)
        total = torch.zeros((), device=ps.device)
        for i, (tokens, labels) in enumerate(micro_batches):
            rows = tokens.shape[0] // ps.dp_size             # the global batch is the same at any DP
            mine = slice(ps.dp_rank * rows, (ps.dp_rank + 1) * rows)
            loss = model.loss(tokens[mine].to(ps.device), labels[mine].to(ps.device))
            engine.backward(loss / accum, last_micro_batch=i == accum - 1)
            total += loss.detach().float() / accum
        collectives.all_reduce(total, group=ps.dp_group)
        res = engine.step(lr=lr(step))
        losses.append(total.item() / ps.dp_size)
        norms.append(res.grad_norm)
    return losses, norms


def train_with_torch_adamw(model, batches: list, *, lr, weight_decay: float, clip: float, betas, eps: float,
                           vocab: int, skip_step: int | None = None) -> tuple[list[float], list[float]]:
    """Train the transformers causal LM `model` in place on `batches` (random_batches' layout), one
    optimizer step per step with the mean loss of its micro-batches; `lr(step)` is the step's rate;
    `skip_step`: that step's update is dropped (as an overflowing fp16 step's is). Megatron's rule: no
    decay for 1-D parameters (norms, biases), decay for every matrix. Returns (losses, grad norms
    before clipping), one per step."""
    decay = [p for p in model.parameters() if p.dim() > 1]
    no_decay = [p for p in model.parameters() if p.dim() <= 1]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=lr(0), betas=betas, eps=eps)
    losses, norms = [], []
    for step, micro_batches in enumerate(batches):
        accum = len(micro_batches)
        opt.zero_grad()
        total = 0.0
        for tokens, labels in micro_batches:
            logits = model(tokens).logits
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), labels.reshape(-1))
            (loss / accum).backward()
            total += loss.item() / accum
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item())
        for g in opt.param_groups:
            g["lr"] = lr(step)
        if step != skip_step:
            opt.step()
        losses.append(total)
    return losses, norms
