"""How each parameter of the GPT is split over TP, and moving between shards and full tensors.

Megatron marks TP-split parameters with `tensor_model_parallel=True` and `partition_dim`
(0: column-parallel rows / vocab rows, 1: row-parallel columns). Everything else (LayerNorms,
row-parallel biases, position embeddings) is replicated on every TP rank. The word embedding is
also padded along the vocab rows; `full` tensors here are always UNPADDED, so they are the same
at any TP size.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from zo_megatron.parallel import collectives

WORD_EMBEDDING = "embedding.word_embeddings.weight"


@dataclass(frozen=True)
class ShardInfo:
    """Where a local parameter sits inside the full (unpadded) tensor."""

    name: str
    tp_axis: int | None          # None: replicated across TP
    local_shape: tuple[int, ...]
    full_shape: tuple[int, ...]  # unpadded
    offset: int                  # start index of this rank's shard along tp_axis (0 if replicated)
    valid: int                   # how many of the local rows along tp_axis are real (not vocab padding)

    @property
    def replicated(self) -> bool:
        return self.tp_axis is None


def shard_info(name: str, param: torch.Tensor, tp_rank: int, tp_size: int,
               vocab_size: int | None = None) -> ShardInfo:
    local = tuple(param.shape)
    if not getattr(param, "tensor_model_parallel", False):
        return ShardInfo(name, None, local, local, 0, local[0] if local else 0)
    axis = int(getattr(param, "partition_dim", 0))
    n = local[axis]
    offset = tp_rank * n
    full = list(local)
    full[axis] = n * tp_size
    valid = n
    if name.endswith(WORD_EMBEDDING) and vocab_size is not None:
        full[axis] = vocab_size
        valid = max(0, min(n, vocab_size - offset))
    return ShardInfo(name, axis, local, tuple(full), offset, valid)


def shard_of(full: torch.Tensor, info: ShardInfo) -> torch.Tensor:
    """This rank's local slice of a full unpadded tensor (vocab padding rows are zero)."""
    if info.replicated:
        return full.reshape(info.local_shape)
    out = full.new_zeros(info.local_shape)
    src = full.narrow(info.tp_axis, info.offset, info.valid)
    out.narrow(info.tp_axis, 0, info.valid).copy_(src)
    return out


def gather_full(local: torch.Tensor, info: ShardInfo, tp_group, tp_size: int) -> torch.Tensor:
    """All-gather a TP-split tensor into the full unpadded tensor (every TP rank gets it)."""
    if info.replicated or tp_size == 1:
        out = local
    else:
        out = torch.cat(collectives.all_gather_list(local, tp_group), dim=info.tp_axis)
    if info.tp_axis is not None:
        out = out.narrow(info.tp_axis, 0, info.full_shape[info.tp_axis])
    return out


def model_shard_infos(model: torch.nn.Module, tp_rank: int, tp_size: int,
                      vocab_size: int) -> dict[str, ShardInfo]:
    return {name: shard_info(name, p, tp_rank, tp_size, vocab_size) for name, p in model.named_parameters()}


def gather_full_params(model: torch.nn.Module, tp_group, tp_rank: int, tp_size: int,
                       vocab_size: int) -> dict[str, torch.Tensor]:
    """Full unpadded copies of every parameter (collective over the TP group)."""
    infos = model_shard_infos(model, tp_rank, tp_size, vocab_size)
    return {name: gather_full(p.detach(), infos[name], tp_group, tp_size)
            for name, p in model.named_parameters()}


@torch.no_grad()
def load_full_params(model: torch.nn.Module, full: dict[str, torch.Tensor], tp_rank: int, tp_size: int,
                     vocab_size: int) -> None:
    """Copy this rank's shards of full unpadded tensors into the model's parameters."""
    for name, p in model.named_parameters():
        info = shard_info(name, p, tp_rank, tp_size, vocab_size)
        if name not in full:
            raise KeyError(f"missing parameter {name!r}")
        if tuple(full[name].shape) != info.full_shape:
            raise ValueError(f"{name}: expected full shape {info.full_shape}, got {tuple(full[name].shape)}")
        p.copy_(shard_of(full[name].to(p.dtype), info))
