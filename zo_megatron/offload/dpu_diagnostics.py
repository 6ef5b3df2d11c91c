"""Debug only: how far the device's weights are from the exact weights under DPU (issue 37).

    ZO_DPU_DIAGNOSTICS=FILE[:EVERY]       (EVERY: default 10)

With DPU (schedules.DelayedSchedule) the forward/backward of update n's gradient runs on the device
copy p_n, while exact updates would run it on w_n, the master after update n-1, which the CPU is
still computing. At every update n that is a multiple of EVERY, when the join of update n-1 (in
step(), on the main thread) has made w_n, rank 0 appends one JSON line to FILE:

    {"update": n, "weight_error": ||p_n - w_n|| / ||w_n - w_{n-1}||,
     "device_vs_exact": ||p_n - w_n||, "last_update": ||w_n - w_{n-1}||}

norms over the whole model (every TP and DP rank; TP-replicated parameters once, as the grad norm).
Plain DPU gives 1 (in fp32 exactly), weight prediction less, exact updates 0. An update whose
predecessor was joined by a flush (evaluation, checkpoint) ran on the exact master: no line.

Cost when the variable is unset: nothing (the schedule holds None and tests it once per step and
per join). When set, per diagnosed update: a copy of the host master partition (fp32, 4 B/param on
the host, freed at the join), the device copy's partition copied home, two fp64 sums and one
all-reduce of two numbers on the main thread. tools/dpu_convergence.py sets it.
"""
from __future__ import annotations

import json
import math
import os

import torch

from zo_megatron.parallel import collectives

ENV = "ZO_DPU_DIAGNOSTICS"


class WeightError:
    """The diagnostic above, driven by DelayedSchedule: before_submit() when an update is handed
    to the worker, after_join() when it is joined."""

    def __init__(self, path: str, every: int = 10):
        if every < 1:
            raise ValueError(f"{ENV}: EVERY must be >= 1 (got {every})")
        self.path, self.every = path, every
        self._before: torch.Tensor | None = None       # w_{n-1}: the master before update n-1

    @classmethod
    def from_env(cls) -> "WeightError | None":
        spec = os.environ.get(ENV, "").strip()
        if not spec:
            return None
        path, _, every = spec.rpartition(":")
        if not every.isdigit():                          # FILE alone (which may hold a colon)
            return cls(spec)
        return cls(path, int(every))

    def before_submit(self, engine) -> None:
        """Main thread, worker idle: update engine.step_count is about to be handed to the worker.
        Keep the master before it when the update after it is diagnosed."""
        self._before = engine.master.clone() if (engine.step_count + 1) % self.every == 0 else None

    @torch.no_grad()
    def after_join(self, engine, from_step: bool) -> None:
        """Main thread, right after the worker finished: the master is w_n, the device still holds
        p_n. `from_step`: joined by step() (a flush has sent p = w: nothing to measure)."""
        before, self._before = self._before, None
        if before is None or not from_step:
            return
        master = engine.master
        device = torch.empty_like(master)                # this rank's partition of the device copy
        for bucket in engine.layout.buckets:
            lo, hi = bucket.shard_range(engine.dp_rank)
            n = min(hi - lo, max(0, engine._cut - bucket.host_start))
            if n:
                device[bucket.host_start:bucket.host_start + n].copy_(engine.flat[lo:lo + n])
        sums = torch.zeros(2, dtype=torch.float64)
        for s, e, counted in engine._norm_segments:
            if counted:
                sums[0] += (device[s:e].double() - master[s:e].double()).pow(2).sum()
                sums[1] += (master[s:e].double() - before[s:e].double()).pow(2).sum()
        collectives.all_reduce(sums)                     # every TP and DP rank, as the grad norm
        err, step = math.sqrt(sums[0].item()), math.sqrt(sums[1].item())
        if collectives.group_rank() == 0:
            row = {"update": engine.step_count + 1, "weight_error": err / step if step > 0 else None,
                   "device_vs_exact": err, "last_update": step}
            with open(self.path, "a") as f:
                f.write(json.dumps(row) + "\n")
