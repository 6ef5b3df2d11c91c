"""Sliding-window attention (Megatron-LM's --window-size and --window-attn-skip-freq): what the values
mean, which layers slide and which masks a forward builds. Pure Python (no torch): GPTConfig, the job's
flags, checkpoint conversion and the planner all read the rules here, so none can disagree.

Megatron-LM core_v0.16.1, megatron/core/transformer/utils.py:

    get_sliding_window_causal_mask(sq, skv, window_size)      (masked = True)
        mu = triu(ones(sq, skv), diagonal=skv - sq - window_size[0])
        ml = tril(mu, diagonal=skv - sq + window_size[1]);  return ~ml
    is_layer_window_attention(window_size, window_attn_skip_freq, layer_number)   # layer_number 1-indexed
        not window_size: False;  freq None: True;  int N: layer_number % N != 0;  list: bool(freq[layer_number - 1])

So with sq == skv = s a query i attends key j iff i - L <= j <= i + R: (L, 0) is the token itself and the L
before it, L + 1 tokens. transformer_config.py: "-1 is special value meaning infinite window size" (Transformer
Engine's and flash-attn's convention; megatron-core's own mask function does not handle it): (-1, 0) is full
causal attention. --window-attn-skip-freq N: layers N, 2N, ... (1-indexed) attend fully, the rest slide;
a list has one entry per layer, 1 = sliding window, 0 = full attention.

Hugging Face's sliding_window W (Mistral, Qwen2, StarCoder2; transformers' sliding_window_overlay:
kv_idx > q_idx - W) is W tokens including the token itself: --window-size W-1,0.
"""
from __future__ import annotations

from typing import NamedTuple


def _text(value) -> str:
    if isinstance(value, (list, tuple)):
        return ",".join(str(v) for v in value)
    return str(value)


def parse_window_size(text: str) -> list[int] | None:
    """The flag's text as Megatron-LM's tuple_type reads it ("L,R" or "(L,R)"), then normalize_window_size;
    a list (a checkpoint's JSON holds the same), None for full attention. ValueError: one line."""
    try:
        parts = [int(p) for p in str(text).strip().strip("()[]").split(",")]
    except ValueError:
        raise ValueError(f"--window-size {text}: give LEFT,RIGHT as two integers (Megatron-LM's form, e.g. "
                         "4095,0)") from None
    window = normalize_window_size(parts)
    return None if window is None else list(window)


def normalize_window_size(value) -> tuple[int, int] | None:
    """(L, 0) from a window as GPTConfig may be given it (a tuple, a checkpoint's list, the flag's text), None
    for full attention (None, or -1 to the left with no right side); ValueError (one line) for what a causal
    GPT cannot run: a right side other than 0 (a token would see later ones; Transformer Engine silently
    turns it into 0 under a causal mask, megatron-core's local mask breaks), a left below -1, not two numbers."""
    if value is None:
        return None
    if isinstance(value, str):
        return None if parse_window_size(value) is None else tuple(parse_window_size(value))
    parts = list(value) if isinstance(value, (list, tuple)) else [value]
    if not parts or any(isinstance(p, bool) or not isinstance(p, int) for p in parts):
        raise ValueError(f"--window-size {_text(value)}: give LEFT,RIGHT as two integers (e.g. 4095,0)")
    if all(p == -1 for p in parts):
        return None                        # Megatron-LM's "infinite window": full attention
    if len(parts) != 2:
        raise ValueError(f"--window-size {_text(value)}: give LEFT,RIGHT, two integers (e.g. 4095,0: each token "
                         "attends to itself and the 4095 before it)")
    left, right = parts
    if right != 0:
        raise ValueError(f"--window-size {left},{right}: only causal windows are supported (RIGHT 0: a GPT token "
                         f"attends to no later token); use --window-size {left},0")
    if left == -1:
        return None                        # (-1, 0): causal, unlimited to the left
    if left < 0:
        raise ValueError(f"--window-size {left},{right}: LEFT must be >= 0 (the earlier tokens each token sees), or "
                         "-1 for no limit; use e.g. 4095,0")
    return left, right


def normalize_skip_freq(value, window_size, num_layers: int):
    """--window-attn-skip-freq as GPTConfig records it: None (every layer slides), an int N >= 1 (layers N,
    2N, ... attend fully) or a list of one 0/1 per layer (1 slides); ValueError (one line) otherwise, and
    for a value without a window (Megatron-LM would ignore it)."""
    if value is None:
        return None
    if window_size is None:
        raise ValueError(f"--window-attn-skip-freq {value} chooses the sliding-window layers: add "
                         "--window-size (or drop it)")
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 1:
            raise ValueError(f"--window-attn-skip-freq {value}: use N >= 1 (layers N, 2N, ... attend fully, the "
                             "others slide)")
        return value
    freq = list(value) if isinstance(value, (list, tuple)) else None
    if freq is None or len(freq) != num_layers or any(isinstance(x, bool) or x not in (0, 1) for x in freq):
        raise ValueError(f"--window-attn-skip-freq {value}: a list needs one 1 (sliding window) or 0 (full "
                         f"attention) per layer, {num_layers} entries")
    return freq


def is_window_layer(window_size, skip_freq, layer_number: int) -> bool:
    """megatron-core's is_layer_window_attention (layer_number 1-indexed), on normalized values."""
    if not window_size:
        return False
    if skip_freq is None:
        return True
    if isinstance(skip_freq, int):
        return layer_number % skip_freq != 0
    return bool(skip_freq[layer_number - 1])


def window_layers(window_size, skip_freq, num_layers: int) -> list[bool]:
    """Which layers (0-indexed) slide."""
    return [is_window_layer(window_size, skip_freq, i + 1) for i in range(num_layers)]


def window_binds(window_size, seq_length: int) -> bool:
    """A window of L earlier tokens changes something at this sequence length: some token has more than L
    before it. Below that it is full attention, and no mask is built for it."""
    return window_size is not None and window_size[0] < seq_length - 1


class MaskLayout(NamedTuple):
    """The additive [rows, channels, s, s] mask of one forward (sdpa_mask_layout)."""

    batched: bool                 # one row per sample (documents), else one row for all
    channels: int                 # one per distinct mask: [full-attention layers', ] sliding-window layers'
    window_left: int | None       # the window's L; None: per-document attention's mask alone


def sdpa_mask_layout(window_size, skip_freq, num_layers: int, seq_length: int, documents: bool) -> MaskLayout | None:
    """The additive mask GPTModelTP hands SDPA in one forward (None: none, every layer is_causal).

    Without a window that binds: per-document attention's [b, 1, s, s] (documents) or none. With one:
    [b or 1, C, s, s], one channel per distinct mask, each shared by the layers that use it: the last is the
    sliding-window layers' (causal, within the window, and with documents in the same document); the first,
    when there are documents and full-attention layers, theirs (causal, same document). Full-attention layers
    without documents get no mask (is_causal, as without a window)."""
    layers = window_layers(window_size, skip_freq, num_layers)
    if not (window_binds(window_size, seq_length) and any(layers)):
        return MaskLayout(True, 1, None) if documents else None
    return MaskLayout(documents, 2 if documents and not all(layers) else 1, window_size[0])


def describe_window(window_size, skip_freq, num_layers: int, short: bool = False) -> str:
    """'sliding window 4095,0 (4096 tokens) on 24 of 32 layers' ('window(4095,0, 24 of 32 layers)' short, the
    architecture name's part); '' without one."""
    if window_size is None:
        return ""
    n = sum(window_layers(window_size, skip_freq, num_layers))
    left = window_size[0]
    if short:
        return f"window({left},0" + (f", {n} of {num_layers} layers" if n != num_layers else "") + ")"
    where = "every layer" if n == num_layers else f"{n} of {num_layers} layers"
    return f"sliding window {left},0 ({left + 1} tokens) on {where}"


def from_hf_window(tokens: int, layers, num_layers: int) -> tuple[list[int], int | list | None]:
    """(window_size, window_attn_skip_freq) of a Hugging Face sliding_window of `tokens` on `layers` (0-indexed):
    W tokens with the token itself is --window-size W-1,0; every layer: no skip freq, else the list form
    (1 = window), which expresses any set of layers. ValueError for a window of no token."""
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
        raise ValueError(f"sliding_window={tokens!r}: a window must hold at least the token itself (>= 1)")
    layers = set(layers)
    freq = None if layers == set(range(num_layers)) else [int(i in layers) for i in range(num_layers)]
    return [tokens - 1, 0], freq


def hf_window(window_size, skip_freq, num_layers: int) -> dict | None:
    """The inverse: {"tokens": W, "layers": [0-indexed sliding layers]} as Hugging Face's configs say it, None
    where no layer slides."""
    window = normalize_window_size(window_size)
    layers = [i for i, slides in enumerate(window_layers(window, skip_freq, num_layers)) if slides]
    return {"tokens": window[0] + 1, "layers": layers} if layers else None
