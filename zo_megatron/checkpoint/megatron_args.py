"""Megatron-LM's saved args <-> the model's architecture (GPTConfig fields), both ways.

`megatron_args` writes the args Megatron-LM's loader reads for a model (its argument names, its
validate_args' forms); `meta_from_args` reads a Megatron-LM checkpoint's args back into the
architecture, refusing in one line what zo_megatron's GPT does not build (an allow-list:
megatron_allow.py). The files themselves are megatron_lm.py's (torch format) and
megatron_dist.py's (torch_dist).
"""
from __future__ import annotations

import argparse

from zo_megatron.checkpoint.arch import full_meta, head_dim, mla_size_flags, num, query_groups
from zo_megatron.checkpoint.megatron_allow import non_neutral
from zo_megatron.checkpoint.megatron_lm import legacy_rank_files
from zo_megatron.checkpoint.tp_layout import padded_vocab_size
from zo_megatron.errors import UserError
from zo_megatron.model.config import (MLA_FIELDS, MOE_DISPATCHERS, MOE_FIELDS, ROPE_TYPES, YARN_FIELDS,
                                      megatron_bias_gelu_fusion, megatron_gelu, rotary_base)

# megatron-core 0.16.1's MLATransformerConfig defaults (tests check them against the class): what Megatron-LM
# builds an MLA model with for a field its args lack. Its core_transformer_config_from_args passes every field
# the args have (MLA's YaRN original context and betas are no args in core_v0.16.1 nor core_v0.19: always these);
# our YARN_FIELDS' names for them.
MLA_CONFIG_DEFAULTS = {"q_lora_rank": 512, "kv_lora_rank": 512, "qk_head_dim": 128, "qk_pos_emb_head_dim": 64,
                       "v_head_dim": 128, "rope_type": "yarn", "rotary_scaling_factor": 40.0, "mscale": 1.0,
                       "mscale_all_dim": 0.0, "yarn_original_max_position_embeddings": 4096, "yarn_beta_fast": 32.0,
                       "yarn_beta_slow": 1.0}
# the YaRN settings Megatron-LM's args give MLA (its mla group's flags)
MLA_YARN_ARGS = ("rotary_scaling_factor", "mscale", "mscale_all_dim")


def megatron_args(meta: dict, *, tp: int, iteration: int, divisible_by: int, seq_length: int | None,
                  precision: str | None, tokenizer_type: str = "GPT2BPETokenizer", tokenizer_model: str | None = None,
                  consumed_samples: int = 0, consumed_valid_samples: int = 0,
                  expert_parallel: int = 1, expert_tensor_parallel: int | None = None,
                  grouped_gemm: bool = False, ckpt_format: str = "torch",
                  transformer_impl: str = "local") -> argparse.Namespace:
    """The args Megatron-LM reads from a checkpoint (its argument names), for the model `meta`;
    grouped_gemm: the experts as a --moe-grouped-gemm run holds them (write());
    ckpt_format: the files' format (torch_dist holds any expert layout: its tensors are global);
    transformer_impl: Megatron-LM's --transformer-impl whose layer names the files hold."""
    meta = full_meta(meta)
    h, heads, groups = meta["hidden_size"], meta["num_attention_heads"], query_groups(meta)
    rope = meta["position_embedding_type"] == "rope"
    return argparse.Namespace(
        num_layers=meta["num_layers"], hidden_size=h, ffn_hidden_size=meta["ffn_hidden_size"],
        num_attention_heads=heads, kv_channels=head_dim(meta), group_query_attention=groups != heads,
        num_query_groups=groups, max_position_embeddings=meta["max_position_embeddings"],
        seq_length=seq_length or meta["max_position_embeddings"],
        position_embedding_type=meta["position_embedding_type"], add_position_embedding=True,
        use_rotary_position_embeddings=rope, rotary_base=meta["rotary_base"], rotary_percent=meta["rotary_percent"],
        rotary_interleaved=False, rotary_seq_len_interpolation_factor=None, use_rope_scaling=meta["use_rope_scaling"],
        rope_scaling_factor=meta["rope_scaling_factor"], **_yarn_args(meta), **_mla_args(meta),
        make_vocab_size_divisible_by=divisible_by, vocab_size=meta["vocab_size"],
        padded_vocab_size=padded_vocab_size(meta["vocab_size"], divisible_by, tp), tokenizer_type=tokenizer_type,
        tokenizer_model=tokenizer_model,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=1,
        untie_embeddings_and_output_weights=meta["untie_embeddings_and_output_weights"],
        # Megatron-LM before 2026-01 names the epsilon norm_epsilon, later layernorm_epsilon (TransformerConfig's)
        normalization=meta["normalization"], norm_epsilon=meta["layernorm_epsilon"],
        layernorm_epsilon=meta["layernorm_epsilon"], apply_layernorm_1p=meta["layernorm_zero_centered_gamma"],
        qk_layernorm=meta["qk_layernorm"],
        # Megatron-LM keeps add_qkv_bias True whenever add_bias_linear is
        add_bias_linear=meta["add_bias_linear"], add_qkv_bias=meta["add_bias_linear"] or meta["add_qkv_bias"],
        swiglu=meta["swiglu"], squared_relu=meta["squared_relu"], openai_gelu=False,
        bias_gelu_fusion=_bias_gelu_fusion(meta),
        # GPT-OSS's MLP and attention sinks (TransformerConfig fields, Megatron-LM's flags of the same names)
        quick_geglu=meta["quick_geglu"], glu_linear_offset=meta["glu_linear_offset"],
        activation_func_clamp_value=meta["activation_func_clamp_value"], softmax_type=meta["softmax_type"],
        transformer_impl=transformer_impl, **_window_args(meta),
        ckpt_format=ckpt_format, bf16=precision == "bf16", fp16=precision == "fp16", iteration=iteration,
        consumed_train_samples=consumed_samples, consumed_valid_samples=consumed_valid_samples,
        **_moe_args(meta, tp, expert_parallel, expert_tensor_parallel, grouped_gemm, ckpt_format))


def _bias_gelu_fusion(meta: dict) -> bool:
    """Megatron-LM's bias_gelu_fusion for the model's GELU (model/config.py megatron_bias_gelu_fusion)."""
    if meta["swiglu"] or meta["quick_geglu"]:
        return meta["add_bias_linear"]          # as Megatron-LM's validate_args leaves it; a gated MLP does not read it
    if meta["squared_relu"]:
        return False                            # megatron-core fuses only GELU and SwiGLU with a bias (it refuses this)
    fusion = megatron_bias_gelu_fusion(meta["gelu_approximate"], meta["add_bias_linear"])
    if fusion is None:
        raise UserError("the MLP's GELU is the tanh approximation without linear biases: megatron-core's GPT "
                        "computes the erf GELU there (its tanh GELU is the fused bias-GELU), so the weights would "
                        "compute another function in Megatron-LM: nothing is written (no Megatron-LM flag computes "
                        "this model; train it on with zo_megatron, --use-checkpoint-args)")
    return fusion


def _window_args(meta: dict) -> dict:
    """The sliding window's args as Megatron-LM's parser gives them (tuple_type, moe_freq_type; the same
    semantics: planner/window.py); none without one (the args are then what they were before windows).
    Its --use-checkpoint-args does not take them: to-megatron names the flags its launch needs."""
    if meta["window_size"] is None:
        return {}
    return {"window_size": tuple(meta["window_size"]), "window_attn_skip_freq": meta["window_attn_skip_freq"]}


def _moe_args(meta: dict, tp: int, ep: int, etp: int | None, grouped_gemm: bool, ckpt_format: str) -> dict:
    """The MoE args under Megatron-LM's names (its validate_args' forms: one load-balancing type and
    one aux-loss coefficient as plain values, expert TP (default TP), moe_ffn_hidden_size resolved);
    none for a dense model (then the args are what they were before MoE)."""
    if meta["num_experts"] is None:
        if ep != 1:
            raise UserError(f"--expert-model-parallel-size {ep}: the model is dense (no experts); use 1")
        if grouped_gemm:
            raise UserError("--moe-grouped-gemm: the model is dense (no experts); drop it")
        return {}
    if grouped_gemm and meta["add_bias_linear"]:
        # megatron-core 0.16.1's GroupedMLP asserts add_bias_linear is False; its TEGroupedMLP holds biases only
        # without bias_dropout_fusion (Megatron-LM's default is on), which no file records: not written either
        raise UserError("--moe-grouped-gemm: the experts have biases (add_bias_linear), which megatron-core's "
                        "GroupedMLP does not hold (and TEGroupedMLP only without Megatron-LM's default bias-dropout "
                        "fusion); drop --moe-grouped-gemm (SequentialMLP's files)")
    e = meta["num_experts"]
    if ep < 1 or e % ep:
        raise UserError(f"--expert-model-parallel-size {ep} does not divide the model's {e} experts: each EP rank "
                        f"holds E/EP whole experts; choose one that divides {e}")
    etp = etp or tp
    if meta["moe_ffn_hidden_size"] % etp:
        raise UserError(f"--expert-tensor-parallel-size {etp} does not divide the experts' FFN size "
                        f"{meta['moe_ffn_hidden_size']}: each expert splits over expert TP as the MLP over TP; "
                        "choose one that divides it")
    if ckpt_format == "torch":
        legacy_rank_files(tp, etp, ep)          # (refuses a layout Megatron-LM's torch format cannot hold)
    return {**{k: meta[k] for k in MOE_FIELDS}, "expert_model_parallel_size": ep, "expert_tensor_parallel_size": etp,
            "moe_grouped_gemm": grouped_gemm, "moe_use_legacy_grouped_gemm": False,
            # Megatron-LM needs sequence parallelism for MoE with TP (the math is the same)
            "sequence_parallel": tp > 1}


def _yarn_args(meta: dict) -> dict:
    """YaRN's args under Megatron-LM's names (core_v0.19 on: --position-embedding-type yarn, its
    --yarn-* flags, the MLA group's --rotary-scaling-factor, --mscale, --mscale-all-dim); none for
    another position embedding (the args then are what they were before YaRN)."""
    return {k: meta[k] for k in YARN_FIELDS} if meta["position_embedding_type"] == "yarn" else {}


def _mla_args(meta: dict) -> dict:
    """Multi-latent attention's args under Megatron-LM's names (its mla group, --multi-latent-attention and
    --rope-type, resolved); none without MLA (the args then are what they were before MLA). One line for a
    model Megatron-LM's MLA cannot build: YaRN with another original context or betas than
    MLATransformerConfig's, which no Megatron-LM arg sets."""
    if not meta["multi_latent_attention"]:
        return {}
    fixed = ("yarn_original_max_position_embeddings", "yarn_beta_fast", "yarn_beta_slow")
    off = [f"{k}={meta[k]!r}" for k in fixed if meta[k] != MLA_CONFIG_DEFAULTS[k]]
    if meta["rope_type"] == "yarn" and off:
        raise UserError(f"multi-latent attention with YaRN's {', '.join(off)}: Megatron-LM's MLA takes no arg for "
                        "them (core_v0.16.1 builds its YaRN with MLATransformerConfig's original context 4096, "
                        "beta_fast 32 and beta_slow 1), so the weights would compute another function there: nothing "
                        "is written (train it on with zo_megatron, --use-checkpoint-args)")
    return {**{k: meta[k] for k in MLA_FIELDS}, **{k: meta[k] for k in MLA_YARN_ARGS}, "cache_mla_latents": False}


def mla_launch_flags(meta: dict) -> list[str]:
    """The flags a Megatron-LM launch that loads an MLA model must give: its --use-checkpoint-args
    (core_v0.16.1 load_args_from_checkpoint) takes none of them from the args, and without the YaRN ones
    its MLA computes another function (its own defaults)."""
    if not meta["multi_latent_attention"]:
        return []
    return [*mla_size_flags(meta), *(f"--{k.replace('_', '-')} {num(meta[k])}" for k in MLA_YARN_ARGS),
            *(["--qk-layernorm"] if meta["qk_layernorm"] else [])]


def _mla_meta(args: argparse.Namespace, refuse) -> dict:
    """Multi-latent attention's fields from Megatron-LM's args, as its core_transformer_config_from_args builds
    MLATransformerConfig: every field the args hold, the class's defaults for the rest (YaRN's original
    context and betas always); rope_type None is the class's 'yarn'. Without MLA: none, and rope_type must
    be 'rope' or None (Megatron-LM's own assertion)."""
    rope_type = getattr(args, "rope_type", None)
    if not getattr(args, "multi_latent_attention", False):
        if rope_type not in (None, "rope"):
            refuse(f"args.rope_type={rope_type!r} without multi_latent_attention (Megatron-LM's attention without "
                   "MLA takes only 'rope')")
        return {}
    if rope_type not in (None, *ROPE_TYPES):
        refuse(f"args.rope_type={rope_type!r} with multi_latent_attention (megatron-core's MLA takes "
               f"{' or '.join(map(repr, ROPE_TYPES))})")

    def field(name):
        value = getattr(args, name) if hasattr(args, name) else MLA_CONFIG_DEFAULTS[name]
        if value is None and name != "q_lora_rank":             # q_lora_rank None: queries projected directly
            refuse(f"args.{name}=None with multi_latent_attention (megatron-core's MLA needs a value)")
        return value

    out = {name: field(name) for name in MLA_FIELDS if name not in ("multi_latent_attention", "rope_type")}
    out.update(multi_latent_attention=True, rope_type=rope_type or MLA_CONFIG_DEFAULTS["rope_type"],
               **{k: type(YARN_FIELDS[k])(field(k)) for k in MLA_YARN_ARGS},
               **{k: MLA_CONFIG_DEFAULTS[k] for k in ("yarn_original_max_position_embeddings", "yarn_beta_fast",
                                                      "yarn_beta_slow")},
               yarn_correction_range_round_to_int=True)          # megatron-core 0.16.1's MLA rounds the range
    for k in ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim"):
        out[k] = None if out[k] is None else int(out[k])
    if out["rope_type"] == "rope":        # MLA's plain RoPE reads no mscale (GPTConfig refuses a recorded one)
        out["mscale"] = YARN_FIELDS["mscale"]
    return out


def _yarn_meta(args: argparse.Namespace, pos: str) -> dict:
    """YaRN's fields from Megatron-LM's args, unset ones at the values Megatron-LM gives them
    (core_v0.19's _apply_yarn_config_from_args: megatron-core's YarnRotaryEmbedding defaults)."""
    if pos != "yarn":
        return {}
    return {k: type(default)(default if getattr(args, k, None) is None else getattr(args, k))
            for k, default in YARN_FIELDS.items()}


def meta_from_args(args: argparse.Namespace, vocab: int, where: str) -> dict:
    """The model's architecture (GPTConfig fields) from Megatron-LM's saved args; one line for
    what zo_megatron does not build."""
    def refuse(what):
        raise UserError(f"{where}: {what}: zo_megatron's GPT does not build it")

    bad = non_neutral(args)                     # an allow-list: every arg is read, inert or at its neutral value
    if bad:
        them = "it" if len(bad) == 1 else "them"
        raise UserError(f"{where}: {'; '.join(bad)}: zo_megatron's GPT does not build {them}, so the weights would "
                        f"compute another function; only checkpoints trained without {them} convert "
                        "(zo_megatron/checkpoint/megatron_allow.py lists what converts)")
    swiglu = bool(getattr(args, "swiglu", False))
    bias = bool(getattr(args, "add_bias_linear", True))
    squared_relu = bool(getattr(args, "squared_relu", False))
    if not swiglu and not squared_relu and not getattr(args, "quick_geglu", False) and \
            getattr(args, "use_te_activation_func", False):
        refuse("args.use_te_activation_func=True with a GELU MLP (Transformer Engine's activation op, whose GELU "
               "depends on the layer spec)")
    mla = _mla_meta(args, refuse)
    pos = "rope" if getattr(args, "use_rotary_position_embeddings", False) else \
        getattr(args, "position_embedding_type", "learned_absolute")
    if mla and pos == "none":
        pos = "rope"        # under MLA the same model: no position table, MLA rotates its queries and keys itself
    if pos not in ("learned_absolute", "rope", "yarn"):
        refuse(f"args.position_embedding_type={pos!r}")
    norm = getattr(args, "normalization", "LayerNorm")
    if norm not in ("LayerNorm", "RMSNorm"):
        refuse(f"args.normalization={norm!r}")
    h, heads = args.hidden_size, args.num_attention_heads
    eps = getattr(args, "norm_epsilon", None) or getattr(args, "layernorm_epsilon", None) or 1e-5
    ffn = getattr(args, "ffn_hidden_size", None) or (int(4 * h * 2 / 3 / 64) * 64 if swiglu else 4 * h)
    # what megatron-core's GPT ignores under MLA is read at its neutral value: its own RoPE (Llama-3.1
    # scaling: GPTModel builds none), QKV biases (MLA's projections have none), YaRN's rotary percent
    ignored = dict(use_rope_scaling=False, add_qkv_bias=False,
                   **({"rotary_percent": 1.0} if mla.get("rope_type") == "yarn" else {})) if mla else {}
    meta = dict(
        num_layers=args.num_layers, hidden_size=h, num_attention_heads=heads, ffn_hidden_size=ffn, vocab_size=vocab,
        max_position_embeddings=args.max_position_embeddings,
        make_vocab_size_divisible_by=int(getattr(args, "make_vocab_size_divisible_by", None) or 128),
        position_embedding_type=pos, rotary_base=rotary_base(getattr(args, "rotary_base", 10000)),
        **_yarn_meta(args, pos),
        rotary_percent=float(getattr(args, "rotary_percent", 1.0)),
        use_rope_scaling=bool(getattr(args, "use_rope_scaling", False)),
        rope_scaling_factor=float(getattr(args, "rope_scaling_factor", 8.0)), normalization=norm,
        layernorm_epsilon=float(eps), swiglu=swiglu, squared_relu=squared_relu,
        quick_geglu=bool(getattr(args, "quick_geglu", False)),
        glu_linear_offset=float(getattr(args, "glu_linear_offset", None) or 0.0),
        activation_func_clamp_value=getattr(args, "activation_func_clamp_value", None),
        softmax_type=getattr(args, "softmax_type", None) or "vanilla",
        gelu_approximate=megatron_gelu(bias, bool(getattr(args, "bias_gelu_fusion", True))),
        num_query_groups=args.num_query_groups if getattr(args, "group_query_attention", False) else None,
        kv_channels=getattr(args, "kv_channels", None),
        untie_embeddings_and_output_weights=bool(getattr(args, "untie_embeddings_and_output_weights", False)),
        add_bias_linear=bias, add_qkv_bias=not bias and bool(getattr(args, "add_qkv_bias", False)),
        qk_layernorm=bool(getattr(args, "qk_layernorm", False)),
        # Megatron-LM's --apply-layernorm-1p (its TransformerConfig field in newer saves): the same raw weights
        layernorm_zero_centered_gamma=bool(getattr(args, "apply_layernorm_1p", False)
                                           or getattr(args, "layernorm_zero_centered_gamma", False)),
        # megatron-core's window (its local mask function and Transformer Engine's agree: planner/window.py);
        # GPTConfig refuses in one line what the job cannot run (a right side other than 0)
        window_size=getattr(args, "window_size", None),
        window_attn_skip_freq=getattr(args, "window_attn_skip_freq", None),
        **_moe_meta(args, refuse))
    return full_meta({**meta, **mla, **ignored})


def _one(args: argparse.Namespace, name: str, default, refuse):
    """An arg Megatron-LM takes with nargs='+' (its validate_args keeps a list of one as the value)."""
    value = getattr(args, name, None)
    if value is None:
        return default
    if isinstance(value, (list, tuple)):
        if len(value) != 1:
            refuse(f"args.{name}={value!r} (one value per layer group)")
        value = value[0]
    return value


def _moe_meta(args: argparse.Namespace, refuse) -> dict:
    """The MoE fields (GPTConfig's, Megatron-LM's names) from the args; none for a dense model. What
    the job does not build is refused through `refuse` (or GPTConfig's one line)."""
    experts = getattr(args, "num_experts", None)
    if not experts:
        return {}
    out = {k: getattr(args, k, None) if getattr(args, k, None) is not None else default
           for k, default in MOE_FIELDS.items()}
    out.update(num_experts=int(experts), moe_router_pre_softmax=bool(out["moe_router_pre_softmax"]),
               moe_shared_expert_gate=bool(out["moe_shared_expert_gate"]),
               moe_router_load_balancing_type=_one(args, "moe_router_load_balancing_type", "aux_loss", refuse),
               moe_aux_loss_coeff=float(_one(args, "moe_aux_loss_coeff", 0.0, refuse)),
               moe_pad_expert_input_to_capacity=bool(out["moe_pad_expert_input_to_capacity"]))
    factor = out["moe_expert_capacity_factor"]
    out["moe_expert_capacity_factor"] = None if factor is None or factor < 0 else float(factor)  # < 0: none
    if out["moe_router_group_topk"] is None:     # megatron-core routes without groups then
        out["moe_router_num_groups"] = None
    if out["moe_token_dispatcher_type"] not in MOE_DISPATCHERS:     # 'flex' (DeepEP): the same math as alltoall
        out["moe_token_dispatcher_type"] = "alltoall"
    freq = out["moe_layer_freq"]
    out["moe_layer_freq"] = list(freq) if isinstance(freq, (list, tuple)) else int(freq)
    return out
