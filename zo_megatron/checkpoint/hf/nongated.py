"""Hugging Face decoders with LayerNorm and a non-gated MLP <-> zo_megatron: Nemotron (Nemotron-4,
Minitron, Nemotron-Mini) and StarCoder2. What differs is data (`VARIANTS`): the MLP's names and
activation, the norm's scale, the config's field names, a sliding window.

    HF (model.layers.{i}.)                     megatron-core (decoder.layers.{i}.)
    input_layernorm                         -> input_layernorm        weight and bias
    self_attn.q_proj, k_proj, v_proj        -> self_attention.linear_qkv   grouped per query group (llama.py's)
    self_attn.o_proj                        -> self_attention.linear_proj
    post_attention_layernorm                -> pre_mlp_layernorm
    mlp.up_proj / mlp.c_fc                  -> mlp.linear_fc1          no gate
    mlp.down_proj / mlp.c_proj              -> mlp.linear_fc2
    model.embed_tokens / model.norm / lm_head -> embedding.word_embeddings / decoder.final_layernorm / output_layer

Nemotron: `--squared-relu --apply-layernorm-1p --rotary-percent 0.5 --disable-bias-linear`. Its
LayerNorm1P scales by 1 + weight as megatron-core's zero-centred gamma (--apply-layernorm-1p) does, so
the weights move as they are (`zero_centred_norms`: to-hf hands this family zero-centred weights);
`partial_rotary_factor` is --rotary-percent: both rotate the first head_dim x factor channels of each
head with rotate_half (megatron's non-interleaved RoPE) and the frequencies of that many channels.
StarCoder2: GPT-2's tanh GELU (`gelu_pytorch_tanh`; Megatron-LM's default with biases), plain
LayerNorm, biases on every linear layer (`use_bias`), RoPE on the whole head, and a sliding window
on every layer (recorded as Mistral's: the model trains exactly at sequences up to it).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from zo_megatron.checkpoint.arch import full_meta, head_dim, query_groups
from zo_megatron.checkpoint.hf.family import VariantFamily, read_checked_state_dict
from zo_megatron.checkpoint.hf.llama import _pack_qkv, _reads_rope_parameters, _rope_params, _unpack_qkv, sliding_layers
from zo_megatron.errors import UserError
from zo_megatron.model.config import rotary_base

_OURS = "gpt."
_NORMS = (("input_layernorm", "input_layernorm"), ("pre_mlp_layernorm", "post_attention_layernorm"))
# HF activation names -> our MLP fields
_ACTIVATIONS = {"relu2": {"squared_relu": True}, "gelu_pytorch_tanh": {"gelu_approximate": "tanh"},
                "gelu_new": {"gelu_approximate": "tanh"}, "gelu": {"gelu_approximate": "none"}}


@dataclass(frozen=True)
class Variant:
    architecture: str
    model_type: str
    config_class: str
    mlp: tuple[str, str]                    # HF's fc1 and fc2 module names
    activations: tuple[str, ...]            # the hidden_act values it takes; the first is written for ours
    zero_centred: bool                      # its LayerNorm scales by 1 + weight
    eps_field: str                          # the config's LayerNorm epsilon field
    bias_fields: tuple[str, ...]            # the config's bias fields (all True or all False)
    partial_rotary: bool                    # partial_rotary_factor (--rotary-percent < 1)
    head_dim_field: bool                    # its config declares head_dim (else written when not hidden / heads)
    dropout_fields: tuple[str, ...] = ()    # the config's residual/embedding dropouts: our hidden_dropout
    window: str | None = None               # llama.sliding_layers' kind: "every_layer" (StarCoder2)


VARIANTS = (
    Variant("NemotronForCausalLM", "nemotron", "NemotronConfig", ("up_proj", "down_proj"), ("relu2",),
            zero_centred=True, eps_field="norm_eps", bias_fields=("attention_bias", "mlp_bias"), partial_rotary=True,
            head_dim_field=True),
    Variant("Starcoder2ForCausalLM", "starcoder2", "Starcoder2Config", ("c_fc", "c_proj"),
            ("gelu_pytorch_tanh", "gelu_new", "gelu"), zero_centred=False, eps_field="norm_epsilon",
            bias_fields=("use_bias",), partial_rotary=False, head_dim_field=False,
            dropout_fields=("residual_dropout", "embedding_dropout"), window="every_layer"),
)


def _activation_name(v: Variant, meta: dict) -> str | None:
    """The variant's hidden_act for the model's MLP; None if it has none for it."""
    if meta.get("swiglu"):
        return None
    ours = {"squared_relu": True} if meta.get("squared_relu") else {"gelu_approximate": meta.get("gelu_approximate")}
    return next((a for a in v.activations if _ACTIVATIONS[a] == ours), None)


def _pairs(v: Variant, i: int, bias: bool) -> list[tuple[str, str]]:
    """(ours, HF) for the one-to-one tensors of layer i."""
    m, h = f"{_OURS}decoder.layers.{i}.", f"model.layers.{i}."
    out = [(m + o + "." + p, h + t + "." + p) for o, t in _NORMS for p in ("weight", "bias")]
    linears = (("self_attention.linear_proj", "self_attn.o_proj"), ("mlp.linear_fc1", "mlp." + v.mlp[0]),
               ("mlp.linear_fc2", "mlp." + v.mlp[1]))
    kinds = ("weight", "bias") if bias else ("weight",)
    out += [(m + o + "." + p, h + t + "." + p) for o, t in linears for p in kinds]
    return out


def _top(meta: dict) -> list[tuple[str, str]]:
    out = [(_OURS + "embedding.word_embeddings.weight", "model.embed_tokens.weight"),
           (_OURS + "decoder.final_layernorm.weight", "model.norm.weight"),
           (_OURS + "decoder.final_layernorm.bias", "model.norm.bias")]
    if meta.get("untie_embeddings_and_output_weights"):
        out.append((_OURS + "output_layer.weight", "lm_head.weight"))
    return out


def hf_shapes(v: Variant, meta: dict) -> dict[str, tuple[int, ...]]:
    h, f, vocab, d = meta["hidden_size"], meta["ffn_hidden_size"], meta["vocab_size"], head_dim(meta)
    q, kv = meta["num_attention_heads"] * d, query_groups(meta) * d
    out = {"model.embed_tokens.weight": (vocab, h), "model.norm.weight": (h,), "model.norm.bias": (h,)}
    if meta.get("untie_embeddings_and_output_weights"):
        out["lm_head.weight"] = (vocab, h)
    for i in range(meta["num_layers"]):
        m = f"model.layers.{i}."
        for _, norm in _NORMS:
            out[m + norm + ".weight"] = out[m + norm + ".bias"] = (h,)
        for name, shape in (("self_attn.q_proj", (q, h)), ("self_attn.k_proj", (kv, h)), ("self_attn.v_proj", (kv, h)),
                            ("self_attn.o_proj", (h, q)), ("mlp." + v.mlp[0], (f, h)), ("mlp." + v.mlp[1], (h, f))):
            out[m + name + ".weight"] = shape
            if meta["add_bias_linear"]:
                out[m + name + ".bias"] = shape[:1]
    return out


def from_hf(v: Variant, sd: dict[str, torch.Tensor], meta: dict) -> dict[str, torch.Tensor]:
    heads, groups, bias = meta["num_attention_heads"], query_groups(meta), meta["add_bias_linear"]
    out = {ours: sd[hf] for ours, hf in _top(meta)}
    for i in range(meta["num_layers"]):
        out.update({ours: sd[hf] for ours, hf in _pairs(v, i, bias)})
        h = f"model.layers.{i}.self_attn."
        for kind in ("weight", "bias") if bias else ("weight",):
            out[f"{_OURS}decoder.layers.{i}.self_attention.linear_qkv.{kind}"] = _pack_qkv(
                *(sd[h + f"{p}_proj.{kind}"] for p in "qkv"), heads, groups)
    return {k: t.contiguous() for k, t in out.items()}


def to_hf(v: Variant, weights: dict[str, torch.Tensor], meta: dict) -> dict[str, torch.Tensor]:
    heads, groups, bias = meta["num_attention_heads"], query_groups(meta), meta["add_bias_linear"]
    out = {hf: weights[ours] for ours, hf in _top(meta)}
    for i in range(meta["num_layers"]):
        out.update({hf: weights[ours] for ours, hf in _pairs(v, i, bias)})
        h = f"model.layers.{i}.self_attn."
        for kind in ("weight", "bias") if bias else ("weight",):
            q, k, val = _unpack_qkv(weights[f"{_OURS}decoder.layers.{i}.self_attention.linear_qkv.{kind}"], heads,
                                    groups, head_dim(meta))
            out.update({h + f"q_proj.{kind}": q, h + f"k_proj.{kind}": k, h + f"v_proj.{kind}": val})
    return {k: t.clone(memory_format=torch.contiguous_format) for k, t in out.items()}


def _rope(cfg, where: str) -> tuple[int | float, float]:
    """(rotary base, rotary percent) from either config schema (llama._rope_params); one line for what
    megatron-core's RoPE cannot express here (scaling: these families' models are unscaled)."""
    p = _rope_params(cfg)
    kind = "per layer type" if "per_layer_type" in p else p["rope_type"]
    if kind != "default":
        raise UserError(f"{where}: rope_type={kind!r}: megatron-core's RoPE cannot express it here (only 'default')")
    partial = p.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", None) or 1.0)
    return rotary_base(p.get("rope_theta", 10000.0)), float(partial)


def _rope_schemas(v: Variant, meta: dict) -> tuple[dict, dict]:
    """The rope as transformers 5's `rope_parameters` and as 4.x's keys (partial_rotary_factor where the
    variant has it)."""
    theta = float(meta["rotary_base"])
    partial = {"partial_rotary_factor": float(meta["rotary_percent"])} if v.partial_rotary else {}
    v5 = {"rope_parameters": {"rope_type": "default", "rope_theta": theta, **partial}}
    return v5, {"rope_theta": theta, **partial}


class NonGatedFamily(VariantFamily):
    def __init__(self, variant: Variant):
        super().__init__(variant)
        self.zero_centred_norms = variant.zero_centred

    def meta_from_config(self, cfg, where: str) -> tuple[dict, dict]:
        v = self.variant
        if cfg.hidden_act not in v.activations:
            raise UserError(f"{where}: hidden_act={cfg.hidden_act!r}: {self.architecture}'s MLP converts with "
                            f"{' or '.join(map(repr, v.activations))} (megatron-core's activations)")
        biases = {f: bool(getattr(cfg, f)) for f in v.bias_fields}
        if len(set(biases.values())) > 1:
            raise UserError(f"{where}: {', '.join(f'{k}={x}' for k, x in biases.items())}: megatron-core gives "
                            "biases to all linear layers (--add-bias-linear) or to none")
        heads = cfg.num_attention_heads
        groups = cfg.num_key_value_heads or heads
        if heads % groups:
            raise UserError(f"{where}: num_key_value_heads={groups}: does not divide num_attention_heads={heads}")
        base, percent = _rope(cfg, where)
        if percent != 1.0 and not v.partial_rotary:
            raise UserError(f"{where}: partial_rotary_factor={percent}: {self.architecture} rotates the whole head")
        meta = dict(num_layers=cfg.num_hidden_layers, hidden_size=cfg.hidden_size, num_attention_heads=heads,
                    ffn_hidden_size=cfg.intermediate_size, vocab_size=cfg.vocab_size,
                    max_position_embeddings=cfg.max_position_embeddings, make_vocab_size_divisible_by=128,
                    position_embedding_type="rope", rotary_base=base, rotary_percent=percent,
                    normalization="LayerNorm", layernorm_epsilon=float(getattr(cfg, v.eps_field)),
                    layernorm_zero_centered_gamma=v.zero_centred, **_ACTIVATIONS[cfg.hidden_act],
                    num_query_groups=groups,
                    kv_channels=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,   # StarCoder2 reads one too
                    untie_embeddings_and_output_weights=not cfg.tie_word_embeddings,
                    add_bias_linear=next(iter(biases.values())))
        # megatron-core's one hidden dropout is both the residual and the embedding dropout: the first field's
        args = {"hidden_dropout": float(getattr(cfg, v.dropout_fields[0], 0.0) or 0.0) if v.dropout_fields else 0.0,
                "attention_dropout": float(getattr(cfg, "attention_dropout", 0.0) or 0.0)}
        return full_meta(meta), args

    def attention_window(self, cfg) -> dict | None:
        """StarCoder2's window on every layer (llama.sliding_layers, as Mistral's): {"tokens": W, "layers"}."""
        window, sliding = sliding_layers(self.variant, cfg)
        if window is None or not sliding:
            return None
        return {"tokens": window, "layers": sliding}

    def read_state(self, input_dir: str, cfg, meta: dict) -> dict[str, torch.Tensor]:
        sd = read_checked_state_dict(input_dir, meta, hf_shapes(self.variant, meta), self.architecture,
                                     " (biases, tying and layers must agree)")
        return from_hf(self.variant, sd, meta)

    def why_not(self, meta: dict) -> str | None:
        meta, v = full_meta(meta), self.variant
        needs = (("num_experts", None, "no experts"), ("position_embedding_type", "rope", "rotary positions"),
                 ("normalization", "LayerNorm", "LayerNorm"), ("qk_layernorm", False, "no q/k norms"),
                 ("use_rope_scaling", False, "no rope scaling"))
        for key, want, what in needs:
            if meta.get(key) != want:
                return f"{self.architecture} has {what} ({key}={meta.get(key)!r})"
        if _activation_name(v, meta) is None:
            return f"{self.architecture}'s MLP is {' or '.join(map(repr, v.activations))} (not the model's)"
        if meta["add_qkv_bias"] and not meta["add_bias_linear"]:
            return f"{self.architecture} has biases on every linear layer or none (add_qkv_bias=True alone)"
        if meta["rotary_percent"] != 1.0 and not v.partial_rotary:
            return f"{self.architecture} rotates the whole head (rotary_percent={meta['rotary_percent']})"
        if meta["num_attention_heads"] % query_groups(meta):
            return f"num_query_groups {query_groups(meta)} does not divide the heads"
        return None

    def to_hf_state(self, weights: dict[str, torch.Tensor], meta: dict) -> dict[str, torch.Tensor]:
        return to_hf(self.variant, weights, meta)

    def config_json_extra(self, meta: dict) -> dict:
        """The rope keys of the transformers schema the installed config class does not write (a 4.x
        reader of 5's file would take theta 10000 and the whole head)."""
        v5, v4 = _rope_schemas(self.variant, meta)
        return v4 if _reads_rope_parameters(self._config_class()) else v5

    def hf_config(self, meta: dict, *, dtype: str, args: dict, bos_token_id, eos_token_id, window: dict | None = None):
        v, cls = self.variant, self._config_class()
        default_head_dim = head_dim(meta) == meta["hidden_size"] // meta["num_attention_heads"]
        extra = {"head_dim": head_dim(meta)} if v.head_dim_field or not default_head_dim else {}
        extra.update({f: float(args.get("hidden_dropout") or 0.0) for f in v.dropout_fields})
        if v.window is not None:
            extra["sliding_window"] = (window or {}).get("tokens")
        return cls(
            vocab_size=meta["vocab_size"], hidden_size=meta["hidden_size"], intermediate_size=meta["ffn_hidden_size"],
            num_hidden_layers=meta["num_layers"], num_attention_heads=meta["num_attention_heads"],
            num_key_value_heads=query_groups(meta), hidden_act=_activation_name(v, meta),
            max_position_embeddings=meta["max_position_embeddings"], **{v.eps_field: meta["layernorm_epsilon"]},
            tie_word_embeddings=not meta.get("untie_embeddings_and_output_weights", False),
            **_rope_schemas(v, meta)[0 if _reads_rope_parameters(cls) else 1],
            **{f: meta["add_bias_linear"] for f in v.bias_fields}, **extra,
            attention_dropout=float(args.get("attention_dropout") or 0.0), bos_token_id=bos_token_id,
            eos_token_id=eos_token_id, architectures=[self.architecture], dtype=dtype)


FAMILIES = tuple(NonGatedFamily(v) for v in VARIANTS)
