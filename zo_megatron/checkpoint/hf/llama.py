"""Hugging Face Llama, Mistral, Qwen2 and Qwen3 <-> zo_megatron (megatron-core GPTModel, local spec).

The four are one decoder (RoPE, RMSNorm, SwiGLU MLP, grouped-query attention, optionally untied
output layer); they differ only in a few config fields, written here as data (`VARIANTS`):
which linear layers carry biases and which config field says so, whether each head's queries and
keys are RMS-normalised before RoPE (Qwen3's q_norm / k_norm: megatron's --qk-layernorm, same
epsilon), what a full-attention config says about the sliding window, and which layers a window
limits (`sliding_layers`).

    HF (model.layers.{i}.)                     megatron-core (decoder.layers.{i}.)
    input_layernorm                         -> input_layernorm
    self_attn.q_proj, k_proj, v_proj        -> self_attention.linear_qkv   rows grouped per query group g:
                                               [q heads of g (heads/G x d rows); k_g (d); v_g (d)]
    self_attn.o_proj                        -> self_attention.linear_proj
    self_attn.q_norm, k_norm (Qwen3)        -> self_attention.q_layernorm, k_layernorm   (head dim)
    post_attention_layernorm                -> pre_mlp_layernorm
    mlp.gate_proj, mlp.up_proj              -> mlp.linear_fc1              [gate; up] (full tensor)
    mlp.down_proj                           -> mlp.linear_fc2
    model.embed_tokens / model.norm / lm_head -> embedding.word_embeddings / decoder.final_layernorm / output_layer

HF's rotate_half RoPE is megatron's non-interleaved RoPE: q and k need no permutation. nn.Linear
and megatron both store [out, in]: nothing is transposed. How [gate; up] splits over TP (stride 2)
is the TP layout's business (checkpoint/tp_layout.py), not this file's.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from zo_megatron.checkpoint.arch import full_meta, head_dim, query_groups
from zo_megatron.checkpoint.hf.family import VariantFamily, read_checked_state_dict
from zo_megatron.checkpoint.hf.rope import ROPE_REFUSED, ROPE_TYPES, yarn_meta, yarn_parameters
from zo_megatron.errors import UserError
from zo_megatron.model.config import rotary_base

_OURS = "gpt."
_LINEARS = ("qkv", "proj", "fc1", "fc2")
# megatron-core's hard-coded Llama-3.1 rope scaling (rotary_pos_embedding._apply_scaling): only
# the factor is a flag (--rope-scaling-factor)
LLAMA3_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


@dataclass(frozen=True)
class Variant:
    architecture: str
    model_type: str
    config_class: str                                       # transformers' config class
    bias_fields: dict = field(default_factory=dict)         # config field -> the linears it gives biases
    fixed_biases: tuple = ()                                # linears that always have biases
    full_attention: dict = field(default_factory=dict)      # what to write for full attention
    # which layers slide, as the family's HF model reads its config (`sliding_layers`): None (no
    # window), "every_layer" (Mistral: sliding_window alone; its model ignores layer_types) or
    # "layer_types" (Qwen2: use_sliding_window, then layer_types, or 4.x's max_window_layers)
    window: str | None = None
    qk_norm: bool = False                                   # q_norm / k_norm on each head (Qwen3)


VARIANTS = (
    Variant("LlamaForCausalLM", "llama", "LlamaConfig",
            bias_fields={"attention_bias": ("qkv", "proj"), "mlp_bias": ("fc1", "fc2")}),
    Variant("MistralForCausalLM", "mistral", "MistralConfig", full_attention={"sliding_window": None},
            window="every_layer"),
    Variant("Qwen2ForCausalLM", "qwen2", "Qwen2Config", fixed_biases=("qkv",),
            full_attention={"use_sliding_window": False}, window="layer_types"),
    Variant("Qwen3ForCausalLM", "qwen3", "Qwen3Config", bias_fields={"attention_bias": ("qkv", "proj")},
            full_attention={"use_sliding_window": False}, window="layer_types", qk_norm=True),
)


def sliding_layers(variant: Variant, cfg) -> tuple[int | None, list[int]]:
    """(window, the layers whose attention it limits) as transformers' model of `variant` reads the
    config object: MistralAttention passes config.sliding_window to every layer (layer_types is not
    read: transformers warns and ignores it); Qwen2 slides only with use_sliding_window, in the layers
    layer_types names "sliding_attention" (5.x, and 4.x since layer_types), else those from
    max_window_layers on (older 4.x, whose config keeps sliding_window when use_sliding_window is
    false: the model reads the flag)."""
    window = getattr(cfg, "sliding_window", None)
    if variant.window is None or window is None:
        return None, []
    n = cfg.num_hidden_layers
    if variant.window == "every_layer":
        return window, list(range(n))
    if not getattr(cfg, "use_sliding_window", False):
        return None, []
    layer_types = getattr(cfg, "layer_types", None)
    if layer_types:
        return window, [i for i, t in enumerate(layer_types) if t == "sliding_attention"]
    first = getattr(cfg, "max_window_layers", 0) or 0
    return window, list(range(first, n))


# ---- the model's architecture in our terms

def _our_biases(meta: dict) -> frozenset:
    """The linears with biases: megatron's add_bias_linear gives all of them one, add_qkv_bias linear_qkv."""
    if meta.get("add_bias_linear", True):
        return frozenset(_LINEARS)
    return frozenset({"qkv"} if meta.get("add_qkv_bias") else ())


def _bias_flags(biases: frozenset) -> tuple[bool, bool] | None:
    """(add_bias_linear, add_qkv_bias) for a set of linears with biases; None if megatron cannot."""
    return {frozenset(_LINEARS): (True, False), frozenset({"qkv"}): (False, True), frozenset(): (False, False)}.get(biases)


def _ranges(layers: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'."""
    out, start = [], None
    for i, x in enumerate(layers):
        start = x if start is None else start
        if i + 1 == len(layers) or layers[i + 1] != x + 1:
            out.append(f"{start}-{x}" if x != start else str(x))
            start = None
    return ", ".join(out)


# ---- rope, both config schemas

def _rope_params(cfg) -> dict:
    """{'rope_type', 'rope_theta', ...}: transformers 5's `rope_parameters`, or 4.x's `rope_theta` +
    `rope_scaling` (a config file of either schema is read by the installed transformers' class,
    which converts the other one)."""
    params = getattr(cfg, "rope_parameters", None)
    if params is None:
        params = dict(getattr(cfg, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(cfg, "rope_theta", 10000.0))
    params = dict(params)
    if "rope_theta" not in params and params and all(isinstance(v, dict) for v in params.values()):
        return {"per_layer_type": sorted(params)}         # one rope per layer type: not a single RoPE
    params.setdefault("rope_type", params.pop("type", "default"))
    return params


def _rope_meta(cfg, where: str) -> dict:
    def refuse(what, fix):
        raise UserError(f"{where}: {what}: megatron-core's RoPE cannot express it ({fix})")

    p = _rope_params(cfg)
    if "per_layer_type" in p:
        refuse(f"rope_parameters per layer type {p['per_layer_type']}", "one RoPE for every layer is supported")
    partial = p.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", None))
    if partial not in (None, 1, 1.0):
        refuse(f"partial_rotary_factor={partial}", "this family rotates the whole head")
    out = dict(position_embedding_type="rope", rotary_base=rotary_base(p.get("rope_theta", 10000.0)),
               rotary_percent=1.0,
               use_rope_scaling=False, rope_scaling_factor=8.0)
    kind = p["rope_type"]
    if kind == "llama3":
        for k, want in LLAMA3_FIXED.items():
            if float(p.get(k, want)) != want:
                refuse(f"llama3 rope scaling with {k}={p.get(k)}", f"only the factor is configurable; {k} is {want}")
        out.update(use_rope_scaling=True, rope_scaling_factor=float(p["factor"]))
    elif kind == "yarn":
        out.update(yarn_meta(p, cfg.max_position_embeddings, refuse))
    elif kind != "default":
        refuse(f"rope_type={kind!r}", f"supported: {', '.join(map(repr, ROPE_TYPES))}; {ROPE_REFUSED.get(kind, '')}"
               .rstrip("; "))
    return out


def _rope_schemas(meta: dict) -> tuple[dict, dict]:
    """The model's rope as transformers 5's `rope_parameters` and as 4.x's `rope_theta` + `rope_scaling`."""
    params = {"rope_type": "default", "rope_theta": float(meta.get("rotary_base", 10000))}
    if meta.get("position_embedding_type") == "yarn":
        params.update(yarn_parameters(meta))
    elif meta.get("use_rope_scaling"):
        params.update(rope_type="llama3", factor=float(meta.get("rope_scaling_factor", 8.0)), **LLAMA3_FIXED)
    scaling = None if params["rope_type"] == "default" else {k: v for k, v in params.items() if k != "rope_theta"}
    return {"rope_parameters": params}, {"rope_theta": params["rope_theta"], "rope_scaling": scaling}


def _reads_rope_parameters(cls) -> bool:
    return "rope_parameters" in getattr(cls, "__dataclass_fields__", {}) or hasattr(cls, "rope_parameters")


def _rope_config(cls, meta: dict) -> dict:
    """The rope kwargs of a transformers config class, in the schema the installed version reads."""
    v5, v4 = _rope_schemas(meta)
    return v5 if _reads_rope_parameters(cls) else v4


def _rope_config_json_extra(cls, meta: dict) -> dict:
    """The rope keys of the schema the installed transformers' config class `cls` does not write, for
    config.json's readers of the other version (see LlamaFamily.config_json_extra)."""
    v5, v4 = _rope_schemas(meta)
    return v4 if _reads_rope_parameters(cls) else v5


# ---- names and shapes

def hf_shapes(meta: dict, biases: frozenset) -> dict[str, tuple[int, ...]]:
    d = head_dim(meta)
    h, f, v = meta["hidden_size"], meta["ffn_hidden_size"], meta["vocab_size"]
    q, kv = meta["num_attention_heads"] * head_dim(meta), query_groups(meta) * head_dim(meta)
    out = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    if meta.get("untie_embeddings_and_output_weights"):
        out["lm_head.weight"] = (v, h)
    for i in range(meta["num_layers"]):
        m = f"model.layers.{i}."
        lin = {"qkv": {"self_attn.q_proj": (q, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h)},
               "proj": {"self_attn.o_proj": (h, q)},
               "fc1": {"mlp.gate_proj": (f, h), "mlp.up_proj": (f, h)}, "fc2": {"mlp.down_proj": (h, f)}}
        out[m + "input_layernorm.weight"] = (h,)
        out[m + "post_attention_layernorm.weight"] = (h,)
        if meta.get("qk_layernorm"):
            out[m + "self_attn.q_norm.weight"] = out[m + "self_attn.k_norm.weight"] = (d,)
        for which, mods in lin.items():
            for mod, shape in mods.items():
                out[m + mod + ".weight"] = shape
                if which in biases:
                    out[m + mod + ".bias"] = shape[:1]
    return out


def _pack_qkv(q, k, v, heads: int, groups: int) -> torch.Tensor:
    rest = q.shape[1:]
    q = q.reshape(groups, -1, *rest)                             # each group's query heads, whole
    return torch.cat([q, k.reshape(groups, -1, *rest), v.reshape(groups, -1, *rest)], dim=1).reshape(-1, *rest)


def _unpack_qkv(t, heads: int, groups: int, d: int):
    rest = t.shape[1:]
    q, k, v = t.reshape(groups, -1, *rest).split([heads // groups * d, d, d], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def _layer_pairs(i: int) -> list[tuple[str, str]]:
    """(ours, HF) for the one-to-one tensors of layer i (weights and biases)."""
    m, h = f"{_OURS}decoder.layers.{i}.", f"model.layers.{i}."
    return [(m + "input_layernorm.weight", h + "input_layernorm.weight"),
            (m + "pre_mlp_layernorm.weight", h + "post_attention_layernorm.weight"),
            (m + "self_attention.linear_proj.weight", h + "self_attn.o_proj.weight"),
            (m + "self_attention.linear_proj.bias", h + "self_attn.o_proj.bias"),
            (m + "mlp.linear_fc2.weight", h + "mlp.down_proj.weight"),
            (m + "mlp.linear_fc2.bias", h + "mlp.down_proj.bias"),
            (m + "self_attention.q_layernorm.weight", h + "self_attn.q_norm.weight"),
            (m + "self_attention.k_layernorm.weight", h + "self_attn.k_norm.weight")]


def from_hf(sd: dict[str, torch.Tensor], meta: dict) -> dict[str, torch.Tensor]:
    """HF state dict (full) -> our full tensors, in the files' dtype: the mapping only moves data,
    and the checkpoint writer converts each box to fp32 as it writes it (an fp32 copy of the whole
    model here was 4 bytes/param more at the conversion's peak)."""
    heads, groups = meta["num_attention_heads"], query_groups(meta)
    out = {_OURS + "embedding.word_embeddings.weight": sd["model.embed_tokens.weight"],
           _OURS + "decoder.final_layernorm.weight": sd["model.norm.weight"]}
    if "lm_head.weight" in sd and meta.get("untie_embeddings_and_output_weights"):
        out[_OURS + "output_layer.weight"] = sd["lm_head.weight"]
    for i in range(meta["num_layers"]):
        m, h = f"{_OURS}decoder.layers.{i}.", f"model.layers.{i}."
        for ours, hf in _layer_pairs(i):
            if hf in sd:
                out[ours] = sd[hf]
        for kind in ("weight", "bias"):
            if h + f"self_attn.q_proj.{kind}" in sd:
                out[m + f"self_attention.linear_qkv.{kind}"] = _pack_qkv(
                    *(sd[h + f"self_attn.{p}_proj.{kind}"] for p in "qkv"), heads, groups)
            if h + f"mlp.gate_proj.{kind}" in sd:
                out[m + f"mlp.linear_fc1.{kind}"] = torch.cat([sd[h + f"mlp.gate_proj.{kind}"],
                                                               sd[h + f"mlp.up_proj.{kind}"]])
    return {k: v.contiguous() for k, v in out.items()}


def to_hf(weights: dict[str, torch.Tensor], meta: dict) -> dict[str, torch.Tensor]:
    """Our full tensors -> HF state dict (no lm_head when tied)."""
    heads, groups, d, f = meta["num_attention_heads"], query_groups(meta), head_dim(meta), meta["ffn_hidden_size"]
    out = {"model.embed_tokens.weight": weights[_OURS + "embedding.word_embeddings.weight"],
           "model.norm.weight": weights[_OURS + "decoder.final_layernorm.weight"]}
    if _OURS + "output_layer.weight" in weights:
        out["lm_head.weight"] = weights[_OURS + "output_layer.weight"]
    for i in range(meta["num_layers"]):
        m, h = f"{_OURS}decoder.layers.{i}.", f"model.layers.{i}."
        for ours, hf in _layer_pairs(i):
            if ours in weights:
                out[hf] = weights[ours]
        for kind in ("weight", "bias"):
            if m + f"self_attention.linear_qkv.{kind}" in weights:
                q, k, v = _unpack_qkv(weights[m + f"self_attention.linear_qkv.{kind}"], heads, groups, d)
                out.update({h + f"self_attn.q_proj.{kind}": q, h + f"self_attn.k_proj.{kind}": k,
                            h + f"self_attn.v_proj.{kind}": v})
            if m + f"mlp.linear_fc1.{kind}" in weights:
                gate, up = weights[m + f"mlp.linear_fc1.{kind}"].split([f, f])
                out.update({h + f"mlp.gate_proj.{kind}": gate, h + f"mlp.up_proj.{kind}": up})
    # own storage each (views of one tensor cannot be saved as separate safetensors entries)
    return {k: v.clone(memory_format=torch.contiguous_format) for k, v in out.items()}


# ---- the family object

class LlamaFamily(VariantFamily):
    def _hf_biases(self, cfg) -> frozenset:
        on = set(self.variant.fixed_biases)
        for name, linears in self.variant.bias_fields.items():
            if getattr(cfg, name, False):
                on.update(linears)
        return frozenset(on)

    def _expressible_biases(self) -> set[frozenset]:
        names = list(self.variant.bias_fields)
        return {frozenset(self.variant.fixed_biases).union(*(self.variant.bias_fields[n] for n, on in zip(names, ons) if on))
                for ons in itertools.product((False, True), repeat=len(names))}

    def meta_from_config(self, cfg, where: str) -> tuple[dict, dict]:
        def refuse(what, why):
            raise UserError(f"{where}: {what}: {why}")

        if cfg.hidden_act != "silu":
            refuse(f"hidden_act={cfg.hidden_act!r}", "the MLP must be SwiGLU (silu), megatron's --swiglu")
        max_pos = cfg.max_position_embeddings
        biases = self._hf_biases(cfg)
        flags = _bias_flags(biases)
        if flags is None:
            fields = {n: getattr(cfg, n) for n in self.variant.bias_fields}
            refuse(", ".join(f"{k}={v}" for k, v in fields.items()),
                   "megatron-core gives biases to all linear layers (--add-bias-linear) or only to QKV "
                   "(--add-qkv-bias), not to this mix")
        heads = cfg.num_attention_heads
        groups = cfg.num_key_value_heads or heads
        if heads % groups:
            refuse(f"num_key_value_heads={groups}", f"does not divide num_attention_heads={heads}")
        d = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        meta = dict(num_layers=cfg.num_hidden_layers, hidden_size=cfg.hidden_size, num_attention_heads=heads,
                    ffn_hidden_size=cfg.intermediate_size, vocab_size=cfg.vocab_size,
                    max_position_embeddings=max_pos, make_vocab_size_divisible_by=128, **_rope_meta(cfg, where),
                    normalization="RMSNorm", layernorm_epsilon=float(cfg.rms_norm_eps), swiglu=True,
                    num_query_groups=groups, kv_channels=d,
                    untie_embeddings_and_output_weights=not cfg.tie_word_embeddings,
                    add_bias_linear=flags[0], add_qkv_bias=flags[1], qk_layernorm=self.variant.qk_norm)
        meta = full_meta(meta)
        args = {"hidden_dropout": 0.0, "attention_dropout": float(getattr(cfg, "attention_dropout", 0.0) or 0.0)}
        return meta, args

    def attention_window(self, cfg) -> dict | None:
        """A sliding window as transformers' model applies it (sliding_layers): {"tokens": W, "layers"}
        (from-hf makes it --window-size W-1,0 on those layers: planner/window.py from_hf_window)."""
        window, sliding = sliding_layers(self.variant, cfg)
        if window is None or not sliding:
            return None
        return {"tokens": window, "layers": sliding}

    def _window_config(self, window: dict | None, n: int) -> dict:
        """The config fields that say `window` (planner/window.py hf_window) as this variant's model reads
        them: Mistral's sliding_window (every layer); Qwen2/3's use_sliding_window with layer_types, and
        max_window_layers where the window layers are the last ones (what 4.x without layer_types reads)."""
        if window is None:
            return dict(self.variant.full_attention)
        if self.variant.window == "every_layer":
            return {"sliding_window": window["tokens"]}
        layers = window["layers"]
        out = {"use_sliding_window": True, "sliding_window": window["tokens"],
               "layer_types": ["sliding_attention" if i in layers else "full_attention" for i in range(n)]}
        if layers == list(range(n - len(layers), n)):
            out["max_window_layers"] = n - len(layers)
        return out

    def read_state(self, input_dir: str, cfg, meta: dict) -> dict[str, torch.Tensor]:
        sd = read_checked_state_dict(input_dir, meta, hf_shapes(meta, _our_biases(meta)), self.architecture,
                                     " (biases, tying and layers must agree)")
        return from_hf(sd, meta)

    def why_not(self, meta: dict) -> str | None:
        meta = full_meta(meta)
        if meta.get("num_experts") is not None:
            return f"{self.architecture} has no experts (num_experts={meta['num_experts']})"
        if meta.get("position_embedding_type") not in ("rope", "yarn"):
            return f"{self.architecture} has rotary positions (position_embedding_type=" \
                   f"{meta.get('position_embedding_type')!r})"
        needs = (("normalization", "RMSNorm", "RMSNorm"),
                 ("swiglu", True, "a SwiGLU MLP"),
                 ("qk_layernorm", self.variant.qk_norm, "q/k norms" if self.variant.qk_norm else "no q/k norms"),
                 ("rotary_percent", 1.0, "RoPE on the whole head (--rotary-percent 1)"))
        for key, want, what in needs:
            if meta.get(key) != want:
                return f"{self.architecture} has {what} ({key}={meta.get(key)!r})"
        if _our_biases(meta) not in self._expressible_biases():
            return f"{self.architecture} cannot have biases on exactly {sorted(_our_biases(meta)) or 'no linear layer'}"
        if meta["num_attention_heads"] % query_groups(meta):
            return f"num_query_groups {query_groups(meta)} does not divide the heads"
        return self._config_refuses(meta)

    def to_hf_state(self, weights: dict[str, torch.Tensor], meta: dict) -> dict[str, torch.Tensor]:
        return to_hf(weights, meta)

    def config_json_extra(self, meta: dict) -> dict:
        """transformers 5 writes only rope_parameters; a 4.x reader would silently take theta 10000 and
        no scaling from such a file: the 4.x keys too (5.x reads them as the same rope)."""
        return _rope_config_json_extra(self._config_class(), meta)

    def hf_config(self, meta: dict, *, dtype: str, args: dict, bos_token_id, eos_token_id, window: dict | None = None):
        cls = self._config_class()
        ours = _our_biases(meta)
        extra = {name: set(lin) <= ours for name, lin in self.variant.bias_fields.items()}
        # Qwen2's config has no head_dim field (its attention reads one if present): only when needed
        if "head_dim" in getattr(cls, "__dataclass_fields__", {}) or \
                head_dim(meta) != meta["hidden_size"] // meta["num_attention_heads"]:
            extra["head_dim"] = head_dim(meta)
        return cls(vocab_size=meta["vocab_size"], hidden_size=meta["hidden_size"],
                   intermediate_size=meta["ffn_hidden_size"], num_hidden_layers=meta["num_layers"],
                   num_attention_heads=meta["num_attention_heads"], num_key_value_heads=query_groups(meta),
                   hidden_act="silu", max_position_embeddings=meta["max_position_embeddings"],
                   rms_norm_eps=meta["layernorm_epsilon"],
                   tie_word_embeddings=not meta.get("untie_embeddings_and_output_weights", False),
                   attention_dropout=float(args.get("attention_dropout") or 0.0), bos_token_id=bos_token_id,
                   eos_token_id=eos_token_id, architectures=[self.architecture], dtype=dtype,
                   **_rope_config(cls, meta), **extra, **self._window_config(window, meta["num_layers"]))


FAMILIES = tuple(LlamaFamily(v) for v in VARIANTS)
