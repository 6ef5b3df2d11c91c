"""Sliding-window attention's masks for torch SDPA: built once per forward by GPTModelTP, picked per layer by
SDPAttention (planner/window.py has the rules: which layers slide, which masks a forward needs).

The mask travels as megatron's own `attention_mask`: an additive [rows, C, s, s] tensor with one channel per
distinct mask (planner/window.sdpa_mask_layout). Every layer receives that one tensor and takes a view of its
channel, so autograd keeps one storage per forward however many layers save it, and megatron-core's recompute
checkpoints (full layers, selective core_attn) take it as an input like any mask: the recomputed forward sees
the very same masks, with sequence parallelism too (attention sees all s tokens on every TP rank).

Attention sinks (softmax_type off-by-one / learnable; model/sinks.py) run SDPA on s + 1 positions: a dummy query
and the sink key at position 0. Their masks are built in that layout once per forward (sink=True): [rows, C, s + 1,
s + 1], row 0 (the dummy query, whose output is dropped) sees the sink alone, column 0 (the sink) is seen by every
query, and [..., 1:, 1:] is the mask of the s real tokens -- so no layer copies a mask to add the sink.
"""
from __future__ import annotations

import torch

from zo_megatron.errors import ConfigError


def padded_mask(rows: int, channels: int, s: int, dtype: torch.dtype, device, sink: bool = False) -> torch.Tensor:
    """A zero [rows, channels, s, s] mask. CUDA's memory-efficient kernel wants every stride but the last a
    multiple of 8 elements, else torch pads the mask in each call (a copy per layer): the rows of a CUDA mask
    are padded once here where s % 8 != 0.

    sink: the attention-sink layout [rows, channels, s + 1, s + 1] (module docstring): zero but for row 0, which
    sees column 0 only; fill the real tokens' mask into mask_body(mask, True)."""
    device = torch.device(device)
    n = s + 1 if sink else s
    width = -(-n // 8) * 8 if device.type == "cuda" else n
    mask = torch.zeros((rows, channels, n, width), dtype=dtype, device=device)[..., :n]
    if sink:
        # the dummy query's row as is_causal has it: the sink alone (its output is dropped and gets no gradient,
        # whatever it sees; but a row of -inf only would be NaN, which the kernels' backward would spread)
        mask[:, :, 0, 1:] = float("-inf")
    return mask


def mask_body(mask: torch.Tensor, sink: bool) -> torch.Tensor:
    """The real tokens' [.., s, s] part of a mask from padded_mask (a view: filling it fills the mask)."""
    return mask[..., 1:, 1:] if sink else mask


def sink_layout(mask: torch.Tensor | None, s: int) -> torch.Tensor | None:
    """An additive [rows, C, s, s] mask in the attention-sink layout: as it is where it already is (the model's
    masks, built so once per forward), else a copy (a caller's own mask, e.g. megatron's convention's bool one
    converted by attention.additive_mask: one copy per call)."""
    if mask is None or mask.size(-1) == s + 1:
        return mask
    if tuple(mask.shape[-2:]) != (s, s):
        raise ConfigError(f"an attention mask for {s} tokens must be [.., {s}, {s}] (or [.., {s + 1}, {s + 1}] in the "
                          f"attention-sink layout), got {list(mask.shape)}")
    out = padded_mask(mask.size(0), mask.size(1), s, mask.dtype, mask.device, sink=True)
    mask_body(out, True).copy_(mask)
    return out


def window_attention_mask(s: int, left: int, channels: int, dtype: torch.dtype, device,
                          segment_ids: torch.Tensor | None = None, sink: bool = False) -> torch.Tensor:
    """The windowed forward's additive mask [b or 1, channels, s, s] (0 where a token may attend, -inf where not):
    the last channel lets query i see key j iff i - left <= j <= i (megatron-core's get_sliding_window_causal_mask
    for (left, 0)) and, with segment_ids [b, s], both are in the same document; with channels 2 the first is the
    full-attention layers' (j <= i, same document). sink: in the attention-sink layout, [.., s + 1, s + 1]."""
    idx = torch.arange(s, device=device)
    future = idx[None, :] > idx[:, None]                               # [query, key]
    outside = idx[:, None] - idx[None, :] > left
    rows = 1 if segment_ids is None else segment_ids.size(0)
    full = padded_mask(rows, channels, s, dtype, device, sink)
    mask = mask_body(full, sink)
    other = None if segment_ids is None else segment_ids[:, None, :, None] != segment_ids[:, None, None, :]
    window = future | outside if other is None else other | (future | outside)
    mask[:, -1:].masked_fill_(window, float("-inf"))
    if channels == 2:
        mask[:, :1].masked_fill_(other | future, float("-inf"))
    return full


def layer_mask(attention_mask: torch.Tensor | None, window_layer: bool) -> torch.Tensor | None:
    """This layer's view of a windowed forward's mask (window_attention_mask): a sliding-window layer's is the
    last channel; a full-attention layer's the first where there are two (documents), else none (is_causal)."""
    if window_layer:
        if attention_mask is None:
            raise ConfigError("a sliding-window attention layer got no mask: GPTModelTP.forward builds it (calling "
                              "megatron's GPTModel directly needs planner/window.sdpa_mask_layout's mask)")
        return attention_mask[:, -1:]
    if attention_mask is None or attention_mask.size(1) == 1:
        return None
    return attention_mask[:, :1]
