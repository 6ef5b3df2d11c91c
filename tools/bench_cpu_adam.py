#!/usr/bin/env python
"""Benchmark of the ZeRO-Offload CPU Adam kernel against torch, DeepSpeed and a memory roofline.

All variants run in ONE process and are interleaved (the order rotates every repeat, thread
counts alternate) so that noise from other work on the machine hits them equally. Per size, the
buffers are allocated once and shared by every variant (all update the same param / moment
tensors in place; only the 16-bit states are separate), then freed before the next size.

Variants (impl key: what one "step" is; bytes/param it must move at least):
  zo_fp32                fp32 grad in, fp32 states                                   28 B
  zo_fused16             bf16 grad in + bf16 param copy out (same buffer), fp32 states 28 B
  zo_bf16_states         as zo_fused16 with bf16 exp_avg / exp_avg_sq                  20 B
  torch_fused            torch.optim.AdamW(fused=True).step(), fp32 grads           28 B
  torch_foreach          torch.optim.AdamW(foreach=True).step(), fp32 grads         28 B
  torch_fused_plus_copy  torch_fused, then a separate fp32 -> bf16 copy of the params  34 B
  deepspeed_fp32         DeepSpeedCPUAdam.step(), fp32 grads (if deepspeed imports)  28 B
  deepspeed_fp32_plus_copy  deepspeed_fp32, then its separate fp32 -> bf16 copy      34 B
  roofline               C++ kernel moving exactly a pattern's bytes with no arithmetic,
                         one row per pattern: fp32 (28 B), fused16 (28 B), bf16_states (20 B)

gbps = bytes/param above x n_params / median time (the variant's minimum traffic; torch_foreach
really moves more). roofline_fraction = median time of the roofline kernel for the variant's job
(fp32 pattern for fp32-grad steps, fused16 pattern for "step + bf16 copy" jobs, bf16_states
pattern for zo_bf16_states) / the variant's median time.

DeepSpeed is optional: with DS_ACCELERATOR=cpu (set here if unset) and `deepspeed` importable
(e.g. `pip install --no-deps --target DIR deepspeed` + its small pure-Python deps, then
PYTHONPATH=DIR), its rows are added; otherwise they are skipped and the fused16 target is
reported against torch_fused_plus_copy instead, labelled as such.

Segment lists (last section): the engine's host partition is cut into runs wherever weight decay
changes (every bias / LayerNorm). For GPT-like layouts (--seg-layouts LAYERSxHIDDEN,...) it times
one optimizer step as (a) one adam_step call per segment vs (b) one adam_step_segments
call, and the same for the grad-norm pass (grad_sumsq_and_finite per segment
vs grad_sumsq_and_finite_segments); bf16 grad in + bf16 param out (same buffer), fp32 states.

  python tools/bench_cpu_adam.py                       # 10M, 100M, 500M; 1 and 2 threads; segments
  python tools/bench_cpu_adam.py --sizes 10M --repeats 3 --json out.json
  python tools/bench_cpu_adam.py --sizes "" --seg-layouts 12x768   # the segment section only
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import statistics
import sys
import time

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from zo_megatron.offload import cpu_adam as ca  # noqa: E402

LR, BETAS, EPS, WD = 1e-3, (0.9, 0.999), 1e-8, 0.01
N_TENSORS = 4
BYTES = {"zo_fp32": 28, "zo_fused16": 28, "zo_bf16_states": 20, "torch_fused": 28, "torch_foreach": 28,
         "torch_fused_plus_copy": 34, "deepspeed_fp32": 28, "deepspeed_fp32_plus_copy": 34,
         "roofline:fp32": 28, "roofline:fused16": 28, "roofline:bf16_states": 20}
# torch_foreach allocates and frees a full-size temporary (sqrt(v)) every step. On this VM,
# ~2 s after GiBs are freed the kernel hands the free pages back to the host (free page
# reporting), and memory bandwidth drops ~20% for a few hundred ms: measured, that slowed
# whichever variant ran 2 s after torch_foreach (in the fixed rotation: zo_fp32 at 500M, 2 threads)
# and the roofline kernel alike. So after a variant that frees big temporaries, wait it out.
ALLOCATES = {"torch_foreach"}
SETTLE_S = 3.0
ROOF_OF = {"zo_fp32": "fp32", "torch_fused": "fp32", "torch_foreach": "fp32", "deepspeed_fp32": "fp32",
           "zo_fused16": "fused16", "torch_fused_plus_copy": "fused16", "deepspeed_fp32_plus_copy": "fused16",
           "zo_bf16_states": "bf16_states"}


def parse_size(s: str) -> int:
    s = s.strip().upper()
    mult = {"K": 10 ** 3, "M": 10 ** 6, "G": 10 ** 9, "B": 10 ** 9}.get(s[-1:], 1)
    return int(float(s[:-1] if s[-1:] in "KMGB" else s) * mult)


def mem_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 1 << 62


def load_deepspeed():
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam  # noqa: F401
        return DeepSpeedCPUAdam, None
    except Exception as exc:  # noqa: BLE001 - any failure: skip its rows
        return None, f"{type(exc).__name__}: {exc}".splitlines()[0][:200]


class OmpThreads:
    """omp_set_num_threads of the system libgomp (the one DeepSpeed's JIT op links)."""

    def __init__(self):
        try:
            self.lib = ctypes.CDLL("libgomp.so.1")
        except OSError:
            self.lib = None

    def set(self, n: int) -> None:
        if self.lib is not None:
            self.lib.omp_set_num_threads(int(n))


class Buffers:
    def __init__(self, n: int):
        sizes = [n // N_TENSORS + (1 if i < n % N_TENSORS else 0) for i in range(N_TENSORS)]
        sizes = [s for s in sizes if s > 0]
        gen = torch.Generator().manual_seed(0)
        self.p = [torch.nn.Parameter(torch.empty(s).normal_(generator=gen)) for s in sizes]
        self.m = [torch.empty(s).normal_(0, 0.1, generator=gen) for s in sizes]
        self.v = [torch.empty(s).uniform_(1e-4, 1e-2, generator=gen) for s in sizes]
        self.g32 = [torch.empty(s).normal_(0, 0.05, generator=gen) for s in sizes]
        self.g16 = [g.to(torch.bfloat16) for g in self.g32]
        self.m16 = [m.to(torch.bfloat16) for m in self.m]
        self.v16 = [v.to(torch.bfloat16) for v in self.v]
        for p, g in zip(self.p, self.g32):
            p.grad = g
        self.step = 0


def make_variants(buf: Buffers, DeepSpeedCPUAdam):
    ext = ca._ext
    F32, BF16, NONE = ext.DTYPE_F32, ext.DTYPE_BF16, ext.DTYPE_NONE
    variants = {}

    def zo(kind):
        def run():
            buf.step += 1
            for i, p in enumerate(buf.p):
                if kind == "fp32":
                    ca.adam_step(p.data, buf.g32[i], buf.m[i], buf.v[i], step=buf.step, lr=LR, beta1=BETAS[0],
                                 beta2=BETAS[1], eps=EPS, weight_decay=WD)
                elif kind == "fused16":
                    ca.adam_step(p.data, buf.g16[i], buf.m[i], buf.v[i], step=buf.step, lr=LR, beta1=BETAS[0],
                                 beta2=BETAS[1], eps=EPS, weight_decay=WD, param16_out=buf.g16[i])
                else:
                    ca.adam_step(p.data, buf.g16[i], buf.m16[i], buf.v16[i], step=buf.step, lr=LR,
                                 beta1=BETAS[0], beta2=BETAS[1], eps=EPS, weight_decay=WD, param16_out=buf.g16[i])
        return run

    variants["zo_fp32"] = zo("fp32")
    variants["zo_fused16"] = zo("fused16")
    variants["zo_bf16_states"] = zo("bf16")

    def torch_opt(**kw):
        opt = torch.optim.AdamW(buf.p, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, **kw)
        for i, p in enumerate(buf.p):  # share the moment buffers: no extra memory, same bytes
            opt.state[p] = {"step": torch.tensor(0.0), "exp_avg": buf.m[i], "exp_avg_sq": buf.v[i]}
        return opt

    fused, foreach = torch_opt(fused=True), torch_opt(foreach=True)
    variants["torch_fused"] = fused.step
    variants["torch_foreach"] = foreach.step

    def copy16():
        for p, o in zip(buf.p, buf.g16):
            o.copy_(p.data)

    variants["torch_fused_plus_copy"] = lambda: (fused.step(), copy16())

    if DeepSpeedCPUAdam is not None:
        ds = DeepSpeedCPUAdam(buf.p, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, adamw_mode=True)
        for i, p in enumerate(buf.p):
            ds.state[p] = {"step": 0, "exp_avg": buf.m[i], "exp_avg_sq": buf.v[i]}
        variants["deepspeed_fp32"] = ds.step
        variants["deepspeed_fp32_plus_copy"] = lambda: (ds.step(), copy16())

    def roof(pattern):
        def run():
            for i, p in enumerate(buf.p):
                n = p.numel()
                if pattern == "fp32":
                    ext.roofline(p.data_ptr(), buf.g32[i].data_ptr(), F32, buf.m[i].data_ptr(), buf.v[i].data_ptr(),
                                 F32, 0, NONE, n)
                elif pattern == "fused16":
                    ext.roofline(p.data_ptr(), buf.g16[i].data_ptr(), BF16, buf.m[i].data_ptr(),
                                 buf.v[i].data_ptr(), F32, buf.g16[i].data_ptr(), BF16, n)
                else:
                    ext.roofline(p.data_ptr(), buf.g16[i].data_ptr(), BF16, buf.m16[i].data_ptr(),
                                 buf.v16[i].data_ptr(), BF16, buf.g16[i].data_ptr(), BF16, n)
        return run

    for pattern in ("fp32", "fused16", "bf16_states"):
        variants[f"roofline:{pattern}"] = roof(pattern)
    return variants


def set_threads(n: int, omp: OmpThreads) -> None:
    ca.set_num_threads(n)
    torch.set_num_threads(n)
    omp.set(n)


def bench_size(n, threads_list, repeats, DeepSpeedCPUAdam, omp, only=None):
    settle_s = SETTLE_S if n * 4 >= (256 << 20) else 0.0  # temporaries of >= 256 MiB
    buf = Buffers(n)
    variants = make_variants(buf, DeepSpeedCPUAdam)
    if only:
        variants = {k: v for k, v in variants.items() if k in only or k.startswith("roofline")}
    names = list(variants)
    times = {(k, t): [] for k in names for t in threads_list}
    with torch.no_grad():
        for t in threads_list:  # warm-up: JIT ops, first-touch effects, allocator
            set_threads(t, omp)
            for k in names:
                variants[k]()
        for r in range(repeats):
            for t in (threads_list if r % 2 == 0 else threads_list[::-1]):
                set_threads(t, omp)
                shift = (r * 3 + t) % len(names)
                for k in names[shift:] + names[:shift]:
                    t0 = time.perf_counter()
                    variants[k]()
                    times[(k, t)].append(time.perf_counter() - t0)
                    if k in ALLOCATES and settle_s:
                        time.sleep(settle_s)  # let the freed temporaries' after-effects pass (see SETTLE_S)
    rows = []
    for t in threads_list:
        med = {k: statistics.median(times[(k, t)]) for k in names}
        for k in names:
            impl, pattern = (k.split(":") + [None])[:2]
            roof_key = k if impl == "roofline" else f"roofline:{ROOF_OF[k]}"
            rows.append({
                "impl": impl, "pattern": pattern or ROOF_OF[k], "threads": t, "n_params": n,
                "median_s": med[k], "min_s": min(times[(k, t)]), "repeats": repeats,
                "times_s": [round(x, 6) for x in times[(k, t)]],
                "bytes_per_param": BYTES[k], "params_per_s": n / med[k], "gbps": BYTES[k] * n / med[k] / 1e9,
                "roofline_fraction": med[roof_key] / med[k],
            })
    del variants, buf
    gc.collect()
    return rows


def fmt_n(n: int) -> str:
    return f"{n / 1e9:g}B" if n >= 10 ** 9 else f"{n / 1e6:g}M" if n >= 10 ** 6 else str(n)


def print_table(rows):
    print(f"{'n_params':>9} {'thr':>3} {'impl':<26} {'B/p':>4} {'ms/step':>9} {'Mparam/s':>9} {'GB/s':>6} "
          f"{'roofline':>8}")
    for r in rows:
        name = r["impl"] + (f" ({r['pattern']})" if r["impl"] == "roofline" else "")
        print(f"{fmt_n(r['n_params']):>9} {r['threads']:>3} {name:<26} {r['bytes_per_param']:>4} "
              f"{r['median_s'] * 1e3:>9.1f} {r['params_per_s'] / 1e6:>9.0f} {r['gbps']:>6.1f} "
              f"{r['roofline_fraction'] * 100:>7.1f}%")


def print_targets(rows, have_ds: bool):
    print("\nTargets (at >= 100M params; medians of this run):")
    by = {(r["impl"], r["pattern"], r["threads"], r["n_params"]): r for r in rows}
    results = []
    for (impl, pattern, t, n), r in sorted(by.items(), key=lambda kv: (kv[0][3], kv[0][2])):
        if impl != "zo_fp32" or n < 10 ** 8:
            continue

        def get(i, p=None):
            return by.get((i, p or ROOF_OF.get(i, p), t, n))

        tag = f"{fmt_n(n)} x{t}thr"
        frac = r["roofline_fraction"]
        results.append((tag, "zo_fp32 >= 95% of roofline", frac >= 0.95, f"{frac * 100:.1f}%"))
        for other in ("torch_fused", "deepspeed_fp32"):
            o = get(other)
            if o:
                ratio = o["median_s"] / r["median_s"]
                results.append((tag, f"zo_fp32 not slower than {other}", ratio >= 1.0, f"{ratio:.2f}x"))
        f16 = get("zo_fused16")
        base_name = "deepspeed_fp32_plus_copy" if have_ds else "torch_fused_plus_copy"
        base = get(base_name)
        if f16 and base:
            ratio = base["median_s"] / f16["median_s"]
            label = f"zo_fused16 >= 1.4x vs {base_name}" + ("" if have_ds else " (DeepSpeed absent)")
            results.append((tag, label, ratio >= 1.4, f"{ratio:.2f}x"))
        b16 = get("zo_bf16_states")
        if b16:
            ratio = r["median_s"] / b16["median_s"]
            results.append((tag, "zo_bf16_states >= 1.25x vs zo_fp32", ratio >= 1.25, f"{ratio:.2f}x"))
            if f16:
                results.append((tag, "(info) zo_bf16_states vs zo_fused16", True,
                                f"{f16['median_s'] / b16['median_s']:.2f}x"))
    for tag, label, ok, val in results:
        mark = "    " if label.startswith("(info)") else ("MET " if ok else "MISS")
        print(f"  {mark} {tag:<12} {label:<52} {val}")
    return results


# ----------------------------------------------------------------------------------------------
# Segment lists: one kernel call per step vs one per segment
# ----------------------------------------------------------------------------------------------
def gpt_segments(layers: int, hidden: int) -> tuple[list[tuple[int, int, bool]], int]:
    """(start, end, decay) runs of a GPT-like partition, as FlatLayout._segments cuts it: per layer
    LN1 w/b, QKV w/b, proj w/b, LN2 w/b, FC1 w/b, FC2 w/b; matrices decay, vectors do not, and
    neighbours with the same setting form one run. Returns (runs, total elements)."""
    h = hidden
    layer = [(h, False), (h, False), (3 * h * h, True), (3 * h, False), (h * h, True), (h, False), (h, False),
             (h, False), (4 * h * h, True), (4 * h, False), (4 * h * h, True), (h, False)]
    runs: list[list] = []
    x = 0
    for size, decay in layer * layers:
        if runs and runs[-1][2] == decay:
            runs[-1][1] += size
        else:
            runs.append([x, x + size, decay])
        x += size
    return [(a, b, d) for a, b, d in runs], x


def bench_segments(layers: int, hidden: int, threads_list, repeats: int, omp: OmpThreads):
    segs, n = gpt_segments(layers, hidden)
    gen = torch.Generator().manual_seed(0)
    p = torch.empty(n).normal_(generator=gen)
    m = torch.empty(n).normal_(0, 0.1, generator=gen)
    v = torch.empty(n).uniform_(1e-4, 1e-2, generator=gen)
    g16 = torch.empty(n).normal_(0, 0.05, generator=gen).to(torch.bfloat16)  # grad in, param out
    adam_segs = [(a, b, WD if d else 0.0) for a, b, d in segs]
    norm_segs = [(a, b, True) for a, b, _ in segs]
    hp = dict(lr=LR, beta1=BETAS[0], beta2=BETAS[1], eps=EPS)
    step = [0]

    def adam_per_segment():
        step[0] += 1
        for a, b, wd in adam_segs:
            ca.adam_step(p[a:b], g16[a:b], m[a:b], v[a:b], step=step[0], weight_decay=wd,
                         param16_out=g16[a:b], **hp)

    def adam_one_call():
        step[0] += 1
        ca.adam_step_segments(p, g16, m, v, adam_segs, step=step[0], param16_out=g16, **hp)

    def sumsq_per_segment():
        for a, b, _ in norm_segs:
            ca.grad_sumsq_and_finite(g16[a:b])

    def sumsq_one_call():
        ca.grad_sumsq_and_finite_segments(g16, norm_segs)

    variants = {("adam", "a"): adam_per_segment, ("adam", "b"): adam_one_call,
                ("sumsq", "a"): sumsq_per_segment, ("sumsq", "b"): sumsq_one_call}
    times = {(k, t): [] for k in variants for t in threads_list}
    for t in threads_list:  # warm-up
        set_threads(t, omp)
        for f in variants.values():
            f()
    names = list(variants)
    for r in range(repeats):
        for t in (threads_list if r % 2 == 0 else threads_list[::-1]):
            set_threads(t, omp)
            shift = r % len(names)
            for k in names[shift:] + names[:shift]:
                t0 = time.perf_counter()
                variants[k]()
                times[(k, t)].append(time.perf_counter() - t0)
    sizes = [b - a for a, b, _ in segs]
    print(f"\n== segments: GPT-like {layers} layers x hidden {hidden}: {len(segs)} segments, {fmt_n(n)} params "
          f"(segment sizes {min(sizes)} .. {fmt_n(max(sizes))}, median {statistics.median(sizes):g}), "
          f"{repeats} repeats, medians")
    print(f"{'thr':>3} {'pass':<6} {'(a) per-segment ms':>19} {'(b) one call ms':>16} {'(b)/(a)':>8}")
    rows = []
    for t in threads_list:
        for what in ("adam", "sumsq"):
            a, b = (statistics.median(times[((what, x), t)]) for x in ("a", "b"))
            print(f"{t:>3} {what:<6} {a * 1e3:>19.3f} {b * 1e3:>16.3f} {b / a:>8.3f}")
            rows.append({"section": "segments", "layout": f"{layers}x{hidden}", "pass": what, "threads": t,
                         "n_params": n, "n_segments": len(segs), "per_segment_median_s": a,
                         "one_call_median_s": b, "ratio": b / a, "repeats": repeats})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="10M,100M,500M", help="comma list, e.g. 10M,100M,500M")
    ap.add_argument("--threads", default="1,2", help="comma list of thread counts")
    ap.add_argument("--repeats", type=int, default=0,
                    help="timed repeats per variant (default: 7, 5 above 200M params; 15 for segment lists)")
    ap.add_argument("--only", default="", help="comma list of impl keys to run (rooflines always run)")
    ap.add_argument("--seg-layouts", default="12x768,12x256",
                    help="GPT-like LAYERSxHIDDEN layouts for the segment-list section ('' to skip)")
    ap.add_argument("--json", default="", help="write the rows as a JSON list to this file")
    args = ap.parse_args(argv)

    if ca._ext is None:
        print(f"error: the C++ extension is not built ({ca._EXT_ERROR}); run `pip install --no-build-isolation -e .`",
              file=sys.stderr)
        return 2
    sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
    threads_list = [int(t) for t in args.threads.split(",") if t.strip()]
    only = {s.strip() for s in args.only.split(",") if s.strip()} or None
    DeepSpeedCPUAdam, ds_err = load_deepspeed()
    omp = OmpThreads()
    info = ca.info()
    print(f"cpu_adam: isa={info['isa']} avx512_bf16={ca._ext.has_avx512_bf16()} available={info['available_isas']}; "
          f"torch {torch.__version__}; deepspeed: {'yes' if DeepSpeedCPUAdam else 'skipped (' + str(ds_err) + ')'}")
    print(f"load average at start: {os.getloadavg()}; CPUs in affinity: {len(os.sched_getaffinity(0))}")
    all_rows = []
    for n in sizes:
        need = n * 22 + n * 4  # shared buffers + torch_foreach's sqrt temporary
        if need > 0.9 * mem_available():
            print(f"\nskipping {fmt_n(n)}: needs ~{need / 2**30:.1f} GiB, {mem_available() / 2**30:.1f} GiB available")
            continue
        repeats = args.repeats or (7 if n <= 2 * 10 ** 8 else 5)
        t0 = time.time()
        rows = bench_size(n, threads_list, repeats, DeepSpeedCPUAdam, omp, only)
        print(f"\n== {fmt_n(n)} params in {N_TENSORS} tensors, {repeats} repeats, medians "
              f"({time.time() - t0:.0f}s, load avg {os.getloadavg()[0]:.2f})")
        print_table(rows)
        all_rows += rows
    if all_rows:
        print_targets(all_rows, DeepSpeedCPUAdam is not None)
    for layout in (x.strip() for x in args.seg_layouts.split(",") if x.strip()):
        layers, hidden = (int(x) for x in layout.lower().split("x"))
        all_rows += bench_segments(layers, hidden, threads_list, args.repeats or 15, omp)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(all_rows, f, indent=1)
        print(f"\nwrote {len(all_rows)} rows to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
