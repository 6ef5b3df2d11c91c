"""Megatron-LM's definitions, transcribed as test references (megatron-core 0.16.1)."""
import math


def megatron_get_lr(num_steps, *, init_lr, max_lr, min_lr, lr_warmup_steps, lr_decay_steps, lr_decay_style,
                    wsd_decay_steps=None, lr_wsd_decay_style=None):
    """Transcribed from OptimizerParamScheduler.get_lr (param_group without overrides)."""
    if lr_warmup_steps > 0 and num_steps <= lr_warmup_steps:
        return init_lr + ((max_lr - init_lr) * float(num_steps) / float(lr_warmup_steps))
    if lr_decay_style == 'constant':
        return max_lr
    if num_steps > lr_decay_steps:
        return min_lr
    if lr_decay_style == 'inverse-square-root':
        warmup_steps = max(lr_warmup_steps, 1)
        num_steps = max(num_steps, 1)
        lr = max_lr * warmup_steps**0.5 / (num_steps**0.5)
        return max(min_lr, lr)
    num_steps_ = num_steps - lr_warmup_steps
    decay_steps_ = lr_decay_steps - lr_warmup_steps
    decay_ratio = float(num_steps_) / float(decay_steps_)
    assert 0.0 <= decay_ratio <= 1.0
    delta_lr = max_lr - min_lr
    if lr_decay_style == 'linear':
        coeff = 1.0 - decay_ratio
    elif lr_decay_style == 'cosine':
        coeff = 0.5 * (math.cos(math.pi * decay_ratio) + 1.0)
    elif lr_decay_style == 'WSD':
        wsd_anneal_start_ = lr_decay_steps - wsd_decay_steps
        if num_steps <= wsd_anneal_start_:
            coeff = 1.0
        else:
            wsd_steps = num_steps - wsd_anneal_start_
            wsd_decay_ratio = float(wsd_steps) / float(wsd_decay_steps)
            if lr_wsd_decay_style == "linear":
                coeff = 1.0 - wsd_decay_ratio
            elif lr_wsd_decay_style == "cosine":
                coeff = 0.5 * (math.cos(math.pi * wsd_decay_ratio) + 1.0)
            elif lr_wsd_decay_style == "exponential":
                coeff = (2.0 * math.pow(0.5, wsd_decay_ratio)) - 1.0
            elif lr_wsd_decay_style == "minus_sqrt":
                coeff = 1.0 - math.sqrt(wsd_decay_ratio)
    return min_lr + coeff * delta_lr


def megatron_flops_per_token(*, num_layers, hidden_size, seq_length, ffn_hidden_size, padded_vocab_size,
                             num_attention_heads, kv_channels=None, num_query_groups=None, swiglu=False):
    """Megatron-LM's `num_floating_point_operations(args, batch_size)` (megatron/training/training.py at
    core_v0.16.1, transformer_flops: dense GPT, no MoE, no MTP, no MLA, no linear attention, no attention
    output gate) divided by batch_size x seq_length."""
    group_query_attention = num_query_groups is not None
    kv_channels = kv_channels or hidden_size // num_attention_heads
    if not group_query_attention:
        num_query_groups = num_attention_heads
    batch_size = 1
    num_dense_layers, num_moe_layers, mtp_num_layers = num_layers, 0, 0
    forward_backward_expansion_factor = 3
    fma_expansion_factor = 2
    ffn_expansion_factor = 3 if swiglu else 2
    query_projection_size = kv_channels * num_attention_heads
    key_projection_size = kv_channels * num_query_groups
    value_projection_size = kv_channels * num_query_groups
    gate_projection_size = 0
    standard_self_attn_term = (
        forward_backward_expansion_factor
        * fma_expansion_factor
        * (
            hidden_size * (query_projection_size + key_projection_size + value_projection_size
                           + gate_projection_size)
            + query_projection_size * seq_length / 2 * 2
            + query_projection_size * hidden_size
        )
    )
    self_attn_term = standard_self_attn_term * num_layers
    total = (
        batch_size * seq_length * (
            forward_backward_expansion_factor * fma_expansion_factor * hidden_size
            * (ffn_hidden_size * ffn_expansion_factor * num_dense_layers + 0 * num_moe_layers)
            + self_attn_term
            + forward_backward_expansion_factor * fma_expansion_factor * hidden_size * padded_vocab_size
            * (mtp_num_layers + 1)
        )
    )
    return total / (batch_size * seq_length)


def megatron_llama2_tokenize(sp, s, bos=True, eos=False):
    """Transcribed from megatron/training/tokenizer/tokenizer.py (core_v0.16.1) _Llama2Tokenizer.tokenize
    over a sentencepiece.SentencePieceProcessor `sp` (its n_words = sp.vocab_size(), eod = eos_id)."""
    assert type(s) is str
    t = sp.encode(s)
    if bos:
        t = [sp.bos_id()] + t
    if eos:
        t = t + [sp.eos_id()]
    return t


def megatron_preprocess_document(sp, text, append_eod=True):
    """tools/preprocess_data.py's Encoder.encode for one document without --split-sentences (core_v0.16.1):
    the whole text is one sentence, tokenized, then the tokenizer's eod appended with --append-eod."""
    ids = megatron_llama2_tokenize(sp, text)
    return ids + [sp.eos_id()] if append_eod else ids


def megatron_bias_gelu_fusion(args) -> bool:
    """TransformerConfig.bias_activation_fusion for a GELU MLP as Megatron-LM sets it (core_v0.16.1
    arguments.py): core_transformer_config_from_args takes args.bias_gelu_fusion (--no-bias-gelu-fusion
    turns it off; on by default), which validate_args has turned off where add_bias_linear is off.
    megatron-core's MLP then computes its fused bias-GELU (fused_bias_gelu.py's tanh approximation).
    SwiGLU: off here (its fusion is the same function as the unfused silu(gate) * up)."""
    if args.swiglu or getattr(args, "quick_geglu", False):
        return False
    return bool(getattr(args, "bias_gelu_fusion", True)) and bool(args.add_bias_linear)


def megatron_core_config(args, *, initialise=False, **layout):
    """megatron-core's TransformerConfig from Megatron-LM's saved args alone (independent of
    zo_megatron.model), as Megatron-LM's loader would build it: the args' model, its MoE fields where
    the args have experts; `layout` overrides the parallel sizes (pipeline stages, for instance).
    `initialise`: megatron-core's own random initialisation (on the host); else the weights are
    left to a load. Dropout off, no fusions but Megatron-LM's bias-GELU (megatron_bias_gelu_fusion: it
    decides which GELU the MLP computes): the CPU eval forward of a test reference. The args'
    sequence parallelism is a training layout (megatron-core's MoELayer asks for it only when
    training; its torch norms refuse it without Apex): off here, the same math. Multi-latent attention
    (args.multi_latent_attention): MLATransformerConfig with every field of its own the args hold (Megatron-LM's
    core_transformer_config_from_args: rope_type None left to the class's default), the rest its defaults."""
    import dataclasses

    import torch
    import torch.nn.functional as F
    from megatron.core.activations import squared_relu
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    def quick_gelu(x):
        # megatron-core's quick_gelu (fusions/fused_bias_geglu.py) is torch.compile'd: ~15 s to compile on a CPU
        return x * torch.sigmoid(1.702 * x)

    quick_geglu = bool(getattr(args, "quick_geglu", False))
    moe = {}
    if getattr(args, "num_experts", None):
        moe = dict(
            expert_model_parallel_size=args.expert_model_parallel_size,
            expert_tensor_parallel_size=args.expert_tensor_parallel_size, num_moe_experts=args.num_experts,
            moe_router_topk=args.moe_router_topk, moe_ffn_hidden_size=args.moe_ffn_hidden_size,
            moe_router_pre_softmax=args.moe_router_pre_softmax,
            moe_router_load_balancing_type=args.moe_router_load_balancing_type,
            moe_aux_loss_coeff=args.moe_aux_loss_coeff,
            moe_shared_expert_intermediate_size=args.moe_shared_expert_intermediate_size,
            moe_shared_expert_gate=args.moe_shared_expert_gate, moe_layer_freq=args.moe_layer_freq,
            moe_token_dispatcher_type=args.moe_token_dispatcher_type, moe_grouped_gemm=args.moe_grouped_gemm,
            moe_use_legacy_grouped_gemm=getattr(args, "moe_use_legacy_grouped_gemm", False),
            # the router's semantics, as Megatron-LM passes every TransformerConfig field its args hold
            moe_router_score_function=getattr(args, "moe_router_score_function", "softmax"),
            moe_router_topk_scaling_factor=getattr(args, "moe_router_topk_scaling_factor", None),
            moe_router_enable_expert_bias=bool(getattr(args, "moe_router_enable_expert_bias", False)),
            moe_router_num_groups=getattr(args, "moe_router_num_groups", None),
            moe_router_group_topk=getattr(args, "moe_router_group_topk", None))
    fields = dict(
        num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups, kv_channels=args.kv_channels, ffn_hidden_size=args.ffn_hidden_size,
        gated_linear_unit=args.swiglu or quick_geglu,
        activation_func=F.silu if args.swiglu else quick_gelu if quick_geglu else squared_relu
        if getattr(args, "squared_relu", False) else F.gelu,
        # GPT-OSS (Megatron-LM's core_transformer_config_from_args passes TransformerConfig's fields as the args hold
        # them; --quick-geglu sets the gated unit and megatron-core's quick_gelu)
        glu_linear_offset=float(getattr(args, "glu_linear_offset", 0.0) or 0.0),
        activation_func_clamp_value=getattr(args, "activation_func_clamp_value", None),
        softmax_type=getattr(args, "softmax_type", None) or "vanilla",
        normalization=args.normalization,
        layernorm_epsilon=args.norm_epsilon, add_bias_linear=args.add_bias_linear, add_qkv_bias=args.add_qkv_bias,
        qk_layernorm=getattr(args, "qk_layernorm", False), hidden_dropout=0.0, attention_dropout=0.0,
        apply_query_key_layer_scaling=False, attention_softmax_in_fp32=True,
        tensor_model_parallel_size=args.tensor_model_parallel_size, sequence_parallel=False, **moe,
        params_dtype=torch.float32, use_cpu_initialization=True, perform_initialization=initialise,
        gradient_accumulation_fusion=False, masked_softmax_fusion=False,
        bias_activation_fusion=megatron_bias_gelu_fusion(args),
        bias_dropout_fusion=False, apply_rope_fusion=False, persist_layer_norm=False)
    config_class, mla = TransformerConfig, {}
    if getattr(args, "multi_latent_attention", False):
        config_class = MLATransformerConfig
        own = {f.name for f in dataclasses.fields(MLATransformerConfig)} - {f.name for f in dataclasses.fields(
            TransformerConfig)} | {"rotary_base", "rotary_percent"}
        mla = {k: getattr(args, k) for k in sorted(own) if hasattr(args, k)}
        if mla.get("rope_type", "") is None:
            del mla["rope_type"]
        mla["num_query_groups"] = None      # validate_args: MLA excludes grouped-query attention
    return config_class(**{**fields, **mla, **layout})


def mla_core_attention():
    """A core attention for megatron-core's local MLA spec, whose own DotProductAttention (0.16.1) takes no
    separate key and value head dims (MLASelfAttention passes k_channels, v_channels; Transformer Engine's
    attention takes them): plain softmax attention over [s, b, n, d] as DotProductAttention computes it --
    scores q.k x softmax_scale (MLA's, which folds in YaRN's mscale), masked where the mask is True, softmax
    in fp32, times the values -- returning [s, b, n x v_head_dim]."""
    import torch
    from megatron.core.transformer.module import MegatronModule

    class MLACoreAttention(MegatronModule):
        def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                     softmax_scale=None, k_channels=None, v_channels=None, cp_comm_type=None, pg_collection=None):
            super().__init__(config=config)
            self.softmax_scale = softmax_scale

        def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                    packed_seq_params=None):
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))          # [b, n, s, d]
            scores = torch.matmul(q, k.transpose(-1, -2)) * self.softmax_scale
            scores = scores.masked_fill(attention_mask, float("-inf"))
            probs = torch.softmax(scores.float(), dim=-1).to(v.dtype)
            ctx = torch.matmul(probs, v)                                           # [b, n, s, dv]
            return ctx.permute(2, 0, 1, 3).reshape(ctx.shape[2], ctx.shape[0], -1)

    return MLACoreAttention


# Transformer Engine's modules (megatron-core 0.16.1's wrappers, megatron/core/extensions/transformer_engine.py)
# and what each holds in a state dict, read from Transformer Engine 2.9-2.11 (the versions Megatron-LM
# core_v0.16.1's pyproject.toml pins, `transformer-engine>=2.9.0a0,<2.12.0`):
#   TELayerNormColumnParallelLinear (te.pytorch.LayerNormLinear, module/layernorm_linear.py): layer_norm_weight,
#       layer_norm_bias unless RMSNorm, weight, bias with a bias (else a plain attribute, not saved)
#   TELinear, TEColumnParallelLinear, TERowParallelLinear (te.pytorch.Linear, module/linear.py): weight, bias
#   TE*GroupedLinear (te.pytorch.GroupedLinear, module/grouped_linear.py): weight{j}, bias{j} per GEMM
#   TENorm (te.pytorch.LayerNorm / RMSNorm: ops/basic/layer_norm.py, rmsnorm.py): weight, bias unless RMSNorm
#   TEDotProductAttention (attention/dot_product_attention/dot_product_attention.py): no tensor (softmax_offset
#       only for a learnable softmax)
# and every one an `_extra_state`: each is a TransformerEngineBaseModule (module/base.py) or a BasicOperation
# (ops/op.py), both overriding get_extra_state / set_extra_state.
TE_LINEARS = ("TELinear", "TEColumnParallelLinear", "TERowParallelLinear")
TE_GROUPED = ("TEColumnParallelGroupedLinear", "TERowParallelGroupedLinear")


def _te_entries(kind: str, *, bias: bool, layer_norm: bool, gemms: int) -> list[str]:
    norm = ["bias"] if layer_norm else []
    bias_ = ["bias"] if bias else []
    return {"TELayerNormColumnParallelLinear": ["layer_norm_weight", *(["layer_norm_bias"] if layer_norm else []),
                                                "weight", *bias_],
            **{k: ["weight", *bias_] for k in TE_LINEARS},
            **{k: [f"weight{j}" for j in range(gemms)] + ([f"bias{j}" for j in range(gemms)] if bias else [])
               for k in TE_GROUPED},
            "TENorm": ["weight", *norm], "TEDotProductAttention": []}[kind] + ["_extra_state"]


def transformer_engine_specs(args, config):
    """(the layer specs, the final norm's module) Megatron-LM core_v0.16.1 builds with --transformer-impl
    transformer_engine (its default) for `args`: gpt_builders.py's _get_transformer_layer_spec(use_te=True)
    -- get_gpt_layer_with_transformer_engine_spec(num_experts, moe_grouped_gemm, qk_layernorm,
    multi_latent_attention) for every layer -- or, with experts, get_gpt_decoder_block_spec(config,
    use_transformer_engine=True), whose layer specs are get_gpt_decoder_layer_specs' and whose final norm is
    TENorm; the dense path's final norm is transformer_block.py's LayerNormImpl, TENorm wherever Transformer
    Engine is installed (its lines 54-61). Built here without Transformer Engine: megatron-core's own spec
    functions run on its stand-ins -- the TE wrapper classes it defines when TE is missing (MagicMock-based,
    never instantiated), TESpecProvider and TENorm put where the spec module imports them when TE is
    present, is_te_min_version true (TE >= 2.9), and two stand-in classes for the grouped linears it defines
    only with TE (so that --moe-grouped-gemm's spec is TEGroupedMLP's, not the legacy fallback). Returns the
    layer specs, the final norm and {id(module class): TE class name} for the TE classes in them."""
    from megatron.core.extensions import transformer_engine as te_ext
    from megatron.core.extensions import transformer_engine_spec_provider as provider
    from megatron.core.models.gpt import gpt_layer_specs

    grouped = {name: type(name, (), {}) for name in TE_GROUPED}
    patches = [(provider, "is_te_min_version", lambda *a, **k: True),
               *((provider, name, cls) for name, cls in grouped.items()),
               (gpt_layer_specs, "TESpecProvider", provider.TESpecProvider), (gpt_layer_specs, "TENorm", te_ext.TENorm)]
    saved = [(mod, name, getattr(mod, name, None), hasattr(mod, name)) for mod, name, _ in patches]
    for mod, name, value in patches:
        setattr(mod, name, value)
    try:
        if getattr(args, "num_experts", None):
            layers = gpt_layer_specs.get_gpt_decoder_layer_specs(config, use_transformer_engine=True,
                                                                 normalization=args.normalization)
        else:
            layers = [gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
                getattr(args, "num_experts", None), getattr(args, "moe_grouped_gemm", False), args.qk_layernorm,
                getattr(args, "multi_latent_attention", False))] * args.num_layers
    finally:
        for mod, name, value, had in saved:
            if had:
                setattr(mod, name, value)
            else:
                delattr(mod, name)
    kinds = {id(getattr(te_ext, n)): n for n in (*TE_LINEARS, "TELayerNormColumnParallelLinear", "TENorm",
                                                 "TEDotProductAttention")}
    kinds.update({id(cls): name for name, cls in grouped.items()})
    return layers, te_ext.TENorm, kinds


def transformer_engine_state_keys(args, config, local_model) -> set[str]:
    """The state-dict keys of one rank's GPTModel as Megatron-LM core_v0.16.1 builds it with --transformer-impl
    transformer_engine (its torch-format rank file holds exactly these): megatron-core's TE spec tree for the
    args (transformer_engine_specs) walked over `local_model`, megatron-core's own local-spec GPTModel of the same
    args and rank. Where the TE spec puts a Transformer Engine module (or an IdentityOp) the local module's keys
    go and the TE module's come (_te_entries); a megatron-core module both specs share (TransformerLayer,
    SelfAttention, MLASelfAttention, MLP, MoELayer, SharedExpertMLP, SequentialMLP, TopKRouter) keeps its own
    keys; TEGroupedMLP, which the local spec does not build, replaces the local experts. Which submodules a
    module builds at all (MLA's linear_q_proj or its query latent, a shared expert) is megatron-core's own code,
    the same for both specs: a spec entry counts where the local model has a module at that path."""
    import dataclasses

    import torch
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.moe.experts import SequentialMLP, TEGroupedMLP
    from megatron.core.transformer.spec_utils import ModuleSpec

    layers, final_norm, kinds = transformer_engine_specs(args, config)
    modules = dict(local_model.named_modules())
    local_keys = set(local_model.state_dict())
    layer_norm = config.normalization == "LayerNorm"
    gemms = (config.num_moe_experts or 0) // config.expert_model_parallel_size
    out, replaced = set(), set()

    def walk(spec, path, built=False):
        module = spec.module if isinstance(spec, ModuleSpec) else spec
        kind = kinds.get(id(module))
        if kind is None and not (isinstance(module, type) and issubclass(module, torch.nn.Module)):
            return                                  # a function (bias-dropout-add), a keys map, None
        if path not in modules and not built:
            return                                  # not built by megatron-core's module for these args
        if kind is not None or issubclass(module, IdentityOp):
            replaced.add(path)
            if kind is not None:
                bias = config.add_bias_linear if kind in TE_GROUPED else f"{path}.bias" in local_keys
                out.update(f"{path}.{e}" for e in _te_entries(kind, bias=bias, layer_norm=layer_norm, gemms=gemms))
            return
        if type(modules.get(path)) is not module:
            replaced.add(path)                      # TEGroupedMLP where the local spec has other experts
        sub = spec.submodules if isinstance(spec, ModuleSpec) else None
        if module is SequentialMLP:                 # its local_experts: one MLP of these submodules per local expert
            for j in range(gemms):
                walk(ModuleSpec(module=MLP, submodules=sub), f"{path}.local_experts.{j}")
        elif dataclasses.is_dataclass(sub):
            for f in dataclasses.fields(sub):
                walk(getattr(sub, f.name), f"{path}.{f.name}", built=module is TEGroupedMLP)

    for i, spec in enumerate(layers):
        walk(spec, f"decoder.layers.{i}")
    walk(final_norm, "decoder.final_layernorm")
    kept = {k for k in local_keys if not any(k.startswith(p + ".") for p in replaced)}
    return kept | out
