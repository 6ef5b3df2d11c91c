"""Megatron-LM's `--profile`: a torch.profiler trace of a few iterations, one file per profiled rank.

    --profile --profile-step-start 10 --profile-step-end 12 --profile-ranks 0 1

As in Megatron-LM, the profiler starts when `--profile-step-start` iterations have completed and
stops when `--profile-step-end` have (iterations 11 and 12 above, the numbers the log prints; after
a resume the count goes on from the checkpoint's iteration), on the ranks `--profile-ranks` names
(default rank 0). Megatron-LM records with nsys unless `--use-pytorch-profiler`; here the recorder is
always torch.profiler (CPU activity, and CUDA on a GPU; shapes and Python stacks, Megatron's
settings), so a CPU-only run is profiled too. Each profiled rank writes

    DIR/rank{R}.iter{FIRST}-{LAST}.pt.trace.json

a Chrome trace (chrome://tracing, Perfetto, or TensorBoard's profiler plugin, which reads
`*.pt.trace.json`), where DIR is `--tensorboard-dir` (where Megatron-LM's trace handler writes), else
`--save`/profile, else ./profile. The cost when `--profile` is off: nothing (no profiler is built).
"""
from __future__ import annotations

import contextlib
import os
import sys

from zo_megatron.errors import ConfigError


def check_profile_args(args, world_size: int) -> None:
    """The --profile window and ranks fit the run (one line each, at launch)."""
    if not args.profile:
        return
    a, b = args.profile_step_start, args.profile_step_end
    if a < 0 or b <= a:
        raise ConfigError(f"--profile-step-start {a} --profile-step-end {b}: the window must satisfy 0 <= start < "
                          f"end (it profiles iterations start+1..end)")
    if b > args.train_iters:
        raise ConfigError(f"--profile-step-end {b} is past --train-iters {args.train_iters}: the trace would "
                          f"never be written; use an end <= {args.train_iters}")
    bad = [r for r in args.profile_ranks if not 0 <= r < world_size]
    if bad:
        raise ConfigError(f"--profile-ranks {' '.join(map(str, args.profile_ranks))}: rank {bad[0]} is not in this "
                          f"job of {world_size} rank{'s' * (world_size != 1)}; use ranks 0..{world_size - 1}")


def trace_dir(args) -> str:
    if args.tensorboard_dir:
        return args.tensorboard_dir
    return os.path.join(args.save, "profile") if args.save else "profile"


class StepProfiler:
    """torch.profiler around iterations (start, end] on this rank: `begin_if_due(completed)` before
    an iteration, `end_if_due(completed)` right after its optimizer step (as Megatron-LM stops it:
    the iteration's logging, evaluation and saving stay out of the trace)."""

    def __init__(self, args, rank: int, device_type: str):
        self.start, self.end = args.profile_step_start, args.profile_step_end
        self.rank, self.device_type = rank, device_type
        self.path = os.path.join(trace_dir(args), f"rank{rank}.iter{self.start + 1}-{self.end}.pt.trace.json")
        self._prof = None
        self._done = False

    def begin_if_due(self, completed: int) -> None:
        if self._prof is None and not self._done and self.start <= completed < self.end:
            self._begin()

    def end_if_due(self, completed: int) -> None:
        if self._prof is not None and completed >= self.end:
            self._finish(completed)

    def close(self, completed: int | None = None) -> None:
        """A run that stops inside the window (a signal, an exit flag) still writes what it recorded."""
        if self._prof is not None:
            self._finish(completed)

    def _begin(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device_type == "cuda" else [])
        self._prof = profile(activities=activities, record_shapes=True, with_stack=True)
        self._prof.start()

    def _finish(self, completed: int | None) -> None:
        prof, self._prof, self._done = self._prof, None, True
        prof.stop()
        tmp = f"{self.path}.partial"
        try:
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
            prof.export_chrome_trace(tmp)
            os.replace(tmp, self.path)           # a reader never sees half a trace
        except OSError as exc:                   # (a full disk: traces with stacks are large) not the run's end:
            with contextlib.suppress(OSError):   # only the profiled ranks write, the others would wait for them
                os.remove(tmp)
            print(f"warning: --profile rank {self.rank}: writing {self.path} failed ({type(exc).__name__}: {exc}); "
                  "no trace, training goes on", file=sys.stderr, flush=True)
            return
        cut = "" if completed is None or completed >= self.end else f" (the run stopped after iteration {completed})"
        print(f" profile: rank {self.rank}, iterations {self.start + 1}-{self.end}{cut} -> {self.path}",
              file=sys.stdout, flush=True)


def build_profiler(args, ps) -> StepProfiler | None:
    """The --profile recorder of this rank, or None (profiling off, or another rank's job)."""
    if not args.profile or ps.rank not in args.profile_ranks:
        return None
    return StepProfiler(args, ps.rank, ps.device.type)
