"""The non-offloaded baseline: DDP-style gradient all-reduce + torch AdamW(fused=True) on the device.

Implements `optimizer_api.TrainingOptimizer` like ZeroOffloadEngine, so the training loop and
the benchmarks compare the two on equal terms. Parameters, gradients and both Adam
moments live on the device in fp32 (16 bytes/param); bf16/fp16 run the forward under autocast.
"""
from __future__ import annotations

import contextlib
import math
import time

import torch

from zo_megatron.errors import ConfigError
from zo_megatron.offload.accounting import Accounting
from zo_megatron.offload.flat_buffer import is_decoupled
from zo_megatron.offload.loss_scaler import ConstantLossScaler, DynamicLossScaler
from zo_megatron.optimizer_api import AdamConfig, StepResult
from zo_megatron.parallel import collectives

_AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}


def local_norm_stats(grads: list[torch.Tensor], counted: list[bool], count_zeros: bool = False) -> torch.Tensor:
    """[sum of squared per-tensor norms of the counted gradients, 1.0 if any gradient is
    non-finite else 0.0, exact zeros in the counted gradients (0 unless `count_zeros`)] in
    float64, on the gradients' device.

    Per-tensor fp32 norms in one multi-tensor call (as Megatron's multi_tensor_l2norm), their
    squares summed in float64; a NaN/inf in any gradient makes its norm, and so the sum,
    non-finite. Both numbers are built on the gradients' device -- an empty list's zero too --
    so they stack there and cross to the host in one transfer (a CPU zero next to a CUDA sum
    made torch.stack raise on every TP=1 CUDA run)."""
    device = grads[0].device
    zero = torch.zeros((), dtype=torch.float64, device=device)
    counted_grads = [g for g, c in zip(grads, counted) if c]
    sumsq = torch.stack(torch._foreach_norm(counted_grads)).double().square().sum() if counted_grads else zero
    uncounted = [g for g, c in zip(grads, counted) if not c]    # TP copies: only their finiteness
    bad = torch.stack(torch._foreach_norm(uncounted)).double().sum() if uncounted else zero
    zeros = zero
    if count_zeros and counted_grads:
        zeros = float(sum(g.numel() for g in counted_grads)) - \
            torch.stack([torch.count_nonzero(g) for g in counted_grads]).double().sum()
    return torch.stack([sumsq, (~torch.isfinite(bad)).double(), zeros])


class PlainDDPOptimizer:
    holds_master_weights = False            # the model's fp32 weights are the truth

    def __init__(self, model: torch.nn.Module, *, precision: str = "bf16", adam: AdamConfig | None = None,
                 clip_grad: float = 1.0, dp_group=None, tp_rank: int = 0, loss_scaler=None,
                 no_decay_embeddings: bool = False, tp_group=None):
        self.model, self.precision = model, precision
        self.adam = adam or AdamConfig()
        self.clip_grad = clip_grad
        self.count_zeros_in_grad = False        # --log-num-zeros-in-grad: set by the job before a logged step
        self.dp_group = dp_group
        self.dp_size = collectives.group_size(dp_group)
        self.loss_scaler = loss_scaler or (DynamicLossScaler() if precision == "fp16" else ConstantLossScaler())
        self.params = [p for p in model.parameters() if p.requires_grad]
        # Sequence parallelism: megatron-core sums the gradients of parameters tagged
        # `sequence_parallel` (norms, row-parallel biases: each TP rank saw 1/TP of the sequence)
        # over the TP group (finalize_model_grads); so do we, after the DP all-reduce.
        self._sp_params = [p for p in self.params if getattr(p, "sequence_parallel", False)]
        if self._sp_params and tp_group is None:
            raise ConfigError("the model has sequence-parallel parameters: pass the optimizer its TP group "
                              "(tp_group=...) so their gradients are summed over TP")
        self.tp_group = tp_group
        # Replicated-across-TP params are counted once in the global norm (on TP rank 0).
        self._counted = [bool(getattr(p, "tensor_model_parallel", False)) or tp_rank == 0 for p in self.params]
        # Megatron's groups: weight decay or not x the decoupled rate (--decoupled-lr: the word
        # embedding and output layer, flat_buffer.is_decoupled) or not; empty groups left out.
        groups: dict[tuple[bool, bool], list] = {}
        for name, p in model.named_parameters():
            if p.requires_grad:
                decay = p.dim() > 1 and not (no_decay_embeddings and "embedding" in name)
                groups.setdefault((decay, is_decoupled(p)), []).append(p)
        a = self.adam
        self.opt = torch.optim.AdamW(
            [{"params": ps, "weight_decay": a.weight_decay if decay else 0.0, "decoupled": decoupled}
             for (decay, decoupled), ps in sorted(groups.items(), key=lambda kv: (kv[0][1], not kv[0][0]))],
            lr=a.lr, betas=(a.beta1, a.beta2), eps=a.eps, fused=True)
        n = sum(p.numel() for p in self.params)
        self.accounting = Accounting(device_param_bytes=4 * n, device_bucket_bytes=4 * n,
                                     device_optimizer_bytes=8 * n)
        self.step_count = 0
        self._phases: list[tuple[str, float, float]] = []

    def forward_context(self):
        dtype = _AUTOCAST.get(self.precision)
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.params[0].device.type, dtype=dtype)

    def backward(self, loss: torch.Tensor, *, last_micro_batch: bool = True) -> None:
        if last_micro_batch:
            self.accounting.reset_step()
        (loss * self.loss_scaler.scale).backward()

    def _allreduce_grads(self) -> None:
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        if self.dp_size > 1:
            flat = torch.cat([g.reshape(-1) for g in grads]).div_(self.dp_size)
            collectives.all_reduce(flat, group=self.dp_group)
            self.accounting.ring(collectives.wire_bytes("all_reduce", flat), self.dp_size)
            off = 0
            for g in grads:
                g.copy_(flat[off:off + g.numel()].view_as(g))
                off += g.numel()
        for p, g in zip(self.params, grads):
            p.grad = g
        if self._sp_params and collectives.group_size(self.tp_group) > 1:
            flat = torch.cat([p.grad.reshape(-1) for p in self._sp_params])
            collectives.all_reduce(flat, group=self.tp_group)
            off = 0
            for p in self._sp_params:
                p.grad.copy_(flat[off:off + p.numel()].view_as(p.grad))
                off += p.numel()

    def step(self, lr: float | None = None, decoupled_lr: float | None = None) -> StepResult:
        t0 = time.monotonic()
        try:
            return self._step(lr, decoupled_lr)
        finally:
            self._phases = [("optimizer_step", t0, time.monotonic())]

    def _step(self, lr: float | None, decoupled_lr: float | None) -> StepResult:
        self._allreduce_grads()
        scale = self.loss_scaler.scale
        # One device->host transfer, one small all-reduce.
        grads = [p.grad for p in self.params]
        stats = local_norm_stats(grads, self._counted, self.count_zeros_in_grad).cpu()
        collectives.all_reduce(stats)   # over the world: every DP replica adds the same sum
        stats[0] /= self.dp_size           # after the all-reduce, so each is counted once
        stats[2] /= self.dp_size
        found_inf = stats[1].item() > 0 or not math.isfinite(stats[0].item())
        self.loss_scaler.update(found_inf)
        if found_inf:
            self.opt.zero_grad(set_to_none=True)
            return StepResult(True, float("nan"), 0.0, scale)
        norm = math.sqrt(stats[0].item()) / scale
        clip = min(1.0, self.clip_grad / (norm + 1e-6)) if self.clip_grad and self.clip_grad > 0 else 1.0
        if clip / scale != 1.0:
            torch._foreach_mul_(grads, clip / scale)
        lr = self.adam.lr if lr is None else lr
        for g in self.opt.param_groups:
            g["lr"] = decoupled_lr if g["decoupled"] and decoupled_lr is not None else lr
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.step_count += 1
        return StepResult(False, norm, clip, scale,
                          num_zeros_in_grad=stats[2].item() if self.count_zeros_in_grad else None)

    def flush(self) -> StepResult | None:
        return None

    def drain_phases(self) -> list[tuple[str, float, float]]:
        """One phase: the all-reduce and the AdamW step together."""
        out, self._phases = self._phases, []
        return out

    def reload_params_from_master(self) -> None:
        """The model's parameters are the master weights: nothing to derive."""

    def state_dict(self) -> dict:
        return {"step": self.step_count, "optimizer": self.opt.state_dict(),
                "loss_scaler": self.loss_scaler.state_dict()}

    def load_state_dict(self, sd: dict) -> None:
        self.opt.load_state_dict(sd["optimizer"])
        self.step_count = int(sd["step"])
        self.loss_scaler.load_state_dict(sd["loss_scaler"])

    def close(self) -> None:
        pass
