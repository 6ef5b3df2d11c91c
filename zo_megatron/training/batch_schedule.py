"""Samples per iteration: a fixed global batch, or Megatron-LM's batch-size ramp-up.

    --global-batch-size G                        every iteration takes G samples
    --rampup-batch-size S I N --train-samples T  S samples first, then S + I, S + 2I, ... up to G;
                                                 each batch size lasts N / ((G - S) / I) samples

        global batch
          G |                    ___________________________
            |               ____|
            |          ____|
          S |_________|
            +---------|----|----|-------------------------> consumed samples
            0       N/k  2N/k   N    (k = (G - S) / I increments)      T

Iteration t's batch depends only on the samples consumed before it (megatron-core's
num_microbatches_calculator: the ramp's step is int(consumed / (N / k)), the full batch once
consumed > N), so a checkpoint's consumed_samples is all a resume needs, at any point of the ramp.
Each rank takes batch / (micro x DP) micro-batches of that iteration (its gradient accumulation), the
learning-rate schedule advances by the samples taken, and with --decrease-batch-size-if-needed a
batch that is no multiple of micro x DP is rounded down to one (Megatron-LM's running batch).

What this module adds to megatron-core's calculator: Megatron-LM's iteration count for a ramp
(training.py's update_train_iters: the ramp's iterations while consumed <= N, then whole batches of G)
and the launch-time check of every batch of the ramp — Megatron-LM asserts each one when the run
reaches it, hours in.
"""
from __future__ import annotations

from zo_megatron.errors import ConfigError


class BatchSchedule:
    """`at(consumed_samples)` -> (samples of the next iteration, micro-batches per rank)."""

    def __init__(self, global_batch: int, micro_batch: int, dp_size: int, rampup: list[int] | None = None,
                 decrease_if_needed: bool = False):
        self.global_batch, self.micro_batch, self.dp_size = int(global_batch), int(micro_batch), int(dp_size)
        self.per_micro = self.micro_batch * self.dp_size            # samples of one micro-batch over DP
        self.rampup = None if rampup is None else [int(v) for v in rampup]
        self.decrease_if_needed = bool(decrease_if_needed)
        self._check()
        self._calc = self._calculator()

    @classmethod
    def from_args(cls, args, dp_size: int) -> "BatchSchedule":
        return cls(args.global_batch_size, args.micro_batch_size, dp_size, getattr(args, "rampup_batch_size", None),
                   bool(getattr(args, "decrease_batch_size_if_needed", False)))

    @property
    def ramped(self) -> bool:
        return self.rampup is not None

    def _running(self, batch: int) -> int:
        """What an iteration of `batch` samples takes: itself, or rounded down to micro x DP."""
        return batch - batch % self.per_micro if self.decrease_if_needed else batch

    def _check(self) -> None:
        """Every batch the run will take is a whole number of micro-batches over DP: one line if not."""
        fix = f"use a multiple of {self.per_micro}" + (
            f" of at least {self.per_micro}" if self.decrease_if_needed else
            ", or add --decrease-batch-size-if-needed (Megatron-LM's: rounds each batch down to one)")
        if self.rampup is None:
            if self._running(self.global_batch) < self.per_micro or self.global_batch % self.per_micro and \
                    not self.decrease_if_needed:
                what = "is below" if self.decrease_if_needed else "is not a multiple of"
                raise ConfigError(f"--global-batch-size {self.global_batch} {what} --micro-batch-size "
                                  f"{self.micro_batch} x DP {self.dp_size} = {self.per_micro}: {fix}")
            return
        if len(self.rampup) != 3:
            raise ConfigError(f"--rampup-batch-size takes 3 values (<start batch> <increment> <ramp-up samples>, "
                              f"Megatron-LM's), not {len(self.rampup)}: use all three")
        start, inc, samples = self.rampup
        flag = f"--rampup-batch-size {start} {inc} {samples}"
        if min(start, inc, samples) < 1:       # (megatron-core divides by zero at 0 ramp-up samples)
            raise ConfigError(f"{flag}: the start batch, the increment and the ramp-up samples must be >= 1: use "
                              "positive values")
        if start >= self.global_batch:
            raise ConfigError(f"{flag}: the start batch is not below --global-batch-size {self.global_batch}, so "
                              "there is nothing to ramp: lower the start or drop it")
        if (self.global_batch - start) % inc:
            raise ConfigError(f"{flag}: --global-batch-size {self.global_batch} - start {start} = "
                              f"{self.global_batch - start} is not a multiple of the increment {inc}: use an increment "
                              "that divides it")
        for batch in [*range(start, self.global_batch, inc), self.global_batch]:
            if self._running(batch) < self.per_micro or batch % self.per_micro and not self.decrease_if_needed:
                where = "--global-batch-size" if batch == self.global_batch else "the ramp's batch"
                what = "is below" if self.decrease_if_needed else "is not a multiple of"
                raise ConfigError(f"{flag}: {where} {batch} {what} --micro-batch-size "
                                  f"{self.micro_batch} x DP {self.dp_size} = {self.per_micro}: {fix}")

    def _calculator(self):
        from megatron.core.num_microbatches_calculator import ConstantNumMicroBatchesCalculator, \
            RampupBatchsizeNumMicroBatchesCalculator

        common = (self.global_batch, self.micro_batch, self.dp_size, self.decrease_if_needed, 1)   # rank 1: quiet
        if self.rampup is None:
            return ConstantNumMicroBatchesCalculator(*common)
        return RampupBatchsizeNumMicroBatchesCalculator(*common, *self.rampup)

    def at(self, consumed_samples: int) -> tuple[int, int]:
        """(samples the next iteration takes over DP, micro-batches each rank runs for it)."""
        self._calc.update(int(consumed_samples), consistency_check=not self.decrease_if_needed)
        return self._calc.get_current_running_global_batch_size(), self._calc.get()

    def full(self) -> tuple[int, int]:
        """`at` past any ramp: the full (running) batch and its micro-batches per rank."""
        return self.at(max(self.global_batch, self.rampup[2] + 1 if self.rampup else 0))

    def nominal_at(self, consumed_samples: int) -> int:
        """The ramp's batch before any rounding down (Megatron-LM counts iterations with it)."""
        self._calc.update(int(consumed_samples), consistency_check=False)
        return self._calc.get_current_global_batch_size()

    def iterations(self, train_samples: int) -> int:
        """Megatron-LM's update_train_iters: whole batches of --global-batch-size; with a ramp, the
        ramp's iterations while the consumed samples are <= the ramp-up samples (and the run's), then
        whole batches of --global-batch-size (a partial last batch is dropped)."""
        if self.rampup is None:
            return int(train_samples) // self.global_batch
        iterations = consumed = 0
        limit = min(self.rampup[2], int(train_samples))
        while consumed <= limit:                    # Megatron's loop steps by the ramp's (nominal) batch
            batch = self.nominal_at(consumed)
            cap = (limit - consumed) // batch + 1
            steps = self._run(consumed, batch, self.nominal_at, cap)
            consumed += steps * batch
            iterations += steps
        if train_samples > consumed:
            iterations += (int(train_samples) - consumed) // self.global_batch
        return iterations

    def consumed_after(self, iterations: int, start: int = 0) -> int:
        """Samples consumed after `iterations` more iterations from `start` consumed samples."""
        consumed, left = int(start), int(iterations)
        while left > 0:
            taken = self.at(consumed)[0]
            if self.nominal_at(consumed) == self.global_batch:      # the ramp is over: the batch stays
                return consumed + left * taken
            steps = self._run(consumed, taken, lambda c: self.at(c)[0], left)
            consumed += steps * taken
            left -= steps
        return consumed

    def iterations_to(self, samples: int) -> int:
        """The first iteration count whose consumed samples reach `samples`."""
        iterations = consumed = 0
        while consumed < samples:
            taken = self.at(consumed)[0]
            need = -(-(int(samples) - consumed) // taken)
            steps = need if self.nominal_at(consumed) == self.global_batch else \
                self._run(consumed, taken, lambda c: self.at(c)[0], need)
            consumed += steps * taken
            iterations += steps
        return iterations

    def _run(self, consumed: int, step: int, batch_at, cap: int) -> int:
        """How many iterations of `step` samples from `consumed`, at most `cap` (>= 1), take the batch
        they start with: the batch only grows with the samples consumed, so the last such iteration
        is found by doubling then bisecting on megatron-core's own answer -- a ramp over 10^9 samples
        costs a few calls per batch size, not one per iteration."""
        batch = batch_at(consumed)
        good, bad = 0, 1                            # iteration `good` (0-based) takes `batch`; `bad` does not
        while bad < cap and batch_at(consumed + bad * step) == batch:
            good, bad = bad, min(bad * 2, cap)
        if bad >= cap and batch_at(consumed + (cap - 1) * step) == batch:
            return cap
        while bad - good > 1:
            mid = (good + bad) // 2
            good, bad = (mid, bad) if batch_at(consumed + mid * step) == batch else (good, mid)
        return good + 1

    def describe(self) -> str:
        """The banner's words for the ramp ('' without one)."""
        if self.rampup is None:
            return ""
        start, inc, samples = self.rampup
        k = (self.global_batch - start) // inc
        rounded = " (each rounded down to micro x DP: --decrease-batch-size-if-needed)" if self.decrease_if_needed \
            else ""
        return (f"ramps {start} -> {self.global_batch} by {inc} over {samples:,} samples "
                f"({k} increments of {samples / k:,.0f} samples; --rampup-batch-size){rounded}")
