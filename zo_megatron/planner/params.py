"""Parameter counts of the model, total and per TP rank (Megatron's layout), for every architecture
the planner models: GPT-2 (learned positions, LayerNorm, GELU, biases, tied embeddings) and the
Llama family through GPTConfig's fields (rope, RMSNorm, SwiGLU, GQA, untied output layer, no
biases / qkv bias only, qk LayerNorm), multi-latent attention (DeepSeek-V2/V3's MLA,
`mla_attention_rows`: megatron-core's MLASelfAttention as model/mla.py builds it), and GPT-OSS's parts:
quick GeGLU (a gated MLP: fc1 [gate; up] as SwiGLU's) and attention sinks (`sink_rows`).

One list of parameters (`layer_parameters`, `model_parameters`) in megatron-core's registration
order feeds both the counts here and the bucket walk of the memory model.

Mixture of experts (`MoEShape`, GPTConfig's MoE fields): the MLP of every layer `layers` names is
megatron-core's MoELayer (local spec): the router (E x h, + E with biases; replicated over TP), the
experts this EP rank holds (E / EP of them, each a dense MLP of the experts' FFN size, split over
expert TP as the dense MLP over TP; expert TP defaults to TP; their fc1 / fc2 biases with add_bias_linear,
GPT-OSS's), and the shared expert (split over TP; no biases) with its gate (h). Expert
parameters are named `.mlp.experts.` as zo_megatron/param_names.is_routed_expert names them.
"""
from __future__ import annotations

from dataclasses import dataclass

from zo_megatron.param_names import is_routed_expert

# megatron-core's selective recompute modules that the local spec has (--recompute-modules): the
# attention core, the two layer norms (their outputs dropped and recomputed), a dense layer's MLP, a
# whole MoE layer (router, dispatch and experts), the shared expert, multi-latent attention's up
# projections (their query, key and value dropped after the core attention and recomputed)
RECOMPUTE_MODULES = ("core_attn", "layernorm", "mlp", "moe", "shared_experts", "mla_up_proj")
# megatron-core's attention softmax types (softmax_type): "learnable" is GPT-OSS's attention sinks (model/sinks.py)
SOFTMAX_TYPES = ("vanilla", "off-by-one", "learnable")


def check_mlp_and_softmax(swiglu: bool, squared_relu: bool, quick_geglu: bool, glu_linear_offset: float,
                          activation_func_clamp_value: float | None, softmax_type: str) -> None:
    """The MLP activation's and the attention softmax's rules, one line each (ValueError): the job's (GPTConfig
    turns them into ConfigError) and the planner's. One activation at most (Megatron-LM's rule); the offset and
    the clamp shape a gated MLP's product, which megatron-core ignores otherwise; a clamp > 0; a known softmax."""
    if swiglu + squared_relu + quick_geglu > 1:
        raise ValueError("--swiglu, --squared-relu and --quick-geglu are three MLP activations: choose one "
                         "(Megatron-LM's rule)")
    if not (swiglu or quick_geglu) and (glu_linear_offset != 0.0 or activation_func_clamp_value is not None):
        raise ValueError("--glu-linear-offset / --activation-func-clamp-value shape a gated MLP's product "
                         "(megatron-core ignores them otherwise): add --quick-geglu or --swiglu, or drop them")
    if activation_func_clamp_value is not None and not activation_func_clamp_value > 0:
        raise ValueError(f"--activation-func-clamp-value {activation_func_clamp_value}: must be > 0 (the gate is "
                         "clamped to at most C, the linear half to [-C, C])")
    if softmax_type not in SOFTMAX_TYPES:
        raise ValueError(f"--softmax-type {softmax_type} (softmax_type): choose one of {', '.join(SOFTMAX_TYPES)}")


def default_core_attention(needs_sdpa: bool) -> str:
    """The core attention when no backend is named: megatron-core's local one, or torch SDPA where the model
    needs it -- multi-latent attention or a sliding window, which the local one cannot run (megatron-core
    0.16: no separate key and value head dims; its window mask is built on CUDA only, in place of any other
    mask). The job's flags, GPTConfig and the planner all resolve it here (flags_need_sdpa reads both from
    the job's flags)."""
    return "sdpa" if needs_sdpa else "local"


def flags_need_sdpa(flags) -> bool:
    """Whether the job's flags ask for what only torch SDPA runs: multi-latent attention, or a sliding
    window (--window-size other than full attention; a bad value is refused where it is parsed)."""
    from zo_megatron.planner.window import normalize_window_size

    try:
        windowed = normalize_window_size(getattr(flags, "window_size", None)) is not None
    except ValueError:
        windowed = False
    return bool(getattr(flags, "multi_latent_attention", False)) or windowed


def resolve_recompute(granularity: str | None, modules, *, recompute_activations: bool, moe_layer_recompute: bool,
                      experts: bool) -> tuple[str | None, list | None]:
    """(granularity, modules) of Megatron-LM's recompute flags as it resolves them, for the job's
    arguments and the planner alike: --recompute-activations is selective and wins over
    --recompute-granularity; --moe-layer-recompute (megatron-core's older flag) is selective with moe
    added to the modules (on a dense model nothing), and refused (ValueError) with full."""
    if recompute_activations:
        granularity = "selective"
    if moe_layer_recompute:
        if granularity == "full":
            raise ValueError("--moe-layer-recompute with --recompute-granularity full: full recompute covers the MoE "
                             "layers already; drop one of them (megatron-core's rule)")
        granularity = "selective"
        modules = ["core_attn"] if modules is None else list(modules)
        modules += ["moe"] * (experts and "moe" not in modules)
    return granularity, None if modules is None else list(dict.fromkeys(modules))


def selective_recompute_modules(recompute: str | None, modules, *, experts: bool, dense_layers: bool,
                                shared_expert: bool, linear_biases: bool, mla: bool = False) -> tuple | None:
    """The modules selective recompute runs (None when it is off), or a ValueError naming the flag
    and its fix: the job's rules (model/config.py) and the planner's (inputs.py), so the two never
    plan a run the other refuses. As Megatron-LM, the list defaults to the attention core and is
    moot under full recompute; without any recompute it is refused (Megatron-LM ignores it, which
    would leave a run believed to recompute keeping everything)."""
    if recompute != "selective":
        if modules is not None and recompute is None:
            raise ValueError("--recompute-modules applies to --recompute-granularity selective: add it (or drop "
                             "--recompute-modules)")
        return None
    modules = ("core_attn",) if modules is None else tuple(dict.fromkeys(modules))
    for m in modules:
        if m == "moe_act":
            raise ValueError("--recompute-modules moe_act: megatron-core recomputes the activation of its grouped "
                             "experts only, and the experts here run as its SequentialMLP (--moe-grouped-gemm is "
                             "performance only); use moe (the whole MoE layer) instead")
        if m == "mla_up_proj" and not mla:
            raise ValueError("--recompute-modules mla_up_proj recomputes multi-latent attention's up projections: "
                             "the model has none (add --multi-latent-attention, or drop it)")
        if m not in RECOMPUTE_MODULES:
            raise ValueError(f"--recompute-modules {m}: choose from {', '.join(RECOMPUTE_MODULES)}")
    if not experts and {"moe", "shared_experts"} & set(modules):
        raise ValueError("--recompute-modules moe / shared_experts recompute mixture-of-experts layers: the model "
                         "has none (add --num-experts, or drop them)")
    if "shared_experts" in modules and not shared_expert:
        raise ValueError("--recompute-modules shared_experts: the model has no shared expert (add "
                         "--moe-shared-expert-intermediate-size, or drop it)")
    if "mlp" in modules and linear_biases:
        # the MLP hands its fc2 bias (a parameter) out of megatron-core's checkpoint for the bias-dropout-add;
        # each recompute's backward then reached the checkpoints of earlier iterations through it, without end
        raise ValueError("--recompute-modules mlp with linear biases: megatron-core's MLP checkpoint returns the "
                         "fc2 bias itself and its backward never ends; add --disable-bias-linear, or use "
                         "--recompute-granularity full")
    if "mlp" in modules and not dense_layers:
        raise ValueError("--recompute-modules mlp recomputes dense MLPs: every layer here is a mixture of "
                         "experts; use moe")
    return modules


@dataclass(frozen=True)
class Architecture:
    """The shape-defining choices beyond layers/hidden/heads, named as GPTConfig's fields."""

    position_embedding_type: str = "learned_absolute"   # "learned_absolute" | "rope" | "yarn"
    rotary_percent: float = 1.0
    normalization: str = "LayerNorm"                     # "LayerNorm" | "RMSNorm"
    # the MLP's activation: GELU (none of these), SwiGLU, squared ReLU, or quick GeGLU (GPT-OSS: quick_gelu's
    # gated MLP); SwiGLU and quick GeGLU are gated (`gated_mlp`: linear_fc1 = [gate; up], 2f outputs)
    swiglu: bool = False
    squared_relu: bool = False
    quick_geglu: bool = False
    # a gated MLP's product act(min(gate, C)) * (clamp(up, -C, C) + offset) (megatron-core's glu(); GPT-OSS: C 7,
    # offset 1): what autograd keeps changes with the clamp (planner/mlp_activations.py), not the parameters
    glu_linear_offset: float = 0.0
    activation_func_clamp_value: float | None = None
    # the attention softmax: "vanilla", "off-by-one" (exp(0) in every denominator) or "learnable" (GPT-OSS's
    # attention sinks: one learned logit per head, a parameter split over TP with the heads)
    softmax_type: str = "vanilla"
    num_query_groups: int | None = None                  # None: = heads (multi-head attention)
    kv_channels: int | None = None                       # None: hidden // heads
    untie_embeddings_and_output_weights: bool = False
    add_bias_linear: bool = True
    add_qkv_bias: bool = False
    qk_layernorm: bool = False          # with MLA: the q and kv latents' norms
    # multi-latent attention (GPTConfig's MLA_FIELDS, Megatron-LM's defaults): queries from a q_lora_rank
    # latent (None: projected from the hidden state), keys and values from one kv_lora_rank latent per
    # token; per head qk_head_dim + qk_pos_emb_head_dim query/key channels and v_head_dim value channels
    multi_latent_attention: bool = False
    q_lora_rank: int | None = None
    kv_lora_rank: int = 32
    qk_head_dim: int = 128
    qk_pos_emb_head_dim: int = 64
    v_head_dim: int = 128

    @property
    def gated_mlp(self) -> bool:
        """linear_fc1 is [gate; up] (2f outputs): SwiGLU or quick GeGLU (GPTConfig.gated_mlp)."""
        return self.swiglu or self.quick_geglu


GPT2 = Architecture()


@dataclass(frozen=True)
class MoEShape:
    """The mixture-of-experts fields that change memory (GPTConfig's names in PlanInput)."""

    num_experts: int
    topk: int
    ffn: int                                # each expert's FFN size
    layers: tuple[bool, ...]                # which layers are MoE
    shared: int = 0                         # the shared expert's FFN size (0: none)
    shared_gate: bool = False
    expert_parallel: int = 1

    @property
    def local_experts(self) -> int:
        return self.num_experts // self.expert_parallel


def moe_layer_pattern(num_layers: int, freq) -> list[bool]:
    """megatron-core's --moe-layer-freq: every N-th layer from layer 0, or a 0/1 list per layer."""
    if isinstance(freq, int) and not isinstance(freq, bool):
        if freq < 1:
            raise ValueError(f"moe_layer_freq {freq} must be >= 1 (every N-th layer is MoE)")
        return [i % freq == 0 for i in range(num_layers)]
    freq = list(freq)
    if len(freq) != num_layers or any(x not in (0, 1) or isinstance(x, bool) for x in freq):
        raise ValueError(f"moe_layer_freq {freq}: a list needs one 0 (dense) or 1 (MoE) per layer, "
                         f"{num_layers} entries")
    return [x == 1 for x in freq]


def default_ffn_size(hidden_size: int, swiglu: bool) -> int:
    """Megatron-LM's --ffn-hidden-size default: 4h, or int(4h * 2/3 / 64) * 64 with --swiglu (SwiGLU
    specifically, not any gated MLP: Megatron-LM and GPTConfig.ffn_size give --quick-geglu 4h)."""
    return int(4 * hidden_size * 2 / 3 / 64) * 64 if swiglu else 4 * hidden_size


def pad_vocab_size(vocab_size: int, tensor_parallel: int = 1, divisible_by: int = 128) -> int:
    """Megatron's padding: round V up to a multiple of divisible_by x TP."""
    multiple = divisible_by * tensor_parallel
    return ((vocab_size + multiple - 1) // multiple) * multiple


def layer_parameters(hidden_size: int, ffn_size: int, num_attention_heads: int,
                     arch: Architecture = GPT2, moe: MoEShape | None = None) -> list[tuple[str, int, bool]]:
    """(name, numel, split over TP) of one transformer layer, in megatron-core's registration order
    (input norm, linear_proj, linear_qkv, q/k norms, pre-MLP norm, fc1, fc2).

    linear_qkv has (heads + 2G)·head_dim output rows (GQA's k/v are G heads each); fc1 has 2f rows
    with a gated MLP (SwiGLU, quick GeGLU: [gate; up]); norms have a bias only as LayerNorm; linear biases
    with add_bias_linear, the qkv bias also with add_qkv_bias; q/k norms act on one head (head_dim).
    Attention sinks (softmax_type "learnable") are the core attention's softmax_offset, one per head,
    split over TP with the heads and registered first in the attention (its core attention is built
    before linear_proj, also under MLA); "off-by-one" has no parameter (a fixed zero logit).
    Biases of row-parallel layers (proj, fc2) are replicated over TP. With `moe` the MLP is the MoE
    layer's (`moe_mlp_parameters`: router, this EP rank's experts, shared expert)."""
    h, f, a = hidden_size, ffn_size, num_attention_heads
    d = arch.kv_channels or h // a
    g = arch.num_query_groups or a
    qkv_out = (a + 2 * g) * d
    bias = arch.add_bias_linear

    def norm(name: str, n: int) -> list[tuple[str, int, bool]]:
        return _norm_rows(name, n, arch)

    rows = norm("input_layernorm", h)
    rows += sink_rows(a, arch)
    if arch.multi_latent_attention:
        rows += mla_attention_rows(h, a, arch)
    else:
        rows += [("self_attention.linear_proj.weight", h * a * d, True)]
        rows += [("self_attention.linear_proj.bias", h, False)] if bias else []
        rows += [("self_attention.linear_qkv.weight", qkv_out * h, True)]
        rows += [("self_attention.linear_qkv.bias", qkv_out, True)] if bias or arch.add_qkv_bias else []
        if arch.qk_layernorm:
            rows += norm("self_attention.q_layernorm", d) + norm("self_attention.k_layernorm", d)
    rows += norm("pre_mlp_layernorm", h)
    if moe is not None:
        return rows + moe_mlp_parameters(h, arch, moe)
    return rows + _mlp_rows("mlp.", h, f, arch.gated_mlp, bias)


def sink_rows(a: int, arch: Architecture) -> list[tuple[str, int, bool]]:
    """The attention sinks' parameter (softmax_type "learnable": megatron-core's DotProductAttention and
    model/attention.py's SDPAttention register `softmax_offset`, [heads / TP]); none otherwise."""
    if arch.softmax_type != "learnable":
        return []
    return [("self_attention.core_attention.softmax_offset", a, True)]


def _norm_rows(name: str, n: int, arch: Architecture) -> list[tuple[str, int, bool]]:
    """A norm of n channels: its weight, and its bias as LayerNorm (replicated over TP)."""
    return [(name + ".weight", n, False)] + ([(name + ".bias", n, False)] if arch.normalization == "LayerNorm" else [])


def mla_attention_rows(h: int, a: int, arch: Architecture) -> list[tuple[str, int, bool]]:
    """(name, numel, split over TP) of one layer's multi-latent attention in megatron-core's registration
    order (MLASelfAttention, model/mla.py), with n = a heads, d_qk = qk_head_dim + qk_pos_emb_head_dim:

      linear_proj          [h, n·v_head_dim] (+ bias h, replicated), row-parallel
      linear_q_proj        [n·d_qk, h], column-parallel                    (q_lora_rank None)
      linear_q_down_proj   [q_lora_rank, h], column-parallel (its output is gathered: the latent is whole)
      linear_q_up_proj     [n·d_qk, q_lora_rank], column-parallel
      linear_kv_down_proj  [kv_lora_rank + qk_pos_emb_head_dim, h], REPLICATED over TP (model/mla.py)
      linear_kv_up_proj    [n·(qk_head_dim + v_head_dim), kv_lora_rank], column-parallel
      q_layernorm, kv_layernorm   on the latents (q_lora_rank, kv_lora_rank; with qk_layernorm, the q one
                           only with a q latent), replicated
    No projection but linear_proj has a bias."""
    d_qk = arch.qk_head_dim + arch.qk_pos_emb_head_dim
    r_q, r_kv = arch.q_lora_rank, arch.kv_lora_rank
    p = "self_attention."
    rows = [(p + "linear_proj.weight", h * a * arch.v_head_dim, True)]
    rows += [(p + "linear_proj.bias", h, False)] if arch.add_bias_linear else []
    if r_q is None:
        rows += [(p + "linear_q_proj.weight", a * d_qk * h, True)]
    else:
        rows += [(p + "linear_q_down_proj.weight", r_q * h, True),
                 (p + "linear_q_up_proj.weight", a * d_qk * r_q, True)]
    rows += [(p + "linear_kv_down_proj.weight", (r_kv + arch.qk_pos_emb_head_dim) * h, False),
             (p + "linear_kv_up_proj.weight", a * (arch.qk_head_dim + arch.v_head_dim) * r_kv, True)]
    if arch.qk_layernorm:
        rows += _norm_rows(p + "q_layernorm", r_q, arch) if r_q is not None else []
        rows += _norm_rows(p + "kv_layernorm", r_kv, arch)
    return rows


def _mlp_rows(prefix: str, h: int, f: int, gated: bool, bias: bool) -> list[tuple[str, int, bool]]:
    """A dense MLP (or an expert): fc1 [f, or 2f gated: [gate; up]] (+ bias, split), fc2 (+ bias h, replicated
    over TP: the row-parallel output's)."""
    fc1_out = 2 * f if gated else f
    rows = [(prefix + "linear_fc1.weight", fc1_out * h, True)]
    rows += [(prefix + "linear_fc1.bias", fc1_out, True)] if bias else []
    rows += [(prefix + "linear_fc2.weight", h * f, True)]
    rows += [(prefix + "linear_fc2.bias", h, False)] if bias else []
    return rows


def moe_mlp_parameters(h: int, arch: Architecture, moe: MoEShape) -> list[tuple[str, int, bool]]:
    """(name, numel, split over TP) of one MoE layer's MLP on one EP rank, in megatron-core's
    registration order: router weight [E, h] (+ bias [E] with add_bias_linear), the rank's E / EP
    experts (each a dense MLP of the experts' FFN size, its biases with add_bias_linear), the shared
    expert's gate [1, h] and its fc1 / fc2 (never biases)."""
    bias = arch.add_bias_linear
    rows = [("mlp.router.weight", moe.num_experts * h, False)]
    rows += [("mlp.router.bias", moe.num_experts, False)] if bias else []
    for j in range(moe.local_experts):
        rows += _mlp_rows(f"mlp.experts.local_experts.{j}.", h, moe.ffn, arch.gated_mlp, bias)
    if moe.shared:
        rows += [("mlp.shared_experts.gate_weight", h, False)] if moe.shared_gate else []
        rows += _mlp_rows("mlp.shared_experts.", h, moe.shared, arch.gated_mlp, False)
    return rows


def model_parameters(num_layers: int, hidden_size: int, ffn_size: int, num_attention_heads: int,
                     vocab_size_padded: int, max_position_embeddings: int,
                     arch: Architecture = GPT2, moe: MoEShape | None = None) -> list[tuple[str, int, bool]]:
    """(name, numel, split over TP) of the whole GPTModel in registration order: embeddings, the
    layers, the final norm, and the output layer when it is untied (vocab-padded like the embedding;
    tied, the word embedding is the output layer). No position table with rope. With `moe`, the
    layers it names are MoE layers (one EP rank's experts)."""
    h = hidden_size
    rows = [("embedding.word_embeddings.weight", vocab_size_padded * h, True)]
    if arch.position_embedding_type == "learned_absolute":
        rows.append(("embedding.position_embeddings.weight", max_position_embeddings * h, False))
    layer = layer_parameters(h, ffn_size, num_attention_heads, arch)
    moe_layer = layer_parameters(h, ffn_size, num_attention_heads, arch, moe) if moe is not None else layer
    kinds = moe.layers if moe is not None else [False] * num_layers
    for i in range(num_layers):
        rows += [(f"decoder.layers.{i}.{n}", k, s) for n, k, s in (moe_layer if kinds[i] else layer)]
    rows.append(("decoder.final_layernorm.weight", h, False))
    if arch.normalization == "LayerNorm":
        rows.append(("decoder.final_layernorm.bias", h, False))
    if arch.untie_embeddings_and_output_weights:
        rows.append(("output_layer.weight", vocab_size_padded * h, True))
    return rows


def count_params(num_layers: int, hidden_size: int, vocab_size_padded: int,
                 max_position_embeddings: int, tensor_parallel: int = 1,
                 ffn_hidden_size: int | None = None, *, num_attention_heads: int | None = None,
                 arch: Architecture = GPT2, moe: MoEShape | None = None,
                 expert_tensor_parallel: int | None = None) -> dict[str, int]:
    """Parameters of the model, total and on one TP rank (Megatron layout).

    GPT-2 (the default `arch`), split over t: word embedding (vocab rows), qkv weight 3h x h + bias
    3h (column parallel), proj weight h x h (row parallel), fc1 f x h + bias f (column), fc2 h x f
    (row); f = ffn size (4h). Replicated: position embedding S x h, proj bias h, fc2 bias h, two
    LayerNorms 2h each, final LN 2h. Other architectures: see `layer_parameters`
    (num_attention_heads is needed only with GQA or kv_channels).

    Keys: total, per_tp_rank (everything one rank holds: with experts, the dense parameters of its TP
    rank and its EP rank's experts), replicated_per_tp_rank; dense_per_tp_rank and expert_per_rank
    (the rank's routed-expert parameters; 0 without experts), experts_total (every routed expert) and
    active (what one token uses: top-k routed experts per MoE layer instead of E; = total without).
    The routed experts' split tensors divide by `expert_tensor_parallel` (None: TP)."""
    L, h, V, S, t = num_layers, hidden_size, vocab_size_padded, max_position_embeddings, tensor_parallel
    et = t if expert_tensor_parallel is None else expert_tensor_parallel
    f = default_ffn_size(h, arch.swiglu) if ffn_hidden_size is None else ffn_hidden_size
    a = num_attention_heads
    if a is None:
        if arch.num_query_groups is not None or arch.kv_channels is not None or arch.multi_latent_attention:
            raise ValueError("count_params needs num_attention_heads with num_query_groups, kv_channels or "
                             "multi-latent attention")
        a = 1                                       # MHA with head_dim h: the counts do not depend on a
    if h % t or V % t or f % t:
        raise ValueError(f"hidden_size {h}, ffn size {f} and padded vocab {V} must be divisible by TP {t}")
    if arch.multi_latent_attention and (arch.q_lora_rank or 0) % t:
        raise ValueError(f"q_lora_rank {arch.q_lora_rank} must be divisible by TP {t} (its down projection is "
                         "column-parallel)")
    rows = model_parameters(0, h, f, a, V, S, arch)          # everything outside the layers
    out = {"total": sum(n for _, n, _ in rows), "replicated_per_tp_rank": sum(n for _, n, split in rows if not split),
           "per_tp_rank": sum(n // t for _, n, split in rows if split), "expert_per_rank": 0, "experts_total": 0}
    out["per_tp_rank"] += out["replicated_per_tp_rank"]
    kinds = list(moe.layers) if moe is not None else [False] * L
    full = None if moe is None else MoEShape(**{**moe.__dict__, "expert_parallel": 1})   # every expert
    routed_one = 0
    for is_moe in (False, True):
        count = sum(1 for k in kinds if k == is_moe)
        if not count:
            continue
        local = layer_parameters(h, f, a, arch, moe if is_moe else None)
        every = layer_parameters(h, f, a, arch, full) if is_moe else local
        def by(name: str) -> int:
            return et if is_routed_expert(name) else t

        if any(n % by(name) for name, n, split in local if split):
            raise ValueError(f"the TP-split parameters of a layer are not divisible by TP {t} (experts: expert TP {et})")
        out["total"] += count * sum(n for _, n, _ in every)
        out["replicated_per_tp_rank"] += count * sum(n for name, n, split in local if not split)
        out["per_tp_rank"] += count * sum(n // by(name) if split else n for name, n, split in local)
        if is_moe:
            out["expert_per_rank"] += count * sum(n // et if split else n for name, n, split in local
                                                  if is_routed_expert(name))
            experts = sum(n for name, n, _ in every if is_routed_expert(name))
            out["experts_total"] += count * experts
            routed_one = experts // moe.num_experts
    out["dense_per_tp_rank"] = out["per_tp_rank"] - out["expert_per_rank"]
    out["active"] = out["total"] - (0 if moe is None else
                                    sum(kinds) * (moe.num_experts - moe.topk) * routed_one)
    return out
