"""What the planner is asked (PlanInput: a training configuration) and what it answers (Plan)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from zo_megatron.planner.params import (Architecture, MoEShape, check_mlp_and_softmax, default_core_attention,
                                        default_ffn_size, flags_need_sdpa, moe_layer_pattern, resolve_recompute,
                                        selective_recompute_modules)
from zo_megatron.planner.units import GiB, MiB
from zo_megatron.planner.window import (MaskLayout, describe_window, normalize_skip_freq, normalize_window_size,
                                        sdpa_mask_layout, window_layers)

PRECISIONS = ("bf16", "fp16", "fp32")
POSITION_EMBEDDING_TYPES = ("learned_absolute", "rope", "yarn")
NORMALIZATIONS = ("LayerNorm", "RMSNorm")
RECOMPUTE = (None, "full", "selective")
ATTENTION_BACKENDS = ("local", "sdpa")


# The OS reserve: host memory per node the plan leaves to everything but the job (the kernel, page
# cache, other processes). A tenth of the node's memory (the job's rule since issue 34), at most
# 32 GiB (a big node's OS and page cache do not grow with its RAM: 1.5 TiB DGX-2 -> 32 GiB, a 64 GiB
# workstation -> 6.4 GiB, not half of it) and at least 256 MiB: the most free memory Linux itself keeps
# (vm.min_free_kbytes = sqrt(16 x RAM in KiB), capped at 256 MiB; 66 MiB on the 24 GiB test machine),
# below which it reclaims or OOM-kills. docs/memory_planner.md, "Host".
OS_RESERVE_DIVISOR = 10               # a tenth
OS_RESERVE_CAP_BYTES = 32 * GiB
OS_RESERVE_FLOOR_BYTES = 256 * MiB


def os_reserve_bytes(host_bytes: int) -> int:
    """min(32 GiB, max(256 MiB, host / 10)): the reserve the job, estimate_memory.py and
    find_max_model.py keep on a node with `host_bytes` of memory."""
    return min(OS_RESERVE_CAP_BYTES, max(OS_RESERVE_FLOOR_BYTES, host_bytes // OS_RESERVE_DIVISOR))


@dataclass
class PlanInput:
    """A training configuration. Shape fields use Megatron's names; bytes are bytes.

    Defaults describe the paper's single-GPU setting: one V100-32GB with the DGX-2's 1.5 TiB host.
    """
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    vocab_size: int = 50257
    seq_length: int = 1024
    max_position_embeddings: int | None = None  # None: = seq_length
    ffn_hidden_size: int | None = None  # None: Megatron's default (4h; int(4h·2/3/64)·64 with swiglu)
    # architecture: GPTConfig's field names (the job's flags), defaults = GPT-2
    position_embedding_type: str = "learned_absolute"  # "learned_absolute" | "rope" | "yarn"
    rotary_percent: float = 1.0
    normalization: str = "LayerNorm"  # "LayerNorm" | "RMSNorm"
    swiglu: bool = False
    squared_relu: bool = False  # relu(x)^2 (Nemotron-4); keeps what a GELU keeps
    quick_geglu: bool = False  # GPT-OSS: a gated MLP as SwiGLU's with quick_gelu (x * sigmoid(1.702 x))
    glu_linear_offset: float = 0.0  # a gated MLP's act(min(gate, C)) * (clamp(up, -C, C) + offset) (GPT-OSS: 1)
    activation_func_clamp_value: float | None = None  # ... its C (GPT-OSS: 7; None: no clamp)
    softmax_type: str = "vanilla"  # SOFTMAX_TYPES; "learnable": GPT-OSS's attention sinks (a parameter per head)
    num_query_groups: int | None = None  # None: = num_attention_heads
    kv_channels: int | None = None  # None: hidden_size // num_attention_heads
    untie_embeddings_and_output_weights: bool = False
    add_bias_linear: bool = True
    add_qkv_bias: bool = False
    qk_layernorm: bool = False  # with multi-latent attention: the q and kv latents' norms
    # multi-latent attention (GPTConfig's MLA_FIELDS; params.Architecture, mla_attention_rows): DeepSeek-V2/V3
    multi_latent_attention: bool = False
    q_lora_rank: int | None = None  # None: queries projected from the hidden state directly
    kv_lora_rank: int = 32
    qk_head_dim: int = 128
    qk_pos_emb_head_dim: int = 64
    v_head_dim: int = 128
    rope_type: str | None = None  # MLA's rotary embedding: "yarn" (None: its default) or "rope"
    # mixture of experts (GPTConfig's MoE fields, docs/moe.md): None = a dense model
    num_experts: int | None = None
    moe_router_topk: int = 2
    moe_ffn_hidden_size: int | None = None  # None: ffn_hidden_size (Megatron-LM's default)
    moe_shared_expert_intermediate_size: int | None = None
    moe_shared_expert_gate: bool = False
    moe_layer_freq: int | list = 1  # every N-th layer from 0, or one 0/1 per layer
    moe_token_dispatcher_type: str = "allgather"  # "allgather" | "alltoall"
    moe_expert_capacity_factor: float | None = None  # --moe-expert-capacity-factor (None / < 0: no dropping)
    moe_pad_expert_input_to_capacity: bool = False  # --moe-pad-expert-input-to-capacity
    moe_routing_imbalance: float = 1.0  # planner only: the busiest EP rank's slots / the balanced share
    expert_parallel: int = 1  # EP (--expert-model-parallel-size); expert DP = world / (expert TP x EP)
    expert_tensor_parallel: int | None = None  # expert TP (--expert-tensor-parallel-size); None: = TP
    tensor_parallel: int = 1
    data_parallel: int = 1
    micro_batch_size: int = 1
    grad_accum_steps: int = 1
    precision: str = "bf16"  # "bf16" | "fp16" | "fp32"
    zero_offload: bool = True
    dpu: bool = False
    dpu_weight_prediction: bool = False  # --dpu-weight-prediction: + the fp32 master before the update
    recompute: bool | str | None = False  # False/None, True/"full", "selective"
    recompute_method: str = "uniform"  # full only: "uniform" (checkpoints of N layers) | "block" (first N layers)
    recompute_num_layers: int = 1  # full only: N
    # selective only: megatron-core's --recompute-modules (None: the attention core; model/config.py's list)
    recompute_modules: tuple | None = None
    bucket_size: int = 50_000_000  # elements per gradient bucket (two are allocated)
    bf16_optimizer_states: bool = False  # exp_avg/exp_avg_sq stored as bf16 on the host
    gpu_memory_bytes: int = 32510 * MiB  # V100-SXM3-32GB as torch reports it
    host_memory_bytes_per_node: int = 1536 * GiB  # DGX-2: 1.5 TiB
    gpus_per_node: int | None = None  # None: every rank of the job on one node
    make_vocab_size_divisible_by: int = 128
    # activation-model details
    dropout: bool = True  # dropout masks stored (Korthikanti's formula assumes dropout on)
    fused_softmax: bool = True  # False: torch softmax in fp32 (CPU path) keeps fp32 probs too
    attention_backend: str = "local"  # "local": megatron's DotProductAttention (s² scores) | "sdpa": torch SDPA
    attention_dropout: bool | None = None  # None: = dropout; SDPA on the CPU with it takes the math path
    sequence_parallel: bool = False  # megatron's sequence parallelism (only at TP > 1, as the job)
    # per-document attention (--reset-attention-mask, --sft): one [b, 1, s, s] mask per micro-batch
    # (layer_activations.attention_mask_bytes)
    document_attention_mask: bool = False
    # sliding-window attention (GPTConfig's window fields; planner/window.py): its layers' additive mask, one per
    # micro-batch, [b or 1, C, s, s] with C the distinct masks (window.sdpa_mask_layout; SDPA only)
    window_size: tuple | list | None = None
    window_attn_skip_freq: int | list | None = None
    # overheads and layout
    device_overhead_bytes: int = 1 * GiB  # CUDA context + cuBLAS workspace + NCCL buffers
    host_overhead_bytes_per_rank: int = 3 * GiB  # python + torch + megatron + CUDA host side
    host_overhead_bytes_per_node: int = 0  # the launcher (torchrun's agent), once per node
    host_reserve_bytes: int | None = None  # OS, page cache, data loader on the node; None: os_reserve_bytes(host)
    fragmentation: float = 0.10  # caching-allocator margin on the transient device bytes
    partition_alignment: int = 128  # elements; each DP partition is a multiple of this
    accumulate_on_host: bool = False  # True: fp32 host accumulator instead of device 16-bit grads
    grad_reduce_fp32: bool | None = None  # fp32 bucket buffers + reduce-scatter; None: on for bf16 (Megatron)
    host_grad_fp32: bool = False  # reduced gradients copied home in fp32 (needs grad_reduce_fp32)
    device_is_host: bool = False  # CPU runs: "device" bytes also live in host RAM
    optimizer_offload_fraction: float = 1.0  # share of each partition's optimizer on the host (Megatron's name)
    overlap_cpu_step: bool = False  # --overlap-cpu-step: the rollback backup (memory.overlap_rollback_host_bytes)
    overlap_speculated_fraction: float = 1.0  # ... of this share of each rank's host partition
    nvme_states: bool = False  # --optimizer-nvme-path: exp_avg/exp_avg_sq in files (docs/nvme.md)
    nvme_master: bool = False  # --optimizer-nvme-master: the fp32 master in files too
    nvme_buffer_count: int = 4  # --optimizer-nvme-buffer-count: I/O buffers in the ring
    nvme_buffer_size: int = 1 << 24  # --optimizer-nvme-buffer-size: partition elements per buffer
    nvme_disk_free_bytes: int | None = None  # free space where the states go (the job's statvfs); None: unknown

    def ffn(self) -> int:
        return default_ffn_size(self.hidden_size, self.swiglu) if self.ffn_hidden_size is None \
            else self.ffn_hidden_size

    def gated_mlp(self) -> bool:
        """linear_fc1 is [gate; up] (2f outputs): SwiGLU or quick GeGLU (GPTConfig.gated_mlp)."""
        return self.swiglu or self.quick_geglu

    def sinks(self) -> bool:
        """The attention softmax has a sink logit per head in its denominator (off-by-one: 0; learnable:
        GPT-OSS's learned one): megatron-core's softmax then always runs unfused (planner/attention_sinks.py)."""
        return self.softmax_type != "vanilla"

    def arch(self) -> Architecture:
        return Architecture(**{k: getattr(self, k) for k in Architecture.__dataclass_fields__})

    def moe(self) -> MoEShape | None:
        """The MoE shape on one EP rank, None for a dense model."""
        if self.num_experts is None:
            return None
        return MoEShape(num_experts=self.num_experts, topk=self.moe_router_topk, ffn=self.moe_ffn(),
                        layers=tuple(moe_layer_pattern(self.num_layers, self.moe_layer_freq)),
                        shared=self.moe_shared_expert_intermediate_size or 0, shared_gate=self.moe_shared_expert_gate,
                        expert_parallel=self.expert_parallel)

    def moe_ffn(self) -> int:
        return self.moe_ffn_hidden_size or self.ffn()

    def expert_tp(self) -> int:
        """Expert TP: what each routed expert's TP-split tensors split over (default TP)."""
        return self.tensor_parallel if self.expert_tensor_parallel is None else self.expert_tensor_parallel

    def expert_data_parallel(self) -> int:
        """EDP = world / (expert TP x EP) (= DP / EP at expert TP = TP)."""
        return self.tensor_parallel * self.data_parallel // (self.expert_tp() * self.expert_parallel)

    def experts_apart(self) -> bool:
        """The job's two engines (offload/expert_parallel.py): EP > 1 or an expert TP other than TP
        (ParallelState.experts_apart)."""
        return self.num_experts is not None and (self.expert_parallel > 1 or self.expert_tp() != self.tensor_parallel)

    def query_groups(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    def qk_dim(self) -> int:
        """A query's and a key's channels per head: MLA's qk_head_dim + qk_pos_emb_head_dim, else head_dim."""
        return self.qk_head_dim + self.qk_pos_emb_head_dim if self.multi_latent_attention else self.head_dim()

    def v_dim(self) -> int:
        """A value's channels per head (= the attention output's per head): MLA's v_head_dim, else head_dim."""
        return self.v_head_dim if self.multi_latent_attention else self.head_dim()

    def rotary_dim(self) -> int:
        """Channels the rotary embedding rotates per head: MLA's qk_pos_emb_head_dim (YaRN: all of them;
        rope: rotary_percent of them, megatron-core's RotaryEmbedding), else rotary_percent of head_dim."""
        if self.multi_latent_attention:
            return self.qk_pos_emb_head_dim if (self.rope_type or "yarn") == "yarn" else \
                int(self.qk_pos_emb_head_dim * self.rotary_percent)
        return int(self.head_dim() * self.rotary_percent)

    def architecture_name(self) -> str:
        """One line naming the architecture, e.g. "GPT-2 (learned positions, LayerNorm, GELU, tied)"; with
        multi-latent attention "DeepSeek-family (RMSNorm, SwiGLU, MLA: q latent 1536, kv latent 512, ...)"."""
        gpt2 = self.arch() == Architecture()
        mla = self.multi_latent_attention
        parts = ["learned positions" if self.position_embedding_type == "learned_absolute" else
                 "" if mla else "rope", self.normalization, self.activation_name(),
                 {"off-by-one": "softmax-off-by-one", "learnable": "sinks"}.get(self.softmax_type, "")]
        parts = [p for p in parts if p]
        if mla:     # its own rotary embedding (a model-level rope is not built under MLA)
            parts.append(f"MLA: {'q latent ' + str(self.q_lora_rank) if self.q_lora_rank else 'queries direct'}, "
                         f"kv latent {self.kv_lora_rank}, qk head {self.qk_head_dim}+{self.qk_pos_emb_head_dim}, "
                         f"v head {self.v_head_dim}, {self.rope_type or 'yarn'}"
                         + (", latent norms" if self.qk_layernorm else ""))
        if self.query_groups() != self.num_attention_heads:
            parts.append(f"GQA {self.query_groups()}")
        if not mla and self.kv_channels is not None and self.kv_channels * self.num_attention_heads != self.hidden_size:
            parts.append(f"kv channels {self.kv_channels}")
        parts.append("untied" if self.untie_embeddings_and_output_weights else "tied")
        if not gpt2:
            parts.append("biases" if self.add_bias_linear else "qkv bias only" if self.add_qkv_bias else "no biases")
        if self.qk_layernorm and not mla:
            parts.append("qk norm")
        if self.num_experts is not None:
            moe = self.moe()
            parts.append(f"MoE: {self.num_experts} experts, top-{self.moe_router_topk}, expert ffn {self.moe_ffn()}"
                         + (f", shared expert {moe.shared}" + (" gated" if moe.shared_gate else "") if moe.shared else "")
                         + ("" if all(moe.layers) else f", {sum(moe.layers)} of {self.num_layers} layers"))
        window = normalize_window_size(self.window_size)
        if any(window_layers(window, self.window_attn_skip_freq, self.num_layers)):
            parts.append(describe_window(window, self.window_attn_skip_freq, self.num_layers))
        family = "GPT-2" if gpt2 else "DeepSeek-family" if mla else "Llama-family"
        return f"{family} ({', '.join(parts)})"

    def activation_name(self) -> str:
        """The MLP's activation as GPTConfig names it: "GELU", "ReLU^2", "SwiGLU", "QuickGeGLU", a gated one with
        its clamp and offset where set (GPT-OSS: "QuickGeGLU(clamp 7, +1)")."""
        if not self.gated_mlp():
            return "ReLU^2" if self.squared_relu else "GELU"
        c, offset = self.activation_func_clamp_value, self.glu_linear_offset
        extras = ([f"clamp {c:g}"] if c is not None else []) + ([f"{offset:+g}"] if offset else [])
        return ("SwiGLU" if self.swiglu else "QuickGeGLU") + (f"({', '.join(extras)})" if extras else "")

    def reserve(self) -> int:
        """The OS reserve this plan keeps free on each node: host_reserve_bytes, or the rule."""
        return os_reserve_bytes(self.host_memory_bytes_per_node) if self.host_reserve_bytes is None \
            else self.host_reserve_bytes

    def sp(self) -> bool:
        """Sequence parallelism in effect (the job turns it off at TP = 1, as Megatron-LM)."""
        return self.sequence_parallel and self.tensor_parallel > 1

    def attention_dropout_on(self) -> bool:
        return self.dropout if self.attention_dropout is None else self.attention_dropout

    def sdpa_grouped_kv(self) -> bool:
        """SDPA takes GQA's k/v grouped (enable_gqa): the CPU kernel, and CUDA's flash in 16 bits; CUDA's
        memory-efficient kernel (fp32, or a document or window mask: flash takes no mask) gets them repeated
        (layer_activations._attention_saved)."""
        return self.device_is_host or (self.precision != "fp32" and self.attention_mask_layout() is None)

    def sdpa_math_path(self) -> bool:
        """torch SDPA on the CPU with attention dropout: its CPU kernel has no dropout, the math path runs."""
        return self.attention_backend == "sdpa" and self.device_is_host and self.attention_dropout_on()

    def normalized_recompute(self) -> str | None:
        r = self.recompute
        if r is None or r is False or r == "" or r == "none":
            return None
        if r is True:
            return "full"
        if r in ("full", "selective"):
            return r
        raise ValueError(f"recompute must be False, True, 'full' or 'selective', got {r!r}")

    def selective_modules(self) -> frozenset:
        """What selective recompute recomputes (--recompute-modules; default: the attention core)."""
        if self.normalized_recompute() != "selective":
            return frozenset()
        return frozenset(("core_attn",) if self.recompute_modules is None else self.recompute_modules)

    def reduces_in_fp32(self) -> bool:
        """Bucket buffers and the reduce-scatter in fp32 (the engine's default rule)."""
        if self.precision == "fp32":
            return True
        return self.precision == "bf16" if self.grad_reduce_fp32 is None else bool(self.grad_reduce_fp32)

    def replace(self, **changes) -> "PlanInput":
        return dataclasses.replace(self, **changes)

    def attention_mask_layout(self) -> MaskLayout | None:
        """The attention mask one forward builds (window.sdpa_mask_layout; the local attention's is the
        documents' [b, 1, s, s] bool mask, a window being refused there), None without one."""
        if self.attention_backend == "local":
            return MaskLayout(True, 1, None) if self.document_attention_mask else None
        return sdpa_mask_layout(normalize_window_size(self.window_size), self.window_attn_skip_freq, self.num_layers,
                                self.seq_length, self.document_attention_mask)

    def validate(self) -> None:
        def pos(name):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        for name in ("num_layers", "hidden_size", "num_attention_heads", "vocab_size",
                     "seq_length", "tensor_parallel", "data_parallel", "micro_batch_size",
                     "grad_accum_steps", "bucket_size", "make_vocab_size_divisible_by",
                     "partition_alignment"):
            pos(name)
        if self.max_position_embeddings is not None:
            pos("max_position_embeddings")
            if self.seq_length > self.max_position_embeddings:
                raise ValueError(f"seq_length {self.seq_length} > max_position_embeddings "
                                 f"{self.max_position_embeddings}")
        if self.gpus_per_node is not None:
            pos("gpus_per_node")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {self.precision!r}")
        self.normalized_recompute()
        if self.recompute_method not in ("uniform", "block"):
            raise ValueError(f"recompute_method must be 'uniform' or 'block', got {self.recompute_method!r}")
        pos("recompute_num_layers")
        moe = self.moe()
        selective_recompute_modules(self.normalized_recompute(), self.recompute_modules,
                                    experts=moe is not None, dense_layers=moe is None or not all(moe.layers),
                                    shared_expert=bool(self.moe_shared_expert_intermediate_size),
                                    linear_biases=self.add_bias_linear, mla=self.multi_latent_attention)
        if self.normalized_recompute() == "full" and self.recompute_method == "uniform" and \
                self.num_layers % self.recompute_num_layers:
            raise ValueError(f"recompute_num_layers {self.recompute_num_layers} does not divide num_layers "
                             f"{self.num_layers} (uniform recompute checkpoints whole groups)")
        if self.position_embedding_type not in POSITION_EMBEDDING_TYPES:
            raise ValueError(f"position_embedding_type must be one of {POSITION_EMBEDDING_TYPES}, "
                             f"got {self.position_embedding_type!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}")
        if self.sp() and self.seq_length % self.tensor_parallel:
            raise ValueError(f"sequence_parallel splits the sequence over TP: seq_length {self.seq_length} is not a "
                             f"multiple of tensor_parallel {self.tensor_parallel}")
        if self.normalization not in NORMALIZATIONS:
            raise ValueError(f"normalization must be one of {NORMALIZATIONS}, got {self.normalization!r}")
        if not 0.0 < self.rotary_percent <= 1.0:
            raise ValueError(f"rotary_percent must be in (0, 1], got {self.rotary_percent}")
        if self.num_query_groups is not None:
            pos("num_query_groups")
            if self.num_attention_heads % self.num_query_groups:
                raise ValueError(f"num_attention_heads {self.num_attention_heads} is not divisible by "
                                 f"num_query_groups {self.num_query_groups}")
        if self.kv_channels is not None:
            pos("kv_channels")
        if self.num_query_groups is not None and self.num_query_groups % self.tensor_parallel:
            largest = max(t for t in range(1, self.query_groups() + 1) if self.query_groups() % t == 0
                          and self.num_attention_heads % t == 0 and t <= self.tensor_parallel)
            raise ValueError(f"num_query_groups {self.query_groups()} is not divisible by tensor_parallel "
                             f"{self.tensor_parallel} (the local attention splits whole query groups): "
                             f"use TP {largest} or another divisor of {self.query_groups()}")
        if self.kv_channels is None and self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not divisible by "
                             f"num_attention_heads {self.num_attention_heads}")
        if self.num_attention_heads % self.tensor_parallel:
            raise ValueError(f"num_attention_heads {self.num_attention_heads} is not divisible by "
                             f"tensor_parallel {self.tensor_parallel}")
        self._validate_mla()
        check_mlp_and_softmax(self.swiglu, self.squared_relu, self.quick_geglu, self.glu_linear_offset,
                              self.activation_func_clamp_value, self.softmax_type)
        window = normalize_window_size(self.window_size)      # (ValueError: the job's one line)
        normalize_skip_freq(self.window_attn_skip_freq, window, self.num_layers)
        if self.attention_backend == "local" and any(window_layers(window, self.window_attn_skip_freq,
                                                                   self.num_layers)):
            raise ValueError("a sliding window (window_size) runs on SDPA only: attention_backend 'sdpa' "
                             "(the job's --use-flash-attn)")
        if self.ffn_hidden_size is not None:
            pos("ffn_hidden_size")
            if self.ffn_hidden_size % self.tensor_parallel:
                raise ValueError(f"ffn_hidden_size {self.ffn_hidden_size} is not divisible by "
                                 f"tensor_parallel {self.tensor_parallel}")
        self._validate_moe()
        if self.host_grad_fp32 and not self.reduces_in_fp32():
            raise ValueError("host_grad_fp32 needs grad_reduce_fp32")
        if self.dpu and not self.zero_offload:
            raise ValueError("dpu (delayed parameter update) requires zero_offload")
        if self.dpu_weight_prediction and not self.dpu:
            raise ValueError("dpu_weight_prediction requires dpu")
        if not 0.0 <= self.optimizer_offload_fraction <= 1.0:
            raise ValueError(f"optimizer_offload_fraction must be in [0, 1], got {self.optimizer_offload_fraction}")
        if (self.nvme_states or self.nvme_master) and not (self.zero_offload and self.nvme_states):
            raise ValueError("nvme_states needs zero_offload, and nvme_master needs nvme_states")
        if self.nvme_buffer_count < 1 or self.nvme_buffer_size < 64 or self.nvme_buffer_size % 64:
            raise ValueError("nvme_buffer_count must be >= 1 and nvme_buffer_size a positive multiple of 64")
        for name in ("gpu_memory_bytes", "host_memory_bytes_per_node"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")
        for name in ("device_overhead_bytes", "host_overhead_bytes_per_rank", "host_overhead_bytes_per_node",
                     "host_reserve_bytes"):
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        if not 0 <= self.fragmentation < 1:
            raise ValueError(f"fragmentation must be in [0, 1), got {self.fragmentation}")

    def _validate_mla(self) -> None:
        """Multi-latent attention's rules that shape memory (the job checks the rest, GPTConfig._check_mla)."""
        if not self.multi_latent_attention:
            return
        for name in ("kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        r_q = self.q_lora_rank
        if r_q is not None and (not isinstance(r_q, int) or isinstance(r_q, bool) or r_q < 1):
            raise ValueError(f"q_lora_rank must be a positive integer or None, got {r_q!r}")
        if r_q is not None and r_q % self.tensor_parallel:
            raise ValueError(f"q_lora_rank {r_q} is not divisible by tensor_parallel {self.tensor_parallel} (its down "
                             "projection is column-parallel)")
        kv = self.kv_lora_rank + self.qk_pos_emb_head_dim
        if kv % self.tensor_parallel:
            # replicated in the model (model/mla.py), but megatron-core's constructor first builds it column-parallel
            raise ValueError(f"kv_lora_rank + qk_pos_emb_head_dim = {kv} is not divisible by tensor_parallel "
                             f"{self.tensor_parallel} (megatron-core builds the kv down projection column-parallel "
                             "before the model replaces it; the job's rule)")
        if self.rope_type not in (None, "rope", "yarn"):
            raise ValueError(f"rope_type must be 'rope' or 'yarn' (None: yarn), got {self.rope_type!r}")
        if self.query_groups() != self.num_attention_heads:
            raise ValueError(f"num_query_groups {self.num_query_groups} with multi_latent_attention: MLA's keys and "
                             "values come from one latent per token, not from groups")
        if self.attention_backend != "sdpa":
            raise ValueError("multi_latent_attention runs on torch SDPA (attention_backend 'sdpa'): megatron-core's "
                             "local attention cannot take its separate key and value head dims")

    def _validate_moe(self) -> None:
        """megatron-core's MoE rules that shape memory (the job checks the rest, GPTConfig._check_moe)."""
        ep, etp = self.expert_parallel, self.expert_tensor_parallel
        if self.num_experts is None:
            if ep != 1 or etp not in (None, self.tensor_parallel):
                raise ValueError(f"expert_parallel {ep} / expert_tensor_parallel {etp} need num_experts (a dense "
                                 "model has no experts to split)")
            return
        e, k, t = self.num_experts, self.moe_router_topk, self.tensor_parallel
        if not isinstance(e, int) or e < 1 or not isinstance(ep, int) or ep < 1:
            raise ValueError(f"num_experts ({e}) and expert_parallel ({ep}) must be positive integers")
        if etp is not None and (not isinstance(etp, int) or etp < 1):
            raise ValueError(f"expert_tensor_parallel ({etp}) must be a positive integer (None: = TP)")
        etp = self.expert_tp()
        if not 1 <= k <= e:
            raise ValueError(f"moe_router_topk {k} must be in 1..num_experts {e}")
        if e % ep:
            raise ValueError(f"expert_parallel {ep} does not divide num_experts {e}: use an EP size that divides {e}")
        world = t * self.data_parallel
        if world % (ep * etp):
            raise ValueError(f"expert_parallel {ep} x expert_tensor_parallel {etp} does not divide the world {world} "
                             f"(TP {t} x DP {self.data_parallel}): use an EP size that divides {world // etp}")
        if not (isinstance(self.moe_routing_imbalance, (int, float)) and self.moe_routing_imbalance >= 1):
            raise ValueError(f"moe_routing_imbalance {self.moe_routing_imbalance!r} must be >= 1 (1: balanced routing)")
        c = self.moe_expert_capacity_factor
        if self.moe_pad_expert_input_to_capacity and (c is None or c < 0):
            raise ValueError("moe_pad_expert_input_to_capacity needs moe_expert_capacity_factor >= 0")
        if self.moe_token_dispatcher_type not in ("allgather", "alltoall"):
            raise ValueError(f"moe_token_dispatcher_type must be allgather or alltoall, got "
                             f"{self.moe_token_dispatcher_type!r}")
        for name, n, by, what in (("moe_ffn_hidden_size", self.moe_ffn(), etp, "expert_tensor_parallel"),
                                  ("moe_shared_expert_intermediate_size", self.moe_shared_expert_intermediate_size or 0,
                                   t, "tensor_parallel")):
            if n < 0 or n % by:
                raise ValueError(f"{name} {n} is not divisible by {what} {by}")
        if self.moe_shared_expert_gate and not self.moe_shared_expert_intermediate_size:
            raise ValueError("moe_shared_expert_gate needs moe_shared_expert_intermediate_size")
        moe_layer_pattern(self.num_layers, self.moe_layer_freq)


@dataclass
class Plan:
    input: PlanInput
    fits: bool
    reasons: list[str]  # one line per check (device / host / unified), saying OK or how far over
    suggestions: list[str]  # when it does not fit: changes that help, each re-planned
    warnings: list[str]
    device_bytes_per_gpu: int
    host_bytes_per_gpu: int  # model-state bytes on the host for one rank (no process overhead)
    host_bytes_per_node: int
    device_items: dict[str, int]  # per GPU
    host_items: dict[str, int]  # per node (already multiplied by the ranks on the node)
    params_total: int
    params_per_tp_rank: int  # Ψ, unpadded
    params_per_tp_rank_padded: int  # Ψ padded so N partitions of partition_alignment fit
    replicated_params_per_tp_rank: int
    vocab_size_padded: int
    world_size: int
    num_nodes: int
    ranks_per_node: int
    fits_device: bool
    fits_host: bool
    disk_bytes_per_node: int = 0  # --optimizer-nvme-path: the state files of the node's ranks
    host_setup_bytes_per_node: int = 0  # while the engine is built: every rank's fp32 model + what it allocates
    # mixture of experts (0 for a dense model)
    params_active: int = 0  # what one token uses: the top-k routed experts per MoE layer (= total when dense)
    params_experts_total: int = 0  # every routed expert of every MoE layer
    params_expert_per_rank: int = 0  # the routed-expert parameters one rank holds (E/EP experts, 1/TP of each)
    experts_per_ep_rank: int = 0  # E / EP

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["input"] = dataclasses.asdict(self.input)
        d["architecture"] = self.input.architecture_name()
        return d


def plan_input_from_flags(flags: Any, *, data_parallel: int, vocab_size: int, **hardware: Any) -> PlanInput:
    """The PlanInput of a pretrain_gpt.py run, built from its flags: the one builder behind both the
    job's pre-launch check and tools/estimate_memory.py (which takes the same flag names and
    defaults), so the two can never plan different models. `flags` has pretrain_gpt.py's argparse
    attribute names; `hardware` the PlanInput fields of the machine (memory sizes, overheads)."""
    precision = flags.precision or "bf16"
    mb = flags.micro_batch_size
    gbs = flags.global_batch_size
    if gbs is not None and getattr(flags, "decrease_batch_size_if_needed", False):
        gbs -= gbs % (mb * data_parallel)       # Megatron-LM's running batch (training/batch_schedule.py)
    if gbs is None:
        accum = 1
    elif gbs < 1 or gbs % (mb * data_parallel):
        raise ValueError(f"--global-batch-size {gbs} is not a multiple of --micro-batch-size {mb} x DP {data_parallel}")
    else:
        accum = gbs // (mb * data_parallel)
    recompute, modules = resolve_recompute(
        flags.recompute_granularity, getattr(flags, "recompute_modules", None),
        recompute_activations=bool(getattr(flags, "recompute_activations", False)),
        moe_layer_recompute=bool(getattr(flags, "moe_layer_recompute", False)),
        experts=getattr(flags, "num_experts", None) is not None)
    # the architecture flags (GPTConfig's field names; absent on an older namespace: GPT-2)
    arch = {name: getattr(flags, name) for name in Architecture.__dataclass_fields__
            if getattr(flags, name, None) is not None}
    if not getattr(flags, "group_query_attention", True):
        arch.pop("num_query_groups", None)      # Megatron-LM: --num-query-groups counts only with GQA on
    if getattr(flags, "multi_latent_attention", False):
        arch["rope_type"] = getattr(flags, "rope_type", None)
    return PlanInput(**arch,
        num_layers=flags.num_layers, hidden_size=flags.hidden_size, num_attention_heads=flags.num_attention_heads,
        ffn_hidden_size=flags.ffn_hidden_size, vocab_size=vocab_size, seq_length=flags.seq_length,
        max_position_embeddings=flags.max_position_embeddings or flags.seq_length, tensor_parallel=flags.tensor_parallel,
        data_parallel=data_parallel, micro_batch_size=mb, grad_accum_steps=accum, precision=precision,
        zero_offload=flags.zero_offload, dpu=bool(getattr(flags, "dpu", False)),
        dpu_weight_prediction=bool(getattr(flags, "dpu_weight_prediction", False)), recompute=recompute,
        recompute_method=getattr(flags, "recompute_method", None) or "uniform",
        recompute_num_layers=getattr(flags, "recompute_num_layers", None) or 1,
        recompute_modules=None if modules is None else tuple(modules),
        bucket_size=flags.bucket_size, make_vocab_size_divisible_by=flags.make_vocab_size_divisible_by,
        # the model's attention is torch's softmax in fp32 (not a fused kernel) on every device
        dropout=flags.hidden_dropout > 0 or flags.attention_dropout > 0, fused_softmax=False,
        attention_dropout=flags.attention_dropout > 0,
        # --use-flash-attn / --attention-backend (args.core_attention once the job's checks ran)
        attention_backend=_core_attention(flags), sequence_parallel=bool(getattr(flags, "sequence_parallel", False)),
        document_attention_mask=bool(getattr(flags, "reset_attention_mask", False) or getattr(flags, "sft", False)),
        window_size=getattr(flags, "window_size", None),
        window_attn_skip_freq=getattr(flags, "window_attn_skip_freq", None),
        bf16_optimizer_states=flags.exp_avg_dtype == "bf16",
        grad_reduce_fp32=flags.accumulate_allreduce_grads_in_fp32,
        host_grad_fp32=flags.main_grads_dtype == "fp32" and precision != "fp32",
        accumulate_on_host=flags.accumulate_grads_on_host,
        nvme_states=getattr(flags, "optimizer_nvme_path", None) is not None,
        nvme_master=bool(getattr(flags, "optimizer_nvme_master", False)),
        nvme_buffer_count=getattr(flags, "optimizer_nvme_buffer_count", 4),
        nvme_buffer_size=getattr(flags, "optimizer_nvme_buffer_size", 1 << 24), **_moe_fields(flags), **hardware)


def _moe_fields(flags: Any) -> dict[str, Any]:
    """PlanInput's MoE fields from the job's flags (Megatron-LM's names; absent: a dense model)."""
    if getattr(flags, "num_experts", None) is None:
        return {}
    return dict(expert_tensor_parallel=getattr(flags, "expert_tensor_parallel", None),
                num_experts=flags.num_experts, moe_router_topk=flags.moe_router_topk,
                moe_ffn_hidden_size=flags.moe_ffn_hidden_size,
                moe_shared_expert_intermediate_size=flags.moe_shared_expert_intermediate_size,
                moe_shared_expert_gate=bool(flags.moe_shared_expert_gate), moe_layer_freq=flags.moe_layer_freq,
                moe_token_dispatcher_type=flags.moe_token_dispatcher_type,
                moe_expert_capacity_factor=getattr(flags, "moe_expert_capacity_factor", None),
                moe_pad_expert_input_to_capacity=bool(getattr(flags, "moe_pad_expert_input_to_capacity", False)),
                moe_routing_imbalance=getattr(flags, "moe_routing_imbalance", 1.0),
                expert_parallel=getattr(flags, "expert_parallel", 1) or 1)



def _core_attention(flags: Any) -> str:
    """"local" | "sdpa" from the job's flags: args.core_attention when the job's argument checks
    set it, otherwise from --use-flash-attn / --attention-backend as they do (none named: local, or torch
    SDPA under multi-latent attention or a sliding window)."""
    core = getattr(flags, "core_attention", None)
    if core is not None:
        return core
    if getattr(flags, "use_flash_attn", False):
        return "sdpa"
    backend = getattr(flags, "attention_backend", None)
    if backend is None:
        return default_core_attention(flags_need_sdpa(flags))
    return "local" if backend in ("local", "unfused") else "sdpa"
