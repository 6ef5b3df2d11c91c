"""DP collectives on bucket-sized flat tensors (names differ across torch versions)."""
from __future__ import annotations

import torch
import torch.distributed as dist

_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, group, group_size: int) -> None:
    """output (1/N of input) <- sum over ranks of this rank's shard of input."""
    if group_size == 1:
        if output.data_ptr() != input.data_ptr():
            output.copy_(input)
        return
    _reduce_scatter(output, input, group=group)


def all_gather(output: torch.Tensor, input: torch.Tensor, group, group_size: int) -> None:
    """output (N x input) <- every rank's input, in rank order."""
    if group_size == 1:
        if output.data_ptr() != input.data_ptr():
            output.copy_(input)
        return
    _all_gather(output, input, group=group)
