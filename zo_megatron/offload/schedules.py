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

  main   |fwd t|bwd t......................|N|check|A_rest|R|fwd t+1 ...
  comm          |rs0 h0|rs1 h1|rs2 h2|
  worker               |A_0...|A_1...|            (A_k backs up its segments' state, updates in place)
  Each bucket's CPU Adam starts as soon as its shard is home, speculating "clean and unclipped"
  (clip coefficient 1, no overflow, the learning rates announced by expect_lr()), for the prefix
  of the partition that the host memory set aside for it holds. After backward the main thread
  takes back the buckets not started, computes the norm, then checks: clean and unclipped ->
  commit (A_rest updates the segments not speculated, R sends the parameters; nothing reached the
  device before); otherwise the backup is copied back and the whole step redone (or skipped).
  Every kernel call covers whole segments with the same arguments as the synchronous call, and
  the kernel's result per segment does not depend on how segments are grouped into calls, so the
  result is bit-identical to the synchronous schedule in every case.

Threads. Collectives are issued only where they are issued without a schedule: the norm's
all-reduce and the all-gathers on the main thread, the reduce-scatters from the gradient hooks
(on the main thread on CPU; on CUDA autograd runs the post-accumulate hooks on its device thread
while the main thread is blocked in backward(), so one thread issues at a time). A worker (one
`ThreadPoolExecutor` thread per engine) runs only the CPU Adam kernel and host copies, never a
collective: `WORKER_PREFIX` names it and tests record the thread of every collective.
"""
from __future__ import annotations

import contextlib
import math
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from zo_megatron.offload.dpu_diagnostics import WeightError
from zo_megatron.optimizer_api import StepResult
from zo_megatron.parallel import collectives

WORKER_PREFIX = "zo-cpu-step"       # the worker threads' name prefix: they never issue a collective


_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(_INT_OF_SIZE[t.element_size()])


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (a NaN gradient of a step about to be skipped equals itself)."""
    return torch.equal(_bits(a), _bits(b))


def cpu_step_agreed(engine):
    """With the NVMe tier a CPU step can fail on one rank alone (its disk full, a state file changed
    on disk): the ranks agree on the step's outcome before the parameters' all-gather, so every rank
    raises that rank's one line instead of the others waiting at the all-gather for a rank that left
    (they then died with "lost contact with its peers", the disk's line only in the launcher's
    summary). In memory the step cannot fail on one rank alone: no collective is added."""
    return collectives.all_ranks_agree() if engine._nvme is not None else contextlib.nullcontext()


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

    def step(self, engine, found_inf: bool, grad_norm: float, scale: float, rates: tuple[float, float]) -> StepResult:
        """rates: (the learning rate, the decoupled one of the word embedding and output layer)."""
        if found_inf:                                    # every rank agrees: skip, touch nothing
            return StepResult(True, grad_norm, 0.0, scale)
        clip_coef = engine._clip_coef(grad_norm)
        engine.step_count += 1
        k = engine._cur
        lr, decoupled_lr = rates
        if engine._tail is not None:       # queued first: on a GPU it runs while the CPU Adam does
            engine._tail.step(engine.step_count, lr, clip_coef / scale, decoupled_lr)
        with cpu_step_agreed(engine):
            engine._cpu_update(k, engine._update_grad(), engine.step_count, lr, clip_coef / scale,
                               decoupled_lr=decoupled_lr)
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
      - The learning rates, clip coefficient and loss scale of an update are those of the step
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

    def __init__(self, warmup_steps: int, weight_prediction: bool = False,
                 device: torch.device = torch.device("cpu"), worker: ThreadPoolExecutor | None = None):
        self.warmup_steps = warmup_steps
        self.worker, self._own_worker = new_worker(device, worker)
        self.pending = None                # (future, landing set, StepResult) of the update in flight
        # --dpu-weight-prediction: the device gets w_t + (w_t - w_{t-1}) instead of w_t after a
        # delayed update. Forward/backward of step t+2 run on what the device gets at step t+1,
        # while the update of g_{t+2} is applied to w_{t+1}: the device copy is one update behind.
        # With Adam's momentum consecutive updates are close (u_{t+1} ~ u_t), so w_t + u_t
        # estimates w_{t+1} (weight prediction: PipeMare, SpecTrain). The CPU Adam kernel writes
        # that copy in its own pass (it holds w_{t-1} and w_t of every element in registers), so
        # it costs no host memory and no extra pass; the master and the moments stay exact Adam.
        self.weight_prediction = weight_prediction
        # Debug only (issue 37): the device copy's distance to the exact weights, ZO_DPU_DIAGNOSTICS
        # (dpu_diagnostics.py); None, and nothing done, when the variable is unset.
        self.diagnostics = WeightError.from_env()

    def step(self, engine, found_inf: bool, grad_norm: float, scale: float, rates: tuple[float, float]) -> StepResult:
        self.flush(engine, predicted=True)               # the update of g_{t-1}, if one is in flight
        if engine.step_count + 1 < self.warmup_steps or found_inf:
            return super().step(engine, found_inf, grad_norm, scale, rates)
        clip_coef = engine._clip_coef(grad_norm)
        engine.step_count += 1
        result = StepResult(False, grad_norm, clip_coef, scale)
        if self.diagnostics is not None:
            self.diagnostics.before_submit(engine)
        k = engine._cur
        update = (k, engine._update_grad(), engine.step_count, rates[0], clip_coef / scale)
        self.pending = (self.worker.submit(engine._cpu_update, *update, decoupled_lr=rates[1],
                                           extrapolate=self.weight_prediction), k, result)
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
        with cpu_step_agreed(engine):
            future.result()
        engine._phases.append(("cpu_step_wait", t0, time.monotonic()))
        if self.diagnostics is not None:
            self.diagnostics.after_join(engine, from_step=predicted)
        if self.weight_prediction and not predicted:       # the exact master, not the predicted copy
            if engine.master is not None:
                engine._params[k].copy_(engine.master)
            else:                                        # --optimizer-nvme-master: read from disk, and a
                with cpu_step_agreed(engine):            # read failing on one rank is every rank's line
                    engine._nvme.copy_master_to(engine._params[k])
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
            if self._own_worker:
                self.worker.shutdown(wait=True)
            self.worker = None
        if pending is not None:
            pending[0].result()


class SpeculativeSchedule(SynchronousSchedule):
    """--overlap-cpu-step: per-bucket CPU Adam during the last micro-batch's backward, speculated
    clean and unclipped, validated after the norm, committed or rolled back (bit-identical).

    Bounded by memory (issue 34): only a prefix of the partition is speculated, the segments that
    end within `fraction` of it. Buckets come home in partition order and bucket 0 holds the last
    layers, so the prefix is what backward produces first: the part with the most backward left
    to hide behind. The rest of the partition is updated after validation, in place, as the
    synchronous step does. With fraction 0 nothing is speculated (the engine then builds the
    synchronous schedule instead).

      partition  |segments 0..j-1: speculated (backup kept)|segments j..: after validation|
                 0                                 limit <= fraction x partition

    State kept for a rollback: before a speculated kernel writes segments [lo, hi) in place, the
    worker copies their old master and moments into a backup of the prefix's size. Where the
    synchronous step writes the updated parameters over the gradient it read (one staging buffer),
    the speculated kernel writes them into a parameter buffer of the prefix's size instead: the
    gradient must survive for the norm and a redo. A commit costs nothing more (the parameters of
    the prefix go to the device from that buffer); a rollback copies the backup back over the
    segments done, then the step is redone (or skipped) exactly as the synchronous one. Every
    kernel call is the synchronous step's in-place kernel with the same arguments, and the
    kernel's result per segment does not depend on how segments are grouped into calls, so the
    result is bit-identical in every case. Host memory: `backup_bytes` = prefix x (fp32 master +
    two moments [+ the 16-bit parameters]), the planner's `overlap_rollback` line
    (planner.memory.overlap_rollback_host_bytes).

    With the states on disk (--optimizer-nvme-path) the units speculated are the store's chunks, not
    the segments: each speculated chunk is read, updated and written to its other place on disk
    (nvme_store.py's shadow slots), so the state before the step stays where it was; a commit moves
    the chunks to their new places, a rollback forgets them. The backup then holds only what lives
    in memory (the master, unless --optimizer-nvme-master): the rollback costs disk, not host memory.

    At the end of backward the main thread takes back the buckets the worker has not started
    (their accumulation into the host accumulator runs there; their update waits for the
    validation, in place and unspeculated): after backward, speculating would only add the
    backup's copies to the critical path.

    Rollbacks back off: a step whose speculation was rolled back is followed by 1, 2, 4, ... up to
    64 steps that do not speculate (the synchronous step); a commit resets it (a step that
    speculated no segment changes neither). While the gradient
    norm is clipped every step (early training) the schedule is then the synchronous one plus a
    rare probe. The decision depends only on the global norm, the overflow and the learning rate,
    which every rank shares, so every rank speculates the same steps.
    """

    name = "speculative"

    def __init__(self, engine, fraction: float = 1.0, worker: ThreadPoolExecutor | None = None):
        if not 0.0 < fraction <= 1.0:
            raise ValueError(f"the speculated fraction must be in (0, 1] (got {fraction!r})")
        self.worker, self._own_worker = new_worker(engine.device, worker)
        self.budget = math.floor(fraction * engine._cut)       # elements the backup holds
        # The units speculated whole: the partition's segments; with the states on disk its chunks
        # (nvme_store.py: one read and one write per chunk and step, as the synchronous pass), whose
        # cuts the kernel's result does not depend on either.
        nvme = engine._nvme
        self.units = [s[:2] for s in engine._host_segments] if nvme is None else nvme.chunks
        self.limit = 0                                         # units [0, limit) may be speculated
        while self.limit < len(self.units) and self.units[self.limit][1] <= self.budget:
            self.limit += 1
        if nvme is not None:
            self.limit = min(self.limit, nvme.shadow_chunks)  # (equal: the store was cut for this budget)
        n = self.budget
        # The rollback backup holds the prefix's states that live in memory; those on disk keep their
        # state before the step in the chunks' other places (nvme_store.py's shadow slots).
        self.backup = tuple(torch.empty(n, dtype=t.dtype) for t in _live_state(engine))
        # Where the synchronous kernel writes the parameters over the gradient it reads (and the
        # update reads that gradient, not the host accumulator), speculated parameters go apart.
        aliased = any(p.data_ptr() == g.data_ptr() for p, g in zip(engine._params, engine._grads))
        self.params = engine.dev.host_empty(n, engine.dtype) if aliased and not engine.accumulate_on_host else None
        self.backup_bytes = sum(t.numel() * t.element_size() for t in (*self.backup, self.params) if t is not None)
        # expect_lr(): the learning rates (rate, decoupled rate) the coming step() gets
        self.next_lr: tuple[float, float] | None = None
        self.last_lr: tuple[float, float] = (engine.adam.lr, engine.adam.lr)
        self.max_backoff = 64               # (tests set 0 to speculate every step)
        self.backoff = 0                    # steps not speculated after the last rollback ...
        self.hold = 0                       # ... and how many of them are still to come
        self._reset()

    def _reset(self) -> None:
        self.futures: list = []             # the worker's tasks, one per bucket, in order ...
        self._queued: list = []             # ... and their arguments (before_norm may take some back)
        self.active = False                 # a speculating backward is under way (last micro-batch)
        self.args = None                    # (step, rates, grad_scale, first micro-batch) speculated
        self.done: list[int] = []           # indices of engine._host_segments updated speculatively
        self.buckets = 0                    # buckets whose segments were (at least partly) speculated
        self._next_seg = 0                  # the first host segment not yet speculated
        self._race: list = []               # race_check: (name, view, snapshot) to verify at the join

    def _done_end(self) -> int:
        """The end of the speculated prefix of the partition (0: nothing speculated)."""
        return self.units[self.done[-1]][1] if self.done else 0

    def _restore(self, engine) -> None:
        """Rollback: the units done get their state from before the step back."""
        if not self.done:
            return
        hi = self._done_end()
        for live, kept in zip(_live_state(engine), self.backup):
            live[:hi].copy_(kept[:hi])
        if engine._nvme is not None:
            engine._nvme.discard_shadow()

    def on_backward_start(self, engine, last_micro_batch: bool) -> None:
        if not last_micro_batch or self.active or not self.limit:
            return
        if self.hold:                       # backing off after a rollback: a synchronous step
            self.hold -= 1
            return
        rates = self.next_lr if self.next_lr is not None else self.last_lr
        self.active = True
        self.args = (engine.step_count + 1, rates, 1.0 / engine.loss_scaler.scale, engine._micro == 0)

    def on_bucket_home(self, engine, bucket, handle) -> None:
        """Main thread, right after bucket's copy home was queued: hand its CPU Adam to the worker."""
        if self.active:
            self.futures.append(self.worker.submit(self._speculate, engine, bucket, handle))
            self._queued.append((bucket, handle))

    def _accumulate(self, engine, bucket, handle) -> int:
        """Wait for the shard to be home and add it into the host accumulator (what backward()
        does for the whole partition when nothing speculates). Returns the end of what landed."""
        hs, m = bucket.host_start, min(bucket.shard_numel, max(0, engine._cut - bucket.host_start))
        if not m:
            return 0
        engine.dev.wait_landed(handle)
        if engine.accumulate_on_host:
            acc, g = engine.host_acc[hs:hs + m], engine.host_grad[hs:hs + m]
            acc.copy_(g) if self.args[3] else acc.add_(g)
        return hs + m

    @torch.no_grad()
    def _speculate(self, engine, bucket, handle) -> None:
        """Worker: the shard home and accumulated, then every unit of the prefix that is now
        complete (units never straddle a call): back up its state, update it in place."""
        landed = self._accumulate(engine, bucket, handle)
        j0 = j = self._next_seg
        while j < self.limit and self.units[j][1] <= landed:
            j += 1
        if j == j0:
            return
        t0 = time.monotonic()                   # the phase is the worker's work, not its wait
        step, (lr, decoupled_lr), grad_scale, _ = self.args
        lo, hi = self.units[j0][0], self.units[j - 1][1]
        for live, kept in zip(_live_state(engine), self.backup):
            kept[lo:hi].copy_(live[lo:hi])
        self._next_seg = j
        grad = engine._update_grad()
        engine._cpu_update(engine._cur, grad, step, lr, grad_scale, segments=_clip(engine._host_segments, lo, hi),
                           phase=None, out=self.params, decoupled_lr=decoupled_lr, speculated=True)
        self.done.extend(range(j0, j))
        self.buckets += 1
        if engine.race_check:   # what the kernel read and wrote must not change until the join
            kept = [(f"kept {name}", t) for name, t in zip(("master", "exp_avg", "exp_avg_sq"), self.backup)]
            named = (("gradient", grad), *kept, ("master", engine.master), ("exp_avg", engine.exp_avg),
                     ("exp_avg_sq", engine.exp_avg_sq),
                     ("staged parameters", engine._params[engine._cur] if self.params is None else self.params))
            for name, t in named:
                if t is not None:               # (states on disk: their chunks' other places hold them)
                    self._race.append((name, lo, t[lo:hi], t[lo:hi].clone()))
        engine._phases.append(("cpu_step_speculated", t0, time.monotonic()))

    def before_norm(self, engine) -> None:
        """Join the worker (an error is raised here) and run the race check.

        The buckets the worker has not started yet are taken back: the main thread accumulates
        them here, and their segments are updated after the validation, unspeculated. Cancelled
        from the last one back, so the taken ones are a suffix of the queue (the worker takes
        tasks in order) and the speculated segments stay a prefix."""
        with cpu_step_agreed(engine):       # a speculated pass's disk error: every rank raises it
            self._join(engine)              # (every rank comes here, speculating or not)
        for name, lo, view, snap in self._race:
            if not _same_bits(view, snap):
                at = (_bits(view) != _bits(snap)).nonzero()[0].item() + lo
                raise RuntimeError(f"overlap race: the {name} of a speculated segment changed between its "
                                   f"CPU Adam and the end of backward (first at partition index {at})")
        self._race = []

    def _join(self, engine) -> None:
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
                self._accumulate(engine, *args)
        finally:
            engine._phases.append(("cpu_step_wait", t0, time.monotonic()))

    def step(self, engine, found_inf: bool, grad_norm: float, scale: float, rates: tuple[float, float]) -> StepResult:
        if self.futures:                    # the engine joined them before the norm (prepare_step), on every
            self.before_norm(engine)        # rank: no second agreement per step; kept for direct callers
        self.next_lr, self.last_lr = None, rates
        if not self.active:                 # no speculating backward: the plain synchronous step
            self._reset()
            return super().step(engine, found_inf, grad_norm, scale, rates)
        speculated, args, done = self.buckets, self.args, self.done
        clip_coef = 1.0 if found_inf else engine._clip_coef(grad_norm)
        step, spec_rates, spec_grad_scale, _ = args
        rollback = found_inf or clip_coef != 1.0 or rates != spec_rates or clip_coef / scale != spec_grad_scale \
            or step != engine.step_count + 1
        if rollback:
            t0 = time.monotonic()
            self._restore(engine)
            engine._phases.append(("cpu_step_rollback", t0, time.monotonic()))
        if done:                            # (a step that speculated nothing cost nothing: no change)
            self.backoff = min(max(1, 2 * self.backoff), self.max_backoff) if rollback else 0
            self.hold = self.backoff
        self._reset()
        if found_inf:
            return StepResult(True, grad_norm, 0.0, scale, speculated_buckets=speculated,
                              rolled_back_buckets=speculated)
        engine.step_count += 1
        k = engine._cur
        lr, decoupled_lr = rates
        if engine._tail is not None:        # the device part needs no speculation
            engine._tail.step(engine.step_count, lr, clip_coef / scale, decoupled_lr)
        # A redo updates every segment from the restored state; a commit the segments after the
        # speculated units (done is a prefix: buckets land in order). Both in place.
        end = self.units[done[-1]][1] if done else 0
        rest = None if rollback else _clip(engine._host_segments, end, engine._cut)
        with cpu_step_agreed(engine):       # the commit's or the redo's disk error: every rank raises it
            if not rollback and done and engine._nvme is not None:
                engine._nvme.commit_shadow()        # the speculated chunks' new places become theirs
            if rest is None or rest:
                engine._cpu_update(k, engine._update_grad(), engine.step_count, lr, clip_coef / scale,
                                   segments=rest, decoupled_lr=decoupled_lr)
        prefix = None if rollback or self.params is None or not done else self.params[:end]
        engine._params_to_device(k, prefix=prefix)
        return StepResult(False, grad_norm, clip_coef, scale, speculated_buckets=speculated,
                          rolled_back_buckets=speculated if rollback else 0)

    def abandon(self, engine) -> None:
        """A speculating backward with no step() after it (a flush, checkpoint or close first):
        join and roll back, so the state is the one before that backward."""
        self.before_norm(engine)
        self._restore(engine)
        self._reset()

    def flush(self, engine) -> StepResult | None:
        if self.active:
            self.abandon(engine)
        return None

    def close(self) -> None:
        """Cancel what the worker has not started (after an error nobody waits for those
        updates), join the one it runs, raise its error."""
        futures, self.futures = self.futures, []
        for f in reversed(futures):
            f.cancel()
        if self.worker is not None:
            if self._own_worker:
                self.worker.shutdown(wait=True, cancel_futures=True)
            self.worker = None
        for f in futures:
            if not f.cancelled():
                f.result()


def new_worker(device: torch.device, shared: ThreadPoolExecutor | None) -> tuple[ThreadPoolExecutor, bool]:
    """(the schedule's worker, whether the schedule owns it). `shared`: another engine's worker
    (expert_parallel.py: the dense and the expert engine's CPU steps run one after another on one
    thread, in the order they are handed over, instead of two kernels contending for the cores);
    its owner shuts it down, a schedule that borrows it only joins its own tasks."""
    if shared is not None:
        return shared, False
    return ThreadPoolExecutor(1, thread_name_prefix=WORKER_PREFIX, initializer=select_worker_device,
                              initargs=(device,)), True


def select_worker_device(device: torch.device) -> None:
    """A schedule worker's initializer: its CUDA calls (event waits) go to the rank's GPU. A new
    thread's current device is 0: without this, every rank whose GPU is not 0 would create a CUDA
    context on GPU 0 at its worker's first CUDA call (issue 34, 2.1)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


def _live_state(engine) -> tuple:
    """The states a rollback backs up: those in memory (with --optimizer-nvme-path the moments, and
    with --optimizer-nvme-master the master, live on disk: None here), in the order master, moments."""
    return tuple(t for t in (engine.master, engine.exp_avg, engine.exp_avg_sq) if t is not None)


def _clip(segments, lo: int, hi: int) -> list:
    """The engine's host segments (start, end, ...) cut to the partition range [lo, hi)."""
    return [(max(s, lo), min(e, hi), *rest) for s, e, *rest in segments if s < hi and e > lo]
