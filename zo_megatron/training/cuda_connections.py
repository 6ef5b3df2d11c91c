"""CUDA_DEVICE_MAX_CONNECTIONS=1 at TP > 1, set before anything can start CUDA.

CUDA reads the variable once, when it initialises, and parsing the arguments already calls
torch.cuda.is_available() (cpu_precision.default_precision), which may initialise it. So the job's
entry point (pretrain/pretrain_gpt.py main()) sets it first, from the raw command line, before
parsing or importing anything that might touch CUDA; training.loop.pretrain() calls this again
before its parsing, for callers that start there (idempotent: setdefault, and a variable already
set by the user wins). Only light imports here: importing this module must not start CUDA.
"""
from __future__ import annotations

import os
import sys

# training/arguments.py's spellings of the TP size (its parser has allow_abbrev=False, so no prefixes)
TP_FLAGS = ("--tensor-model-parallel-size", "--tensor-parallel")


def tensor_parallel_from_argv(argv=None) -> int:
    """The TP size the command line asks for as argparse will read it (`--flag N` or `--flag=N`,
    the last one wins; 1 without one). A malformed value counts as 1: argparse reports it."""
    argv = sys.argv[1:] if argv is None else list(argv)
    tp, i = 1, 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":                  # what follows is positional to argparse
            break
        name, eq, value = arg.partition("=")
        if name in TP_FLAGS:
            if not eq:
                value = argv[i + 1] if i + 1 < len(argv) else ""
                i += 1
            try:
                tp = int(value)
            except ValueError:
                tp = 1
        i += 1
    return tp


def set_cuda_device_max_connections(argv=None) -> bool:
    """Set CUDA_DEVICE_MAX_CONNECTIONS=1 (unless already set) when the command line asks for TP > 1;
    returns whether TP > 1. Call before anything can initialise CUDA."""
    if tensor_parallel_from_argv(argv) <= 1:
        return False
    # As Megatron-LM's launch scripts do: one hardware queue, so each TP layer's async
    # all-reduce is scheduled before the weight-gradient GEMM it overlaps (set before CUDA starts).
    # The cost (issue 27, item 4; unmeasured): in one in-order queue, the side stream's wait for
    # a bucket's reduce-scatter (offload/device.py copy_home) may hold back backward kernels
    # queued after it, where Megatron waits for its reduce-scatters only at the end of
    # backward. The TP overlap is kept as Megatron has it; tests/gpu/test_gpu_stream_connections.py
    # measures the stall on the first GPU lent, and docs/gpu.md says what to change if it shows.
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    return True


def set_nccl_memory_defaults() -> None:
    """NCCL_NVLS_ENABLE=0 unless the user set it. NVLink SHARP (NVLS, on by default from NCCL 2.17
    on NVSwitch systems such as DGX H100) keeps multicast buffers per communicator that the memory
    planner does not count and that were never measured here; a default may only use memory the plan
    shows is free (issue 34, 2.7). NCCL_NVLS_ENABLE=1 turns it back on (faster large all-reduces on
    NVSwitch, more device memory: leave margin in the plan). NCCL reads it when a communicator is
    created, so this only has to run before the process group."""
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

