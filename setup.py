"""Builds the CPU Adam kernel (csrc/) as a plain pybind11 extension.

No torch headers: the module takes raw buffers, builds in seconds and keeps working when a
cluster's torch differs from the one it was built beside. The ISA (AVX-512 / AVX2 / scalar) is
chosen at run time from CPUID, so the module is compiled WITHOUT -march=native. If the compiler
fails, the package still installs and falls back to torch's fused AdamW (with one warning).
"""
import sys

from setuptools import setup
from setuptools.command.build_ext import build_ext

try:
    from pybind11.setup_helpers import Pybind11Extension
except ImportError:  # pybind11 missing from the build env: install pure-Python
    Pybind11Extension = None


class OptionalBuildExt(build_ext):
    """A failed kernel build must not break `pip install`: the torch fallback still works."""

    def run(self):
        try:
            super().run()
        except Exception as exc:  # noqa: BLE001 - report and continue with the fallback
            print(f"WARNING: zo_megatron CPU Adam extension not built ({exc}); "
                  "the torch fused AdamW fallback will be used.", file=sys.stderr)

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception as exc:  # noqa: BLE001
            print(f"WARNING: building {ext.name} failed ({exc}); "
                  "the torch fused AdamW fallback will be used.", file=sys.stderr)


ext_modules = []
if Pybind11Extension is not None:
    ext_modules.append(
        Pybind11Extension(
            "zo_megatron._cpu_adam",
            ["csrc/cpu_adam.cpp"],
            depends=["csrc/cpu_adam_avx512.inc",  # #included twice (AVX-512 with/without AVX512_BF16)
                     "csrc/checksum.inc"],   # CRC32C, the NVMe tier's block checksum
            cxx_std=17,
            # -Wno-*uninitialized: GCC 12's own AVX-512 headers trip these (the `__Y = __Y` idiom).
            extra_compile_args=["-O3", "-fopenmp", "-fno-math-errno",
                                "-Wno-uninitialized", "-Wno-maybe-uninitialized"],
            extra_link_args=["-fopenmp"],
        )
    )

setup(ext_modules=ext_modules, cmdclass={"build_ext": OptionalBuildExt})
