"""megatron-core's torch.compile decorators are no-ops in zo_megatron's processes (zo_megatron/megatron_jit.py).

Applying torch.compile at import imported torch._dynamo and torch._inductor into every rank of every launch (~2 s of
its start here), for functions the model never calls compiled. In a fresh interpreter: importing zo_megatron then the
megatron-core modules the model uses leaves torch._dynamo unimported, megatron-core's jit_fuser is its own
noop_decorator, and its decorated helpers are the plain functions (the same math: squared_relu is compared with its
definition on random inputs). Old code: megatron.core.activations.squared_relu was a torch._dynamo wrapper.
"""
import subprocess
import sys
from pathlib import Path

from tests.seeds import fresh_seed

ROOT = Path(__file__).resolve().parents[1]

PROBE = """
import sys, types, torch
import zo_megatron
from zo_megatron.model import gpt                       # the model's megatron-core modules
from megatron.core.models.gpt import GPTModel           # noqa: F401
from megatron.core.transformer.moe import router        # noqa: F401 (its decorated expert-bias counter)
from megatron.core import activations, jit
assert "torch._dynamo" not in sys.modules, "torch._dynamo was imported"
assert jit.jit_fuser is jit.noop_decorator, jit.jit_fuser
f = activations.squared_relu
assert isinstance(f, types.FunctionType) and f.__module__ == "megatron.core.activations", type(f)
assert isinstance(router.TopKRouter._apply_expert_bias, types.FunctionType)
g = torch.Generator().manual_seed(int(sys.argv[1]))
x = torch.randn(64, 33, generator=g, dtype=torch.float64)
assert torch.equal(f(x), torch.square(torch.relu(x)))
print("ok")
"""


def test_megatron_core_compiles_nothing_in_our_processes():
    seed = fresh_seed("megatron jit")
    r = subprocess.run([sys.executable, "-c", PROBE, str(seed)], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout[-2000:] + r.stderr[-3000:]


def test_installing_after_megatron_core_was_imported_still_applies_to_later_modules():
    """A program that imported megatron-core before zo_megatron: megatron's own switch is thrown at once, so every
    megatron-core module imported later gets the no-op (those imported before keep what they were given)."""
    probe = ("import megatron.core.jit as jit, zo_megatron\n"
             "assert jit.jit_fuser is jit.noop_decorator, jit.jit_fuser\nprint('ok')\n")
    r = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout[-2000:] + r.stderr[-3000:]
