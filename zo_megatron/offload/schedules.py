"""Three schedules of one CPU step: when the CPU Adam runs against the device's forward/backward.

The engine (engine.py) is the data path: buckets, copies home, the global grad norm, the kernel
call (`engine._cpu_update`), the return of the parameters (`engine._params_to_device`). A
schedule decides only WHEN the kernel runs and on which thread. All three compute the same
update from the same inputs; only the delayed one changes the math (by design: one step stale).

  rs = reduce-scatter of a bucket (async), h = its shard's copy home, N = norm + overflow check
  (all-reduce), A = CPU Adam, A_k = CPU Adam of bucket k's segments, R = parameters home + all-gather

Synchronous (`SynchronousSchedule`, the default):

  main   |fwd t|bwd t...............|N|A......|R|fwd t+1|bwd t+1 ...
  comm          |rs0 h0|rs1 h1|rs2 h2|          ^ step(t) returns
  The CPU step sits on the critical path: the device idles for A.

Delayed parameter update (`DelayedSchedule`, --dpu, from the W-th update on; paper section 5.2):

  main   |fwd t|bwd t|N|R(t-1)|fwd t+1|bwd t+1|N|R(t)|fwd t+2 ...
  worker               |A(t).............|       |A(t+1)........|
  Forward/backward of t+1 run on parameters one update old (the math changes: docs/dpu.md).

Speculative overlap (`SpeculativeSchedule`, --overlap-cpu-step; docs/overlap.md):

  main   |fwd t|bwd t......................|N|check|R|fwd t+1 ...
  comm          |rs0 h0|rs1 h1|rs2 h2|
  worker               |A_0...|A_1...|A_2...|       (A_k reads the state, writes the spare set)
  Each bucket's CPU Adam starts as soon as its shard is home, speculating "clean and unclipped"
  (clip coefficient 1, no overflow, the learning rate announced by expect_lr()). After backward
  the main thread joins the worker, computes the norm, then checks: clean and unclipped -> commit
  (R sends the staged parameters; nothing reached the device before); otherwise discard the
  speculated segments (they went to the spare state set; the state before the step was only
  read) and redo the whole step from the kept state (or skip). Every kernel call
  covers whole segments with the same arguments as the synchronous call, and the kernel's result
  per segment does not depend on how segments are grouped into calls, so the result is
  bit-identical to the synchronous schedule in every case.

Threads. Collectives are issued only where they are issued without a schedule: the norm's
all-reduce and the all-gathers on the main thread, the reduce-scatters from the gradient hooks
(on the main thread on CPU; on CUDA autograd runs the post-accumulate hooks on its device thread
while the main thread is blocked in backward(), so one thread issues at a time). A worker (one
`ThreadPoolExecutor` thread per engine) runs only the CPU Adam kernel and host copies, never a
collective: `WORKER_PREFIX` names it and tests record the thread of every collective.
"""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import torch

from zo_megatron.optimizer_api import StepResult

WORKER_PREFIX = "zo-cpu-step"       # the worker threads' name prefix: they never issue a collective


_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(_INT_OF_SIZE[t.element_size()])


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (a NaN gradient of a step about to be skipped equals itself)."""
    return torch.equal(_bits(a), _bits(b))


class SynchronousSchedule:
    """The CPU step at once: step() returns with the parameters on their way to the device."""

    name = "synchronous"
    worker = None
    pending = None

    def on_backward_start(self, engine, last_micro_batch: bool) -> None:
        pass

    def on_bucket_home(self, engine, bucket, handle) -> None:
        pass

    def before_norm(self, engine) -> None:
        pass

    def step(self, engine, found_inf: bool, grad_norm: float, scale: float, lr: float) -> StepResult:
        if found_inf:                                    # every rank agrees: skip, touch nothing
            return StepResult(True, grad_norm, 0.0, scale)
        clip_coef = engine._clip_coef(grad_norm)
        engine.step_count += 1
        k = engine._cur
        if engine._tail is not None:       # queued first: on a GPU it runs while the CPU Adam does
            engine._tail.step(engine.step_count, lr, clip_coef / scale)
        engine._cpu_update(k, engine._update_grad(), engine.step_count, lr, clip_coef / scale)
        engine._params_to_device(k)
        return StepResult(False, grad_norm, clip_coef, scale)

    def flush(self, engine) -> StepResult | None:
        return None

    def close(self) -> None:
        pass


class DelayedSchedule(SynchronousSchedule):
    """DPU: updates 1 .. W-1 at once; from the W-th on, step(t) hands the CPU Adam of g_t to the
    worker and returns; step(t+1) joins it and returns its parameters to the device.

      - W counts applied updates (the Adam step counter, restored from checkpoints); a step
        skipped for overflow does not count, as it does not update.
      - The learning rate, clip coefficient and loss scale of an update are those of the step
        that produced its gradient (fixed on the main thread before the worker starts). An
        overflowing g_t is dropped on every rank and lowers the scale at step t, as without DPU;
        the pending update of g_{t-1} is still applied.
      - The host gradient landing buffer is a pair (g_{t+1} lands in one while the worker reads
        the other): one more landing buffer (and fp32 accumulator, with host accumulation).
      - flush() joins a pending update and returns its parameters to the device: before
        evaluation, a checkpoint and the end of training, so nothing is pending there and a
        resume is exact. The next step() delays again.
      - A worker exception is raised on the main thread at the next join, with its own message.
    """

    name = "delayed"

    def __init__(self, warmup_steps: int, prev_master: torch.Tensor | None = None):
        self.warmup_steps = warmup_steps
        self.worker = ThreadPoolExecutor(1, thread_name_prefix=WORKER_PREFIX)
        self.pending = None                # (future, landing set, StepResult) of the update in flight
        # --dpu-weight-prediction: the master before the update in flight (w_{t-1}); the device
        # then gets w_t + (w_t - w_{t-1}) instead of w_t (see _predicted_update).
        self.prev_master = prev_master

    def _predicted_update(self, engine, k: int, grad, step: int, lr: float, grad_scale: float) -> None:
        """Worker: the CPU Adam of g_t, then the device copy extrapolated by this update.

        Forward/backward of step t+2 run on what the device gets at step t+1, while the update of
        g_{t+2} is applied to w_{t+1}: the device copy is one update behind. With Adam's momentum
        consecutive updates are close (u_{t+1} ~ u_t), so w_t + u_t estimates w_{t+1} (weight
        prediction: PipeMare, SpecTrain). The master and the moments stay exact Adam; only the copy
        the gradients are computed on moves.
        """
        prev = self.prev_master
        prev.copy_(engine.master)
        engine._cpu_update(k, grad, step, lr, grad_scale)
        out = engine._params[k]
        torch.sub(engine.master, prev, out=prev)           # prev <- u_t = w_t - w_{t-1}
        prev.add_(engine.master)                           # prev <- w_t + u_t (the whole partition:
        out.copy_(prev)                                    # DPU refuses partial offload)

    def step(self, engine, found_inf: bool, grad_norm: float, scale: float, lr: float) -> StepResult:
        self.flush(engine, predicted=True)               # the update of g_{t-1}, if one is in flight
        if engine.step_count + 1 < self.warmup_steps or found_inf:
            return super().step(engine, found_inf, grad_norm, scale, lr)
        clip_coef = engine._clip_coef(grad_norm)
        engine.step_count += 1
        result = StepResult(False, grad_norm, clip_coef, scale)
        k = engine._cur
        update = (k, engine._update_grad(), engine.step_count, lr, clip_coef / scale)
        kernel = engine._cpu_update if self.prev_master is None else partial(self._predicted_update, engine)
        self.pending = (self.worker.submit(kernel, *update), k, result)
        engine._cur = 1 - k                              # step t+1's gradients land in the other set
        return result

    def flush(self, engine, predicted: bool = False) -> StepResult | None:
        """Join the update in flight and return its parameters to the device: the predicted copy
        when step() joins (predicted=True), the exact master when evaluation, a checkpoint or the
        end of training asks (so they see, and a resume restarts from, exactly the master)."""
        if self.pending is None:
            return None
        future, k, result = self.pending
        self.pending = None
        t0 = time.monotonic()
        future.result()
        engine._phases.append(("cpu_step_wait", t0, time.monotonic()))
        if self.prev_master is not None and not predicted:
            engine._params[k].copy_(engine.master)
        engine._params_to_device(k)
        if engine._params[0] is engine._params[-1] and len(engine._params) > 1:
            # One 16-bit output buffer shared by both sets: the next update may overwrite it only
            # after these (async, on CUDA) copies to the device have read it.
            engine.dev.wait_host()
        return result

    def close(self) -> None:
        """Join the worker; an update still in flight is waited for (never freed under the
        kernel), its error raised here."""
        pending, self.pending = self.pending, None
        if self.worker is not None:
            self.worker.shutdown(wait=True)
            self.worker = None
        if pending is not None:
            pending[0].result()


class SpeculativeSchedule(SynchronousSchedule):
    """--overlap-cpu-step: per-bucket CPU Adam during the last micro-batch's backward, speculated
    clean and unclipped, validated after the norm, committed or rolled back (bit-identical).

    Kept state: two sets of state buffers, the engine's master / exp_avg / exp_avg_sq and a spare
    set of the same size (`spare`). When a speculating backward starts, the engine's attributes
    are pointed at the spare set and the state before the step is kept aside (`kept`, never
    written while kept). Every kernel call of the step is the out-of-place kernel reading `kept`
    and writing the engine's set: each speculated bucket, the segments left at the commit, the
    whole partition in a redo. Commit: nothing to copy, the kept set becomes the spare. Rollback:
    the kept set is the engine's again (a skip) or the redo rewrites every segment of the other
    set from it; either way the speculated values are discarded without a copy, so speculation
    costs the kernel alone. The 16-bit (or fp32) parameters are written into a staging buffer of
    their own (the engine's `_params`, not aliased to the gradient in this mode), so the gradient
    survives for a redo and nothing reaches the device before step() commits.

    Why the engine's attributes are re-pointed rather than the tensors' storage swapped: every
    user of the host state reads `engine.master` / `exp_avg` / `exp_avg_sq` at the moment it needs
    them (the kernel call, the fp32 parameter copy, `_state_pieces` behind state_dict,
    load_state_dict, host_state_views for DCP checkpoints and the tools that read them,
    reload_params_from_master; accounting takes sizes only; the device tail of a partial offload
    has tensors of its own), and those that can run between a backward and its step() flush()
    first, which points the attributes back at the state before the step. Nothing keeps a view
    across a step, so re-pointing is enough; it is plain Python (Tensor.set_ would move storage
    under views and the race check's snapshots without telling them), and a reader (or a test)
    sees which set is live by identity. The two sets start as copies of each other (the elements
    outside every segment, alignment padding, are then equal in both and never written).
    """

    name = "speculative"

    def __init__(self, engine):
        self.worker = ThreadPoolExecutor(1, thread_name_prefix=WORKER_PREFIX)
        self.spare: tuple | None = tuple(t.clone() for t in _live_state(engine))
        self.kept: tuple | None = None      # the state before the step while the engine's set is written
        self.next_lr: float | None = None   # expect_lr(): the learning rate the coming step() gets
        self.last_lr: float = engine.adam.lr
        self._reset()

    def _reset(self) -> None:
        self.futures: list = []             # the worker's tasks, one per bucket, in order ...
        self._queued: list = []             # ... and their arguments (before_norm may take some back)
        self.active = False                 # a speculating backward is under way (last micro-batch)
        self.args = None                    # (step, lr, grad_scale, first micro-batch) speculated
        self.done: list[int] = []           # indices of engine._host_segments updated speculatively
        self.buckets = 0                    # buckets whose segments were (at least partly) speculated
        self._next_seg = 0                  # the first host segment not yet speculated
        self._race: list = []               # race_check: (name, view, snapshot) to verify at the join

    # Main thread only, never while a speculated kernel runs (before backward, after the join).
    def _write_spare(self, engine) -> None:
        """The step's kernels will read the engine's state (kept) and write the spare set."""
        self.kept = _live_state(engine)
        _set_live_state(engine, self.spare)
        self.spare = None

    def _keep_written(self) -> None:
        """Commit: the written set stays the engine's; the state before the step is the spare."""
        self.spare, self.kept = self.kept, None

    def _restore_kept(self, engine) -> None:
        """Rollback without a redo: the state before the step is the engine's again."""
        self.spare = _live_state(engine)
        _set_live_state(engine, self.kept)
        self.kept = None

    def on_backward_start(self, engine, last_micro_batch: bool) -> None:
        if not last_micro_batch or self.active or not engine._host_segments:
            return
        lr = self.next_lr if self.next_lr is not None else self.last_lr
        self.active = True
        self.args = (engine.step_count + 1, lr, 1.0 / engine.loss_scaler.scale, engine._micro == 0)
        self._write_spare(engine)

    def on_bucket_home(self, engine, bucket, handle) -> None:
        """Main thread, right after bucket's copy home was queued: hand its CPU Adam to the worker."""
        if self.active:
            self.futures.append(self.worker.submit(self._speculate, engine, bucket, handle))
            self._queued.append((bucket, handle))

    @torch.no_grad()
    def _speculate(self, engine, bucket, handle) -> None:
        """Worker: wait for the shard to be home, add it into the host accumulator, then update
        every segment that is now complete (segments never straddle a call), reading the kept
        state and writing the engine's."""
        hs, m = bucket.host_start, min(bucket.shard_numel, max(0, engine._cut - bucket.host_start))
        if not m:
            return
        engine.dev.wait_landed(handle)
        t0 = time.monotonic()                   # the phase is the worker's work, not its wait
        step, lr, grad_scale, first_micro = self.args
        if engine.accumulate_on_host:       # what backward() does for the whole partition otherwise
            acc, g = engine.host_acc[hs:hs + m], engine.host_grad[hs:hs + m]
            acc.copy_(g) if first_micro else acc.add_(g)
        segs, landed = engine._host_segments, hs + m
        j0 = j = self._next_seg
        while j < len(segs) and segs[j][1] <= landed:
            j += 1
        if j == j0:
            return
        self._next_seg = j
        lo, hi = segs[j0][0], segs[j - 1][1]
        grad = engine._update_grad()
        engine._cpu_update(engine._cur, grad, step, lr, grad_scale, segments=segs[j0:j], phase=None,
                           state_from=self.kept)
        self.done.extend(range(j0, j))
        self.buckets += 1
        if engine.race_check:   # what the kernel read and wrote must not change until the join
            read = (("gradient", grad), *zip(("old master", "old exp_avg", "old exp_avg_sq"), self.kept))
            written = (*zip(("master", "exp_avg", "exp_avg_sq"), _live_state(engine)),
                       ("staged parameters", engine._params[engine._cur]))
            for name, t in (*read, *written):
                self._race.append((name, lo, t[lo:hi], t[lo:hi].clone()))
        engine._phases.append(("cpu_step_speculated", t0, time.monotonic()))

    def before_norm(self, engine) -> None:
        """Join the speculated kernels (an error is raised here) and run the race check.

        The buckets the worker has not started yet are taken back and run here, in order, after
        the one it is running: the main thread would only wait for them, and where the CPU is
        shared (the worker's every wake-up may wait for a time slice) the worker can be many
        buckets behind. Cancelled from the last one back, so the taken ones are a suffix of the
        queue (the worker takes tasks in order): the same calls in the same order, exact."""
        if not self.futures:
            return
        t0 = time.monotonic()
        futures, self.futures, queued, self._queued = self.futures, [], self._queued, []
        taken = []
        for f, args in zip(reversed(futures), reversed(queued)):
            if not f.cancel():              # running or done: so is every task before it
                break
            taken.append(args)
        try:
            for f in futures:
                if not f.cancelled():
                    f.result()
            for args in reversed(taken):
                self._speculate(engine, *args)
        finally:
            engine._phases.append(("cpu_step_wait", t0, time.monotonic()))
        for name, lo, view, snap in self._race:
            if not _same_bits(view, snap):
                at = (_bits(view) != _bits(snap)).nonzero()[0].item() + lo
                raise RuntimeError(f"overlap race: the {name} of a speculated segment changed between its "
                                   f"CPU Adam and the end of backward (first at partition index {at})")
        self._race = []

    def step(self, engine, found_inf: bool, grad_norm: float, scale: float, lr: float) -> StepResult:
        self.before_norm(engine)            # (already joined by the engine; kept for direct callers)
        self.next_lr, self.last_lr = None, lr
        speculated, args, done = self.buckets, self.args, self.done
        self._reset()
        if self.kept is None:               # no speculating backward: the plain synchronous step
            return super().step(engine, found_inf, grad_norm, scale, lr)
        clip_coef = 1.0 if found_inf else engine._clip_coef(grad_norm)
        step, spec_lr, spec_grad_scale, _ = args
        rollback = found_inf or clip_coef != 1.0 or lr != spec_lr or clip_coef / scale != spec_grad_scale \
            or step != engine.step_count + 1
        if rollback:
            t0 = time.monotonic()
            if found_inf:                   # skip: the state before the step, untouched, is the engine's again
                self._restore_kept(engine)
            engine._phases.append(("cpu_step_rollback", t0, time.monotonic()))
            if found_inf:
                return StepResult(True, grad_norm, 0.0, scale, speculated_buckets=speculated,
                                  rolled_back_buckets=speculated)
        engine.step_count += 1
        k = engine._cur
        if engine._tail is not None:        # the device part needs no speculation
            engine._tail.step(engine.step_count, lr, clip_coef / scale)
        # The redo rewrites every segment (the speculated values are discarded by being
        # overwritten); a commit updates the segments whose gradients were complete only at the end
        # (done is a prefix: buckets land in order). Both read the kept state.
        rest = None if rollback else engine._host_segments[len(done):]
        if rest is None or rest:
            engine._cpu_update(k, engine._update_grad(), engine.step_count, lr, clip_coef / scale, segments=rest,
                               state_from=self.kept)
        self._keep_written()
        engine._params_to_device(k)
        return StepResult(False, grad_norm, clip_coef, scale, speculated_buckets=speculated,
                          rolled_back_buckets=speculated if rollback else 0)

    def abandon(self, engine) -> None:
        """A speculating backward with no step() after it (a flush, checkpoint or close first):
        join and roll back, so the state is the one before that backward."""
        self.before_norm(engine)
        if self.kept is not None:
            self._restore_kept(engine)
        self._reset()

    def flush(self, engine) -> StepResult | None:
        if self.active:
            self.abandon(engine)
        return None

    def close(self) -> None:
        futures, self.futures = self.futures, []
        if self.worker is not None:
            self.worker.shutdown(wait=True)
            self.worker = None
        for f in futures:
            f.result()


def _live_state(engine) -> tuple:
    return engine.master, engine.exp_avg, engine.exp_avg_sq


def _set_live_state(engine, state) -> None:
    engine.master, engine.exp_avg, engine.exp_avg_sq = state
