"""The GPU suite: skipped cleanly without CUDA (`make test` collects it and reports the skips).

ZO_GPU_SUITE_ON_CPU=1 runs the tests that make sense without a GPU on the CPU instead, to check
the suite itself on a machine without one; it proves nothing about CUDA.

Where the suite runs (CUDA, or that CPU check), it runs in the order of docs/gpu.md's record
(record.py): what failed on a GPU last time first, then what never ran on one, then what passed.
"""
import os

import pytest
import torch

DRY_RUN = os.environ.get("ZO_GPU_SUITE_ON_CPU") == "1"
HAVE_CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if HAVE_CUDA or DRY_RUN:
        _unproven_first(items)
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU: `make test-gpu` on a GPU machine runs this suite")
    here = os.path.dirname(os.path.abspath(__file__))
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(skip)


def _unproven_first(items) -> None:
    """Sort the GPU tests in place by their record (stable: file order within a group); pytest-xdist
    hands tests out in this order, so a budget that stops the suite cuts the proven tests."""
    from tests.gpu.record import gpu_record, run_rank

    here = os.path.dirname(os.path.abspath(__file__))
    record = dict(gpu_record())
    rel = lambda item: item.nodeid.split("tests/gpu/", 1)[-1]          # noqa: E731
    gpu = [i for i in items if str(i.fspath).startswith(here)]
    if gpu:
        first = items.index(gpu[0])
        rest = [i for i in items if i not in gpu]
        items[:] = rest[:first] + sorted(gpu, key=lambda i: run_rank(rel(i), record)) + rest[first:]


def dp2_backend(cuda_devices: int | None = None) -> str:
    """The backend map of a DP=2 world: NCCL for CUDA tensors when two GPUs are there (one rank
    each: the real thing), gloo for CUDA tensors when two ranks share one GPU (NCCL refuses two
    ranks on one device), plain gloo on the CPU dry run."""
    n = torch.cuda.device_count() if cuda_devices is None else cuda_devices
    if n >= 2:
        return "cpu:gloo,cuda:nccl"
    return "cpu:gloo,cuda:gloo" if n == 1 else "gloo"


def device() -> torch.device:
    return torch.device("cuda", 0) if HAVE_CUDA else torch.device("cpu")


def needs_cuda(reason: str):
    """For checks that only mean something on a GPU (pinned memory, the CUDA allocator)."""
    return pytest.mark.skipif(not HAVE_CUDA, reason=f"CUDA only: {reason}")


def nvml_process_bytes(index: int = 0) -> int | None:
    """This process's memory on GPU `index` as NVML sees it (CUDA context, allocator cache, cuBLAS
    workspace and NCCL buffers included, which torch.cuda.max_memory_allocated does not count);
    None where NVML or its per-process accounting is not available."""
    try:
        import pynvml
        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(index)
        for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(h):
            if proc.pid == os.getpid() and proc.usedGpuMemory is not None:
                return int(proc.usedGpuMemory)
    except Exception:  # noqa: BLE001 - no NVML: the caller says so
        return None
    return None
