"""The GPU suite's choices that can be checked without a GPU, and what the docs say of it."""
import os
import re
import subprocess
import sys

import pytest

from tests.gpu.conftest import dp2_backend

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("gpus,want", [(0, "gloo"), (1, "cpu:gloo,cuda:gloo"), (2, "cpu:gloo,cuda:nccl"),
                                       (8, "cpu:gloo,cuda:nccl")])
def test_dp2_worlds_use_nccl_when_each_rank_has_a_gpu(gpus, want):
    assert dp2_backend(gpus) == want


def _gpu_doc_lists():
    """docs/gpu.md's "Which GPU tests have run": (ran, never run), test ids relative to tests/gpu."""
    text = open(os.path.join(ROOT, "docs", "gpu.md")).read()
    section = text.split("\n## Which GPU tests have run\n", 1)[1].split("\n## ", 1)[0]
    ran_part, never_part = section.split("\nNever run on a GPU:\n", 1)
    ids = lambda part: [m.group(1) for m in re.finditer(r"^- `(test_gpu_[^`]+)`", part, re.M)]  # noqa: E731
    return ids(ran_part), ids(never_part)


def test_docs_name_every_gpu_test_and_whether_it_ran():
    """Stale GPU facts (issue 27, item 11) fail here: every collected GPU test is in exactly one
    of docs/gpu.md's two lists, nothing else is, and README's counts are the lists' lengths."""
    r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                        "tests/gpu"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    collected = sorted(line.split("tests/gpu/", 1)[1] for line in r.stdout.splitlines()
                       if line.startswith("tests/gpu/") and "::" in line)
    ran, never = _gpu_doc_lists()
    assert len(set(ran)) == len(ran) and len(set(never)) == len(never) and not set(ran) & set(never)
    assert sorted(ran + never) == collected, (sorted(set(collected) - set(ran + never)),
                                              sorted(set(ran + never) - set(collected)))
    readme = open(os.path.join(ROOT, "README.md")).read()
    m = re.search(r"`tests/gpu` held then; it holds (\d+) now, (\d+) never run on a GPU", readme)
    assert m and (int(m.group(1)), int(m.group(2))) == (len(collected), len(never)), m and m.group(0)
