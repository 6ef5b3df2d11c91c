"""ZeRO-Offload for a mixture-of-experts model: two engines, one per parameter group (docs/moe.md).

    dense parameters   replicated over DP (every rank of a TP group's column)  -> an engine over DP
    expert parameters  replicated over expert DP only (EDP = world / (expert TP x EP)): different EP
                       ranks hold different experts                            -> an engine over EDP

Each engine partitions its parameters over its own group for the CPU Adam, with its own buckets in a
fixed order. Megatron-LM's DDP averages dense gradients over DP and scales an expert's by 1 / DP
before summing it over EDP (an expert's gradient already sums the tokens every EP rank sent it), so
the expert engine's reduce-scatter averages by DP (`grad_divisor`), not by its group's size. The
gradient norm is one: each engine adds the other's local sum of squares before its all-reduce over the
world (`extra_grad_stats`, taken before either steps), so both clip by the same coefficient and skip
the same overflowing step.

One loss.backward() per micro-batch reaches both: the dense engine runs it (with the loss scale),
the expert engine only its bookkeeping (begin_backward / end_backward). One loss scaler: the dense
engine's updates it; the expert engine unscales by the scale the backward used (a follower set
before each backward and each step). At EP 1 with expert TP = TP the expert groups are the DP
groups and one engine suffices (the caller keeps the plain engine); an expert TP other than TP
(ParallelState.experts_apart) needs both engines even at EP 1 (TP 2, expert TP 1: DP 1, expert DP 2).

The CPU step's schedules (schedules.py) run in both engines, driven by the one norm and overflow
decision: DPU delays both engines' updates alike (both step counts, hence both warm-ups, are one),
and a flush flushes both; --overlap-cpu-step speculates in both and each validates against the
global norm, so both commit or both roll back. Both schedules share one worker thread (the dense
engine's): their CPU Adam calls run one after another, as the synchronous step runs them. A partial
offload keeps the tail of each engine's partition on the device; the NVMe tier gives each engine
its own state files (the expert engine's named by its global rank); the job reads both stores as
one (`_nvme`).

The job drives it as any TrainingOptimizer (optimizer_api.py): the checkpoint reads both engines'
host states (`host_state_views`), the log both engines' accounting (summed).
"""
from __future__ import annotations

import contextlib
import dataclasses

from zo_megatron.offload.accounting import Accounting
from zo_megatron.offload.engine import ZeroOffloadEngine
from zo_megatron.optimizer_api import StepResult
from zo_megatron.param_names import is_routed_expert

class ExpertParallelEngine:
    """The dense engine over `dp_group` and the expert engine over `edp_group` of one model, driven as
    one optimizer: backward, step, close (the engine's other options are passed to both)."""

    def __init__(self, model, *, dp_group, edp_group, dp_size: int, expert_tp: tuple[int, object] | None = None,
                 **engine_kwargs):
        """`expert_tp`: (expert TP rank, expert TP group) where expert TP differs from TP (default: the
        engine kwargs' tp_rank / tp_group): the rank that counts an expert's TP-replicated elements."""
        from zo_megatron.offload.loss_scaler import ConstantLossScaler
        from zo_megatron.parallel import collectives

        self.model = model
        self.dense = ZeroOffloadEngine(model, dp_group=dp_group, params=lambda n, p: not is_routed_expert(n), **engine_kwargs)
        # the one scaler is the dense engine's; the expert engine's follows it (set before each backward)
        follower = ConstantLossScaler(self.dense.loss_scaler.scale)
        expert_kwargs = {**engine_kwargs, "loss_scaler": follower}
        if expert_tp is not None:
            expert_kwargs.update(tp_rank=expert_tp[0], tp_group=expert_tp[1])
        try:
            self.experts = ZeroOffloadEngine(model, dp_group=edp_group, params=lambda n, p: is_routed_expert(n), grad_divisor=dp_size,
                                             cpu_worker=self.dense.schedule.worker,
                                             nvme_tag=f"zo_optimizer.experts.rank{collectives.group_rank(None)}",
                                             **expert_kwargs)
        except BaseException:
            self.dense.close()
            raise

    holds_master_weights = True

    @property
    def loss_scaler(self):
        return self.dense.loss_scaler

    @property
    def step_count(self) -> int:
        return self.dense.step_count

    @step_count.setter
    def step_count(self, value: int) -> None:     # a checkpoint's step: both engines' Adam step
        self.dense.step_count = self.experts.step_count = value

    @property
    def accounting(self) -> Accounting:
        """Both engines' bytes, summed (a fresh object: read it, do not update it)."""
        a, b = self.dense.accounting, self.experts.accounting
        return Accounting(**{f.name: getattr(a, f.name) + getattr(b, f.name) for f in dataclasses.fields(Accounting)})

    @property
    def _nvme(self):
        """Both engines' NVMe stores as one (the job's banner and disk-I/O log read `optimizer._nvme`:
        training/nvme_flags.py); None without the tier."""
        stores = [e._nvme for e in (self.dense, self.experts) if e._nvme is not None]
        return _NvmeStores(stores) if stores else None

    def forward_context(self):
        stack = contextlib.ExitStack()
        stack.enter_context(self.dense.forward_context())
        stack.enter_context(self.experts.forward_context())
        return stack

    def expect_lr(self, lr: float, decoupled_lr: float | None = None) -> None:
        self.dense.expect_lr(lr, decoupled_lr)
        self.experts.expect_lr(lr, decoupled_lr)

    def host_state_views(self):
        """Both engines' (name, param, start, n, views) fragments: the checkpoint's boxes."""
        yield from self.dense.host_state_views()
        yield from self.experts.host_state_views()

    def reload_params_from_master(self) -> None:
        self.dense.reload_params_from_master()
        self.experts.reload_params_from_master()

    def flush(self):
        self.experts.flush()
        return self.dense.flush()

    def drain_phases(self) -> list[tuple[str, float, float]]:
        return sorted(self.dense.drain_phases() + self.experts.drain_phases(), key=lambda p: p[1])

    def __enter__(self) -> "ExpertParallelEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def count_zeros_in_grad(self) -> bool:
        return self.dense.count_zeros_in_grad

    @count_zeros_in_grad.setter
    def count_zeros_in_grad(self, on: bool) -> None:
        # both engines count their share; each one's norm all-reduce adds the other's (extra_grad_stats)
        self.dense.count_zeros_in_grad = self.experts.count_zeros_in_grad = on

    def backward(self, loss, *, last_micro_batch: bool = True) -> None:
        self.experts.loss_scaler.scale = self.dense.loss_scaler.scale     # the scale this backward uses
        self.experts.begin_backward(last_micro_batch)
        self.dense.backward(loss, last_micro_batch=last_micro_batch)
        self.experts.end_backward(last_micro_batch)

    def step(self, lr: float | None = None, decoupled_lr: float | None = None) -> StepResult:
        """Both engines' gradients home and final first (each one's norm reads the other's; a
        speculating worker joined), then each steps with the one global norm. The result is the
        dense engine's, with both engines' speculated and rolled-back buckets."""
        self.experts.prepare_step()
        self.dense.prepare_step()
        # each engine's norm adds the other's share, taken now (a step rewrites its host gradient); each pass
        # over a partition once: its own norm reuses it
        dense, experts = self.dense.local_grad_stats(), self.experts.local_grad_stats()
        self.dense.own_grad_stats, self.dense.extra_grad_stats = dense, experts
        self.experts.own_grad_stats, self.experts.extra_grad_stats = experts, dense
        self.experts.loss_scaler.scale = self.dense.loss_scaler.scale     # the scale the backward used
        result = self.dense.finish_step(lr, decoupled_lr)
        other = self.experts.finish_step(lr, decoupled_lr)
        if (result.skipped, result.grad_norm) != (other.skipped, other.grad_norm) and not result.skipped:
            raise RuntimeError(f"the dense and expert engines disagree on the step: {result} vs {other}")
        return dataclasses.replace(result, speculated_buckets=result.speculated_buckets + other.speculated_buckets,
                                   rolled_back_buckets=result.rolled_back_buckets + other.rolled_back_buckets)

    def close(self) -> None:
        try:
            self.experts.close()
        finally:
            self.dense.close()


class _NvmeStores:
    """Several engines' NvmeStateStores read as one: the states' dtypes (the same in each), the rings
    side by side, and the byte counts, disk bytes and I/O wait summed (per rank)."""

    _SUMMED = ("disk_bytes", "buffer_bytes", "read_bytes", "written_bytes", "wait_s", "bytes_per_pass")

    def __init__(self, stores):
        self._stores = stores

    dtypes = property(lambda self: self._stores[0].dtypes)
    ring = property(lambda self: [slot for s in self._stores for slot in s.ring])
    direct = property(lambda self: all(s.direct for s in self._stores))

    def __getattr__(self, name):
        if name in _NvmeStores._SUMMED:
            return sum(getattr(s, name) for s in self._stores)
        raise AttributeError(name)
