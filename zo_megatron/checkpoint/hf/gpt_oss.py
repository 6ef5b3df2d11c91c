"""Hugging Face GPT-OSS (`GptOssForCausalLM`: openai/gpt-oss-20b, -120b) <-> zo_megatron's mixture-of-experts GPT
(megatron-core's MoELayer, local spec; docs/moe.md, docs/checkpoints.md).

GPT-OSS is a Llama-shaped decoder (hf/llama.py maps q/k/v/o, the norms and the embeddings) with biases on every
attention projection, per-head attention sinks, sliding-window attention on the layers `layer_types` names,
YaRN RoPE, and a mixture of experts in every layer whose experts have biases and a clamped quick GeGLU. On disk
(what transformers' save_pretrained writes; model.layers.{i}.):

    HF                                          megatron-core (decoder.layers.{i}.)
    self_attn.q/k/v_proj .weight, .bias      -> self_attention.linear_qkv .weight, .bias  (rows per query group)
    self_attn.o_proj .weight, .bias          -> self_attention.linear_proj .weight, .bias
    self_attn.sinks [heads]                  -> self_attention.core_attention.softmax_offset (--softmax-type learnable)
    mlp.router.weight [E, h], .bias [E]      -> mlp.router.weight, .bias       (--add-bias-linear gives the bias)
    mlp.experts.gate_up_proj [E, h, 2f]      -> mlp.experts.local_experts.{e}.linear_fc1.weight [2f, h] = [gate; up]
    mlp.experts.gate_up_proj_bias [E, 2f]    -> ...local_experts.{e}.linear_fc1.bias [2f] = [gate; up]
    mlp.experts.down_proj [E, f, h]          -> ...local_experts.{e}.linear_fc2.weight [h, f]  (transposed)
    mlp.experts.down_proj_bias [E, h]        -> ...local_experts.{e}.linear_fc2.bias [h]

HF's experts compute x @ gate_up_proj[e] + bias with gate and up INTERLEAVED on the last axis (gate = [..., 0::2],
up = [..., 1::2]); megatron-core chunks linear_fc1's output into halves [gate; up]: from-hf de-interleaves and
transposes, to-hf interleaves back (bit for bit both ways). OpenAI's own files store the two expert weights in
MXFP4 (`{p}_blocks` uint8 [E, rows, cols / 32, 16] and `{p}_scales` uint8 [E, rows, cols / 32], rows being the
output features: [E, 2f, h] for gate_up, [E, h, f] for down), which transformers dequantizes when it loads them
(config.json's quantization_config quant_method "mxfp4"); from-hf does the same arithmetic (hf/mxfp4.py) one
tensor at a time, either form per tensor as transformers' dequantizing loader takes it. to-hf writes the plain
form in --dtype (bf16 for the released models' size) and a config without quantization_config.

The semantics, each the same function on both sides:
  - the experts: HF (up.clamp(-L, L) + 1) * g * sigmoid(alpha g), g = gate.clamp(max=L); megatron-core's glu()
    with --quick-geglu (quick_gelu(x) = x * sigmoid(1.702 x)), --glu-linear-offset 1, --activation-func-clamp-value
    L = swiglu_limit. megatron-core's quick_gelu has 1.702 built in: another swiglu_alpha is refused.
  - the router: HF takes the top k of the logits (x W^T + b) and a softmax over those k, megatron-core's default
    (--moe-router-score-function softmax without --moe-router-pre-softmax) the same. k = 1 is refused: HF's weight
    is then 1, megatron-core requires --moe-router-pre-softmax for k = 1 (all-expert softmax: another weight).
  - attention sinks: HF softmaxes each head's scores with one extra logit, sinks[h], and drops its column;
    megatron-core's learnable softmax offset is that (SoftmaxOne). Scale 1/sqrt(head_dim) on both.
  - sliding window: HF's sliding_window W on the "sliding_attention" layers is W tokens with the token itself:
    --window-size W-1,0 and --window-attn-skip-freq as the 0/1 list (planner/window.py, as Qwen2's layer_types).
    transformers' GPT-OSS builds its sliding mask for every forward, so to-hf of a model without a window writes
    every layer "full_attention" and sliding_window = max_position_embeddings (read by no layer).
  - RoPE: rotate-half (non-interleaved) as megatron-core's; YaRN's fields as hf/rope.py maps them (truncate false
    -> yarn_correction_range_round_to_int false).
The load-balancing loss is not converted (coefficient 0, as for Mixtral): transformers adds router_aux_loss_coef
x its loss only with output_router_logits, and another function (hf/mixtral.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from zo_megatron.checkpoint.arch import full_meta, query_groups
from zo_megatron.checkpoint.hf import llama, mxfp4
from zo_megatron.checkpoint.hf.experts import check_groups_and_top_k
from zo_megatron.checkpoint.hf.family import VariantFamily, read_checked_state_dict, stored_tensor_names
from zo_megatron.errors import UserError

_OURS = "gpt."
QUICK_GELU_ALPHA = 1.702            # megatron-core's quick_gelu: x * sigmoid(1.702 x), not configurable
_LAYER_TYPES = ("sliding_attention", "full_attention")
_PROJS = ("gate_up_proj", "down_proj")
_SINKS = "self_attention.core_attention.softmax_offset"


@dataclass(frozen=True)
class Variant:
    architecture: str = "GptOssForCausalLM"
    model_type: str = "gpt_oss"
    config_class: str = "GptOssConfig"
    window: str = "layer_types"            # any set of layers slides (hf.why_not; family.window_support)


# ---- config

def _quant_method(cfg) -> str | None:
    q = getattr(cfg, "quantization_config", None)
    if q is None:
        return None
    q = q if isinstance(q, dict) else q.to_dict()
    return str(q.get("quant_method"))


def sliding_layers(cfg) -> tuple[int | None, list[int]]:
    """(sliding_window, the layers transformers' GptOssAttention limits with it: layer_types' "sliding_attention")."""
    layers = [i for i, t in enumerate(cfg.layer_types or ()) if t == "sliding_attention"]
    return cfg.sliding_window, layers


def meta_from_config(cfg, where: str) -> dict:
    """GPTConfig's fields of a transformers GptOssConfig; one line for what has no exact mapping."""
    def refuse(what, why):
        raise UserError(f"{where}: {what}: {why}")

    method = _quant_method(cfg)
    if method not in (None, "mxfp4"):
        refuse(f"quantization_config quant_method {method!r}", "only MXFP4 (OpenAI's release format) is read; give "
               "the unquantized or the MXFP4 checkpoint")
    alpha = float(getattr(cfg, "swiglu_alpha", QUICK_GELU_ALPHA))
    if alpha != QUICK_GELU_ALPHA:
        refuse(f"swiglu_alpha={alpha:g}", f"megatron-core's quick_gelu has sigmoid gain {QUICK_GELU_ALPHA} built in")
    limit = cfg.swiglu_limit
    if limit is None or isinstance(limit, bool) or not float(limit) > 0:
        refuse(f"swiglu_limit={limit!r}", "the experts' clamp must be a number > 0 (--activation-func-clamp-value)")
    if not cfg.attention_bias:
        refuse("attention_bias=false", "GPT-OSS's router and experts always have biases, and megatron-core gives "
               "biases to all linear layers (--add-bias-linear) or to none of them")
    types = list(cfg.layer_types or ())
    odd = [t for t in types if t not in _LAYER_TYPES]
    if odd or len(types) != cfg.num_hidden_layers:
        refuse(f"layer_types={types}", f"one of {' or '.join(map(repr, _LAYER_TYPES))} per layer "
               f"({cfg.num_hidden_layers} layers)")
    window, sliding = sliding_layers(cfg)
    if sliding and window is None:
        refuse("sliding_window=null", "layer_types names sliding-attention layers (transformers cannot run it)")
    check_groups_and_top_k(cfg, refuse)
    heads, groups = cfg.num_attention_heads, cfg.num_key_value_heads or cfg.num_attention_heads
    experts, k = cfg.num_local_experts, cfg.num_experts_per_tok
    d = cfg.head_dim or cfg.hidden_size // heads
    return dict(num_layers=cfg.num_hidden_layers, hidden_size=cfg.hidden_size, num_attention_heads=heads,
                ffn_hidden_size=cfg.intermediate_size, vocab_size=cfg.vocab_size,
                max_position_embeddings=cfg.max_position_embeddings, make_vocab_size_divisible_by=128,
                **llama._rope_meta(cfg, where), normalization="RMSNorm", layernorm_epsilon=float(cfg.rms_norm_eps),
                swiglu=False, quick_geglu=True, glu_linear_offset=1.0, activation_func_clamp_value=float(limit),
                softmax_type="learnable", num_query_groups=groups, kv_channels=d,
                untie_embeddings_and_output_weights=not cfg.tie_word_embeddings, add_bias_linear=True,
                add_qkv_bias=False, qk_layernorm=False,
                num_experts=experts, moe_router_topk=k, moe_ffn_hidden_size=cfg.intermediate_size,
                moe_router_pre_softmax=False, moe_router_score_function="softmax",
                moe_router_topk_scaling_factor=None, moe_layer_freq=1,
                moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.0)


# ---- names and shapes

def hf_shapes(meta: dict, quantized: frozenset = frozenset()) -> dict[str, tuple[int, ...]]:
    """Every tensor of a GPT-OSS's files and its shape; `quantized`: the (layer, projection) pairs stored as MXFP4
    blocks and scales instead of the plain tensor."""
    h, f, e, n = meta["hidden_size"], meta["moe_ffn_hidden_size"], meta["num_experts"], meta["num_attention_heads"]
    out = {k: v for k, v in llama.hf_shapes({**meta, "ffn_hidden_size": 0}, frozenset({"qkv", "proj"})).items()
           if ".mlp." not in k}
    for i in range(meta["num_layers"]):
        a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        out.update({a + "sinks": (n,), m + "router.weight": (e, h), m + "router.bias": (e,),
                    m + "experts.gate_up_proj_bias": (e, 2 * f), m + "experts.down_proj_bias": (e, h)})
        # the plain tensors are [E, in, out]; MXFP4 stores [E, out, in / 32 blocks, 16 bytes]
        for proj, (rows, cols) in (("gate_up_proj", (2 * f, h)), ("down_proj", (h, f))):
            if (i, proj) in quantized:
                groups = cols // mxfp4.BLOCK
                out[f"{m}experts.{proj}_blocks"] = (e, rows, groups, mxfp4.BLOCK_BYTES)
                out[f"{m}experts.{proj}_scales"] = (e, rows, groups)
            else:
                out[f"{m}experts.{proj}"] = (e, cols, rows)
    return out


# ---- the tensors

def _deinterleave(t: torch.Tensor) -> torch.Tensor:
    """HF's interleaved [g0, u0, g1, u1, ...] rows -> megatron's [gate; up]."""
    return torch.cat([t[0::2], t[1::2]])


def _interleave(t: torch.Tensor) -> torch.Tensor:
    """The inverse: [gate; up] rows -> [g0, u0, g1, u1, ...]."""
    gate, up = t.chunk(2)
    return torch.stack([gate, up], dim=1).reshape(t.shape)


def _expert_weights(sd: dict, m: str, proj: str, where: str) -> torch.Tensor:
    """One projection's weights of every expert as megatron's [E, out, in] (out of gate_up still interleaved),
    dequantized from MXFP4 when stored so; taken out of `sd`."""
    if m + proj in sd:
        return sd.pop(m + proj).transpose(1, 2)
    blocks, scales = sd.pop(f"{m}{proj}_blocks"), sd.pop(f"{m}{proj}_scales")
    try:
        return mxfp4.dequantize(blocks, scales, torch.bfloat16)
    except ValueError as exc:
        raise UserError(f"{where}: {m}{proj}_blocks / _scales are not MXFP4: {exc}") from None


def from_hf(sd: dict[str, torch.Tensor], meta: dict, where: str = "the weights") -> dict[str, torch.Tensor]:
    """HF state dict as on disk (full; MXFP4 experts dequantized) -> our full tensors (experts by global index).
    The experts' tensors are taken out of `sd` as each layer is mapped: the peak holds one layer's copy beside
    the rest (pass a copy to keep yours)."""
    out = llama.from_hf({k: v for k, v in sd.items() if ".mlp." not in k and not k.endswith(".self_attn.sinks")},
                        meta)
    for i in range(meta["num_layers"]):
        h, m = f"model.layers.{i}.", f"{_OURS}decoder.layers.{i}."
        out[m + _SINKS] = sd.pop(h + "self_attn.sinks")
        out[m + "mlp.router.weight"] = sd.pop(h + "mlp.router.weight")
        out[m + "mlp.router.bias"] = sd.pop(h + "mlp.router.bias")
        x = h + "mlp.experts."
        gate_up, down = (_expert_weights(sd, x, p, where) for p in _PROJS)
        gate_up_bias, down_bias = sd.pop(x + "gate_up_proj_bias"), sd.pop(x + "down_proj_bias")
        for e in range(meta["num_experts"]):
            ours = f"{m}mlp.experts.local_experts.{e}."
            out[ours + "linear_fc1.weight"] = _deinterleave(gate_up[e])
            out[ours + "linear_fc1.bias"] = _deinterleave(gate_up_bias[e])
            out[ours + "linear_fc2.weight"] = down[e].contiguous()
            out[ours + "linear_fc2.bias"] = down_bias[e].clone()
        del gate_up, down, gate_up_bias, down_bias
    return {k: v.contiguous() for k, v in out.items()}


def to_hf(weights: dict[str, torch.Tensor], meta: dict) -> dict[str, torch.Tensor]:
    """Our full tensors -> HF state dict in the on-disk layout, experts unquantized (no lm_head when tied)."""
    out = llama.to_hf({k: v for k, v in weights.items() if ".mlp." not in k and not k.endswith(_SINKS)}, meta)
    for i in range(meta["num_layers"]):
        h, m = f"model.layers.{i}.", f"{_OURS}decoder.layers.{i}."
        out[h + "self_attn.sinks"] = weights[m + _SINKS]
        out[h + "mlp.router.weight"] = weights[m + "mlp.router.weight"]
        out[h + "mlp.router.bias"] = weights[m + "mlp.router.bias"]
        experts = [f"{m}mlp.experts.local_experts.{e}." for e in range(meta["num_experts"])]
        x = h + "mlp.experts."
        out[x + "gate_up_proj"] = torch.stack([_interleave(weights[p + "linear_fc1.weight"]).T for p in experts])
        out[x + "gate_up_proj_bias"] = torch.stack([_interleave(weights[p + "linear_fc1.bias"]) for p in experts])
        out[x + "down_proj"] = torch.stack([weights[p + "linear_fc2.weight"].T for p in experts])
        out[x + "down_proj_bias"] = torch.stack([weights[p + "linear_fc2.bias"] for p in experts])
    return {k: v.clone(memory_format=torch.contiguous_format) for k, v in out.items()}


# ---- the family object

class GptOssFamily(VariantFamily):
    def meta_from_config(self, cfg, where: str) -> tuple[dict, dict]:
        meta = full_meta(meta_from_config(cfg, where))
        return meta, {"hidden_dropout": 0.0, "attention_dropout": float(getattr(cfg, "attention_dropout", 0.0) or 0.0)}

    def attention_window(self, cfg) -> dict | None:
        window, sliding = sliding_layers(cfg)
        return {"tokens": window, "layers": sliding} if sliding else None

    def _quantized(self, input_dir: str, cfg, meta: dict) -> frozenset:
        """The (layer, projection) pairs the files store as MXFP4: those whose {p}_blocks are there
        (transformers' dequantizing loader takes either form, tensor by tensor, with quant_method mxfp4)."""
        names = stored_tensor_names(input_dir) or set()
        out = frozenset((i, p) for i in range(meta["num_layers"]) for p in _PROJS
                        if f"model.layers.{i}.mlp.experts.{p}_blocks" in names)
        if out and _quant_method(cfg) != "mxfp4":
            i, p = min(out)
            raise UserError(f"{input_dir}: the weight files hold MXFP4 experts (model.layers.{i}.mlp.experts."
                            f"{p}_blocks) "
                            "but config.json has no quantization_config with quant_method mxfp4, without which "
                            "transformers does not read them: restore the release's config.json")
        for i, p in sorted(out):
            cols = meta["hidden_size"] if p == "gate_up_proj" else meta["moe_ffn_hidden_size"]
            if cols % mxfp4.BLOCK:
                raise UserError(f"{input_dir}: model.layers.{i}.mlp.experts.{p}_blocks: MXFP4 needs rows of whole "
                                f"blocks of {mxfp4.BLOCK}, and {p}'s inputs are {cols}")
        return out

    def read_state(self, input_dir: str, cfg, meta: dict) -> dict[str, torch.Tensor]:
        sd = read_checked_state_dict(input_dir, meta, hf_shapes(meta, self._quantized(input_dir, cfg, meta)),
                                     self.architecture, " (layers, experts and tying must agree)")
        return from_hf(sd, meta, input_dir)

    def why_not(self, meta: dict) -> str | None:
        meta, arch = full_meta(meta), self.architecture
        if meta["num_experts"] is None:
            return f"{arch} has experts in every layer (num_experts=None)"
        if meta["position_embedding_type"] not in ("rope", "yarn"):
            return f"{arch} has rotary positions (position_embedding_type={meta['position_embedding_type']!r})"
        needs = (("normalization", "RMSNorm", "RMSNorm"),
                 ("quick_geglu", True, "quick-GeGLU experts (--quick-geglu)"),
                 ("glu_linear_offset", 1.0, "experts computing (up + 1) (--glu-linear-offset 1)"),
                 ("softmax_type", "learnable", "attention sinks (--softmax-type learnable)"),
                 ("add_bias_linear", True, "biases on every linear layer"), ("qk_layernorm", False, "no q/k norms"),
                 ("rotary_percent", 1.0, "RoPE on the whole head"),
                 ("moe_router_score_function", "softmax", "a softmax router"),
                 ("moe_router_pre_softmax", False, "a softmax over the top-k logits (no --moe-router-pre-softmax)"),
                 ("moe_router_topk_scaling_factor", None, "no top-k scaling factor"),
                 ("moe_router_group_topk", None, "no group-limited routing"),
                 ("moe_router_enable_expert_bias", False, "no router expert bias"),
                 ("moe_shared_expert_intermediate_size", None, "no shared expert"),
                 ("moe_expert_capacity_factor", None, "no expert capacity (it drops no tokens)"))
        for key, want, what in needs:
            if meta.get(key) != want:
                return f"{arch} has {what} ({key}={meta.get(key)!r})"
        if meta["activation_func_clamp_value"] is None:
            return f"{arch}'s experts clamp (swiglu_limit; activation_func_clamp_value=None)"
        if not all(_moe_layers(meta)):
            return f"{arch} has experts in every layer (moe_layer_freq={meta['moe_layer_freq']!r})"
        if meta["moe_router_topk"] == 1:
            return f"{arch}'s top-1 weight is 1, which megatron-core's top-1 routing is not (moe_router_topk=1)"
        if meta["num_attention_heads"] % query_groups(meta):
            return f"num_query_groups {query_groups(meta)} does not divide the heads"
        return self._config_refuses(meta)

    def to_hf_state(self, weights: dict[str, torch.Tensor], meta: dict) -> dict[str, torch.Tensor]:
        return to_hf(weights, full_meta(meta))

    def config_json_extra(self, meta: dict) -> dict:
        """transformers 4.x's rope keys beside 5.x's rope_parameters (as the Llama family writes them)."""
        v5, v4 = _rope_schemas(full_meta(meta))
        return v4 if llama._reads_rope_parameters(self._config_class()) else v5

    def hf_config(self, meta: dict, *, dtype: str, args: dict, bos_token_id, eos_token_id, window: dict | None = None):
        meta = full_meta(meta)
        cls = self._config_class()
        n = meta["num_layers"]
        layers = window["layers"] if window is not None else []
        extra = {"swiglu_alpha": QUICK_GELU_ALPHA} if "swiglu_alpha" in getattr(cls, "__dataclass_fields__", {}) else {}
        return cls(vocab_size=meta["vocab_size"], hidden_size=meta["hidden_size"],
                   intermediate_size=meta["moe_ffn_hidden_size"], num_hidden_layers=n,
                   num_attention_heads=meta["num_attention_heads"], num_key_value_heads=query_groups(meta),
                   head_dim=meta["kv_channels"], max_position_embeddings=meta["max_position_embeddings"],
                   rms_norm_eps=meta["layernorm_epsilon"],
                   tie_word_embeddings=not meta["untie_embeddings_and_output_weights"], attention_bias=True,
                   attention_dropout=float(args.get("attention_dropout") or 0.0), bos_token_id=bos_token_id,
                   eos_token_id=eos_token_id, architectures=[self.architecture], dtype=dtype,
                   num_local_experts=meta["num_experts"], num_experts_per_tok=meta["moe_router_topk"],
                   swiglu_limit=float(meta["activation_func_clamp_value"]), output_router_logits=False,
                   # transformers builds the sliding mask in every forward: a window no layer reads without one
                   sliding_window=window["tokens"] if window is not None else meta["max_position_embeddings"],
                   layer_types=["sliding_attention" if i in layers else "full_attention" for i in range(n)],
                   **_rope_config(cls, meta), **extra)


def _rope_schemas(meta: dict) -> tuple[dict, dict]:
    """hf/llama.py's two rope schemas, YaRN's beta_fast and beta_slow always said (as OpenAI's configs say them;
    hf/rope.py writes only what differs from the defaults, the same RoPE)."""
    v5, v4 = llama._rope_schemas(meta)
    if meta["position_embedding_type"] == "yarn":
        betas = {"beta_fast": float(meta["yarn_beta_fast"]), "beta_slow": float(meta["yarn_beta_slow"])}
        v5 = {"rope_parameters": {**v5["rope_parameters"], **betas}}
        v4 = {**v4, "rope_scaling": {**v4["rope_scaling"], **betas}}
    return v5, v4


def _rope_config(cls, meta: dict) -> dict:
    v5, v4 = _rope_schemas(meta)
    return v5 if llama._reads_rope_parameters(cls) else v4


def _moe_layers(meta: dict) -> list[bool]:
    from zo_megatron.model.config import ARCH_FIELDS, GPTConfig

    return GPTConfig(**{k: meta[k] for k in ARCH_FIELDS}, precision="fp32").moe_layers()


FAMILY = GptOssFamily(Variant())
