#!/usr/bin/env python
"""Training-step time: zo_megatron's ZeRO-Offload engine vs plain torch, same GPT, world and batches.

    python tools/bench_train_step.py                  # DP=1, ~45M-param GPT, bf16
    python tools/bench_train_step.py --dp 2           # a 2-process gloo world (spawned by this script)
    python tools/bench_train_step.py --dp 2 --precision fp32 --steps 12 --json out.json

What is compared (TP=1, DP = --dp, one process per DP rank, CPU):

  ours      zo_megatron's TP GPT (build_gpt_model, TP=1) + ZeroOffloadEngine: bf16 flat parameters
            (fp32 with --precision fp32), gradient buckets reduce-scattered over DP, CPU Adam on
            this rank's fp32 master partition, all-gather of the updated 16-bit parameters.
  baseline  the same model class, config and seed (fp32 parameters) wrapped in
            torch.nn.parallel.DistributedDataParallel (gloo, gradient_as_bucket_view=True) +
            torch.optim.AdamW(fused=True); bf16 = torch.autocast("cpu", dtype=torch.bfloat16)
            around the forward (standard torch mixed precision; megatron-core restores the autocast
            state in its linear layers' backward only on CUDA, so the script applies the same
            custom_bwd rule for CPU, see zo_megatron/parallel/megatron_cpu.py); fp32 = no autocast.

Both clip the global gradient norm to 1.0 and use the same AdamW hyper-parameters (weight decay on
matrices only), the same learning rate and the same batches (random tokens, one fixed stream per
DP rank). A step is forward + backward + optimizer step, timed with barriers around it; the step
time of a world is the slowest rank's. The variants run interleaved in the same process(es),
alternating which goes first (A B, B A, A B, ...), so machine noise hits both; the first --warmup
steps of each are dropped. Reported: median step time of each, the ratio ours/baseline, tokens/s,
the target verdict (ratio <= --target, default 1.15), a per-phase breakdown (forward / backward /
optimizer step, medians), and the engine's accounting (device and host bytes, bytes sent per step).
When ours misses the target (or with --profile) it also times the engine's internals
(bucket absorb, reduce-scatter + copy home, grad-norm pass, CPU Adam, params home + all-gather)
and prints torch.profiler's top operators for one step of each variant.

Reading the numbers: in bf16 the two are different mixed-precision schemes by design -- ours
computes with bf16 weights (no casts, bf16 residual stream), the baseline casts its fp32 weights
to bf16 per matmul and keeps fp32 elsewhere -- so ours can beat the baseline outright; --precision
fp32 compares the same math and isolates the engine's own costs (bucket copies, the grad-norm pass,
blocking reduce-scatter / all-gather, CPU Adam). On a shared machine check the reported load
average and the min/max spread before trusting a ratio.

DP=2 runs as a 2-process gloo world that this script spawns itself with torch.multiprocessing
(127.0.0.1, a free port); torchrun is not needed. Threads per process = CPUs / DP (torch intra-op
and the CPU Adam kernel alike), so the two ranks do not oversubscribe the machine.
"""
from __future__ import annotations

import argparse
import json
import os
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
    p.add_argument("--profile", action="store_true", help="always print the engine-internals breakdown "
                   "and torch.profiler's top operators (otherwise only when over the target)")
    p.add_argument("--json", metavar="FILE", help="write the results as JSON")
    args = p.parse_args(argv)
    if args.hidden % args.heads:
        p.error(f"--hidden {args.hidden} is not divisible by --heads {args.heads}")
    if args.steps < 1 or args.warmup < 0:
        p.error("--steps must be >= 1 and --warmup >= 0")
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


# ------------------------------------------------------------------------------------------------
# one rank

class _Timer:
    """Exclusive wall time per name for wrapped callables (engine internals): a wrapped call made
    inside another (the flush a hook triggers) is charged to itself, not to its caller."""

    def __init__(self):
        self.t: dict[str, float] = {}
        self._stack: list[float] = []     # time spent in nested timed calls, per open call

    def wrap(self, name, fn):
        def timed(*a, **k):
            self._stack.append(0.0)
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                dt = time.perf_counter() - t0
                nested = self._stack.pop()
                self.t[name] = self.t.get(name, 0.0) + dt - nested
                if self._stack:
                    self._stack[-1] += dt
        return timed


def _rank_main(rank: int, args, port: int, out_path: str | None):
    world = args.dp
    threads = args.threads or max(1, _cpus() // world)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), ZO_CPU_ADAM_THREADS=str(threads))
    import warnings

    warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex).*")
    warnings.filterwarnings("ignore", message=".*full scope is deprecated.*")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    from zo_megatron.model import GPTConfig, build_gpt_model
    from zo_megatron.offload import cpu_adam
    from zo_megatron.offload.engine import AdamConfig, ZeroOffloadEngine
    from zo_megatron.parallel import destroy_parallel, init_parallel

    ps = init_parallel(1, seed=args.seed, num_attention_heads=args.heads, hidden_size=args.hidden)
    cfg = GPTConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                    vocab_size=args.vocab, max_position_embeddings=args.seq, precision=args.precision)
    betas, eps, wd, clip = (0.9, 0.95), 1e-8, 0.1, 1.0

    # ours: the engine owns the model's parameters (a flat bf16 buffer) from here on
    ours_model = build_gpt_model(cfg, ps.tp_rank, ps.tp_size, args.seed)
    n_params = sum(p.numel() for p in ours_model.parameters())
    engine = ZeroOffloadEngine(ours_model, precision=args.precision,
                               adam=AdamConfig(lr=args.lr, beta1=betas[0], beta2=betas[1], eps=eps, weight_decay=wd),
                               clip_grad=clip, bucket_size=args.bucket_size, dp_group=ps.dp_group,
                               tp_rank=ps.tp_rank)

    # baseline: same class, config and seed; fp32 parameters; torch DDP + fused AdamW
    class LossModule(torch.nn.Module):   # DDP must see the forward that produces the loss
        def __init__(self, gpt):
            super().__init__()
            self.gpt = gpt

        def forward(self, tokens, labels):
            return self.gpt.loss(tokens, labels)

    base_model = build_gpt_model(cfg, ps.tp_rank, ps.tp_size, args.seed)
    ddp = torch.nn.parallel.DistributedDataParallel(LossModule(base_model), process_group=ps.dp_group,
                                                    gradient_as_bucket_view=True)
    decay = [p for p in base_model.parameters() if p.dim() > 1]
    no_decay = [p for p in base_model.parameters() if p.dim() <= 1]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=betas, eps=eps, fused=True)
    autocast = (torch.autocast("cpu", dtype=torch.bfloat16) if args.precision == "bf16"
                else torch.autocast("cpu", enabled=False))

    total = args.warmup + args.steps
    gen = torch.Generator().manual_seed(args.seed + 1000 * ps.dp_rank)
    batches = [(torch.randint(0, args.vocab, (args.micro_batch, args.seq), generator=gen),
                torch.randint(0, args.vocab, (args.micro_batch, args.seq), generator=gen)) for _ in range(total)]

    def step_ours(tokens, labels, times):
        t0 = time.perf_counter()
        loss = ours_model.loss(tokens, labels)
        t1 = time.perf_counter()
        engine.backward(loss)
        t2 = time.perf_counter()
        res = engine.step(lr=args.lr)
        t3 = time.perf_counter()
        times.update(forward=t1 - t0, backward=t2 - t1, optimizer=t3 - t2)
        assert not res.skipped
        return loss.item()

    def step_base(tokens, labels, times):
        t0 = time.perf_counter()
        with autocast:
            loss = ddp(tokens, labels)
        t1 = time.perf_counter()
        loss.backward()            # DDP all-reduces the gradient buckets during backward
        t2 = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(base_model.parameters(), clip)
        opt.step()
        opt.zero_grad(set_to_none=False)   # keep the grads as views of DDP's buckets
        t3 = time.perf_counter()
        times.update(forward=t1 - t0, backward=t2 - t1, optimizer=t3 - t2)
        return loss.item()

    variants = {"ours": step_ours, "baseline": step_base}
    records = {v: [] for v in variants}       # per step: dict(total, forward, backward, optimizer)
    losses = {v: [] for v in variants}
    sent = []
    for i in range(total):
        order = ("ours", "baseline") if i % 2 == 0 else ("baseline", "ours")
        for v in order:
            times: dict[str, float] = {}
            dist.barrier()
            t0 = time.perf_counter()
            loss = variants[v](*batches[i], times)
            dist.barrier()
            times["total"] = time.perf_counter() - t0
            records[v].append(times)
            losses[v].append(loss)
            if v == "ours":
                sent.append(engine.accounting.sent_bytes)

    # the step time of the world is the slowest rank's: MAX over ranks, per step and phase
    keys = ("total", "forward", "backward", "optimizer")
    flat = torch.tensor([[r[k] for k in keys] for v in variants for r in records[v]], dtype=torch.float64)
    dist.all_reduce(flat, op=dist.ReduceOp.MAX)
    per_variant = {}
    for j, v in enumerate(variants):
        rows = flat[j * total:(j + 1) * total][args.warmup:]
        per_variant[v] = {k: rows[:, c].tolist() for c, k in enumerate(keys)}

    ratio = statistics.median(per_variant["ours"]["total"]) / statistics.median(per_variant["baseline"]["total"])
    detail = None
    if args.profile or ratio > args.target:
        detail = _profile_internals(engine, cpu_adam, ours_model, ddp, step_ours, step_base, batches, dist, args)

    result = dict(
        rank=rank, threads=threads, params=n_params, step_times=per_variant,
        losses={v: losses[v] for v in variants}, accounting=engine.accounting.as_dict(),
        sent_bytes_per_step=sent[-1], adam=cpu_adam.info(), detail=detail,
        bucket_count=len(engine.layout.buckets), bucket_numel=engine.layout.max_bucket_numel)
    engine.close()
    destroy_parallel()
    if rank == 0 and out_path:
        with open(out_path, "w") as f:
            json.dump(result, f)
    return result


def _profile_internals(engine, cpu_adam, model, ddp, step_ours, step_base, batches, dist, args):
    """Time the engine's internals over a few extra steps, then torch.profiler's top ops for one step
    of each variant (rank 0's view)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    timer = _Timer()
    orig = {n: getattr(engine, n) for n in ("_absorb", "_flush", "finish_grad_sync", "_local_sumsq_and_finite",
                                             "_params_to_device", "check_params")}
    for n, fn in orig.items():
        setattr(engine, n, timer.wrap(n, fn))
    orig_adam = cpu_adam.adam_step
    cpu_adam.adam_step = timer.wrap("cpu_adam", orig_adam)
    engine_mod = sys.modules[type(engine).__module__]     # the engine calls these module globals
    orig_coll = {n: getattr(engine_mod, n) for n in ("reduce_scatter", "all_gather")}
    for n, fn in orig_coll.items():
        setattr(engine_mod, n, timer.wrap(n, fn))
    n_extra = 3
    phase: dict[str, float] = {}
    try:
        for i in range(n_extra):
            times: dict[str, float] = {}
            dist.barrier()
            step_ours(*batches[i % len(batches)], times)
            for k, v in times.items():
                phase[k] = phase.get(k, 0.0) + v
    finally:
        for n in orig:
            delattr(engine, n)       # back to the class's methods
        cpu_adam.adam_step = orig_adam
        for n, fn in orig_coll.items():
            setattr(engine_mod, n, fn)
    internals = {k: v / n_extra for k, v in timer.t.items()}
    phases = {k: v / n_extra for k, v in phase.items()}

    tables = {}
    for name, fn in (("ours", step_ours), ("baseline", step_base)):
        dist.barrier()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            fn(*batches[0], {})
        tables[name] = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=60)
    return dict(internals_s=internals, phases_s=phases, profiler_top_ops=tables)


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


def main(argv=None) -> int:
    args = parse_args(argv)
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

    print(f"bench_train_step: GPT {args.layers} layers x {args.hidden} hidden x {args.heads} heads, vocab "
          f"{args.vocab}, seq {args.seq}, micro-batch {args.micro_batch}, {res['params'] / 1e6:.1f}M params, "
          f"{args.precision}")
    print(f"  world: TP=1 x DP={args.dp} (gloo, CPU), {res['threads']} thread(s) per rank; "
          f"{args.steps} timed steps per variant after {args.warmup} warm-up, interleaved")
    print(f"  load average before/after: {load_before[0]:.2f} / {load_after[0]:.2f} "
          f"(the machine's cores are shared: timings carry that noise)")
    print()
    print(f"  {'variant':<10}{'median step':>13}{'min':>10}{'max':>10}{'tokens/s':>11}"
          f"{'forward':>10}{'backward':>10}{'optim':>10}")
    for v, label in (("ours", "ours"), ("baseline", "baseline")):
        m, x = med[v], st[v]["total"]
        print(f"  {label:<10}{m['total']:>12.3f}s{min(x):>9.3f}s{max(x):>9.3f}s{tokens / m['total']:>11.0f}"
              f"{m['forward']:>9.3f}s{m['backward']:>9.3f}s{m['optimizer']:>9.3f}s")
    print()
    print(f"  ratio ours/baseline (median step): {ratio:.3f}x   target <= {args.target:.2f}x: "
          f"{'MET' if ok else 'MISSED'}")
    print(f"  losses, last step: ours {res['losses']['ours'][-1]:.4f}, baseline {res['losses']['baseline'][-1]:.4f} "
          f"(first: {res['losses']['ours'][0]:.4f} / {res['losses']['baseline'][0]:.4f})")
    print()
    print("  engine accounting (per rank):")
    print(f"    device: params {_fmt_bytes(acc['device_param_bytes'])} + gradient buckets "
          f"{_fmt_bytes(acc['device_bucket_bytes'])} ({res['bucket_count']} bucket(s) of {res['bucket_numel']:,} "
          f"elements) = {_fmt_bytes(acc['device_model_state_bytes'])}")
    print(f"    host:   fp32 master {_fmt_bytes(acc['host_master_bytes'])} + Adam m/v "
          f"{_fmt_bytes(acc['host_optimizer_bytes'])} + staging {_fmt_bytes(acc['host_staging_bytes'])} = "
          f"{_fmt_bytes(acc['host_bytes'])}")
    print(f"    per step: sent {_fmt_bytes(acc['sent_bytes'])}, received {_fmt_bytes(acc['received_bytes'])}, "
          f"device->host {_fmt_bytes(acc['d2h_bytes'])}, host->device {_fmt_bytes(acc['h2d_bytes'])}")
    base_state = 16 * res["params"]
    base_wire = 2 * (args.dp - 1) * 4 * res["params"] // args.dp
    print(f"    (baseline: fp32 params + grads + m + v = {_fmt_bytes(base_state)} per rank, all on the device; "
          f"DDP's fp32 all-reduce sends {_fmt_bytes(base_wire)} per step)")
    det = res.get("detail")
    if det:
        print()
        print("  where ours spends a step (rank 0, mean of 3 extra steps, engine internals timed):")
        ph, it = det["phases_s"], det["internals_s"]
        names = {"_absorb": "backward: copy grads into buckets (hooks)",
                 "_flush": "backward: bucket /= N + copy shard home",
                 "reduce_scatter": "backward: reduce-scatter (gloo, blocking)",
                 "finish_grad_sync": "step: finish grad sync (late buckets)",
                 "check_params": "step: check_params",
                 "_local_sumsq_and_finite": "step: grad norm + overflow pass",
                 "cpu_adam": "step: CPU Adam kernel",
                 "_params_to_device": "step: copy params home",
                 "all_gather": "step: all-gather (gloo, blocking)"}
        for k in ("forward", "backward", "optimizer"):
            print(f"    {k:<44}{ph.get(k, 0.0):>9.3f}s")
        for k, label in names.items():
            if k in it:
                print(f"      {label:<42}{it[k]:>9.3f}s")
        for v in ("ours", "baseline"):
            print()
            print(f"  torch.profiler, one step of {v} (top operators by self CPU time):")
            for line in det["profiler_top_ops"][v].splitlines():
                print("    " + line)
    print()
    print(f"  wall time {wall:.0f}s")

    if args.json:
        out = dict(config=vars(args), params=res["params"], threads_per_rank=res["threads"],
                   median_step_s={v: med[v]["total"] for v in med}, median_phases_s=med,
                   tokens_per_s={v: tokens / med[v]["total"] for v in med}, ratio=ratio, target=args.target,
                   target_met=ok, step_times_s=st, losses=res["losses"], accounting=acc,
                   sent_bytes_per_step=res["sent_bytes_per_step"], cpu_adam=res["adam"],
                   load_average_before_after=[load_before[0], load_after[0]], detail=det, wall_s=wall)
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
