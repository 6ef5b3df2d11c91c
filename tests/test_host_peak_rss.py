"""metrics.host_rss_bytes is the peak of the process's own memory, not of the process that started it.

getrusage's ru_maxrss survives exec on Linux: a process spawned by a large parent (torchrun's
launcher, a benchmark driver, pytest) reports at least the parent's resident set at the spawn. The
job logged that as its rank's peak, bench_train's sweep as each size's "own" peak, and
test_convert_peak failed in the full suite (9.8 B/param, 5.2 alone) because pytest had grown.

The child here is started by this test process while it holds a large touched buffer; the child
touches a buffer of its own, frees it, and reports. Its peak must cover its own buffer (a peak, not
the current RSS) and stay below the parent's buffer (the old ru_maxrss reported more than that).
"""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys

from tests.seeds import fresh_seed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MiB = 1 << 20

_CHILD = r"""
import json, sys
from zo_megatron.training.metrics import host_rss_bytes, proc_memory_bytes
base = proc_memory_bytes()["vmrss"]
own = bytearray(int(sys.argv[1]))
own[::4096] = b"\1" * len(range(0, len(own), 4096))      # touch every page
del own
print(json.dumps({"base": base, "now": proc_memory_bytes()["vmrss"], "peak": host_rss_bytes()}))
"""


def test_peak_is_the_process_own_and_not_its_parents():
    rng = random.Random(fresh_seed("host peak rss"))
    parent_bytes = rng.randrange(900, 1400) * MiB
    child_bytes = rng.randrange(150, 400) * MiB
    held = bytearray(parent_bytes)
    held[::4096] = b"\1" * len(range(0, parent_bytes, 4096))
    try:
        res = subprocess.run([sys.executable, "-c", _CHILD, str(child_bytes)], capture_output=True, text=True,
                             timeout=120, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT))
    finally:
        del held
    assert res.returncode == 0, res.stderr[-2000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    print(f"parent held {parent_bytes / MiB:.0f} MiB; child base {out['base'] / MiB:.0f} MiB, own buffer "
          f"{child_bytes / MiB:.0f} MiB, now {out['now'] / MiB:.0f} MiB, reported peak {out['peak'] / MiB:.0f} MiB")
    # a few pages of slack below: the buffer's edge pages, and what the interpreter frees meanwhile
    assert out["peak"] >= out["base"] + child_bytes - 4 * MiB, "the peak must include the buffer the child freed"
    assert out["peak"] < out["base"] + child_bytes + 64 * MiB, "the peak counts memory the child never held"
    assert out["peak"] < parent_bytes, "the peak includes the parent's memory"
