"""The Trainer: builds the job's components and runs the loop that composes them.

    Trainer(args, env, ps, tokenizer, data_path).run()
      build:  metrics + faults -> checkpointer (the --save lock) -> model config -> datasets -> model
              -> optimizer engine -> timeline, profiler -> resume (--load) -> banner -> batches, evaluator,
              step log, LR schedule
      loop:   one iteration's timeline, top to bottom (`train`): get batches + forward/backward,
              optimizer step, advance the schedule, log, evaluate, exit checks, save
      finish: a stop saves; the last delayed update is flushed; every resource is closed

Each component is built by one function (training/components.py) or is its own class
(checkpointing.Checkpointer, evaluation.Evaluator, step_log.StepLog); the optimizer engine hides
its CPU-step schedule (synchronous, overlapped, delayed) behind optimizer_api.TrainingOptimizer,
so a new schedule or component plugs in without a branch here. All time is read from this
module's clock (`_now`), one clock for the interval timer, the exit deadline and the set-up time.
"""
from __future__ import annotations

import contextlib
import dataclasses
import signal
import time

import torch

from zo_megatron.errors import report_error
from zo_megatron.offload.device import host_value
from zo_megatron.parallel import collectives
from zo_megatron.training import components, faults
from zo_megatron.training.batch_schedule import BatchSchedule
from zo_megatron.training.checkpointing import Checkpointer
from zo_megatron.training.evaluation import Evaluator, loss_inputs
from zo_megatron.training.metrics import proc_memory_bytes
from zo_megatron.training.profiling import build_profiler
from zo_megatron.training.schedule import LRScheduler
from zo_megatron.training.step_log import StepLog
from zo_megatron.training.user_report import banner


def _now() -> float:
    return time.monotonic()


@dataclasses.dataclass
class TrainState:
    """Where the run is: what a checkpoint records and a resume restores."""
    iteration: int = 0
    consumed_samples: int = 0
    consumed_valid_samples: int = 0
    skips_in_a_row: int = 0                 # fp16/NaN skipped steps at the loss scale's floor


class Trainer:
    """One training job on this rank: `run()` builds the components (`build`), trains (`train`) and
    closes everything, whatever happens."""

    def __init__(self, args, env, ps, tokenizer, data_path):
        from zo_megatron.parallel.launch_env import default_cpu_adam_threads

        self.args, self.ps, self.tokenizer, self.data_path = args, ps, tokenizer, data_path
        self.adam_threads = args.cpu_adam_threads or default_cpu_adam_threads(env.local_world_size)
        self.state = TrainState()
        self.stack = contextlib.ExitStack()     # closed last: optimizer, timeline, signal handlers, lock

    # ---- the run ------------------------------------------------------------------------------
    def run(self) -> int:
        """Build, train, finish; 0 done or stopped cleanly, 1 a failed save or a run of skipped steps."""
        from zo_megatron.parallel import destroy_parallel

        args, ps = self.args, self.ps
        self.t_start = _now()
        components.set_threads(args, ps, self.adam_threads)
        with collectives.all_ranks_agree():     # rank 0's log set-up (W&B's login) fails every rank
            self.metrics = components.build_metrics(args, ps)
        self.stop = faults.StopSignal(enabled=args.exit_signal_handler or bool(args.save))
        self.stack.callback(self.stop.restore)
        self.inject = faults.FaultInjection.from_env(ps.rank)
        try:
            self.build()
            return self.train()
        except faults.SaveFailed as exc:
            report_error(f"{'' if exc.everywhere else f'rank {ps.rank}: '}{exc.message}",
                         print_it=ps.rank == 0 or not exc.everywhere)
            return 1
        except Exception as exc:  # noqa: BLE001 - only a lost peer is handled here; the rest re-raises
            if faults.is_lost_peer(exc):
                faults.exit_lost_peer(exc, ps.rank, self.state.iteration, args.distributed_timeout_minutes)
            raise
        finally:
            self.stack.close()                  # the optimizer first: pinned host memory is unregistered
            self.metrics.close()
            destroy_parallel()

    def build(self) -> None:
        """Every component, in the order their memory and their failures should show."""
        from zo_megatron.data import DPBatches
        from zo_megatron.model import build_gpt_model

        args, ps, st = self.args, self.ps, self.state
        # each phase's memory and when it ended (seconds since run() began): where a slow start-up goes
        mark = lambda: {**proc_memory_bytes(), "elapsed_s": round(_now() - self.t_start, 3)}   # noqa: E731
        memory = {"start": mark()}
        self.checkpointer = Checkpointer(args, ps, self.metrics, self.inject, self.stack)
        self.cfg = components.model_config(args)
        train_ds, valid_ds = components.build_datasets(args, self.tokenizer, self.data_path, ps.dp_size)
        test_ds = components.build_test_dataset(args, self.tokenizer, self.data_path)    # --test-data-path only
        memory["data"] = mark()
        # Built on the host in fp32: the offload engine moves it to the device as its flat 16-bit
        # buffer (the device never holds the fp32 copy); the baseline moves it whole.
        self.model = build_gpt_model(self.cfg, ps.tp_rank, ps.tp_size, args.seed)
        memory["model"] = mark()
        self.optimizer = components.build_optimizer(args, self.model, ps)
        self.stack.callback(self.optimizer.close)
        memory["optimizer"] = mark()
        self.timeline = components.build_timeline(args, ps)
        if self.timeline is not None:
            self.stack.callback(self.timeline.close)
        self.profiler = build_profiler(args, ps)            # --profile on this rank, else None
        if self.profiler is not None:
            self.stack.callback(lambda: self.profiler.close(self.state.iteration))
        # every ARCH_FIELDS field: a resume must match them all
        self.checkpointer.attach(self.model, self.optimizer, self.cfg.vocab_size, self.cfg.arch_meta(), self.tokenizer)
        if args.load:
            st.iteration, st.consumed_samples, st.consumed_valid_samples = self.checkpointer.resume()
            memory["load"] = mark()                   # its hwm: what reading the checkpoint peaked at
        self.start_iter = st.iteration
        acc = getattr(self.optimizer, "accounting", None)
        self.metrics.log_setup_memory(memory, acc.as_dict() if acc is not None else None)
        banner(self.metrics, args, ps, self.cfg, self.optimizer, self.data_path, _now() - self.t_start)
        self._warn_dpu_never_starts()
        self._warn_dpu_starts_early()
        self.train_batches = iter(DPBatches(train_ds, args.micro_batch_size, ps.dp_rank, ps.dp_size,
                                            consumed_samples=st.consumed_samples))
        self.evaluator = Evaluator(args, ps, valid_ds, st.consumed_valid_samples) if valid_ds is not None else None
        self.tester = Evaluator(args, ps, test_ds, 0) if test_ds is not None else None
        self.moe = components.build_moe_losses(args, self.cfg, ps, self.model)     # None for a dense model
        self.expert_bias = components.build_expert_bias(self.cfg, self.model)     # None without the flag
        if self.moe is not None:
            self.stack.callback(self.moe.close)
        self.log = StepLog(self.metrics, args, ps, self.optimizer, components.flops_per_token(args, self.cfg, ps),
                           self.start_iter, clock=_now, moe=self.moe)
        self.batches = BatchSchedule.from_args(args, ps.dp_size)   # samples per iteration (a ramp's grow)
        self.scheduler = LRScheduler.from_args(args)   # after --load: it may take the checkpoint's schedule
        self.scheduler.step(st.consumed_samples)       # exact on resume unless fp16 skipped steps before the save

    def train(self) -> int:
        """The loop: one iteration's timeline, top to bottom."""
        args, st = self.args, self.state
        if args.skip_train:                             # Megatron-LM's: evaluate the loaded model, train nothing
            self.metrics.print(f" skipping training (--skip-train): evaluating the model of iteration {st.iteration}")
            if self.evaluator is not None:
                self.evaluate()
            return self.finish(None)
        stop_reason = None
        while st.iteration < args.train_iters:
            if self.profiler is not None:               # --profile: its window's first edge
                self.profiler.begin_if_due(st.iteration)
            self.inject.at_iteration_start(st.iteration + 1)
            lr, decoupled_lr = self.scheduler.get_lr(), self.scheduler.get_decoupled_lr()   # None: no --decoupled-lr
            samples, micro_batches = self.batches.at(st.consumed_samples)   # this iteration's global batch
            loss = self.forward_backward(lr, decoupled_lr, micro_batches)
            logs = (st.iteration + 1) % args.log_interval == 0 or st.iteration + 1 == args.train_iters
            self.optimizer.count_zeros_in_grad = args.log_num_zeros_in_grad and logs   # a pass: logged steps only
            res = self.optimizer.step(lr, decoupled_lr)
            self.advance(res, samples)
            self.log.record(host_value(loss).item(), res, delayed=self._delayed(res),   # a timed wait first
                            samples=samples)
            if logs:
                self.log.write(st.iteration, lr, res, st.consumed_samples, decoupled_lr)
            if self.evaluator is not None and self.evaluator.due(st.iteration):
                self.evaluate()
            exit_reason = self.exit_reason()
            if self.checkpointer.due(st.iteration) or (exit_reason and args.save):
                self.save()
            if exit_reason:
                self.metrics.print(f" exiting after iteration {st.iteration}: {exit_reason}")
                break
            if stop_reason := self.stop_reason():
                break
        return self.finish(stop_reason)

    # ---- one iteration's parts ------------------------------------------------------------------
    def forward_backward(self, lr: float, decoupled_lr: float | None, n: int) -> torch.Tensor:
        """Forward and backward over this iteration's `n` micro-batches per rank (its global batch /
        micro x DP: --grad-accum-steps, fewer during a --rampup-batch-size ramp); the mean loss (on
        the device)."""
        it = self.state.iteration + 1
        if hasattr(self.optimizer, "expect_lr"):    # a speculated CPU step (--overlap-cpu-step) uses it
            self.optimizer.expect_lr(lr, decoupled_lr)
        phase = self.timeline.phase if self.timeline is not None else _no_phase
        batches = [next(self.train_batches) for _ in range(n)]     # host tensors: their masks weigh them
        weights, logged, per_micro_batch = loss_weights(batches, self.args.calculate_per_token_loss, self.ps)
        if self.moe is not None:                    # the aux losses' gradient: the LM loss's scale
            self.moe.set_scale(self.optimizer.loss_scaler.scale, per_micro_batch)
        step_loss = torch.zeros((), device=self.ps.device)
        for m, (batch, weight, log_weight) in enumerate(zip(batches, weights, logged)):
            inputs = loss_inputs(batch, self.ps.device)
            with phase("forward", it, m), self.optimizer.forward_context():
                loss = self.inject.loss(it, self.model.loss(*inputs))
            with phase("backward", it, m):
                self.optimizer.backward(loss * weight, last_micro_batch=m == n - 1)
            step_loss += loss.detach().float() * log_weight
        if self.moe is not None:                    # the tracker's sums of this iteration, as means
            self.moe.end_iteration(n)
        if self.expert_bias is not None:            # Megatron-LM: after the backward, before the step
            self.expert_bias.update()
        return step_loss

    def advance(self, res, samples: int) -> None:
        """After the optimizer step of `samples` samples: the timeline, the LR schedule, the counters,
        the DPU notice."""
        from zo_megatron.offload.loss_scaler import DynamicLossScaler

        args, st, opt = self.args, self.state, self.optimizer
        if self.timeline is not None:
            self.timeline.record_all(st.iteration + 1, opt.drain_phases())
        else:
            opt.drain_phases()
        if not res.skipped:                 # as Megatron: a skipped (fp16 overflow) update does not advance it
            self.scheduler.step(samples)
        if self._delayed(res) and opt.step_count == args.dpu_warmup_steps:
            self.metrics.print(f" delayed parameter update starts at iteration {st.iteration + 1}: from now on the "
                               f"CPU Adam of each step overlaps the next step's forward/backward "
                               f"(--dpu-warmup-steps {args.dpu_warmup_steps})")
        st.iteration += 1
        if self.profiler is not None:                   # --profile: its window's last edge
            self.profiler.end_if_due(st.iteration)
        st.consumed_samples += samples
        self.metrics.advance()
        scaler = opt.loss_scaler                # fp16: skips while the scale searches do not count
        at_floor = not isinstance(scaler, DynamicLossScaler) or res.loss_scale <= scaler.min_scale
        st.skips_in_a_row = st.skips_in_a_row + 1 if res.skipped and at_floor else 0

    def _delayed(self, res) -> bool:
        """Whether this step's update was delayed (the engine delays every update from its W-th on)."""
        a = self.args
        return bool(a.dpu and not res.skipped and self.optimizer.step_count >= a.dpu_warmup_steps)

    def evaluate(self) -> None:
        """--eval-iters global batches of the validation split, logged; the consumed count moves on."""
        with self.log.paused():             # as Megatron: evaluation stays out of the interval timer
            loss, n_samples = self.evaluator.run(self.model, self.optimizer)
            self.state.consumed_valid_samples = self.evaluator.consumed_valid
            self.metrics.log_eval(self.state.iteration, loss, eval_samples=n_samples,
                                  consumed_tokens=self.state.consumed_samples * self.args.seq_length)

    def save(self) -> None:
        """A checkpoint of this iteration (pending updates flushed first: checkpointing.Checkpointer)."""
        st = self.state
        with self.log.paused():             # as Megatron: saving stays out of the interval timer
            self.checkpointer.save(st.iteration, st.consumed_samples, st.consumed_valid_samples)

    def exit_reason(self) -> str | None:
        """Megatron's --exit-interval / --exit-duration-in-mins; the clock-based one is agreed (max over
        ranks) so every rank stops after the same iteration."""
        from zo_megatron.training.megatron_compat import should_exit

        args = self.args
        reason = should_exit(args, self.state.iteration, _now() - self.t_start)
        if args.exit_duration_in_mins is not None:
            flag = collectives.all_reduce(torch.tensor([1.0 if reason else 0.0]), "max")
            if flag.item() and reason is None:
                reason = f"--exit-duration-in-mins {args.exit_duration_in_mins:g} (on another rank)"
        return reason

    def stop_reason(self) -> str | None:
        """A run of skipped steps (--max-skipped-iters) or a signal every rank agreed on (faults.StopSignal)."""
        args, st = self.args, self.state
        if args.max_skipped_iters and st.skips_in_a_row >= args.max_skipped_iters:
            return "skipped"
        if self.stop.enabled and st.iteration < args.train_iters and (signum := self.stop.agreed()):
            return signal.Signals(signum).name
        return None

    # ---- the end ------------------------------------------------------------------------------
    def finish(self, stop_reason: str | None) -> int:
        """A stop saves (if --save) and says how to resume; a finished run applies its last delayed
        update and prints the final validation loss."""
        args, st = self.args, self.state
        if stop_reason is not None:
            if args.save and self.checkpointer.saved_at != st.iteration:
                self.save()
            where = f"; resume with --load {args.save}" if args.save else " (no --save: nothing was saved)"
            if stop_reason == "skipped":
                report_error(f"{st.skips_in_a_row} consecutive iterations (up to {st.iteration}) were skipped for "
                             f"a NaN/inf loss or gradient; stopping (--max-skipped-iters {args.max_skipped_iters}). "
                             f"The weights and optimizer state are those of the last good step{where}; lower --lr "
                             f"or check the data", print_it=self.ps.rank == 0)
                return 1
            self.metrics.print(f" stopped by {stop_reason} after iteration {st.iteration}{where}")
            return 0
        with collectives.all_ranks_agree():   # (a disk error of one rank's optimizer states: every rank's)
            self.optimizer.flush()          # the last delayed update belongs to the trained model
        if self.timeline is not None:
            self.timeline.record_all(st.iteration, self.optimizer.drain_phases())
        if self.tester is not None:         # --test-data-path: once, at the end (Megatron-LM's "on test set")
            with self.log.paused():
                loss, n_samples = self.tester.run(self.model, self.optimizer)
                self.metrics.log_eval(st.iteration, loss, split="test", eval_samples=n_samples)
        last_val = self.evaluator.last_loss if self.evaluator is not None else None
        if last_val is not None:
            import math

            self.metrics.print(f" done: {st.iteration} iterations in {(_now() - self.t_start) / 60:.1f} min; final "
                               f"validation loss {last_val:.4f} nats, perplexity {math.exp(min(last_val, 50)):.2f}")
        return 0

    def _warn_dpu_starts_early(self) -> None:
        """--dpu whose delay starts inside the learning-rate warm-up or in the first 1% of the run,
        where a one-update delay costs the most accuracy (issue 37; docs/dpu.md's measurements)."""
        args = self.args
        w, warmup, total = args.dpu_warmup_steps, args.lr_warmup_iters, args.train_iters
        if not args.dpu or w > total:                # never starts: _warn_dpu_never_starts says so
            return
        where = [f"inside the learning-rate warm-up (--lr-warmup-iters {warmup})"] if w <= warmup else []
        if w <= 0.01 * total:
            where.append(f"in the first 1% of the run (--train-iters {total})")
        if where:
            self.metrics.print(
                f" warning: --dpu delays from update {w} (--dpu-warmup-steps) on, {' and '.join(where)}: "
                f"a one-update delay costs the most accuracy early, where the loss falls fastest (docs/dpu.md: "
                f"W=40 of a 300-iteration run ended 13.3% behind exact updates, 5.6% with --dpu-corrector "
                f"weight-prediction; W=150 0.9%); raise --dpu-warmup-steps past "
                f"{max(warmup, int(0.01 * total))} or compare with tools/dpu_convergence.py")

    def _warn_dpu_never_starts(self) -> None:
        """--dpu given but the run ends before its warm-up does: say so (every update is exact)."""
        args, opt = self.args, self.optimizer
        if not args.dpu:
            return
        first_delayed = self.start_iter + max(1, args.dpu_warmup_steps - opt.step_count)
        if first_delayed > args.train_iters:
            self.metrics.print(f" warning: --dpu given, but the delayed parameter update would start at iteration "
                               f"{first_delayed} (after --dpu-warmup-steps {args.dpu_warmup_steps} exact updates; "
                               f"{opt.step_count} done) and the run ends at --train-iters {args.train_iters}: "
                               f"every update of this run is exact; use --dpu-warmup-steps at most "
                               f"{args.train_iters - self.start_iter + opt.step_count} to delay any")


def loss_weights(batches: list[dict], per_token: bool, ps) -> tuple[list[float], list[float], float]:
    """(what each micro-batch's loss -- its unmasked tokens' mean -- is multiplied by before backward,
    ... for the logged loss, the micro-batch count the aux losses divide by).

    The gradient, Megatron-LM's default: 1 / micro-batches -- the objective is the mean of the micro-batch
    means. --calculate-per-token-loss: the global batch's unmasked tokens' mean over every DP rank:
    micro-batch m (t_m tokens) weighs dp x t_m / T, T the tokens of the global batch (one all-reduce of a
    count over DP); the dp because the engines average gradients over DP where Megatron-LM sums them and
    divides by T. The aux losses then divide by T / dp, as Megatron-LM scales every gradient by 1 / T (its
    router multiplies them by its tokens first: model/config.py calculate_per_token_loss).
    The logged loss is the tokens' mean in both modes (dp x t_m / T; StepLog averages the ranks), as
    Megatron-LM's loss_func reports [loss sum, tokens] and its train_step divides the sums."""
    n = len(batches)
    tokens = [float(b["loss_mask"].sum()) for b in batches]          # host tensors: no device read
    counts = torch.tensor([sum(tokens)], dtype=torch.float64)        # a host tensor, reduced over gloo
    collectives.all_reduce(counts, group=ps.dp_group)
    total = max(counts.item(), 1.0)                                  # every token masked: a zero loss, not NaN
    token_mean = [ps.dp_size * t / total for t in tokens]
    if per_token:
        return token_mean, token_mean, total / ps.dp_size
    return [1.0 / n] * n, token_mean, float(n)


@contextlib.contextmanager
def _no_phase(*_):
    yield
