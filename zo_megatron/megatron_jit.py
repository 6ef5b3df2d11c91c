"""megatron-core's torch.compile decorators, made no-ops before they are applied (zo_megatron/__init__.py installs this).

megatron-core decorates its fused helpers (fusions/*.py, activations.py, a router method) with
`megatron.core.jit.jit_fuser`, which its jit.py sets to torch.compile when it is imported. Applying torch.compile
imports torch._dynamo and torch._inductor: about 2 s of every process's start on these CPUs (`import
megatron.core.models.gpt`: 4.6 s, 2.6 s with the decorators no-ops), paid by every rank of every launch; on a CPU the
first call of a decorated function then compiles for seconds more. zo_megatron's model runs megatron-core's unfused
local layers (every fusion flag off; its own quick_gelu and squared_relu), so the one decorated function on its path
is the router's expert-bias token counter (an in-place sum under no_grad), which computes the same uncompiled.

megatron-core's own switch, `jit.disable_jit_fuser()`, only works before the decorators run: between jit.py's
execution and the first `from megatron.core.jit import jit_fuser`. jit.py is imported from inside megatron.core's
package __init__, so no caller can get in between; an import hook can: it runs jit.py, then disable_jit_fuser(),
before the importing module reads the name. Where megatron.core.jit was imported before zo_megatron, the switch still
applies to every module imported after.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys

_JIT = "megatron.core.jit"


class _DisableOnLoad(importlib.abc.Loader):
    """Runs megatron.core.jit as its own loader would, then megatron-core's disable_jit_fuser()."""

    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        module.disable_jit_fuser()


class _JitFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != _JIT:
            return None
        sys.meta_path.remove(self)              # once: the real finders from here on
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is not None and spec.loader is not None:
            spec.loader = _DisableOnLoad(spec.loader)
        return spec


def install() -> None:
    """Make megatron-core's jit_fuser a no-op for every module that imports it from now on (idempotent)."""
    module = sys.modules.get(_JIT)
    if module is not None:
        module.disable_jit_fuser()
    elif not any(isinstance(f, _JitFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _JitFinder())
