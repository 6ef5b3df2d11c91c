"""Sliding-window attention's masks for torch SDPA: built once per forward by GPTModelTP, picked per layer by
SDPAttention (planner/window.py has the rules: which layers slide, which masks a forward needs).

The mask travels as megatron's own `attention_mask`: an additive [rows, C, s, s] tensor with one channel per
distinct mask (planner/window.sdpa_mask_layout). Every layer receives that one tensor and takes a view of its
channel, so autograd keeps one storage per forward however many layers save it, and megatron-core's recompute
checkpoints (full layers, selective core_attn) take it as an input like any mask: the recomputed forward sees
the very same masks, with sequence parallelism too (attention sees all s tokens on every TP rank).
"""
from __future__ import annotations

import torch

from zo_megatron.errors import ConfigError


def padded_mask(rows: int, channels: int, s: int, dtype: torch.dtype, device) -> torch.Tensor:
    """A zero [rows, channels, s, s] mask. CUDA's memory-efficient kernel wants every stride but the last a
    multiple of 8 elements, else torch pads the mask in each call (a copy per layer): the rows of a CUDA mask
    are padded once here where s % 8 != 0."""
    device = torch.device(device)
    width = -(-s // 8) * 8 if device.type == "cuda" else s
    return torch.zeros((rows, channels, s, width), dtype=dtype, device=device)[..., :s]


def window_attention_mask(s: int, left: int, channels: int, dtype: torch.dtype, device,
                          segment_ids: torch.Tensor | None = None) -> torch.Tensor:
    """The windowed forward's additive mask [b or 1, channels, s, s] (0 where a token may attend, -inf where not):
    the last channel lets query i see key j iff i - left <= j <= i (megatron-core's get_sliding_window_causal_mask
    for (left, 0)) and, with segment_ids [b, s], both are in the same document; with channels 2 the first is the
    full-attention layers' (j <= i, same document)."""
    idx = torch.arange(s, device=device)
    future = idx[None, :] > idx[:, None]                               # [query, key]
    outside = idx[:, None] - idx[None, :] > left
    rows = 1 if segment_ids is None else segment_ids.size(0)
    mask = padded_mask(rows, channels, s, dtype, device)
    other = None if segment_ids is None else segment_ids[:, None, :, None] != segment_ids[:, None, None, :]
    window = future | outside if other is None else other | (future | outside)
    mask[:, -1:].masked_fill_(window, float("-inf"))
    if channels == 2:
        mask[:, :1].masked_fill_(other | future, float("-inf"))
    return mask


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
