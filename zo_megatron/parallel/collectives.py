"""Every torch.distributed collective zo_megatron issues goes through this module.

The rule, in one place: process groups carry one backend per device type --
``cpu:gloo,cuda:nccl`` on GPUs, ``gloo`` on CPU-only machines (``default_backend``) -- and
megatron-core's TP/DP subgroups inherit that map. So a collective runs where its tensor lives:
bucket reduce-scatters and parameter all-gathers on CUDA tensors go through NCCL, the small
host-side agreements (overflow flag + grad norm, layout checks, logged losses) stay on CPU
tensors and go through gloo, and no tensor is moved just to satisfy a backend. A tensor whose
device type the group has no backend for is refused with one line here, not deep inside torch.

A size-1 group never communicates. Without an initialised process group every call acts as a
size-1 group (single-process tools and tests). ``tests/test_collectives.py`` fails if code
outside this module calls a torch.distributed collective directly.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from zo_megatron.errors import ConfigError

__all__ = ["default_backend", "group_size", "group_rank", "all_reduce", "reduce_scatter", "all_gather",
           "all_gather_list", "barrier", "wait_all"]

# torch >= 2.12 renamed the tensor forms; older torch (a cluster's CUDA build) has only the old names.
_reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
_devices_of_group: dict[int, frozenset[str]] = {}


def default_backend(device: torch.device) -> str:
    """The backend map for a process group whose compute device is `device`."""
    return "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"


def _active() -> bool:
    return dist.is_available() and dist.is_initialized()


def group_size(group=None) -> int:
    return dist.get_world_size(group) if _active() else 1


def group_rank(group=None) -> int:
    return dist.get_rank(group) if _active() else 0


def _check_device(t: torch.Tensor, group) -> None:
    key = id(group)
    devices = _devices_of_group.get(key)
    if devices is None:
        config = dist.get_backend_config(group)     # e.g. "cpu:gloo,cuda:nccl"
        devices = frozenset(part.split(":")[0] for part in config.split(",") if ":" in part)
        _devices_of_group[key] = devices
    if devices and t.device.type not in devices:
        raise ConfigError(
            f"a collective on a {t.device.type} tensor was issued on a process group with backends "
            f"{dist.get_backend_config(group)!r}: initialise torch.distributed with "
            f"backend={default_backend(torch.device('cuda'))!r} (zo_megatron.parallel.init_parallel does)")


def all_reduce(t: torch.Tensor, op: str = "sum", group=None) -> torch.Tensor:
    """In place over `group` (default: the whole world); returns `t`."""
    if group_size(group) > 1:
        _check_device(t, group)
        dist.all_reduce(t, op=_OPS[op], group=group)
    return t


def _flat_collective(fn, output: torch.Tensor, input: torch.Tensor, group, async_op: bool):
    """A size-1 group only copies (nothing when in place); otherwise `fn` on the group."""
    if group_size(group) == 1:
        if output.data_ptr() != input.data_ptr():
            output.copy_(input)
        return None
    _check_device(input, group)
    return fn(output, input, group=group, async_op=async_op)


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, group, async_op: bool = False):
    """output (1/N of input) <- sum over ranks of this rank's shard of input.

    `output` may be this rank's own shard of `input` (in place, as NCCL allows). With
    async_op=True returns the torch Work handle (None when nothing was sent)."""
    return _flat_collective(_reduce_scatter_tensor, output, input, group, async_op)


def all_gather(output: torch.Tensor, input: torch.Tensor, group, async_op: bool = False):
    """output (N x input) <- every rank's input, in rank order; `input` may be its own slot of
    `output` (in place). With async_op=True returns the Work handle (None when nothing was sent)."""
    return _flat_collective(_all_gather_tensor, output, input, group, async_op)


def all_gather_list(t: torch.Tensor, group) -> list[torch.Tensor]:
    """Every rank's `t` (same shape everywhere), in rank order."""
    n = group_size(group)
    if n == 1:
        return [t]
    _check_device(t, group)
    parts = [torch.empty_like(t) for _ in range(n)]
    dist.all_gather(parts, t.contiguous(), group=group)
    return parts


def barrier(group=None) -> None:
    if group_size(group) > 1:
        dist.barrier(group=group)


def wait_all(works) -> None:
    """Wait for async Work handles (on CUDA: the current stream waits; the host does not block)."""
    for w in works:
        if w is not None:
            w.wait()
