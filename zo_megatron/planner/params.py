"""Parameter counts of the model, total and per TP rank (Megatron's layout), for every architecture
the planner models: GPT-2 (learned positions, LayerNorm, GELU, biases, tied embeddings) and the
Llama family through GPTConfig's fields (rope, RMSNorm, SwiGLU, GQA, untied output layer, no
biases / qkv bias only, qk LayerNorm).

One list of parameters (`layer_parameters`, `model_parameters`) in megatron-core's registration
order feeds both the counts here and the bucket walk of the memory model.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Architecture:
    """The shape-defining choices beyond layers/hidden/heads, named as GPTConfig's fields."""

    position_embedding_type: str = "learned_absolute"   # "learned_absolute" | "rope" | "yarn"
    rotary_percent: float = 1.0
    normalization: str = "LayerNorm"                     # "LayerNorm" | "RMSNorm"
    swiglu: bool = False
    num_query_groups: int | None = None                  # None: = heads (multi-head attention)
    kv_channels: int | None = None                       # None: hidden // heads
    untie_embeddings_and_output_weights: bool = False
    add_bias_linear: bool = True
    add_qkv_bias: bool = False
    qk_layernorm: bool = False


GPT2 = Architecture()


def default_ffn_size(hidden_size: int, swiglu: bool) -> int:
    """Megatron-LM's --ffn-hidden-size default: 4h, or int(4h * 2/3 / 64) * 64 with --swiglu."""
    return int(4 * hidden_size * 2 / 3 / 64) * 64 if swiglu else 4 * hidden_size


def pad_vocab_size(vocab_size: int, tensor_parallel: int = 1, divisible_by: int = 128) -> int:
    """Megatron's padding: round V up to a multiple of divisible_by x TP."""
    multiple = divisible_by * tensor_parallel
    return ((vocab_size + multiple - 1) // multiple) * multiple


def layer_parameters(hidden_size: int, ffn_size: int, num_attention_heads: int,
                     arch: Architecture = GPT2) -> list[tuple[str, int, bool]]:
    """(name, numel, split over TP) of one transformer layer, in megatron-core's registration order
    (input norm, linear_proj, linear_qkv, q/k norms, pre-MLP norm, fc1, fc2).

    linear_qkv has (heads + 2G)·head_dim output rows (GQA's k/v are G heads each); fc1 has 2f rows
    with SwiGLU ([gate; up]); norms have a bias only as LayerNorm; linear biases with
    add_bias_linear, the qkv bias also with add_qkv_bias; q/k norms act on one head (head_dim).
    Biases of row-parallel layers (proj, fc2) are replicated over TP."""
    h, f, a = hidden_size, ffn_size, num_attention_heads
    d = arch.kv_channels or h // a
    g = arch.num_query_groups or a
    qkv_out = (a + 2 * g) * d
    fc1_out = 2 * f if arch.swiglu else f
    norm_bias = arch.normalization == "LayerNorm"
    bias = arch.add_bias_linear

    def norm(name: str, n: int) -> list[tuple[str, int, bool]]:
        return [(name + ".weight", n, False)] + ([(name + ".bias", n, False)] if norm_bias else [])

    rows = norm("input_layernorm", h)
    rows += [("self_attention.linear_proj.weight", h * a * d, True)]
    rows += [("self_attention.linear_proj.bias", h, False)] if bias else []
    rows += [("self_attention.linear_qkv.weight", qkv_out * h, True)]
    rows += [("self_attention.linear_qkv.bias", qkv_out, True)] if bias or arch.add_qkv_bias else []
    if arch.qk_layernorm:
        rows += norm("self_attention.q_layernorm", d) + norm("self_attention.k_layernorm", d)
    rows += norm("pre_mlp_layernorm", h)
    rows += [("mlp.linear_fc1.weight", fc1_out * h, True)]
    rows += [("mlp.linear_fc1.bias", fc1_out, True)] if bias else []
    rows += [("mlp.linear_fc2.weight", h * f, True)]
    rows += [("mlp.linear_fc2.bias", h, False)] if bias else []
    return rows


def model_parameters(num_layers: int, hidden_size: int, ffn_size: int, num_attention_heads: int,
                     vocab_size_padded: int, max_position_embeddings: int,
                     arch: Architecture = GPT2) -> list[tuple[str, int, bool]]:
    """(name, numel, split over TP) of the whole GPTModel in registration order: embeddings, the
    layers, the final norm, and the output layer when it is untied (vocab-padded like the embedding;
    tied, the word embedding is the output layer). No position table with rope."""
    h = hidden_size
    rows = [("embedding.word_embeddings.weight", vocab_size_padded * h, True)]
    if arch.position_embedding_type == "learned_absolute":
        rows.append(("embedding.position_embeddings.weight", max_position_embeddings * h, False))
    layer = layer_parameters(h, ffn_size, num_attention_heads, arch)
    for i in range(num_layers):
        rows += [(f"decoder.layers.{i}.{n}", k, s) for n, k, s in layer]
    rows.append(("decoder.final_layernorm.weight", h, False))
    if arch.normalization == "LayerNorm":
        rows.append(("decoder.final_layernorm.bias", h, False))
    if arch.untie_embeddings_and_output_weights:
        rows.append(("output_layer.weight", vocab_size_padded * h, True))
    return rows


def count_params(num_layers: int, hidden_size: int, vocab_size_padded: int,
                 max_position_embeddings: int, tensor_parallel: int = 1,
                 ffn_hidden_size: int | None = None, *, num_attention_heads: int | None = None,
                 arch: Architecture = GPT2) -> dict[str, int]:
    """Parameters of the model, total and on one TP rank (Megatron layout).

    GPT-2 (the default `arch`), split over t: word embedding (vocab rows), qkv weight 3h x h + bias
    3h (column parallel), proj weight h x h (row parallel), fc1 f x h + bias f (column), fc2 h x f
    (row); f = ffn size (4h). Replicated: position embedding S x h, proj bias h, fc2 bias h, two
    LayerNorms 2h each, final LN 2h. Other architectures: see `layer_parameters`
    (num_attention_heads is needed only with GQA or kv_channels)."""
    L, h, V, S, t = num_layers, hidden_size, vocab_size_padded, max_position_embeddings, tensor_parallel
    f = default_ffn_size(h, arch.swiglu) if ffn_hidden_size is None else ffn_hidden_size
    a = num_attention_heads
    if a is None:
        if arch.num_query_groups is not None or arch.kv_channels is not None:
            raise ValueError("count_params needs num_attention_heads with num_query_groups or kv_channels")
        a = 1                                       # MHA with head_dim h: the counts do not depend on a
    if h % t or V % t or f % t:
        raise ValueError(f"hidden_size {h}, ffn size {f} and padded vocab {V} must be divisible by TP {t}")
    layer = layer_parameters(h, f, a, arch)
    layer_split = sum(n for _, n, split in layer if split)
    layer_rep = sum(n for _, n, split in layer if not split)
    if layer_split % t:
        raise ValueError(f"the TP-split parameters of a layer ({layer_split}) are not divisible by TP {t}")
    rows = model_parameters(0, h, f, a, V, S, arch)          # everything outside the layers
    total = sum(n for _, n, _ in rows) + L * (layer_split + layer_rep)
    replicated = sum(n for _, n, split in rows if not split) + L * layer_rep
    per_rank = sum(n // t for _, n, split in rows if split) + L * layer_split // t + replicated
    return {"total": total, "per_tp_rank": per_rank, "replicated_per_tp_rank": replicated}
