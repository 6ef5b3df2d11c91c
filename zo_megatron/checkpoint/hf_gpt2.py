"""Hugging Face GPT-2 <-> zo_megatron (megatron-core GPTModel) parameter mapping.

Works on FULL unpadded tensors (see model.sharding), so it is independent of TP. The one
non-trivial piece is the fused QKV: megatron stores rows per head, [q_h | k_h | v_h] for each
head h; HF's Conv1D c_attn stores [in, out] with out = [q_all | k_all | v_all].
"""
from __future__ import annotations

import torch

_PREFIX = "gpt."


def _qkv_megatron_to_hf(t: torch.Tensor, heads: int) -> torch.Tensor:
    rest = t.shape[1:]
    d = t.shape[0] // (3 * heads)
    return t.reshape(heads, 3, d, *rest).transpose(0, 1).reshape(3 * heads * d, *rest)


def _qkv_hf_to_megatron(t: torch.Tensor, heads: int) -> torch.Tensor:
    rest = t.shape[1:]
    d = t.shape[0] // (3 * heads)
    return t.reshape(3, heads, d, *rest).transpose(0, 1).reshape(3 * heads * d, *rest)


def _layer_map(i: int):
    m, h = f"{_PREFIX}decoder.layers.{i}.", f"transformer.h.{i}."
    return [
        (m + "input_layernorm.weight", h + "ln_1.weight", None),
        (m + "input_layernorm.bias", h + "ln_1.bias", None),
        (m + "self_attention.linear_qkv.weight", h + "attn.c_attn.weight", "qkv_w"),
        (m + "self_attention.linear_qkv.bias", h + "attn.c_attn.bias", "qkv_b"),
        (m + "self_attention.linear_proj.weight", h + "attn.c_proj.weight", "t"),
        (m + "self_attention.linear_proj.bias", h + "attn.c_proj.bias", None),
        (m + "pre_mlp_layernorm.weight", h + "ln_2.weight", None),
        (m + "pre_mlp_layernorm.bias", h + "ln_2.bias", None),
        (m + "mlp.linear_fc1.weight", h + "mlp.c_fc.weight", "t"),
        (m + "mlp.linear_fc1.bias", h + "mlp.c_fc.bias", None),
        (m + "mlp.linear_fc2.weight", h + "mlp.c_proj.weight", "t"),
        (m + "mlp.linear_fc2.bias", h + "mlp.c_proj.bias", None),
    ]


def _name_map(num_layers: int):
    rows = [
        (_PREFIX + "embedding.word_embeddings.weight", "transformer.wte.weight", None),
        (_PREFIX + "embedding.position_embeddings.weight", "transformer.wpe.weight", None),
        (_PREFIX + "decoder.final_layernorm.weight", "transformer.ln_f.weight", None),
        (_PREFIX + "decoder.final_layernorm.bias", "transformer.ln_f.bias", None),
    ]
    for i in range(num_layers):
        rows += _layer_map(i)
    return rows


def to_hf(full: dict[str, torch.Tensor], num_layers: int, num_heads: int) -> dict[str, torch.Tensor]:
    """zo_megatron full state -> GPT2LMHeadModel state dict (lm_head tied to wte)."""
    out = {}
    for ours, hf, kind in _name_map(num_layers):
        t = full[ours]
        if kind == "qkv_w":
            t = _qkv_megatron_to_hf(t, num_heads).t()
        elif kind == "qkv_b":
            t = _qkv_megatron_to_hf(t, num_heads)
        elif kind == "t":
            t = t.t()
        out[hf] = t.contiguous()
    out["lm_head.weight"] = out["transformer.wte.weight"]
    return out


def from_hf(hf_sd: dict[str, torch.Tensor], num_layers: int, num_heads: int) -> dict[str, torch.Tensor]:
    """GPT2LMHeadModel state dict -> zo_megatron full state (unpadded)."""
    out = {}
    for ours, hf, kind in _name_map(num_layers):
        t = hf_sd[hf]
        if kind == "qkv_w":
            t = _qkv_hf_to_megatron(t.t(), num_heads)
        elif kind == "qkv_b":
            t = _qkv_hf_to_megatron(t, num_heads)
        elif kind == "t":
            t = t.t()
        out[ours] = t.contiguous()
    return out
