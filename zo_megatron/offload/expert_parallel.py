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

One loss.backward() per micro-batch reaches both: the dense engine runs it, the expert engine only
its bookkeeping (begin_backward / end_backward). Only the synchronous CPU step is offered (DPU,
--overlap-cpu-step, partial offload and the NVMe tier with experts: not yet). At EP 1 with expert TP =
TP the expert groups are the DP groups and one engine suffices (the caller keeps the plain engine).
"""
from __future__ import annotations

from zo_megatron.errors import ConfigError
from zo_megatron.offload.engine import ZeroOffloadEngine
from zo_megatron.optimizer_api import StepResult

_EXPERT = ".mlp.experts."


def is_expert(name: str, _param=None) -> bool:
    """Parameters of megatron-core's routed experts (not the router, not the shared expert)."""
    return _EXPERT in name


class ExpertParallelEngine:
    """The dense engine over `dp_group` and the expert engine over `edp_group` of one model, driven as
    one optimizer: backward, step, close (the engine's other options are passed to both)."""

    def __init__(self, model, *, dp_group, edp_group, dp_size: int, **engine_kwargs):
        for option in ("dpu_warmup_steps", "overlap_cpu_step", "nvme"):
            if engine_kwargs.get(option):
                raise ConfigError(f"{option} with expert parallelism is not supported yet (docs/moe.md): drop it")
        if engine_kwargs.get("optimizer_offload_fraction", 1.0) != 1.0:
            raise ConfigError("a partial offload with expert parallelism is not supported yet (docs/moe.md)")
        self.dense = ZeroOffloadEngine(model, dp_group=dp_group, params=lambda n, p: not is_expert(n), **engine_kwargs)
        try:
            self.experts = ZeroOffloadEngine(model, dp_group=edp_group, params=is_expert, grad_divisor=dp_size,
                                             **engine_kwargs)
        except BaseException:
            self.dense.close()
            raise
        self.step_count = 0

    def __enter__(self) -> "ExpertParallelEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def backward(self, loss, *, last_micro_batch: bool = True) -> None:
        self.experts.begin_backward(last_micro_batch)
        self.dense.backward(loss, last_micro_batch=last_micro_batch)
        self.experts.end_backward(last_micro_batch)

    def step(self, lr: float | None = None, decoupled_lr: float | None = None) -> StepResult:
        """Both engines' gradients home first (each one's norm reads the other's), then each steps
        with the one global norm."""
        self.experts.finish_grad_sync()
        self.dense.finish_grad_sync()
        # each engine's norm adds the other's share, taken now: a step rewrites its host gradient
        self.dense.extra_grad_stats, self.experts.extra_grad_stats = \
            self.experts.local_grad_stats(), self.dense.local_grad_stats()
        result = self.dense.step(lr=lr, decoupled_lr=decoupled_lr)
        other = self.experts.step(lr=lr, decoupled_lr=decoupled_lr)
        if (result.skipped, result.grad_norm) != (other.skipped, other.grad_norm) and not result.skipped:
            raise RuntimeError(f"the dense and expert engines disagree on the step: {result} vs {other}")
        self.step_count = self.dense.step_count
        return result

    def close(self) -> None:
        try:
            self.experts.close()
        finally:
            self.dense.close()
