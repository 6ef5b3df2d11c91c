"""A checkpoint's model architecture (`meta`: GPTConfig field values) for the offline tools.

Checkpoints record the architecture fields (manifest "model"); those written before the Llama
family existed record only the GPT-2 shape, and the other fields then take GPT-2's values. From
the fields alone the tools know every parameter's full shape (`param_shapes`, checked against
the built model by the tests) and which TP sizes can hold the model.
"""
from __future__ import annotations

import dataclasses

from zo_megatron.checkpoint.tp_layout import gated_mlp
from zo_megatron.errors import UserError
from zo_megatron.model.config import ARCH_FIELDS, MOE_FIELDS, YARN_FIELDS, GPTConfig, megatron_bias_gelu_fusion
from zo_megatron.planner.window import window_layers

# GPTConfig's defaults (GPT-2) for the fields an old checkpoint does not record
DEFAULTS = {f.name: f.default for f in dataclasses.fields(GPTConfig)
            if f.name in ARCH_FIELDS and f.name not in ("num_layers", "hidden_size", "num_attention_heads",
                                                         "vocab_size", "max_position_embeddings", "ffn_hidden_size")}
_PREFIX = "gpt."


def full_meta(meta: dict) -> dict:
    """Every ARCH_FIELDS field as the job records it (GPTConfig.arch_meta: FFN size, query groups
    and head dim resolved), the unrecorded ones at GPT-2's values; an impossible architecture is
    GPTConfig's one-line ConfigError."""
    known = {k: v for k, v in {**DEFAULTS, **meta}.items() if k in ARCH_FIELDS}
    return GPTConfig(**known, precision="fp32").arch_meta()


def recentred_gamma(weights: dict, meta: dict, *, zero_centred: bool) -> tuple[dict, dict]:
    """The same model with its norms' gamma convention switched to `zero_centred`: a zero-centred
    gamma (--apply-layernorm-1p: each norm scales by 1 + weight) as ordinary norms (scale = weight) by
    adding 1 to every norm weight, what Hugging Face's LayerNorm/RMSNorm classes express; or the
    other way, subtracting 1, for a class that scales by 1 + weight (Nemotron's LayerNorm1P). Exact
    in the fp32 of the master weights where the model already has the convention asked (no change)."""
    if bool(meta.get("layernorm_zero_centered_gamma")) == zero_centred:
        return weights, meta
    step = -1 if zero_centred else 1
    out = {k: (v + step if k.endswith("layernorm.weight") else v) for k, v in weights.items()}
    return out, {**meta, "layernorm_zero_centered_gamma": zero_centred}


def query_groups(meta: dict) -> int:
    return meta.get("num_query_groups") or meta["num_attention_heads"]


def head_dim(meta: dict) -> int:
    return meta.get("kv_channels") or meta["hidden_size"] // meta["num_attention_heads"]


def param_shapes(meta: dict) -> dict[str, tuple[int, ...]]:
    """Full unpadded shape of every parameter of the GPTModel `meta` describes (our names)."""
    meta = full_meta(meta)
    h, v = meta["hidden_size"], meta["vocab_size"]
    q, kv = meta["num_attention_heads"] * head_dim(meta), query_groups(meta) * head_dim(meta)
    layer_norm = meta["normalization"] == "LayerNorm"
    bias, qkv_bias = meta["add_bias_linear"], meta["add_bias_linear"] or meta["add_qkv_bias"]
    moe = GPTConfig(**{k: meta[k] for k in ARCH_FIELDS}, precision="fp32").moe_layers()

    def norm(name):
        return {name + ".weight": (h,), **({name + ".bias": (h,)} if layer_norm else {})}

    out = {_PREFIX + "embedding.word_embeddings.weight": (v, h)}
    if meta["position_embedding_type"] == "learned_absolute":
        out[_PREFIX + "embedding.position_embeddings.weight"] = (meta["max_position_embeddings"], h)
    for i in range(meta["num_layers"]):
        m = f"{_PREFIX}decoder.layers.{i}."
        out.update(norm(m + "input_layernorm"))
        if meta["multi_latent_attention"]:
            out.update(_mla_shapes(meta, m + "self_attention."))
        else:
            out[m + "self_attention.linear_qkv.weight"] = (q + 2 * kv, h)
        if qkv_bias and not meta["multi_latent_attention"]:
            out[m + "self_attention.linear_qkv.bias"] = (q + 2 * kv,)
        if meta["qk_layernorm"] and not meta["multi_latent_attention"]:
            out.update({m + "self_attention.q_layernorm.weight": (head_dim(meta),),
                        m + "self_attention.k_layernorm.weight": (head_dim(meta),)})
            if layer_norm:
                out.update({m + "self_attention.q_layernorm.bias": (head_dim(meta),),
                            m + "self_attention.k_layernorm.bias": (head_dim(meta),)})
        if meta["softmax_type"] == "learnable":              # attention sinks: one offset per head
            out[m + "self_attention.core_attention.softmax_offset"] = (meta["num_attention_heads"],)
        out[m + "self_attention.linear_proj.weight"] = (h, meta["num_attention_heads"] * meta["v_head_dim"]) \
            if meta["multi_latent_attention"] else (h, q)
        out.update(norm(m + "pre_mlp_layernorm"))
        if bias:
            out[m + "self_attention.linear_proj.bias"] = (h,)
        out.update(_mlp_shapes(meta, m + "mlp.", moe[i]))
    out.update(norm(_PREFIX + "decoder.final_layernorm"))
    if meta["untie_embeddings_and_output_weights"]:
        out[_PREFIX + "output_layer.weight"] = (v, h)
    return out


def _mla_shapes(meta: dict, a: str) -> dict[str, tuple[int, ...]]:
    """Multi-latent attention's projections and latent norms under `a` (".../self_attention."; model/mla.py):
    the query latent's down/up projections (or one query projection), the key/value latent's down projection
    (with the shared rotated key) and up projection [keys without position; values] per head."""
    h, n, r_q, r_kv = meta["hidden_size"], meta["num_attention_heads"], meta["q_lora_rank"], meta["kv_lora_rank"]
    q_head = meta["qk_head_dim"] + meta["qk_pos_emb_head_dim"]
    if r_q is None:
        out = {a + "linear_q_proj.weight": (n * q_head, h)}
    else:
        out = {a + "linear_q_down_proj.weight": (r_q, h), a + "linear_q_up_proj.weight": (n * q_head, r_q)}
    out.update({a + "linear_kv_down_proj.weight": (r_kv + meta["qk_pos_emb_head_dim"], h),
                a + "linear_kv_up_proj.weight": (n * (meta["qk_head_dim"] + meta["v_head_dim"]), r_kv)})
    if meta["qk_layernorm"]:
        for name, size in (("q_layernorm", r_q), ("kv_layernorm", r_kv)):
            if size is not None:
                out[f"{a}{name}.weight"] = (size,)
                if meta["normalization"] == "LayerNorm":
                    out[f"{a}{name}.bias"] = (size,)
    return out


def buffer_shapes(meta: dict) -> dict[str, tuple[int, ...]]:
    """The persistent buffers of that GPTModel that are not parameters (content.py `buffers/`): each
    MoE layer's router expert bias (--moe-router-enable-expert-bias, fp32 [E]); none otherwise."""
    meta = full_meta(meta)
    if not meta["moe_router_enable_expert_bias"]:
        return {}
    moe = GPTConfig(**{k: meta[k] for k in ARCH_FIELDS}, precision="fp32").moe_layers()
    return {f"{_PREFIX}decoder.layers.{i}.mlp.router.expert_bias": (meta["num_experts"],)
            for i in range(meta["num_layers"]) if moe[i]}


def _mlp_shapes(meta: dict, m: str, moe: bool) -> dict[str, tuple[int, ...]]:
    """The MLP's parameters under `m` (".../mlp."): the dense MLP, or the router, every expert (by
    global index) and the shared expert with its gate (model/gpt.py's docstring)."""
    h, bias = meta["hidden_size"], meta["add_bias_linear"]

    def mlp(prefix, f, with_bias):
        fc1 = 2 * f if gated_mlp(meta) else f
        out = {prefix + "linear_fc1.weight": (fc1, h), prefix + "linear_fc2.weight": (h, f)}
        if with_bias:
            out.update({prefix + "linear_fc1.bias": (fc1,), prefix + "linear_fc2.bias": (h,)})
        return out

    if not moe:
        return mlp(m, meta["ffn_hidden_size"], bias)
    e = meta["num_experts"]
    out = {m + "router.weight": (e, h), **({m + "router.bias": (e,)} if bias else {})}
    for j in range(e):
        out.update(mlp(f"{m}experts.local_experts.{j}.", meta["moe_ffn_hidden_size"], bias))
    if meta["moe_shared_expert_intermediate_size"]:
        out.update(mlp(m + "shared_experts.", meta["moe_shared_expert_intermediate_size"], False))
        if meta["moe_shared_expert_gate"]:
            out[m + "shared_experts.gate_weight"] = (1, h)
    return out


def _moe_flags(m: dict) -> list[str]:
    """The MoE flags (Megatron-LM's names) of the fields that differ from Megatron-LM's defaults."""
    if m["num_experts"] is None:
        return []
    flags = []
    for name, default in MOE_FIELDS.items():
        value = m[name]
        if name == "moe_ffn_hidden_size" and value == m["ffn_hidden_size"]:
            continue
        if value == default:
            continue
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag)
        elif isinstance(value, list):
            flags.append(f"{flag} [{','.join(str(x) for x in value)}]")      # one word: the list, no spaces
        else:
            flags.append(f"{flag} {num(value) if isinstance(value, float) else value}")
    return flags


def needs_no_bias_gelu_fusion(meta: dict) -> bool:
    """Megatron-LM needs --no-bias-gelu-fusion for the model: a biased non-gated MLP whose activation is
    not the fused tanh GELU (the erf GELU, or the squared ReLU, which megatron-core refuses to fuse);
    without biases its validate_args turns the fusion off itself."""
    return not gated_mlp(meta) and meta["add_bias_linear"] and \
        (meta["squared_relu"] or meta["gelu_approximate"] == "none")


def job_flags(meta: dict, hf_tokenizer: bool = False) -> str:
    """pretrain_gpt.py's flags (Megatron-LM's names) for the architecture `meta`: what a run that
    loads the checkpoint must be given (a resume with other values is refused). hf_tokenizer: the
    run uses a Hugging Face tokenizer, whose length need not be the model's vocabulary (Qwen2's
    config has 151936 rows, its tokenizer 151646 tokens), so the vocabulary is always given as
    --vocab-size: the flags stay right whatever the tokenizer's length, and no tokenizer is read."""
    m = full_meta(meta)
    flags = [f"--num-layers {m['num_layers']}", f"--hidden-size {m['hidden_size']}",
             f"--num-attention-heads {m['num_attention_heads']}", f"--ffn-hidden-size {m['ffn_hidden_size']}",
             f"--max-position-embeddings {m['max_position_embeddings']}"]
    if m["position_embedding_type"] != "learned_absolute":
        flags += [f"--position-embedding-type {m['position_embedding_type']}", f"--rotary-base {m['rotary_base']}"]
        if m["rotary_percent"] != 1.0:
            flags.append(f"--rotary-percent {m['rotary_percent']:g}")
        if m["use_rope_scaling"]:
            flags += ["--use-rope-scaling", f"--rope-scaling-factor {m['rope_scaling_factor']:g}"]
        flags += _yarn_flags(m)
    if m["normalization"] != "LayerNorm":
        flags.append(f"--normalization {m['normalization']}")
    if m["layernorm_epsilon"] != DEFAULTS["layernorm_epsilon"]:
        flags.append(f"--norm-epsilon {m['layernorm_epsilon']:g}")
    if m["swiglu"]:
        flags.append("--swiglu")
    elif m["quick_geglu"]:
        flags.append("--quick-geglu")
    elif m["squared_relu"]:
        flags.append("--squared-relu")
    elif megatron_bias_gelu_fusion(m["gelu_approximate"], m["add_bias_linear"]) is None:
        flags.append("--use-checkpoint-args")          # no flag gives a bias-free tanh GELU (Megatron-LM's rule)
    if needs_no_bias_gelu_fusion(m):
        flags.append("--no-bias-gelu-fusion")
    if m["glu_linear_offset"]:
        flags.append(f"--glu-linear-offset {num(m['glu_linear_offset'])}")
    if m["activation_func_clamp_value"] is not None:
        flags.append(f"--activation-func-clamp-value {num(m['activation_func_clamp_value'])}")
    if m["softmax_type"] != "vanilla":
        flags.append(f"--softmax-type {m['softmax_type']}")
    if m["num_query_groups"] != m["num_attention_heads"]:
        flags += ["--group-query-attention", f"--num-query-groups {m['num_query_groups']}"]
    flags += _mla_flags(m)
    if m["kv_channels"] != m["hidden_size"] // m["num_attention_heads"]:
        flags.append(f"--kv-channels {m['kv_channels']}")
    if m["untie_embeddings_and_output_weights"]:
        flags.append("--untie-embeddings-and-output-weights")
    if not m["add_bias_linear"]:
        flags.append("--disable-bias-linear")
        if m["add_qkv_bias"]:
            flags.append("--add-qkv-bias")
    if m["qk_layernorm"]:
        flags.append("--qk-layernorm")
    if m["layernorm_zero_centered_gamma"]:
        flags.append("--apply-layernorm-1p")
    flags += _moe_flags(m) + window_flags(m)
    if m["make_vocab_size_divisible_by"] != DEFAULTS["make_vocab_size_divisible_by"]:
        flags.append(f"--make-vocab-size-divisible-by {m['make_vocab_size_divisible_by']}")
    if hf_tokenizer:
        flags.append(f"--vocab-size {m['vocab_size']}")
    return " ".join(flags)


def window_flags(m: dict) -> list[str]:
    """The sliding window's flags (Megatron-LM's names), and --use-flash-attn where a layer slides: the job runs
    the window on torch SDPA only (model/config.py refuses megatron-core's local attention with it)."""
    if m["window_size"] is None:
        return []
    freq = m["window_attn_skip_freq"]
    flags = [f"--window-size {m['window_size'][0]},{m['window_size'][1]}"]
    if freq is not None:
        text = freq if isinstance(freq, int) else "[" + ",".join(map(str, freq)) + "]"     # one word, as MoE's
        flags.append(f"--window-attn-skip-freq {text}")
    return flags + ["--use-flash-attn"] * any(window_layers(m["window_size"], freq, m["num_layers"]))


def mla_size_flags(m: dict) -> list[str]:
    """Multi-latent attention's own flags (Megatron-LM's names), all of them, as Megatron-LM's MLA lines give
    them; none without MLA."""
    if not m["multi_latent_attention"]:
        return []
    return ["--multi-latent-attention", *([f"--q-lora-rank {m['q_lora_rank']}"] if m["q_lora_rank"] else []),
            f"--kv-lora-rank {m['kv_lora_rank']}", f"--qk-head-dim {m['qk_head_dim']}",
            f"--qk-pos-emb-head-dim {m['qk_pos_emb_head_dim']}", f"--v-head-dim {m['v_head_dim']}",
            f"--rope-type {m['rope_type']}"]


def _mla_flags(m: dict) -> list[str]:
    """mla_size_flags and YaRN's settings, which MLA reads whatever its rope type (model/config.py
    _check_yarn), where they are not the defaults."""
    if not m["multi_latent_attention"]:
        return []
    flags = mla_size_flags(m)
    if m["position_embedding_type"] == "learned_absolute":     # MLA rotates with these whatever the positions
        flags += [f"--rotary-base {m['rotary_base']}"] * (m["rotary_base"] != DEFAULTS["rotary_base"]) + \
            [f"--rotary-percent {m['rotary_percent']:g}"] * (m["rotary_percent"] != 1.0)
    # (GPTConfig refuses --position-embedding-type yarn under MLA: _yarn_flags writes nothing for it)
    return flags + _non_default_yarn(m, ("rotary_scaling_factor", "yarn_original_max_position_embeddings",
                                         "yarn_beta_fast", "yarn_beta_slow", "mscale", "mscale_all_dim"))


def _non_default_yarn(m: dict, names) -> list[str]:
    """The flags of YaRN's settings `names` that are not megatron-core's defaults."""
    return [f"--{name.replace('_', '-')} {num(m[name])}" for name in names if m[name] != YARN_FIELDS[name]]


def num(x: float) -> str:
    """A float as short as it reads back exactly (a resume compares the values)."""
    return f"{x:g}" if float(f"{x:g}") == x else repr(float(x))


def _yarn_flags(m: dict) -> list[str]:
    """YaRN's flags (Megatron-LM's names): the factor and original context always, the rest when not
    megatron-core's defaults."""
    if m["position_embedding_type"] != "yarn":
        return []
    flags = [f"--rotary-scaling-factor {num(m['rotary_scaling_factor'])}",
             f"--yarn-original-max-position-embeddings {m['yarn_original_max_position_embeddings']}",
             *_non_default_yarn(m, ("yarn_beta_fast", "yarn_beta_slow", "mscale", "mscale_all_dim"))]
    if not m["yarn_correction_range_round_to_int"]:
        flags.append("--no-yarn-correction-range-round-to-int")
    return flags


def check_tensor_parallel(meta: dict, tp: int, flag: str = "--tensor-parallel") -> None:
    """TP splits whole query groups (so whole heads) and whole MLP columns."""
    if tp < 1:
        raise UserError(f"{flag} {tp}: must be >= 1")
    mla = (("q_lora_rank", meta.get("q_lora_rank") or 0),
           ("kv_lora_rank + qk_pos_emb_head_dim", meta["kv_lora_rank"] + meta["qk_pos_emb_head_dim"])) \
        if meta.get("multi_latent_attention") else ()
    for what, n in (("num_attention_heads", meta["num_attention_heads"]), ("query groups", query_groups(meta)),
                    ("ffn_hidden_size", meta["ffn_hidden_size"]), *mla):
        if n % tp:
            raise UserError(f"{flag} {tp} does not divide the model's {what} {n}: TP splits whole query groups, "
                            f"heads and MLP columns; choose a TP size that divides {n}")
