"""The decision behind `make test` / `make test-gpu` failing instead of skipping."""
import os
import subprocess
import sys

import pytest

from tests.requirements_check import missing_requirements

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _decide(**kw):
    base = dict(require_kernel=False, require_gpu_suite=False, have_cuda=False, have_compiler=True, kernel_built=True,
                importable=lambda name: True)
    base.update(kw)
    return missing_requirements(**base)


def test_make_test_fails_without_the_kernel_when_a_compiler_is_there():
    assert _decide(require_kernel=True, kernel_built=False) and "CPU Adam kernel" in _decide(
        require_kernel=True, kernel_built=False)[0]
    assert _decide(require_kernel=True, kernel_built=False, have_compiler=False) == []   # fallback's own tests
    assert _decide(require_kernel=True) == []
    assert _decide(kernel_built=False) == []         # a plain pytest run is not `make test`


@pytest.mark.parametrize("missing", ["transformers", "megatron.core"])
def test_make_test_gpu_fails_on_cuda_without_a_dependency(missing):
    got = _decide(require_gpu_suite=True, have_cuda=True, importable=lambda name: name != missing)
    assert len(got) == 1 and got[0].startswith(missing), got
    assert _decide(require_gpu_suite=True, have_cuda=False, importable=lambda name: name != missing) == []


def test_make_test_gpu_fails_on_cuda_without_the_kernel():
    got = _decide(require_gpu_suite=True, have_cuda=True, kernel_built=False, have_compiler=False)
    assert len(got) == 1 and "CPU Adam kernel" in got[0], got
    assert _decide(require_gpu_suite=True, have_cuda=True) == []


def test_the_session_stops_with_the_reason(tmp_path):
    """End to end: pytest under ZO_REQUIRE_KERNEL=1 with the kernel hidden (its import fails in
    the child) stops before any test, naming the kernel; with the kernel it runs."""
    hide = tmp_path / "sitecustomize.py"
    hide.write_text("import sys\nsys.modules['zo_megatron._cpu_adam'] = None\n")
    target = "tests/test_requirements_check.py::test_make_test_gpu_fails_on_cuda_without_the_kernel"
    for hidden in (True, False):
        path = [str(tmp_path)] if hidden else []
        env = dict(os.environ, ZO_REQUIRE_KERNEL="1", CXX=sys.executable,
                   PYTHONPATH=os.pathsep.join(path + [REPO, os.environ.get("PYTHONPATH", "")]))
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", target],
                           capture_output=True, text=True, env=env, cwd=REPO, timeout=120)
        out = r.stdout + r.stderr
        if hidden:
            assert r.returncode != 0 and "CPU Adam kernel" in out and "1 passed" not in out, out
        else:
            assert r.returncode == 0 and "1 passed" in out, out
