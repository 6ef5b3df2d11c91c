"""The written interface every optimizer engine implements, and the types it speaks.

Two engines implement it: `offload.engine.ZeroOffloadEngine` (fp32 master and Adam on the host,
the product) and `training.plain_optimizer.PlainDDPOptimizer` (everything on the device, the
baseline). The training loop, the checkpoint code and the benchmarks see only this Protocol.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ContextManager, Protocol, runtime_checkable

import torch


@dataclass
class AdamConfig:
    lr: float = 1e-3
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    adamw: bool = True              # decoupled weight decay (AdamW); False = L2 into the gradient (Adam)
    bias_correction: bool = True
    state_dtype: str = "fp32"       # exp_avg/exp_avg_sq precision: fp32 | bf16


@dataclass
class StepResult:
    skipped: bool
    grad_norm: float               # global, before clipping (nan/inf when the step overflowed)
    clip_coef: float
    loss_scale: float
    speculated_buckets: int = 0    # --overlap-cpu-step: buckets whose CPU Adam ran during backward
    rolled_back_buckets: int = 0   # ... and were undone and redone (clipped, overflow, other lr)
    # --log-num-zeros-in-grad: exact zeros in the step's gradient, each element once over the world
    # (Megatron-LM's count_zeros); None unless the optimizer's count_zeros_in_grad was set, or skipped
    num_zeros_in_grad: float | None = None


@runtime_checkable
class TrainingOptimizer(Protocol):
    """One optimizer engine as the training loop drives it:

        for each micro-batch:  with opt.forward_context(): loss = model(...)
                               opt.backward(loss / A, last_micro_batch=...)
        opt.step(lr, decoupled_lr)
        ...
        opt.flush()            before evaluation, a checkpoint, or the end of training
    """

    model: torch.nn.Module
    accounting: object              # offload.accounting.Accounting: bytes held and moved
    # True when the fp32 master in state_dict() is the truth and the model's 16-bit weights are
    # derived from it (reload_params_from_master); False when the model's weights are the truth.
    holds_master_weights: bool
    step_count: int                 # updates applied (Adam's bias-correction step); checkpoints restore it
    loss_scaler: object             # offload.loss_scaler: state_dict()/load_state_dict(), scale
    count_zeros_in_grad: bool       # set before step(): its StepResult counts the gradient's zeros

    def forward_context(self) -> ContextManager: ...

    def backward(self, loss: torch.Tensor, *, last_micro_batch: bool = True) -> None: ...

    def step(self, lr: float | None = None, decoupled_lr: float | None = None) -> StepResult:
        """One update at learning rate `lr` (None: AdamConfig.lr); the parameters megatron-core marks
        `is_embedding_or_output_parameter` (the word embedding and output layer weights, Megatron's
        --decoupled-lr group) at `decoupled_lr` (None: `lr`)."""

    def flush(self) -> StepResult | None:
        """Apply any update still pending (delayed parameter update); None when nothing was."""

    def drain_phases(self) -> list[tuple[str, float, float]]:
        """(phase, start, end) in time.monotonic() seconds recorded since the last call."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, sd: dict) -> None: ...

    def reload_params_from_master(self) -> None: ...

    def close(self) -> None: ...
