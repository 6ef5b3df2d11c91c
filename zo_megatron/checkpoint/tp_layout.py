"""How each GPT parameter splits over TP, by name, for tools that work without building the model.

The job reads the split from the parameters themselves (megatron's `partition_dim`, see
model/sharding.py); an offline converter has only names and full shapes. This table is the same
rule written down, and tests/test_convert_checkpoint.py checks it against the built model:

    column-parallel (axis 0): word embeddings (vocab rows), linear_qkv, linear_fc1 (weights, biases)
    row-parallel    (axis 1): linear_proj.weight, linear_fc2.weight
    replicated:               everything else (LayerNorms, position embeddings, row-parallel biases)

The word embedding is padded along the vocab to a multiple of make_vocab_size_divisible_by x TP
(megatron's rule); full tensors here are unpadded, a TP shard covers padding rows at the end.
"""
from __future__ import annotations

from zo_megatron.checkpoint.boxes import Box

WORD_EMBEDDING = "embedding.word_embeddings.weight"
_COLUMN = (WORD_EMBEDDING, "self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias",
           "mlp.linear_fc1.weight", "mlp.linear_fc1.bias")
_ROW = ("self_attention.linear_proj.weight", "mlp.linear_fc2.weight")
# megatron-core's local-spec linear layers carry an `_extra_state` entry (None) in state_dict
EXTRA_STATE_LAYERS = ("self_attention.linear_proj", "self_attention.linear_qkv", "mlp.linear_fc1", "mlp.linear_fc2")


def tp_axis(name: str) -> int | None:
    if name.endswith(_COLUMN):
        return 0
    if name.endswith(_ROW):
        return 1
    return None


def padded_vocab_size(vocab_size: int, divisible_by: int, tp: int) -> int:
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple


def local_rows(name: str, full_shape: tuple[int, ...], tp: int, padded_vocab: int | None = None) -> int:
    """Size of one TP shard along the split axis (the padded vocab's share for the embedding)."""
    axis = tp_axis(name)
    n = padded_vocab if name.endswith(WORD_EMBEDDING) and padded_vocab else full_shape[axis]
    if n % tp:
        raise ValueError(f"{name}: {n} rows do not split over TP={tp}")
    return n // tp


def tp_shard_box(name: str, full_shape: tuple[int, ...], tp_rank: int, tp: int,
                 padded_vocab: int | None = None) -> Box | None:
    """The box of the full (unpadded) tensor that TP rank `tp_rank` holds; None if it holds only
    padding. Replicated parameters: the whole tensor."""
    axis = tp_axis(name)
    if axis is None or tp == 1:
        return Box((0,) * len(full_shape), tuple(full_shape), 0)
    n = local_rows(name, full_shape, tp, padded_vocab)
    start = tp_rank * n
    size = min(n, full_shape[axis] - start)
    if size <= 0:
        return None
    offsets = [0] * len(full_shape)
    offsets[axis] = start
    sizes = list(full_shape)
    sizes[axis] = size
    return Box(tuple(offsets), tuple(sizes), 0)
