"""The GPT: megatron-core's GPTModel (local layer spec), GPT-2 by default, Llama-family by flags.

GPT-2 exactly means: learned absolute positions, pre-LayerNorm (eps 1e-5), GELU with the tanh
approximation, biases everywhere, tied input/output embeddings, a final LayerNorm, attention
scaled by 1/sqrt(head_dim) with softmax in fp32. The architecture fields of GPTConfig switch on
RoPE (unfused pure-torch path), RMSNorm (torch.nn.RMSNorm via megatron's WrappedTorchNorm),
SwiGLU, grouped-query attention, an untied output layer, qkv-only biases and q/k norms; RoPE
with Llama-3.1 scaling or YaRN (megatron-core's YarnRotaryEmbedding).

Parameters (names under `gpt.`; [..] only when the architecture has them) and their TP splits,
t = TP size, d = head dim, G = query groups, f = FFN size, H = heads:

    embedding.word_embeddings.weight       VocabParallelEmbedding [V_pad/t, h]  vocab rows (tied: also the LM head)
    [embedding.position_embeddings.weight] replicated             [P, h]        learned_absolute only
    decoder.layers.{i}.
      input_layernorm.weight[.bias]        replicated             [h]           .bias: LayerNorm only
      self_attention.linear_qkv.weight     ColumnParallel         [(H+2G)d/t, h] rows per group g:
                                              [q heads of g (H/G x d); k_g (d); v_g (d)]; rank r: G/t whole groups
      self_attention.linear_qkv.bias       ColumnParallel         [(H+2G)d/t]   add_bias_linear or add_qkv_bias
      [self_attention.q_layernorm.weight,  replicated             [d]           qk_layernorm (+.bias with
       self_attention.k_layernorm.weight]                                       LayerNorm); grads summed over TP
      self_attention.linear_proj.weight    RowParallel            [h, Hd/t]     (.bias replicated)
      pre_mlp_layernorm.weight[.bias]      replicated             [h]
      mlp.linear_fc1.weight[.bias]         ColumnParallel         [f/t, h]      GELU
                                           ColumnParallel stride 2 [2f/t, h]    SwiGLU: full [gate (f); up (f)],
                                              rank r holds [gate_r; up_r] (not a contiguous chunk)
      mlp.linear_fc2.weight                RowParallel            [h, f/t]      (.bias replicated)
    decoder.final_layernorm.weight[.bias]  replicated             [h]
    [output_layer.weight]                  ColumnParallel         [V_pad/t, h]  untied only, vocab-padded like
                                                                                the embedding

    SwiGLU fc1 at t=2:  full [g0 g1 | u0 u1]  ->  rank 0 [g0; u0], rank 1 [g1; u1]

Mixture of experts (--num-experts E; the layers --moe-layer-freq names; docs/moe.md): the MLP is
megatron-core's MoELayer, local spec (SequentialMLP: the experts run one after another):

      mlp.router.weight[.bias]             replicated             [E, h]        fp32, sequence_parallel
      mlp.experts.local_experts.{j}.       expert j of this EP rank: global expert ep_rank x E/EP + j;
        linear_fc1.weight, linear_fc2.weight  split over EXPERT TP (--expert-tensor-parallel-size, default
                                              TP; may be 1 with TP > 1) as the dense MLP's fc1 / fc2
      [mlp.shared_experts.linear_fc1/2.weight, .gate_weight [1, h]]  the shared expert (and its sigmoid gate)

Full tensors (init, load_full_params) name experts by their GLOBAL index (GPTModelTP.full_name), so
every EP layout starts from the same model.
"""
from __future__ import annotations

import functools
import zlib

import torch
import torch.nn.functional as F

from zo_megatron.errors import ConfigError
from zo_megatron.model.config import YARN_FIELDS, GPTConfig
from zo_megatron.model.masks import mask_body, padded_mask, window_attention_mask
from zo_megatron.model.norms import scale_of
from zo_megatron.model.sharding import shard_info, shard_of
from zo_megatron.planner.window import sdpa_mask_layout


def squared_relu(x: torch.Tensor) -> torch.Tensor:
    """megatron-core's squared_relu (megatron/core/activations.py), without its torch.compile decorator,
    which on a CPU compiles in every process for ~15 s: relu(x)^2."""
    return torch.square(F.relu(x))

def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """megatron-core's quick_gelu (fusions/fused_bias_geglu.py: GPT-OSS's activation), without its torch.compile
    decorator (as squared_relu): x * sigmoid(1.702 x)."""
    return x * torch.sigmoid(1.702 * x)


def causal_attention_mask(seq_length: int, device) -> torch.Tensor:
    """Bool [1, 1, s, s], True = masked. Always explicit: with None megatron builds it on 'cuda'."""
    return torch.triu(torch.ones(seq_length, seq_length, dtype=torch.bool, device=device), diagonal=1)[None, None]


def document_attention_mask(segment_ids: torch.Tensor, backend: str, dtype: torch.dtype,
                            sink: bool = False) -> torch.Tensor:
    """Per-document causal attention (--reset-attention-mask, --sft) from segment_ids [b, s]: token j
    may attend to token i iff i <= j and segment_ids[b, i] == segment_ids[b, j].

    backend "local": bool [b, 1, s, s], True = masked (megatron-core's DotProductAttention fills those
    scores with -10000 before its fp32 softmax: exactly 0 after it, every row keeping its diagonal).
    "sdpa": additive [b, 1, s, s] in `dtype` (the attention's), 0 where allowed and -inf where masked,
    so that SDPA takes it as it is (a bool mask would be converted inside every layer, one copy each).
    Built once per forward and shared by every layer: autograd keeps one tensor, not one per layer.
    sink ("sdpa" with attention sinks): in model/masks.py's sink layout, [b, 1, s + 1, s + 1]."""
    b, s = segment_ids.shape
    idx = torch.arange(s, device=segment_ids.device)
    masked = segment_ids[:, None, :, None] != segment_ids[:, None, None, :]     # [b, 1, s, s]
    masked |= idx[None, :] > idx[:, None]                                      # the future, [s, s]
    if backend != "sdpa":
        return masked
    # (rows padded once on CUDA, for its memory-efficient kernel: model/masks.py)
    mask = padded_mask(b, 1, s, dtype, segment_ids.device, sink)
    mask_body(mask, sink).masked_fill_(masked, float("-inf"))
    return mask


class TPQKNorm:
    """The q/k norm (`--qk-layernorm`): torch's RMSNorm/LayerNorm over head_dim, as megatron-core's
    WrappedTorchNorm builds it, except that its weight's gradient is summed over TP in backward.

    The weight is replicated over TP but each rank normalises only its own heads, so each rank's
    gradient is a partial sum. Megatron-LM sums it after backward (finalize_model_grads, for
    qk_layernorm); here megatron's copy_to_tensor_model_parallel_region (forward identity,
    backward all-reduce) does it inside autograd, so every optimizer sees the full gradient."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **_):
        norm_cls = _TPSummedRMSNorm if config.normalization == "RMSNorm" else _TPSummedLayerNorm
        norm = norm_cls(hidden_size, eps=eps)
        norm.zero_centered_gamma = bool(getattr(config, "layernorm_zero_centered_gamma", False))
        return norm


def _tp_summed(weight):
    from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region

    return None if weight is None else copy_to_tensor_model_parallel_region(weight)


class _TPSummedRMSNorm(torch.nn.RMSNorm):
    def forward(self, x):
        return F.rms_norm(x, self.normalized_shape, _tp_summed(scale_of(self)), self.eps)


class _TPSummedLayerNorm(torch.nn.LayerNorm):
    def forward(self, x):
        return F.layer_norm(x, self.normalized_shape, _tp_summed(scale_of(self)), _tp_summed(self.bias), self.eps)


def layer_spec(cfg: GPTConfig, num_experts: int | None = None):
    """megatron-core's local spec for this architecture (RMSNorm / LayerNorm, q/k norms); with
    num_experts an MoE layer's (SequentialMLP experts: megatron-core's grouped GEMMs need the
    grouped_gemm package or Transformer Engine)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(num_experts=num_experts, moe_grouped_gemm=False, qk_layernorm=cfg.qk_layernorm,
                                    normalization=cfg.normalization, multi_latent_attention=cfg.multi_latent_attention)
    if cfg.multi_latent_attention:
        # its k/v down projection whole at any TP (model/mla.py); its core attention is ours, torch SDPA
        # (model/spec.py): megatron-core 0.16's local DotProductAttention takes no separate key and value head
        # dims (GPTConfig refuses the local backend with MLA)
        from zo_megatron.model.mla import MLASelfAttentionTP

        spec.submodules.self_attention.module = MLASelfAttentionTP
    if cfg.multi_latent_attention and cfg.qk_layernorm:
        # MLA's q/kv norms act on whole latents (every rank's, the same), on this rank's tokens under sequence
        # parallelism: model/norms.py's Norm tags them for the sum over TP then (megatron-core's torch norm
        # refuses SP), and has the zero-centred gamma
        from zo_megatron.model.norms import Norm

        attention = spec.submodules.self_attention.submodules
        attention.q_layernorm = attention.kv_layernorm = Norm
    elif cfg.qk_layernorm:
        attention = spec.submodules.self_attention.submodules
        attention.q_layernorm = attention.k_layernorm = TPQKNorm
    return spec


def layer_specs(cfg: GPTConfig):
    """The decoder's layer spec: one for a dense model, one per layer (dense or MoE) with experts."""
    if cfg.num_experts is None:
        return layer_spec(cfg)
    dense, moe = layer_spec(cfg), layer_spec(cfg, cfg.num_experts)
    return [moe if is_moe else dense for is_moe in cfg.moe_layers()]


def moe_config_kwargs(cfg: GPTConfig, tensor_parallel: int) -> dict:
    """TransformerConfig's MoE fields (Megatron-LM's flag dests and megatron-core's names differ only
    in num_moe_experts); the expert layout from megatron-core's parallel state when it is set up."""
    if cfg.num_experts is None:
        return {}
    from megatron.core import parallel_state as mpu

    if cfg.moe_expert_capacity_factor is not None and cfg.moe_token_drop_policy == "position":
        _keep_the_earliest_tokens_on_position_drops()
    ep, etp = 1, tensor_parallel
    if mpu.model_parallel_is_initialized():
        ep, etp = mpu.get_expert_model_parallel_world_size(), mpu.get_expert_tensor_parallel_world_size()
    cfg.check_expert_parallel(tensor_parallel, ep, etp, cfg.sequence_parallel and tensor_parallel > 1)
    if cfg.moe_token_dispatcher_type == "alltoall" and etp > 1 and not torch.cuda.is_available():
        raise ConfigError(f"--moe-token-dispatcher-type alltoall at expert TP {etp} on CPUs: megatron-core's alltoall "
                          "dispatcher all-gathers uneven token counts over expert TP, which gloo cannot; use "
                          "--moe-token-dispatcher-type allgather (or TP 1)")
    return dict(num_moe_experts=cfg.num_experts, moe_router_topk=cfg.moe_router_topk,
                moe_ffn_hidden_size=cfg.moe_ffn_size, moe_router_load_balancing_type=cfg.moe_router_load_balancing_type,
                moe_aux_loss_coeff=cfg.moe_aux_loss_coeff, moe_z_loss_coeff=cfg.moe_z_loss_coeff,
                moe_router_pre_softmax=cfg.moe_router_pre_softmax,
                moe_router_score_function=cfg.moe_router_score_function,
                moe_router_topk_scaling_factor=cfg.moe_router_topk_scaling_factor,
                moe_shared_expert_intermediate_size=cfg.moe_shared_expert_intermediate_size,
                moe_shared_expert_gate=cfg.moe_shared_expert_gate, moe_layer_freq=cfg.moe_layer_freq,
                moe_token_dispatcher_type=cfg.moe_token_dispatcher_type,
                moe_expert_capacity_factor=cfg.moe_expert_capacity_factor,
                moe_pad_expert_input_to_capacity=cfg.moe_pad_expert_input_to_capacity,
                moe_token_drop_policy=cfg.moe_token_drop_policy, moe_router_dtype=cfg.moe_router_dtype,
                moe_input_jitter_eps=cfg.moe_input_jitter_eps,
                moe_router_force_load_balancing=cfg.moe_router_force_load_balancing,
                moe_router_enable_expert_bias=cfg.moe_router_enable_expert_bias,
                moe_router_bias_update_rate=cfg.moe_router_bias_update_rate,
                moe_router_num_groups=cfg.moe_router_num_groups, moe_router_group_topk=cfg.moe_router_group_topk,
                moe_grouped_gemm=False,
                moe_permute_fusion=False, moe_router_fusion=False,
                expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)


def _keep_the_earliest_tokens_on_position_drops() -> None:
    """--moe-token-drop-policy position: megatron-core 0.16.1 documents "tokens at the end of each batch
    will be dropped" but picks each expert's kept tokens with torch.topk over the 0/1 routing map, whose
    choice among equal values is unspecified (on CPU it keeps an arbitrary subset of the routed tokens).
    Here its apply_router_token_dropping (as the router calls it) keeps what it documents: each expert's
    first `capacity` routed tokens in the order of the flattened [s, b] tokens (with padding, then the
    earliest unrouted ones, at probability 0); the capacity, the "probs" policy and the rest are its own."""
    from megatron.core.transformer.moe import moe_utils, router

    original = moe_utils.apply_router_token_dropping
    if getattr(router.apply_router_token_dropping, "zo_position_in_order", False):
        return

    def apply_router_token_dropping(routing_probs, routing_map, router_topk, capacity_factor, drop_policy="probs",
                                    pad_to_capacity=False):
        tokens, experts = routing_map.shape
        capacity = moe_utils.get_capacity(tokens * router_topk, experts, capacity_factor)
        if drop_policy != "position" or capacity > tokens:
            return original(routing_probs, routing_map, router_topk, capacity_factor, drop_policy, pad_to_capacity)
        earlier = torch.arange(tokens, 0, -1, device=routing_map.device, dtype=torch.long)[:, None]
        order = routing_map.long() * (tokens + 1) + earlier       # routed first, each group earliest first
        keep = torch.zeros_like(routing_map).scatter(0, torch.topk(order, k=capacity, dim=0).indices, True)
        final_map = keep if pad_to_capacity else routing_map & keep
        return routing_probs * final_map, final_map

    apply_router_token_dropping.zo_position_in_order = True
    router.apply_router_token_dropping = apply_router_token_dropping


def transformer_config(cfg: GPTConfig, tensor_parallel: int):
    from megatron.core.transformer.transformer_config import TransformerConfig

    recompute = {}
    if cfg.recompute == "full":
        recompute = dict(recompute_granularity="full", recompute_method=cfg.recompute_method,
                         recompute_num_layers=cfg.recompute_num_layers)
    elif cfg.recompute == "selective":
        recompute = dict(recompute_granularity="selective", recompute_modules=list(cfg.recompute_modules))
    cfg.check_tensor_parallel(tensor_parallel)
    config_class, mla = TransformerConfig, {}
    if cfg.multi_latent_attention:
        from megatron.core.transformer.transformer_config import MLATransformerConfig

        config_class = MLATransformerConfig
        mla = dict(q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank, qk_head_dim=cfg.qk_head_dim,
                   qk_pos_emb_head_dim=cfg.qk_pos_emb_head_dim, v_head_dim=cfg.v_head_dim, rope_type=cfg.rope_type,
                   rotary_base=cfg.rotary_base, rotary_percent=cfg.rotary_percent,
                   rotary_scaling_factor=cfg.rotary_scaling_factor, mscale=cfg.mscale,
                   mscale_all_dim=cfg.mscale_all_dim,
                   original_max_position_embeddings=cfg.yarn_original_max_position_embeddings,
                   beta_fast=cfg.yarn_beta_fast, beta_slow=cfg.yarn_beta_slow)
    config = config_class(
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.query_groups,
        kv_channels=cfg.head_dim,
        ffn_hidden_size=cfg.ffn_size,
        hidden_dropout=cfg.hidden_dropout,
        attention_dropout=cfg.attention_dropout,
        normalization=cfg.normalization,
        layernorm_epsilon=cfg.layernorm_epsilon,
        qk_layernorm=cfg.qk_layernorm,
        layernorm_zero_centered_gamma=cfg.layernorm_zero_centered_gamma,
        init_method_std=cfg.init_method_std,
        # SwiGLU: silu(gate) * up with linear_fc1 = [gate; up]; quick GeGLU the same with quick_gelu (GPT-OSS: the
        # gate clamped, the up half clamped and offset by megatron-core's glu()); squared ReLU; otherwise GELU,
        # GPT-2's tanh approximation or the erf GELU (cfg.gelu_approximate: Megatron-LM's fused or unfused bias-GELU)
        activation_func=F.silu if cfg.swiglu else quick_gelu if cfg.quick_geglu else squared_relu
        if cfg.squared_relu else F.gelu if cfg.gelu_approximate == "none" else
        functools.partial(F.gelu, approximate="tanh"),
        gated_linear_unit=cfg.gated_mlp,
        glu_linear_offset=cfg.glu_linear_offset,
        activation_func_clamp_value=cfg.activation_func_clamp_value,
        softmax_type=cfg.softmax_type,
        add_bias_linear=cfg.add_bias_linear,
        add_qkv_bias=cfg.add_qkv_bias,
        apply_query_key_layer_scaling=False,
        attention_softmax_in_fp32=True,
        tensor_model_parallel_size=tensor_parallel,
        # Weights are created in fp32 on the host and initialised by init_weights_() below, the
        # same full tensors at any TP; the engine then moves them to the device in 16 bits.
        params_dtype=torch.float32,
        use_cpu_initialization=True,
        perform_initialization=False,
        bf16=cfg.precision == "bf16",
        fp16=cfg.precision == "fp16",
        # Fusions: CUDA kernels / torch.compile; the unfused paths are the same math.
        gradient_accumulation_fusion=False,
        masked_softmax_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        # megatron-LM turns sequence parallelism off at TP = 1 (there is no sequence to split)
        sequence_parallel=cfg.sequence_parallel and tensor_parallel > 1,
        calculate_per_token_loss=cfg.calculate_per_token_loss,
        # sliding-window attention: megatron-core's fields, read by our SDPAttention (GPTConfig refuses the local
        # attention with a window, whose mask megatron-core builds on CUDA only)
        window_size=cfg.window_size, window_attn_skip_freq=cfg.window_attn_skip_freq,
        **recompute,
        **moe_config_kwargs(cfg, tensor_parallel),
        **mla,
    )
    if cfg.position_embedding_type == "yarn":
        # megatron-core 0.16's GPTModel and attention read YaRN's settings as config attributes
        # TransformerConfig does not declare (getattr(config, "yarn_beta_fast"), ...); Megatron-LM
        # sets them the same way (core_v0.19's argument_utils._apply_yarn_config_from_args)
        for name in YARN_FIELDS:
            setattr(config, name if name.startswith("yarn_") else f"yarn_{name}", getattr(cfg, name))
    return config


class GPTModelTP(torch.nn.Module):
    """A megatron-core GPTModel plus the loss: vocab-parallel cross-entropy over real tokens only."""

    def __init__(self, cfg: GPTConfig, tp_rank: int, tp_size: int):
        super().__init__()
        from megatron.core.models.gpt import GPTModel

        from zo_megatron.model.spec import decoder_spec

        self.cfg = cfg
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.expert_tp = _expert_tp(cfg, tp_rank, tp_size)
        self.padded_vocab_size = cfg.padded_vocab_size(tp_size)
        config = transformer_config(cfg, tp_size)
        self.sequence_parallel = config.sequence_parallel
        self.gpt = GPTModel(
            config=config,
            transformer_layer_spec=decoder_spec(cfg, layer_specs(cfg), config.sequence_parallel),
            vocab_size=self.padded_vocab_size,
            max_sequence_length=cfg.max_position_embeddings,
            share_embeddings_and_output_weights=not cfg.untie_embeddings_and_output_weights,
            position_embedding_type=cfg.position_embedding_type,
            rotary_percent=cfg.rotary_percent,
            rotary_base=cfg.rotary_base,
            rope_scaling=cfg.use_rope_scaling,
            rope_scaling_factor=cfg.rope_scaling_factor,
            parallel_output=True,
        )
        _mark_tp_split_params(self.gpt, gated=cfg.gated_mlp)
        _expert_fc2_returns_its_own_tensor(self.gpt)
        self._full_names = _expert_full_names(self)
        local_vocab = self.padded_vocab_size // tp_size
        first = tp_rank * local_vocab
        n_pad = max(0, first + local_vocab - max(first, cfg.vocab_size))
        # Pad columns of this rank's logits shard; they must never reach the softmax.
        self._n_vocab_pad = n_pad
        self._mask_cache: dict = {}
        # set by checkpoint/load.py from the checkpoint it loads: what its saves carry on (from-hf's records)
        self.checkpoint_carried: dict = {}

    def full_name(self, name: str) -> str:
        """The full model's name of parameter `name`: an expert's global index in place of its local one."""
        return self._full_names.get(name, name)

    def _mask(self, seq_length: int, device) -> torch.Tensor:
        key = (seq_length, str(device))
        if key not in self._mask_cache:
            self._mask_cache[key] = causal_attention_mask(seq_length, device)
        return self._mask_cache[key]

    def _check_segment_ids(self, tokens: torch.Tensor, segment_ids: torch.Tensor) -> None:
        """Refused in one line where the ids do not describe `tokens`."""
        if tuple(segment_ids.shape) != tuple(tokens.shape) or segment_ids.dtype not in (torch.int32, torch.int64):
            raise ConfigError(f"segment_ids must be an int32/int64 tensor shaped like tokens {list(tokens.shape)}, "
                              f"got {segment_ids.dtype} {list(segment_ids.shape)}")
        if segment_ids.device != tokens.device:
            raise ConfigError(f"segment_ids are on {segment_ids.device}, tokens on {tokens.device}")
        if self.gpt.config.masked_softmax_fusion:
            # megatron-core's fused causal softmax kernel would build its own causal mask and ignore this one
            raise ConfigError("per-document attention needs the unfused softmax: megatron-core's fused causal "
                              "softmax ignores the mask")

    def _attention_mask(self, tokens: torch.Tensor, segment_ids: torch.Tensor | None) -> torch.Tensor | None:
        """This forward's mask, built once and handed to every layer: SDPA's additive one in the attention's dtype
        (the parameters': the engine's 16-bit buffer) where planner/window.sdpa_mask_layout says one is needed
        (documents, a sliding window that binds; each layer takes its channel), else none (is_causal); the local
        attention's bool mask (documents, or the cached causal one). With attention sinks SDPA's mask is in the
        sink layout (model/masks.py: one more row and column), built so here once rather than in every layer."""
        cfg, s = self.cfg, tokens.size(1)
        if segment_ids is not None:
            self._check_segment_ids(tokens, segment_ids)
        if cfg.attention_backend != "sdpa":
            return self._mask(s, tokens.device) if segment_ids is None else \
                document_attention_mask(segment_ids, "local", torch.bool)
        layout = sdpa_mask_layout(cfg.window_size, cfg.window_attn_skip_freq, cfg.num_layers, s,
                                  segment_ids is not None)
        dtype = self.gpt.embedding.word_embeddings.weight.dtype
        if layout is None:
            return None
        sink = cfg.softmax_type != "vanilla"
        if layout.window_left is None:
            return document_attention_mask(segment_ids, "sdpa", dtype, sink)
        return window_attention_mask(s, layout.window_left, layout.channels, dtype, tokens.device, segment_ids, sink)

    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor | None = None,
                segment_ids: torch.Tensor | None = None) -> torch.Tensor:
        """tokens [b, s] -> this TP rank's logits shard [b, s, V_pad/t]; pad columns are -inf.

        segment_ids [b, s] (int32/int64; the data's documents, non-decreasing along a row): each token
        attends only to earlier tokens of its own segment (document_attention_mask); None: plain causal. A
        sliding window (cfg.window_size) limits its layers' attention further (model/masks.py)."""
        b, s = tokens.shape
        if self.sequence_parallel and s % self.tp_size:
            raise ConfigError(f"sequence parallelism splits the sequence over TP: sequence length {s} is not "
                              f"divisible by TP {self.tp_size}; use a multiple of {self.tp_size}")
        if position_ids is None:
            position_ids = torch.arange(s, device=tokens.device).unsqueeze(0).expand(b, s)
        # one mask for every layer (with sequence parallelism too: attention sees all s); none for SDPA without
        # documents or a binding window (causal by construction, nothing s x s is built or read)
        logits = self.gpt(tokens, position_ids, self._attention_mask(tokens, segment_ids))
        if self._n_vocab_pad:
            logits = logits.float()
            logits[..., logits.shape[-1] - self._n_vocab_pad:] = float("-inf")
        return logits

    def loss(self, tokens: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor | None = None,
             position_ids: torch.Tensor | None = None, segment_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Mean next-token cross-entropy (fp32) over unmasked tokens of this micro-batch (segment_ids:
        per-document attention, as in forward)."""
        from megatron.core import tensor_parallel

        logits = self.forward(tokens, position_ids, segment_ids)
        per_token = tensor_parallel.vocab_parallel_cross_entropy(logits.float(), labels)
        if loss_mask is None:
            return per_token.mean()
        loss_mask = loss_mask.to(per_token.dtype)
        return (per_token * loss_mask).sum() / loss_mask.sum().clamp(min=1.0)


def _mark_tp_split_params(module: torch.nn.Module, gated: bool = False) -> None:
    """Megatron sets the TP-split attributes of weights only inside its own initialisers, which
    we skip (perform_initialization=False): mark the split weights here so sharding/clipping see
    them. A gated MLP's linear_fc1 (SwiGLU, quick GeGLU) has stride 2 (each rank holds [gate_r; up_r]);
    its bias too. Attention sinks (softmax_type learnable: one offset per head) split with the heads."""
    from megatron.core import tensor_parallel as tp

    for name, m in module.named_modules():
        offset = getattr(m, "softmax_offset", None) if name.endswith("core_attention") else None
        if isinstance(offset, torch.nn.Parameter):
            offset.tensor_model_parallel, offset.partition_dim, offset.partition_stride = True, 0, 1
        if isinstance(m, (tp.ColumnParallelLinear, tp.VocabParallelEmbedding)):
            dim = 0
        elif isinstance(m, tp.RowParallelLinear):
            dim = 1
        else:
            continue
        stride = 2 if gated and name.endswith("linear_fc1") else 1     # the MLP's, an expert's, the shared expert's
        w = getattr(m, "weight", None)
        if w is not None:
            w.tensor_model_parallel, w.partition_dim, w.partition_stride = True, dim, stride
        b = getattr(m, "bias", None)
        if dim == 0 and isinstance(b, torch.nn.Parameter):
            b.tensor_model_parallel, b.partition_dim, b.partition_stride = True, 0, stride


def _expert_fc2_returns_its_own_tensor(module: torch.nn.Module) -> None:
    """Experts with biases (GPT-OSS) at expert TP 1 and EP 1: megatron-core 0.16.1's MLP.forward adds the bias times
    the routing probabilities in place (`output += output_bias * probs`) to linear_fc2's output, which there is the
    input handed back by a one-rank reduce (a custom autograd Function's view: autograd refuses the in-place add in
    the first forward). A reduce over one rank is the identity, forward and backward, so such an fc2 is told to skip
    it, as megatron-core's own expert-parallel path does (explicit_expert_comm): the same math, no refusal."""
    from megatron.core import tensor_parallel as tp

    for name, m in module.named_modules():
        if isinstance(m, tp.RowParallelLinear) and getattr(m, "is_expert", False) and m.skip_bias_add \
                and m.tp_group.size() == 1 and not m.explicit_expert_comm:
            m.explicit_expert_comm = True


def _expert_tp(cfg: GPTConfig, tp_rank: int, tp_size: int) -> tuple[int, int]:
    """(expert TP rank, size) the routed experts split over: megatron-core's expert TP group where the
    parallel state is set up, else TP's."""
    from megatron.core import parallel_state as mpu

    if cfg.num_experts is None or not mpu.model_parallel_is_initialized():
        return tp_rank, tp_size
    return mpu.get_expert_tensor_parallel_rank(), mpu.get_expert_tensor_parallel_world_size()


def _expert_full_names(model: torch.nn.Module) -> dict[str, str]:
    """{local name: full name} of every expert parameter: megatron-core's MoE layer knows its experts'
    global indices (local_expert_indices)."""
    out = {}
    for prefix, m in model.named_modules():
        indices = getattr(m, "local_expert_indices", None)
        experts = getattr(getattr(m, "experts", None), "local_experts", None)
        if indices is None or experts is None:
            continue
        for j, expert in enumerate(experts):
            for pname, _ in expert.named_parameters():
                out[f"{prefix}.experts.local_experts.{j}.{pname}"] = f"{prefix}.experts.local_experts.{indices[j]}.{pname}"
    return out


def _param_seed(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63 - 1)


@torch.no_grad()
def init_weights_(model: GPTModelTP, seed: int) -> None:
    """GPT-2 / Megatron initialisation, identical full weights at any TP/DP layout for one seed.

    Each parameter's FULL unpadded tensor is drawn from its own generator (seed, name), then this
    rank keeps its shard: so TP=1/2/4 runs start from the same model. Weights N(0, 0.02) (also the
    untied output layer and SwiGLU's whole [gate; up] fc1, sharded with stride 2), output
    projections N(0, 0.02/sqrt(2L)) (GPT-2 and Megatron), biases 0, norm weights 1 (LayerNorm,
    RMSNorm, q/k norms; 0 with a zero-centred gamma, whose scale is 1 + weight).
    """
    cfg = model.cfg
    out_std = cfg.init_method_std / (2.0 * cfg.num_layers) ** 0.5
    for name, p in model.named_parameters():
        local_name = model.full_name(name).removeprefix("gpt.")
        info = shard_info(local_name, p, model.tp_rank, model.tp_size, cfg.vocab_size, model.expert_tp)
        if local_name.endswith("layernorm.weight"):
            p.fill_(0.0 if cfg.layernorm_zero_centered_gamma else 1.0)     # the scale starts at 1 either way
            continue
        if local_name.endswith(".bias"):
            p.zero_()
            continue
        std = out_std if local_name.endswith(("linear_proj.weight", "linear_fc2.weight")) else cfg.init_method_std
        gen = torch.Generator().manual_seed(_param_seed(seed, local_name))
        full = torch.empty(info.full_shape, dtype=torch.float32).normal_(0.0, std, generator=gen)
        p.copy_(shard_of(full, info).to(p.device, p.dtype))


def build_gpt_model(cfg: GPTConfig, tp_rank: int, tp_size: int, seed: int, device=None) -> GPTModelTP:
    """Build, initialise (layout-independent) and place the model; params stay fp32 here.

    The training engine casts parameters to cfg.dtype (flat 16-bit buffer); for a standalone
    16-bit model call `.to(cfg.dtype)`.
    """
    from zo_megatron.parallel import megatron_cpu

    megatron_cpu.apply()
    model = GPTModelTP(cfg, tp_rank, tp_size)
    init_weights_(model, seed)
    if device is not None:
        model.to(device)
    return model
