"""What tools/find_max_model.py and tools/find_max_model_deepspeed.py both use: the monotone search
over model sizes and running a script under torchrun while sampling its process tree's memory.

The two tools import this module and never each other in a cycle (issue 36; tests/test_import_graph.py):
find_max_model imports find_max_model_deepspeed (only with --deepspeed), which imports only this.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from zo_megatron.planner.units import MiB  # noqa: E402
from zo_megatron.training.metrics import proc_memory_bytes  # noqa: E402


def largest(fits, limit: int) -> int:
    """Largest k in [1, limit] with fits(k), for a monotone `fits` (0: none): the planner's search."""
    from zo_megatron.planner import largest_monotone

    return largest_monotone(fits, limit)


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


class TreeSampler(threading.Thread):
    """Every `interval` s: VmRSS of every process under `root`, summed (peak kept), and each
    process's VmHWM (its own peak, also between samples)."""

    def __init__(self, root: int, interval: float = 0.05):
        super().__init__(daemon=True)
        self.root, self.interval = root, interval
        self.peak_tree_rss, self.samples = 0, 0
        self.hwm: dict[int, int] = {}
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.is_set():
            total = 0
            for pid in _descendants(self.root):
                st = proc_memory_bytes(pid)
                total += st.get("vmrss", 0)
                if "vmhwm" in st:
                    self.hwm[pid] = max(self.hwm.get(pid, 0), st["vmhwm"])
            self.peak_tree_rss = max(self.peak_tree_rss, total)
            self.samples += 1
            self._halt.wait(self.interval)

    def stop(self) -> None:
        self._halt.set()
        self.join()


def run_command(script_and_args: list[str], nproc: int, host_bytes: int, *, timeout: float, tag: str) -> dict:
    """A script under torchrun (`python -m torch.distributed.run`), seeing `host_bytes` as its node's
    memory (SLURM_MEM_PER_NODE); its progress lines streamed with a prefix; the process tree's memory
    sampled."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           *script_and_args]
    env = dict(os.environ, SLURM_MEM_PER_NODE=str(host_bytes // MiB), PYTHONUNBUFFERED="1")
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT)
    sampler = TreeSampler(proc.pid)
    sampler.start()
    lines: list[str] = []
    timer = threading.Timer(timeout, proc.kill)
    timer.start()
    try:
        for line in proc.stdout:
            line = line.rstrip("\n")
            lines.append(line)
            if line.startswith((" iter", "error:", "zo_megatron pretrain_gpt", " model:", " done:", " model states")):
                print(f"  [{tag}] {line.strip()}", flush=True)
        rc = proc.wait()
    finally:
        timer.cancel()
        sampler.stop()
    rank_codes = [int(c) for c in re.findall(r"exitcode\s*:\s*(-?\d+)", "\n".join(lines))]
    return dict(command=cmd, rc=rc, rank_exit_codes=rank_codes, wall_s=round(time.monotonic() - t0, 1),
                peak_tree_rss_bytes=sampler.peak_tree_rss, sum_process_hwm_bytes=sum(sampler.hwm.values()),
                launcher_hwm_bytes=sampler.hwm.get(proc.pid, 0), samples=sampler.samples,
                error_lines=[x for x in lines if x.startswith("error:")], output_tail=lines[-40:])
