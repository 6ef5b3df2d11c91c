"""A CPU rank's resident set as the memory planner counts it: glibc's malloc returns freed tensors.

glibc serves an allocation at or above its mmap threshold with a mapping of its own, which free()
unmaps at once; below it, from the heap, where a freed chunk between live ones stays resident. The
threshold is dynamic: each freed mapping raises it to that mapping's size (up to 32 MiB), so after
the first steps a CPU rank's gradients, weight copies and activations of a few MiB all come from
the heap, and the heap keeps what the backward pass freed. Measured with tools/find_max_model.py's
runs (issue 35, item 16; docs/memory_planner.md): GPT-2 at hidden 512, 28 layers, bf16, a rank held
0.42 GiB beyond its model states and planned activations (+14% over the plan at 3 GiB), growing
with the number of layers; with the threshold pinned at 1 MiB, 0.10 GiB, as at 4 layers. Setting
the threshold (mallopt M_MMAP_THRESHOLD) turns the dynamic adjustment off. Cost: tensors of 1 MiB
and more are mapped afresh each time (a few % more CPU time in an fp32 MLP micro-benchmark; within
the noise of a training step). The planner's CPU process overhead (planner/presets.py) is measured
with it. MALLOC_MMAP_THRESHOLD_ in the environment (glibc's own knob) is left to win.
"""
from __future__ import annotations

import ctypes
import os

M_MMAP_THRESHOLD = -3                  # glibc's malloc.h
MMAP_THRESHOLD_BYTES = 1 << 20


def pin_mmap_threshold(nbytes: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Pin glibc's mmap threshold at `nbytes` for this process; False where the C library is not
    glibc or MALLOC_MMAP_THRESHOLD_ already decides."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version          # glibc only (musl's mallopt does nothing)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt(M_MMAP_THRESHOLD, nbytes) == 1


def keep_host_memory_plannable(device_is_host: bool) -> bool:
    """On a CPU device (the planner's unified RAM) pin the threshold; a GPU run's host side is
    preallocated (pinned buffers) and left alone."""
    return pin_mmap_threshold() if device_is_host else False
