"""The job's model flags (Megatron-LM's names): attention and architecture, the GPTConfig fields they
give, and their checks. arguments.py adds them to the job's parser; tools that describe a model
(estimate_memory, find_max_model) reuse them through it.
"""
from __future__ import annotations

import argparse
import os
import sys

from zo_megatron.errors import ConfigError
from zo_megatron.planner.params import default_core_attention, flags_need_sdpa
from zo_megatron.planner.window import normalize_window_size
from zo_megatron.model.config import (MOE_DISPATCHERS, MOE_DROP_POLICIES, MOE_FIELDS, MOE_LOAD_BALANCING,
                                      MLA_FIELDS, MOE_SCORE_FUNCTIONS, YARN_FIELDS, megatron_gelu, rotary_base)

# --attention-backend (megatron-core's AttnBackend names) -> the model's core attention.
ATTENTION_BACKENDS = {"flash": "sdpa", "fused": "sdpa", "auto": "sdpa", "local": "local", "unfused": "local"}


def add_attention_flags(g) -> None:
    """--use-flash-attn, --attention-backend, --sequence-parallel (Megatron-LM's names); shared with
    tools/estimate_memory.py. `check_attention_flags` turns them into args.core_attention."""
    g.add_argument("--use-flash-attn", action="store_true",
                   help="core attention through torch's scaled_dot_product_attention, causal: no [b, heads, s, s] "
                        "scores, probabilities or dropout mask are stored (the local attention keeps ~6 bytes x "
                        "b*heads/TP*s^2 per layer in bf16, more with dropout), only a logsumexp of b*heads/TP*s "
                        "floats; flash or memory-efficient kernel on a GPU, "
                        "torch's fused kernel on a CPU (with attention dropout the CPU falls back to the math path). "
                        "Same as --attention-backend flash")
    g.add_argument("--attention-backend", choices=list(ATTENTION_BACKENDS), default=None,
                   help="flash / fused / auto: torch SDPA as --use-flash-attn (torch picks flash or "
                        "memory-efficient); local / unfused: megatron-core's DotProductAttention, which "
                        "materialises the s x s scores (default: local)")
    g.add_argument("--sequence-parallel", action="store_true",
                   help="with TP > 1, LayerNorm/dropout/residual activations are split over the TP ranks along the "
                        "sequence (megatron-core's sequence parallelism): those activations shrink by TP, the TP "
                        "all-reduces become reduce-scatter + all-gather (same bytes); the sequence length must be a "
                        "multiple of TP; turned off with a warning at TP = 1, as Megatron-LM does")


def _rotary_base_flag(text: str) -> int | float:
    try:
        return rotary_base(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None


def add_architecture_flags(g) -> None:
    """Megatron-LM's flags for Llama / Mistral / Qwen2-shaped models (same names, defaults and
    meaning; docs/models.md). Their dests are GPTConfig's field names, except the two Megatron
    spellings: --disable-bias-linear (add_bias_linear=False), --group-query-attention."""
    g.add_argument("--position-embedding-type", choices=["learned_absolute", "rope", "yarn"], default="learned_absolute",
                   help="learned_absolute (GPT-2), rope (rotary, Llama / Mistral / Qwen2) or yarn (rotary with "
                        "YaRN's frequencies and attention factor: --rotary-scaling-factor and the --yarn-* flags)")
    g.add_argument("--use-rotary-position-embeddings", action="store_true",
                   help="Megatron-LM's older spelling of --position-embedding-type rope")
    g.add_argument("--no-position-embedding", action="store_true",
                   help="Megatron-LM: no learned position table; accepted with rope (which has none)")
    g.add_argument("--rotary-base", type=_rotary_base_flag, default=10000,
                   help="RoPE base (theta); Llama-3: 500000; a non-integer base too (StarCoder2-3B's 999999.44...), "
                        "which Megatron-LM's int flag does not take")
    g.add_argument("--rotary-percent", type=float, default=1.0,
                   help="share of each head's channels that RoPE rotates, in (0, 1]")
    g.add_argument("--use-rope-scaling", action="store_true",
                   help="Llama-3.1 RoPE frequency scaling (megatron-core's: low/high frequency factors 1/4, "
                        "original context 8192)")
    g.add_argument("--rope-scaling-factor", type=float, default=8.0, help="with --use-rope-scaling: the factor")
    _add_yarn_flags(g)
    g.add_argument("--normalization", choices=["LayerNorm", "RMSNorm"], default="LayerNorm",
                   help="the norm of every layer and the final norm")
    g.add_argument("--norm-epsilon", "--layernorm-epsilon", dest="layernorm_epsilon", type=float, default=1e-5,
                   metavar="EPS",
                   help="epsilon of LayerNorm / RMSNorm")
    g.add_argument("--swiglu", action="store_true",
                   help="gated SiLU MLP (linear_fc1 = [gate; up]) instead of GELU")
    g.add_argument("--squared-relu", action="store_true",
                   help="the MLP's activation is relu(x)^2 (megatron-core's squared_relu; Nemotron-4), not GELU; "
                        "not with --swiglu")
    g.add_argument("--quick-geglu", action="store_true",
                   help="gated MLP as --swiglu with megatron-core's quick_gelu, x * sigmoid(1.702 x), in place of "
                        "SiLU (GPT-OSS)")
    g.add_argument("--glu-linear-offset", type=float, default=0.0,
                   help="a gated MLP computes act(gate) * (up + OFFSET) (GPT-OSS: 1.0)")
    g.add_argument("--activation-func-clamp-value", type=float, default=None, metavar="C",
                   help="a gated MLP clamps the gate to at most C and the linear half to [-C, C] before the product "
                        "(GPT-OSS: 7.0)")
    g.add_argument("--softmax-type", choices=["vanilla", "off-by-one", "learnable"], default="vanilla",
                   help="the attention softmax: 'off-by-one' adds 1 to each row's denominator, 'learnable' exp(s_h) "
                        "with one learned logit per head (GPT-OSS's attention sinks)")
    g.add_argument("--no-bias-gelu-fusion", dest="bias_gelu_fusion", action="store_false",
                   help="the MLP's GELU is the erf GELU (torch's F.gelu), as in Megatron-LM, whose fused bias-GELU "
                        "computes the tanh approximation instead: without this flag the GELU is the tanh one where "
                        "the linears have biases and the erf one with --disable-bias-linear (Megatron-LM's rule)")
    g.add_argument("--group-query-attention", action="store_true",
                   help="grouped-query attention with --num-query-groups key/value heads")
    g.add_argument("--num-query-groups", type=int, default=1,
                   help="with --group-query-attention: key/value heads G (must divide the heads; TP must "
                        "divide G); ignored without it, as in Megatron-LM")
    g.add_argument("--kv-channels", type=int, default=None,
                   help="head dimension (default: hidden / heads)")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true",
                   help="an output layer of its own instead of the word embedding (vocab-padded, decays)")
    g.add_argument("--disable-bias-linear", dest="add_bias_linear", action="store_false",
                   help="no biases in the linear layers (Llama, Mistral)")
    g.add_argument("--add-qkv-bias", action="store_true",
                   help="a bias on the query/key/value projection even with --disable-bias-linear (Qwen2)")
    g.add_argument("--qk-layernorm", action="store_true",
                   help="normalise queries and keys per head (with --normalization's norm) before RoPE")
    g.add_argument("--apply-layernorm-1p", action="store_true",
                   help="zero-centred gamma: every norm (LayerNorm or RMSNorm) scales by 1 + weight, the weight "
                        "starting at 0 (Megatron-LM's LayerNorm-1p; exported to Hugging Face as 1 + weight)")
    _add_mla_flags(g)
    g.add_argument("--window-size", type=_window_size_flag, default=None, metavar="LEFT,RIGHT",
                   help="sliding-window attention, Megatron-LM's: each token attends to itself and the LEFT tokens "
                        "before it (RIGHT must be 0: causal; -1 means no limit, full attention), exactly, as an "
                        "additive mask on torch SDPA (the default core attention with a window; megatron-core's "
                        "local attention builds its window mask on CUDA only). A Hugging Face sliding_window W is "
                        "--window-size W-1,0")
    g.add_argument("--window-attn-skip-freq", type=moe_layer_freq, default=None, metavar="N|LIST",
                   help="with --window-size: every N-th layer (layers N, 2N, ... counting from 1) attends fully, "
                        "the others within the window; or a list of one 1 (window) or 0 (full) per layer such as "
                        "'([1]*3+[0])*2' (Megatron-LM's syntax and rule; default: every layer slides)")


def _add_mla_flags(g) -> None:
    """Multi-latent attention (DeepSeek-V2/V3): Megatron-LM's names and defaults (its mla group, and
    --rope-type); the dests are GPTConfig's MLA_FIELDS."""
    g.add_argument("--multi-latent-attention", action="store_true",
                   help="multi-latent attention (megatron-core's MLASelfAttention; DeepSeek-V2/V3, Kimi-K2): keys and "
                        "values from one --kv-lora-rank latent per token, queries from a --q-lora-rank one; runs on "
                        "torch SDPA; with --qk-layernorm the latents are normalised (docs/models.md)")
    g.add_argument("--q-lora-rank", type=int, default=None,
                   help="MLA: the query latent's rank (default: queries projected from the hidden state directly)")
    g.add_argument("--kv-lora-rank", type=int, default=32, help="MLA: the key/value latent's rank")
    g.add_argument("--qk-head-dim", type=int, default=128,
                   help="MLA: each head's query/key channels without position (the rotated ones are "
                        "--qk-pos-emb-head-dim more)")
    g.add_argument("--qk-pos-emb-head-dim", type=int, default=64,
                   help="MLA: each head's rotated query/key channels (the key's are one for all heads)")
    g.add_argument("--v-head-dim", type=int, default=128, help="MLA: each head's value channels")
    g.add_argument("--rope-type", choices=["rope", "yarn"], default=None,
                   help="MLA's rotary embedding: yarn (its default; --rotary-scaling-factor, --mscale, "
                        "--mscale-all-dim and the --yarn-* flags) or rope; without MLA only rope, which changes nothing")


def mla_kwargs(args: argparse.Namespace) -> dict:
    """GPTConfig's MLA fields from the parsed flags."""
    return {name: getattr(args, name) for name in MLA_FIELDS}


def _add_yarn_flags(g) -> None:
    """YaRN (--position-embedding-type yarn): Megatron-LM's names (core_v0.19 on; the factor and the
    mscale pair are flags of its MLA group) and megatron-core's YarnRotaryEmbedding defaults."""
    g.add_argument("--rotary-scaling-factor", type=float, default=1.0, help="YaRN: the context extension factor")
    g.add_argument("--yarn-original-max-position-embeddings", type=int, default=4096,
                   help="YaRN: the context the model was trained at before the extension")
    g.add_argument("--yarn-beta-fast", type=float, default=32.0, help="YaRN: rotations above which a dim is not scaled")
    g.add_argument("--yarn-beta-slow", type=float, default=1.0, help="YaRN: rotations below which a dim is fully scaled")
    g.add_argument("--yarn-correction-range-round-to-int", action="store_true", default=True,
                   help="YaRN: round the ramp's ends outward (the default; Hugging Face's truncate)")
    g.add_argument("--no-yarn-correction-range-round-to-int", dest="yarn_correction_range_round_to_int",
                   action="store_false", help="YaRN: keep the ramp's ends fractional (truncate: false)")
    g.add_argument("--mscale", type=float, default=1.0,
                   help="YaRN: cos and sin are scaled by get_mscale(factor, mscale) / get_mscale(factor, "
                        "mscale-all-dim), get_mscale(f, m) = 0.1 m ln f + 1")
    g.add_argument("--mscale-all-dim", type=float, default=0.0, help="YaRN: see --mscale")
    # Megatron-LM's post-training (ModelOpt) GPT-OSS switch: refused in check_architecture_flags with the flags to use
    g.add_argument("--enable-gpt-oss", action="store_true", help=argparse.SUPPRESS)


# What Megatron-LM's --enable-gpt-oss leaves out, in the flags of OpenAI's GPT-OSS (its Hugging Face config's
# rope_scaling: factor 32 of an original 4096, beta 32 / 1, truncate false)
GPT_OSS_YARN = ("--position-embedding-type yarn --rotary-scaling-factor 32 --yarn-original-max-position-embeddings 4096 "
                "--no-yarn-correction-range-round-to-int")


def add_moe_flags(g) -> None:
    """Megatron-LM's mixture-of-experts flags (names, defaults, meaning; docs/moe.md); their dests are
    GPTConfig's fields (MOE_FIELDS) except --num-experts' num_experts, which is both."""
    g.add_argument("--num-experts", type=int, default=None,
                   help="experts per MoE layer (megatron-core's MoELayer, local spec; default: a dense model; "
                        "docs/moe.md). The memory planner plans the experts too (both engines at EP > 1; "
                        "docs/memory_planner.md)")
    g.add_argument("--moe-router-topk", type=int, default=2, help="experts each token is routed to")
    g.add_argument("--moe-ffn-hidden-size", type=int, default=None, help="each expert's FFN size (default: "
                   "--ffn-hidden-size)")
    g.add_argument("--moe-router-load-balancing-type", default="aux_loss",
                   help=f"the load-balancing loss: {', '.join(MOE_LOAD_BALANCING)} (Megatron's global_aux_loss and "
                        "sinkhorn are not offered)")
    g.add_argument("--moe-aux-loss-coeff", type=float, default=0.0, help="the load-balancing loss's coefficient")
    g.add_argument("--moe-z-loss-coeff", type=float, default=None, help="the router z-loss's coefficient")
    g.add_argument("--moe-router-pre-softmax", action="store_true",
                   help="softmax over all experts, then the top k (not renormalised); default: the top k logits, "
                        "then a softmax over them")
    g.add_argument("--moe-router-score-function", default="softmax",
                   help=f"the router's score: {', '.join(MOE_SCORE_FUNCTIONS)}")
    g.add_argument("--moe-router-dtype", choices=("fp32", "fp64"), default=None,
                   help="compute the router's logits and scores in fp32 or fp64 (Megatron-LM's; default: the model's "
                        "dtype): the routing of a bf16 model in full precision")
    g.add_argument("--moe-input-jitter-eps", type=float, default=None,
                   help="the router's input is multiplied by noise uniform in [1 - eps, 1 + eps] (Switch "
                        "Transformer's jitter; megatron-core applies it in evaluation too); a run setting, not the model's")
    g.add_argument("--moe-router-force-load-balancing", action="store_true",
                   help="benchmarking only: route by random logits (megatron-core's), so every expert gets an even "
                        "share of the tokens whatever the weights; the model learns nothing useful")
    g.add_argument("--moe-router-topk-scaling-factor", type=float, default=None,
                   help="multiplies the chosen experts' weights")
    g.add_argument("--moe-router-enable-expert-bias", action="store_true",
                   help="aux-loss-free load balancing (DeepSeek-V3, megatron-core's): a per-expert bias added to the "
                        "sigmoid scores that choose the top-k (not to the weights), moved after every iteration by "
                        "--moe-router-bias-update-rate toward the experts that got fewer tokens than the mean")
    g.add_argument("--moe-router-bias-update-rate", type=float, default=1e-3,
                   help="with --moe-router-enable-expert-bias: how far each expert's bias moves per iteration")
    g.add_argument("--moe-per-layer-logging", action="store_true",
                   help="each layer's load-balancing / z loss too, under megatron-core's names "
                        "(moe/<loss>_layer_<i>, a dense layer 0) in the JSONL rows, TensorBoard and W&B")
    g.add_argument("--moe-router-num-groups", type=int, default=None,
                   help="group-limited routing (DeepSeek-V2/V3, megatron-core's): the experts form N equal groups "
                        "(the EP size: device-limited routing; the nodes of the EP group: node-limited), of which "
                        "each token may use --moe-router-group-topk")
    g.add_argument("--moe-router-group-topk", type=int, default=None,
                   help="with --moe-router-num-groups: the groups each token picks, by the sum of each group's top "
                        "topk / group-topk scores; its top-k experts come from those groups only")
    g.add_argument("--moe-shared-expert-intermediate-size", type=int, default=None,
                   help="FFN size of a shared expert every token goes through (Qwen2-MoE)")
    g.add_argument("--moe-shared-expert-gate", action="store_true",
                   help="scale the shared expert's output by sigmoid(x . w), w a [1, hidden] weight")
    g.add_argument("--moe-layer-freq", type=moe_layer_freq, default=1,
                   help="every N-th layer is MoE (from layer 0), or a list of 0/1 per layer such as "
                        "'([1]*3+[0]*1)*3' (Megatron's syntax)")
    g.add_argument("--moe-token-dispatcher-type", default="allgather",
                   help=f"how tokens reach their experts' ranks: {', '.join(MOE_DISPATCHERS)}")
    g.add_argument("--moe-expert-capacity-factor", type=float, default=None,
                   help="each expert takes at most ceil(tokens x topk / experts x factor) of a rank's tokens per "
                        "layer, the rest of its assignments are dropped (contribute nothing from it); default: no "
                        "dropping (a negative factor means the same)")
    g.add_argument("--moe-pad-expert-input-to-capacity", action="store_true",
                   help="with --moe-expert-capacity-factor: every expert runs exactly its capacity of tokens, "
                        "padded with zero-weight ones (fixed shapes; the same output)")
    g.add_argument("--moe-token-drop-policy", default="probs",
                   help=f"which assignments over capacity are dropped: {', '.join(MOE_DROP_POLICIES)} (the lowest "
                        "routing probabilities, or the latest tokens of the rank's [seq, batch] order)")


def add_expert_parallel_flags(g) -> None:
    g.add_argument("--expert-model-parallel-size", dest="expert_parallel", type=int, default=1,
                   help="EP: the experts of each MoE layer split over this many ranks (must divide --num-experts); "
                        "expert DP = world / (expert TP x EP)")
    g.add_argument("--expert-tensor-parallel-size", dest="expert_tensor_parallel", type=int, default=None,
                   help="expert TP: what each routed expert's fc1/fc2 split over (default: --tensor-model-parallel-size); "
                        "1 with TP > 1 keeps experts whole beside TP attention, as Megatron-LM's MoE recipes; "
                        "trains, saves, reshards, and converts to and from Megatron-LM (docs/moe.md)")


def moe_layer_freq(text):
    """Megatron-LM's --moe-layer-freq: an int, or a Python list expression of 0s and 1s such as
    '([1]*3+[0]*1)*3' (only digits, brackets, commas, + and * are evaluated, with no names)."""
    import re

    try:
        return int(text)
    except ValueError:
        pass
    if not re.fullmatch(r"[\[\]() 0-9,+*]+", text):
        raise argparse.ArgumentTypeError(f"{text!r}: an integer or a list expression of 0s and 1s")
    try:
        value = eval(text, {"__builtins__": {}}, {})          # noqa: S307 (characters checked above)
    except Exception:                                       # noqa: BLE001 (any syntax error)
        raise argparse.ArgumentTypeError(f"{text!r}: not a list expression such as '([1]*3+[0]*1)*3'") from None
    if not isinstance(value, (list, tuple)):
        raise argparse.ArgumentTypeError(f"{text!r}: an integer or a list of 0s and 1s")
    return list(value)


def moe_kwargs(args: argparse.Namespace) -> dict:
    """GPTConfig's MoE fields from the parsed flags."""
    return {name: getattr(args, name) for name in MOE_FIELDS}


def _window_size_flag(text: str) -> list[int] | None:
    """--window-size as Megatron-LM's tuple_type reads it ("L,R" or "(L,R)"): a list, as a checkpoint's JSON
    records it (--use-checkpoint-args compares the two), None for full attention (-1); what a causal GPT
    cannot run is GPTConfig's one line (planner/window.py)."""
    try:
        parts = [int(p) for p in text.strip().strip("()[]").split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give LEFT,RIGHT as two integers (e.g. 4095,0)") from None
    try:
        window = normalize_window_size(parts)
    except ValueError:
        return parts                           # refused with its reason once GPTConfig reads it
    return None if window is None else list(window)


def architecture_kwargs(args: argparse.Namespace) -> dict:
    """GPTConfig's architecture fields from the parsed flags (all of ARCH_FIELDS except vocab_size,
    which --vocab-size or the tokenizer gives: training/loop.py model_vocab_size). Used by the job
    and by tools/estimate_memory.py."""
    return dict(
        num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
        ffn_hidden_size=args.ffn_hidden_size, max_position_embeddings=args.max_position_embeddings,
        make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
        position_embedding_type=args.position_embedding_type, rotary_base=args.rotary_base,
        rotary_percent=args.rotary_percent, use_rope_scaling=args.use_rope_scaling,
        rope_scaling_factor=args.rope_scaling_factor, normalization=args.normalization,
        layernorm_epsilon=args.layernorm_epsilon, swiglu=args.swiglu, squared_relu=args.squared_relu,
        quick_geglu=args.quick_geglu, glu_linear_offset=args.glu_linear_offset,
        activation_func_clamp_value=args.activation_func_clamp_value, softmax_type=args.softmax_type,
        # Megatron-LM: --num-query-groups counts only with --group-query-attention
        num_query_groups=args.num_query_groups if args.group_query_attention else None,
        kv_channels=args.kv_channels, **{name: getattr(args, name) for name in YARN_FIELDS}, **mla_kwargs(args),
        untie_embeddings_and_output_weights=args.untie_embeddings_and_output_weights,
        add_bias_linear=args.add_bias_linear, add_qkv_bias=args.add_qkv_bias, qk_layernorm=args.qk_layernorm,
        layernorm_zero_centered_gamma=args.apply_layernorm_1p, gelu_approximate=gelu_approximate(args),
        window_size=getattr(args, "window_size", None),
        window_attn_skip_freq=getattr(args, "window_attn_skip_freq", None))


def gelu_approximate(args: argparse.Namespace) -> str:
    """The GELU of a non-gated MLP, by Megatron-LM's rule (model/config.py megatron_gelu) from the flags;
    a checkpoint's own value (--use-checkpoint-args sets it) wins."""
    recorded = getattr(args, "gelu_approximate", None)
    if recorded is not None:
        return recorded
    return megatron_gelu(args.add_bias_linear, getattr(args, "bias_gelu_fusion", True))


def check_architecture_flags(args: argparse.Namespace) -> None:
    """The architecture flags checked before any process starts work (one line each)."""
    from zo_megatron.model.config import GPTConfig

    if args.enable_gpt_oss:
        # megatron/post_training/model_builder.py (core_v0.16.1 and later) sets YaRN with an original context of
        # 131072 where OpenAI's config says 4096: another rotation for most dims than the released weights had
        raise ConfigError("--enable-gpt-oss (Megatron-LM's post-training switch) sets YaRN with an original context "
                          "of 131072, not the 4096 of OpenAI's GPT-OSS config: drop it and give YaRN explicitly, "
                          f"{GPT_OSS_YARN} (tools/convert_checkpoint.py from-hf prints a converted model's flags)")
    # The vocabulary comes from the tokenizer later; no architecture check depends on it.
    cfg = GPTConfig(**architecture_kwargs(args), **moe_kwargs(args), vocab_size=1, precision=args.precision,
                    attention_backend=args.core_attention)
    # heads, query groups, MLP columns and MLA's latents against TP (validate_parallel_config), one line before
    # any process starts (the planner, which runs first there, would raise its own ValueError)
    cfg.check_tensor_parallel(args.tensor_parallel)
    cfg.check_expert_parallel(args.tensor_parallel, args.expert_parallel, args.expert_tensor_parallel,
                              args.sequence_parallel)
    if cfg.num_experts is not None:
        check_moe_job_flags(args)


def check_moe_job_flags(args: argparse.Namespace) -> None:
    """What the job does not do with experts yet, one line each (docs/moe.md). At EP > 1 (or an expert
    TP other than TP) only ZeRO-Offload reduces experts over expert DP (the baseline's DDP would average different experts
    over DP); the two-engine optimizer (offload/expert_parallel.py) runs every CPU-step schedule, a
    partial offload and the NVMe tier, and the planner resolves their defaults and budgets as for a
    dense model (its lines per engine)."""
    ep, etp, tp = args.expert_parallel, args.expert_tensor_parallel, args.tensor_parallel
    if getattr(args, "num_experts", None) is None or (ep == 1 and etp in (None, tp)):
        return
    where = f"with --expert-model-parallel-size {ep}" if ep > 1 else \
        f"with --expert-tensor-parallel-size {etp} (TP {tp})"
    if not args.zero_offload:
        raise ConfigError(f"--num-experts {where} trains with the ZeRO-Offload engine only (the baseline's DDP "
                          "does not reduce experts over expert DP): add --zero-offload")


def check_attention_flags(args: argparse.Namespace) -> None:
    """--use-flash-attn / --attention-backend -> args.core_attention ("local" | "sdpa");
    --sequence-parallel off at TP = 1 (Megatron-LM's rule, with its warning)."""
    if args.use_flash_attn and args.attention_backend in ("local", "unfused"):
        raise ConfigError(f"--use-flash-attn and --attention-backend {args.attention_backend} contradict each other: "
                          "use one of them")
    args.core_attention = "sdpa" if args.use_flash_attn else ATTENTION_BACKENDS[args.attention_backend] \
        if args.attention_backend else default_core_attention(flags_need_sdpa(args))
    if args.sequence_parallel and args.tensor_parallel == 1:
        if os.environ.get("RANK", "0") == "0":
            print("warning: Disabling sequence parallelism because tensor model parallelism is disabled",
                  file=sys.stderr, flush=True)
        args.sequence_parallel = False
    if args.sequence_parallel and args.seq_length % args.tensor_parallel:
        raise ConfigError(f"--sequence-parallel splits the sequence over TP: --seq-length {args.seq_length} is not a "
                          f"multiple of --tensor-model-parallel-size {args.tensor_parallel}; use a multiple")
