"""Hugging Face GPT-2 <-> zo_megatron (megatron-core GPTModel) parameter mapping.

Works on FULL unpadded tensors (see model.sharding), so it is independent of TP. The one
non-trivial piece is the fused QKV: megatron stores rows per head, [q_h | k_h | v_h] for each
head h; HF's Conv1D c_attn stores [in, out] with out = [q_all | k_all | v_all].
"""
from __future__ import annotations

import torch

from zo_megatron.checkpoint.arch import full_meta
from zo_megatron.checkpoint.hf.family import HFFamily, read_hf_config
from zo_megatron.errors import UserError
from zo_megatron.model.config import YARN_FIELDS

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


# ---- the model's shape, both ways (transformers' GPT2Config)

# transformers' activation names -> gelu_approximate: GPT-2's tanh approximation (two names of one
# function), and "gelu", torch's erf GELU (Megatron-LM's unfused GELU)
_GELUS = {"gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu": "none"}


def hf_config(meta: dict, *, dtype: str = "float32", hidden_dropout: float = 0.0, attention_dropout: float = 0.0,
              bos_token_id=None, eos_token_id=None):
    """A GPT2Config for a zo_megatron model (meta: num_layers, hidden_size, ...)."""
    from transformers import GPT2Config

    ffn = meta["ffn_hidden_size"]
    return GPT2Config(
        vocab_size=meta["vocab_size"], n_positions=meta["max_position_embeddings"], n_embd=meta["hidden_size"],
        n_layer=meta["num_layers"], n_head=meta["num_attention_heads"],
        n_inner=None if ffn == 4 * meta["hidden_size"] else ffn,
        activation_function="gelu_new" if meta.get("gelu_approximate", "tanh") == "tanh" else "gelu",
        resid_pdrop=hidden_dropout, embd_pdrop=hidden_dropout, attn_pdrop=attention_dropout,
        layer_norm_epsilon=meta.get("layernorm_epsilon", 1e-5), tie_word_embeddings=True,
        architectures=["GPT2LMHeadModel"],
        bos_token_id=bos_token_id if bos_token_id is not None else 50256 if meta["vocab_size"] > 50256 else None,
        eos_token_id=eos_token_id if eos_token_id is not None else 50256 if meta["vocab_size"] > 50256 else None,
        dtype=dtype)


def meta_from_hf_config(cfg, where: str) -> dict:
    """zo_megatron's model meta from a GPT2Config; refuses anything that is not GPT-2-shaped,
    naming the field."""
    def refuse(field, value, why):
        raise UserError(f"{where}: {field}={value!r}: {why}; a GPT2LMHeadModel converts only with GPT-2's own architecture")

    if getattr(cfg, "model_type", None) != "gpt2":
        refuse("model_type", getattr(cfg, "model_type", None), "not a GPT-2 model (learned positions, LayerNorm, "
               "tanh GELU, tied embeddings)")
    if cfg.activation_function not in _GELUS:
        refuse("activation_function", cfg.activation_function, "the MLP is GPT-2's tanh GELU ('gelu_new') or the erf "
               "GELU ('gelu')")
    if not getattr(cfg, "tie_word_embeddings", True):
        refuse("tie_word_embeddings", False, "untied input and output embeddings")
    for field, want in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                        ("add_cross_attention", False)):
        if getattr(cfg, field, want) != want:
            refuse(field, getattr(cfg, field), f"the attention differs from GPT-2's ({field}={want})")
    if cfg.n_embd % cfg.n_head:
        refuse("n_embd", cfg.n_embd, f"not divisible by n_head={cfg.n_head}")
    return dict(num_layers=cfg.n_layer, hidden_size=cfg.n_embd, num_attention_heads=cfg.n_head,
                ffn_hidden_size=cfg.n_inner or 4 * cfg.n_embd, max_position_embeddings=cfg.n_positions,
                vocab_size=cfg.vocab_size, layernorm_epsilon=float(cfg.layer_norm_epsilon),
                gelu_approximate=_GELUS[cfg.activation_function])


# architecture fields a GPT2Config holds, or that do not apply to it (any value)
_SHAPE = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "vocab_size", "max_position_embeddings")
_FREE = ("layernorm_epsilon", "gelu_approximate", "make_vocab_size_divisible_by", "rotary_base", "rope_scaling_factor",
         *YARN_FIELDS)


class GPT2Family(HFFamily):
    architecture, model_type = "GPT2LMHeadModel", "gpt2"

    def read_config(self, cfg_json: dict, where: str):
        from transformers import GPT2Config

        return read_hf_config(GPT2Config, cfg_json, where)

    def meta_from_config(self, cfg, where: str) -> tuple[dict, dict]:
        return full_meta(meta_from_hf_config(cfg, where)), {"hidden_dropout": cfg.resid_pdrop, "attention_dropout": cfg.attn_pdrop}

    def read_state(self, input_dir: str, cfg, meta: dict) -> dict[str, torch.Tensor]:
        # transformers' own loader: it also reads the original GPT-2 files' legacy names (no
        # "transformer." prefix, attention-mask buffers); safetensors, or .bin with weights_only
        from transformers import GPT2LMHeadModel

        try:
            model = GPT2LMHeadModel.from_pretrained(input_dir, local_files_only=True, dtype=torch.float32,
                                                    use_safetensors=None)
        except (OSError, ValueError, RuntimeError) as exc:
            raise UserError(f"{input_dir}: the weights cannot be loaded ({type(exc).__name__}: "
                            f"{str(exc).splitlines()[0][:200] if str(exc) else ''})") from None
        sd = {k: v.detach() for k, v in model.state_dict().items()}
        return from_hf(sd, meta["num_layers"], meta["num_attention_heads"])

    def why_not(self, meta: dict) -> str | None:
        meta = full_meta(meta)
        # the same shape as GPT-2 (its head dim compared below: GPT2Config has no head_dim)
        gpt2 = full_meta({**{k: meta[k] for k in _SHAPE + _FREE}, "kv_channels": meta["kv_channels"]})
        for key, want in gpt2.items():
            if meta[key] != want:
                return f"GPT-2 has {key}={want!r} (the model has {meta[key]!r})"
        h, heads, d = meta["hidden_size"], meta["num_attention_heads"], meta["kv_channels"]
        if h % heads or d != h // heads:
            return (f"GPT2LMHeadModel has no head_dim: its head dim is n_embd / n_head = {h} / {heads}"
                    f"{' (not whole)' if h % heads else f' = {h // heads}'}, the model's is {d} (--kv-channels)")
        return None

    def to_hf_state(self, weights: dict[str, torch.Tensor], meta: dict) -> dict[str, torch.Tensor]:
        sd = to_hf(weights, meta["num_layers"], meta["num_attention_heads"])
        sd.pop("lm_head.weight")                # tied to transformer.wte.weight: HF re-ties it on load
        return sd

    def hf_config(self, meta: dict, *, dtype: str, args: dict, bos_token_id, eos_token_id, window: dict | None = None):
        assert window is None, "convert.to_hf writes a window only with the family it was read from"
        return hf_config(meta, dtype=dtype, hidden_dropout=float(args.get("hidden_dropout") or 0.0),
                         attention_dropout=float(args.get("attention_dropout") or 0.0),
                         bos_token_id=bos_token_id, eos_token_id=eos_token_id)


FAMILY = GPT2Family()
