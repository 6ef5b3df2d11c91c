"""Attention sinks (megatron-core's softmax_type "off-by-one" / "learnable", GPT-OSS's `sinks`) on torch SDPA.

megatron-core's local DotProductAttention (fused_softmax.SoftmaxOne) appends one logit per head, softmax_offset_h,
to every row of the scores and drops its column after the softmax:

    p_ij = exp(s_ij) / (sum_j' exp(s_ij') + exp(offset_h))         (off-by-one: offset 0, i.e. + 1)

SDPA has no such term, but the same softmax is an ordinary one over one more key, whose score is offset_h for every
query of head h and whose value is 0. SDPAttention builds that key into SDPA's operands, so the fused kernels run as
they are (nothing s x s is built where nothing was):

    position 0: a dummy query and the sink key; positions 1..s: the real tokens
    q' = [q, c_h]   c_h = offset_h / scale in `offset_channels` extra head-dim channels, every position
    k' = [k, 0]     the sink key [0 .. 0, 1 .. 1]: q'_i . k'_sink x scale = offset_h
    v' = [v, 0]     the sink value 0

With the dummy query the square is_causal (top-left aligned) still reads right: query i + 1 sees the sink and real
keys 0..i. Its output is dropped with the extra channels; it sees the sink alone (is_causal, or row 0 of a mask in
the sink layout: model/masks.py), which does not depend on the inputs, so it gives them no gradient. The sink key is
one for every head (the per-head value lives in q), so grouped-query attention's grouped k/v stay grouped.
Gradients reach softmax_offset through c_h by autograd.

Off-by-one needs no channel: a zero sink key scores exactly 0. In 16 bits c_h (offset / scale, not representable
in general) is split over 3 channels, c1 + c2 + c3 (each the rounding of what is left), which the kernels multiply
by the key's exact 1s and sum in fp32: the sink logit then is good to ~fp32, as megatron-core's fp32 softmax has it
(one channel where the division is exact: a power-of-2 scale on an offset of the attention's dtype, e.g. head dim 64).
On CUDA the head dim is padded with zeros to a multiple of 8 (flash and memory-efficient kernels want one);
zeros change no dot product.

Cost (what backward keeps, per layer): SDPA saves q', k', v', the output and its fp32 logsumexp at s + 1 positions
and the widened head dim -- q', k', v' new tensors, where the vanilla path saves q, k, v as they come (v a view of
linear_qkv's whole output, which it keeps alive). Where the output has extra channels (learnable, or MLA's padded
value) the [s, b, heads x d] context handed to linear_proj (which saves it) is a copy, not a view of SDPA's
output; off-by-one's is a view, as vanilla's is on a CPU. Building the operands costs one allocation each; their
backward hands q, k, v views of the gradient (_SinkOperand).
"""
from __future__ import annotations

import torch

from zo_megatron.planner.attention_sinks import sink_offset_channels, sink_widths



def offset_channels(softmax_type: str, dtype: torch.dtype, offset_dtype: torch.dtype | None, scale: float) -> int:
    """How many extra head-dim channels carry c_h = offset / scale (module docstring; the planner's rule too:
    planner/attention_sinks.sink_offset_channels)."""
    return sink_offset_channels(softmax_type, dtype not in (torch.float32, torch.float64), scale,
                                offset_exact=offset_dtype == dtype)


def _offset_pieces(offset: torch.Tensor, scale: float, dtype: torch.dtype, channels: int) -> torch.Tensor:
    """[heads, channels] of `dtype` summing to offset / scale (to ~fp32 in 16 bits). Only the first piece carries
    the gradient: the kernels give every piece the same one (the key is 1 in each), and d(c)/d(offset) = 1/scale
    must be counted once."""
    wide = torch.promote_types(offset.dtype, torch.float32)
    c = offset.to(wide) / scale
    pieces = [c.to(dtype)]
    rest = c.detach() - pieces[0].detach().to(wide)
    for _ in range(channels - 1):
        pieces.append(rest.to(dtype))
        rest = rest - pieces[-1].to(wide)
    return torch.stack(pieces, dim=-1)


class _SinkOperand(torch.autograd.Function):
    """[s, b, n, d] -> [s + 1, b, n, width]: zeros, x at positions 1.., `fill` [n, extra] in channels d.. of every
    position, 1 in those channels at position 0 where `sink_key`. One allocation forward; backward hands x a
    view of the gradient and `fill` its sum over positions (in-place slice assignments would clone the whole
    gradient once per assignment)."""

    @staticmethod
    def forward(ctx, x, fill, width: int, extra: int, sink_key: bool):
        s, b, n, d = x.shape
        out = x.new_zeros(s + 1, b, n, width)
        out[1:, :, :, :d] = x
        if fill is not None:
            out[:, :, :, d:d + extra] = fill
        if sink_key and extra:
            out[0, :, :, d:d + extra] = 1
        ctx.d, ctx.extra, ctx.fill = d, extra, fill is not None
        return out

    @staticmethod
    def backward(ctx, grad):
        d, extra = ctx.d, ctx.extra
        fill = grad[:, :, :, d:d + extra].sum((0, 1)) if ctx.fill and ctx.needs_input_grad[1] else None
        return grad[1:, :, :, :d], fill, None, None, None


def sink_operands(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, offset: torch.Tensor | None,
                  softmax_type: str, scale: float, cuda: bool | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """megatron's [s, b, n, d] query / key / value -> SDPA's [b, n, s + 1, d'] operands with the sink (module
    docstring): strided views of [s + 1, b, n, d'] buffers, so that the output comes back in [s + 1, b, n, d']
    order (the CPU kernel follows the query's strides) and dropping its row 0 is free.

    Widths: q and k d + the offset channels (`cuda`, by default where the tensors are: rounded up to a multiple of
    8); v the same where its head dim is q's, and on a CPU (whose flash kernel takes one head dim), else
    (multi-latent attention on CUDA: the memory-efficient kernel takes two) its own."""
    dq, dv = query.size(-1), value.size(-1)
    extra = offset_channels(softmax_type, query.dtype, None if offset is None else offset.dtype, scale)
    cuda = query.device.type == "cuda" if cuda is None else cuda
    width, v_width = sink_widths(dq, dv, extra, cuda)
    # every position's q carries c_h, the dummy query's too (its row is dropped)
    pieces = _offset_pieces(offset, scale, query.dtype, extra) if extra else None
    q = _SinkOperand.apply(query, pieces, width, extra, False)
    k = _SinkOperand.apply(key, None, width, extra, True)
    v = _SinkOperand.apply(value, None, v_width, 0, False)
    return tuple(t.permute(1, 2, 0, 3) for t in (q, k, v))
