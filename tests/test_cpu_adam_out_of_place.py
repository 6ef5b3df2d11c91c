"""The CPU Adam kernel out of place (param_out / exp_avg_out / exp_avg_sq_out) == in place, bit for bit.

--overlap-cpu-step keeps the old optimizer state by reading it from one set of buffers and writing
the new one into another (docs/overlap.md), so the out-of-place call must give exactly the bits of
the in-place call on every code path (avx512 with and without AVX512_BF16 conversions where the CPU
has them, avx2, scalar, torch fallback), for every dtype combination the kernel takes, and touch
nothing outside the segments: not in the inputs (only read) and not in the out buffers (prefilled
with random bits here, NaNs included). Two steps ping-pong between the buffers, as the engine does.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.seeds import fresh_seed
from tests.test_cpu_adam import GRAD_DTYPES, PATHS, assert_same_bits, random_segments, segment_mask, use_path
from zo_megatron.offload import cpu_adam as ca

STATE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
HP = dict(beta1=0.9, beta2=0.999, eps=1e-8)


def _out_modes(gdtype):
    """The 16-bit parameter outputs the kernel takes with this gradient dtype."""
    return ["none", "bf16", "fp16"] + (["alias"] if gdtype != "fp32" else [])


def _garbage(rng, n, dtype):
    """Random bits of `dtype` (NaNs and infinities included): what an unused alternate buffer holds."""
    width = torch.int32 if dtype == torch.float32 else torch.int16
    info = torch.iinfo(width)
    return torch.from_numpy(rng.integers(info.min, info.max, size=n, endpoint=True)).to(width).view(dtype)


def _state(rng, n, sdtype, warm):
    p = torch.from_numpy(rng.standard_normal(n).astype(np.float32))
    if warm:
        m = torch.from_numpy((rng.standard_normal(n) * 0.3).astype(np.float32))
        v = torch.from_numpy((rng.random(n) * 2.0 + 1e-3).astype(np.float32))
    else:
        m, v = torch.zeros(n), torch.zeros(n)
    return [p, m.to(sdtype), v.to(sdtype)]


@pytest.mark.parametrize("sdtype", list(STATE_DTYPES))
@pytest.mark.parametrize("gdtype", list(GRAD_DTYPES))
def test_segments_out_of_place_equals_in_place(gdtype, sdtype):
    rng = np.random.default_rng(fresh_seed(f"out of place segments {gdtype} {sdtype}"))
    state_dtype = STATE_DTYPES[sdtype]
    # > kMinParallel elements in total (chunked, several threads) with odd segment lengths: every
    # segment has a vector body and a scalar tail (1..99-element ones often only a tail)
    segs, n = random_segments(rng, 40, 2, lambda r: float(r.choice((0.0, 0.1, 0.05))))
    gaps = torch.from_numpy(~segment_mask(segs, n))
    step0 = int(rng.choice((1, 1000)))
    grads = [torch.from_numpy((rng.standard_normal(n) * 1024).astype(np.float32)).to(GRAD_DTYPES[gdtype])
             for _ in range(2)]
    for g in grads:
        g[gaps] = float("nan")                     # never read: a read would spread NaN
    init = _state(rng, n, state_dtype, warm=step0 > 1)
    other_init = [_garbage(rng, n, t.dtype) for t in init]
    for out_mode in _out_modes(gdtype):
        adamw = bool(rng.integers(2))
        kw = dict(lr=2e-3, adamw=adamw, bias_correction=bool(rng.integers(2)), grad_scale=0.8 / 1024, **HP)
        for path in PATHS:
            where = f"[{path} grad {gdtype} states {sdtype} out16 {out_mode} adamw={adamw}]"

            def out16_buffer(gbuf):
                if out_mode == "alias":
                    return gbuf
                return None if out_mode == "none" else torch.full((n,), 7.0, dtype=GRAD_DTYPES[out_mode])

            ref = [t.clone() for t in init]
            ref_g = torch.empty(n, dtype=grads[0].dtype)
            ref_o = out16_buffer(ref_g)
            live, spare = [t.clone() for t in init], [t.clone() for t in other_init]
            g_buf = torch.empty(n, dtype=grads[0].dtype)
            o_buf = out16_buffer(g_buf)
            with use_path(path):
                for k, g in enumerate(grads):
                    ref_g.copy_(g)
                    g_buf.copy_(g)
                    ca.adam_step_segments(*ref[:1], ref_g, *ref[1:], segs, step=step0 + k, param16_out=ref_o, **kw)
                    before_live = [t.clone() for t in live]
                    before_spare = [t.clone() for t in spare]
                    ca.adam_step_segments(live[0], g_buf, live[1], live[2], segs, step=step0 + k, param16_out=o_buf,
                                          param_out=spare[0], exp_avg_out=spare[1], exp_avg_sq_out=spare[2], **kw)
                    for name, r, new, old, was in zip(("param", "exp_avg", "exp_avg_sq"), ref, spare, live,
                                                      before_spare):
                        assert_same_bits(f"{where} step {k} {name} out of place vs in place", new[~gaps], r[~gaps])
                        assert_same_bits(f"{where} step {k} {name}_out outside the segments", new[gaps], was[gaps])
                    for name, old, was in zip(("param", "exp_avg", "exp_avg_sq"), live, before_live):
                        assert_same_bits(f"{where} step {k} {name} (input, only read)", old, was)
                    if o_buf is not None:
                        assert_same_bits(f"{where} step {k} param16_out", o_buf, ref_o)
                    if o_buf is not g_buf:
                        assert_same_bits(f"{where} step {k} grad (only read)", g_buf, g)
                    live, spare = spare, live          # the next step reads what this one wrote


@pytest.mark.parametrize("path", PATHS)
def test_adam_step_out_of_place_equals_in_place(path):
    """adam_step (one range) on odd sizes: the vector body, the scalar / masked tail and a threaded
    size, each output given alone (the others in place) and all three together."""
    rng = np.random.default_rng(fresh_seed(f"out of place adam_step {path}"))
    for n in (1, 7, 33, 1000, 40001):
        for gdtype in GRAD_DTYPES:
            sdtype = STATE_DTYPES[str(rng.choice(list(STATE_DTYPES)))]
            init = _state(rng, n, sdtype, warm=True)
            g = torch.from_numpy((rng.standard_normal(n) * 1024).astype(np.float32)).to(GRAD_DTYPES[gdtype])
            kw = dict(step=5, lr=1e-3, weight_decay=0.1, adamw=bool(rng.integers(2)), grad_scale=1 / 1024, **HP)
            ref = [t.clone() for t in init]
            ref_o = torch.empty(n, dtype=torch.bfloat16)
            with use_path(path):
                ca.adam_step(ref[0], g, ref[1], ref[2], param16_out=ref_o, **kw)
                for which in ((0,), (1,), (2,), (0, 1, 2)):
                    src = [t.clone() for t in init]
                    outs = [_garbage(rng, n, t.dtype) if i in which else None for i, t in enumerate(init)]
                    o = torch.empty(n, dtype=torch.bfloat16)
                    ca.adam_step(src[0], g, src[1], src[2], param16_out=o, param_out=outs[0], exp_avg_out=outs[1],
                                 exp_avg_sq_out=outs[2], **kw)
                    where = f"[{path} n={n} grad {gdtype} states {sdtype} outs {which}]"
                    for i, name in enumerate(("param", "exp_avg", "exp_avg_sq")):
                        got = outs[i] if i in which else src[i]
                        assert_same_bits(f"{where} {name}", got, ref[i])
                        if i in which:
                            assert_same_bits(f"{where} {name} input (only read)", src[i], init[i])
                    assert_same_bits(f"{where} param16_out", o, ref_o)


def test_out_buffers_are_checked():
    n = 64
    p, g, m, v = torch.zeros(n), torch.zeros(n), torch.zeros(n), torch.zeros(n)
    kw = dict(step=1, lr=1e-3, **HP)
    with pytest.raises(ValueError, match="param_out: dtype bfloat16 is not supported"):
        ca.adam_step(p, g, m, v, param_out=torch.zeros(n, dtype=torch.bfloat16), **kw)
    with pytest.raises(ValueError, match="exp_avg_out: has 63 elements but param has 64"):
        ca.adam_step(p, g, m, v, exp_avg_out=torch.zeros(n - 1), **kw)
    with pytest.raises(ValueError, match="exp_avg_sq_out: dtype bfloat16 is not supported"):
        ca.adam_step(p, g, m, v, exp_avg_sq_out=torch.zeros(n, dtype=torch.bfloat16), **kw)
    big = torch.zeros(2 * n)
    with pytest.raises(ValueError, match="overlap in memory"):             # out overlapping another out
        ca.adam_step(p, g, m, v, param_out=big[:n], exp_avg_out=big[n // 2:n // 2 + n], **kw)
    with pytest.raises(ValueError, match="overlap in memory"):             # out overlapping another input
        ca.adam_step_segments(p, g, m, v, [(0, n, 0.0)], param_out=m, **kw)
    with pytest.raises(ValueError, match="overlap in memory"):
        ca.adam_step(p, g, m, v, exp_avg_out=g, **kw)
    ca.adam_step(p, g, m, v, param_out=p, exp_avg_out=m, exp_avg_sq_out=v, **kw)   # its own input: in place
