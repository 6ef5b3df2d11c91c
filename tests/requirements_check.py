"""What a `make test` / `make test-gpu` run must have, decided before any test runs, so that a
missing piece fails the run instead of turning tests into skips.

- `make test` (ZO_REQUIRE_KERNEL=1): on a machine with a C++ compiler the CPU Adam kernel must have
  built; without a compiler the torch fallback is the product and keeps its own tests.
- `make test-gpu` on a CUDA machine (ZO_REQUIRE_GPU_SUITE=1): transformers and megatron-core must
  import and the CPU Adam kernel must have built. Without CUDA the GPU suite still skips.
"""
from __future__ import annotations

import importlib.util
import os
import shutil


def missing_requirements(*, require_kernel: bool, require_gpu_suite: bool, have_cuda: bool, have_compiler: bool,
                         kernel_built: bool, importable) -> list[str]:
    """One line per missing requirement (empty: run the tests). `importable(name)` says whether a
    module imports."""
    problems = []
    kernel_line = ("the CPU Adam kernel (zo_megatron/_cpu_adam*.so) did not build: rebuild it with "
                   "`pip install --no-build-isolation -e .` and read the compiler's error")
    if require_kernel and have_compiler and not kernel_built:
        problems.append(kernel_line + " (a compiler is present, so the kernel is expected)")
    if require_gpu_suite and have_cuda:
        for module, package in (("transformers", "transformers"), ("megatron.core", "megatron-core==0.16.1")):
            if not importable(module):
                problems.append(f"{module} does not import: install {package} (the GPU suite needs it)")
        if not kernel_built and kernel_line not in " ".join(problems):
            problems.append(kernel_line + " (the GPU suite runs the offload engine's host side)")
    return problems


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def have_compiler() -> bool:
    return any(shutil.which(c) for c in filter(None, (os.environ.get("CXX"), "c++", "g++", "clang++")))


def check_from_environment() -> list[str]:
    require_kernel = os.environ.get("ZO_REQUIRE_KERNEL") == "1"
    require_gpu = os.environ.get("ZO_REQUIRE_GPU_SUITE") == "1"
    if not (require_kernel or require_gpu):
        return []
    import torch

    from zo_megatron.offload import cpu_adam

    return missing_requirements(require_kernel=require_kernel, require_gpu_suite=require_gpu,
                                have_cuda=torch.cuda.is_available(), have_compiler=have_compiler(),
                                kernel_built=cpu_adam._ext is not None, importable=_importable)
