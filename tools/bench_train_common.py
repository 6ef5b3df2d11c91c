"""What every part of tools/bench_train.py uses: the benchmark's constants (variants, regimes, AdamW
settings, sweep shapes), world names, the regime's shape, and what it asks of the machine (CPUs,
CPU model, free memory, a free port, whether DeepSpeed imports).

The parts import this module and never each other in a cycle (issue 36; tests/test_import_graph.py):
bench_train_variants imports only this, bench_train_runner this and the variants, bench_train_report
this (and bench_loss_check); tools/bench_train.py composes them.
"""
from __future__ import annotations

import os
import platform
import socket
import statistics
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _path in (REPO, os.path.join(REPO, "tools")):       # zo_megatron and the sibling tools, for every part
    if _path not in sys.path:
        sys.path.insert(0, _path)

VARIANTS = ("zo_offload", "zo_offload_f0.5", "zo_baseline", "torch_ddp", "deepspeed_offload")
# The CPU-step schedules (docs/overlap.md), on request: --variants zo_offload,zo_offload_overlap,zo_offload_dpu
SCHEDULE_VARIANTS = ("zo_offload_overlap", "zo_offload_dpu", "zo_offload_dpu_predict")
HF_VARIANTS = ("torch_ddp", "deepspeed_offload")
REGIMES = {"compute-bound": dict(seq=256, micro_batch=4), "optimizer-bound": dict(seq=32, micro_batch=1)}
BETAS, EPS, WD = (0.9, 0.95), 1e-8, 0.1
# (layers, hidden, heads) for --sweep: ~10M .. ~1.3B parameters (vocab 50257)
SWEEP_SHAPES = ((2, 128, 4), (6, 512, 8), (12, 768, 12), (24, 1024, 16), (24, 1536, 16), (24, 2048, 16))


def world_name(tp: int, dp: int) -> str:
    if tp == 1 and dp == 1:
        return "1"
    return (f"tp{tp}" if tp > 1 else "") + (f"dp{dp}" if dp > 1 else "")


def regime_shape(args, regime: str) -> dict:
    """{'seq', 'micro_batch'} of a regime, with --seq / --micro-batch overriding it."""
    shape = dict(REGIMES[regime])
    if args.seq:
        shape["seq"] = args.seq
    if args.micro_batch:
        shape["micro_batch"] = args.micro_batch
    return shape


def cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def mem_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 << 30


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def median(xs):
    return statistics.median(xs) if xs else float("nan")


def gpt_params(layers: int, hidden: int, vocab: int, seq: int) -> int:
    """GPT-2 parameter count (tied embeddings, biases, 4h MLP)."""
    return vocab * hidden + seq * hidden + layers * (12 * hidden * hidden + 13 * hidden) + 2 * hidden


def deepspeed_status() -> tuple[bool, str]:
    """(importable, version or the reason it is not)."""
    if not _cuda_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")      # explicit: DeepSpeed's CPU accelerator
    try:
        import deepspeed
        return True, deepspeed.__version__
    except Exception as e:       # ImportError, or a broken install raising anything at import
        return False, f"deepspeed not importable ({type(e).__name__}: {str(e).splitlines()[0][:120]}); " \
                      "install it with `pip install deepspeed==0.19.8`"


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


_SPLIT: tuple[int, int] | None = None


def split_cpus() -> tuple[int, int]:
    """--split-cores: the first two CPUs the process could run on before it pinned its main
    thread (torch's, the CPU Adam's)."""
    global _SPLIT
    if _SPLIT is None:
        cpus = sorted(os.sched_getaffinity(0))
        _SPLIT = (cpus[0], cpus[1])
    return _SPLIT
