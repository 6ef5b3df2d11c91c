"""CPU Adam for ZeRO-Offload: a thin, validating wrapper over the C++ kernel `zo_megatron._cpu_adam`.

The kernel does one fused, memory-bound pass per call: it reads the gradient (fp32, bf16 or fp16),
multiplies it by ``grad_scale`` (= clip_coef / loss_scale, computed by the caller), updates the fp32
master param and the Adam moments (fp32, or bf16 with round-to-nearest-even on store) and, when
``param16_out`` is given, writes the 16-bit copy of the new param in the same pass. The 16-bit
output may be the very same tensor as a 16-bit gradient (the engine reuses one host buffer).

Semantics are exactly torch.optim.Adam / AdamW (single step, amsgrad=False, maximize=False):

    g  = grad * grad_scale
    Adam : g = g + weight_decay * param           AdamW: param = param * (1 - lr * weight_decay)
    m  = beta1 * m + (1 - beta1) * g              v = beta2 * v + (1 - beta2) * g * g
    bc1, bc2 = 1 - beta1**step, 1 - beta2**step   (both 1 when bias_correction=False)
    param = param - (lr / bc1) * m / (sqrt(v) / sqrt(bc2) + eps)

Out of place: with ``param_out`` / ``exp_avg_out`` / ``exp_avg_sq_out`` the old state is only READ
from ``param`` / ``exp_avg`` / ``exp_avg_sq`` and the new values are written to the out buffers
(same dtype and size; each one given is apart from every other buffer, or is its input itself,
which means in place). The arithmetic is the same, so the bits are those of the in-place call:
--overlap-cpu-step keeps the old state this way (alternate state buffers, docs/overlap.md).

``adam_step_segments`` / ``grad_sumsq_and_finite_segments`` do the same over a list of disjoint
ranges of the buffers (each with its own weight decay / norm flag, and optionally its own learning
rate: --decoupled-lr) in ONE kernel call, split over
the threads by total size: the engine's partition is cut wherever weight decay changes (every bias
and LayerNorm, several small segments per layer), and as separate calls each segment would pay a
Python call and a thread fork, and one below the kernel's threading threshold runs on one thread.

If the extension is missing (failed build) everything still works through torch ops
(``torch._fused_adam_`` / ``torch._fused_adamw_`` when bias correction is on), with one warning.

Environment:
    ZO_CPU_ADAM_THREADS   OpenMP threads of the kernel (default: CPUs in this process's affinity)
    ZO_CPU_ADAM_ISA       force a code path: avx512 | avx2 | scalar (error if the CPU lacks it)

``crc32c(buf, value=0)``: the NVMe tier's block checksum (CRC32C, SSE4.2 or portable C++, chosen
from CPUID), in the same extension; ``has_crc32c()`` says whether the build has it.

``python -m zo_megatron.offload.cpu_adam --info`` prints the chosen ISA, threads, what the CPU has
and the checksum path.
"""
from __future__ import annotations

import argparse
import json
import math
import operator
import os
import sys
import warnings

import torch

from zo_megatron.errors import UserError

__all__ = ["adam_step", "adam_step_segments", "grad_sumsq_and_finite", "grad_sumsq_and_finite_segments",
           "set_num_threads", "get_num_threads", "info", "crc32c", "has_crc32c"]

_DTYPE_CODE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_NONE_CODE = 3
_GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_STATE_DTYPES = (torch.float32, torch.bfloat16)
_OUT_DTYPES = (torch.bfloat16, torch.float16)
_FALLBACK_CHUNK = 1 << 22  # elements per torch-fallback chunk: bounds its temporaries (~64 MiB)

try:  # the placeholder module of an old build has no adam_step: treat it as missing
    from zo_megatron import _cpu_adam as _ext

    if not hasattr(_ext, "adam_step"):
        raise ImportError("zo_megatron._cpu_adam is a stale placeholder build (no adam_step)")
    _EXT_ERROR: str | None = None
except Exception as _exc:  # noqa: BLE001 - any failure means: use the torch fallback
    _ext = None
    _EXT_ERROR = f"{type(_exc).__name__}: {_exc}"

_use_fallback = _ext is None  # private switch: tests force the torch path with _set_isa("torch-fallback")
_fallback_warned = False
_threads = 1


def _default_threads() -> int:
    env = os.environ.get("ZO_CPU_ADAM_THREADS", "").strip()
    if env:
        try:
            n = int(env)
        except ValueError:
            n = 0
        if n < 1:
            raise UserError(f"ZO_CPU_ADAM_THREADS={env!r} is not a positive integer; unset it or set e.g. 4")
        return n
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def set_num_threads(n: int) -> None:
    """Threads used by the kernel (OpenMP). The torch fallback keeps torch's own thread setting."""
    global _threads
    n = int(n)
    if n < 1:
        raise ValueError(f"num_threads must be >= 1, got {n}")
    _threads = n
    if _ext is not None:
        _ext.set_num_threads(n)


def get_num_threads() -> int:
    return _threads


def _available_isas() -> list[str]:
    return list(_ext.available_isas()) if _ext is not None else []


def _set_isa(name: str) -> None:
    """Private selector (tests, benchmarks): 'avx512' | 'avx2' | 'scalar' | 'torch-fallback'."""
    global _use_fallback
    if name == "torch-fallback":
        _use_fallback = True
        return
    if _ext is None:
        raise UserError(f"CPU Adam ISA {name!r} requested but the C++ extension is not built ({_EXT_ERROR}); "
                        "rebuild with `pip install --no-build-isolation -e .`")
    if name not in _available_isas():
        raise UserError(f"CPU Adam ISA {name!r} is not available on this CPU "
                        f"(available: {', '.join(_available_isas())})")
    _ext.set_isa(name)
    _use_fallback = False


def _current_isa() -> str:
    return "torch-fallback" if (_use_fallback or _ext is None) else _ext.get_isa()


def info() -> dict:
    d = {
        "extension": _ext is not None,
        "isa": _current_isa(),
        "threads": get_num_threads(),
        "available_isas": _available_isas(),
    }
    if _ext is None:
        d["extension_error"] = _EXT_ERROR
    else:  # whether the avx512 path converts fp32 -> bf16 with AVX512_BF16 instructions
        d["avx512_bf16"] = bool(_ext._get_avx512_bf16())
    d["checksum"] = _checksum_path()
    return d


def _warn_fallback_once() -> None:
    global _fallback_warned
    if not _fallback_warned:
        _fallback_warned = True
        why = f"the C++ extension is unavailable ({_EXT_ERROR})" if _ext is None else "it was forced"
        warnings.warn(f"zo_megatron CPU Adam: using the torch fallback because {why}; it is correct but "
                      "several times slower. Rebuild with `pip install --no-build-isolation -e .`.",
                      RuntimeWarning, stacklevel=3)


# ----------------------------------------------------------------------------------------------
# Validation
# ----------------------------------------------------------------------------------------------
def _check(name: str, t, dtypes, numel: int | None) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise ValueError(f"{name}: must be a CPU tensor, got device {t.device}")
    if t.layout != torch.strided:
        raise ValueError(f"{name}: must be a dense (strided) tensor, got layout {t.layout}")
    if t.dtype not in dtypes:
        allowed = "/".join(str(d).replace("torch.", "") for d in dtypes)
        raise ValueError(f"{name}: dtype {str(t.dtype).replace('torch.', '')} is not supported (expected {allowed})")
    if not t.is_contiguous():
        raise ValueError(f"{name}: must be contiguous (shape {tuple(t.shape)}, stride {t.stride()}); "
                         "pass a flat contiguous buffer, e.g. .contiguous() or a view of a flat tensor")
    if numel is not None and t.numel() != numel:
        raise ValueError(f"{name}: has {t.numel()} elements but param has {numel}")


def _check_overlaps(named: list[tuple[str, torch.Tensor]], allowed_alias: tuple[str, str]) -> None:
    """No two buffers overlap, except the pair `allowed_alias` when it is exactly one buffer."""
    spans = []
    for name, t in named:
        if t.numel():
            start = t.data_ptr()
            spans.append((start, start + t.numel() * t.element_size(), name, t.element_size()))
    spans.sort()
    for i in range(len(spans)):
        for j in range(i + 1, len(spans)):
            a, b = spans[i], spans[j]
            if b[0] >= a[1]:
                break
            exact = a[0] == b[0] and a[1] == b[1] and a[3] == b[3]
            if exact and {a[2], b[2]} == set(allowed_alias):
                continue
            raise ValueError(f"{a[2]} and {b[2]} overlap in memory; only param16_out may be the very same "
                             "buffer as a 16-bit grad")


def _same_buffer(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.numel() == b.numel() and a.dtype == b.dtype


def _state_outs(param, exp_avg, exp_avg_sq, outs) -> tuple:
    """The out-of-place outputs, checked; an out that is its input itself becomes None (in place)."""
    checked = []
    for name, src, out in zip(("param_out", "exp_avg_out", "exp_avg_sq_out"), (param, exp_avg, exp_avg_sq), outs):
        if out is not None:
            _check(name, out, (src.dtype,), src.numel())
            if _same_buffer(out, src):
                out = None
        checked.append(out)
    return tuple(checked)


def _check_adam_args(param, grad, exp_avg, exp_avg_sq, param16_out, step, beta1, beta2,
                     outs=(None, None, None), out_dtypes=_OUT_DTYPES) -> tuple[int, int]:
    """Validates the tensors and hyper-parameters of an Adam step; returns (numel, step).
    outs: (param_out, exp_avg_out, exp_avg_sq_out) as returned by _state_outs."""
    _check("param", param, (torch.float32,), None)
    n = param.numel()
    _check("grad", grad, _GRAD_DTYPES, n)
    _check("exp_avg", exp_avg, _STATE_DTYPES, n)
    _check("exp_avg_sq", exp_avg_sq, _STATE_DTYPES, n)
    if exp_avg.dtype != exp_avg_sq.dtype:
        raise ValueError(f"exp_avg ({exp_avg.dtype}) and exp_avg_sq ({exp_avg_sq.dtype}) must have the same dtype")
    if param16_out is not None:
        _check("param16_out", param16_out, out_dtypes, n)
    named = [("param", param), ("grad", grad), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)]
    if param16_out is not None:
        named.append(("param16_out", param16_out))
    named += [(name, t) for name, t in zip(("param_out", "exp_avg_out", "exp_avg_sq_out"), outs) if t is not None]
    _check_overlaps(named, ("grad", "param16_out"))
    if isinstance(step, bool) or int(step) != step or step < 1:
        raise ValueError(f"step must be a 1-based integer, got {step!r}")
    if not (0.0 <= beta1 < 1.0 and 0.0 <= beta2 < 1.0):
        raise ValueError(f"betas must be in [0, 1), got ({beta1}, {beta2})")
    return n, int(step)


def _check_segments(segments, n: int, third: str) -> tuple[list[int], list[int], list]:
    """Splits (start, end, x) triples into three lists; 0 <= start < end <= n, sorted, disjoint."""
    starts, ends, xs = [], [], []
    for i, seg in enumerate(segments):
        try:
            start, end, x = seg
            start, end = operator.index(start), operator.index(end)
        except (TypeError, ValueError):
            raise ValueError(f"segments[{i}]: expected (start, end, {third}) with integer start and end, "
                             f"got {seg!r}") from None
        if end <= start:
            raise ValueError(f"segments[{i}] = ({start}, {end}): end must be > start")
        if start < 0 or end > n:
            raise ValueError(f"segments[{i}] = ({start}, {end}) is outside the buffer of {n} elements")
        if starts and start < starts[-1]:
            raise ValueError(f"segments[{i}] starts at {start}, before segments[{i - 1}] ({starts[-1]}): "
                             "segments must be sorted by start")
        if ends and start < ends[-1]:
            raise ValueError(f"segments[{i}] = ({start}, {end}) overlaps segments[{i - 1}] = "
                             f"({starts[-1]}, {ends[-1]}): segments must be disjoint")
        starts.append(start)
        ends.append(end)
        xs.append(x)
    return starts, ends, xs


# ----------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------
def _ptr(t) -> int:
    return 0 if t is None else t.data_ptr()


def adam_step(param, grad, exp_avg, exp_avg_sq, *, step: int, lr: float, beta1: float, beta2: float,
              eps: float, weight_decay: float = 0.0, adamw: bool = True, bias_correction: bool = True,
              grad_scale: float = 1.0, param16_out=None, param_out=None, exp_avg_out=None,
              exp_avg_sq_out=None) -> None:
    """One Adam/AdamW step, in place on ``param``, ``exp_avg``, ``exp_avg_sq`` (and ``param16_out``).

    param: fp32 contiguous CPU tensor (1-D expected; any contiguous shape is treated as flat).
    grad: fp32/bf16/fp16, same numel. exp_avg/exp_avg_sq: both fp32 or both bf16.
    param16_out: None or a bf16/fp16 tensor of the same numel; it may be the same tensor as grad.
    param_out / exp_avg_out / exp_avg_sq_out: None (in place) or a tensor of its input's dtype and
    numel, apart from every other buffer: the new value goes there and the input is only read
    (bit-identical to the in-place step).
    step: 1-based step count of this update. Bad inputs raise ValueError naming the tensor.
    """
    outs = _state_outs(param, exp_avg, exp_avg_sq, (param_out, exp_avg_out, exp_avg_sq_out))
    n, step = _check_adam_args(param, grad, exp_avg, exp_avg_sq, param16_out, step, beta1, beta2, outs)
    if n == 0:
        return
    if _use_fallback or _ext is None:
        _warn_fallback_once()
        _torch_adam_step(param, grad, exp_avg, exp_avg_sq, step, float(lr), float(beta1), float(beta2),
                         float(eps), float(weight_decay), bool(adamw), bool(bias_correction),
                         float(grad_scale), param16_out, outs)
        return
    _ext.adam_step(param.data_ptr(), grad.data_ptr(), _DTYPE_CODE[grad.dtype],
                   exp_avg.data_ptr(), exp_avg_sq.data_ptr(), _DTYPE_CODE[exp_avg.dtype],
                   0 if param16_out is None else param16_out.data_ptr(),
                   _NONE_CODE if param16_out is None else _DTYPE_CODE[param16_out.dtype],
                   n, step, float(lr), float(beta1), float(beta2), float(eps), float(weight_decay),
                   bool(adamw), bool(bias_correction), float(grad_scale), *map(_ptr, outs))


def grad_sumsq_and_finite(grad) -> tuple[float, bool]:
    """(sum of squares accumulated in fp64, all elements finite) of a contiguous fp32/bf16/fp16 tensor."""
    _check("grad", grad, _GRAD_DTYPES, None)
    n = grad.numel()
    if n == 0:
        return 0.0, True
    if _use_fallback or _ext is None:
        _warn_fallback_once()
        s = _torch_sumsq(grad.view(-1))
        return s, math.isfinite(s)
    s, finite = _ext.grad_sumsq_and_finite(grad.data_ptr(), _DTYPE_CODE[grad.dtype], n)
    return float(s), bool(finite)


def adam_step_segments(param, grad, exp_avg, exp_avg_sq, segments, *, step: int, lr: float, beta1: float,
                       beta2: float, eps: float, adamw: bool = True, bias_correction: bool = True,
                       grad_scale: float = 1.0, param16_out=None, param_out=None, exp_avg_out=None,
                       exp_avg_sq_out=None, lrs=None, extrapolate: bool = False) -> None:
    """``adam_step`` on each segment of the (flat) buffers, in one kernel call.

    extrapolate: ``param16_out`` (then required; fp32, bf16 or fp16) gets the weight-predicted copy
    (p_new - p_old) + p_new of each element (--dpu-weight-prediction, docs/dpu.md), computed in
    fp32 in that order and rounded to nearest even: the same bits as those two passes in torch
    after the step, with no copy of the old parameters.

    segments: sequence of (start, end, weight_decay), sorted, disjoint, 0 <= start < end <= numel;
    lrs: None (every segment at ``lr``) or one learning rate per segment.
    The result is bit-identical to one ``adam_step`` per segment on the slices [start:end] (same
    arguments, that segment's weight_decay and rate); elements outside every segment are not touched (in
    the inputs nor in the out buffers). The tensors are checked as in ``adam_step`` (out of place
    with ``param_out`` / ``exp_avg_out`` / ``exp_avg_sq_out``, bit-identical to in place); a bad
    segment list raises ValueError naming the segment.
    """
    outs = _state_outs(param, exp_avg, exp_avg_sq, (param_out, exp_avg_out, exp_avg_sq_out))
    if extrapolate and param16_out is None:
        raise ValueError("extrapolate writes the predicted copy into param16_out: give one")
    n, step = _check_adam_args(param, grad, exp_avg, exp_avg_sq, param16_out, step, beta1, beta2, outs,
                               _OUT_DTYPES + (torch.float32,) if extrapolate else _OUT_DTYPES)
    starts, ends, wds = _check_segments(segments, n, "weight_decay")
    if not starts:
        return
    wds = [float(wd) for wd in wds]
    lrs = [float(lr)] * len(starts) if lrs is None else [float(x) for x in lrs]
    if len(lrs) != len(starts):
        raise ValueError(f"lrs has {len(lrs)} rates for {len(starts)} segments: give one per segment")
    if _use_fallback or _ext is None:
        _warn_fallback_once()
        p, g, m, v = param.view(-1), grad.view(-1), exp_avg.view(-1), exp_avg_sq.view(-1)
        o = None if param16_out is None else param16_out.view(-1)
        flat_outs = [None if t is None else t.view(-1) for t in outs]
        for a, b, wd, rate in zip(starts, ends, wds, lrs):
            _torch_adam_step(p[a:b], g[a:b], m[a:b], v[a:b], step, rate, float(beta1), float(beta2),
                             float(eps), wd, bool(adamw), bool(bias_correction), float(grad_scale),
                             None if o is None else o[a:b], [None if t is None else t[a:b] for t in flat_outs],
                             extrapolate)
        return
    _ext.adam_step_segments(param.data_ptr(), grad.data_ptr(), _DTYPE_CODE[grad.dtype],
                            exp_avg.data_ptr(), exp_avg_sq.data_ptr(), _DTYPE_CODE[exp_avg.dtype],
                            0 if param16_out is None else param16_out.data_ptr(),
                            _NONE_CODE if param16_out is None else _DTYPE_CODE[param16_out.dtype],
                            starts, ends, wds, step, float(lr), float(beta1), float(beta2), float(eps),
                            bool(adamw), bool(bias_correction), float(grad_scale), *map(_ptr, outs),
                            # one rate for all / no prediction: the call of a kernel built before them
                            **({} if all(x == float(lr) for x in lrs) else {"seg_lr": lrs}),
                            **({"extrapolate": True} if extrapolate else {}))


def grad_sumsq_and_finite_segments(grad, segments) -> tuple[float, bool]:
    """(fp64 sum of squares over the segments flagged counted, every element of every segment finite).

    segments: sequence of (start, end, counted), sorted, disjoint, 0 <= start < end <= numel of the
    contiguous fp32/bf16/fp16 ``grad``. Elements outside every segment are not read.
    """
    _check("grad", grad, _GRAD_DTYPES, None)
    starts, ends, counted = _check_segments(segments, grad.numel(), "counted")
    if not starts:
        return 0.0, True
    counted = [bool(c) for c in counted]
    if _use_fallback or _ext is None:
        _warn_fallback_once()
        flat = grad.view(-1)
        s, finite = 0.0, True
        for a, b, c in zip(starts, ends, counted):
            x = _torch_sumsq(flat[a:b])
            finite = finite and math.isfinite(x)
            if c:
                s += x
        return s, finite
    s, finite = _ext.grad_sumsq_and_finite_segments(grad.data_ptr(), _DTYPE_CODE[grad.dtype], starts, ends,
                                                    counted)
    return float(s), bool(finite)


# ----------------------------------------------------------------------------------------------
# CRC32C: the NVMe tier's block checksum (csrc/checksum.inc, same extension)
# ----------------------------------------------------------------------------------------------
def has_crc32c() -> bool:
    """Whether the extension has crc32c (a missing build, or one from before it, has not)."""
    return _ext is not None and hasattr(_ext, "crc32c")


def crc32c(buf, value: int = 0) -> int:
    """CRC32C (Castagnoli) of ``buf``, continuing ``value`` as zlib.crc32 does:
    crc32c(a + b) == crc32c(b, crc32c(a)); crc32c(b"123456789") == 0xE3069283.

    buf: a C-contiguous Python buffer (bytes, bytearray, memoryview) or a contiguous CPU tensor
    (its bytes). The GIL is released while it runs, so several threads checksum in parallel.
    Without the extension there is no CRC32C here (a Python loop would run at a few MB/s);
    nvme_io then checksums with zlib.crc32 instead (see its module docstring).
    """
    if not has_crc32c():
        why = _EXT_ERROR if _ext is None else "the build predates crc32c"
        raise UserError(f"crc32c needs the C++ extension ({why}); rebuild with `pip install --no-build-isolation -e .`")
    if isinstance(buf, torch.Tensor):
        if buf.device.type != "cpu" or not buf.is_contiguous():
            raise ValueError(f"crc32c: expected a contiguous CPU tensor, got one on {buf.device} "
                             f"with stride {buf.stride()}")
        return _ext.crc32c_ptr(buf.data_ptr(), buf.numel() * buf.element_size(), value)
    return _ext.crc32c(buf, value)


def _checksum_path() -> str:
    """What the NVMe tier checksums with, for info(): CRC32C and its path, or zlib's CRC-32."""
    return f"crc32c ({_ext.crc32c_impl()})" if has_crc32c() else "zlib crc32 (no crc32c in the extension)"


def _set_crc32c_impl(name: str) -> None:
    """Private selector (tests, benchmarks): 'sse4.2' | 'software' (the portable C++ path)."""
    if not has_crc32c():
        raise UserError("crc32c is not in this build of the C++ extension")
    if name not in _ext.crc32c_impls():
        raise UserError(f"CRC32C path {name!r} is not available on this CPU "
                        f"(available: {', '.join(_ext.crc32c_impls())})")
    _ext._set_crc32c_impl(name)


# ----------------------------------------------------------------------------------------------
# Torch fallback (also the reference for "what torch would do")
# ----------------------------------------------------------------------------------------------
def _torch_sumsq(flat) -> float:
    s = 0.0
    for a in range(0, flat.numel(), _FALLBACK_CHUNK):
        s += float(flat[a:a + _FALLBACK_CHUNK].to(torch.float64).square().sum())
    return s


def _torch_adam_step(param, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, wd, adamw,
                     bias_correction, grad_scale, param16_out, outs=(None, None, None), extrapolate=False) -> None:
    """In place; out of place (`outs`: param_out, exp_avg_out, exp_avg_sq_out, None = in place)
    each chunk's old state is first copied into the out buffers (exact), then updated there in place.
    extrapolate: param16_out gets (p_new - p_old) + p_new (adam_step_segments)."""
    p_src, g_all = param.view(-1), grad.view(-1)
    m_src, v_src = exp_avg.view(-1), exp_avg_sq.view(-1)
    p_all, m_all, v_all = (src if out is None else out.view(-1) for src, out in zip((p_src, m_src, v_src), outs))
    o_all = None if param16_out is None else param16_out.view(-1)
    fp32_states = exp_avg.dtype == torch.float32
    fused = getattr(torch, "_fused_adamw_" if adamw else "_fused_adam_", None) if bias_correction else None
    bc1 = 1.0 - beta1 ** step if bias_correction else 1.0
    bc2 = 1.0 - beta2 ** step if bias_correction else 1.0
    n = p_all.numel()
    for a in range(0, n, _FALLBACK_CHUNK):
        b = min(n, a + _FALLBACK_CHUNK)
        p_old = p_src[a:b].clone() if extrapolate else None
        for src, dst in ((p_src, p_all), (m_src, m_all), (v_src, v_all)):
            if dst is not src:
                dst[a:b].copy_(src[a:b])
        p = p_all[a:b]
        g = g_all[a:b].to(torch.float32).mul(grad_scale)  # always a fresh tensor: grad is never written
        m = m_all[a:b] if fp32_states else m_all[a:b].to(torch.float32)
        v = v_all[a:b] if fp32_states else v_all[a:b].to(torch.float32)
        done = False
        if fused is not None:
            try:
                fused([p], [g], [m], [v], [], [torch.tensor(float(step))], lr=lr, beta1=beta1, beta2=beta2,
                      weight_decay=wd, eps=eps, amsgrad=False, maximize=False)
                done = True
            except (RuntimeError, NotImplementedError):  # an old torch without the CPU fused kernel
                fused = None
        if not done:
            if wd != 0.0:
                if adamw:
                    p.mul_(1.0 - lr * wd)
                else:
                    g.add_(p, alpha=wd)
            m.lerp_(g, 1.0 - beta1)
            v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
            denom = v.sqrt().div_(math.sqrt(bc2)).add_(eps)
            p.addcdiv_(m, denom, value=-lr / bc1)
        if not fp32_states:
            m_all[a:b].copy_(m)  # RNE to bf16
            v_all[a:b].copy_(v)
        if o_all is not None:    # grad chunk was already read into g: aliasing is safe
            o_all[a:b].copy_(torch.sub(p, p_old).add_(p) if extrapolate else p)


# ----------------------------------------------------------------------------------------------
# Import-time configuration
# ----------------------------------------------------------------------------------------------
def _configure_from_env() -> None:
    set_num_threads(_default_threads())
    isa = os.environ.get("ZO_CPU_ADAM_ISA", "").strip().lower()
    if isa:
        if isa not in ("avx512", "avx2", "scalar"):
            raise UserError(f"ZO_CPU_ADAM_ISA={isa!r}: expected avx512, avx2 or scalar (or unset it)")
        _set_isa(isa)


try:
    _configure_from_env()
except UserError as _exc:
    if __name__ == "__main__":  # the --info CLI: one line, exit 2
        print(f"error: {_exc}", file=sys.stderr)
        sys.exit(2)
    raise


def _main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m zo_megatron.offload.cpu_adam",
                                 description="ZeRO-Offload CPU Adam kernel")
    ap.add_argument("--info", action="store_true", help="print the ISA, threads, available ISAs and checksum path")
    ap.add_argument("--json", action="store_true", help="print info() as JSON")
    args = ap.parse_args(argv)
    d = info()
    if args.json:
        print(json.dumps(d))
        return 0
    print(f"extension:      {'built' if d['extension'] else 'MISSING (' + str(d.get('extension_error')) + ')'}")
    print(f"isa:            {d['isa']}")
    print(f"threads:        {d['threads']}")
    print(f"available isas: {', '.join(d['available_isas']) or '-'}")
    if d["isa"] == "avx512" and d.get("avx512_bf16") is not None:
        print(f"avx512_bf16:    {'used for fp32->bf16' if d['avx512_bf16'] else 'no'}")
    print(f"checksum:       {d['checksum']}")
    return 0


if __name__ == "__main__":
    sys.exit(_main())
