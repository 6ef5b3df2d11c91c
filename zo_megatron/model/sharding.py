"""How each parameter of the GPT is split over TP, and moving between shards and full tensors.

Megatron marks TP-split parameters with `tensor_model_parallel=True`, `partition_dim` (0:
column-parallel rows / vocab rows, 1: row-parallel columns) and `partition_stride`. Everything
else (norms, row-parallel biases, position embeddings, q/k norms) is replicated on every TP rank.
The word embedding and the untied output layer are also padded along the vocab rows; `full`
tensors here are always UNPADDED, so they are the same at any TP size.

Stride: with SwiGLU, linear_fc1's full tensor is [gate (f rows); up (f rows)] and TP rank r holds
[gate rows of r; up rows of r] (megatron's partition_stride 2): the full tensor is NOT the
concatenation of the TP shards. A shard is therefore described by its PIECES along the split axis,
(full offset, local offset, length): one piece for stride 1, `stride` pieces otherwise.

    full  [g0 g1 | u0 u1]  (TP 2)       rank 0: [g0; u0]   rank 1: [g1; u1]

Routed experts (names with `.mlp.experts.`) split over EXPERT TP instead (--expert-tensor-parallel-size,
megatron-core's expert TP group), which may differ from TP: Megatron-LM's MoE recipes run experts
whole (expert TP 1) beside attention at TP > 1. The model carries its (expert TP rank, size) as
`expert_tp`; a ShardInfo says which group it splits over (`expert`, `split_rank`, `split_size`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from zo_megatron.param_names import is_routed_expert
from zo_megatron.parallel import collectives

WORD_EMBEDDING = "embedding.word_embeddings.weight"
OUTPUT_LAYER = "output_layer.weight"
VOCAB_PADDED = (WORD_EMBEDDING, OUTPUT_LAYER)


def split_pieces(full_len: int, local_len: int, tp_rank: int, tp_size: int,
                 stride: int = 1) -> tuple[tuple[int, int, int], ...]:
    """(full offset, local offset, length) of TP rank `tp_rank`'s rows along the split axis.

    `full_len` is unpadded; `local_len` the rank's share (of the padded length for the vocab:
    rows past `full_len` are padding and belong to no piece). Stride s > 1 (no padding): the full
    axis is s blocks and the rank holds the r-th 1/tp of each block, in block order."""
    if stride == 1:
        start = tp_rank * local_len
        n = max(0, min(local_len, full_len - start))
        return ((start, 0, n),) if n else ()
    if full_len % (stride * tp_size) or local_len * tp_size != full_len:
        raise ValueError(f"{full_len} rows with stride {stride} do not split over TP={tp_size}")
    block, part = full_len // stride, local_len // stride
    return tuple((j * block + tp_rank * part, j * part, part) for j in range(stride))


@dataclass(frozen=True)
class ShardInfo:
    """Where a local parameter sits inside the full (unpadded) tensor."""

    name: str
    tp_axis: int | None          # None: replicated across TP
    local_shape: tuple[int, ...]
    full_shape: tuple[int, ...]  # unpadded
    pieces: tuple[tuple[int, int, int], ...]   # (full offset, local offset, length) along tp_axis
    stride: int = 1
    expert: bool = False         # a routed expert's: split over expert TP, not TP
    split_rank: int = 0          # this rank's index in the group tp_axis splits over
    split_size: int = 1          # that group's size (TP, or expert TP for an expert)

    @property
    def replicated(self) -> bool:
        return self.tp_axis is None

    @property
    def valid(self) -> int:
        """How many local rows along tp_axis are real (not vocab padding)."""
        return sum(n for _, _, n in self.pieces)

    @property
    def offset(self) -> int:
        """Start of this rank's shard along tp_axis in the full tensor (stride 1 only)."""
        if self.stride != 1:
            raise ValueError(f"{self.name}: a stride-{self.stride} shard has no single offset: use .pieces")
        return self.pieces[0][0] if self.pieces else 0


def shard_info(name: str, param: torch.Tensor, tp_rank: int, tp_size: int,
               vocab_size: int | None = None, expert_tp: tuple[int, int] | None = None) -> ShardInfo:
    """Where `param` (TP rank `tp_rank` of `tp_size`) sits in its full tensor; a routed expert's
    splits over `expert_tp` = (expert TP rank, size) where given (default: TP's)."""
    local = tuple(param.shape)
    expert = is_routed_expert(name)
    rank, size = expert_tp if expert and expert_tp is not None else (tp_rank, tp_size)
    if not getattr(param, "tensor_model_parallel", False):
        n = local[0] if local else 0
        return ShardInfo(name, None, local, local, ((0, 0, n),), expert=expert, split_rank=rank, split_size=size)
    axis = int(getattr(param, "partition_dim", 0))
    stride = int(getattr(param, "partition_stride", 1))
    n = local[axis]
    full = list(local)
    full[axis] = n * size
    if name.endswith(VOCAB_PADDED) and vocab_size is not None:
        full[axis] = vocab_size
    pieces = split_pieces(full[axis], n, rank, size, stride)
    return ShardInfo(name, axis, local, tuple(full), pieces, stride, expert, rank, size)


def shard_of(full: torch.Tensor, info: ShardInfo) -> torch.Tensor:
    """This rank's local slice of a full unpadded tensor (vocab padding rows are zero)."""
    if info.replicated:
        return full.reshape(info.local_shape)
    out = full.new_zeros(info.local_shape)
    for f, l, n in info.pieces:
        out.narrow(info.tp_axis, l, n).copy_(full.narrow(info.tp_axis, f, n))
    return out


def gather_full(local: torch.Tensor, info: ShardInfo, tp_group, tp_size: int, etp_group=None) -> torch.Tensor:
    """All-gather a TP-split tensor into the full unpadded tensor (every rank of its group gets it):
    over `tp_group`, or for an expert split over an expert TP other than TP over `etp_group`."""
    if info.replicated:
        return local
    axis, size = info.tp_axis, info.split_size
    if size == 1:                          # the whole tensor (a view), minus vocab padding rows
        return local.narrow(axis, 0, info.full_shape[axis])
    group = tp_group
    if size != tp_size:
        if etp_group is None:
            raise ValueError(f"{info.name}: split over expert TP {size}, not TP {tp_size}: pass etp_group")
        group = etp_group
    shards = collectives.all_gather_list(local, group)
    out = local.new_empty(info.full_shape)
    for r, shard in enumerate(shards):
        for f, l, n in split_pieces(info.full_shape[axis], info.local_shape[axis], r, size, info.stride):
            out.narrow(axis, f, n).copy_(shard.narrow(axis, l, n))
    return out


def model_shard_infos(model: torch.nn.Module, tp_rank: int, tp_size: int,
                      vocab_size: int) -> dict[str, ShardInfo]:
    expert_tp = getattr(model, "expert_tp", None)
    return {name: shard_info(name, p, tp_rank, tp_size, vocab_size, expert_tp) for name, p in model.named_parameters()}


def gather_full_params(model: torch.nn.Module, tp_group, tp_rank: int, tp_size: int,
                       vocab_size: int, etp_group=None) -> dict[str, torch.Tensor]:
    """Full unpadded copies of every parameter (collective over the TP group, and over the expert TP
    group for experts split over an expert TP other than TP)."""
    infos = model_shard_infos(model, tp_rank, tp_size, vocab_size)
    return {name: gather_full(p.detach(), infos[name], tp_group, tp_size, etp_group)
            for name, p in model.named_parameters()}


@torch.no_grad()
def load_full_params(model: torch.nn.Module, full: dict[str, torch.Tensor], tp_rank: int, tp_size: int,
                     vocab_size: int) -> None:
    """Copy this rank's shards of full unpadded tensors into the model's parameters (experts by their
    global index: the model's `full_name`, when it has one)."""
    full_name = getattr(model, "full_name", lambda n: n)
    expert_tp = getattr(model, "expert_tp", None)
    for local_name, p in model.named_parameters():
        name = full_name(local_name)
        info = shard_info(name, p, tp_rank, tp_size, vocab_size, expert_tp)
        if name not in full:
            raise KeyError(f"missing parameter {name!r}")
        if tuple(full[name].shape) != info.full_shape:
            raise ValueError(f"{name}: expected full shape {info.full_shape}, got {tuple(full[name].shape)}")
        p.copy_(shard_of(full[name].to(p.dtype), info))
