"""Will my model fit? The memory model of zo_megatron's engine, per GPU and per node.

Pure Python (no torch, no megatron): `tools/estimate_memory.py` and the pre-launch check call it.
Every number below is a line item you can read in `Plan.device_items` / `Plan.host_items`.
The formulas are written out in docs/memory_planner.md; the short version, per TP rank, with
t = tensor parallel, N = data parallel, Ψ = parameters on this TP rank (padded to N partitions),
b16 = 2 bytes (bf16/fp16) or 4 (fp32):

  device, ZeRO-Offload   b16·Ψ params + bg·bucket gradient buckets x2 (x1 when one bucket holds every
                         parameter; + grad_bucket_oversize when the largest bucket -- the one holding
                         the word embedding, a parameter never straddles buckets -- exceeds bucket_size;
                         bg = 4 when gradients are reduced in fp32, the bf16 default, else b16)
                         (+ 2·largest bucket/N x2 narrowing scratch on a GPU when fp32-reduced shards
                         go home as 16 bits) (+ bg·bucket reduce-scatter scratch when N > 1: an
                         allowance, the engine reduce-scatters in place) (+ on a CPU device at N > 1,
                         bg x the largest two consecutive buckets below 2**20 elements: the clones gloo
                         reduce-scatters them through, reduce_scatter_copies) (+ b16·Ψ 16-bit gradients
                         kept across micro-batches when grad_accum_steps > 1, unless they accumulate
                         on the host) + activations + fragmentation + CUDA overhead
  device, baseline       16 bytes/param (2 param + 2 grad + 4 master + 4 m + 4 v; fp32: 4+4+4+4)
  host per GPU           Ψ/N · (4 master + 4|2 m + 4|2 v + b16 staging [+ 4 fp32 host gradients:
                         staging 4 + 2 params] [+ 4 host accumulator] [+ DPU: another gradient staging
                         [+ accumulator]])
  host per node          host per GPU x ranks on the node + per-process overhead x ranks (+ the launcher's,
                         once) + OS reserve (min(32 GiB, max(256 MiB, host/10)): inputs.os_reserve_bytes)
  activations            stored: Korthikanti et al. 2022, s·b·h·(10 + 24/t + 5·a·s/(h·t)) bytes per layer
                         (16-bit, dropout, no sequence parallel); full recompute stores b16·s·b·h per
                         layer. On top, the largest of three phases that never coexist: the logits
                         (+ their fp32 copies), the output layer's backward (+ the tied embedding's
                         gradient, held to the end of backward), one layer's backward (its recompute
                         working set + its gradients). `_activation_items` has the details; validated
                         against torch's measured CPU peak in tests/test_planner_validation.py.
                         --use-flash-attn (attention_backend="sdpa"): the 5·a·s/(h·t) scores term
                         becomes an fp32 logsumexp, 4·a·s·b/t per layer (no s² term; CPU with
                         attention dropout: the math path's fp32 s² tensors). --sequence-parallel
                         (t > 1): the replicated 10 becomes 10/t, and the embedding/final-norm
                         activations, residual gradients and full-recompute checkpoints / t, plus
                         one b16·s·b·h gather buffer. Per-document attention (document_attention_mask:
                         --reset-attention-mask, --sft): one [b, 1, s, s] mask per micro-batch, b·s²
                         (local, bool) or b16·b·s² (SDPA), in every phase where it is kept for backward
                         (layer_activations.attention_mask_bytes); on a GPU SDPA's k/v repeated (the
                         memory-efficient kernel: flash takes no mask). A sliding window that binds
                         (window_size, SDPA): its layers' mask counted the same way, one channel per
                         distinct mask, b16·(b or 1)·C·s² (planner/window.py sdpa_mask_layout); the
                         item is `activations_attention_mask`.

Parameter count of the GPT-2-style model (learned positions, tied embeddings, biases, LayerNorms):
  P = V_pad·h + S·h + L·(12h² + 13h) + 2h,   V_pad = V rounded up to a multiple of 128·t
  Ψ_tp = V_pad·h/t + S·h + L·((12h² + 7h)/t + 6h) + 2h

Llama-family shapes (rope, RMSNorm, SwiGLU, GQA, untied output layer, no biases / qkv bias,
q/k norm; GPTConfig's field names in PlanInput): parameters in params.py, activations in memory.py
(_layer_saved), both described in docs/memory_planner.md.

Multi-latent attention (MLA, DeepSeek-V2/V3; GPTConfig's MLA fields in PlanInput): its projections
(the kv down projection replicated over TP) in params.py, its latents, heads, padded CPU heads and
rotary tables in layer_activations.py; docs/memory_planner.md, "Multi-latent attention".

GPT-OSS's parts (GPTConfig's quick_geglu, glu_linear_offset, activation_func_clamp_value, softmax_type in
PlanInput): quick GeGLU's fc1 is [gate; up] as SwiGLU's (params.py); what a gated MLP keeps with its clamp
in mlp_activations.py (dense, shared and routed experts); attention sinks' parameter (params.sink_rows) and
what their softmax keeps (attention_sinks.py: the local attention's sink column, SDPA's s + 1 positions);
docs/memory_planner.md, "GPT-OSS".

Mixtures of experts (GPTConfig's MoE fields and expert_parallel in PlanInput): the router, E / EP
experts per rank and the shared expert in params.py (total and active counts); at EP > 1 two engines
(the dense parameters over DP, the experts over expert DP = DP / EP), each with its own flat buffer,
buckets and host partition ("expert_..." items); the MoE layer's activations and the dispatcher's
buffers in moe.py; docs/memory_planner.md, "Mixtures of experts".

Layers (each module imports only those above it):
  units    GiB, formatting
  params   the parameter list (Architecture, MoEShape, registration order) and its counts
  inputs   PlanInput (the question), Plan (the answer), plan_input_from_flags
  buckets  the engine's bucket layout (one engine, or at EP > 1 the dense and the experts' engines)
  mlp_activations  what a dense MLP and a routed expert keep per token (GELU, ReLU^2, SwiGLU, quick GeGLU, clamps)
  attention_sinks  what attention sinks add to the core attention's activations (local, SDPA)
  moe      what a mixture-of-experts layer adds to the activations, the token dispatcher's buffers
  layer_activations  what one transformer layer keeps for backward, by part (and under selective recompute)
  memory   the memory model, one function per component (_compute assembles them)
  search   plan() with suggestions, max_model()
  presets  hardware and model-shape presets
  paper    the paper's reference points and our maxima
"""
from __future__ import annotations

from zo_megatron.planner.inputs import (PRECISIONS, RECOMPUTE, Plan, PlanInput, os_reserve_bytes,
                                        plan_input_from_flags)
from zo_megatron.planner.memory import (PLAN_ERROR_MARGIN, _activation_items, _bucket_layout, _bytes16, _compute, _ranks_layout, _try,
                                        may_fit, overlap_full_bytes_per_rank, solve_offload_fraction,
                                        solve_overlap_fraction, resolve_overlap, OVERLAP_MODES)
from zo_megatron.planner.paper import GOALS, baseline_maxima, our_maxima, paper_checks
from zo_megatron.planner.params import (Architecture, MoEShape, count_params, default_ffn_size, layer_parameters,
                                        model_parameters, pad_vocab_size)
from zo_megatron.planner.presets import (HARDWARE_PRESETS, MODEL_PRESET_NUMERICS, MODEL_PRESETS, apply_hardware_preset,
                                         model_preset)
from zo_megatron.planner.search import (BF16_STATES_FLAGS, FAMILIES, _describe, _suggest, family_member,
                                        largest_fitting, largest_monotone, max_model, plan)
from zo_megatron.planner.units import GiB, MiB, format_bytes, format_params

from typing import Any

__all__ = [
    "GiB", "PlanInput", "Plan", "plan", "plan_input_from_flags", "max_model", "count_params", "pad_vocab_size",
    "HARDWARE_PRESETS", "MODEL_PRESETS", "MODEL_PRESET_NUMERICS", "apply_hardware_preset", "model_preset", "paper_checks",
    "baseline_maxima", "our_maxima", "GOALS", "FAMILIES",
    "format_bytes", "format_params", "solve_offload_fraction", "solve_overlap_fraction", "overlap_full_bytes_per_rank", "resolve_overlap", "OVERLAP_MODES", "Architecture", "default_ffn_size",
    "layer_parameters", "model_parameters", "MoEShape", "may_fit", "largest_fitting", "largest_monotone", "os_reserve_bytes",
    "PLAN_ERROR_MARGIN", "family_member",
]
