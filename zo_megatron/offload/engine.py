"""The ZeRO-Offload engine: ZeRO-2 gradient partitioning over DP with the optimizer on the CPU.

One step, per TP rank, DP group of N (paper sections 3-4):

  backward   each parameter's gradient lands in a bucket buffer on the device (at most two
             buffers; fp32 with --accumulate-allreduce-grads-in-fp32); a complete bucket is
             reduce-scattered over DP (averaged, async) and this rank's shard is copied home on a
             side stream once the collective is done, as 16 bits unless fp32 host gradients were
             asked for: the compute stream never waits for communication.
  step       overflow check + global grad norm (all TP and DP ranks, TP-replicated params once)
             -> clip coefficient -> ONE CPU Adam call over the host partition's segments: reads
             the gradient, updates fp32 master / exp_avg / exp_avg_sq, writes the new 16-bit param
             in the same pass -> host->device -> async all-gather over DP into the flat buffer.

Ordering rules (the collectives of all DP ranks must match one for one):
  - buckets are reduce-scattered in bucket order 0, 1, 2, ... on every rank. A bucket that
    completes early waits for its turn; a rank whose gradients arrive in another order (a branch
    unused on this rank, a frozen path) still issues the same sequence.
  - only buckets in the window [next to send, next + buffers) get a buffer, so the next bucket
    can always be opened; gradients of later buckets stay in param.grad until their turn.
  - at the end of backward every bucket not yet sent is completed from whatever its parameters
    hold (what earlier micro-batches accumulated, or zero) and sent, in order.

The device keeps the 16-bit parameters (a flat buffer the model's parameters view) and the bucket
buffers; the host keeps Psi/N of fp32 master, exp_avg, exp_avg_sq and the staging partition(s).
Gradient accumulation: by default micro-batches before the last accumulate in `param.grad` on the
device (16 bits) with no communication and only the last one streams through the buckets; with
accumulate_on_host every micro-batch is reduced and added into an fp32 host accumulator, so the
device holds no gradient copy between micro-batches (the paper's large-model single-GPU mode),
at the price of one reduce-scatter per micro-batch.

When the CPU Adam runs is a schedule (schedules.py draws the three timelines side by side):
synchronous (above), delayed (DPU, `dpu_warmup_steps=W`, docs/dpu.md) or speculative
(`overlap_cpu_step`, per-bucket CPU Adam during backward for the share of the partition that
`overlap_speculated_fraction` sets memory aside for, validated and committed or rolled back:
bit-identical to synchronous, docs/overlap.md).

Threads. The reduce-scatters are issued from the gradient hooks: on the main thread on CPU; on
CUDA autograd runs post-accumulate hooks on its device thread while the main thread is blocked
in backward(). The norm's all-reduce and the all-gathers are issued by the main thread. So one
thread issues collectives at a time, in the same order on every rank (torch.distributed does not
order collectives issued concurrently from two threads on one group). A schedule's worker thread
runs only the CPU Adam kernel and host copies, never a collective.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import math
import time

import torch

from zo_megatron.errors import ConfigError
from zo_megatron.offload import cpu_adam
from zo_megatron.offload.accounting import Accounting
from zo_megatron.offload.device import DeviceLayer, host_value
from zo_megatron.offload.device_optimizer import DeviceOptimizerTail
from zo_megatron.offload.engine_state import EngineState
from zo_megatron.offload.flat_buffer import ALIGN, FlatLayout
from zo_megatron.offload.grad_buckets import GradientBuckets
from zo_megatron.offload.loss_scaler import ConstantLossScaler, DynamicLossScaler
from zo_megatron.offload.nvme_store import NvmeConfig, NvmeStateStore
from zo_megatron.offload.schedules import DelayedSchedule, SpeculativeSchedule, SynchronousSchedule, cpu_step_agreed
from zo_megatron.offload.sequence_parallel_grads import SequenceParallelGrads
from zo_megatron.optimizer_api import AdamConfig, StepResult
from zo_megatron.parallel import collectives

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def default_grad_reduce_in_fp32(precision: str) -> bool:
    """Megatron's rule: bf16 gradients are accumulated and all-reduced in fp32."""
    return precision == "bf16"


def _refuse_bad_schedule(adam: AdamConfig, dpu_warmup_steps, dpu_weight_prediction, overlap_cpu_step,
                         speculated_fraction, offload_fraction, accumulate_on_host) -> None:
    """The engine's option combinations that have no meaning, each refused in one line."""
    if dpu_warmup_steps is not None and dpu_warmup_steps < 1:
        raise ConfigError(f"DPU warm-up must be >= 1 step (got {dpu_warmup_steps})")
    if dpu_weight_prediction and dpu_warmup_steps is None:
        raise ConfigError("--dpu-weight-prediction extrapolates the delayed update's parameters: add --dpu")
    if overlap_cpu_step and dpu_warmup_steps is not None:
        raise ConfigError("--overlap-cpu-step cannot be combined with --dpu (DPU already takes the CPU step "
                          "off the critical path, one update late): use one or the other")
    if not 0.0 <= speculated_fraction <= 1.0:
        raise ConfigError(f"the speculated share of the partition must be in [0, 1] (got {speculated_fraction!r})")
    f = offload_fraction
    if not (isinstance(f, (int, float)) and 0.0 <= f <= 1.0):
        raise ConfigError(f"the optimizer offload fraction must be in [0, 1] (got {f!r})")
    if f < 1.0:
        for bad, why in ((dpu_warmup_steps is not None, "--dpu (the device tail would not be delayed)"),
                         (accumulate_on_host, "--accumulate-grads-on-host (the tail has no host gradients)"),
                         (not adam.bias_correction, "Adam without bias correction (torch's has it)"),
                         (adam.state_dtype != "fp32", "bf16 optimizer states (the device part keeps fp32)")):
            if bad:
                raise ConfigError(f"--optimizer-offload-fraction {f:g} < 1 cannot be combined with {why}: "
                                  "use one or the other")


class ZeroOffloadEngine(GradientBuckets, EngineState):
    """The offload optimizer engine (see the module docstring). Use as a context manager, or call
    close(): it unregisters pinned host memory and removes the gradient hooks. Implements
    `optimizer_api.TrainingOptimizer` (its backward: grad_buckets.GradientBuckets; its checkpoint
    state: engine_state.EngineState).

    The model may be built on the host in fp32 (recommended for large models): its parameters are
    copied into the flat 16-bit buffer on `device` one at a time, so the device never holds more
    than that buffer and the buckets. `grad_reduce_in_fp32` (None: Megatron's default for the
    precision) puts the bucket buffers and the reduce-scatter in fp32; `host_grad_dtype` "fp32"
    copies the reduced fp32 shards home in fp32 (default: the 16-bit parameter dtype).
    `dpu_warmup_steps` (DPU) and `overlap_cpu_step` pick the schedule of the CPU step
    (schedules.py); with overlap, announce each step's learning rate with expect_lr() before its
    backward, or a step with a new rate is rolled back and redone (exact, only slower).
    """

    def __init__(self, model: torch.nn.Module, *, precision: str = "bf16", adam: AdamConfig | None = None,
                 clip_grad: float = 1.0, bucket_size: int = 40_000_000, dp_group=None, tp_rank: int = 0,
                 loss_scaler=None, no_decay_embeddings: bool = False, device: torch.device | None = None,
                 pin_memory: bool = True, grad_reduce_in_fp32: bool | None = None,
                 host_grad_dtype: str | None = None, accumulate_on_host: bool = False,
                 dpu_warmup_steps: int | None = None, race_check: bool = False,
                 optimizer_offload_fraction: float = 1.0, tp_group=None, overlap_cpu_step: bool = False,
                 dpu_weight_prediction: bool = False, overlap_speculated_fraction: float = 1.0,
                 nvme: NvmeConfig | None = None, params=None, grad_divisor: int | None = None,
                 cpu_worker=None, nvme_tag: str | None = None):
        # MoE (expert_parallel.py): params, a predicate on (name, param), picks this engine's parameters;
        # grad_divisor replaces the group size in the average; extra_grad_stats, another engine's share;
        # cpu_worker, another engine's schedule worker to share; nvme_tag, this engine's state files' name
        self._owns, self.extra_grad_stats = params or (lambda _n, _p: True), None
        self.own_grad_stats = None               # this engine's local_grad_stats(), when its caller took them already
        self.count_zeros_in_grad = False         # --log-num-zeros-in-grad: set by the job before a logged step
        self._zeros_in_grad: float | None = None
        self._cpu_worker, self._nvme_tag = cpu_worker, nvme_tag
        if precision not in _DTYPES:
            raise ConfigError(f"precision must be bf16, fp16 or fp32 (got {precision!r})")
        self.model = model
        self.precision = precision
        self.dtype = _DTYPES[precision]
        self.adam = adam or AdamConfig()
        self.clip_grad = clip_grad
        self.dp_group = dp_group
        self.tp_rank = tp_rank
        self.dp_size = collectives.group_size(dp_group)
        self.dp_rank = collectives.group_rank(dp_group)
        self.grad_divisor = grad_divisor or self.dp_size
        if loss_scaler is None:
            loss_scaler = DynamicLossScaler() if precision == "fp16" else ConstantLossScaler(1.0)
        self.loss_scaler = loss_scaler
        if grad_reduce_in_fp32 is None:
            grad_reduce_in_fp32 = default_grad_reduce_in_fp32(precision)
        self.reduce_dtype = torch.float32 if grad_reduce_in_fp32 else self.dtype
        if host_grad_dtype not in (None, "fp32", precision):
            raise ConfigError(f"host gradient dtype must be fp32 or the parameter dtype {precision} "
                              f"(got {host_grad_dtype!r})")
        self.host_grad_dtype = torch.float32 if host_grad_dtype == "fp32" else self.dtype
        if self.host_grad_dtype == torch.float32 and self.reduce_dtype != torch.float32:
            raise ConfigError("fp32 host gradients need gradients reduced in fp32: add "
                              "--accumulate-allreduce-grads-in-fp32")
        self.accumulate_on_host = accumulate_on_host
        _refuse_bad_schedule(self.adam, dpu_warmup_steps, dpu_weight_prediction, overlap_cpu_step,
                             overlap_speculated_fraction, optimizer_offload_fraction, accumulate_on_host)
        self.dpu_warmup_steps = dpu_warmup_steps
        self.dpu_weight_prediction = bool(dpu_weight_prediction)
        # --overlap-cpu-step with no host memory set aside for it speculates nothing: synchronous
        self.overlap_cpu_step = bool(overlap_cpu_step) and overlap_speculated_fraction > 0
        self.overlap_speculated_fraction = float(overlap_speculated_fraction) if self.overlap_cpu_step else 0.0
        self.offload_fraction = float(optimizer_offload_fraction)
        self.nvme_config = nvme             # --optimizer-nvme-path: the states on disk (nvme_store.py)
        self._nvme: NvmeStateStore | None = None
        if nvme is not None:
            nvme.check()                    # (the tier combines with every schedule and corrector)
        # race_check (tests, debugging): snapshot the flat parameters at the first forward of a
        # step that overlaps a CPU update and fail in step() if anything changed them meanwhile.
        self.race_check = race_check
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad and self._owns(n, p)]
        if not named:
            raise ConfigError("the model has no trainable parameters")
        self.device = torch.device(device) if device is not None else named[0][1].device
        self.dev = DeviceLayer(self.device, pin_memory)
        try:
            self.layout = FlatLayout(named, dp_size=self.dp_size, dp_rank=self.dp_rank, tp_rank=tp_rank,
                                     bucket_size=bucket_size, no_decay_embeddings=no_decay_embeddings)
            self.layout.check_same_across(self.dp_group, self.dp_size)
            self._build_buffers()
            self._place_model_on_device()
            self._zero_host_state()
            self.check_params()
        except BaseException:
            self.dev.close()
            if self._nvme is not None:
                self._nvme.close()
            raise
        # The host's segments (start, end, decay, counted, decoupled), cut where the device tail begins.
        self._host_segments = [(s.start, min(s.end, self._cut), s.decay, s.counted, s.decoupled)
                               for s in self.layout.segments if s.start < self._cut]
        self._norm_segments = [(a, e, c) for a, e, _, c, _ in self._host_segments]
        # --log-num-zeros-in-grad counts parameters' elements only (the segments above also hold the
        # buckets' padding, always zero): the host's counted runs, cut where the device tail begins
        self._zero_runs = [(a, min(e, self._cut)) for a, e in self.layout.counted_param_runs() if a < self._cut]
        self.step_count = 0
        if dpu_warmup_steps:
            self.schedule = DelayedSchedule(dpu_warmup_steps, self.dpu_weight_prediction, self.device,
                                            worker=self._cpu_worker)
        elif self.overlap_cpu_step:
            self.schedule = SpeculativeSchedule(self, self.overlap_speculated_fraction, worker=self._cpu_worker)
            self.accounting.host_overlap_bytes = self.schedule.backup_bytes
        else:
            self.schedule = SynchronousSchedule()
        self._race_ref = None
        # (phase, start, end) since drain_phases(); bounded, as nobody may ever drain it
        self._phases: collections.deque = collections.deque(maxlen=256)
        self._micro = 0                     # micro-batches of this step seen so far
        self._sync = True                   # do the hooks stream gradients into buckets?
        self._sync_pending = False          # a syncing backward ran and finish_grad_sync has not
        self._slot_index = {id(s): i for i, s in enumerate(self.layout.slots)}
        # Micro-batches before the last add their gradients into an fp32 device buffer, as
        # Megatron's main_grad, when gradients are reduced in fp32 (--accumulate-allreduce-grads-in-fp32,
        # the bf16 default): accumulated in the 16-bit param.grad instead, 32 micro-batches lose up to
        # ~16 ulps of bf16 (issue 34, 2.5). Allocated at the first such micro-batch (4 B/param).
        self._fp32_accumulation = (self.reduce_dtype == torch.float32 and self.dtype != torch.float32
                                   and not self.accumulate_on_host)
        self._main_grad: torch.Tensor | None = None
        self._main_grad_held = [False] * len(self.layout.slots)
        self.tp_group = tp_group
        self._sp_grads = SequenceParallelGrads(self.layout, self.tp_group)
        self._reset_bucket_state()
        self._hooks = [s.param.register_post_accumulate_grad_hook(self._make_hook(s)) for s in self.layout.slots]

    holds_master_weights = True             # the fp32 master on the host is the truth

    def __enter__(self) -> "ZeroOffloadEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ----------------------------------------------------------------------------------- set-up
    def _build_buffers(self) -> None:
        L, acc = self.layout, Accounting()
        state_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}.get(self.adam.state_dtype)
        if state_dtype is None:
            raise ConfigError(f"optimizer state dtype must be fp32 or bf16 (got {self.adam.state_dtype!r})")
        self.flat = self.dev.device_empty(L.numel, self.dtype)
        # Bucket padding is zero forever; placement writes every parameter's range. Zeroing only the
        # gaps keeps the set-up from touching the whole buffer (2 B/param on a CPU device) while the
        # fp32 model is still resident: with the NVMe tier that was a peak above training's.
        for lo, hi in L.padding():
            self.flat[lo:hi].zero_()
        # Host elements [0, cut) of the partition are the CPU Adam's; the tail stays on the device
        # (optimizer_offload_fraction < 1, see device_optimizer.py).
        f = self.offload_fraction
        self._cut = cut = L.host_numel if f >= 1.0 else min(L.host_numel, round(f * L.host_numel / ALIGN) * ALIGN)
        self._tail = DeviceOptimizerTail(L, cut, self.device, self.adam, self.flat, self.dp_rank) \
            if cut < L.host_numel else None
        # --optimizer-nvme-path: the moments (and with --optimizer-nvme-master the master) live in
        # files instead (None here), streamed through the store's ring for each CPU step.
        on_disk = {} if self.nvme_config is None or cut == 0 else {     # (cut 0: nothing on the host)
            "exp_avg": state_dtype, "exp_avg_sq": state_dtype, **({"master": torch.float32} if self.nvme_config.master else {})}
        if on_disk:
            tag = self._nvme_tag or f"zo_optimizer.tp{self.tp_rank}.dp{self.dp_rank}"
            self._nvme = NvmeStateStore.open_on_every_rank(self.nvme_config, tag,   # (+ the overlap's second places)
                                        [(s.start, min(s.end, cut)) for s in L.segments if s.start < cut], cut, on_disk,
                                        math.floor(self.overlap_speculated_fraction * cut))
        self.master = None if "master" in on_disk else torch.zeros(cut, dtype=torch.float32)
        # The moments and landing buffers are zeroed (touched) only after the model's fp32
        # parameters are released (_zero_host_state): touched now, they would coexist with the
        # whole fp32 model and the build would peak 4 bytes/param above the training steady state.
        self.exp_avg = None if on_disk else torch.empty(cut, dtype=state_dtype)
        self.exp_avg_sq = None if on_disk else torch.empty(cut, dtype=state_dtype)
        # Reduced gradient shards arrive in host_grad. The kernel writes the updated 16-bit
        # parameters into host_param, which goes back to the device; when both have the parameter
        # dtype they are one buffer (the kernel reads the gradient before it writes the parameter).
        # With DPU there are two landing sets (gradient, parameter-out alias, accumulator): step
        # t+1's gradients land in one while the worker updates from the other.
        sets = 2 if self.dpu_warmup_steps else 1
        self._grads = [self.dev.host_empty(cut, self.host_grad_dtype) for _ in range(sets)]
        if self.host_grad_dtype == self.dtype:
            self._params = self._grads
        else:   # a separate 16-bit output: one is enough (it is read back before the next update)
            self._params = [self.dev.host_empty(cut, self.dtype)] * sets
        self._accs = [torch.empty(cut, dtype=torch.float32) for _ in range(sets)] \
            if self.accumulate_on_host else [None] * sets
        self._cur = 0                                   # the landing set of the current step
        n_buffers = min(2, len(L.buckets))
        self._grad_buffers = [self.dev.device_empty(L.max_bucket_numel, self.reduce_dtype) for _ in range(n_buffers)]
        # On CUDA, fp32-reduced shards bound for 16-bit host gradients are narrowed on the device
        # first (one scratch per buffer: a shard is at most a bucket / N).
        narrow = self.dev.is_cuda and self.reduce_dtype != self.host_grad_dtype
        max_shard = max(b.shard_numel for b in L.buckets)
        self._scratch = [self.dev.device_empty(max_shard, self.host_grad_dtype) if narrow else None
                         for _ in range(n_buffers)]
        esz = self.flat.element_size()
        acc.device_param_bytes = L.numel * esz
        acc.device_bucket_bytes = sum(b.numel() * b.element_size() for b in self._grad_buffers) + sum(
            s.numel() * s.element_size() for s in self._scratch if s is not None)
        acc.device_optimizer_bytes = 0 if self._tail is None else self._tail.nbytes
        nbytes = lambda t: 0 if t is None else t.numel() * t.element_size()   # noqa: E731
        acc.host_master_bytes = nbytes(self.master)
        acc.host_optimizer_bytes = nbytes(self.exp_avg) + nbytes(self.exp_avg_sq)
        if self._nvme is not None:
            acc.host_nvme_buffer_bytes, acc.nvme_disk_bytes = self._nvme.buffer_bytes, self._nvme.disk_bytes
        separate_out = self.host_grad_dtype != self.dtype          # a 16-bit output apart anyway
        acc.host_staging_bytes = nbytes(self._grads[0]) + (nbytes(self._params[0]) if separate_out else 0)
        acc.host_accumulator_bytes = nbytes(self._accs[0])
        acc.host_dpu_pending_bytes = sum(nbytes(g) + nbytes(a) for g, a in zip(self._grads[1:], self._accs[1:]))
        self.accounting = acc

    def _state_pieces(self, host: int, n: int):
        """Partition elements [host, host + n) as (offset, length, master, exp_avg, exp_avg_sq)
        views: the part before the cut on the host, the rest in the device tail."""
        cut = self._cut
        if host < cut:
            m = min(n, cut - host)
            yield 0, m, *(None if t is None else t[host:host + m] for t in (self.master, self.exp_avg, self.exp_avg_sq))
        if host + n > cut:
            t, a = self._tail, max(host, cut) - cut
            off, m = max(0, cut - host), host + n - max(host, cut)
            yield off, m, t.master[a:a + m], t.exp_avg[a:a + m], t.exp_avg_sq[a:a + m]

    # The current step's landing set.
    host_grad = property(lambda self: self._grads[self._cur])
    host_param = property(lambda self: self._params[self._cur])
    host_acc = property(lambda self: self._accs[self._cur])

    def _zero_host_state(self) -> None:
        """Zero the Adam moments and the host landing buffers, after _place_model_on_device has
        released the model's fp32 parameters (see _build_buffers)."""
        for t in (self.exp_avg, self.exp_avg_sq, *self._grads, *self._params, *self._accs):
            if t is not None:
                t.zero_()

    @torch.no_grad()
    def _place_model_on_device(self) -> None:
        """Copy every parameter into the flat buffer (narrowed on the host, one at a time), take
        its fp32 master fragment, and make the parameter a view of the flat buffer. The model may
        live on the host in fp32: its full-precision copy is never put on the device."""
        L = self.layout
        if self._nvme is not None:          # the on-disk states' first values (the master from the model)
            self._nvme.fill_initial([(host, s.param.detach().reshape(-1)[pstart:pstart + n])
                                     for s, host, pstart, n in L.host_fragments()])
        fragments: dict[int, list] = {}
        for s, host, pstart, n in L.host_fragments():
            fragments.setdefault(id(s), []).append((host, pstart, n))
        for s in L.slots:
            src = s.param.detach().reshape(-1)
            for host, pstart, n in fragments.get(id(s), ()):
                for off, m, master, _, _ in self._state_pieces(host, n):
                    if master is not None:
                        master.copy_(src[pstart + off:pstart + off + m])
            self.flat[s.start:s.start + s.numel].copy_(src.to(self.dtype) if src.device.type == "cpu" else src)
            s.param.data = self.flat[s.start:s.start + s.numel].view(s.param.shape)
        for module in self.model.modules():     # buffers and frozen parameters follow the model
            for key, buf in module._buffers.items():
                if buf is not None and buf.device != self.device:
                    module._buffers[key] = buf.to(self.device)
            for p in module._parameters.values():
                if p is not None and not p.requires_grad and p.device != self.device:
                    p.data = p.data.to(self.device)

    def check_params(self) -> None:
        """Every trainable parameter must be a view of the flat buffer (none added or replaced)."""
        base = self.flat.untyped_storage().data_ptr()
        missing = [n for n, p in self.model.named_parameters()
                   if p.requires_grad and self._owns(n, p) and p.untyped_storage().data_ptr() != base]
        if missing:
            raise ConfigError(f"parameters not covered by the flat buffer: {missing[:5]}"
                              f"{' ...' if len(missing) > 5 else ''}; build the engine after the model is "
                              "complete and do not replace parameters afterwards")

    # ---------------------------------------------------------------------------------- backward
    def forward_context(self):
        """The model already runs in self.dtype (its parameters are views of the flat buffer)."""
        if self.race_check and self.schedule.pending is not None and self._race_ref is None:
            self._race_ref = self.flat.clone()
        return contextlib.nullcontext()

    # -------------------------------------------------------------------------------------- step
    def step(self, lr: float | None = None, decoupled_lr: float | None = None) -> StepResult:
        """Finish the gradient sync, check and clip on the main thread, then let the schedule run
        the CPU Adam (schedules.py): at once, in the background (DPU), or commit/redo what it
        speculated during backward (overlap). `decoupled_lr`: the word embedding's and output
        layer's rate (Megatron's --decoupled-lr; None: `lr`)."""
        self.prepare_step()
        return self.finish_step(lr, decoupled_lr)

    def prepare_step(self) -> None:
        """step() up to the norm: every gradient of this step home and final (the gradient sync
        finished, a speculating worker joined), so local_grad_stats() reads what the step will."""
        self.check_params()
        t0 = time.monotonic()
        self.finish_grad_sync()
        self.dev.wait_device_reads()     # the last host->device copies have read what the CPU Adam rewrites
        self._phases.append(("grad_sync", t0, time.monotonic()))
        self.schedule.before_norm(self)
        self._check_no_race()

    def finish_step(self, lr: float | None = None, decoupled_lr: float | None = None) -> StepResult:
        """step() from the norm on (after prepare_step())."""
        scale = self.loss_scaler.scale
        found_inf, grad_norm = self._global_grad_norm(scale)
        self.loss_scaler.update(found_inf)
        result = self.schedule.step(self, found_inf, grad_norm, scale, self._rates(lr, decoupled_lr))
        if self.count_zeros_in_grad and not result.skipped:     # Megatron-LM: no count for a skipped step
            result = dataclasses.replace(result, num_zeros_in_grad=self._zeros_in_grad)
        return result

    def _rates(self, lr: float | None, decoupled_lr: float | None) -> tuple[float, float]:
        """(rate of every parameter, rate of the decoupled ones): what the schedules pass on."""
        lr = self.adam.lr if lr is None else lr
        return lr, lr if decoupled_lr is None else decoupled_lr

    def expect_lr(self, lr: float, decoupled_lr: float | None = None) -> None:
        """The learning rates the coming step() will be given, announced before backward so a
        speculated CPU step uses them (other rates at step() are exact too: a rollback)."""
        if isinstance(self.schedule, SpeculativeSchedule):
            self.schedule.next_lr = self._rates(lr, decoupled_lr)

    def local_grad_stats(self) -> torch.Tensor:
        """[sum of squares, non-finite, exact zeros] of this rank's share of the gradient, before any
        reduction; the zeros (of the counted elements: each once over TP and DP, as the norm) only
        with count_zeros_in_grad, else 0 -- a pass over the partition that costs a step's read."""
        grad = self._update_grad()
        sumsq, finite = cpu_adam.grad_sumsq_and_finite_segments(grad, self._norm_segments) \
            if self._norm_segments else (0.0, True)
        zeros = 0
        if self.count_zeros_in_grad:        # count_nonzero: no boolean copy of a partition the size of the model
            zeros = sum(e - a - int(torch.count_nonzero(grad[a:e])) for a, e in self._zero_runs)
        stats = torch.tensor([sumsq, 0.0 if finite else 1.0, float(zeros)], dtype=torch.float64)
        if self._tail is not None:                       # one device->host copy for all three numbers
            stats += host_value(self._tail.grad_sumsq_and_nonfinite(self.count_zeros_in_grad))   # timed (CUDA)
        return stats

    def _global_grad_norm(self, scale: float) -> tuple[bool, float]:
        """(found inf/nan, grad norm before clipping) over every TP and DP rank, extra_grad_stats included."""
        stats = self.own_grad_stats if self.own_grad_stats is not None else self.local_grad_stats()
        self.own_grad_stats = None
        if self.extra_grad_stats is not None:
            stats, self.extra_grad_stats = stats + self.extra_grad_stats, None
        collectives.all_reduce(stats)                    # over every TP and DP rank
        self._zeros_in_grad = stats[2].item() if self.count_zeros_in_grad else None
        found_inf = bool(stats[1].item() > 0) or not math.isfinite(stats[0].item())
        return found_inf, (math.sqrt(stats[0].item()) / scale if not found_inf else float("nan"))

    def _clip_coef(self, grad_norm: float) -> float:
        if self.clip_grad and self.clip_grad > 0:
            return min(1.0, self.clip_grad / (grad_norm + 1e-6))
        return 1.0

    def _update_grad(self) -> torch.Tensor:
        """The host gradient the CPU Adam of the current step reads."""
        return self.host_acc if self.accumulate_on_host else self.host_grad

    def flush(self) -> StepResult | None:
        """Apply the update in flight, if any (DPU: join the worker, its exception is raised here,
        and return its parameters to the device), and with the NVMe tier wait for the state files'
        writes in flight (their errors are raised here: the job flushes inside the ranks' agreement
        before evaluating, saving and finishing). Returns that update's StepResult, or None."""
        result = self.schedule.flush(self)
        if self._nvme is not None:
            self._nvme.drain()
        return result

    def _check_no_race(self) -> None:
        if self._race_ref is not None:
            ref, self._race_ref = self._race_ref, None
            if not torch.equal(ref, self.flat):
                changed = (ref != self.flat).nonzero()
                raise RuntimeError(f"DPU race: {changed.numel()} parameter elements changed between the "
                                   f"first forward and the end of backward (first at flat index "
                                   f"{changed[0].item()}) while an update was in flight")

    @torch.no_grad()
    def _cpu_update(self, k: int, grad: torch.Tensor, step: int, lr: float, grad_scale: float,
                    segments=None, phase: str | None = "cpu_step", out: torch.Tensor | None = None,
                    decoupled_lr: float | None = None, extrapolate: bool = False, speculated: bool = False) -> None:
        """ONE CPU Adam call over the partition's segments (default: all; on a schedule's worker
        under DPU and overlap), the decoupled ones at `decoupled_lr` (None: `lr`): reads `grad`,
        updates master and moments, writes the 16-bit parameters into set k, or into `out` (a
        buffer of the partition's first out.numel() elements, which the segments then lie in:
        --overlap-cpu-step's speculated parameters). extrapolate: the parameters written are
        w_new + (w_new - w_old), --dpu-weight-prediction's copy, in the same kernel pass. speculated:
        states on disk go to their chunks' other places until committed (nvme_store.py)."""
        t0 = time.monotonic()
        a = self.adam
        full = segments is None
        segments = self._host_segments if segments is None else segments
        master, exp_avg, exp_avg_sq = self.master, self.exp_avg, self.exp_avg_sq
        if out is None:
            out = self._params[k]
        else:                               # a prefix buffer: every tensor cut to the prefix
            n = out.numel()             # (states on disk are None here: the store cuts its chunks)
            master, grad, exp_avg, exp_avg_sq = (None if t is None else t[:n] for t in (master, grad, exp_avg, exp_avg_sq))
        rate = (lr, lr if decoupled_lr is None else decoupled_lr)          # by the segment's decoupled flag

        def run(master, grad, exp_avg, exp_avg_sq, segments, out, full):
            if segments:
                cpu_adam.adam_step_segments(
                    master, grad, exp_avg, exp_avg_sq, [(s, e, a.weight_decay if decay else 0.0) for s, e, decay, *_ in segments],
                    step=step, lr=lr, beta1=a.beta1, beta2=a.beta2, eps=a.eps, adamw=a.adamw,
                    bias_correction=a.bias_correction, grad_scale=grad_scale,
                    param16_out=out if self.dtype != torch.float32 or extrapolate else None,
                    lrs=[rate[seg[4]] for seg in segments], extrapolate=extrapolate)
            if self.dtype == torch.float32 and not extrapolate:   # fp32: the parameter copy is the master
                for s, e, *_ in (((0, self._cut),) if full else segments):
                    out[s:e].copy_(master[s:e])
        if self._nvme is None:
            run(master, grad, exp_avg, exp_avg_sq, segments, out, full)
        else:                               # chunk by chunk through the store's ring (nvme_store.py)
            self._nvme.update(run, segments, master, grad, out, prefetch_after=self.dpu_warmup_steps is not None,
                              shadow=speculated)
        if phase is not None:
            self._phases.append((phase, t0, time.monotonic()))

    def drain_phases(self) -> list[tuple[str, float, float]]:
        """(phase, start, end) in time.monotonic() seconds recorded since the last call: grad_sync,
        cpu_step (the worker's, under DPU), cpu_step_speculated (per bucket on the worker during
        backward, --overlap-cpu-step), cpu_step_rollback, cpu_step_wait (the main thread waiting),
        param_return (host->device + all-gather)."""
        out = []
        while self._phases:          # popleft, not clear(): the worker may append meanwhile
            out.append(self._phases.popleft())
        return out

    def _params_to_device(self, k: int | None = None, prefix: torch.Tensor | None = None) -> None:
        """Updated shards of set k -> device -> async all-gather over DP into the flat buffer; the
        next forward is queued behind the gathers (on CUDA the host does not wait for them).
        `prefix`: the partition's first prefix.numel() parameters come from it instead (the
        speculated part of an --overlap-cpu-step commit)."""
        t0 = time.monotonic()
        host_param = self._params[self._cur if k is None else k]
        p = 0 if prefix is None else prefix.numel()
        works = []
        esz = self.flat.element_size()
        for bucket in self.layout.buckets:
            lo, hi = bucket.shard_range(self.dp_rank)
            n = min(hi - lo, max(0, self._cut - bucket.host_start))   # the device tail is already there
            a = bucket.host_start
            m = min(n, max(0, p - a))                                 # the part that lies in the prefix
            if m:
                self.dev.copy_to_device(self.flat[lo:lo + m], prefix[a:a + m])
            if n > m:
                self.dev.copy_to_device(self.flat[lo + m:lo + n], host_param[a + m:a + n])
            if n:
                self.accounting.h2d_bytes += n * esz
            works.append(collectives.all_gather(self.flat[bucket.start:bucket.end], self.flat[lo:hi],
                                                self.dp_group, async_op=True))
            self.accounting.ring(collectives.wire_bytes("all_gather", self.flat[bucket.start:bucket.end]), self.dp_size)
        collectives.wait_all(works)
        self._phases.append(("param_return", t0, time.monotonic()))

    @torch.no_grad()
    def reload_params_from_master(self) -> None:
        """Re-derive the 16-bit parameters from the fp32 master (after loading a checkpoint)."""
        self.flush()
        self.dev.wait_device_reads()     # an async host->device copy may still read host_param
        # the disk's reads may fail on one rank alone: every rank raises that rank's line
        with cpu_step_agreed(self):
            if self._nvme is not None:   # what a checkpoint load wrote into the mapped files: checksummed
                self._nvme.resync()
            if self.master is not None:
                self.host_param.copy_(self.master.to(self.dtype))
            else:                        # --optimizer-nvme-master: read from disk, chunk by chunk
                self._nvme.copy_master_to(self.host_param)
        if self._tail is not None:
            self._tail.write_params()
        self._params_to_device()

    def close(self) -> None:
        """Join the worker, remove the hooks and unregister pinned host memory (idempotent).
        An update still in flight is waited for (never freed under the kernel) but not returned
        to the device: call flush() first to keep it. A worker error is raised here."""
        try:
            self.schedule.close()
        finally:
            for h in self._hooks:
                h.remove()
            self._hooks = []
            self.dev.close()                # waits for every collective still in flight
            self._reset_bucket_state()      # and drops the buffers' last references to them
            if self._nvme is not None:      # the state files go at close (a killed run leaves them)
                self._nvme.close()
