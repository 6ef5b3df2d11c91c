"""--log-params-norm: the L2 norm of the model's parameters, each element once over the world.

Megatron-LM's calc_params_l2_norm: the parameters a TP rank holds apart (`tensor_model_parallel`)
count on every TP rank, the ones each TP rank holds a copy of (norms, row-parallel biases) on TP
rank 0 only (for experts: expert TP rank 0), the tied output layer once (it is the embedding's
tensor). The local sums of squares are divided by the number of ranks holding the same shard (DP for
dense parameters, expert DP for routed experts) and added up in one all-reduce over the world.

What is measured: the model's weights as the forward uses them, on the device. In fp32 that is the
fp32 master; under --bf16 / --fp16 the 16-bit copy of it (Megatron-LM reads its fp32 main params:
the two differ by the 16-bit rounding, relative ~1e-3 / sqrt(elements) at worst per element, far below
the log's 3 digits); with --dpu the weights the forward used last (one update behind the master,
as the model being trained is; with --dpu-corrector weight-prediction the predicted weights).
"""
from __future__ import annotations

import torch

from zo_megatron.offload.device import host_value
from zo_megatron.param_names import is_routed_expert
from zo_megatron.parallel import collectives


def params_l2_norm(model: torch.nn.Module, ps) -> float:
    """Collective over the world: every rank calls it, every rank gets the norm."""
    dense, experts = [], []
    for name, p in model.named_parameters():              # named_parameters: a tied weight once
        expert = is_routed_expert(name)
        tp_rank = ps.etp_rank if expert else ps.tp_rank
        if getattr(p, "tensor_model_parallel", False) or tp_rank == 0:
            (experts if expert else dense).append(p.detach())
    device = ps.device
    total = torch.zeros((), dtype=torch.float64, device=device)
    for params, copies in ((dense, ps.dp_size), (experts, ps.edp_size)):
        if params:
            # fp32 norms of the 16-bit tensors without an fp32 copy of them (a model's worth of device memory)
            norms = torch.stack(torch._foreach_norm(params, 2, dtype=torch.float32)).double()
            total += norms.square().sum() / copies
    # timed: on CUDA the sum sits behind an NCCL all-reduce (issue 34, 2.2)
    return host_value(collectives.all_reduce(total.reshape(1))).item() ** 0.5
