"""Aux-loss-free load balancing (--moe-router-enable-expert-bias; DeepSeek-V3, arXiv 2408.15664): the
job's per-iteration update of megatron-core's router expert bias.

megatron-core's TopKRouter keeps two fp32 buffers of E per MoE layer: `expert_bias`, added to the
sigmoid scores that choose each token's top-k experts (not to the weights the experts' outputs are
mixed with), and `local_tokens_per_expert`, to which every training forward with gradients adds its
routing map (evaluation and the no-grad first pass of a recomputed forward add nothing). Megatron-LM's
finalize_model_grads updates the bias once per iteration, after the last micro-batch's backward and
before the optimizer step, whether or not the step is then skipped:

    counts  = local_tokens_per_expert summed over the tensor x data parallel ranks (the whole world
              here: one pipeline stage, no context parallelism)
    bias   += rate x sign(mean(counts) - counts)           (per layer, over its E experts)
    local_tokens_per_expert = 0

`ExpertBias.update` does that (the rule is megatron-core's get_updated_expert_bias; its all-reduce goes
through parallel/collectives.py). The bias is model state, not an optimizer parameter: no gradient, no
Adam, so the offload engine, DPU and the overlapped CPU step leave it alone; checkpoints keep it
(checkpoint/content.py `buffers/`).
"""
from __future__ import annotations

import torch

from zo_megatron.parallel import collectives


def expert_bias_routers(model) -> list:
    """megatron-core's routers of `model` that carry an expert bias, in module order."""
    return [m for m in model.modules() if getattr(m, "expert_bias", None) is not None]


class ExpertBias:
    """The component: `update()` once per iteration, after the last micro-batch's backward (a
    collective over the world: every rank calls it)."""

    def __init__(self, model, rate: float):
        self.routers = expert_bias_routers(model)
        self.rate = rate

    def update(self) -> None:
        if not self.routers:
            return
        with torch.no_grad():
            counts = torch.stack([r.local_tokens_per_expert for r in self.routers])
            collectives.all_reduce(counts, "sum")
            mean = counts.sum(dim=-1, keepdim=True) / counts.shape[-1]
            for r, row, avg in zip(self.routers, counts, mean):
                r.expert_bias.add_(torch.sign(avg - row) * self.rate)
                r.local_tokens_per_expert.zero_()
