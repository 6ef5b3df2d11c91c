"""The GPT's shape and numerics, independent of how it is laid out over TP/DP.

The defaults are GPT-2 (learned positions, LayerNorm, GELU MLP, biases, tied embeddings); the
architecture fields switch on the Llama / Mistral / Qwen2 parts megatron-core's local spec has
(RoPE, RMSNorm, SwiGLU, grouped-query attention, an untied output layer, qkv-only biases,
q/k LayerNorm), with Megatron-LM's flag names and defaults (docs/models.md).
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from zo_megatron.errors import ConfigError
# (MOE_DROP_POLICIES: re-exported with the other MoE choices, for the flags)
from zo_megatron.model.moe_rules import MOE_DROP_POLICIES, check_capacity, check_group_limited_routing  # noqa: F401
from zo_megatron.planner.params import (Architecture, check_mlp_and_softmax, default_core_attention,
                                        mla_attention_rows, selective_recompute_modules)
from zo_megatron.planner.window import describe_window, normalize_skip_freq, normalize_window_size, window_layers

PRECISIONS = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


POSITION_EMBEDDING_TYPES = ("learned_absolute", "rope", "yarn")
# YaRN's settings (megatron-core's YarnRotaryEmbedding; Megatron-LM's flag dests, core_v0.19 on): field -> default
YARN_FIELDS = {"rotary_scaling_factor": 1.0, "yarn_original_max_position_embeddings": 4096, "yarn_beta_fast": 32.0,
               "yarn_beta_slow": 1.0, "yarn_correction_range_round_to_int": True, "mscale": 1.0, "mscale_all_dim": 0.0}
NORMALIZATIONS = ("LayerNorm", "RMSNorm")
# The GELU of a non-gated MLP, as torch's F.gelu(approximate=...) names it: "tanh" (GPT-2's, OpenAI's
# approximation) or "none" (the erf GELU). Megatron-LM's megatron-core GPT computes the tanh one in its
# bias-GELU fusion (linear biases and --bias-gelu-fusion, its default), the erf one otherwise.
GELU_APPROXIMATIONS = ("tanh", "none")


def rotary_base(value) -> int | float:
    """A RoPE base as recorded: an int where it is whole (Megatron-LM's --rotary-base is an int), else the
    float (a Hugging Face rope_theta such as StarCoder2-3B's 999999.4420358813; megatron-core's
    RotaryEmbedding computes base ** (2i / d) in floating point either way)."""
    value = float(value)
    return int(value) if value.is_integer() else value


def megatron_gelu(add_bias_linear: bool, bias_gelu_fusion: bool) -> str:
    """The GELU Megatron-LM's megatron-core GPT computes (core_v0.16.1 mlp.py): its fused bias-GELU, the
    tanh approximation, where the linears have biases and --bias-gelu-fusion is on (validate_args turns
    the fusion off without biases); torch's erf F.gelu otherwise. --openai-gelu is read by its legacy
    models only."""
    return "tanh" if add_bias_linear and bias_gelu_fusion else "none"


def megatron_bias_gelu_fusion(gelu: str, add_bias_linear: bool) -> bool | None:
    """The inverse: Megatron-LM's bias_gelu_fusion that computes `gelu` with these biases; None where
    none does (the tanh GELU without biases)."""
    if gelu == "tanh":
        return True if add_bias_linear else None
    return False
# Mixture of experts (megatron-core's MoE layer, local spec; docs/moe.md): field -> Megatron-LM's default.
MOE_FIELDS = {"num_experts": None, "moe_router_topk": 2, "moe_ffn_hidden_size": None,
              "moe_router_load_balancing_type": "aux_loss", "moe_aux_loss_coeff": 0.0, "moe_z_loss_coeff": None,
              "moe_router_pre_softmax": False, "moe_router_score_function": "softmax",
              "moe_router_topk_scaling_factor": None, "moe_shared_expert_intermediate_size": None,
              "moe_shared_expert_gate": False, "moe_layer_freq": 1, "moe_token_dispatcher_type": "allgather",
              "moe_expert_capacity_factor": None, "moe_pad_expert_input_to_capacity": False,
              "moe_token_drop_policy": "probs", "moe_router_enable_expert_bias": False,
              "moe_router_num_groups": None, "moe_router_group_topk": None}
MOE_LOAD_BALANCING = ("aux_loss", "seq_aux_loss", "none")
MOE_SCORE_FUNCTIONS = ("softmax", "sigmoid")
MOE_DISPATCHERS = ("allgather", "alltoall")

# Multi-latent attention (DeepSeek-V2/V3's MLA: megatron-core's MLASelfAttention; docs/models.md): field ->
# Megatron-LM's default. rope_type is Megatron-LM's --rope-type: None means YaRN under MLA (megatron-core's
# MLATransformerConfig default); a model records the resolved value ("yarn" or "rope"; None without MLA).
MLA_FIELDS = {"multi_latent_attention": False, "q_lora_rank": None, "kv_lora_rank": 32, "qk_head_dim": 128,
              "qk_pos_emb_head_dim": 64, "v_head_dim": 128, "rope_type": None}
ROPE_TYPES = ("rope", "yarn")
# Sliding-window attention (Megatron-LM's --window-size / --window-attn-skip-freq; planner/window.py): field -> default
WINDOW_FIELDS = {"window_size": None, "window_attn_skip_freq": None}
# GPT-OSS's gated MLP (Megatron-LM's --quick-geglu, --glu-linear-offset, --activation-func-clamp-value): field -> default
GLU_FIELDS = {"quick_geglu": False, "glu_linear_offset": 0.0, "activation_func_clamp_value": None}

# The fields that define the architecture: recorded in checkpoints and compared on resume.
ARCH_FIELDS = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "vocab_size",
               "max_position_embeddings", "make_vocab_size_divisible_by", "position_embedding_type",
               "rotary_base", "rotary_percent", "use_rope_scaling", "rope_scaling_factor", "normalization",
               "layernorm_epsilon", "swiglu", "squared_relu", "gelu_approximate", "num_query_groups", "kv_channels",
               "untie_embeddings_and_output_weights", "add_bias_linear", "add_qkv_bias", "qk_layernorm",
               "layernorm_zero_centered_gamma", *YARN_FIELDS, *MOE_FIELDS, *MLA_FIELDS, *WINDOW_FIELDS,
               "softmax_type", *GLU_FIELDS)


def swiglu_ffn_size(hidden_size: int) -> int:
    """Megatron-LM's --ffn-hidden-size default with --swiglu: 2/3 of 4h, rounded down to 64."""
    return int(4 * hidden_size * 2 / 3 / 64) * 64


def largest_divisor_at_most(n: int, limit: int) -> int:
    return max(d for d in range(1, min(n, limit) + 1) if n % d == 0)


@dataclass
class GPTConfig:
    """A decoder-only GPT: GPT-2 by default, Llama / Mistral / Qwen2 through the architecture fields."""

    num_layers: int = 4
    hidden_size: int = 256
    num_attention_heads: int = 4
    vocab_size: int = 50257
    max_position_embeddings: int = 1024
    ffn_hidden_size: int | None = None          # default 4 * hidden_size, as GPT-2
    make_vocab_size_divisible_by: int = 128     # Megatron's default
    precision: str = "bf16"                     # bf16 | fp16 | fp32: dtype of params and activations
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    init_method_std: float = 0.02
    layernorm_epsilon: float = 1e-5             # --norm-epsilon (also the RMSNorm epsilon)
    position_embedding_type: str = "learned_absolute"   # "learned_absolute" | "rope" | "yarn"
    rotary_base: int | float = 10000            # a float only where not whole (StarCoder2-3B's 999999.44...)
    rotary_percent: float = 1.0
    use_rope_scaling: bool = False              # Llama-3.1 frequency scaling (megatron-core's fixed constants)
    rope_scaling_factor: float = 8.0
    # YaRN (position_embedding_type "yarn"): Hugging Face's rope_type "yarn" (docs/models.md)
    rotary_scaling_factor: float = 1.0          # its factor
    yarn_original_max_position_embeddings: int = 4096
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_correction_range_round_to_int: bool = True     # HF's `truncate`
    mscale: float = 1.0                         # the attention factor is get_mscale(factor, mscale) /
    mscale_all_dim: float = 0.0                 #   get_mscale(factor, mscale_all_dim)
    normalization: str = "LayerNorm"            # "LayerNorm" | "RMSNorm"
    swiglu: bool = False                        # gated SiLU MLP: linear_fc1 is [gate; up]
    squared_relu: bool = False                  # the MLP's activation relu(x)^2 (Nemotron-4; megatron-core's)
    # a gated MLP as SwiGLU ([gate; up]) with megatron-core's quick_gelu, x * sigmoid(1.702 x) (GPT-OSS's)
    quick_geglu: bool = False
    # gated MLPs (megatron-core's glu()): act(min(gate, C)) * (clamp(up, -C, C) + offset); GPT-OSS: C 7, offset 1
    glu_linear_offset: float = 0.0
    activation_func_clamp_value: float | None = None
    # the attention softmax (megatron-core's softmax_type, planner.params.SOFTMAX_TYPES): "off-by-one" adds exp(0) to
    # every row's denominator, "learnable" exp(softmax_offset_h), one learned logit per head (GPT-OSS's sinks)
    softmax_type: str = "vanilla"
    # a GELU MLP (neither): F.gelu(approximate=...), GELU_APPROXIMATIONS ("none" with no GELU)
    gelu_approximate: str = "tanh"
    num_query_groups: int | None = None         # grouped-query attention: G key/value heads (None: one per head)
    kv_channels: int | None = None              # head dim (None: hidden_size // num_attention_heads)
    untie_embeddings_and_output_weights: bool = False
    add_bias_linear: bool = True
    add_qkv_bias: bool = False                  # qkv bias even without add_bias_linear (Qwen2)
    qk_layernorm: bool = False
    layernorm_zero_centered_gamma: bool = False  # --apply-layernorm-1p: every norm scales by (1 + weight), weight from 0
    # multi-latent attention (MLA_FIELDS): queries from a rank-q_lora_rank latent (None: projected from the
    # hidden state directly), keys and values from a shared rank-kv_lora_rank latent; each head's query/key is
    # qk_head_dim channels without position plus qk_pos_emb_head_dim rotated ones (the key's rotated part is
    # one for all heads), its value v_head_dim
    multi_latent_attention: bool = False
    q_lora_rank: int | None = None
    kv_lora_rank: int = 32
    qk_head_dim: int = 128
    qk_pos_emb_head_dim: int = 64
    v_head_dim: int = 128
    rope_type: str | None = None                # MLA's rotary embedding: "yarn" (its default) or "rope"
    # sliding-window attention (planner/window.py): (L, 0) = each token sees itself and the L tokens before it, in
    # the layers window_attn_skip_freq leaves sliding (None: all); None: full attention. Runs on SDPA only
    window_size: tuple | None = None
    window_attn_skip_freq: int | list | None = None
    # mixture of experts (MOE_FIELDS; docs/moe.md): None = a dense model
    num_experts: int | None = None
    moe_router_topk: int = 2
    moe_ffn_hidden_size: int | None = None      # each expert's FFN size (default: ffn_hidden_size)
    moe_router_load_balancing_type: str = "aux_loss"
    moe_aux_loss_coeff: float = 0.0
    moe_z_loss_coeff: float | None = None
    moe_router_pre_softmax: bool = False        # softmax over all experts, then top-k (no renormalisation)
    moe_router_score_function: str = "softmax"
    moe_router_topk_scaling_factor: float | None = None
    moe_shared_expert_intermediate_size: int | None = None
    moe_shared_expert_gate: bool = False        # the shared expert's output scaled by sigmoid(x . gate_weight)
    moe_layer_freq: int | list = 1              # every N-th layer is MoE, or a 0/1 list per layer
    moe_token_dispatcher_type: str = "allgather"
    # capacity (docs/moe.md): each expert takes at most ceil(tokens x topk / E x factor) of a rank's routed
    # tokens per layer call; the rest of its assignments are dropped (None: no dropping, Megatron-LM's default)
    moe_expert_capacity_factor: float | None = None
    moe_pad_expert_input_to_capacity: bool = False  # every expert gets exactly its capacity (zero-weight padding)
    moe_token_drop_policy: str = "probs"        # drop the lowest-probability ("probs") or latest ("position")
    # aux-loss-free load balancing (DeepSeek-V3): a per-expert bias added to the scores that pick the top-k,
    # moved by `moe_router_bias_update_rate` toward balance after every iteration (training/expert_bias.py)
    moe_router_enable_expert_bias: bool = False
    moe_router_bias_update_rate: float = 1e-3   # a run setting, not the architecture
    # group-limited routing (DeepSeek-V2/V3's device- and node-limited routing): the experts form
    # `moe_router_num_groups` equal groups; each token picks `moe_router_group_topk` groups by the sum of
    # their top topk // group_topk scores, then its top-k experts among those groups only
    moe_router_num_groups: int | None = None
    moe_router_group_topk: int | None = None
    recompute: str | None = None                # None | "full" (whole layers) | "selective" (recompute_modules)
    # selective only: megatron-core's recompute_modules (RECOMPUTE_MODULES; None: the attention core)
    recompute_modules: tuple | None = None
    recompute_method: str = "uniform"           # full only: "uniform" (groups of N layers) | "block" (first N)
    recompute_num_layers: int = 1               # full only: N (megatron's --recompute-num-layers)
    label_smoothing: float = 0.0
    # "local": megatron's DotProductAttention | "sdpa": torch SDPA; None: local, or SDPA under MLA (which the
    # local one cannot run)
    attention_backend: str | None = None
    sequence_parallel: bool = False             # megatron's sequence parallelism (no effect at TP = 1)
    # --moe-router-dtype: the router's logits and scores in fp32/fp64 (None: the model's dtype); numerics only,
    # not the architecture (a checkpoint does not record it)
    moe_router_dtype: str | None = None
    # run settings of the router, not the architecture: --moe-input-jitter-eps (the router's input times noise
    # uniform in [1 - eps, 1 + eps], evaluation too) and --moe-router-force-load-balancing (random logits: benchmarks)
    moe_input_jitter_eps: float | None = None
    moe_router_force_load_balancing: bool = False
    # --calculate-per-token-loss: megatron-core's router then multiplies its aux losses by its local tokens
    # (training/trainer.py loss_weights gives them the matching scale); a run setting, not the architecture
    calculate_per_token_loss: bool = False

    def __post_init__(self):
        if self.precision not in PRECISIONS:
            raise ConfigError(f"precision must be one of {sorted(PRECISIONS)} (got {self.precision!r})")
        for name in ("num_layers", "hidden_size", "num_attention_heads", "vocab_size",
                     "max_position_embeddings", "make_vocab_size_divisible_by"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1 (got {getattr(self, name)})")
        if self.kv_channels is None and self.hidden_size % self.num_attention_heads != 0:
            raise ConfigError(
                f"--hidden-size {self.hidden_size} is not divisible by --num-attention-heads "
                f"{self.num_attention_heads}: pick hidden = heads x head_dim (or give --kv-channels)")
        self._check_architecture()
        self._check_moe()
        if self.recompute is True:
            self.recompute = "full"
        if self.recompute not in (None, False, "full", "selective"):
            raise ConfigError(f"recompute must be 'full' or 'selective' (got {self.recompute!r})")
        self.recompute = self.recompute or None
        self._check_recompute_modules()
        if self.recompute_method not in ("uniform", "block"):
            raise ConfigError(f"recompute_method must be 'uniform' or 'block' (got {self.recompute_method!r})")
        if not 1 <= self.recompute_num_layers <= self.num_layers:
            raise ConfigError(f"--recompute-num-layers {self.recompute_num_layers} must be between 1 and "
                              f"--num-layers {self.num_layers}")
        if self.recompute == "full" and self.recompute_method == "uniform" and self.num_layers % self.recompute_num_layers:
            raise ConfigError(f"--recompute-num-layers {self.recompute_num_layers} does not divide --num-layers "
                              f"{self.num_layers} (megatron-core's uniform method checkpoints whole groups): use a divisor")
        windowed = self._check_window()
        if self.attention_backend is None:       # (the job names its backend: it refuses local with a window)
            self.attention_backend = default_core_attention(self.multi_latent_attention or windowed)
        if self.attention_backend not in ("local", "sdpa"):
            raise ConfigError(f"attention_backend must be 'local' or 'sdpa' (got {self.attention_backend!r})")
        if windowed and self.attention_backend == "local":
            raise ConfigError(f"--window-size {self.window_size[0]},0 with megatron-core's local attention, which "
                              "builds its window mask on CUDA only (and in place of a per-document mask): add "
                              "--use-flash-attn (torch SDPA, the window as an additive mask)")
        if self.multi_latent_attention and self.attention_backend == "local":
            raise ConfigError("--attention-backend local with --multi-latent-attention: megatron-core 0.16's local "
                              "attention cannot take MLA's separate key and value head dims; drop the flag (MLA runs "
                              "on torch SDPA, as --use-flash-attn)")
        if self.label_smoothing != 0.0:
            # megatron-core's vocab_parallel_cross_entropy smooths over the local vocab shard only,
            # which is wrong at TP > 1; refuse rather than train on a silently wrong loss.
            raise ConfigError("label smoothing is not supported (megatron-core's vocab-parallel "
                              "cross-entropy applies it to one TP shard only): drop --label-smoothing")

    def _check_window(self) -> bool:
        """The window's values normalized (planner/window.py's rules, one line each); whether a layer slides."""
        try:
            self.window_size = normalize_window_size(self.window_size)
            self.window_attn_skip_freq = normalize_skip_freq(self.window_attn_skip_freq, self.window_size,
                                                             self.num_layers)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        return any(self.window_layers())

    def window_layers(self) -> list[bool]:
        """Which layers (0-indexed) attend within the sliding window (megatron-core's is_layer_window_attention)."""
        return window_layers(self.window_size, self.window_attn_skip_freq, self.num_layers)

    def _check_recompute_modules(self) -> None:
        """--recompute-modules: megatron-core's selective recompute, of the modules this model has
        (planner/params.py's rules, which the planner applies too)."""
        try:
            modules = selective_recompute_modules(
                self.recompute, self.recompute_modules, experts=self.num_experts is not None,
                dense_layers=not all(self.moe_layers()),
                shared_expert=self.moe_shared_expert_intermediate_size is not None,
                linear_biases=self.add_bias_linear, mla=self.multi_latent_attention)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        self.recompute_modules = modules if self.recompute == "selective" else None

    def _check_architecture(self) -> None:
        if self.gelu_approximate not in GELU_APPROXIMATIONS:
            raise ConfigError(f"gelu_approximate must be one of {', '.join(GELU_APPROXIMATIONS)} "
                              f"(got {self.gelu_approximate!r})")
        try:
            check_mlp_and_softmax(self.swiglu, self.squared_relu, self.quick_geglu, self.glu_linear_offset,
                                  self.activation_func_clamp_value, self.softmax_type)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        if not self.gelu_mlp:            # one recorded value for every model without a GELU: a resume compares it
            self.gelu_approximate = "none"
        if self.position_embedding_type not in POSITION_EMBEDDING_TYPES:
            raise ConfigError(f"--position-embedding-type {self.position_embedding_type}: choose one of "
                              f"{', '.join(POSITION_EMBEDDING_TYPES)}")
        if self.normalization not in NORMALIZATIONS:
            raise ConfigError(f"--normalization {self.normalization}: choose one of {', '.join(NORMALIZATIONS)}")
        if not 0.0 < self.rotary_percent <= 1.0:
            raise ConfigError(f"--rotary-percent {self.rotary_percent}: must be in (0, 1]")
        if not self.rotary_base > 0:
            raise ConfigError(f"--rotary-base {self.rotary_base}: must be > 0")
        self.rotary_base = rotary_base(self.rotary_base)
        if self.use_rope_scaling and self.rope_scaling_factor <= 0:
            raise ConfigError(f"--rope-scaling-factor {self.rope_scaling_factor}: must be > 0")
        if self.use_rope_scaling and self.position_embedding_type != "rope":
            raise ConfigError("--use-rope-scaling scales rotary embeddings: add --position-embedding-type rope")
        self._check_mla()
        self._check_yarn()
        if self.layernorm_epsilon <= 0:
            raise ConfigError(f"--norm-epsilon {self.layernorm_epsilon}: must be > 0")
        if self.kv_channels is not None and self.kv_channels < 1:
            raise ConfigError(f"--kv-channels {self.kv_channels}: must be >= 1")
        rotated = self.qk_pos_emb_head_dim if self.multi_latent_attention else self.head_dim
        if self.position_embedding_type != "learned_absolute" and rotated * self.rotary_percent < 2:
            raise ConfigError(f"--rotary-percent {self.rotary_percent} of head dim {self.head_dim} rotates "
                              "no channel pair: raise it")
        g = self.query_groups
        if g < 1 or self.num_attention_heads % g:
            raise ConfigError(f"--num-query-groups {g} must divide --num-attention-heads "
                              f"{self.num_attention_heads} (each key/value head serves a whole group of query heads)")
        if self.multi_latent_attention and g != self.num_attention_heads:
            raise ConfigError(f"--num-query-groups {g} with --multi-latent-attention: MLA's keys and values come from "
                              "one latent per token, not from groups (Megatron-LM's rule); drop --group-query-attention")
        if self.ffn_size < 1:
            raise ConfigError(f"--swiglu with --hidden-size {self.hidden_size} gives an FFN size of 0 "
                              "(int(4h*2/3/64)*64): give --ffn-hidden-size")

    def _check_mla(self) -> None:
        """Multi-latent attention, with Megatron-LM's rules and what its MLA would ignore silently refused."""
        if self.rope_type not in (None, *ROPE_TYPES):
            raise ConfigError(f"--rope-type {self.rope_type}: choose one of {', '.join(ROPE_TYPES)}")
        if not self.multi_latent_attention:
            off = [f"--{k.replace('_', '-')}" for k, v in MLA_FIELDS.items()
                   if k != "rope_type" and getattr(self, k) != v]
            if off:
                raise ConfigError(f"{', '.join(off)} configure{'s' if len(off) == 1 else ''} multi-latent attention: "
                                  "add --multi-latent-attention (or drop it)")
            if self.rope_type == "yarn":
                raise ConfigError("--rope-type yarn: Megatron-LM's attention without MLA takes rope only; use "
                                  "--position-embedding-type yarn for YaRN")
            self.rope_type = None               # --rope-type rope without MLA changes nothing: one recorded value
            return
        self.rope_type = self.rope_type or "yarn"
        for name in ("kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} {getattr(self, name)}: must be >= 1")
        if self.q_lora_rank is not None and self.q_lora_rank < 1:
            raise ConfigError(f"--q-lora-rank {self.q_lora_rank}: must be >= 1 (or drop it: queries then come "
                              "from the hidden state directly)")
        if self.qk_pos_emb_head_dim % 2:
            raise ConfigError(f"--qk-pos-emb-head-dim {self.qk_pos_emb_head_dim}: rotary channels come in pairs; "
                              "use an even number")
        refused = (("position_embedding_type", self.position_embedding_type == "yarn",
                    "--position-embedding-type yarn with --multi-latent-attention: MLA applies its own rotary "
                    "embedding (--rope-type, default yarn), and megatron-core's MLA refuses one from the model; use "
                    "--position-embedding-type rope"),
                   ("use_rope_scaling", self.use_rope_scaling,
                    "--use-rope-scaling with --multi-latent-attention: megatron-core's MLA builds its rotary "
                    "embedding without Llama-3.1 scaling (it would be ignored); drop it"),
                   ("add_qkv_bias", self.add_qkv_bias,
                    "--add-qkv-bias with --multi-latent-attention: MLA's projections have no biases (it would be "
                    "ignored); drop it"),
                   ("rotary_percent", self.rope_type == "yarn" and self.rotary_percent != 1.0,
                    f"--rotary-percent {self.rotary_percent} with MLA's YaRN: megatron-core's YaRN rotates all "
                    "--qk-pos-emb-head-dim channels; drop --rotary-percent"),
                   ("yarn_correction_range_round_to_int", not self.yarn_correction_range_round_to_int,
                    "--no-yarn-correction-range-round-to-int with --multi-latent-attention: megatron-core 0.16's MLA "
                    "builds its YaRN with the rounded range (it would be ignored); drop it"))
        for _, bad, line in refused:
            if bad:
                raise ConfigError(line)

    def _check_yarn(self) -> None:
        if self.multi_latent_attention:
            # MLA's attention reads YaRN's factor and mscale_all_dim whatever its rope type: its softmax scale is
            # mscale(factor, mscale_all_dim)^2 / sqrt(q head dim) (megatron-core's MLASelfAttention); the rest
            # only with its YaRN
            unused = [f"--{k.replace('_', '-')}" for k, v in YARN_FIELDS.items() if getattr(self, k) != v and
                      k not in ("rotary_scaling_factor", "mscale_all_dim")] if self.rope_type == "rope" else []
            if unused:
                raise ConfigError(f"{', '.join(unused)} with --rope-type rope: MLA's plain RoPE does not read "
                                  f"{'it' if len(unused) == 1 else 'them'} (megatron-core would ignore "
                                  f"{'it' if len(unused) == 1 else 'them'}); drop {'it' if len(unused) == 1 else 'them'} "
                                  "or use --rope-type yarn")
            return self._check_yarn_values()
        if self.position_embedding_type != "yarn":
            off = [f"--{k.replace('_', '-')}" for k, v in YARN_FIELDS.items() if getattr(self, k) != v]
            if off:
                raise ConfigError(f"{', '.join(off)} set{'s' if len(off) == 1 else ''} YaRN: add "
                                  "--position-embedding-type yarn (or drop it)")
            return
        if self.rotary_percent != 1.0:
            raise ConfigError(f"--rotary-percent {self.rotary_percent} with --position-embedding-type yarn: "
                              "megatron-core's YaRN rotates the whole head; drop --rotary-percent")
        self._check_yarn_values()

    def _check_yarn_values(self) -> None:
        for name in ("rotary_scaling_factor", "yarn_original_max_position_embeddings", "yarn_beta_fast",
                     "yarn_beta_slow"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"--{name.replace('_', '-')} {getattr(self, name)}: must be > 0")

    def _check_moe(self) -> None:
        """Megatron-LM's MoE rules (megatron-core's TransformerConfig asserts), one line each."""
        if self.moe_expert_capacity_factor is not None and self.moe_expert_capacity_factor < 0:
            self.moe_expert_capacity_factor = None      # megatron-core's meaning of a negative factor: no dropping
        if self.num_experts is None:
            run = {"moe_input_jitter_eps": None, "moe_router_force_load_balancing": False}
            off = [f"--{k.replace('_', '-')}" for k, v in {**MOE_FIELDS, **run}.items() if getattr(self, k) != v]
            if off:
                raise ConfigError(f"{', '.join(off)} configure{'s' if len(off) == 1 else ''} mixture-of-experts "
                                  "layers: add --num-experts (or drop it)")
            return
        e, k = self.num_experts, self.moe_router_topk
        if e < 1:
            raise ConfigError(f"--num-experts {e}: must be >= 1")
        if not 1 <= k <= e:
            raise ConfigError(f"--moe-router-topk {k} with --num-experts {e}: each token is routed to k of the "
                              f"{e} experts; use 1 <= k <= {e}")
        for flag, value, allowed in (("--moe-router-load-balancing-type", self.moe_router_load_balancing_type,
                                      MOE_LOAD_BALANCING),
                                     ("--moe-router-score-function", self.moe_router_score_function, MOE_SCORE_FUNCTIONS),
                                     ("--moe-token-dispatcher-type", self.moe_token_dispatcher_type, MOE_DISPATCHERS)):
            if value not in allowed:
                raise ConfigError(f"{flag} {value}: not supported here; choose one of {', '.join(allowed)}")
        if k == 1 and self.moe_router_score_function == "softmax" and not self.moe_router_pre_softmax:
            raise ConfigError("--moe-router-topk 1 with the softmax score function: add --moe-router-pre-softmax "
                              "(megatron-core's rule: a softmax over the one chosen logit has a zero gradient)")
        for flag, v in (("--moe-ffn-hidden-size", self.moe_ffn_hidden_size),
                        ("--moe-shared-expert-intermediate-size", self.moe_shared_expert_intermediate_size)):
            if v is not None and v < 1:
                raise ConfigError(f"{flag} {v}: must be >= 1")
        for flag, v in (("--moe-aux-loss-coeff", self.moe_aux_loss_coeff), ("--moe-z-loss-coeff", self.moe_z_loss_coeff),
                        ("--moe-router-topk-scaling-factor", self.moe_router_topk_scaling_factor)):
            if v is not None and v < 0:
                raise ConfigError(f"{flag} {v}: must be >= 0")
        if self.moe_shared_expert_intermediate_size is not None and self.add_bias_linear:
            raise ConfigError("--moe-shared-expert-intermediate-size: megatron-core's shared expert has no biases; "
                              "add --disable-bias-linear")
        if self.moe_shared_expert_gate and self.moe_shared_expert_intermediate_size is None:
            raise ConfigError("--moe-shared-expert-gate gates the shared expert: add "
                              "--moe-shared-expert-intermediate-size")
        check_capacity(self)
        if self.moe_router_enable_expert_bias and self.moe_router_score_function != "sigmoid":
            raise ConfigError("--moe-router-enable-expert-bias biases the sigmoid router's scores (megatron-core's "
                              "rule): add --moe-router-score-function sigmoid")
        if not self.moe_router_bias_update_rate >= 0:
            raise ConfigError(f"--moe-router-bias-update-rate {self.moe_router_bias_update_rate}: must be >= 0")
        check_group_limited_routing(self)
        if self.moe_input_jitter_eps is not None and not 0 < self.moe_input_jitter_eps < 1:
            raise ConfigError(f"--moe-input-jitter-eps {self.moe_input_jitter_eps}: the noise is uniform in "
                              "[1 - eps, 1 + eps]; use 0 < eps < 1")
        self.moe_layers()

    def moe_layers(self) -> list[bool]:
        """Which layers are MoE (megatron-core's moe_layer_freq: every N-th layer from layer 0, or a 0/1
        list with one entry per layer); all False for a dense model."""
        if self.num_experts is None:
            return [False] * self.num_layers
        freq = self.moe_layer_freq
        if isinstance(freq, int) and not isinstance(freq, bool):
            if freq < 1:
                raise ConfigError(f"--moe-layer-freq {freq}: must be >= 1 (every N-th layer is MoE)")
            return [i % freq == 0 for i in range(self.num_layers)]
        freq = list(freq)
        if len(freq) != self.num_layers or any(x not in (0, 1) or isinstance(x, bool) for x in freq):
            raise ConfigError(f"--moe-layer-freq {freq}: a list needs one 0 (dense) or 1 (MoE) per layer, "
                              f"{self.num_layers} entries")
        return [x == 1 for x in freq]

    @property
    def moe_ffn_size(self) -> int:
        return self.moe_ffn_hidden_size or self.ffn_size

    def check_expert_parallel(self, tensor_parallel: int, expert_parallel: int, expert_tensor_parallel: int | None,
                              sequence_parallel: bool) -> None:
        """What the expert layout needs of the model (parallel/state.py checks it against the world)."""
        etp = tensor_parallel if expert_tensor_parallel is None else expert_tensor_parallel
        if self.num_experts is None:
            if expert_parallel != 1 or etp != tensor_parallel:
                raise ConfigError("--expert-model-parallel-size / --expert-tensor-parallel-size split experts: add "
                                  "--num-experts (or drop them)")
            return
        if self.num_experts % expert_parallel:
            raise ConfigError(f"--expert-model-parallel-size {expert_parallel} does not divide --num-experts "
                              f"{self.num_experts}: each EP rank holds num_experts / EP whole experts; use an EP size "
                              f"that divides {self.num_experts}")
        if etp < 1:
            raise ConfigError(f"--expert-tensor-parallel-size {etp} must be >= 1")
        if tensor_parallel > 1 and not sequence_parallel:
            raise ConfigError(f"mixture-of-experts layers at --tensor-model-parallel-size {tensor_parallel} need "
                              "--sequence-parallel (megatron-core's MoE layer refuses to train without it)")
        if self.add_bias_linear and etp > 1:
            raise ConfigError(f"mixture-of-experts layers with biases need expert TP 1 (megatron-core's rule; here "
                              f"{etp}): add --disable-bias-linear or use --expert-tensor-parallel-size 1")
        if self.moe_ffn_size % etp:
            raise ConfigError(f"expert TP {etp} (--expert-tensor-parallel-size, default TP) does not divide the "
                              f"experts' FFN size {self.moe_ffn_size}: use an expert TP that divides it")

    def check_query_groups_tp(self, tensor_parallel: int) -> None:
        """Grouped-query attention: megatron-core's local attention splits num_query_groups over
        TP, so each rank must hold whole key/value groups (G % TP == 0)."""
        g = self.query_groups
        if g != self.num_attention_heads and g % tensor_parallel:
            raise ConfigError(
                f"--tensor-model-parallel-size {tensor_parallel} does not divide --num-query-groups {g}: "
                f"each TP rank holds whole key/value groups; use --tensor-model-parallel-size <= "
                f"{largest_divisor_at_most(g, tensor_parallel)} that divides {g}")

    def check_tensor_parallel(self, tensor_parallel: int) -> None:
        """What a TP size needs: whole query groups, whole heads and whole MLP columns per rank."""
        self.check_query_groups_tp(tensor_parallel)
        moe = (("--moe-ffn-hidden-size", self.moe_ffn_size),
               ("--moe-shared-expert-intermediate-size", self.moe_shared_expert_intermediate_size or 0)) \
            if self.num_experts is not None else ()
        # MLA's down projections are megatron-core's column-parallel linears in the local spec: their latents split
        # (model/mla.py replaces the key/value one by a replicated weight, but only after megatron-core's
        # constructor has built, and divided, the column-parallel one; Megatron-LM's local files need it too)
        mla = (("--q-lora-rank", self.q_lora_rank or 0),
               ("--kv-lora-rank + --qk-pos-emb-head-dim", self.kv_lora_rank + self.qk_pos_emb_head_dim)) \
            if self.multi_latent_attention else ()
        for flag, n in (("--num-attention-heads", self.num_attention_heads), ("--ffn-hidden-size", self.ffn_size), *moe,
                        *mla):
            if n % tensor_parallel:
                raise ConfigError(f"--tensor-model-parallel-size {tensor_parallel} does not divide {flag} {n}: "
                                  f"use a TP size that divides {n}")

    @property
    def dtype(self) -> torch.dtype:
        return PRECISIONS[self.precision]

    @property
    def ffn_size(self) -> int:
        if self.ffn_hidden_size:
            return self.ffn_hidden_size
        return swiglu_ffn_size(self.hidden_size) if self.swiglu else 4 * self.hidden_size

    @property
    def gelu_mlp(self) -> bool:
        """The MLP's activation is a GELU (gelu_approximate says which): not SwiGLU, squared ReLU or quick GeGLU."""
        return not (self.swiglu or self.squared_relu or self.quick_geglu)

    @property
    def gated_mlp(self) -> bool:
        """linear_fc1 is [gate; up] (2 x FFN outputs; stride 2 over TP): SwiGLU or quick GeGLU."""
        return self.swiglu or self.quick_geglu

    @property
    def query_groups(self) -> int:
        """G: key/value heads (= num_attention_heads without grouped-query attention)."""
        return self.num_query_groups or self.num_attention_heads

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    def architecture_name(self) -> str:
        """"GPT-2", or the parts that differ from it, e.g. "RoPE+RMSNorm+SwiGLU+GQA(8 groups)+untied";
        multi-latent attention names its latents, head dims and its own rotary embedding, e.g.
        "MLA(q latent 1536, kv latent 512, qk 128+64, v 128, latent norms, YaRN x40 of 4096, base 10000)"."""
        mla = self.multi_latent_attention
        yarn = (f", YaRN x{self.rotary_scaling_factor:g} of {self.yarn_original_max_position_embeddings}"
                if self.position_embedding_type == "yarn" else "")
        mla_rope = (f"YaRN x{self.rotary_scaling_factor:g} of {self.yarn_original_max_position_embeddings}, "
                    if self.rope_type != "rope" else "RoPE ") + f"base {self.rotary_base}" \
            + (f", {self.rotary_percent:g} of its channels" if self.rope_type == "rope" and self.rotary_percent != 1 else "")
        mla_part = (f"MLA({'q latent ' + str(self.q_lora_rank) if self.q_lora_rank else 'queries direct'}, kv latent "
                    f"{self.kv_lora_rank}, qk {self.qk_head_dim}+{self.qk_pos_emb_head_dim}, v {self.v_head_dim}"
                    + (", latent norms" if self.qk_layernorm else "") + f", {mla_rope})") if mla else ""
        # under MLA a model-level rope is not built (megatron-core's GPTModel): the attention rotates its own
        parts = [("RoPE" + (f"(base {self.rotary_base}" + (f", scaled x{self.rope_scaling_factor:g}" if
                                                           self.use_rope_scaling else "") + yarn + ")"))
                 if self.position_embedding_type != "learned_absolute" and not mla else "",
                 mla_part,
                 "RMSNorm" if self.normalization == "RMSNorm" else "",
                 self._gated_name(),
                 {"off-by-one": "softmax-off-by-one", "learnable": "sinks"}.get(self.softmax_type, ""),
                 "ReLU^2" if self.squared_relu else "",
                 "erf-GELU" if self.gelu_mlp and self.gelu_approximate == "none" else "",
                 f"GQA({self.query_groups} groups)" if self.query_groups != self.num_attention_heads else "",
                 "untied" if self.untie_embeddings_and_output_weights else "",
                 "no-bias" if not self.add_bias_linear else "",
                 "qkv-bias" if self.add_qkv_bias and not self.add_bias_linear else "",
                 "qk-norm" if self.qk_layernorm and not mla else "",
                 "norm-1p" if self.layernorm_zero_centered_gamma else "",
                 describe_window(self.window_size, self.window_attn_skip_freq, self.num_layers, short=True)]
        parts = [p for p in parts if p]
        return "+".join(parts) if parts else "GPT-2"

    def _gated_name(self) -> str:
        """"SwiGLU" / "QuickGeGLU", with the clamp and offset where set: e.g. "QuickGeGLU(clamp 7, +1)" (GPT-OSS)."""
        if not self.gated_mlp:
            return ""
        extras = ([f"clamp {self.activation_func_clamp_value:g}"] if self.activation_func_clamp_value is not None
                  else []) + ([f"{self.glu_linear_offset:+g}"] if self.glu_linear_offset else [])
        return ("SwiGLU" if self.swiglu else "QuickGeGLU") + (f"({', '.join(extras)})" if extras else "")

    def arch_meta(self) -> dict:
        """The ARCH_FIELDS with defaults resolved (FFN size, G, head dim): what a checkpoint records."""
        meta = {name: getattr(self, name) for name in ARCH_FIELDS}
        meta.update(ffn_hidden_size=self.ffn_size, num_query_groups=self.query_groups, kv_channels=self.head_dim,
                    moe_ffn_hidden_size=self.moe_ffn_size if self.num_experts is not None else None,
                    window_size=None if self.window_size is None else list(self.window_size))   # as JSON keeps it
        return meta

    def padded_vocab_size(self, tensor_parallel: int) -> int:
        """Megatron's padding: a multiple of make_vocab_size_divisible_by x TP."""
        multiple = self.make_vocab_size_divisible_by * tensor_parallel
        return -(-self.vocab_size // multiple) * multiple

    def num_parameters(self) -> int:
        """Unpadded total parameter count (the number Hugging Face reports for the same model)."""
        h, f, L, V = self.hidden_size, self.ffn_size, self.num_layers, self.vocab_size
        d, heads, g = self.head_dim, self.num_attention_heads, self.query_groups
        norm = 2 if self.normalization == "LayerNorm" else 1          # weight (+ bias)
        bias = 1 if self.add_bias_linear else 0
        qkv_out = (heads + 2 * g) * d
        attention = (qkv_out * h + (qkv_out if self.add_bias_linear or self.add_qkv_bias else 0)
                     + (2 * norm * d if self.qk_layernorm else 0)                # q/k norms
                     + h * heads * d + bias * h)                                 # linear_proj
        if self.multi_latent_attention:
            attention = self.mla_parameters()
        sinks = heads if self.softmax_type == "learnable" else 0                   # one softmax offset per head
        per_layer = norm * h + attention + sinks + norm * h                      # input and pre-MLP norms
        mlps = sum(self._moe_mlp_parameters() if moe else self._mlp_parameters(f) for moe in self.moe_layers())
        positions = self.max_position_embeddings * h if self.position_embedding_type == "learned_absolute" else 0
        output = V * h if self.untie_embeddings_and_output_weights else 0
        return V * h + positions + L * per_layer + mlps + norm * h + output

    def mla_parameters(self) -> int:
        """One layer's multi-latent attention: the projections (no biases but linear_proj's) and, with
        --qk-layernorm, the q and kv latents' norms (the planner's rows of them: planner/params.py)."""
        arch = Architecture(**{k: getattr(self, k) for k in Architecture.__dataclass_fields__})
        return sum(n for _, n, _ in mla_attention_rows(self.hidden_size, self.num_attention_heads, arch))

    def _mlp_parameters(self, f: int, bias: bool | None = None) -> int:
        h, bias = self.hidden_size, self.add_bias_linear if bias is None else bias
        fc1_out = 2 * f if self.gated_mlp else f
        return fc1_out * h + bias * fc1_out + h * f + bias * h

    def _moe_mlp_parameters(self) -> int:
        """Router (E x h, + E with biases), E experts, the shared expert (no biases: megatron-core's
        SharedExpertMLP) and its gate (h)."""
        e, h, shared = self.num_experts, self.hidden_size, self.moe_shared_expert_intermediate_size
        out = e * h + (e if self.add_bias_linear else 0) + e * self._mlp_parameters(self.moe_ffn_size)
        if shared:
            out += self._mlp_parameters(shared, bias=False) + (h if self.moe_shared_expert_gate else 0)
        return out


def complete_arch_meta(meta: dict, args: dict | None = None) -> dict:
    """A checkpoint's recorded architecture with the ARCH_FIELDS it predates filled in.

    Checkpoints written before the Llama-family fields existed are GPT-2 (learned positions,
    LayerNorm 1e-5, GELU, biases, tied, one key/value head per head); their vocabulary divisor is
    in their stored args (Megatron's default 128 otherwise)."""
    out = dict(meta)
    if "num_attention_heads" in out and "hidden_size" in out:
        out.setdefault("num_query_groups", out["num_attention_heads"])
        out.setdefault("kv_channels", out["hidden_size"] // out["num_attention_heads"])
    out.setdefault("make_vocab_size_divisible_by", int((args or {}).get("make_vocab_size_divisible_by") or 128))
    # before the field: every GELU MLP was the tanh GELU (a SwiGLU model records "none")
    out.setdefault("gelu_approximate", "none" if out.get("swiglu") or out.get("squared_relu") else "tanh")
    defaults = {f.name: f.default for f in fields(GPTConfig)}
    for name in ARCH_FIELDS:
        if name not in _RECORDED_FROM_THE_START:
            out.setdefault(name, defaults[name])
    return out


# What checkpoints have recorded since the first format (never filled in: a shape is never guessed).
_RECORDED_FROM_THE_START = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "vocab_size",
                            "max_position_embeddings", "num_query_groups", "kv_channels")
