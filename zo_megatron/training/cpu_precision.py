"""On a CPU, bf16 or fp32 by what this CPU measures, not by its flags alone.

A CPU without AVX512_BF16 or AMX emulates bf16 matmuls (26x slower than fp32 on an AVX2 EPYC): the
job runs fp32 there without measuring. A CPU with them may still be slower in bf16: an Intel Xeon
with AVX512_BF16 under KVM (no AMX exposed) ran bf16 matmuls at 85 GFLOP/s against fp32's 148 at
the demo's shapes, and `make demo` took 14 minutes. So where the flags promise native bf16, the job
times matmuls in each dtype (about half a second) and takes bf16 only if it is faster. The timing
is interleaved, ROUNDS windows per dtype in alternating order, and each dtype's best window counts:
load from other processes only slows a window down, so a burst during one dtype's single window
no longer decides (it did: two launches of one job on a busy 2-core CI machine measured different
verdicts and trained in different precisions).

A resume (`--load` of a checkpoint that records its precision) keeps the checkpoint's precision
instead of measuring again: a measurement taken under other load, or after the cache was cleared,
must not switch a run's precision halfway (`default_precision(checkpoint_precision=...)`).

The result is cached per machine (CPU model, its bf16 flags, torch version, threads) in
`$ZO_MEGATRON_CACHE/cpu_precision.json`; the ranks of one node take turns under a file lock, so
one of them measures and the others read its verdict (ranks measuring at once would slow each
other and could disagree). Ranks on different nodes agree after the process groups exist
(`agree_across_ranks`): if any rank measured fp32, every rank runs fp32.
"""
from __future__ import annotations

import contextlib
import datetime
import json
import os
import time

SHAPE = (1024, 1024, 1024)          # m, k, n: one MLP-sized matmul
ROUNDS, ROUND_SECONDS = 3, 0.05     # the verdict's timing: 3 interleaved windows per dtype (each after
                                    # one warm-up call), the best counting


def cpu_flags() -> set[str]:
    """This CPU's feature flags (/proc/cpuinfo; empty where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def default_precision(checkpoint_precision: str | None = None) -> tuple[str, str, bool]:
    """(precision, why, measured): bf16 on GPUs; on a CPU whose flags promise native bf16 (AVX512_BF16
    or AMX) the faster of bf16 and fp32 by a short cached measurement (`choose`:
    such a CPU may still run bf16 slower), or, resuming, the checkpoint's precision
    (`checkpoint_precision`) without measuring; fp32 on other CPUs, which emulate bf16 matmuls
    (measured on an AVX2 EPYC: 26x slower than fp32)."""
    import torch

    if torch.cuda.is_available():
        return "bf16", "GPU", False
    native = sorted(cpu_flags() & {"avx512_bf16", "amx_bf16"})
    if native and checkpoint_precision in ("bf16", "fp32"):
        return (checkpoint_precision, f"the checkpoint's, kept by the resume instead of measuring on this CPU "
                f"({', '.join(native)}); --{'fp32' if checkpoint_precision == 'bf16' else 'bf16'} to change", False)
    if native:
        from zo_megatron.data.corpus import default_cache_dir

        return (*choose(native, default_cache_dir()), True)
    return "fp32", "CPU without native bf16 (no AVX512_BF16/AMX): bf16 would be emulated; --bf16 to force", False


def matmul_gflops(dtype_name: str, shape=SHAPE, min_seconds: float = ROUND_SECONDS) -> float:
    """GFLOP/s of torch.matmul at `shape` in `dtype_name` ("bf16" / "fp32") on this CPU."""
    import torch

    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype_name]
    m, k, n = shape
    g = torch.Generator().manual_seed(0)
    a = torch.randn(m, k, generator=g).to(dtype)
    b = torch.randn(k, n, generator=g).to(dtype)
    torch.matmul(a, b)                                  # warm-up: kernel selection, caches
    calls, t0 = 0, time.perf_counter()
    while True:
        torch.matmul(a, b)
        calls += 1
        dt = time.perf_counter() - t0
        if dt >= min_seconds:
            return 2.0 * m * k * n * calls / dt / 1e9


def machine_key(native: list[str]) -> str:
    """What the verdict depends on: the CPU model, its bf16 flags, torch's version and threads."""
    import torch

    model = "unknown cpu"
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), model)
    return f"{model} | {','.join(native)} | torch {torch.__version__} | {torch.get_num_threads()} threads"


def best_of_rounds(measure, rounds: int = ROUNDS) -> dict[str, float]:
    """{"bf16": GFLOP/s, "fp32": GFLOP/s}: `measure(dtype)` called `rounds` times per dtype, the
    dtypes alternating and the order flipped every round (bf16 fp32, fp32 bf16, ...), each dtype's
    best call kept -- a slowdown from other processes lands in some windows, not in the best one."""
    best = {"bf16": 0.0, "fp32": 0.0}
    for r in range(rounds):
        for dtype in (("bf16", "fp32") if r % 2 == 0 else ("fp32", "bf16")):
            best[dtype] = max(best[dtype], measure(dtype))
    return best


def choose(native: list[str], cache_dir: str, measure=None) -> tuple[str, str]:
    """(precision, why) for a CPU whose flags name `native` bf16 support: the cached verdict for this
    machine, else a measurement (best_of_rounds over `measure`, default matmul_gflops: one window;
    written to the cache)."""
    measure = measure or matmul_gflops
    key = machine_key(native)
    path = os.path.join(cache_dir, "cpu_precision.json")
    os.makedirs(cache_dir, exist_ok=True)
    with _locked(path + ".lock"):
        cache = _read(path)
        rec = cache.get(key)
        # a verdict of the single-window timing (no "rounds") is measured again: it may be a burst's
        cached = isinstance(rec, dict) and rec.get("rounds") == ROUNDS and all(
            isinstance(rec.get(k), (int, float)) and rec[k] > 0 for k in ("bf16_gflops", "fp32_gflops"))
        if not cached:
            best = best_of_rounds(measure)
            rec = {"bf16_gflops": best["bf16"], "fp32_gflops": best["fp32"], "rounds": ROUNDS,
                   "measured": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
            cache[key] = rec
            _write(path, cache)
    bf16, fp32 = rec["bf16_gflops"], rec["fp32_gflops"]
    how = (f"{'cached measurement' if cached else 'measured'} on this CPU ({', '.join(native)}): "
           f"bf16 matmul {bf16:.0f} vs fp32 {fp32:.0f} GFLOP/s")
    if bf16 > fp32:
        return "bf16", f"{how}; --fp32 to force"
    return "fp32", f"{how}, bf16 {fp32 / max(bf16, 1e-9):.1f}x slower; --bf16 to force"


def agree_across_ranks(args) -> None:
    """After the process groups exist: a measured choice is the same on every rank (fp32 if any rank
    measured fp32: nodes may differ). A no-op for a precision given by flag or by the device."""
    if not getattr(args, "precision_measured", False):
        return
    import torch

    from zo_megatron.parallel import collectives

    fp32 = collectives.all_reduce(torch.tensor([1.0 if args.precision == "fp32" else 0.0]), "max")
    if fp32.item() and args.precision != "fp32":
        if args.main_grads_dtype not in (None, "fp32"):
            from zo_megatron.errors import UserError

            raise UserError(f"the ranks' CPUs measured different precisions (this one bf16, another fp32) and "
                            f"--main-grads-dtype {args.main_grads_dtype} fits only bf16: add --bf16 or --fp32")
        args.precision = "fp32"
        args.precision_reason += "; fp32 because another rank's CPU measured bf16 slower"


@contextlib.contextmanager
def _locked(path: str):
    import fcntl

    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _read(path: str) -> dict:
    try:
        with open(path) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}                          # missing or damaged: measured again and rewritten


def _write(path: str, data: dict) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)
