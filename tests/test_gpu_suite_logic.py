"""The GPU suite's choices that can be checked without a GPU, and what the docs say of it."""
import os
import re
import subprocess
import sys

import pytest

from tests.gpu.conftest import dp2_backend
from tests.gpu.record import RUN_ORDER, gpu_record

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("gpus,want", [(0, "gloo"), (1, "cpu:gloo,cuda:gloo"), (2, "cpu:gloo,cuda:nccl"),
                                       (8, "cpu:gloo,cuda:nccl")])
def test_dp2_worlds_use_nccl_when_each_rank_has_a_gpu(gpus, want):
    assert dp2_backend(gpus) == want


def _gpu_doc_lists():
    """docs/gpu.md's "Which GPU tests have run": (ran, never run), test ids relative to tests/gpu."""
    record = gpu_record()
    return [t for t, s in record if s != "never"], [t for t, s in record if s == "never"]


def _collect(env=None) -> list[str]:
    r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                        "tests/gpu"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env=None if env is None else dict(os.environ, **env))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return [line.split("tests/gpu/", 1)[1] for line in r.stdout.splitlines()
            if line.startswith("tests/gpu/") and "::" in line]


def test_docs_name_every_gpu_test_and_whether_it_ran():
    """Stale GPU facts (issue 27, item 11) fail here: every collected GPU test is in exactly one
    of docs/gpu.md's two lists, nothing else is, and README's counts are the lists' lengths."""
    collected = sorted(_collect())
    ran, never = _gpu_doc_lists()
    assert len(set(ran)) == len(ran) and len(set(never)) == len(never) and not set(ran) & set(never)
    assert sorted(ran + never) == collected, (sorted(set(collected) - set(ran + never)),
                                              sorted(set(ran + never) - set(collected)))
    readme = open(os.path.join(ROOT, "README.md")).read()
    m = re.search(r"`tests/gpu` held then; it holds (\d+) now, (\d+) never run on a GPU", readme)
    assert m and (int(m.group(1)), int(m.group(2))) == (len(collected), len(never)), m and m.group(0)


def test_the_suite_runs_what_has_not_passed_on_a_gpu_first():
    """Where the suite runs (here its CPU check; on CUDA the same hook), the tests that failed on a GPU
    last time come first, then those never run there, then the proven ones: the lent GPU's budget cut
    the suite at 20 of 35 tests on 2026-11-27 and the cut fell on chance, not on what was proven."""
    order = _collect({"ZO_GPU_SUITE_ON_CPU": "1"})
    record = dict(gpu_record())
    ranks = [RUN_ORDER[record[t]] for t in order]
    print("run order:", [record[t] for t in order])
    assert ranks == sorted(ranks) and set(ranks) == set(RUN_ORDER.values()), order
    # within a group, pytest's own order (file, then definition) stands
    for r in set(ranks):
        group = [t for t in order if RUN_ORDER[record[t]] == r]
        assert group == [t for t in _collect() if t in group], group


def test_the_record_reads_each_heading_kind_and_refuses_an_id_under_none(tmp_path):
    doc = tmp_path / "gpu.md"
    doc.write_text("# x\n\n## Which GPU tests have run\n\nintro\n- `test_gpu_z.py::orphan`\n")
    with pytest.raises(ValueError, match="orphan"):
        gpu_record(str(doc))
    doc.write_text("## Which GPU tests have run\n\nAt commit abc, 2026-12-01, passed:\n- `test_gpu_a.py::t[x]`\n\n"
                   "At commit abc, failed (causes above):\n- `test_gpu_b.py::t` (why)\n\n"
                   "Never run on a GPU:\n- `test_gpu_c.py::t` (needs two GPUs)\n\n## Next\n- `test_gpu_d.py::t`\n")
    assert gpu_record(str(doc)) == [("test_gpu_a.py::t[x]", "passed"), ("test_gpu_b.py::t", "failed"),
                                    ("test_gpu_c.py::t", "never")]
