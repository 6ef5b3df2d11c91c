"""How each GPT parameter splits over TP, by name, for tools that work without building the model.

The job reads the split from the parameters themselves (megatron's `partition_dim` and
`partition_stride`, see model/sharding.py); an offline converter has only names and full shapes.
This table is the same rule written down, and tests check it against the built model:

    column-parallel (axis 0): word embeddings and the untied output layer (vocab rows), linear_qkv,
                              linear_fc1 (weights, biases; the MLP's, every expert's, the shared expert's),
                              MLA's linear_q_proj, linear_q_down_proj, linear_q_up_proj, linear_kv_up_proj,
                              the attention sinks (core_attention.softmax_offset, one per head)
    row-parallel    (axis 1): linear_proj.weight, linear_fc2.weight (the same three)
    replicated:               everything else (norms, q/k norms, position embeddings, row-parallel biases,
                              MLA's linear_kv_down_proj)

With SwiGLU or quick GeGLU, linear_fc1 (weight and bias) is [gate; up] and has stride 2: TP rank r holds
[gate_r; up_r], two boxes of the full tensor (`tp_shard_boxes`). The word embedding and output
layer are padded along the vocab to a multiple of make_vocab_size_divisible_by x TP (megatron's
rule); full tensors here are unpadded, a TP shard covers padding rows at the end.
"""
from __future__ import annotations

import math

from zo_megatron.checkpoint.boxes import Box
from zo_megatron.model.sharding import OUTPUT_LAYER, VOCAB_PADDED, WORD_EMBEDDING, split_pieces

__all__ = ["WORD_EMBEDDING", "OUTPUT_LAYER", "EXTRA_STATE_LAYERS", "tp_axis", "partition_stride", "gated_mlp",
           "padded_vocab_size", "local_rows", "tp_shard_boxes", "tp_shard_box"]

# the MLP's, each expert's (mlp.experts.local_experts.{e}.) and the shared expert's (mlp.shared_experts.)
_FC1 = (".linear_fc1.weight", ".linear_fc1.bias")
# multi-latent attention (model/mla.py): the query projections and the key/value up projection are
# column-parallel; the key/value down projection is replicated
_MLA_COLUMN = tuple(f"self_attention.{n}.weight" for n in ("linear_q_proj", "linear_q_down_proj", "linear_q_up_proj",
                                                            "linear_kv_up_proj"))
# attention sinks (softmax_type learnable): one offset per head, split with the heads
_SINKS = ("self_attention.core_attention.softmax_offset",)
_COLUMN = VOCAB_PADDED + ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias") + _FC1 + _MLA_COLUMN \
    + _SINKS
_ROW = ("self_attention.linear_proj.weight", ".linear_fc2.weight")
# megatron-core's local-spec linear layers carry an `_extra_state` entry (None) in state_dict
EXTRA_STATE_LAYERS = ("self_attention.linear_proj", "self_attention.linear_qkv", "mlp.linear_fc1", "mlp.linear_fc2")


def tp_axis(name: str) -> int | None:
    if name.endswith(_COLUMN):
        return 0
    if name.endswith(_ROW):
        return 1
    return None


def partition_stride(name: str, swiglu: bool) -> int:
    """2 for a gated MLP's linear_fc1 (`swiglu` True for SwiGLU or quick GeGLU: [gate; up], each rank
    [gate_r; up_r]); 1 for everything else."""
    return 2 if swiglu and name.endswith(_FC1) else 1


def gated_mlp(meta) -> bool:
    """Whether linear_fc1 is [gate; up] (stride 2): SwiGLU or quick GeGLU, from a checkpoint's recorded
    architecture (a dict) or Megatron-LM's args (a namespace)."""
    get = meta.get if isinstance(meta, dict) else (lambda k: getattr(meta, k, None))
    return bool(get("swiglu") or get("quick_geglu"))


def padded_vocab_size(vocab_size: int, divisible_by: int, tp: int) -> int:
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple


def local_rows(name: str, full_shape: tuple[int, ...], tp: int, padded_vocab: int | None = None) -> int:
    """Size of one TP shard along the split axis (the padded vocab's share for the vocab tensors)."""
    axis = tp_axis(name)
    n = padded_vocab if name.endswith(VOCAB_PADDED) and padded_vocab else full_shape[axis]
    if n % tp:
        raise ValueError(f"{name}: {n} rows do not split over TP={tp}")
    return n // tp


def tp_shard_boxes(name: str, full_shape: tuple[int, ...], tp_rank: int, tp: int,
                   padded_vocab: int | None = None, swiglu: bool = False) -> list[Box]:
    """The boxes of the full (unpadded) tensor that TP rank `tp_rank` holds, in local order.

    Each box's `flat_start` is where it starts in the rank's flattened local shard (whose shape
    is the full shape with `local_rows` along the split axis). Replicated parameters: one box,
    the whole tensor. A rank that holds only vocab padding: no box. SwiGLU's fc1: two boxes."""
    full_shape = tuple(full_shape)
    axis = tp_axis(name)
    if axis is None:
        return [Box((0,) * len(full_shape), full_shape, 0)]
    n = local_rows(name, full_shape, tp, padded_vocab)
    inner = math.prod(full_shape[axis + 1:])
    boxes = []
    for f, l, size in split_pieces(full_shape[axis], n, tp_rank, tp, partition_stride(name, swiglu)):
        offsets, sizes = [0] * len(full_shape), list(full_shape)
        offsets[axis], sizes[axis] = f, size
        # along axis 1 a piece is all rows of a column block: only axis-0 pieces are contiguous
        # in the local shard, and axis-1 (row-parallel) tensors have one piece starting at 0
        boxes.append(Box(tuple(offsets), tuple(sizes), l * inner if axis == 0 else 0))
    return boxes


def tp_shard_box(name: str, full_shape: tuple[int, ...], tp_rank: int, tp: int,
                 padded_vocab: int | None = None) -> Box | None:
    """The one box of a stride-1 parameter that TP rank `tp_rank` holds; None if it holds only
    padding. (A stride-2 tensor, SwiGLU's fc1, needs `tp_shard_boxes(..., swiglu=True)`.)"""
    boxes = tp_shard_boxes(name, full_shape, tp_rank, tp, padded_vocab)
    return boxes[0] if boxes else None
