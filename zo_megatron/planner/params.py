"""Parameter counts of the model, total and per TP rank (Megatron's layout)."""
from __future__ import annotations


def pad_vocab_size(vocab_size: int, tensor_parallel: int = 1, divisible_by: int = 128) -> int:
    """Megatron's padding: round V up to a multiple of divisible_by x TP."""
    multiple = divisible_by * tensor_parallel
    return ((vocab_size + multiple - 1) // multiple) * multiple


def count_params(num_layers: int, hidden_size: int, vocab_size_padded: int,
                 max_position_embeddings: int, tensor_parallel: int = 1,
                 ffn_hidden_size: int | None = None) -> dict[str, int]:
    """Parameters of the GPT-2-style model, total and on one TP rank (Megatron layout).

    Split over t: word embedding (vocab rows), qkv weight 3h x h + bias 3h (column parallel),
    proj weight h x h (row parallel), fc1 f x h + bias f (column), fc2 h x f (row); f = ffn size (4h).
    Replicated: position embedding S x h, proj bias h, fc2 bias h, two LayerNorms 2h each, final LN 2h.
    """
    L, h, V, S, t = num_layers, hidden_size, vocab_size_padded, max_position_embeddings, tensor_parallel
    f = 4 * h if ffn_hidden_size is None else ffn_hidden_size
    if h % t or V % t or f % t:
        raise ValueError(f"hidden_size {h}, ffn size {f} and padded vocab {V} must be divisible by TP {t}")
    split_per_layer = 3 * h * h + 3 * h + h * h + f * h + f + h * f  # 12h² + 7h at f = 4h
    rep_per_layer = 2 * h + h + 2 * h + h  # LN1, proj bias, LN2, fc2 bias = 6h
    total = V * h + S * h + L * (split_per_layer + rep_per_layer) + 2 * h
    replicated = S * h + L * rep_per_layer + 2 * h
    per_rank = V * h // t + L * (split_per_layer // t) + replicated
    return {"total": total, "per_tp_rank": per_rank, "replicated_per_tp_rank": replicated}

