"""Per-step phase times of one rank, as JSON lines: what overlaps what (`--timeline FILE`).

One line per phase:  {"rank": 0, "iteration": 12, "phase": "backward", "micro": 1,
                      "start": 8123.41, "end": 8123.52}
Times are time.monotonic() seconds: one clock for every process on a machine, so the ranks'
files line up; tools/plot_timeline.py draws them. Phases: forward and backward (per
micro-batch, from the loop) and the optimizer's own (drain_phases(): grad_sync, cpu_step on the
DPU worker, cpu_step_speculated per bucket on the --overlap-cpu-step worker during backward,
cpu_step_rollback where a speculation is undone, cpu_step_wait, param_return; the baseline's
optimizer_step). On a GPU the loop
synchronises the device at the end of forward and backward while a timeline is written, so
their times are the device's, not the time to queue the kernels.
"""
from __future__ import annotations

import contextlib
import json
import os
import sys
import time

import torch


def timeline_path(path: str, rank: int, world_size: int) -> str:
    """FILE for a 1-rank run, FILE.rankN otherwise (each rank writes its own file)."""
    return path if world_size == 1 else f"{path}.rank{rank}"


class Timeline:
    def __init__(self, path: str, rank: int, world_size: int, device: torch.device):
        self.path = timeline_path(path, rank, world_size)
        self.rank = rank
        self._f = None
        try:
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
            self._f = open(self.path, "w")
        except OSError as exc:
            self._failed(exc)
        self._sync = device.type == "cuda"
        self._device = device

    @contextlib.contextmanager
    def phase(self, name: str, iteration: int, micro: int | None = None):
        t0 = time.monotonic()
        yield
        if self._sync:
            torch.cuda.synchronize(self._device)
        self.record(name, iteration, t0, time.monotonic(), micro)

    def record(self, name: str, iteration: int, start: float, end: float, micro: int | None = None) -> None:
        row = {"rank": self.rank, "iteration": iteration, "phase": name, "start": round(start, 6),
               "end": round(end, 6)}
        if micro is not None:
            row["micro"] = micro
        if self._f is not None:
            try:
                self._f.write(json.dumps(row) + "\n")
            except OSError as exc:
                self._failed(exc)

    def record_all(self, iteration: int, phases) -> None:
        for name, start, end in phases:
            self.record(name, iteration, start, end)
        if self._f is not None:
            try:
                self._f.flush()
            except OSError as exc:
                self._failed(exc)

    def _failed(self, exc: OSError) -> None:
        """A timeline that cannot be written (a full disk) stops with one warning, not the run: each
        rank writes its own, and one rank raising would leave the others in their next collective."""
        print(f"warning: --timeline {self.path} (rank {self.rank}): writing failed ({type(exc).__name__}: {exc}); "
              "the timeline stops here, training goes on", file=sys.stderr, flush=True)
        f, self._f = self._f, None
        if f is not None:
            with contextlib.suppress(OSError):
                f.close()

    def close(self) -> None:
        if self._f is not None:
            with contextlib.suppress(OSError):
                self._f.close()
            self._f = None
