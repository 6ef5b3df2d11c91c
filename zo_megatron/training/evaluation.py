"""Evaluation: the validation split's endless micro-batches and the mean loss over --eval-iters.

Megatron's semantics: --eval-iters counts global batches (accumulation x micro-batches per
rank), the validation samples consumed are counted (a resumed run continues where it stopped),
and the parameters evaluated have every pending (delayed) update applied.
"""
from __future__ import annotations

import torch

from zo_megatron.errors import UserError
from zo_megatron.offload.device import batch_to_device, host_value
from zo_megatron.parallel import collectives

# model.loss's arguments, in order; segment_ids (the documents attention keeps apart: --reset-attention-mask,
# --sft) only where the data carry them
BATCH_KEYS = ("tokens", "labels", "loss_mask", "position_ids", "segment_ids")


def loss_inputs(batch: dict, device: torch.device) -> list[torch.Tensor]:
    """model.loss's arguments from one host micro-batch, on the device (pinned, non-blocking)."""
    keys = [k for k in BATCH_KEYS if k in batch]
    d = batch_to_device({k: batch[k] for k in keys}, device)
    return [d[k] for k in keys]


def cycle(make, consumed: int = 0):
    """Endless micro-batches from `make(start)` (a fresh DP iterator per pass over a split),
    continuing after `consumed` samples (all ranks together) as a resumed run must."""
    first = make(0)
    per_pass = (len(first.dataset) // first.global_micro_batch) * first.global_micro_batch
    start = consumed % per_pass if per_pass else 0
    while True:
        produced = False
        for b in make(start):
            produced = True
            yield b
        start = 0
        if not produced:
            raise UserError("the validation split holds fewer samples than one micro-batch per DP rank: "
                            "lower --micro-batch-size or give the split more documents")


def evaluate(model, optimizer, batches, eval_iters: int, ps, device) -> tuple[float, int]:
    """The loss over `eval_iters` micro-batches per rank -- the mean over their unmasked tokens, all DP
    ranks, as Megatron-LM's evaluate sums its loss_func's [loss sum, tokens] -- and the samples that
    covered (all DP ranks)."""
    with collectives.all_ranks_agree():     # (a disk error of one rank's optimizer states: every rank's)
        optimizer.flush()                   # evaluate the parameters with every update applied
    model.eval()
    sums, count = torch.zeros(2, dtype=torch.float64, device=device), 0      # [loss sum, unmasked tokens]
    with torch.no_grad(), optimizer.forward_context():
        for _ in range(eval_iters):
            b = next(batches)
            inputs = loss_inputs(b, device)
            tokens = inputs[2].sum().double()            # the mask on the device: no host copy to wait for
            sums += torch.stack([model.loss(*inputs).detach().double() * tokens, tokens])
            count += 1
            samples = b["tokens"].shape[0]
    model.train()
    total, tokens = host_value(collectives.all_reduce(sums, group=ps.dp_group)).tolist()
    return total / max(tokens, 1.0), count * samples * ps.dp_size


class Evaluator:
    """The trainer's evaluation component: when it is due and what it measured last."""

    def __init__(self, args, ps, valid_ds, consumed_valid: int):
        from zo_megatron.data import DPBatches

        self.args, self.ps = args, ps
        self.consumed_valid = consumed_valid
        self.last_loss: float | None = None
        self.batches = cycle(lambda start: DPBatches(valid_ds, args.micro_batch_size, ps.dp_rank, ps.dp_size,
                                                     consumed_samples=start), consumed_valid)

    def due(self, iteration: int) -> bool:
        a = self.args
        return a.eval_iters > 0 and (iteration % a.eval_interval == 0 or iteration == a.train_iters)

    def run(self, model, optimizer) -> tuple[float, int]:
        """(mean loss, samples it covered); --eval-iters counts global batches, as Megatron's."""
        loss, n = evaluate(model, optimizer, self.batches, self.args.eval_iters * self.args.grad_accum_steps,
                           self.ps, self.ps.device)
        self.consumed_valid += n
        self.last_loss = loss
        return loss, n
