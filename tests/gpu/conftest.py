"""The GPU suite: skipped cleanly without CUDA (`make test` collects it and reports the skips).

ZO_GPU_SUITE_ON_CPU=1 runs the tests that make sense without a GPU on the CPU instead, to check
the suite itself on a machine without one; it proves nothing about CUDA.
"""
import os

import pytest
import torch

DRY_RUN = os.environ.get("ZO_GPU_SUITE_ON_CPU") == "1"
HAVE_CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if HAVE_CUDA or DRY_RUN:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU: `make test-gpu` on a GPU machine runs this suite")
    here = os.path.dirname(os.path.abspath(__file__))
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(skip)


def device() -> torch.device:
    return torch.device("cuda", 0) if HAVE_CUDA else torch.device("cpu")


def needs_cuda(reason: str):
    """For checks that only mean something on a GPU (pinned memory, the CUDA allocator)."""
    return pytest.mark.skipif(not HAVE_CUDA, reason=f"CUDA only: {reason}")
