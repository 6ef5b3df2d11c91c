"""What attention sinks (softmax_type "off-by-one" / "learnable": one more logit per head in every softmax
denominator, GPT-OSS's sinks) make one layer keep for backward on one TP rank (layer_activations composes
these; measured with saved-tensor hooks in tests/test_planner_gptoss.py).

local (megatron-core's DotProductAttention, fused_softmax.SoftmaxOne): the scores [b, a/t, s, s] get the sink
  column appended (torch.cat, which keeps nothing) and the fp32 softmax keeps its output, now [.., s, s + 1]:
  4·b·(a/t)·s bytes more per layer (`local_sink_extra`); the 16-bit copy it returns is [.., s, s] as before. The
  fused softmax kernel never runs with an offset, so a GPU plan's 16-bit probabilities are the unfused ones.

sdpa (model/sinks.py, SDPAttention): SDPA runs on s + 1 positions (a dummy query and the sink key at position 0)
  over new operands q', k', v' [b, heads, s + 1, d'] into which the projections are copied (so nothing of q, k,
  v, or of the fused qkv tensor they are views of, is kept by the core; `sink_head_dims` gives d'), and keeps
  q', k', v', its output [.., s + 1, d_v'] and the fp32 logsumexp [b, a/t, s + 1] (`sink_core_saved`).
  linear_proj keeps the context [s, b, a/t·d_v]: a view of that output where it has no extra channels (the
  CPU kernel writes it in the query's [s + 1, b, heads, d] order: dropping row 0 and reshaping is free), else a
  copy (`sink_proj_input`). With attention dropout on a CPU the math path runs instead, on the same operands
  (`sink_core_saved`: its fp32 tensors at s + 1 positions and the widths d'). Masks come in the sink layout,
  [.., s + 1, s + 1] (layer_activations.attention_mask_bytes).
"""
from __future__ import annotations

import math

from zo_megatron.planner.inputs import PlanInput


def _w(inp: PlanInput) -> int:
    return 4 if inp.precision == "fp32" else 2


def sink_sdpa(inp: PlanInput) -> bool:
    """The SDPA core attention runs the sink path (model/sinks.py)."""
    return inp.sinks() and inp.attention_backend == "sdpa"


def positions(inp: PlanInput) -> int:
    """Query and key positions SDPA runs on: s, or s + 1 on the sink path."""
    return inp.seq_length + (1 if sink_sdpa(inp) else 0)


def offset_channels(inp: PlanInput) -> int:
    """Extra head-dim channels of q' carrying offset / scale (model/sinks.offset_channels, the same rule: 0
    for off-by-one; learnable: 1 in fp32; in 16 bits 1 where the scale 1/sqrt(d_qk) is a power of 2 (the
    offset, a 16-bit parameter in the engine, then divides exactly), else 3. (Multi-latent attention with YaRN
    scales by mscale^2 / sqrt(d_qk): the rule at 1/sqrt(d_qk), at most 2 channels of q' per head off.)"""
    return sink_offset_channels(inp.softmax_type, _w(inp) == 2, 1.0 / math.sqrt(inp.qk_dim()))


def sink_head_dims(inp: PlanInput) -> tuple[int, int]:
    """(q' and k', v') head dims on the sink path (model/sinks.sink_operands): sink_widths."""
    return sink_widths(inp.qk_dim(), inp.v_dim(), offset_channels(inp), cuda=not inp.device_is_host)


def sink_widths(dq: int, dv: int, extra: int, cuda: bool) -> tuple[int, int]:
    """The one rule, for the model (model/sinks.sink_operands) and the plan: (q' and k', v') head dims on the sink
    path, d_qk + the offset channels, on CUDA rounded up to a multiple of 8 (where there are any: its flash and
    memory-efficient kernels want one); on a CPU (one head dim for its flash kernel) v' as wide as q', at least
    d_v; on CUDA v' = q' where the value's head dim is the query's, else d_v."""
    width = dq + extra
    if not cuda:
        width = max(width, dv)
    elif extra:
        width = -(-width // 8) * 8
    return width, width if not cuda or dv == dq else dv


def sink_offset_channels(softmax_type: str, sixteen_bit: bool, scale: float, offset_exact: bool = True) -> int:
    """The one rule, for the model (model/sinks.offset_channels) and the plan: how many extra head-dim channels of
    q' carry c_h = offset / scale. 0 but for "learnable"; 1 in fp32/fp64, and in 16 bits where the division is
    exact (a power-of-2 scale on an offset already of the attention's dtype: `offset_exact`); else 3, their sum
    good to ~fp32 in the kernels' fp32 accumulation."""
    if softmax_type != "learnable":
        return 0
    if not sixteen_bit:
        return 1
    return 1 if math.frexp(scale)[0] == 0.5 and offset_exact else 3


def _kv_heads(inp: PlanInput) -> int:
    """k' and v' heads as SDPA keeps them: the rank's groups where they stay grouped (PlanInput.sdpa_grouped_kv,
    as for the vanilla path), else repeated to every head (the grouped k', v' the repeat reads are then freed)."""
    a, g = inp.num_attention_heads // inp.tensor_parallel, inp.query_groups() // inp.tensor_parallel
    return g if inp.sdpa_grouped_kv() else a


def _output_copied(inp: PlanInput) -> bool:
    """The context linear_proj keeps is a copy: where SDPA's output has extra channels (v' wider than d_v), or
    from the CPU math path (its output is [b, heads, s + 1, d_v'], which the reshape to [s, b, ...] copies)."""
    return sink_head_dims(inp)[1] != inp.v_dim() or inp.sdpa_math_path()


def sink_proj_input(inp: PlanInput) -> int:
    """Bytes per layer of linear_proj's saved input on the sink path: the [s, b, a/t·d_v] copy, or (a view of
    it) SDPA's whole output [b, a/t, s + 1, d_v]."""
    w, b, a = _w(inp), inp.micro_batch_size, inp.num_attention_heads // inp.tensor_parallel
    if _output_copied(inp):
        return w * inp.seq_length * b * a * inp.v_dim()
    return w * positions(inp) * b * a * sink_head_dims(inp)[1]


def sink_core_saved(inp: PlanInput) -> int:
    """Bytes per layer the SDPA core keeps of its own on the sink path (what --recompute-modules core_attn
    recomputes): q', k', v' at s + 1 positions, the fp32 logsumexp, and the output where it is not
    linear_proj's input (`sink_proj_input`). The CPU math path (attention dropout) keeps instead three fp32
    [b, a/t, s + 1, s + 1] tensors and fp32 q'·scale, k'·scale, v' at the full head count."""
    w, b, n = _w(inp), inp.micro_batch_size, positions(inp)
    a = inp.num_attention_heads // inp.tensor_parallel
    dq, dv = sink_head_dims(inp)
    if inp.sdpa_math_path():
        return 3 * 4 * a * n * n * b + 4 * a * n * b * (2 * dq + dv)
    kept = w * n * b * (a * dq + _kv_heads(inp) * (dq + dv)) + 4 * a * n * b
    if _output_copied(inp):
        kept += w * n * b * a * dv
    return kept


def local_sink_extra(inp: PlanInput) -> int:
    """Bytes per layer the local attention's sink softmax keeps beyond the vanilla one: the fp32 output's
    sink column, [b, a/t, s, 1] (module docstring)."""
    if not inp.sinks() or inp.attention_backend != "local":
        return 0
    return 4 * inp.micro_batch_size * inp.num_attention_heads // inp.tensor_parallel * inp.seq_length
