"""What docs/gpu.md records of each GPU test: its last outcome on a GPU, or that it never ran on one.

docs/gpu.md's section "Which GPU tests have run" is the one record (tests/test_gpu_suite_logic.py
keeps it equal to the collected suite). Its lists sit under lines ending in "passed:", in
"failed ...:" or "Never run on a GPU:"; each test id appears once, under its latest outcome.

The suite runs what has not passed on a GPU first (conftest.py): a GPU is lent for about 15
minutes, and a time budget that stops the suite should cut what is already proven, not the tests
whose first GPU result is the point of the run.
"""
from __future__ import annotations

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOC = os.path.join(ROOT, "docs", "gpu.md")
SECTION = "\n## Which GPU tests have run\n"

# run order of the suite: failed on a GPU last time, then never run there, then passed there
RUN_ORDER = {"failed": 0, "never": 1, "passed": 2}


def gpu_record(path: str = DOC) -> list[tuple[str, str]]:
    """(test id relative to tests/gpu, "passed" | "failed" | "never") in the document's order.
    A test id under no heading of the three kinds raises: the record must say which it is."""
    with open(path) as f:
        text = "\n" + f.read()        # the section may open the file
    if SECTION not in text:
        raise ValueError(f"{path} has no '{SECTION.strip()}' section")
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    out, status = [], None
    for line in section.splitlines():
        m = re.match(r"^- `(test_gpu_[^`]+)`", line)
        if m:
            if status is None:
                raise ValueError(f"{path}: `{m.group(1)}` is listed under no 'passed:', 'failed' or 'Never run' line")
            out.append((m.group(1), status))
        elif line.startswith("Never run on a GPU"):
            status = "never"
        elif re.search(r"\bpassed:\s*$", line):
            status = "passed"
        elif re.search(r"\bfailed\b.*:\s*$", line):
            status = "failed"
    return out


def run_rank(test_id: str, record: dict[str, str]) -> int:
    """Where a collected test goes in the suite's order; a test the record does not know (added since
    the last GPU run) counts as never run."""
    return RUN_ORDER[record.get(test_id, "never")]
