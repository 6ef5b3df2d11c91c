"""The log interval: what one window of iterations measured, written as one log line.

Each iteration adds its loss and the optimizer's step result; every --log-interval iterations the
window becomes a row (training/metrics.py writes it to the console, JSONL, TensorBoard, W&B) and
starts over. As Megatron's interval timer, time spent evaluating or saving is paused out of it.
"""
from __future__ import annotations

import contextlib
import datetime
import math

import torch

from zo_megatron.parallel import collectives
from zo_megatron.training.metrics import device_peak_tflops, host_rss_bytes
from zo_megatron.training.nvme_flags import nvme_endurance_line, nvme_step_fields
from zo_megatron.training.params_norm import params_l2_norm


class StepLog:
    """One log window. `clock` is the trainer's monotonic clock (one clock for the whole job)."""

    def __init__(self, metrics, args, ps, optimizer, flops_per_token: float, start_iter: int, clock, moe=None):
        self.metrics, self.args, self.ps, self.optimizer, self.moe = metrics, args, ps, optimizer, moe
        self.flops_per_token, self.start_iter, self.clock = flops_per_token, start_iter, clock
        self.grad_norm, self.delayed = 0.0, False
        self.num_zeros_in_grad: float | None = None
        self.batch = args.global_batch_size                 # the last iteration's (a ramp's grows)
        self.peak_tflops = device_peak_tflops(ps.device)    # None where unknown (every CPU): no MFU
        self.nvme_last: dict = {}                           # --optimizer-nvme-path's counters at the last row
        self.nvme_rows = 0                                  # rows with the tier's fields (the first has the set-up's writes)
        self._reset()

    def _reset(self) -> None:
        self.loss, self.n, self.skipped, self.nan, self.samples = 0.0, 0, 0, 0, 0
        self.speculated, self.rolled_back = 0, 0
        self.t = self.clock()

    def record(self, loss: float, res, delayed: bool, samples: int) -> None:
        """One iteration of `samples` samples (its global batch): its loss (a host float; NaN/inf counted
        apart) and the optimizer's StepResult."""
        self.samples += samples
        self.batch = samples
        self.num_zeros_in_grad = res.num_zeros_in_grad
        if math.isfinite(loss):
            self.loss += loss
        else:
            self.nan += 1
        self.n += 1
        self.skipped += int(res.skipped)
        self.speculated += res.speculated_buckets
        self.rolled_back += res.rolled_back_buckets
        self.grad_norm, self.delayed = res.grad_norm, delayed

    @contextlib.contextmanager
    def paused(self):
        """Evaluation and checkpoint saving stay out of the interval timer (as Megatron's)."""
        t0 = self.clock()
        try:
            yield
        finally:
            self.t += self.clock() - t0

    def write(self, iteration: int, lr: float, res, consumed_samples: int, decoupled_lr: float | None = None) -> None:
        """The window as one row, then a fresh window. The loss is the mean over the window's finite
        losses of every DP rank; the memory peaks are every rank's (one small gather per record).
        `decoupled_lr` (--decoupled-lr's rate) is in the row only when the run has one."""
        args, ps = self.args, self.ps
        stats = torch.tensor([self.loss, self.n - self.nan], dtype=torch.float64)
        collectives.all_reduce(stats, group=ps.dp_group)
        host_peak = host_rss_bytes()
        device_peak = torch.cuda.max_memory_allocated(ps.device) if ps.device.type == "cuda" else None
        # what the caching allocator held at its peak (allocated + its cached blocks): the part of the GPU's
        # memory above the allocated peak that a plan must budget for (issue 34, the NVML check)
        reserved_peak = torch.cuda.max_memory_reserved(ps.device) if ps.device.type == "cuda" else None
        peaks = rank_peaks(host_peak, device_peak)
        dt = self.clock() - self.t
        tokens = self.samples * args.seq_length            # a --rampup-batch-size window's batches differ
        tflops = self.flops_per_token * tokens / dt / ps.world_size / 1e12
        acc = self.optimizer.accounting
        nvme = nvme_step_fields(self.optimizer, self.nvme_last, self.n)
        self.nvme_rows += bool(nvme)
        if self.nvme_rows == 2:                             # once, from a row without the set-up's writes
            line = nvme_endurance_line(nvme, dt / max(self.n, 1), ps.world_size)
            if line:
                self.metrics.print(line)
        self.metrics.log_train({
            "iteration": iteration, "time": wall_clock(), "consumed_samples": consumed_samples,
            "consumed_tokens": consumed_samples * args.seq_length, "global_batch_size": self.batch,
            "loss": stats[0].item() / max(stats[1].item(), 1.0), "lr": lr,
            **({} if decoupled_lr is None else {"decoupled_lr": decoupled_lr}),
            "grad_norm": self.grad_norm, "loss_scale": res.loss_scale, "skipped": self.skipped,
            # Megatron-LM's --log-num-zeros-in-grad (the last step's; None when it was skipped), --log-params-norm
            **({"num_zeros_in_grad": self.num_zeros_in_grad} if args.log_num_zeros_in_grad else {}),
            **({"params_norm": params_l2_norm(self.optimizer.model, ps)} if args.log_params_norm else {}),
            "nan_iterations": self.nan, "tokens_per_s": tokens / dt, "step_time_s": dt / max(self.n, 1),
            "tflops_per_rank": tflops, "mfu": tflops / self.peak_tflops if self.peak_tflops else None,
            "device_model_state_bytes": acc.device_model_state_bytes, "host_model_state_bytes": acc.host_bytes,
            "host_rss_bytes": host_peak, "comm_bytes_per_step": acc.sent_bytes,
            # --overlap-cpu-step: buckets whose CPU Adam ran during backward / were undone and redone
            "speculated_buckets": self.speculated, "rolled_back_buckets": self.rolled_back,
            "overlap_cpu_step": bool(getattr(args, "overlap_cpu_step", False)),
            "device_peak_bytes": device_peak, "device_reserved_peak_bytes": reserved_peak,
            **peaks,
            "delayed_update": self.delayed,
            **nvme,
            # a mixture of experts: the router's aux losses, as Megatron-LM logs them (training/moe_losses.py)
            **(self.moe.window(self.n) if self.moe is not None else {}),
            "_iters_done_this_run": iteration - self.start_iter,
        })
        self._reset()


def wall_clock() -> str:
    """Now, as an ISO 8601 UTC timestamp to the second (what a log line and a JSONL record carry)."""
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def rank_peaks(host_peak: int, device_peak: int | None) -> dict:
    """Every rank's peak host memory (its own VmHWM) and device memory (CUDA's peak allocated; None
    on a CPU), gathered over the world: per-rank lists in rank order, their maximum and its rank."""
    mine = torch.tensor([host_peak, -1 if device_peak is None else device_peak], dtype=torch.int64)
    gathered = torch.stack(collectives.all_gather_list(mine, None))       # host tensors over gloo
    rows = gathered.tolist()
    host = [r[0] for r in rows]
    out = {"host_peak_bytes_per_rank": host, "host_peak_bytes_max": max(host),
           "host_peak_rank": host.index(max(host))}
    if device_peak is None:
        return {**out, "device_peak_bytes_per_rank": None, "device_peak_bytes_max": None, "device_peak_rank": None}
    dev = [r[1] for r in rows]
    return {**out, "device_peak_bytes_per_rank": dev, "device_peak_bytes_max": max(dev),
            "device_peak_rank": dev.index(max(dev))}
