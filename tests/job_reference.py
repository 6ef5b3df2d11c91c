"""The job's model and datasets built in one process, as pretrain_gpt.py builds them from its flags:
the starting point of the single-process torch references that tests hold the job's runs to."""
from __future__ import annotations

import dataclasses
import os


def job_model_and_data(argv: list[str], cache: str, dp: int, **config_changes):
    """(args, tokenizer, model, train dataset, validation dataset) of the job `argv` launched on `dp`
    data-parallel ranks (TP 1), in this process (a 1-rank world: tests.harness.run_world). The model is
    the one the job's seed gives (the same full tensors at any layout), built from the job's own
    GPTConfig, with `config_changes` applied to it; the datasets hold Megatron-LM's samples in its order."""
    os.environ["ZO_MEGATRON_CACHE"] = cache
    from zo_megatron.data import build_tokenizer
    from zo_megatron.model import build_gpt_model
    from zo_megatron.parallel import init_parallel
    from zo_megatron.training import components
    from zo_megatron.training.arguments import check_batch_sizes, parse_args
    from zo_megatron.training.prelaunch import model_vocab_size

    args = parse_args(argv)
    check_batch_sizes(args, dp)
    init_parallel(1, seed=args.seed)
    tok = build_tokenizer(tokenizer_type=args.tokenizer_type, tokenizer_model=args.tokenizer_model,
                          vocab_size=args.vocab_size if args.tokenizer_type == "NullTokenizer" else None)
    args.model_vocab_size = model_vocab_size(args, tok)
    cfg = dataclasses.replace(components.model_config(args), **config_changes)
    model = build_gpt_model(cfg, 0, 1, args.seed)
    train_ds, valid_ds = components.build_datasets(args, tok, args.data_path, dp)   # --data-path, or mock data
    return args, tok, model, train_ds, valid_ds


def separate_pieces_training(args, model, train_ds, valid_ds, starts_of, iters: int):
    """Megatron-LM's training of the job `args` in one process, where every sample is cut into pieces that
    the model runs ON ITS OWN (no attention mask: what per-document attention must equal): `starts_of(sample)`
    gives the pieces' first positions. Per micro-batch the masked mean loss; the objective is their mean
    (Megatron-LM's), the logged loss the tokens' mean; clip_grad_norm_, AdamW at Megatron-LM's rate (cosine,
    warm-up of one iteration, no weight decay). Returns (logged losses, validation loss over one global batch,
    pieces run)."""
    import torch
    from megatron.core import tensor_parallel

    from tests.megatron_reference import megatron_get_lr
    from zo_megatron.data.datasets import _collate

    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_eps, weight_decay=0.0)
    per_micro, gb = args.micro_batch_size, args.global_batch_size
    pieces = [0]

    def sample_losses(tokens, positions, labels):
        bounds = [*starts_of(tokens, positions), len(tokens)]
        assert bounds[0] == 0
        out = []
        for lo, hi in zip(bounds, bounds[1:]):
            logits = model.forward(tokens[None, lo:hi], positions[None, lo:hi])
            out.append(tensor_parallel.vocab_parallel_cross_entropy(logits.float(), labels[None, lo:hi])[0])
        pieces[0] += len(bounds) - 1
        return torch.cat(out)

    def batch_parts(ds, start):
        """(masked loss sum, tokens) of each micro-batch of the global batch at sample `start` (any DP order)."""
        parts = []
        for m in range(gb // per_micro):
            batch = _collate([ds[start + m * per_micro + j] for j in range(per_micro)])
            losses = torch.stack([sample_losses(batch["tokens"][j], batch["position_ids"][j], batch["labels"][j])
                                  for j in range(per_micro)])
            mask = batch["loss_mask"].float()
            parts.append(((losses * mask).sum(), mask.sum()))
        return parts

    def token_mean(parts):
        return (sum(s for s, _ in parts) / sum(t for _, t in parts)).item()

    losses = []
    for it in range(iters):
        parts = batch_parts(train_ds, gb * it)
        objective = sum(s / t for s, t in parts) / len(parts)       # Megatron-LM's: the micro-batches' means
        objective.backward()
        torch.nn.utils.clip_grad_norm_(params, args.clip_grad)
        for g in opt.param_groups:
            g["lr"] = megatron_get_lr(gb * it, init_lr=0.0, max_lr=args.lr, min_lr=args.min_lr,
                                      lr_warmup_steps=gb, lr_decay_steps=gb * iters, lr_decay_style="cosine")
        opt.step()
        opt.zero_grad()
        losses.append(token_mean(parts))                             # logged: the tokens' mean
    with torch.no_grad():
        val = token_mean(batch_parts(valid_ds, 0))
    return losses, val, pieces[0]
