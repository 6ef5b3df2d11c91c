"""Which Megatron-LM checkpoint args from-megatron converts: an allow-list, not a deny-list.

A Megatron-LM checkpoint carries its run's whole argparse.Namespace. Every arg is one of:

    READ      the model's architecture: megatron_args.meta_from_args reads it (and refuses what
              zo_megatron's GPT does not build, e.g. a non-GELU, non-SwiGLU MLP)
    NEUTRAL   changes what the weights compute: only the listed values convert (the model is then
              the one zo_megatron builds); e.g. qk_l2_norm False, softmax_type 'vanilla'
    ANY       does not change what the weights compute: training, data, logging, parallel layout,
              precision, kernels and fusions, recomputation, initialisation, dropout (training only)

An arg on none of these lists must keep its neutral value: Megatron-LM's default for a flag of its
model groups (transformer configuration, network size, ...; the flag list of core_v0.16.1,
training/megatron_flag_list.py), else None, False, 0 or empty. So a Megatron-LM release that adds
a model option is refused, naming the arg, until someone classifies it here: nothing is dropped
silently. Flags of Megatron's non-model groups (training, checkpointing, logging, data, ...) are
ANY unless NEUTRAL or READ lists them (rope_type of the 'training' group changes the model: READ).
"""
from __future__ import annotations

import ast
import enum

from zo_megatron.training.megatron_flag_list import FLAGS, MEGATRON_LM_VERSION

# megatron_args.meta_from_args and megatron_lm.read read these (the architecture, the layout, the vocabulary)
READ = frozenset({
    "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "kv_channels", "group_query_attention",
    "num_query_groups", "max_position_embeddings", "make_vocab_size_divisible_by", "position_embedding_type",
    "use_rotary_position_embeddings", "rotary_base", "rotary_percent", "use_rope_scaling", "rope_scaling_factor",
    "normalization", "norm_epsilon", "layernorm_epsilon", "swiglu", "squared_relu", "openai_gelu", "bias_gelu_fusion",
    "use_te_activation_func", "add_bias_linear", "add_qkv_bias",
    "qk_layernorm", "apply_layernorm_1p", "layernorm_zero_centered_gamma", "untie_embeddings_and_output_weights",
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size", "vocab_size", "padded_vocab_size", "tokenizer_type", "tokenizer_model",
    "seq_length",
    # pipeline stages, merged into one model (megatron_stages.layer_offset: megatron-core's layer offsets)
    "virtual_pipeline_model_parallel_size", "decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers",
    "account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split", "pipeline_model_parallel_layout",
    # mixture of experts (num_experts set; grouped-GEMM experts read as SequentialMLP's): inert without experts
    "num_experts", "moe_router_topk", "moe_ffn_hidden_size", "moe_router_load_balancing_type", "moe_aux_loss_coeff",
    "moe_router_num_groups", "moe_router_group_topk", "moe_router_enable_expert_bias",
    "moe_z_loss_coeff", "moe_router_pre_softmax", "moe_router_score_function", "moe_router_topk_scaling_factor",
    "moe_shared_expert_intermediate_size", "moe_shared_expert_gate", "moe_layer_freq", "moe_token_dispatcher_type",
    "moe_grouped_gemm", "expert_model_parallel_size", "expert_tensor_parallel_size",
    "moe_expert_capacity_factor", "moe_pad_expert_input_to_capacity", "moe_token_drop_policy",
    # YaRN (position_embedding_type "yarn"; Megatron-LM core_v0.19 on): read with it, inert without it
    "rotary_scaling_factor", "yarn_original_max_position_embeddings", "yarn_beta_fast", "yarn_beta_slow",
    "yarn_correction_range_round_to_int", "mscale", "mscale_all_dim",
    # multi-latent attention (megatron_args._mla_meta; the mla group's other flag, cache_mla_latents, is
    # inference-only): the latents' ranks and head dims inert without it; rope_type MLA's rotary embedding
    # ('rope' or 'yarn'), without MLA only 'rope' (Megatron-LM's rule, checked there)
    "multi_latent_attention", "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim",
    "rope_type",
    # sliding-window attention (megatron_args.meta_from_args; planner/window.py)
    "window_size", "window_attn_skip_freq",
    # GPT-OSS: its gated MLP (quick GeGLU, the clamp, the linear half's offset) and attention sinks
    "quick_geglu", "glu_linear_offset", "activation_func_clamp_value", "softmax_type",
})

# arg -> (values under which the model is zo_megatron's GPT, what another value means)
NEUTRAL: dict[str, tuple[tuple, str]] = {
    "qk_l2_norm": ((False, None), "L2-normalised queries and keys"),
    "apply_residual_connection_post_layernorm": ((False, None), "residuals taken after the LayerNorm"),
    "no_rope_freq": ((None, 0, [], ()), "layers without RoPE"),
    "rotary_interleaved": ((False, None), "interleaved rotary embeddings"),
    "rotary_seq_len_interpolation_factor": ((None, 1, 1.0), "RoPE position interpolation"),
    "mrope_section": ((None,), "multimodal RoPE"),
    "attention_output_gate": ((False, None), "a gated attention output"),
    "experimental_attention_variant": ((None,), "an experimental attention variant"),
    "linear_attention_freq": ((None,), "linear-attention layers"),
    "mtp_num_layers": ((None, 0), "multi-token prediction layers"),
    "is_hybrid_model": ((False, None), "a Mamba/hybrid model"),
    "hybrid_override_pattern": ((None,), "a Mamba/hybrid model"),
    "hybrid_layer_pattern": ((None,), "a Mamba/hybrid model"),
    "mtp_hybrid_override_pattern": ((None,), "a Mamba/hybrid model"),
    "hybrid_attention_ratio": ((0.0, 0, None), "a Mamba/hybrid model"),
    "hybrid_mlp_ratio": ((0.0, 0, None), "a Mamba/hybrid model"),
    "heterogeneous_layers_config_path": ((None,), "layers of different shapes"),
    "heterogeneous_layers_config_encoded_json": ((None,), "layers of different shapes"),
    "spec": ((None,), "a custom layer spec"),
    "use_legacy_models": ((False, None), "Megatron's legacy (non-mcore) GPT"),
}

# Args of Megatron's model groups that do not change what the weights compute (any value converts)
_ANY_MODEL_GROUP = frozenset({
    # precision, kernels, fusions, implementations of the same math
    "bf16", "fp16", "fp32_residual_connection", "attention_backend", "transformer_impl", "apply_query_key_layer_scaling",
    "attention_softmax_in_fp32", "masked_softmax_fusion", "bias_swiglu_fusion",
    "bias_dropout_fusion", "apply_rope_fusion", "gradient_accumulation_fusion", "cross_entropy_loss_fusion",
    "cross_entropy_fusion_impl", "use_fused_weighted_squared_relu", "use_kitchen_attention",
    "kitchen_attention_backend", "batch_invariant_mode", "deterministic_mode", "disable_bf16_reduced_precision_matmul",
    "first_last_layers_bf16", "num_layers_at_start_in_bf16", "num_layers_at_end_in_bf16", "flash_decode",
    "persist_layer_norm", "no_persist_layer_norm", "use_flash_attn",
    "fp8", "fp8_recipe", "fp8_margin", "fp8_interval", "fp8_amax_history_len", "fp8_amax_compute_algo", "fp8_wgrad",
    "fp8_quantizer_factory", "fp8_param_gather", "fp4", "fp4_recipe", "fp4_param", "fp4_quantizer_factory",
    "inference_fuse_tp_communication", "mlp_chunks_for_prefill",
    # training only: dropout, initialisation, loss, recomputation, offloading, clipping
    "attention_dropout", "hidden_dropout", "init_method_std", "embedding_init_method_std", "perform_initialization",
    "use_cpu_initialization", "init_model_with_meta_device", "calculate_per_token_loss", "recompute_granularity",
    "recompute_method", "recompute_num_layers", "recompute_modules", "distribute_saved_activations",
    "cpu_offloading_num_layers", "fine_grained_activation_offloading", "offload_modules", "min_offloaded_tensor_size",
    "qk_clip", "qk_clip_alpha", "qk_clip_threshold", "mtp_loss_scaling_factor", "mtp_standalone",
    "clone_scatter_output_in_embedding", "defer_embedding_wgrad_compute", "delay_wgrad_compute",
    "wgrad_deferral_limit", "config_logger_dir",
    # parallel layout and communication (the files are merged to full tensors; pipeline is checked on its own)
    "sequence_parallel", "context_parallel_size", "hierarchical_context_parallel_sizes", "hybrid_context_parallel",
    "max_seqlen_per_dp_cp_rank", "expert_model_parallel_size", "expert_tensor_parallel_size",
    "microbatch_group_size_per_vp_stage", "overlap_p2p_comm_warmup_flush", "pipeline_model_parallel_comm_backend",
    "async_tensor_model_parallel_allreduce", "symmetric_ar_type", "use_ring_exchange_p2p",
    "tp_comm_overlap", "tp_comm_bulk_dgrad", "tp_comm_bulk_wgrad", "tp_comm_overlap_ag", "tp_comm_overlap_rs",
    "tp_comm_overlap_rs_dgrad", "tp_comm_split_ag", "tp_comm_split_rs", "tp_comm_bootstrap_backend",
    "cuda_graph_impl", "cuda_graph_warmup_steps", "enable_cuda_graph", "external_cuda_graph",
    "ep_overlap_early_attn_memory_release", "overlap_moe_expert_parallel_comm",
    # optimizer state precision (experimental group), config files
    "enable_experimental", "exp_avg_dtype", "exp_avg_sq_dtype", "main_grads_dtype", "main_params_dtype",
    "use_precision_aware_optimizer", "yaml_cfg",
    # only read with an option NEUTRAL refuses (MoE, hybrid, sparse attention): inert without it
    "linear_conv_kernel_dim", "linear_key_head_dim", "linear_num_key_heads", "linear_num_value_heads",
    "linear_value_head_dim", "mamba_head_dim", "mamba_num_groups", "mamba_num_heads", "mamba_state_dim",
    "use_mamba_mem_eff_path", "dsa_indexer_head_dim", "dsa_indexer_loss_coeff", "dsa_indexer_n_heads",
    "dsa_indexer_topk", "dsa_indexer_use_sparse_loss",
    # network size: positions the weights check decides (a learned table is a tensor), relative
    # attention only with position_embedding_type relative (READ), BERT/encoder and ONNX options
    "add_position_embedding", "relative_attention_max_distance", "relative_attention_num_buckets",
    "bert_binary_head", "encoder_num_layers", "decoder_num_layers", "onnx_safe",
})

# Args Megatron-LM sets itself (validate_args, the training loop, the checkpoint code) or that
# older releases had: bookkeeping, not the model
_ANY_DERIVED = frozenset({
    "rank", "world_size", "data_parallel_size", "transformer_pipeline_model_parallel_size",
    "model_parallel_size", "params_dtype", "iteration", "curr_iteration",
    "consumed_train_samples", "consumed_valid_samples", "consumed_train_bins", "skipped_train_samples",
    "num_floating_point_operations_so_far", "do_train", "do_valid", "do_test", "eval_global_batch_size",
    "eval_micro_batch_size", "model_type", "variable_seq_lengths", "async_strategy", "cpu_offloading",
    "cuda_graph_modules", "inference_cuda_graph_scope", "use_custom_fsdp", "use_gloo_process_groups",
    "use_layer_wise_distributed_optimizer", "override_ckpt_iteration", "_is_global_batch_size_explicitly_specified",
    "grpo_samples_per_iteration", "rl_generation_lag", "mtp_hsm", "mamba_inference_conv_states_dtype",
    "mamba_inference_ssm_states_dtype", "mamba_training_ssm_states_dtype", "megatron_fsdp_grad_comm_dtype",
    "megatron_fsdp_main_grads_dtype", "megatron_fsdp_main_params_dtype", "ckpt_format", "encoder_seq_length",
    "decoder_seq_length", "DDP_impl", "use_contiguous_buffers_in_local_ddp", "lazy_mpu_init", "local_rank",
    # flags of Megatron's other groups whose dest is not the flag's name (core_v0.16.1)
    "align_grad_reduce", "align_param_gather", "barrier_with_L1_time", "check_for_nan_in_loss_and_grad",
    "ckpt_fully_parallel_save_deprecated", "create_attention_mask_in_dataloader", "data_sharding",
    "deprecated_use_mcore_models", "dist_ckpt_format_deprecated", "enable_gloo_process_groups", "enable_msc",
    "enable_one_logger", "gradient_reduce_div_fusion", "log_loss_scale_to_tensorboard", "manual_gc_eval",
    "mmap_bin_files", "muon_split_qkv", "nccl_ub", "overlap_p2p_comm", "pin_cpu_grads", "pin_cpu_params",
    "scatter_gather_tensors_in_pipeline", "strict_fsdp_dtensor_load", "torch_fsdp2_reshard_after_forward",
    "use_dist_ckpt_deprecated", "use_tokenizer_model_from_checkpoint_args",
})

# Megatron's argument groups that describe the model; every other group's flags are ANY
_MODEL_GROUPS = frozenset({"transformer configuration", "network size", "experimental", "heterogeneous architecture",
                           "experimental_attention_variant"})
# flags whose dest is not the flag's name (core_v0.16.1), in the model groups
_DEST_OF = {"--norm-epsilon": "layernorm_epsilon", "--apply-layernorm-1p": "layernorm_zero_centered_gamma",
            "--disable-bias-linear": "add_bias_linear", "--no-position-embedding": "add_position_embedding",
            "--bert-no-binary-head": "bert_binary_head", "--fp8-format": "fp8", "--fp4-format": "fp4",
            "--fp4-param-gather": "fp4_param", "--no-initialization": "perform_initialization"}


def _literal(text: str):
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text                                 # an enum's repr: compared as text


def _flag_table() -> tuple[frozenset, dict]:
    """(dests of Megatron's non-model groups: ANY, {model-group dest: Megatron's default})."""
    other, defaults = set(), {}
    for flag, group, _takes, default in FLAGS:
        dest = _DEST_OF.get(flag) or flag[2:].replace("-", "_")
        if group in _MODEL_GROUPS:
            defaults.setdefault(dest, _literal(default))
        else:
            other.add(dest)
    return frozenset(other), defaults


_OTHER_GROUPS, _MODEL_DEFAULTS = _flag_table()
ANY = _ANY_MODEL_GROUP | _ANY_DERIVED | (_OTHER_GROUPS - set(NEUTRAL) - READ)
# MoE options (moe_*) are inert without experts. With experts, READ has the model's; these change no
# math (kernels, fusions, communication, logging, recomputation, upcycling's initialisation, the
# router's compute dtype, options that act only with an option still checked here: grouped GEMM, the
# expert bias; the router's run settings of a run, not its model: the input jitter and benchmarks' forced
# balance); every other moe_* arg must keep Megatron-LM's default.
MOE_ANY = frozenset({
    "moe_permute_fusion", "moe_router_fusion", "moe_enable_deepep", "moe_deepep_num_sms", "moe_hybridep_num_sms",
    "moe_flex_dispatcher_backend", "moe_layer_recompute", "moe_per_layer_logging", "moe_shared_expert_overlap",
    "moe_use_legacy_grouped_gemm", "moe_router_bias_update_rate", "moe_router_dtype", "moe_enable_routing_replay",
    "moe_pad_experts_for_cuda_graph_inference", "moe_upcycling_granularity", "moe_use_upcycling",
    "moe_input_jitter_eps", "moe_router_force_load_balancing",
})
_EMPTY = (None, False, 0, "", [], ())


def _same(value, neutral) -> bool:
    if isinstance(value, enum.Enum):                # a megatron-core enum; the flag list has its repr
        return value == neutral or repr(value) == neutral
    if isinstance(value, bool) or isinstance(neutral, bool):
        return value is neutral
    if isinstance(value, (list, tuple)) and isinstance(neutral, (list, tuple)):
        return list(value) == list(neutral)
    return value == neutral


def non_neutral(args) -> list[str]:
    """Every arg of Megatron-LM's saved `args` that would change the model away from zo_megatron's GPT,
    each as 'args.NAME=VALUE (what it means)'; empty when the checkpoint converts exactly."""
    out = []
    experts = getattr(args, "num_experts", None) not in (None, 0)
    for name, value in sorted(vars(args).items()):
        if name in NEUTRAL:
            values, what = NEUTRAL[name]
            if not any(_same(value, v) for v in values):
                out.append(f"args.{name}={value!r} ({what})")
        elif name in READ or name in ANY or (name.startswith("moe_") and (not experts or name in MOE_ANY)):
            continue
        elif name in _MODEL_DEFAULTS:
            if not _same(value, _MODEL_DEFAULTS[name]):
                out.append(f"args.{name}={value!r} (a model option of Megatron-LM that from-megatron does not "
                           f"convert; only {_MODEL_DEFAULTS[name]!r} does)")
        elif not any(_same(value, v) for v in _EMPTY):
            out.append(f"args.{name}={value!r} (not an arg of Megatron-LM {MEGATRON_LM_VERSION} that from-megatron "
                       "knows to leave the model unchanged)")
    return out
