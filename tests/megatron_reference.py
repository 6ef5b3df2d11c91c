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
    if args.swiglu:
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
        gated_linear_unit=args.swiglu,
        activation_func=F.silu if args.swiglu else squared_relu if getattr(args, "squared_relu", False) else F.gelu,
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
