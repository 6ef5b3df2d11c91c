"""The ZeRO-Offload engine: ZeRO-2 gradient partitioning over DP with the optimizer on the CPU.

One step, per TP rank, DP group of N (paper sections 3-4):

  backward   each parameter's gradient lands in one of two bucket buffers (device); a full bucket
             is reduce-scattered over DP (averaged) and this rank's shard goes to the host as
             16 bits: 2 bytes/param cross the bus, not DeepSpeed's fp32 4.
  step       overflow check + global grad norm (all TP and DP ranks, TP-replicated params once)
             -> clip coefficient -> CPU Adam over the host partition: reads the 16-bit gradient,
             updates fp32 master / exp_avg / exp_avg_sq, writes the new 16-bit param in the same
             pass -> host->device -> all-gather over DP into the flat parameter buffer.

The device keeps only the 16-bit parameters (a flat buffer the model's parameters view) and at
most two gradient buckets; the host keeps Psi/N of fp32 master, exp_avg, exp_avg_sq and one 16-bit
staging partition (gradients in, parameters out). Wire bytes per step equal a DDP all-reduce.
Gradient accumulation: micro-batches before the last accumulate locally in `param.grad` with no
communication; the last one streams through the buckets.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from zo_megatron.errors import ConfigError
from zo_megatron.offload import cpu_adam
from zo_megatron.offload.accounting import Accounting
from zo_megatron.offload.collectives import all_gather, reduce_scatter
from zo_megatron.offload.device import DeviceLayer
from zo_megatron.offload.flat_buffer import FlatLayout
from zo_megatron.offload.loss_scaler import ConstantLossScaler, DynamicLossScaler

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


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


class ZeroOffloadEngine:
    def __init__(self, model: torch.nn.Module, *, precision: str = "bf16", adam: AdamConfig | None = None,
                 clip_grad: float = 1.0, bucket_size: int = 40_000_000, dp_group=None, tp_rank: int = 0,
                 loss_scaler=None, no_decay_embeddings: bool = False, device: torch.device | None = None,
                 pin_memory: bool = True):
        if precision not in _DTYPES:
            raise ConfigError(f"precision must be bf16, fp16 or fp32 (got {precision!r})")
        self.model = model
        self.precision = precision
        self.dtype = _DTYPES[precision]
        self.adam = adam or AdamConfig()
        self.clip_grad = clip_grad
        self.dp_group = dp_group
        self.tp_rank = tp_rank
        self.dp_size = dist.get_world_size(dp_group) if dist.is_initialized() else 1
        self.dp_rank = dist.get_rank(dp_group) if dist.is_initialized() else 0
        if loss_scaler is None:
            loss_scaler = DynamicLossScaler() if precision == "fp16" else ConstantLossScaler(1.0)
        self.loss_scaler = loss_scaler
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if not named:
            raise ConfigError("the model has no trainable parameters")
        self.device = device or named[0][1].device
        self.dev = DeviceLayer(self.device, pin_memory)
        self.layout = FlatLayout(named, dp_size=self.dp_size, dp_rank=self.dp_rank, tp_rank=tp_rank,
                                 bucket_size=bucket_size, no_decay_embeddings=no_decay_embeddings)
        self._check_dp_group_agrees()
        self._build_buffers()
        self.check_params()
        self.step_count = 0
        self._sync = True
        self._bucket_buf: dict[int, torch.Tensor] = {}   # bucket index -> its device buffer
        self._free = list(self._grad_buffers)
        self._copy_events: dict[int, object] = {}        # buffer -> its pending device->host copy
        self._deferred: set[int] = set()                 # buckets waiting for a free buffer
        self._waiting: list[list] = [[] for _ in self.layout.buckets]   # their ready slots
        self._absorbed: list[list] = [[] for _ in self.layout.buckets]  # slots copied into their bucket
        self._done = [False] * len(self.layout.buckets)
        self._hooks = [s.param.register_post_accumulate_grad_hook(self._make_hook(s)) for s in self.layout.slots]

    # ----------------------------------------------------------------------------------- set-up
    def _check_dp_group_agrees(self) -> None:
        """Every DP rank must derive the same layout, or the collectives would mix up shards."""
        if self.dp_size == 1:
            return
        sig = torch.tensor([self.layout.numel, len(self.layout.buckets), self.layout.max_bucket_numel],
                           dtype=torch.int64)
        lo, hi = sig.clone(), sig.clone()
        dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=self.dp_group)
        dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=self.dp_group)
        if not torch.equal(lo, hi):
            raise ConfigError(
                f"DP ranks disagree on the parameter partitioning (flat size/buckets/max bucket "
                f"{sig.tolist()} here, {lo.tolist()}..{hi.tolist()} across the DP group): every DP rank "
                f"must build the same model with the same --bucket-size")

    def _build_buffers(self) -> None:
        L, acc = self.layout, Accounting()
        self.flat = self.dev.device_empty(L.numel, self.dtype)
        self.flat.zero_()
        master = torch.zeros(L.host_numel, dtype=torch.float32)
        with torch.no_grad():
            for s in L.slots:
                src = s.param.detach().reshape(-1)
                self.flat[s.start:s.start + s.numel].copy_(src)
            for s, host, pstart, n in L.host_fragments():
                master[host:host + n].copy_(s.param.detach().reshape(-1)[pstart:pstart + n].float())
            for s in L.slots:   # the model's parameters become views of the flat 16-bit buffer
                s.param.data = self.flat[s.start:s.start + s.numel].view(s.param.shape)
        self.master = master
        state_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}.get(self.adam.state_dtype)
        if state_dtype is None:
            raise ConfigError(f"optimizer state dtype must be fp32 or bf16 (got {self.adam.state_dtype!r})")
        self.exp_avg = torch.zeros(L.host_numel, dtype=state_dtype)
        self.exp_avg_sq = torch.zeros(L.host_numel, dtype=state_dtype)
        # One 16-bit host partition: the reduced gradients arrive here, the kernel overwrites them
        # with the updated 16-bit parameters, which go back to the device.
        self.host16 = self.dev.host_empty(L.host_numel, self.dtype)
        self.host16.zero_()
        self._grad_buffers = [self.dev.device_empty(L.max_bucket_numel, self.dtype)
                              for _ in range(min(2, len(L.buckets)))]
        esz = self.flat.element_size()
        acc.device_param_bytes = L.numel * esz
        acc.device_bucket_bytes = sum(b.numel() * esz for b in self._grad_buffers)
        acc.host_master_bytes = self.master.numel() * 4
        acc.host_optimizer_bytes = 2 * self.exp_avg.numel() * self.exp_avg.element_size()
        acc.host_staging_bytes = self.host16.numel() * self.host16.element_size()
        self.accounting = acc

    def check_params(self) -> None:
        """Every trainable parameter must be a view of the flat buffer (none added or replaced)."""
        base = self.flat.untyped_storage().data_ptr()
        missing = [n for n, p in self.model.named_parameters()
                   if p.requires_grad and p.untyped_storage().data_ptr() != base]
        if missing:
            raise ConfigError(f"parameters not covered by the flat buffer: {missing[:5]}"
                              f"{' ...' if len(missing) > 5 else ''}; build the engine after the model is "
                              "complete and do not replace parameters afterwards")

    # ---------------------------------------------------------------------------------- backward
    def forward_context(self):
        """The model already runs in self.dtype (its parameters are views of the flat buffer)."""
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor, *, last_micro_batch: bool = True) -> None:
        """loss.backward() with loss scaling; only the last micro-batch communicates."""
        self._sync = last_micro_batch
        if last_micro_batch:
            self.accounting.reset_step()
        (loss * self.loss_scaler.scale).backward() if self.loss_scaler.scale != 1.0 else loss.backward()

    def _make_hook(self, slot):
        def hook(param: torch.Tensor) -> None:
            if self._sync:
                self._grad_ready(slot)
        return hook

    def _grad_ready(self, slot) -> None:
        b = slot.bucket
        buf = self._bucket_buf.get(b)
        if buf is not None:
            self._absorb(slot, buf)
            return
        self._waiting[b].append(slot)   # param.grad is kept until its bucket has a buffer
        if self._free:
            self._open_bucket(b)
        else:
            self._deferred.add(b)

    def _open_bucket(self, b: int) -> None:
        bucket = self.layout.buckets[b]
        base = self._free.pop()
        self.dev.before_reuse(self._copy_events.pop(base.data_ptr(), None))
        buf = base[: bucket.numel]
        buf.zero_()
        self._bucket_buf[b] = buf
        waiting, self._waiting[b] = self._waiting[b], []
        for s in waiting:
            self._absorb(s, buf, flush=False)
        self._deferred.discard(b)
        if len(self._absorbed[b]) == len(bucket.slots):
            self._flush(b)

    def _absorb(self, slot, buf: torch.Tensor, flush: bool = True) -> None:
        bucket = self.layout.buckets[slot.bucket]
        off = slot.start - bucket.start
        buf[off:off + slot.numel].copy_(slot.param.grad.reshape(-1))
        slot.param.grad = None
        self._absorbed[slot.bucket].append(slot)
        if flush and len(self._absorbed[slot.bucket]) == len(bucket.slots):
            self._flush(slot.bucket)

    def _flush(self, b: int) -> None:
        """Reduce-scatter a complete bucket (averaged over DP) and send this rank's shard home."""
        bucket, buf = self.layout.buckets[b], self._bucket_buf.pop(b)
        n = bucket.shard_numel
        if self.dp_size > 1:
            buf.div_(self.dp_size)
        mine = buf[self.dp_rank * n:(self.dp_rank + 1) * n]
        reduce_scatter(mine, buf, self.dp_group, self.dp_size)     # in place: the shard lands in `mine`
        self.accounting.ring(buf.numel() * buf.element_size(), self.dp_size)
        ev = self.dev.copy_to_host(self.host16[bucket.host_start:bucket.host_start + n], mine)
        self._copy_events[buf.data_ptr()] = ev   # the buffer is free once the copy has read it
        self.accounting.d2h_bytes += n * buf.element_size()
        self._done[b] = True
        self._free.append(self._base_of(buf))
        for nxt in sorted(self._deferred):
            if self._free and nxt not in self._bucket_buf:
                self._open_bucket(nxt)

    def _base_of(self, view: torch.Tensor) -> torch.Tensor:
        for base in self._grad_buffers:
            if base.data_ptr() == view.data_ptr():
                return base
        raise AssertionError("bucket view of an unknown buffer")

    def finish_grad_sync(self) -> None:
        """Flush every bucket not yet sent, in order. Parameters that got no gradient in the last
        micro-batch contribute what they accumulated earlier, or zero."""
        for b in range(len(self.layout.buckets)):
            if self._done[b]:
                continue
            if b not in self._bucket_buf:
                while not self._free:        # both buffers hold later, incomplete buckets
                    self._complete(next(iter(self._bucket_buf)))
                self._open_bucket(b)
            if not self._done[b]:
                self._complete(b)
        self.dev.wait_host()
        self._done = [False] * len(self.layout.buckets)
        self._absorbed = [[] for _ in self.layout.buckets]
        self._deferred.clear()

    def _complete(self, b: int) -> None:
        """Absorb the gradients an open bucket is still missing (accumulated earlier), then flush."""
        absorbed = {id(s) for s in self._absorbed[b]}
        for s in self.layout.buckets[b].slots:
            if id(s) not in absorbed and s.param.grad is not None:
                self._absorb(s, self._bucket_buf[b], flush=False)
        self._flush(b)

    # -------------------------------------------------------------------------------------- step
    def step(self, lr: float | None = None) -> StepResult:
        """Finish the gradient sync, then clip and update on the CPU; params return to the device."""
        self.check_params()
        self.finish_grad_sync()
        scale = self.loss_scaler.scale
        sumsq, finite = self._local_sumsq_and_finite()
        stats = torch.tensor([sumsq, 0.0 if finite else 1.0], dtype=torch.float64)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(stats)                     # over every TP and DP rank
        found_inf = bool(stats[1].item() > 0) or not math.isfinite(stats[0].item())
        grad_norm = math.sqrt(stats[0].item()) / scale if not found_inf else float("nan")
        self.loss_scaler.update(found_inf)
        if found_inf:                                  # every rank agrees: skip, touch nothing
            return StepResult(True, grad_norm, 0.0, scale)
        clip_coef = 1.0
        if self.clip_grad and self.clip_grad > 0:
            clip_coef = min(1.0, self.clip_grad / (grad_norm + 1e-6))
        self.step_count += 1
        a = self.adam
        lr = a.lr if lr is None else lr
        for seg in self.layout.segments:
            sl = slice(seg.start, seg.end)
            cpu_adam.adam_step(self.master[sl], self.host16[sl], self.exp_avg[sl], self.exp_avg_sq[sl],
                               step=self.step_count, lr=lr, beta1=a.beta1, beta2=a.beta2, eps=a.eps,
                               weight_decay=a.weight_decay if seg.decay else 0.0, adamw=a.adamw,
                               bias_correction=a.bias_correction, grad_scale=clip_coef / scale,
                               param16_out=self.host16[sl] if self.dtype != torch.float32 else None)
        if self.dtype == torch.float32:     # fp32 mode: the "16-bit" staging copy is the master itself
            self.host16.copy_(self.master)
        self._params_to_device()
        return StepResult(False, grad_norm, clip_coef, scale)

    def _local_sumsq_and_finite(self) -> tuple[float, bool]:
        sumsq, finite = 0.0, True
        for seg in self.layout.segments:
            s, ok = cpu_adam.grad_sumsq_and_finite(self.host16[seg.start:seg.end])
            finite &= ok
            if seg.counted:
                sumsq += s
        return sumsq, finite

    def _params_to_device(self) -> None:
        """Updated 16-bit shards -> device -> all-gather over DP into the flat buffer."""
        for bucket in self.layout.buckets:
            lo, hi = bucket.shard_range(self.dp_rank)
            n = hi - lo
            self.dev.copy_to_device(self.flat[lo:hi], self.host16[bucket.host_start:bucket.host_start + n])
            self.accounting.h2d_bytes += n * self.flat.element_size()
            all_gather(self.flat[bucket.start:bucket.end], self.flat[lo:hi], self.dp_group, self.dp_size)
            self.accounting.ring(bucket.numel * self.flat.element_size(), self.dp_size)

    @torch.no_grad()
    def reload_params_from_master(self) -> None:
        """Re-derive the 16-bit parameters from the fp32 master (after loading a checkpoint)."""
        self.host16.copy_(self.master.to(self.dtype))
        self._params_to_device()

    # ------------------------------------------------------------------------------------- state
    def state_dict(self) -> dict:
        """This DP rank's optimizer state, keyed by parameter name.

        Each entry holds the piece of the (TP-local, flattened) parameter this rank owns --
        `fragment` = (start, end) -- with the parameter's TP split axis and shard offset, so a
        resharder can place it in the full tensor for any TP x DP layout.
        """
        params: dict[str, dict] = {}
        for s, host, pstart, n in self.layout.host_fragments():
            p = s.param
            axis = int(getattr(p, "partition_dim", 0)) if getattr(p, "tensor_model_parallel", False) else None
            params[s.name] = {
                "local_shape": tuple(p.shape), "tp_axis": axis,
                # where this TP shard starts along tp_axis in the full (vocab-padded) tensor
                "tp_offset": 0 if axis is None else self.tp_rank * p.shape[axis],
                "fragment": (pstart, pstart + n),
                "master": self.master[host:host + n].clone(),
                "exp_avg": self.exp_avg[host:host + n].clone(),
                "exp_avg_sq": self.exp_avg_sq[host:host + n].clone(),
            }
        return {"step": self.step_count, "adam": asdict(self.adam), "precision": self.precision,
                "dp_size": self.dp_size, "dp_rank": self.dp_rank, "tp_rank": self.tp_rank,
                "loss_scaler": self.loss_scaler.state_dict(), "params": params}

    def load_state_dict(self, sd: dict) -> None:
        """Inverse of state_dict() for the same layout; refuses anything that does not match."""
        params = sd.get("params", {})
        for s, host, pstart, n in self.layout.host_fragments():
            entry = params.get(s.name)
            if entry is None:
                raise ConfigError(f"optimizer state has no entry for parameter {s.name!r}")
            if tuple(entry["local_shape"]) != tuple(s.param.shape) or tuple(entry["fragment"]) != (pstart, pstart + n):
                raise ConfigError(f"optimizer state for {s.name!r} was saved for another layout "
                                  f"(shape {tuple(entry['local_shape'])}, fragment {tuple(entry['fragment'])}; "
                                  f"here {tuple(s.param.shape)}, {(pstart, pstart + n)}): reshard it first")
            self.master[host:host + n].copy_(entry["master"])
            self.exp_avg[host:host + n].copy_(entry["exp_avg"])
            self.exp_avg_sq[host:host + n].copy_(entry["exp_avg_sq"])
        self.step_count = int(sd["step"])
        self.loss_scaler.load_state_dict(sd["loss_scaler"])
        self.reload_params_from_master()

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self.dev.close()
