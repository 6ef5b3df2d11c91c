#!/usr/bin/env python
"""Training-step time: zo_megatron's ZeRO-Offload engine vs plain torch, same GPT, world and batches.

    python tools/bench_train_step.py                  # DP=1, ~45M-param GPT, bf16
    python tools/bench_train_step.py --dp 2           # a 2-process world (spawned by this script)
    python tools/bench_train_step.py --dp 2 --precision fp32 --steps 12 --json out.json

The same command runs on a CPU-only machine (gloo) and on GPUs (NCCL for CUDA tensors, gloo for
the small host-side agreements): the device is the one zo_megatron.parallel.init_parallel picks
(cuda:LOCAL_RANK when CUDA is available, else cpu). --dp 2 on CUDA needs 2 GPUs (NCCL cannot put
two ranks on one GPU); with fewer the script refuses with one `error:` line (exit 2).

What is compared (TP=1, DP = --dp, one process per DP rank):

  ours      zo_megatron's TP GPT (build_gpt_model, TP=1), built on the host in fp32, handed to
            ZeroOffloadEngine(device=<the device>), which copies it into its flat 16-bit device
            buffer (bf16; fp32 with --precision fp32): gradient buckets reduce-scattered over DP
            asynchronously from the backward hooks, the shard copied home, ONE CPU Adam kernel call
            over this rank's fp32 master partition, H2D + all-gather of the updated parameters.
  baseline  the same model class, config and seed (fp32 parameters) moved whole to the device,
            wrapped in torch.nn.parallel.DistributedDataParallel (gradient_as_bucket_view=True) +
            torch.optim.AdamW(fused=True); bf16 = torch.autocast(<device type>, bfloat16) around
            the forward (standard torch mixed precision; megatron-core restores the autocast state
            in its linear layers' backward only on CUDA, so on CPU the same custom_bwd rule is
            applied, see zo_megatron/parallel/megatron_cpu.py); fp32 = no autocast.

Both clip the global gradient norm to 1.0 and use the same AdamW hyper-parameters (weight decay on
matrices only), the same learning rate and the same batches (random tokens, one fixed stream per
DP rank, placed on the device before timing). A step is forward + backward + optimizer step, timed
between barriers; the step time of a world is the slowest rank's (MAX over ranks, per step and
phase). Phases: forward | backward | optimizer. For ours, "backward" is engine.backward() plus
engine.finish_grad_sync() (the wait for the last reduce-scatters and copies home), so that both
variants' backward includes their gradient communication (DDP waits for its all-reduces at the
end of loss.backward()); "optimizer" is engine.step() (grad norm, CPU Adam, params to device).
On CUDA every phase boundary is bracketed by torch.cuda.synchronize(), so a phase is the device
time of its work, not the host time to queue it. The variants run interleaved in the same
process(es), alternating which goes first (A B, B A, A B, ...), so machine noise hits both; the
first --warmup steps of each are dropped.

Reported:
  - median step time of each, min/max, tokens/s, the ratio ours/baseline and the target verdict
    (ratio <= --target, default 1.15), the phase medians;
  - the hardware: on CUDA the GPU name (torch.cuda.get_device_name); always the CPU model and the
    CPU Adam kernel's ISA and threads (zo_megatron.offload.cpu_adam.info());
  - device memory (CUDA only, rank 0): torch.cuda.max_memory_allocated during each variant's
    steps (peak stats reset before every step), both raw (the other variant's resident tensors
    included: both live in one process) and "own" = the variant's resident bytes (measured as
    memory_allocated deltas over its construction and its steps) + its step's peak above the
    memory allocated at step start -- what that variant would peak at alone; and the engine's
    accounting.device_model_state_bytes (flat params + bucket buffers);
  - the engine's accounting (device and host bytes, bytes sent per step);
  - DP > 1: the overlap share of gradient communication (below); DP=1: "n/a (DP=1)";
  - the CPU Adam kernel-call comparison (below).
When ours misses the target (or with --profile) it also times the engine's internals (hooks'
bucket copies, reduce-scatter issue, waits for copies home, the ONE grad-norm pass and the ONE
CPU Adam call, params to device, all-gather) over 3 extra steps, and prints torch.profiler's top
operators for one step of each variant; the kernel-call comparison's per-segment times sit next to
the ONE-call lines there. On CUDA each timed internal is bracketed by torch.cuda.synchronize()
(serialized device time: the overlap is removed in those steps only). --json FILE writes all of
it (among others: device, device_name, cpu_model, cpu_adam, peak_device_bytes[_raw] and
resident_device_bytes per variant, engine_device_model_state_bytes, overlap_share with the
overlap measurement's parts, kernel_call_comparison).

Overlap share of gradient communication (DP > 1): the fraction of the reduce-scatter time that is
hidden behind backward compute. Measured on --overlap-steps extra gradient passes (forward +
backward + finish_grad_sync, no optimizer step: model and optimizer are left unchanged), each pass
running three modes back to back (rotating which goes first), times MAX over ranks per pass:
  T_async  backward + finish_grad_sync as the engine runs it (async reduce-scatters);
  T_free   the same with collectives.reduce_scatter replaced by a no-op (no communication at all;
           every other engine cost -- hooks, bucket copies, /N, copies home -- stays);
  C        the communication time itself: a pass where each reduce-scatter runs alone -- the DP
           ranks align on a host (gloo) barrier, then the collective is issued and waited for
           (CUDA: synchronize before and after) -- summed over the step's reduce-scatters.
  exposed = clamp(median over passes of (T_async - T_free), 0, C)
            what communication adds to the gradient phase; CPU-core / memory-bandwidth
            contention from the communication counts as exposed, rank skew does not (MAX over
            ranks in both modes)
  overlap share = 1 - exposed / C    (1: fully hidden behind backward; 0: fully serial)
It needs only wall clocks (plus synchronize on CUDA) and a wrapper on the collectives module, so
it means the same on CPU/gloo (the gloo thread competes with compute for the cores) and on
CUDA/NCCL (NCCL kernels share the SMs and memory bandwidth with backward). With one bucket (a
model smaller than --bucket-size) the only reduce-scatter starts when backward ends, so expect
~0. Cross-check printed: T_serial (the isolated pass minus its barrier time) - T_free ~ C. The
share rests on a difference of noisy times: its standard error (from the median absolute
deviation of the per-pass differences) is printed as "+- points", and a share whose standard
error exceeds 25 points is flagged LOW CONFIDENCE (use more --overlap-steps, or a quieter machine).

CPU Adam kernel-call comparison: on a copy of the engine's host buffers (master, grad, moments,
16-bit param output aliasing the grad buffer as in the engine; reset before every call), ONE
cpu_adam.adam_step_segments call over engine.layout.segments vs the old path, cpu_adam.adam_step
once per segment with the same arguments (--kernel-reps repetitions in a shuffled order, buffers
reset before each, medians, MAX over ranks, every rank at once as in a real step); the same for the
grad-norm pass (grad_sumsq_and_finite_segments vs grad_sumsq_and_finite per segment). The two
Adam paths' results are checked to be bit-identical (on the segments of the first 4M elements).

Reading the numbers: in bf16 the two are different mixed-precision schemes by design -- ours
computes with bf16 weights (no casts, bf16 residual stream), the baseline casts its fp32 weights
to bf16 per matmul and keeps fp32 elsewhere -- so ours can beat the baseline outright; --precision
fp32 compares the same math and isolates the engine's own costs (bucket copies, the grad-norm pass,
CPU Adam, the host<->device copies). On a shared machine check the reported load average and the
min/max spread before trusting a ratio.

--dp 2 runs as a 2-process world that this script spawns itself with torch.multiprocessing
(127.0.0.1, a free port); torchrun is not needed. Threads per process = CPUs / DP (torch intra-op
and the CPU Adam kernel alike), so the two ranks do not oversubscribe the machine. Every
collective goes through zo_megatron.parallel.collectives.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import socket
import statistics
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dp", type=int, default=1, choices=(1, 2), help="data-parallel ranks (processes)")
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=4, help="sequences per DP rank per step")
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--steps", type=int, default=8, help="timed steps per variant")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per variant first")
    p.add_argument("--precision", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--bucket-size", type=int, default=40_000_000, help="engine gradient bucket (elements)")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--threads", type=int, default=0, help="threads per process (default: CPUs / DP)")
    p.add_argument("--target", type=float, default=1.15, help="pass if ours/baseline median step <= this")
    p.add_argument("--overlap-steps", type=int, default=3,
                   help="gradient passes per mode for the overlap share (DP > 1; 0 skips it)")
    p.add_argument("--kernel-reps", type=int, default=5,
                   help="repetitions of the CPU Adam one-call vs per-segment comparison (0 skips it)")
    p.add_argument("--profile", action="store_true", help="always print the engine-internals breakdown "
                   "and torch.profiler's top operators (otherwise only when over the target)")
    p.add_argument("--json", metavar="FILE", help="write the results as JSON")
    args = p.parse_args(argv)
    if args.hidden % args.heads:
        p.error(f"--hidden {args.hidden} is not divisible by --heads {args.heads}")
    if args.steps < 1 or args.warmup < 0:
        p.error("--steps must be >= 1 and --warmup >= 0")
    if args.overlap_steps < 0 or args.kernel_reps < 0:
        p.error("--overlap-steps and --kernel-reps must be >= 0")
    return args


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def _median(xs):
    return statistics.median(xs) if xs else float("nan")


# ------------------------------------------------------------------------------------------------
# one rank

class _Timer:
    """Exclusive wall time and call count per name for wrapped callables (engine internals): a
    wrapped call made inside another (the reduce-scatter _send issues) is charged to itself, not to
    its caller. `sync` (CUDA: torch.cuda.synchronize) brackets every call, so a name gets the device
    time of its own work."""

    def __init__(self, sync=None):
        self.t: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self._stack: list[float] = []     # time spent in nested timed calls, per open call
        self._sync = sync

    def wrap(self, name, fn):
        def timed(*a, **k):
            if self._sync is not None:
                self._sync()
            self._stack.append(0.0)
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                if self._sync is not None:
                    self._sync()
                dt = time.perf_counter() - t0
                nested = self._stack.pop()
                self.t[name] = self.t.get(name, 0.0) + dt - nested
                self.calls[name] = self.calls.get(name, 0) + 1
                if self._stack:
                    self._stack[-1] += dt
        return timed


_HYPER = ((0.9, 0.95), 1e-8, 0.1, 1.0)       # AdamW betas, eps, weight decay (matrices), grad clip


def _rank_main(rank: int, args, port: int, out_path: str | None):
    world = args.dp
    threads = args.threads or max(1, _cpus() // world)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), ZO_CPU_ADAM_THREADS=str(threads))
    import warnings

    warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex).*")
    warnings.filterwarnings("ignore", message=".*full scope is deprecated.*")
    import torch

    torch.set_num_threads(threads)
    from zo_megatron.model import GPTConfig, build_gpt_model
    from zo_megatron.offload.engine import AdamConfig, ZeroOffloadEngine
    from zo_megatron.parallel import destroy_parallel, init_parallel

    ps = init_parallel(1, seed=args.seed, num_attention_heads=args.heads, hidden_size=args.hidden)
    dev = ps.device     # cuda:LOCAL_RANK when CUDA is available, else cpu
    cuda = dev.type == "cuda"

    def mem() -> int:
        if not cuda:
            return 0
        torch.cuda.synchronize(dev)
        return torch.cuda.memory_allocated(dev)

    cfg = GPTConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                    vocab_size=args.vocab, max_position_embeddings=args.seq, precision=args.precision)
    betas, eps, wd, clip = _HYPER
    try:
        # ours: built on the host in fp32; the engine copies it into its flat 16-bit device buffer
        m0 = mem()
        ours_model = build_gpt_model(cfg, ps.tp_rank, ps.tp_size, args.seed)
        n_params = sum(p.numel() for p in ours_model.parameters())
        adam = AdamConfig(lr=args.lr, beta1=betas[0], beta2=betas[1], eps=eps, weight_decay=wd)
        with ZeroOffloadEngine(ours_model, precision=args.precision, adam=adam, clip_grad=clip,
                               bucket_size=args.bucket_size, dp_group=ps.dp_group, tp_rank=ps.tp_rank,
                               device=dev) as engine:
            resident = {"ours": mem() - m0, "baseline": 0}   # device bytes each variant keeps between steps
            return _compare(rank, args, out_path, ps, engine, ours_model, n_params, threads, resident, cfg)
    finally:
        destroy_parallel()


def _compare(rank, args, out_path, ps, engine, ours_model, n_params, threads, resident, cfg):
    """The interleaved A/B steps, then the overlap, kernel-call and internals measurements."""
    import torch

    from zo_megatron.model import build_gpt_model
    from zo_megatron.offload import cpu_adam
    from zo_megatron.parallel import collectives

    dev = ps.device
    cuda = dev.type == "cuda"
    betas, eps, wd, clip = _HYPER

    def sync():
        if cuda:
            torch.cuda.synchronize(dev)

    def mem() -> int:
        return torch.cuda.memory_allocated(dev) if cuda else 0

    now = time.perf_counter

    # baseline: same class, config and seed; fp32 parameters on the device; torch DDP + fused AdamW
    class LossModule(torch.nn.Module):   # DDP must see the forward that produces the loss
        def __init__(self, gpt):
            super().__init__()
            self.gpt = gpt

        def forward(self, tokens, labels):
            return self.gpt.loss(tokens, labels)

    m1 = mem()
    base_model = build_gpt_model(cfg, ps.tp_rank, ps.tp_size, args.seed, device=dev)
    ddp = torch.nn.parallel.DistributedDataParallel(LossModule(base_model), process_group=ps.dp_group,
                                                    device_ids=[dev.index] if cuda else None,
                                                    gradient_as_bucket_view=True)
    decay = [p for p in base_model.parameters() if p.dim() > 1]
    no_decay = [p for p in base_model.parameters() if p.dim() <= 1]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=betas, eps=eps, fused=True)
    sync()
    resident["baseline"] = mem() - m1             # + Adam moments, added by the first step below
    autocast = (torch.autocast(dev.type, dtype=torch.bfloat16) if args.precision == "bf16"
                else torch.autocast(dev.type, enabled=False))

    total = args.warmup + args.steps
    gen = torch.Generator().manual_seed(args.seed + 1000 * ps.dp_rank)
    batches = [(torch.randint(0, args.vocab, (args.micro_batch, args.seq), generator=gen).to(dev),
                torch.randint(0, args.vocab, (args.micro_batch, args.seq), generator=gen).to(dev))
               for _ in range(total)]

    def step_ours(tokens, labels, times):
        t0 = now()
        loss = ours_model.loss(tokens, labels)
        sync()
        t1 = now()
        engine.backward(loss)
        t2 = now()
        engine.finish_grad_sync()    # step() would do it first; here it counts as backward
        sync()
        t3 = now()
        res = engine.step(lr=args.lr)
        sync()
        t4 = now()
        times.update(forward=t1 - t0, backward=t3 - t1, optimizer=t4 - t3, sync_wait=t3 - t2)
        assert not res.skipped
        return loss

    def step_base(tokens, labels, times):
        t0 = now()
        with autocast:
            loss = ddp(tokens, labels)
        sync()
        t1 = now()
        loss.backward()            # DDP all-reduces the gradient buckets during backward
        sync()
        t2 = now()
        torch.nn.utils.clip_grad_norm_(base_model.parameters(), clip)
        opt.step()
        opt.zero_grad(set_to_none=False)   # keep the grads as views of DDP's buckets
        sync()
        t3 = now()
        times.update(forward=t1 - t0, backward=t2 - t1, optimizer=t3 - t2, sync_wait=0.0)
        return loss

    variants = {"ours": step_ours, "baseline": step_base}
    records = {v: [] for v in variants}       # per step: dict(total, forward, backward, optimizer, sync_wait)
    losses = {v: [] for v in variants}
    peak_raw = {v: 0 for v in variants}       # max_memory_allocated during its steps (both variants resident)
    peak_own = {v: 0 for v in variants}       # its resident bytes + its step's peak above step start
    for i in range(total):
        order = ("ours", "baseline") if i % 2 == 0 else ("baseline", "ours")
        for v in order:
            times: dict[str, float] = {}
            sync()
            collectives.barrier()
            if cuda:
                before = mem()
                torch.cuda.reset_peak_memory_stats(dev)
            t0 = now()
            loss = variants[v](*batches[i], times)
            sync()
            collectives.barrier()
            times["total"] = now() - t0
            records[v].append(times)
            losses[v].append(loss.item())
            del loss
            if cuda:
                peak = torch.cuda.max_memory_allocated(dev)
                peak_raw[v] = max(peak_raw[v], peak)
                peak_own[v] = max(peak_own[v], resident[v] + peak - before)
                resident[v] += mem() - before
    acc = engine.accounting.as_dict()           # this step's bytes, before any extra pass below
    sent = acc["sent_bytes"]

    # the step time of the world is the slowest rank's: MAX over ranks, per step and phase
    keys = ("total", "forward", "backward", "optimizer", "sync_wait")
    flat = torch.tensor([[r[k] for k in keys] for v in variants for r in records[v]], dtype=torch.float64)
    collectives.all_reduce(flat, "max")
    per_variant = {}
    for j, v in enumerate(variants):
        rows = flat[j * total:(j + 1) * total][args.warmup:]
        per_variant[v] = {k: rows[:, c].tolist() for c, k in enumerate(keys)}

    ratio = _median(per_variant["ours"]["total"]) / _median(per_variant["baseline"]["total"])

    overlap = None
    if ps.dp_size > 1 and args.overlap_steps > 0:
        overlap = _measure_overlap(engine, ours_model, batches, args.overlap_steps, ps, sync, now, torch,
                                   collectives)
    kernels = None
    if args.kernel_reps > 0:
        kernels = _compare_kernel_calls(engine, cpu_adam, args, torch, collectives)
    detail = None
    if args.profile or ratio > args.target:
        detail = _profile_internals(engine, cpu_adam, collectives, step_ours, step_base, batches, args, cuda,
                                    sync, torch)

    result = dict(
        rank=rank, threads=threads, params=n_params, step_times=per_variant,
        losses={v: losses[v] for v in variants}, accounting=acc,
        sent_bytes_per_step=sent, adam=cpu_adam.info(), detail=detail,
        bucket_count=len(engine.layout.buckets), bucket_numel=engine.layout.max_bucket_numel,
        segments=len(engine.layout.segments),
        device=str(dev), device_type=dev.type, backend=collectives.default_backend(dev),
        device_name=torch.cuda.get_device_name(dev) if cuda else None,
        peak_device_bytes=peak_own if cuda else None, peak_device_bytes_raw=peak_raw if cuda else None,
        resident_device_bytes=resident if cuda else None,
        overlap=overlap, kernel_calls=kernels)
    if rank == 0 and out_path:
        with open(out_path, "w") as f:
            json.dump(result, f)
    return result


def _measure_overlap(engine, model, batches, n, ps, sync, now, torch, collectives):
    """The overlap share of the gradient reduce-scatters (module docstring): gradient passes in three
    modes -- async (as the engine runs), free (no communication), isolated (each collective alone)."""
    orig_rs = collectives.reduce_scatter
    group = ps.dp_group
    rs_times: list[float] = []
    barrier_times: list[float] = []

    def rs_free(output, input, group, async_op=False):
        return None          # no communication; the engine does all its other work as usual

    def rs_isolated(output, input, group, async_op=False):
        sync()
        b0 = now()
        collectives.all_reduce(torch.zeros(1), "sum", group)     # host barrier of the DP group (gloo)
        sync()
        t0 = now()
        work = orig_rs(output, input, group, async_op=True)
        if work is not None:
            work.wait()
        sync()
        t1 = now()
        barrier_times.append(t0 - b0)
        rs_times.append(t1 - t0)
        return None          # done: the engine's copy home need not wait

    modes = {"async": orig_rs, "free": rs_free, "isolated": rs_isolated}
    names = list(modes)
    grad_s = {m: [] for m in names}
    comm_s, barrier_s, calls = [], [], 0
    try:
        for r in range(n):
            tokens, labels = batches[r % len(batches)]
            for k in range(len(names)):
                mode = names[(r + k) % len(names)]            # rotate which mode goes first
                collectives.reduce_scatter = modes[mode]
                rs_times.clear()
                barrier_times.clear()
                sync()
                collectives.barrier()
                loss = model.loss(tokens, labels)
                sync()
                t1 = now()
                engine.backward(loss)
                engine.finish_grad_sync()     # no step(): the model and optimizer are left as they were
                sync()
                grad_s[mode].append(now() - t1)
                collectives.reduce_scatter = orig_rs
                if mode == "isolated":
                    comm_s.append(sum(rs_times))
                    barrier_s.append(sum(barrier_times))
                    calls = len(rs_times)
    finally:
        collectives.reduce_scatter = orig_rs
    rows = torch.tensor([[grad_s["async"][r], grad_s["free"][r], grad_s["isolated"][r], comm_s[r], barrier_s[r]]
                         for r in range(n)], dtype=torch.float64)
    collectives.all_reduce(rows, "max")          # the world's pass is its slowest rank's
    t_async, t_free, t_iso, comm, bar = (_median(rows[:, c].tolist()) for c in range(5))
    # paired per pass (the three modes of a pass run back to back): slow drifts in load cancel
    raw_exposed = _median((rows[:, 0] - rows[:, 1]).tolist())
    t_serial = _median((rows[:, 2] - rows[:, 4]).tolist())
    diffs = (rows[:, 0] - rows[:, 1]).tolist()
    # standard error of that median from the pass-to-pass spread (MAD -> sigma -> s.e. of a median)
    mad = _median([abs(d - raw_exposed) for d in diffs])
    stderr = 1.2533 * 1.4826 * mad / math.sqrt(n) if n > 1 else float("inf")
    exposed = min(max(raw_exposed, 0.0), comm)
    share = 1.0 - exposed / comm if comm > 0 else None
    share_stderr = stderr / comm if comm > 0 else None
    return dict(passes=n, reduce_scatters_per_step=calls, t_async_s=t_async, t_free_s=t_free,
                comm_s=comm, exposed_s=exposed, share=share, t_serial_s=t_serial, raw_exposed_s=raw_exposed,
                exposed_stderr_s=stderr, share_stderr=share_stderr,
                resolved=bool(share_stderr is not None and share_stderr <= 0.25),
                per_pass_s={"async": rows[:, 0].tolist(), "free": rows[:, 1].tolist(),
                            "isolated": rows[:, 2].tolist(), "comm": rows[:, 3].tolist(),
                            "barrier": rows[:, 4].tolist()})


def _compare_kernel_calls(engine, cpu_adam, args, torch, collectives):
    """ONE adam_step_segments call vs adam_step once per segment (the old path), and the same for
    the grad-norm pass, on a copy of the engine's host buffers (reset from the engine's, which are
    only read, before every call: one extra copy of the host optimizer state in memory)."""
    segs = engine.layout.segments
    a = engine.adam
    grad_src = engine.host_acc if engine.host_acc is not None else engine.host_grad
    src = {"master": engine.master, "m": engine.exp_avg, "v": engine.exp_avg_sq, "grad": grad_src}
    sixteen = engine.dtype != torch.float32
    alias = sixteen and engine.host_param is engine.host_grad and grad_src is engine.host_grad
    if sixteen and not alias:
        src["out"] = engine.host_param
    W = {k: t.clone() for k, t in src.items()}
    out16 = None if not sixteen else (W["grad"] if alias else W["out"])   # the engine's aliasing
    hyper = dict(step=max(1, engine.step_count), lr=args.lr, beta1=a.beta1, beta2=a.beta2, eps=a.eps,
                 adamw=a.adamw, bias_correction=a.bias_correction, grad_scale=0.5)
    wd_segments = [(s.start, s.end, a.weight_decay if s.decay else 0.0) for s in segs]
    norm_segments = [(s.start, s.end, s.counted) for s in segs]

    def adam_one(segments=wd_segments):
        cpu_adam.adam_step_segments(W["master"], W["grad"], W["m"], W["v"], segments, param16_out=out16, **hyper)

    def adam_per_segment(segments=wd_segments):
        for (lo, hi, wdv) in segments:
            cpu_adam.adam_step(W["master"][lo:hi], W["grad"][lo:hi], W["m"][lo:hi], W["v"][lo:hi], weight_decay=wdv,
                               param16_out=None if out16 is None else out16[lo:hi], **hyper)

    def norm_one():
        return cpu_adam.grad_sumsq_and_finite_segments(W["grad"], norm_segments)

    def norm_per_segment():
        s, finite = 0.0, True
        for (lo, hi, counted) in norm_segments:
            x, f = cpu_adam.grad_sumsq_and_finite(W["grad"][lo:hi])
            finite = finite and f
            if counted:
                s += x
        return s, finite

    def reset():
        for k in W:
            W[k].copy_(src[k])

    # bit-identity of the two Adam paths, on the segments of the first 4M elements (memory stays bounded)
    limit = 1 << 22
    head = [(lo, min(hi, limit), wdv) for lo, hi, wdv in wd_segments if lo < limit]
    end = head[-1][1]
    reset()
    adam_one(head)
    after_one = {k: t[:end].clone() for k, t in W.items()}
    reset()
    adam_per_segment(head)
    identical = all(torch.equal(after_one[k], W[k][:end]) for k in W)
    del after_one

    fns = {"adam_one": adam_one, "adam_per_segment": adam_per_segment, "norm_one": norm_one,
           "norm_per_segment": norm_per_segment}
    names = list(fns)
    times = {k: [] for k in names}
    order_rng = random.Random(args.seed)          # the same shuffled order on every rank
    for _ in range(args.kernel_reps):
        for k in order_rng.sample(names, len(names)):
            reset()
            collectives.barrier()        # every DP rank runs its kernel at once, as in a real step
            t0 = time.perf_counter()
            fns[k]()
            times[k].append(time.perf_counter() - t0)
    med = torch.tensor([_median(times[k]) for k in names], dtype=torch.float64)
    collectives.all_reduce(med, "max")
    out = {f"{k}_s": float(med[i]) for i, k in enumerate(names)}
    out.update(segments=len(segs), host_numel=int(engine.master.numel()), reps=args.kernel_reps,
               adam_identical=identical,
               adam_ratio=out["adam_per_segment_s"] / out["adam_one_s"] if out["adam_one_s"] > 0 else None,
               norm_ratio=out["norm_per_segment_s"] / out["norm_one_s"] if out["norm_one_s"] > 0 else None)
    return out


def _profile_internals(engine, cpu_adam, collectives, step_ours, step_base, batches, args, cuda, sync, torch):
    """Time the engine's internals over a few extra steps, then torch.profiler's top ops for one step
    of each variant (rank 0's view). The engine calls cpu_adam.<fn> and collectives.<fn> through the
    modules, so those module attributes are wrapped (and its own bound methods, and its DeviceLayer's)."""
    from torch.profiler import ProfilerActivity, profile

    timer = _Timer(sync if cuda else None)
    engine_methods = ("_absorb", "_open_bucket", "_send", "finish_grad_sync", "check_params", "_params_to_device")
    dev_methods = ("copy_home", "release", "wait_host", "copy_to_device")
    adam_fns = ("grad_sumsq_and_finite_segments", "adam_step_segments")
    coll_fns = ("reduce_scatter", "all_reduce", "all_gather", "wait_all")
    orig_adam = {n: getattr(cpu_adam, n) for n in adam_fns}
    orig_coll = {n: getattr(collectives, n) for n in coll_fns}
    for n in engine_methods:
        setattr(engine, n, timer.wrap(n, getattr(engine, n)))
    timed_finish = engine.finish_grad_sync

    def finish_grad_sync():            # step() calls it again after step_ours did: not a second call
        if engine._sync_pending:
            timed_finish()

    engine.finish_grad_sync = finish_grad_sync
    for n in dev_methods:
        setattr(engine.dev, n, timer.wrap(n, getattr(engine.dev, n)))
    for n, fn in orig_adam.items():
        setattr(cpu_adam, n, timer.wrap(n, fn))
    n_extra = 3
    phase: dict[str, float] = {}
    try:
        for i in range(n_extra):
            times: dict[str, float] = {}
            sync()
            collectives.barrier()
            for n, fn in orig_coll.items():      # not the barrier above: only the engine's calls
                setattr(collectives, n, timer.wrap(n, fn))
            try:
                step_ours(*batches[i % len(batches)], times)
            finally:
                for n, fn in orig_coll.items():
                    setattr(collectives, n, fn)
            for k, v in times.items():
                phase[k] = phase.get(k, 0.0) + v
    finally:
        for n in engine_methods:
            engine.__dict__.pop(n, None)           # back to the class's methods
        for n in dev_methods:
            engine.dev.__dict__.pop(n, None)
        for n, fn in orig_adam.items():
            setattr(cpu_adam, n, fn)
        for n, fn in orig_coll.items():
            setattr(collectives, n, fn)
    internals = {k: v / n_extra for k, v in timer.t.items()}
    calls = {k: v / n_extra for k, v in timer.calls.items()}
    phases = {k: v / n_extra for k, v in phase.items()}

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sort_keys = (["self_device_time_total", "self_cuda_time_total"] if cuda else []) + ["self_cpu_time_total"]
    tables, used_key = {}, sort_keys[-1]
    for name, fn in (("ours", step_ours), ("baseline", step_base)):
        sync()
        collectives.barrier()
        with profile(activities=activities) as prof:
            fn(*batches[0], {})
            sync()
        avg = prof.key_averages()
        for key in sort_keys:          # torch renamed self_cuda_time_total to self_device_time_total
            try:
                tables[name] = avg.table(sort_by=key, row_limit=14, max_name_column_width=60)
                used_key = key
                break
            except (KeyError, AttributeError, ValueError):
                continue
    return dict(internals_s=internals, calls_per_step=calls, phases_s=phases, profiler_top_ops=tables,
                sort_key=used_key, serialized_cuda=cuda)


# ------------------------------------------------------------------------------------------------
# driver

def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:,.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def _spawn_entry(rank, args, port, out_path):
    _rank_main(rank, args, port, out_path)


def _check_devices(args) -> str | None:
    """The refusal for a world this machine's GPUs cannot hold, or None."""
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() < args.dp:
        n = torch.cuda.device_count()
        return (f"--dp {args.dp} needs {args.dp} GPUs (one rank per GPU: NCCL cannot run two ranks on one GPU) "
                f"but CUDA sees {n}; run it on a machine with >= {args.dp} GPUs, or use --dp 1, or benchmark "
                f"the CPU/gloo world instead with CUDA hidden (CUDA_VISIBLE_DEVICES= python tools/bench_train_step.py "
                f"--dp {args.dp} ...)")
    return None


_INTERNAL_LABELS = {
    "_absorb": "backward: copy grads into buckets (hooks)",
    "_open_bucket": "backward: open a bucket (zero its buffer)",
    "release": "backward: wait for a buffer's last copy home",
    "_send": "backward: bucket /= N, queue reduce-scatter",
    "reduce_scatter": "backward: reduce-scatter issue (async)",
    "copy_home": "backward: queue the shard's copy home",
    "finish_grad_sync": "grad sync: complete + send the late buckets",
    "wait_host": "grad sync: wait for reduce-scatters + copies",
    "check_params": "step: check_params",
    "grad_sumsq_and_finite_segments": "step: grad norm + overflow, ONE call",
    "all_reduce": "step: grad-norm all-reduce",
    "adam_step_segments": "step: CPU Adam, ONE kernel call",
    "_params_to_device": "step: params to device (bookkeeping)",
    "copy_to_device": "step: host->device copies",
    "all_gather": "step: all-gather issue (async)",
    "wait_all": "step: wait for the all-gathers",
}


def main(argv=None) -> int:
    args = parse_args(argv)
    problem = _check_devices(args)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    load_before = os.getloadavg()
    t_start = time.perf_counter()
    port = _free_port()
    if args.dp == 1:
        res = _rank_main(0, args, port, None)
    else:
        import torch.multiprocessing as mp

        fd, out_path = tempfile.mkstemp(prefix="bench_train_step_", suffix=".json")
        os.close(fd)
        try:
            mp.spawn(_spawn_entry, args=(args, port, out_path), nprocs=args.dp, join=True)
            with open(out_path) as f:
                res = json.load(f)
        finally:
            os.unlink(out_path)
    load_after = os.getloadavg()
    wall = time.perf_counter() - t_start

    st = res["step_times"]
    tokens = args.micro_batch * args.seq * args.dp
    med = {v: {k: statistics.median(x) for k, x in st[v].items()} for v in st}
    ratio = med["ours"]["total"] / med["baseline"]["total"]
    ok = ratio <= args.target
    acc = res["accounting"]
    cuda = res["device_type"] == "cuda"
    cpu_model = _cpu_model()
    adam = res["adam"]

    print(f"bench_train_step: GPT {args.layers} layers x {args.hidden} hidden x {args.heads} heads, vocab "
          f"{args.vocab}, seq {args.seq}, micro-batch {args.micro_batch}, {res['params'] / 1e6:.1f}M params, "
          f"{args.precision}")
    where = f"CUDA, {res['device_name']}" if cuda else "CPU"
    print(f"  world: TP=1 x DP={args.dp} ({res['backend']}, {where}), {res['threads']} thread(s) per rank; "
          f"{args.steps} timed steps per variant after {args.warmup} warm-up, interleaved")
    if cuda:
        print(f"  device: {res['device_name']} (rank 0: {res['device']}); phases timed with "
              f"torch.cuda.synchronize() at every boundary")
    print(f"  host CPU: {cpu_model}; CPU Adam kernel: "
          f"{adam['isa'] if adam.get('extension') else 'torch fallback (extension missing)'}, "
          f"{adam['threads']} thread(s) (available: {', '.join(adam.get('available_isas') or []) or '-'})")
    print(f"  load average before/after: {load_before[0]:.2f} / {load_after[0]:.2f} "
          f"(the machine's cores are shared: timings carry that noise)")
    print()
    print(f"  {'variant':<10}{'median step':>13}{'min':>10}{'max':>10}{'tokens/s':>11}"
          f"{'forward':>10}{'backward':>10}{'optim':>10}")
    for v in ("ours", "baseline"):
        m, x = med[v], st[v]["total"]
        print(f"  {v:<10}{m['total']:>12.3f}s{min(x):>9.3f}s{max(x):>9.3f}s{tokens / m['total']:>11.0f}"
              f"{m['forward']:>9.3f}s{m['backward']:>9.3f}s{m['optimizer']:>9.3f}s")
    print(f"  (ours' backward includes finish_grad_sync, {med['ours']['sync_wait']:.3f}s median: the wait for "
          f"the last reduce-scatters and copies home; DDP's includes its all-reduces)")
    print()
    print(f"  ratio ours/baseline (median step): {ratio:.3f}x   target <= {args.target:.2f}x: "
          f"{'MET' if ok else 'MISSED'}")
    print(f"  losses, last step: ours {res['losses']['ours'][-1]:.4f}, baseline {res['losses']['baseline'][-1]:.4f} "
          f"(first: {res['losses']['ours'][0]:.4f} / {res['losses']['baseline'][0]:.4f})")

    ov = res.get("overlap")
    if args.dp == 1:
        overlap_text = "n/a (DP=1)"
    elif ov is None:
        overlap_text = "not measured (--overlap-steps 0)"
    elif ov["share"] is None:
        overlap_text = "n/a (no reduce-scatter time measured)"
    else:
        err = ov["share_stderr"]
        overlap_text = f"{100 * ov['share']:.0f}% (+- {f'{100 * err:.0f}' if err <= 1 else '>100'} points)"
    print(f"  overlap share of gradient communication (reduce-scatter hidden behind backward): {overlap_text}")
    if ov is not None:
        print(f"    backward + grad sync: async {ov['t_async_s']:.3f}s, no communication {ov['t_free_s']:.3f}s "
              f"(medians) -> exposed {ov['raw_exposed_s']:+.3f}s (median per-pass difference; clamped to "
              f"[0, alone]: {ov['exposed_s']:.3f}s)")
        print(f"    reduce-scatters alone: {ov['comm_s']:.3f}s in {ov['reduce_scatters_per_step']} call(s); "
              f"serialized pass {ov['t_serial_s']:.3f}s (cross-check: serialized - no-comm = "
              f"{ov['t_serial_s'] - ov['t_free_s']:.3f}s); medians of {ov['passes']} pass(es) per mode")
        print("    share = 1 - clamp(median(async - no-comm), 0, alone) / alone  (see the module docstring)")
        if not ov["resolved"]:
            print(f"    LOW CONFIDENCE: the exposed time's standard error ({ov['exposed_stderr_s']:.3f}s, from the "
                  f"pass-to-pass spread) is over a quarter of the communication time ({ov['comm_s']:.3f}s): "
                  f"use more --overlap-steps or a quieter machine")
        if res["bucket_count"] == 1:
            print("    (one gradient bucket: its reduce-scatter cannot start before backward ends, so little "
                  "overlap is possible; a smaller --bucket-size gives more)")

    kc = res.get("kernel_calls")
    if kc:
        print(f"  CPU Adam over {kc['segments']} segments ({kc['host_numel']:,} elements): one kernel call "
              f"{1e3 * kc['adam_one_s']:.2f} ms vs per segment {1e3 * kc['adam_per_segment_s']:.2f} ms, ratio "
              f"{kc['adam_ratio']:.2f}x (bit-identical: {'yes' if kc['adam_identical'] else 'NO'}); grad-norm pass "
              f"{1e3 * kc['norm_one_s']:.2f} ms vs {1e3 * kc['norm_per_segment_s']:.2f} ms, {kc['norm_ratio']:.2f}x")
    print()
    print("  engine accounting (per rank):")
    print(f"    device: params {_fmt_bytes(acc['device_param_bytes'])} + gradient buckets "
          f"{_fmt_bytes(acc['device_bucket_bytes'])} ({res['bucket_count']} bucket(s) of {res['bucket_numel']:,} "
          f"elements) = {_fmt_bytes(acc['device_model_state_bytes'])} (device_model_state_bytes)")
    print(f"    host:   fp32 master {_fmt_bytes(acc['host_master_bytes'])} + Adam m/v "
          f"{_fmt_bytes(acc['host_optimizer_bytes'])} + staging {_fmt_bytes(acc['host_staging_bytes'])} = "
          f"{_fmt_bytes(acc['host_bytes'])}")
    print(f"    per step: sent {_fmt_bytes(acc['sent_bytes'])}, received {_fmt_bytes(acc['received_bytes'])}, "
          f"device->host {_fmt_bytes(acc['d2h_bytes'])}, host->device {_fmt_bytes(acc['h2d_bytes'])}")
    base_state = 16 * res["params"]
    base_wire = 2 * (args.dp - 1) * 4 * res["params"] // args.dp
    print(f"    (baseline: fp32 params + grads + m + v = {_fmt_bytes(base_state)} per rank, all on the device; "
          f"DDP's fp32 all-reduce sends {_fmt_bytes(base_wire)} per step)")
    if cuda:
        pk, raw, rs = res["peak_device_bytes"], res["peak_device_bytes_raw"], res["resident_device_bytes"]
        print("  device memory (rank 0, torch.cuda.max_memory_allocated, peak stats reset before every step):")
        for v in ("ours", "baseline"):
            print(f"    {v:<9} peak {_fmt_bytes(pk[v])} own (resident {_fmt_bytes(rs[v])} + step peak above it); "
                  f"{_fmt_bytes(raw[v])} raw, the other variant's resident tensors included")
    else:
        print("  device memory: n/a on CPU (the device is the host)")
    det = res.get("detail")
    if det:
        print()
        how = ("each call bracketed by torch.cuda.synchronize(): serialized device time"
               if det.get("serialized_cuda") else "exclusive wall time")
        print(f"  where ours spends a step (rank 0, mean of 3 extra steps; engine internals, {how}):")
        ph, it, calls = det["phases_s"], det["internals_s"], det["calls_per_step"]
        for k in ("forward", "backward", "optimizer"):
            print(f"    {k:<50}{ph.get(k, 0.0):>9.3f}s")
        for k, label in _INTERNAL_LABELS.items():
            if k in it:
                print(f"      {label:<48}{it[k]:>9.3f}s  x{calls[k]:g}")
        if kc:
            print(f"      {'(old path: adam_step once per segment)':<48}{kc['adam_per_segment_s']:>9.3f}s  "
                  f"x{kc['segments']}  -> one call is {kc['adam_ratio']:.2f}x faster")
            print(f"      {'(old path: grad_sumsq_and_finite per segment)':<48}{kc['norm_per_segment_s']:>9.3f}s  "
                  f"x{kc['segments']}  -> one call is {kc['norm_ratio']:.2f}x faster")
        for v in ("ours", "baseline"):
            print()
            print(f"  torch.profiler, one step of {v} (top operators by {det['sort_key']}):")
            for line in det["profiler_top_ops"].get(v, "").splitlines():
                print("    " + line)
    print()
    print(f"  wall time {wall:.0f}s")

    if args.json:
        out = dict(config=vars(args), params=res["params"], threads_per_rank=res["threads"],
                   device=res["device"], device_type=res["device_type"], device_name=res["device_name"],
                   backend=res["backend"], cpu_model=cpu_model,
                   median_step_s={v: med[v]["total"] for v in med}, median_phases_s=med,
                   tokens_per_s={v: tokens / med[v]["total"] for v in med}, ratio=ratio, target=args.target,
                   target_met=ok, step_times_s=st, losses=res["losses"], accounting=acc,
                   engine_device_model_state_bytes=acc["device_model_state_bytes"],
                   peak_device_bytes=res["peak_device_bytes"], peak_device_bytes_raw=res["peak_device_bytes_raw"],
                   resident_device_bytes=res["resident_device_bytes"],
                   overlap_share=(ov["share"] if ov else None), overlap_share_text=overlap_text,
                   overlap_share_resolved=(ov["resolved"] if ov else None), overlap=ov,
                   kernel_call_comparison=kc, segments=res["segments"],
                   sent_bytes_per_step=res["sent_bytes_per_step"], cpu_adam=adam,
                   load_average_before_after=[load_before[0], load_after[0]], detail=det, wall_s=wall)
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
