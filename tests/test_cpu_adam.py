"""CPU Adam kernel (zo_megatron._cpu_adam via zo_megatron.offload.cpu_adam) vs a float64 reference.

Every code path this machine has is checked: avx512 (with and without AVX512_BF16 conversions),
avx2, scalar, and the torch fallback. Metrics, per tensor (param, exp_avg, exp_avg_sq):

  S_i  = the element's own magnitude scale from the same float64 run (S_i >= |ref_i|): |v_i| for
         exp_avg_sq; the exp_avg recurrence run on |g| (no cancellation) for exp_avg;
         max_k |param_k,i| + sum_k |update_k,i| for param.
  rel  = max_i |ours_i - ref_i| / max_i S_i, and also / max_i |ref_i| when the tensor has >= 1000
         elements (for a handful of elements max|ref| can be tiny through cancellation).
         fp32 states: <= 1e-6.
  elem : |ours_i - ref_i| <= tol * S_i for EVERY element i. fp32 states: tol = 2e-6 (~17 ulps).
  bf16 states (reference rounds its states to bf16 after every step, as the kernel stores them):
         exp_avg / exp_avg_sq: elem tol 2^-6 (4 bf16 ulps); param: rel <= 5e-5, elem tol 4e-3.
  16-bit param copy: bit-exact vs torch's .to(bfloat16 / float16) of our fp32 param (RNE).
"""
from __future__ import annotations

import contextlib
import json
import os
import random
import subprocess
import sys
import warnings
import zlib

import numpy as np
import pytest
import torch

from zo_megatron.errors import UserError
from zo_megatron.offload import cpu_adam as ca

EXT = ca._ext

# --------------------------------------------------------------------------------------------
# Code paths
# --------------------------------------------------------------------------------------------
PATHS: list[str] = []
if EXT is not None:
    for _isa in ca._available_isas():
        if _isa == "avx512" and EXT.has_avx512_bf16():
            PATHS.append("avx512-bf16hw")
        PATHS.append(_isa)
PATHS.append("torch-fallback")


@contextlib.contextmanager
def use_path(path: str, threads: int | None = None):
    old_threads = ca.get_num_threads()
    old_fallback = ca._use_fallback
    old_isa = EXT.get_isa() if EXT is not None else None
    old_hw = EXT._get_avx512_bf16() if EXT is not None else None
    try:
        if path == "torch-fallback":
            ca._set_isa("torch-fallback")
        else:
            ca._set_isa("avx512" if path.startswith("avx512") else path)
            if path.startswith("avx512"):
                EXT._set_avx512_bf16(path == "avx512-bf16hw")
        if threads is not None:
            ca.set_num_threads(threads)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # the fallback's one-time warning
            yield
    finally:
        ca._use_fallback = old_fallback
        if EXT is not None:
            EXT.set_isa(old_isa)
            EXT._set_avx512_bf16(old_hw)
        ca.set_num_threads(old_threads)


def seed_of(*key) -> int:
    return zlib.crc32(repr(key).encode())


# --------------------------------------------------------------------------------------------
# float64 reference
# --------------------------------------------------------------------------------------------
def to_bf16_f64(x: np.ndarray) -> np.ndarray:
    return torch.from_numpy(np.asarray(x, dtype=np.float32)).to(torch.bfloat16).double().numpy()


def reference(p, grads, m, v, *, step0, lr, beta1, beta2, eps, wd, adamw, bias_correction, grad_scale,
              bf16_states=False):
    """Adam/AdamW in float64 (torch.optim semantics). Returns (p, m, v, S_p, S_m)."""
    p, m, v = p.astype(np.float64), m.astype(np.float64), v.astype(np.float64)
    s_m, s_p = np.abs(m), np.abs(p)
    with np.errstate(all="ignore"):
        for k, g in enumerate(grads):
            step = step0 + k
            g = g.astype(np.float64) * grad_scale
            if wd:
                if adamw:
                    p = p * (1.0 - lr * wd)
                else:
                    g = g + wd * p
            m = beta1 * m + (1.0 - beta1) * g
            v = beta2 * v + (1.0 - beta2) * g * g
            s_m = beta1 * s_m + (1.0 - beta1) * np.abs(g)
            bc1 = 1.0 - beta1 ** step if bias_correction else 1.0
            bc2 = 1.0 - beta2 ** step if bias_correction else 1.0
            denom = np.sqrt(v) / np.sqrt(bc2) + eps
            upd = (lr / bc1) * m / denom
            p = p - upd
            # the update's scale is that of its terms, not of its result: m = b1 m + (1 - b1) g can
            # cancel to near zero (its fp32 error stays ~ulp(b1 |m_old|)); |upd| alone failed the
            # element check on seed 1154585971 (fp16 grads, L2, step 10000: 3.3e-6 x scale, one element)
            s_p = np.maximum(s_p, np.abs(p)) + (lr / bc1) * s_m / denom
            if bf16_states:
                m, v = to_bf16_f64(m), to_bf16_f64(v)
    return p, m, v, s_p, s_m


def check_close(name, ours, ref, scale, *, rel_tol, elem_tol):
    ours = np.asarray(ours, dtype=np.float64)
    d = np.abs(ours - ref)
    rel = d.max() / max(scale.max(), 1e-30)
    assert rel <= rel_tol, f"{name}: max|ours-ref|/max(S) = {rel:.3e} > {rel_tol:.1e}"
    if ref.size >= 1000:  # large enough for max|ref| to be a meaningful normaliser too
        rel = d.max() / max(np.abs(ref).max(), 1e-30)
        assert rel <= rel_tol, f"{name}: max|ours-ref|/max|ref| = {rel:.3e} > {rel_tol:.1e}"
    bad = d > elem_tol * scale
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise AssertionError(f"{name}: {int(bad.sum())} elements exceed {elem_tol:.1e} * scale; first i={i}: "
                             f"ours={ours[i]!r} ref={ref[i]!r} scale={scale[i]!r}")


def assert_bits_equal(name, a: torch.Tensor, b: torch.Tensor):
    """Bit-exact, except that any NaN equals any NaN (torch's own NaN bits differ between its
    scalar and vector conversions: 0x7FC0 vs 0xFFFF)."""
    nan_a, nan_b = torch.isnan(a), torch.isnan(b)
    assert torch.equal(nan_a, nan_b), f"{name}: NaN positions differ"
    ai, bi = a.view(torch.int16).masked_fill(nan_a, 0), b.view(torch.int16).masked_fill(nan_b, 0)
    if not torch.equal(ai, bi):
        i = int(torch.nonzero(ai != bi)[0])
        raise AssertionError(f"{name}: 16-bit copy differs at {i}: {int(ai[i]) & 0xFFFF:#06x} vs "
                             f"{int(bi[i]) & 0xFFFF:#06x} (fp32 {a.float()[i].item()!r})")


GRAD_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
MODES = {  # name: (weight_decay, adamw, bias_correction, lr)
    "nowd": (0.0, True, True, 1e-3),
    "adamw": (0.1, True, True, 1e-3),
    "adam_l2": (0.05, False, True, 2e-3),
    "adamw_nobc": (0.1, True, False, 1e-2),
}
HP = dict(beta1=0.9, beta2=0.999, eps=1e-8)
LOSS_SCALE = 1024.0
GRAD_SCALE = 0.8 / LOSS_SCALE  # clip_coef / loss_scale


def make_problem(n, gdtype, step0, seed, n_steps=10, bf16_states=False):
    rng = np.random.default_rng(seed)
    p0 = rng.standard_normal(n).astype(np.float32)
    if step0 == 1:
        m0, v0 = np.zeros(n, np.float32), np.zeros(n, np.float32)
    else:  # a warm optimizer state
        m0 = (rng.standard_normal(n) * 0.3).astype(np.float32)
        v0 = (rng.random(n) * 2.0 + 1e-3).astype(np.float32)
    if bf16_states:
        m0, v0 = to_bf16_f64(m0).astype(np.float32), to_bf16_f64(v0).astype(np.float32)
    grads = []  # loss-scaled grads as the engine hands them over, already in their 16-bit dtype
    for _ in range(n_steps):
        g = torch.from_numpy((rng.standard_normal(n) * LOSS_SCALE).astype(np.float32)).to(GRAD_DTYPES[gdtype])
        grads.append(g)
    return p0, m0, v0, grads


def run_ours(p0, m0, v0, grads, *, step0, mode, out_mode, state_dtype=torch.float32):
    """Runs our adam_step over all grads; checks the 16-bit copy bit-exactly after every step."""
    wd, adamw, bc, lr = MODES[mode]
    n = p0.size
    p = torch.from_numpy(p0.copy())
    m = torch.from_numpy(m0.copy()).to(state_dtype)
    v = torch.from_numpy(v0.copy()).to(state_dtype)
    gdtype = grads[0].dtype
    if out_mode == "alias":
        gbuf = torch.empty(n, dtype=gdtype)
        out = gbuf
    else:
        gbuf = None
        out = None if out_mode == "none" else torch.full((n,), 7.0, dtype=GRAD_DTYPES[out_mode])
    for k, g in enumerate(grads):
        if gbuf is not None:
            gbuf.copy_(g)  # the engine's reused host buffer: grad in, 16-bit param out
            g = gbuf
        ca.adam_step(p, g, m, v, step=step0 + k, lr=lr, weight_decay=wd, adamw=adamw, bias_correction=bc,
                     grad_scale=GRAD_SCALE, param16_out=out, **HP)
        if out is not None:
            assert_bits_equal(f"param16_out step {step0 + k}", out, p.to(out.dtype))
    return p, m, v


def ref_for(p0, m0, v0, grads, *, step0, mode, bf16_states=False):
    wd, adamw, bc, lr = MODES[mode]
    g64 = [g.double().numpy() for g in grads]
    return reference(p0, g64, m0, v0, step0=step0, lr=lr, wd=wd, adamw=adamw, bias_correction=bc,
                     grad_scale=GRAD_SCALE, bf16_states=bf16_states, **HP)


def check_fp32_result(where, ours, ref):
    p, m, v = ours
    rp, rm, rv, sp, sm = ref
    check_close(f"{where} param", p.numpy(), rp, sp, rel_tol=1e-6, elem_tol=2e-6)
    check_close(f"{where} exp_avg", m.numpy(), rm, sm, rel_tol=1e-6, elem_tol=2e-6)
    check_close(f"{where} exp_avg_sq", v.numpy(), rv, np.abs(rv), rel_tol=1e-6, elem_tol=2e-6)


# --------------------------------------------------------------------------------------------
# Adam / AdamW vs reference, fp32 states
# --------------------------------------------------------------------------------------------
SMALL_SIZES = [1, 7, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 129] + \
    [int(x) for x in np.random.default_rng(20240601).integers(2, 5000, size=3)]


def out_modes_for(gdtype):
    return ["none", "bf16", "fp16"] + (["alias"] if gdtype != "fp32" else [])


@pytest.mark.parametrize("step0", [1, 10000])
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("gdtype", list(GRAD_DTYPES))
def test_small_sizes_all_paths(gdtype, mode, step0):
    for n in SMALL_SIZES:
        for out_mode in out_modes_for(gdtype):
            p0, m0, v0, grads = make_problem(n, gdtype, step0, seed_of(n, gdtype, mode, step0, out_mode))
            ref = ref_for(p0, m0, v0, grads, step0=step0, mode=mode)
            for path in PATHS:
                with use_path(path):
                    ours = run_ours(p0, m0, v0, grads, step0=step0, mode=mode, out_mode=out_mode)
                check_fp32_result(f"[{path} n={n} out={out_mode}]", ours, ref)


LARGE_N = 1000003
LARGE_CASES = [  # (grad dtype, mode, step0, out_mode): every grad dtype x mode; steps and outputs mixed
    ("fp32", "nowd", 1, "none"), ("fp32", "adamw", 10000, "bf16"), ("fp32", "adam_l2", 1, "fp16"),
    ("fp32", "adamw_nobc", 10000, "bf16"),
    ("bf16", "nowd", 10000, "alias"), ("bf16", "adamw", 1, "alias"), ("bf16", "adam_l2", 10000, "none"),
    ("bf16", "adamw_nobc", 1, "fp16"),
    ("fp16", "nowd", 1, "alias"), ("fp16", "adamw", 10000, "alias"), ("fp16", "adam_l2", 1, "bf16"),
    ("fp16", "adamw_nobc", 10000, "alias"),
]


@pytest.mark.parametrize("gdtype,mode,step0,out_mode", LARGE_CASES)
def test_large_all_paths(gdtype, mode, step0, out_mode):
    p0, m0, v0, grads = make_problem(LARGE_N, gdtype, step0, seed_of("large", gdtype, mode, step0))
    ref = ref_for(p0, m0, v0, grads, step0=step0, mode=mode)
    for path in PATHS:
        with use_path(path):
            ours = run_ours(p0, m0, v0, grads, step0=step0, mode=mode, out_mode=out_mode)
        check_fp32_result(f"[{path} n={LARGE_N}]", ours, ref)


# --------------------------------------------------------------------------------------------
# bf16 optimizer states
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("gdtype,mode,step0", [("fp32", "adamw", 1), ("bf16", "adamw", 10000),
                                               ("fp16", "adam_l2", 1), ("bf16", "nowd", 1)])
def test_bf16_states_vs_reference(gdtype, mode, step0):
    for n in (1, 17, 33, 100003):
        p0, m0, v0, grads = make_problem(n, gdtype, step0, seed_of("bf16st", n, gdtype, mode), bf16_states=True)
        rp, rm, rv, sp, sm = ref_for(p0, m0, v0, grads, step0=step0, mode=mode, bf16_states=True)
        out_mode = "alias" if gdtype != "fp32" else "bf16"
        for path in PATHS:
            with use_path(path):
                p, m, v = run_ours(p0, m0, v0, grads, step0=step0, mode=mode, out_mode=out_mode,
                                   state_dtype=torch.bfloat16)
            assert m.dtype == v.dtype == torch.bfloat16
            where = f"[{path} n={n}]"
            check_close(f"{where} param", p.numpy(), rp, sp, rel_tol=5e-5, elem_tol=4e-3)
            check_close(f"{where} exp_avg", m.double().numpy(), rm, sm, rel_tol=2 ** -6, elem_tol=2 ** -6)
            check_close(f"{where} exp_avg_sq", v.double().numpy(), rv, np.abs(rv), rel_tol=2 ** -6,
                        elem_tol=2 ** -6)


def random_finite_f32(n, seed, max_exp=254):
    """fp32 values with uniformly random bit patterns (all exponents incl. denormals, both signs)."""
    rng = np.random.default_rng(seed)
    bits = rng.integers(0, 2 ** 32, size=n, dtype=np.uint64).astype(np.uint32)
    exp = (bits >> 23) & 0xFF
    bits = np.where(exp > max_exp, bits & ~np.uint32(0x40000000), bits)  # fold inf/NaN/too big down
    return bits.view(np.float32)


def special_f32():
    vals = [0.0, -0.0, 1.0, -1.0, 1e-45, -1e-45, 1e-39, -1e-39, 1.1754942e-38, 1.1754944e-38, 3.4028235e38,
            -3.4028235e38, 65504.0, 65519.996, 65520.0, -65520.0, 6.1035156e-05, 6.0975552e-05, 5.9604645e-08,
            2.9802322e-08, 2.9802326e-08, 1e-8, np.inf, -np.inf]
    ties = []
    for hi in (0x3F80, 0x3F81, 0xBF80, 0xBF81, 0x0000, 0x0001, 0x7F7F, 0x0080, 0x8001):  # bf16 ties, even/odd
        ties += [(hi << 16) | 0x8000, (hi << 16) | 0x7FFF, (hi << 16) | 0x8001]
    for h in (0x3C00, 0x3C01, 0x0001, 0x0002, 0x03FF, 0x0400, 0x7BFF):  # fp16 ties (normal and subnormal)
        f = np.array([h], np.uint16).view(np.float16).astype(np.float32)
        f_next = np.array([h + 1], np.uint16).view(np.float16).astype(np.float32)
        ties.append(((f.astype(np.float64) + f_next.astype(np.float64)) / 2).astype(np.float32).view(np.uint32)[0])
    return np.concatenate([np.array(vals, np.float32), np.array(ties, np.uint32).view(np.float32)])


@pytest.mark.parametrize("path", PATHS)
def test_16bit_conversions_bit_exact(path):
    """lr=0, wd=0 leaves the param unchanged, so param16_out isolates fp32 -> 16-bit RNE; with
    beta1=beta2=0 and grad_scale=1 the bf16 states store exactly rne(g) and rne(g*g)."""
    x = np.concatenate([special_f32(), random_finite_f32(200003, 1)])
    n = x.size
    p = torch.from_numpy(x.copy())
    with use_path(path):
        for odt in (torch.bfloat16, torch.float16):
            out = torch.zeros(n, dtype=odt)
            ca.adam_step(p, torch.zeros(n), torch.zeros(n), torch.zeros(n), step=1, lr=0.0, beta1=0.9,
                         beta2=0.999, eps=1e-8, param16_out=out)
            assert torch.equal(p.view(torch.int32), torch.from_numpy(x).view(torch.int32)), "param changed"
            assert_bits_equal(f"{path} {odt}", out, p.to(odt))
        # bf16 state stores: m = g, v = g*g (in fp32), both RNE-rounded on store
        g = torch.from_numpy(random_finite_f32(100003, 2, max_exp=190))  # keep g*g finite
        sp = special_f32()
        g = torch.cat([g, torch.from_numpy(sp[np.isfinite(sp)])])
        m16 = torch.zeros(g.numel(), dtype=torch.bfloat16)
        v16 = torch.zeros(g.numel(), dtype=torch.bfloat16)
        ca.adam_step(torch.zeros(g.numel()), g, m16, v16, step=1, lr=0.0, beta1=0.0, beta2=0.0, eps=1e-8)
        # m = 0 * m + 1 * g: IEEE turns a -0 grad into +0, hence the "+ 0.0" on the expected side
        # (torch's lerp, used by the fallback, keeps -0: compare zeros without their sign there)
        m_ref = (g + 0.0).to(torch.bfloat16)
        if path == "torch-fallback":
            m16, m_ref = (m16.float() + 0.0).to(torch.bfloat16), (m_ref.float() + 0.0).to(torch.bfloat16)
        assert_bits_equal(f"{path} bf16 exp_avg", m16, m_ref)
        assert_bits_equal(f"{path} bf16 exp_avg_sq", v16, (g * g).to(torch.bfloat16))


def test_grad_inputs_read_exactly():
    """bf16 / fp16 grads (all bit patterns incl. subnormals) are widened exactly: beta1=0, gs=1 -> m == g."""
    h = torch.arange(0, 2 ** 16, dtype=torch.int32).to(torch.int16)
    for dt in (torch.bfloat16, torch.float16):
        g = h.view(dt)
        g = g[torch.isfinite(g.float())].contiguous()
        n = g.numel()
        for path in PATHS:
            with use_path(path):
                m = torch.zeros(n)
                ca.adam_step(torch.zeros(n), g, m, torch.zeros(n), step=1, lr=0.0, beta1=0.0, beta2=0.5, eps=1e-8)
            assert torch.equal((m + 0.0).view(torch.int32), (g.float() + 0.0).view(torch.int32)), f"{path} {dt}"


# --------------------------------------------------------------------------------------------
# Aliasing, threads, non-finite grads
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("gdtype", ["bf16", "fp16"])
def test_alias_equals_separate_buffers(gdtype):
    for n in (1, 15, 16, 17, 47, 64, 65, 1000, 70001):
        p0, m0, v0, grads = make_problem(n, gdtype, 1, seed_of("alias", n, gdtype), n_steps=3)
        for path in PATHS:
            with use_path(path):
                a = run_ours(p0, m0, v0, grads, step0=1, mode="adamw", out_mode="alias")
                b = run_ours(p0, m0, v0, grads, step0=1, mode="adamw", out_mode=gdtype)
            for x, y, name in zip(a, b, ("param", "exp_avg", "exp_avg_sq")):
                assert torch.equal(x, y), f"{path} n={n}: {name} differs between aliased and separate out16"


@pytest.mark.skipif(EXT is None, reason="extension not built")
def test_threads_and_schedule_bitwise_identical():
    """Adam is elementwise and grad_sumsq adds per-block partials in block order: both must be
    bit-identical for any thread count and for the static / dynamic work partition."""
    n = 300007
    p0, m0, v0, grads = make_problem(n, "bf16", 10000, seed_of("threads"), n_steps=2)
    old_block = EXT._get_block()
    try:
        for path in [p for p in PATHS if p != "torch-fallback"]:
            res, sums = [], []
            for block, threads in ((old_block, 1), (old_block, 2), (old_block, 3), (0, 2)):
                EXT._set_block(block)
                with use_path(path, threads=threads):
                    res.append(run_ours(p0, m0, v0, grads, step0=10000, mode="adamw", out_mode="alias"))
                    sums.append(ca.grad_sumsq_and_finite(grads[0])[0])
            for r in res[1:]:
                for x, y in zip(res[0], r):
                    assert torch.equal(x, y), f"{path}: Adam result depends on threads / schedule"
            assert sums[0] == sums[1] == sums[2], f"{path}: grad sumsq depends on the thread count"
            assert abs(sums[3] - sums[0]) <= 1e-12 * sums[0]
    finally:
        EXT._set_block(old_block)


@pytest.mark.parametrize("gdtype", list(GRAD_DTYPES))
def test_nonfinite_grads_propagate_like_reference(gdtype):
    n = 1037
    rng = np.random.default_rng(seed_of("nonfinite", gdtype))
    p0 = rng.standard_normal(n).astype(np.float32)
    g = (rng.standard_normal(n) * LOSS_SCALE).astype(np.float32)
    bad = {3: np.inf, 100: -np.inf, 517: np.nan, 1024: np.inf, n - 1: np.nan}
    for i, x in bad.items():
        g[i] = x
    gt = torch.from_numpy(g).to(GRAD_DTYPES[gdtype])
    grads = [gt, torch.from_numpy((rng.standard_normal(n) * LOSS_SCALE).astype(np.float32)).to(gt.dtype)]
    z = np.zeros(n, np.float32)
    rp, rm, rv, _, _ = ref_for(p0, z, z, grads, step0=1, mode="adamw")
    assert np.isnan(rp[list(bad)]).all()  # reference: inf/inf or NaN -> NaN param
    for path in PATHS:
        with use_path(path):
            p, m, v = run_ours(p0, z, z, grads, step0=1, mode="adamw",
                               out_mode="alias" if gdtype != "fp32" else "bf16")
        for name, ours, ref in (("param", p, rp), ("exp_avg", m, rm), ("exp_avg_sq", v, rv)):
            o = ours.double().numpy()
            if path == "torch-fallback" and name != "param":
                # torch's lerp turns an inf exp_avg into NaN on the next step (inf + w*(g - inf));
                # the kernel keeps inf like the reference formula. Both stay non-finite.
                assert np.array_equal(np.isfinite(o), np.isfinite(ref)), f"{path} {name}: non-finite pattern"
                fin = np.isfinite(ref)
                assert np.allclose(o[fin], ref[fin], rtol=2e-6, atol=1e-6), f"{path} {name}: finite part differs"
                continue
            assert np.array_equal(np.isnan(o), np.isnan(ref)), f"{path} {name}: NaN pattern differs"
            assert np.array_equal(np.isposinf(o), np.isposinf(ref)), f"{path} {name}: +inf pattern differs"
            assert np.array_equal(np.isneginf(o), np.isneginf(ref)), f"{path} {name}: -inf pattern differs"
            fin = np.isfinite(ref)
            assert np.allclose(o[fin], ref[fin], rtol=2e-6, atol=1e-6), f"{path} {name}: finite part differs"


# --------------------------------------------------------------------------------------------
# grad_sumsq_and_finite
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("gdtype", list(GRAD_DTYPES))
def test_grad_sumsq_and_finite(gdtype):
    dt = GRAD_DTYPES[gdtype]
    for n in (0, 1, 15, 16, 17, 65, 1000, 1000003):
        rng = np.random.default_rng(seed_of("sumsq", gdtype, n))
        g = torch.from_numpy((rng.standard_normal(n) * 100).astype(np.float32)).to(dt)
        ref = float(np.sum(np.square(g.double().numpy()))) if n else 0.0
        for path in PATHS:
            with use_path(path):
                s, finite = ca.grad_sumsq_and_finite(g)
            assert isinstance(s, float) and finite is True
            assert abs(s - ref) <= 1e-12 * max(ref, 1e-300), f"{path} n={n}: {s} vs {ref}"
        if n >= 16:
            for pos in (0, n // 2, n - 1):  # head, body, masked tail
                for bad in (np.inf, -np.inf, np.nan):
                    gb = g.clone()
                    gb[pos] = bad
                    for path in PATHS:
                        with use_path(path):
                            s, finite = ca.grad_sumsq_and_finite(gb)
                        assert finite is False, f"{path} n={n} pos={pos} value={bad}"
    # largest finite values: the fp64 accumulator must not overflow
    big = torch.full((4099,), 65504.0 if dt == torch.float16 else 3.0e38).to(dt)
    for path in PATHS:
        with use_path(path):
            s, finite = ca.grad_sumsq_and_finite(big)
        assert finite is True and np.isfinite(s), path


# --------------------------------------------------------------------------------------------
# Validation, fallback, configuration
# --------------------------------------------------------------------------------------------
def _args(n=64, **over):
    a = dict(param=torch.zeros(n), grad=torch.zeros(n), exp_avg=torch.zeros(n), exp_avg_sq=torch.zeros(n))
    a.update(over)
    return a


def _call(a, **kw):
    ca.adam_step(a["param"], a["grad"], a["exp_avg"], a["exp_avg_sq"], step=kw.pop("step", 1), lr=1e-3,
                 beta1=0.9, beta2=0.999, eps=1e-8, param16_out=a.get("param16_out"), **kw)


@pytest.mark.parametrize("name", ["param", "grad", "exp_avg", "exp_avg_sq", "param16_out"])
def test_non_contiguous_is_an_error(name):
    dt = torch.bfloat16 if name == "param16_out" else torch.float32
    a = _args(param16_out=torch.zeros(64, dtype=torch.bfloat16))
    a[name] = torch.zeros(128, dtype=dt)[::2]
    before = {k: v.clone() for k, v in a.items()}
    with pytest.raises(ValueError, match=rf"^{name}: must be contiguous"):
        _call(a)
    for k, v in a.items():  # nothing was touched
        assert torch.equal(v, before[k])


def test_bad_inputs_are_errors():
    with pytest.raises(ValueError, match="grad: has 63 elements"):
        _call(_args(grad=torch.zeros(63)))
    with pytest.raises(ValueError, match="param: dtype bfloat16 is not supported"):
        _call(_args(param=torch.zeros(64, dtype=torch.bfloat16)))
    with pytest.raises(ValueError, match="exp_avg_sq: dtype float16"):
        _call(_args(exp_avg_sq=torch.zeros(64, dtype=torch.float16)))
    with pytest.raises(ValueError, match="same dtype"):
        _call(_args(exp_avg_sq=torch.zeros(64, dtype=torch.bfloat16)))
    with pytest.raises(ValueError, match="param16_out: dtype float32"):
        _call(_args(param16_out=torch.zeros(64)))
    with pytest.raises(ValueError, match="grad: expected a torch.Tensor"):
        _call(_args(grad=np.zeros(64, np.float32)))
    with pytest.raises(ValueError, match="step must be a 1-based integer"):
        _call(_args(), step=0)
    buf = torch.zeros(128)
    with pytest.raises(ValueError, match="overlap"):
        _call(_args(param=buf[:64], exp_avg=buf[32:96]))
    with pytest.raises(ValueError, match="overlap"):  # an fp32 grad cannot be the 16-bit output
        g = torch.zeros(64)
        _call(_args(grad=g, param16_out=g.view(torch.bfloat16)[:64]))
    g16 = torch.zeros(64, dtype=torch.bfloat16)
    _call(_args(grad=g16, param16_out=g16))  # the one allowed alias
    _call(_args(n=0))  # empty is a no-op


def test_fallback_when_extension_missing_warns_once(monkeypatch):
    monkeypatch.setattr(ca, "_ext", None)
    monkeypatch.setattr(ca, "_EXT_ERROR", "ImportError: simulated")
    monkeypatch.setattr(ca, "_fallback_warned", False)
    d = ca.info()
    assert d["extension"] is False and d["isa"] == "torch-fallback" and d["available_isas"] == []
    n = 1000
    p0, m0, v0, grads = make_problem(n, "bf16", 1, seed_of("fallback-missing"), n_steps=3)
    ref = ref_for(p0, m0, v0, grads, step0=1, mode="adam_l2")
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        ours = run_ours(p0, m0, v0, grads, step0=1, mode="adam_l2", out_mode="alias")
        ca.grad_sumsq_and_finite(grads[0])
    assert len([w for w in rec if "torch fallback" in str(w.message)]) == 1
    check_fp32_result("[missing extension]", ours, ref)


def test_info_and_threads():
    d = ca.info()
    assert set(d) >= {"extension", "isa", "threads", "available_isas"}
    assert d["isa"] in ("avx512", "avx2", "scalar", "torch-fallback")
    old = ca.get_num_threads()
    try:
        ca.set_num_threads(3)
        assert ca.get_num_threads() == 3 and ca.info()["threads"] == 3
        if EXT is not None:
            assert EXT.get_num_threads() == 3
        with pytest.raises(ValueError):
            ca.set_num_threads(0)
    finally:
        ca.set_num_threads(old)


def _cli(env_over):
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZO_CPU_ADAM_")}
    env.update(env_over)
    return subprocess.run([sys.executable, "-m", "zo_megatron.offload.cpu_adam", "--info"], env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.skipif(EXT is None, reason="extension not built")
def test_cli_info_and_env_overrides():
    isa = "avx2" if "avx2" in ca._available_isas() else "scalar"
    r = _cli({"ZO_CPU_ADAM_ISA": isa, "ZO_CPU_ADAM_THREADS": "3"})
    assert r.returncode == 0, r.stderr
    assert f"isa:            {isa}" in r.stdout and "threads:        3" in r.stdout
    assert "available isas:" in r.stdout
    assert f"checksum:       crc32c ({EXT.crc32c_impl()})" in r.stdout   # the NVMe tier's CRC32C path
    r = _cli({"ZO_CPU_ADAM_ISA": "sse9"})
    assert r.returncode != 0 and "ZO_CPU_ADAM_ISA" in r.stderr
    if "avx512" not in ca._available_isas():
        r = _cli({"ZO_CPU_ADAM_ISA": "avx512"})
        assert r.returncode != 0 and "not available" in r.stderr


# --------------------------------------------------------------------------------------------
# Segment lists: adam_step_segments / grad_sumsq_and_finite_segments
# --------------------------------------------------------------------------------------------
def fresh_seed(tag: str) -> int:
    """A new seed every run, printed (pytest shows it with a failure); ZO_TEST_SEED=<seed> replays it."""
    seed = int(os.environ.get("ZO_TEST_SEED") or random.SystemRandom().randrange(2 ** 31))
    print(f"[seed] {tag}: seed={seed} (replay with ZO_TEST_SEED={seed})")
    return seed


def random_segments(rng, n_tiny, n_large, third):
    """((start, end, third(rng)), ...), n: n_tiny segments of 1..99 elements and n_large of 20K..60K
    in random order, with gaps of 1..69 elements before the first, after the last and before ~40%
    of the others (the rest are adjacent, as the engine's are)."""
    lens = [int(x) for x in rng.integers(1, 100, size=n_tiny)] + \
        [int(x) for x in rng.integers(20000, 60000, size=n_large)]
    rng.shuffle(lens)
    segs, x = [], int(rng.integers(1, 70))
    for k, length in enumerate(lens):
        if k and rng.random() < 0.4:
            x += int(rng.integers(1, 70))
        segs.append((x, x + length, third(rng)))
        x += length
    return segs, x + int(rng.integers(1, 70))


def segment_mask(segs, n) -> np.ndarray:
    mask = np.zeros(n, bool)
    for a, b, _ in segs:
        mask[a:b] = True
    return mask


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32 if t.element_size() == 4 else torch.int16)


def assert_same_bits(what, a: torch.Tensor, b: torch.Tensor):
    a, b = bits(a), bits(b)
    if not torch.equal(a, b):
        i = int(torch.nonzero(a != b)[0])
        raise AssertionError(f"{what}: {int((a != b).sum())} elements differ, first at {i}")


SEG_WDS = (0.0, 0.1, 0.05)
SEG_CASES = [  # (grad dtype, state dtype, out_mode, adamw, bias_correction, step0)
    ("fp32", "fp32", "none", True, True, 1),
    ("fp32", "fp32", "bf16", False, True, 10000),
    ("bf16", "fp32", "alias", True, True, 10000),
    ("bf16", "bf16", "alias", False, True, 1),
    ("fp16", "fp32", "alias", False, False, 10000),
    ("fp16", "bf16", "fp16", True, True, 10000),
]


@pytest.mark.parametrize("gdtype,sdtype,out_mode,adamw,bc,step0", SEG_CASES)
def test_adam_step_segments_equals_per_segment_calls(gdtype, sdtype, out_mode, adamw, bc, step0):
    """One adam_step_segments call == one adam_step per segment, bit for bit, on every path; gaps keep
    their bits (their grads are NaN: never read); and the float64 reference, per-element decay."""
    rng = np.random.default_rng(fresh_seed(f"segments {gdtype} {sdtype} {out_mode}"))
    state_dtype = GRAD_DTYPES[sdtype]
    bf16_states = sdtype == "bf16"
    lr, n_steps = 2e-3, 2
    layouts = [random_segments(rng, 300, 4, lambda r: float(r.choice(SEG_WDS))),  # > kMinParallel: chunked
               random_segments(rng, 60, 0, lambda r: float(r.choice(SEG_WDS)))]   # one chunk, one thread
    for segs, n in layouts:
        mask = segment_mask(segs, n)
        p0, m0, v0, grads = make_problem(n, gdtype, step0, int(rng.integers(2 ** 31)), n_steps=n_steps,
                                         bf16_states=bf16_states)
        for g in grads:
            g[torch.from_numpy(~mask)] = float("nan")
        wd_of = np.zeros(n)
        for a, b, wd in segs:
            wd_of[a:b] = wd
        # reference: elementwise, so run it once per decay value on that value's elements
        rp, rm, rv = p0.astype(np.float64), m0.astype(np.float64), v0.astype(np.float64)
        sp, sm = np.abs(rp), np.abs(rm)
        for wd in SEG_WDS:
            sel = mask & (wd_of == wd)
            rp[sel], rm[sel], rv[sel], sp[sel], sm[sel] = reference(
                p0[sel], [g.double().numpy()[sel] for g in grads], m0[sel], v0[sel], step0=step0, lr=lr,
                beta1=HP["beta1"], beta2=HP["beta2"], eps=HP["eps"], wd=wd, adamw=adamw, bias_correction=bc,
                grad_scale=GRAD_SCALE, bf16_states=bf16_states)

        def run(path, segmented):
            p = torch.from_numpy(p0.copy())
            m, v = torch.from_numpy(m0.copy()).to(state_dtype), torch.from_numpy(v0.copy()).to(state_dtype)
            gbuf = torch.empty(n, dtype=grads[0].dtype)
            out = gbuf if out_mode == "alias" else None if out_mode == "none" else \
                torch.full((n,), 7.0, dtype=GRAD_DTYPES[out_mode])
            kw = dict(lr=lr, adamw=adamw, bias_correction=bc, grad_scale=GRAD_SCALE, **HP)
            with use_path(path):
                for k, g in enumerate(grads):
                    gbuf.copy_(g)
                    if segmented:
                        ca.adam_step_segments(p, gbuf, m, v, segs, step=step0 + k, param16_out=out, **kw)
                        continue
                    for a, b, wd in segs:
                        ca.adam_step(p[a:b], gbuf[a:b], m[a:b], v[a:b], step=step0 + k, weight_decay=wd,
                                     param16_out=None if out is None else out[a:b], **kw)
            return p, m, v, gbuf, out

        gaps = torch.from_numpy(~mask)
        for path in PATHS:
            where = f"[{path} {len(segs)} segments n={n}]"
            ours, per_seg = run(path, True), run(path, False)
            for name, x, y in zip(("param", "exp_avg", "exp_avg_sq", "grad buffer", "param16_out"), ours, per_seg):
                if x is not None:
                    assert_same_bits(f"{where} {name} vs per-segment adam_step", x, y)
            p, m, v, gbuf, out = ours
            for name, x, x0 in (("param", p, p0), ("exp_avg", m, m0), ("exp_avg_sq", v, v0)):
                assert_same_bits(f"{where} {name} in the gaps", x[gaps], torch.from_numpy(x0).to(x.dtype)[gaps])
            assert_same_bits(f"{where} grad buffer in the gaps", gbuf[gaps], grads[-1][gaps])
            if out is not None and out is not gbuf:
                assert (out[gaps] == 7.0).all(), f"{where} param16_out: a gap element was written"
            if out is not None:
                assert_bits_equal(f"{where} param16_out", out[~gaps], p[~gaps].to(out.dtype))
            if bf16_states:
                check_close(f"{where} param", p.numpy(), rp, sp, rel_tol=5e-5, elem_tol=4e-3)
                check_close(f"{where} exp_avg", m.double().numpy(), rm, sm, rel_tol=2 ** -6, elem_tol=2 ** -6)
                check_close(f"{where} exp_avg_sq", v.double().numpy(), rv, np.abs(rv), rel_tol=2 ** -6,
                            elem_tol=2 ** -6)
            else:
                check_fp32_result(where, (p, m, v), (rp, rm, rv, sp, sm))


def test_adam_step_segments_with_a_rate_per_segment_equals_per_segment_calls():
    """lrs (--decoupled-lr: the embedding's segments at their own rate, still one kernel call) ==
    one adam_step per segment at that segment's rate, bit for bit, on every path, chunked (more
    than kMinParallel elements) or not; a list of the wrong length is an error."""
    rng = np.random.default_rng(fresh_seed("segments per-segment lr"))
    rates = (2e-3, 5e-4, 0.0)
    for segs, n in (random_segments(rng, 120, 2, lambda r: float(r.choice(SEG_WDS))),
                    random_segments(rng, 40, 0, lambda r: float(r.choice(SEG_WDS)))):
        lrs = [float(rng.choice(rates)) for _ in segs]
        p0, m0, v0, grads = make_problem(n, "bf16", 1, int(rng.integers(2 ** 31)), n_steps=2)

        def run(path, segmented):
            p, m, v = (torch.from_numpy(x.copy()) for x in (p0, m0, v0))
            gbuf = torch.empty(n, dtype=grads[0].dtype)
            kw = dict(adamw=True, bias_correction=True, grad_scale=GRAD_SCALE, **HP)
            with use_path(path):
                for k, g in enumerate(grads):
                    gbuf.copy_(g)
                    if segmented:
                        ca.adam_step_segments(p, gbuf, m, v, segs, step=1 + k, lr=1e-3, lrs=lrs, param16_out=gbuf, **kw)
                        continue
                    for (a, b, wd), lr in zip(segs, lrs):
                        ca.adam_step(p[a:b], gbuf[a:b], m[a:b], v[a:b], step=1 + k, lr=lr, weight_decay=wd,
                                     param16_out=gbuf[a:b], **kw)
            return p, m, v, gbuf

        for path in PATHS:
            for name, x, y in zip(("param", "exp_avg", "exp_avg_sq", "param16_out"), run(path, True), run(path, False)):
                assert_same_bits(f"[{path} {len(segs)} segments] {name} vs per-segment adam_step", x, y)
    p, g = torch.zeros(8), torch.zeros(8)
    with pytest.raises(ValueError, match="lrs has 1 rates for 2 segments"):
        ca.adam_step_segments(p, g, torch.zeros(8), torch.zeros(8), [(0, 4, 0.0), (4, 8, 0.0)], step=1, lr=1e-3,
                              lrs=[1e-3], **HP)


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
def test_adam_step_segments_extrapolate_writes_the_predicted_copy(out_dtype):
    """extrapolate (--dpu-weight-prediction fused into the kernel): param16_out gets
    (p_new - p_old) + p_new, rounded to nearest even, bit for bit what torch computes from the
    kernel's own p_new and a copy of p_old (the two passes the engine ran before issue 37); the
    master and moments are those of the plain call, on every path, in place and aliased to a
    16-bit gradient, chunked (more than kMinParallel elements) or not; elements outside the
    segments are untouched."""
    rng = np.random.default_rng(fresh_seed(f"segments extrapolate {out_dtype}"))
    gdtype = "fp32" if out_dtype == torch.float32 else ("fp16" if out_dtype == torch.float16 else "bf16")
    for segs, n in (random_segments(rng, 120, 2, lambda r: float(r.choice(SEG_WDS))),
                    random_segments(rng, 40, 0, lambda r: float(r.choice(SEG_WDS)))):
        p0, m0, v0, grads = make_problem(n, gdtype, 1, int(rng.integers(2 ** 31)), n_steps=3)
        lrs = [float(rng.choice((2e-3, 5e-4))) for _ in segs]
        kw = dict(adamw=True, bias_correction=True, grad_scale=GRAD_SCALE, lr=1e-3, lrs=lrs, **HP)
        inside = torch.zeros(n, dtype=torch.bool)
        for a, b, _ in segs:
            inside[a:b] = True
        for path in PATHS:
            with use_path(path):
                p, m, v = (torch.from_numpy(x.copy()) for x in (p0, m0, v0))
                q, mq, vq = (torch.from_numpy(x.copy()) for x in (p0, m0, v0))
                for k, g in enumerate(grads):
                    gbuf = g.clone()                     # aliased: the kernel reads g before it writes
                    before = torch.full((n,), 7.0).to(out_dtype)
                    out = gbuf if gbuf.dtype == out_dtype else before.clone()
                    ca.adam_step_segments(p, gbuf, m, v, segs, step=1 + k, param16_out=out, extrapolate=True, **kw)
                    old = q.clone()
                    ca.adam_step_segments(q, g.clone(), mq, vq, segs, step=1 + k, **kw)
                    for name, x, y in (("param", p, q), ("exp_avg", m, mq), ("exp_avg_sq", v, vq)):
                        assert_same_bits(f"[{path} step {k + 1}] {name} vs the plain call", x, y)
                    want = torch.sub(q, old).add_(q).to(out_dtype)
                    assert_same_bits(f"[{path} step {k + 1}] predicted copy", out[inside], want[inside])
                    untouched = g if out is gbuf else before
                    assert_same_bits(f"[{path} step {k + 1}] outside the segments", out[~inside], untouched[~inside])
                    assert not torch.equal(out[inside].float(), q[inside].to(out_dtype).float())
    with pytest.raises(ValueError, match="extrapolate writes the predicted copy into param16_out"):
        ca.adam_step_segments(torch.zeros(8), torch.zeros(8), torch.zeros(8), torch.zeros(8), [(0, 8, 0.0)],
                              step=1, lr=1e-3, extrapolate=True, **HP)


@pytest.mark.parametrize("gdtype", list(GRAD_DTYPES))
def test_grad_sumsq_and_finite_segments(gdtype):
    """Counted segments' sum == the per-segment sums (1e-12 relative); non-finite values count
    wherever they sit in a segment, counted or not, and not at all in a gap (never read)."""
    rng = np.random.default_rng(fresh_seed(f"segments sumsq {gdtype}"))
    dt = GRAD_DTYPES[gdtype]
    for segs, n in (random_segments(rng, 300, 4, lambda r: bool(r.random() < 0.7)),
                    random_segments(rng, 60, 0, lambda r: bool(r.random() < 0.7))):
        segs[0], segs[1] = segs[0][:2] + (False,), segs[1][:2] + (True,)  # at least one of each
        mask = segment_mask(segs, n)
        g = torch.from_numpy((rng.standard_normal(n) * 100).astype(np.float32)).to(dt)
        g[torch.from_numpy(~mask)] = float("nan")
        g64 = g.double().numpy()
        ref = float(sum(np.sum(np.square(g64[a:b])) for a, b, c in segs if c))
        for path in PATHS:
            with use_path(path):
                per_seg = sum(ca.grad_sumsq_and_finite(g[a:b])[0] for a, b, c in segs if c)
                s, finite = ca.grad_sumsq_and_finite_segments(g, segs)
            assert isinstance(s, float) and finite is True, f"{path}: a gap's NaN was read"
            assert abs(s - per_seg) <= 1e-12 * per_seg, f"{path} n={n}: {s} vs per-segment {per_seg}"
            assert abs(s - ref) <= 1e-12 * ref, f"{path} n={n}: {s} vs float64 {ref}"
        for counted in (False, True):
            cands = [k for k, sg in enumerate(segs) if sg[2] == counted]
            big = max(cands, key=lambda k: segs[k][1] - segs[k][0])
            for k in {big, int(rng.choice(cands))}:
                a, b, _ = segs[k]
                for pos in {a, (a + b) // 2, b - 1}:
                    bad = float(rng.choice([np.inf, -np.inf, np.nan]))
                    gb = g.clone()
                    gb[pos] = bad
                    for path in PATHS:
                        with use_path(path):
                            s, finite = ca.grad_sumsq_and_finite_segments(gb, segs)
                        where = f"{path} n={n} counted={counted} pos={pos} value={bad}"
                        assert finite is False, where
                        if not counted:  # the counted sum does not see it
                            assert abs(s - ref) <= 1e-12 * ref, where


@pytest.mark.skipif(EXT is None, reason="extension not built")
def test_segments_threads_and_blocks_bitwise_identical():
    """Chunks cut segments only 64k elements from their start: Adam's bits cannot depend on the
    threads or the block size; the sum of squares is bit-identical across threads for one block size."""
    rng = np.random.default_rng(fresh_seed("segments threads"))
    segs, n = random_segments(rng, 300, 4, lambda r: float(r.choice(SEG_WDS)))
    p0, m0, v0, grads = make_problem(n, "bf16", 10000, int(rng.integers(2 ** 31)), n_steps=1)
    counted = [(a, b, wd != 0.05) for a, b, wd in segs]
    old_block = EXT._get_block()
    try:
        for path in [p for p in PATHS if p != "torch-fallback"]:
            res, sums = {}, {}
            for block in (old_block, 0, 64, 4096):
                for threads in (1, 2, 3):
                    EXT._set_block(block)
                    p, m, v = (torch.from_numpy(x.copy()) for x in (p0, m0, v0))
                    g = grads[0].clone()
                    with use_path(path, threads=threads):
                        ca.adam_step_segments(p, g, m, v, segs, step=10000, lr=1e-3, adamw=False,
                                              grad_scale=GRAD_SCALE, param16_out=g, **HP)
                        sums[(block, threads)] = ca.grad_sumsq_and_finite_segments(grads[0], counted)[0]
                    res[(block, threads)] = (p, m, v, g)
            first = res[(old_block, 1)]
            for key, r in res.items():
                for x, y, name in zip(first, r, ("param", "exp_avg", "exp_avg_sq", "param16_out")):
                    assert_same_bits(f"{path} block, threads = {key}: {name}", y, x)
            for block in (old_block, 64, 4096):
                assert sums[(block, 1)] == sums[(block, 2)] == sums[(block, 3)], f"{path} block {block}"
            for s in sums.values():
                assert abs(s - sums[(old_block, 1)]) <= 1e-12 * s
    finally:
        EXT._set_block(old_block)


def _seg_call(a, segs, **kw):
    ca.adam_step_segments(a["param"], a["grad"], a["exp_avg"], a["exp_avg_sq"], segs, step=kw.pop("step", 1),
                          lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, param16_out=a.get("param16_out"), **kw)


def test_segments_bad_inputs_are_errors():
    bad = [  # (segments, message)
        ([(10, 20, 0.0), (0, 5, 0.0)], r"segments\[1\] starts at 0, before segments\[0\].*sorted"),
        ([(0, 10, 0.0), (5, 20, 0.0)], r"segments\[1\] = \(5, 20\) overlaps segments\[0\].*disjoint"),
        ([(0, 10, 0.0), (20, 65, 0.0)], r"segments\[1\] = \(20, 65\) is outside the buffer of 64"),
        ([(-1, 5, 0.0)], r"segments\[0\] = \(-1, 5\) is outside"),
        ([(5, 5, 0.0)], r"segments\[0\] = \(5, 5\): end must be > start"),
        ([(7, 3, 0.0)], r"end must be > start"),
        ([(0, 5)], r"segments\[0\]: expected \(start, end, "),
        ([(0.0, 5, 0.0)], r"integer start and end"),
        ([None], r"segments\[0\]: expected"),
    ]
    for path in PATHS:
        with use_path(path):
            for segs, msg in bad:
                a = _args(param16_out=torch.zeros(64, dtype=torch.bfloat16))
                a["grad"].normal_()
                before = {k: v.clone() for k, v in a.items()}
                with pytest.raises(ValueError, match=msg.replace("start, end, ", "start, end, weight_decay")):
                    _seg_call(a, segs)
                for k, v in a.items():  # nothing was touched
                    assert torch.equal(v, before[k]), f"{path} {segs}: {k} changed"
                counted = [None if s is None else s[:2] + (True,) * (len(s) == 3) for s in segs]
                with pytest.raises(ValueError, match=msg.replace("start, end, ", "start, end, counted")):
                    ca.grad_sumsq_and_finite_segments(a["grad"], counted)
            # the tensor checks of adam_step apply unchanged
            with pytest.raises(ValueError, match="grad: has 63 elements"):
                _seg_call(_args(grad=torch.zeros(63)), [(0, 10, 0.0)])
            with pytest.raises(ValueError, match="step must be a 1-based integer"):
                _seg_call(_args(), [(0, 10, 0.0)], step=0)
            with pytest.raises(ValueError, match="betas must be in"):
                ca.adam_step_segments(*_args().values(), [(0, 10, 0.0)], step=1, lr=1e-3, beta1=1.0,
                                      beta2=0.999, eps=1e-8)
            buf = torch.zeros(128)
            with pytest.raises(ValueError, match="overlap in memory"):
                _seg_call(_args(param=buf[:64], exp_avg=buf[32:96]), [(0, 10, 0.0)])
            with pytest.raises(ValueError, match="grad: dtype float64"):
                ca.grad_sumsq_and_finite_segments(torch.zeros(8, dtype=torch.float64), [(0, 8, True)])
            # adjacent segments are fine; no segments is a no-op
            a = _args()
            a["grad"].normal_()
            _seg_call(a, [(0, 10, 0.0), (10, 64, 0.1)])
            assert (a["param"] != 0).all()
            a = _args(grad=torch.ones(64))
            _seg_call(a, [])
            assert (a["param"] == 0).all()
            assert ca.grad_sumsq_and_finite_segments(a["grad"], []) == (0.0, True)
    if EXT is not None:  # the raw entry points check what they can without the buffers' sizes
        t = torch.zeros(64)
        ptrs = (t.data_ptr(), t.data_ptr(), 0, t.data_ptr(), t.data_ptr(), 0, 0, 3)
        hyper = (1, 1e-3, 0.9, 0.999, 1e-8, True, True, 1.0)
        with pytest.raises(ValueError, match="same length"):
            EXT.adam_step_segments(*ptrs, [0, 10], [5], [0.0, 0.0], *hyper)
        with pytest.raises(ValueError, match="sorted and disjoint"):
            EXT.adam_step_segments(*ptrs, [10, 0], [20, 5], [0.0, 0.0], *hyper)
        with pytest.raises(ValueError, match="end must be > start"):
            EXT.grad_sumsq_and_finite_segments(t.data_ptr(), 0, [3], [3], [True])
        with pytest.raises(ValueError, match="same length"):
            EXT.grad_sumsq_and_finite_segments(t.data_ptr(), 0, [0], [3], [True, False])


def test_segments_fallback_when_extension_missing(monkeypatch):
    monkeypatch.setattr(ca, "_ext", None)
    monkeypatch.setattr(ca, "_EXT_ERROR", "ImportError: simulated")
    monkeypatch.setattr(ca, "_fallback_warned", False)
    rng = np.random.default_rng(fresh_seed("segments fallback"))
    segs, n = random_segments(rng, 40, 1, lambda r: float(r.choice(SEG_WDS)))
    p0, m0, v0, grads = make_problem(n, "bf16", 1, int(rng.integers(2 ** 31)), n_steps=1)
    res = []
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        for segmented in (True, False):
            p, m, v, g = torch.from_numpy(p0.copy()), torch.zeros(n), torch.zeros(n), grads[0].clone()
            kw = dict(step=1, lr=1e-3, adamw=False, **HP)
            if segmented:
                ca.adam_step_segments(p, g, m, v, segs, param16_out=g, **kw)
            else:
                for a, b, wd in segs:
                    ca.adam_step(p[a:b], g[a:b], m[a:b], v[a:b], weight_decay=wd, param16_out=g[a:b], **kw)
            res.append((p, m, v, g))
        s, finite = ca.grad_sumsq_and_finite_segments(grads[0], [(a, b, True) for a, b, _ in segs])
    assert len([w for w in rec if "torch fallback" in str(w.message)]) == 1
    for x, y, name in zip(*res, ("param", "exp_avg", "exp_avg_sq", "param16_out")):
        assert_same_bits(f"missing extension: {name} vs per-segment adam_step", x, y)
    ref = sum(ca.grad_sumsq_and_finite(grads[0][a:b])[0] for a, b, _ in segs)
    assert finite is True and abs(s - ref) <= 1e-12 * ref


# --------------------------------------------------------------------------------------------
# CRC32C (csrc/checksum.inc): the NVMe tier's block checksum, in the same extension
# --------------------------------------------------------------------------------------------
def _crc32c_table() -> list[int]:
    table = []
    for b in range(256):
        c = b
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1   # reflected Castagnoli polynomial
        table.append(c)
    return table


_CRC32C_TABLE = _crc32c_table()


def crc32c_reference(data: bytes, value: int = 0) -> int:
    """Bytewise, from the polynomial: shares nothing with the extension (no slicing, no shifts)."""
    c = value ^ 0xFFFFFFFF
    for x in data:
        c = _CRC32C_TABLE[(c ^ x) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF


CRC_PATHS = list(EXT.crc32c_impls()) if ca.has_crc32c() else []
needs_crc32c = pytest.mark.skipif(not ca.has_crc32c(), reason="extension not built")


@contextlib.contextmanager
def crc_path(name: str):
    old = EXT.crc32c_impl()
    try:
        ca._set_crc32c_impl(name)
        assert EXT.crc32c_impl() == name
        yield
    finally:
        ca._set_crc32c_impl(old)


@needs_crc32c
def test_crc32c_paths_available():
    # this project's CI machines are x86-64 with SSE4.2: the fast path must be the one chosen there
    assert CRC_PATHS[-1] == "software"
    if "sse4.2" in CRC_PATHS:
        assert EXT.crc32c_impl() == "sse4.2" and ca.info()["checksum"] == "crc32c (sse4.2)"


@needs_crc32c
@pytest.mark.parametrize("path", CRC_PATHS)
def test_crc32c_against_a_bytewise_reference(path):
    rng = random.Random(fresh_seed(f"crc32c {path}"))
    pool = bytes(rng.getrandbits(8) for _ in range(100_000 + 64))
    # the loops' edges (8-byte words, 3 x 256 and 3 x 8192 rounds) and random lengths 0..100k
    lengths = [0, 1, 7, 8, 9, 767, 768, 769, 3 * 8192 - 1, 3 * 8192, 3 * 8192 + 1, 100_000]
    lengths += [rng.randrange(0, 100_001) for _ in range(24)]
    with crc_path(path):
        assert ca.crc32c(b"123456789") == 0xE3069283          # the standard check value
        assert ca.crc32c(b"") == 0 and ca.crc32c(b"", 0x12345678) == 0x12345678
        for n in lengths:
            start = rng.randrange(0, 65)                       # unaligned starts (and so ends)
            data = memoryview(pool)[start:start + n]
            value = rng.choice([0, rng.getrandbits(32)])
            ref = crc32c_reference(bytes(data), value)
            assert ca.crc32c(data, value) == ref, (path, start, n, value)
            # a tensor's bytes, as StateFile's buffers are
            t = torch.frombuffer(bytearray(data), dtype=torch.uint8) if n else torch.empty(0, dtype=torch.uint8)
            assert ca.crc32c(t, value) == ref, (path, "tensor", n)
            cut = rng.randrange(0, n + 1)                       # chained: crc(a + b) == crc(b, crc(a))
            assert ca.crc32c(data[cut:], ca.crc32c(data[:cut], value)) == ref, (path, n, cut)


@needs_crc32c
def test_crc32c_paths_agree_on_large_buffers_and_across_threads():
    import concurrent.futures
    rng = np.random.default_rng(fresh_seed("crc32c large"))
    bufs = [torch.from_numpy(rng.integers(0, 256, n, dtype=np.uint8)) for n in (4 << 20, (1 << 20) + 13)]
    bufs.append(torch.from_numpy(rng.standard_normal(300_001).astype(np.float32)))   # 4-byte elements
    got = {}
    for path in CRC_PATHS:
        with crc_path(path):
            got[path] = [ca.crc32c(b) for b in bufs]
            # the GIL is released: threads run at once; each result must still be its own buffer's
            with concurrent.futures.ThreadPoolExecutor(4) as pool:
                assert list(pool.map(ca.crc32c, bufs * 4)) == got[path] * 4
    assert len(set(map(tuple, got.values()))) == 1, got
    # and the odd-sized MiB against the bytewise reference (every long round, then the tails)
    whole = bufs[1].numpy().tobytes()
    assert got["software"][1] == crc32c_reference(whole)
    # a flipped bit anywhere changes it
    flipped = bufs[0].clone()
    pos = int(rng.integers(flipped.numel()))
    flipped[pos] ^= 1 << int(rng.integers(8))
    assert ca.crc32c(flipped) != got["software"][0]


@needs_crc32c
def test_crc32c_bad_inputs():
    t = torch.zeros(64, dtype=torch.uint8)
    with pytest.raises(ValueError, match="contiguous"):
        ca.crc32c(t[::2])
    with pytest.raises(BufferError):
        ca.crc32c(memoryview(bytes(64))[::2])                 # not C-contiguous
    with pytest.raises(TypeError):
        ca.crc32c(b"abc", -1)                                 # value is an unsigned 32-bit CRC
    with pytest.raises(UserError, match="not available"):
        ca._set_crc32c_impl("pclmul")


def test_crc32c_when_extension_missing(monkeypatch):
    monkeypatch.setattr(ca, "_ext", None)
    monkeypatch.setattr(ca, "_EXT_ERROR", "ImportError: simulated")
    assert ca.has_crc32c() is False
    assert ca.info()["checksum"].startswith("zlib crc32")
    with pytest.raises(UserError, match="crc32c needs the C.. extension.*simulated"):
        ca.crc32c(b"123456789")
