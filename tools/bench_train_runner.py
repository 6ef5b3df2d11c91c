"""How tools/bench_train.py runs one world: spawn its TP x DP ranks (run_world; run_isolated for a
--sweep point, whose rank may die), and in each rank build the variants, time their interleaved
steps, measure each variant's loss and parameter change, and gather the world's rows on rank 0
(the step of the world is its slowest rank's).
"""
from __future__ import annotations

import copy
import json
import os
import sys
import tempfile
import time

from bench_loss_check import UPDATE_GROUPS, update_sums
from bench_train_common import (cpu_count, free_port, gpt_params, median, regime_shape, split_cpus,
                                world_name)
from bench_train_variants import build_variants


# ------------------------------------------------------------------------------------------------
# one rank

def _setup_process(rank: int, world: int, port: int, args) -> int:
    """The rank's environment, threads and CPU pinning; returns its threads."""
    threads = 1 if args.split_cores else args.threads or max(1, cpu_count() // world)
    if args.split_cores:                  # the main thread (and so torch's inline intra-op work) on CPU 0
        os.sched_setaffinity(0, {split_cpus()[0]})
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), ZO_CPU_ADAM_THREADS=str(threads),
                      OMP_NUM_THREADS=str(threads))
    import warnings

    warnings.filterwarnings("ignore")
    import torch

    torch.set_num_threads(threads)
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import logging

    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    return threads


def _batches(args, ps, rank: int, tp: int, mb: int, seq: int, total: int):
    """(zo variants' batches, HF variants' batches, the held-out batch): one batch stream per DP
    rank (zo variants); HF variants in a TP world: one per rank (pure DP)."""
    import torch

    dev = ps.device
    # Zipf-distributed tokens (p_k ~ 1/(k+1)), not uniform ones: a model at init already predicts
    # the uniform distribution (loss ln V), so steps on uniform tokens moved the held-out loss by
    # noise of either sign, under the loss check's visibility floor for some seeds
    # (INCONCLUSIVE); a skewed unigram is something every variant learns in its first steps.
    zipf = 1.0 / torch.arange(1, args.vocab + 1, dtype=torch.float64)

    def tokens(rows, gen):
        return torch.multinomial(zipf, rows * seq, replacement=True, generator=gen).view(rows, seq).to(dev)

    def batches(stream):
        gen = torch.Generator().manual_seed(args.seed + 1000 * (stream + 1))
        return [(tokens(mb, gen), tokens(mb, gen)) for _ in range(total)]

    zo_batches = batches(ps.dp_rank)
    hf_batches = zo_batches if tp == 1 else batches(rank)
    gen = torch.Generator().manual_seed(args.seed + 7)
    eval_batch = (tokens(2, gen), tokens(2, gen))
    return zo_batches, hf_batches, eval_batch


def _timed_steps(variants: dict, zo_batches, hf_batches, args, rank: int):
    """Warm-up + timed steps, the variants interleaved (which goes first rotates): per variant its
    phase times and losses per step, and the 1-minute load average after each step."""
    from zo_megatron.parallel import collectives

    names = list(variants)
    total = args.warmup + args.steps
    records = {v: [] for v in names}
    losses = {v: [] for v in names}
    load = [os.getloadavg()[0]]
    for i in range(total):
        k = i % max(1, len(names))
        order = names[k:] + names[:k]          # rotate which variant goes first
        for v in order:
            times: dict[str, float] = {}
            ctx_batches = hf_batches if variants[v].hf else zo_batches
            ps_sync = variants[v].ctx.sync
            ps_sync()
            collectives.barrier()
            t0 = time.perf_counter()
            loss = variants[v].step(*ctx_batches[i], times)
            ps_sync()
            collectives.barrier()
            times["total"] = time.perf_counter() - t0
            records[v].append(times)
            losses[v].append(loss)
        load.append(os.getloadavg()[0])
        if rank == 0:       # a world can take many minutes (emulated bf16): show where it is
            done = "  ".join(f"{v} {records[v][-1]['total']:.2f}s" for v in names)
            print(f"  step {i + 1}/{total}{' (warm-up)' if i < args.warmup else ''}, rank 0: {done}",
                  file=sys.stderr, flush=True)
    return records, losses, load


def _update_norms(variants: dict, start: dict) -> dict:
    """Per variant, the norms of its parameters' change since `start` over the matrices and the
    vectors, each parameter counted once over the ranks."""
    import torch

    from zo_megatron.parallel import collectives

    updates = {}
    for v in variants:
        now = variants[v].weighted_params()
        assert len(now) == len(start[v]), f"{v}: the parameter list changed during the steps"
        sums = torch.tensor(update_sums((b, p, w) for (b, w), (p, _) in zip(start[v], now)), dtype=torch.float64)
        collectives.all_reduce(sums, "sum")
        updates[v] = {f"update_norm_{g}": float(x) ** 0.5 for g, x in zip(UPDATE_GROUPS, sums.tolist())}
    return updates


def _world_rows(job, shape: dict, variants: dict, records: dict, losses: dict, measured: dict) -> list[dict]:
    """One row per variant; the world's step is its slowest rank's: MAX over ranks, per step and phase.
    `measured`: {'before', 'after', 'updates', 'infos'}, each {variant: ...}."""
    import torch

    from zo_megatron.parallel import collectives

    args, tp, dp = job["args"], job["tp"], job["dp"]
    world, seq, mb = tp * dp, shape["seq"], shape["micro_batch"]
    rows = []
    for v in variants:
        keys = sorted(records[v][0])
        flat = torch.tensor([[r[k] for k in keys] for r in records[v]], dtype=torch.float64)
        collectives.all_reduce(flat, "max")
        steps = flat[args.warmup:]
        per = {k: steps[:, c].tolist() for c, k in enumerate(keys)}
        loss_t = torch.tensor([losses[v][-1]], dtype=torch.float64)
        collectives.all_reduce(loss_t, "sum")
        hf = variants[v].hf
        rows.append(dict(
            variant=v, tp=1 if hf else tp, dp=world if hf else dp, world=world_name(tp, dp), ranks=world,
            precision=job["precision"], regime=job["regime"], seq=seq, micro_batch=mb,
            tokens_per_step=mb * seq * (world if hf else dp), step_times_s=per, loss_after=measured["after"][v],
            loss_before=measured["before"][v], world_tp=tp, world_dp=dp, loss_first=losses[v][0],
            loss_last_step=float(loss_t.item()) / world,
            **measured["updates"][v], **measured["infos"][v]))
    return rows


def _rank_facts(threads: int, dev, load: list) -> dict:
    """What the rank reports besides the rows: threads, device, backend, load, its memory."""
    import torch

    from zo_megatron.parallel import collectives
    from zo_megatron.training.metrics import host_rss_bytes, proc_memory_bytes

    return dict(threads=threads, device=str(dev),
                device_name=torch.cuda.get_device_name(dev) if dev.type == "cuda" else None,
                backend=collectives.default_backend(dev), load_average_during=load,
                # the rank's own peak (VmHWM: getrusage's ru_maxrss would include the driver that spawned it)
                peak_rss_bytes=host_rss_bytes(), rss_end_bytes=proc_memory_bytes().get("vmrss", 0))


def _rank_main(rank, job, port, out_path):
    """One rank of one world: its variants' interleaved steps; rank 0 writes the world's result."""
    args, tp, dp, precision, regime = job["args"], job["tp"], job["dp"], job["precision"], job["regime"]
    world = tp * dp
    threads = _setup_process(rank, world, port, args)
    from zo_megatron.model import GPTConfig
    from zo_megatron.parallel import collectives, destroy_parallel, init_parallel

    shape = regime_shape(args, regime)
    seq, mb = shape["seq"], shape["micro_batch"]
    ps = init_parallel(tp, seed=args.seed, num_attention_heads=args.heads, hidden_size=args.hidden)
    cfg = GPTConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                    vocab_size=args.vocab, max_position_embeddings=seq, precision=precision,
                    attention_backend="sdpa" if args.use_flash_attn else "local",
                    sequence_parallel=args.sequence_parallel)
    result = dict(rows=[], skipped={})
    variants, result["skipped"] = build_variants(job["variants"], args, ps, cfg, mb, world)
    zo_batches, hf_batches, eval_batch = _batches(args, ps, rank, tp, mb, seq, args.warmup + args.steps)
    before = {v: variants[v].eval_loss(*eval_batch) for v in variants}
    # the update check's "before": each variant's parameters as its forward uses them, on the host
    start = {v: [(p.detach().to("cpu", copy=True), w) for p, w in variants[v].weighted_params()] for v in variants}
    records, losses, load = _timed_steps(variants, zo_batches, hf_batches, args, rank)
    infos = {v: variants[v].info() for v in variants}
    after = {v: variants[v].eval_loss(*eval_batch) for v in variants}      # (DPU: flushes the last update)
    updates = _update_norms(variants, start)
    del start
    measured = dict(before=before, after=after, updates=updates, infos=infos)
    result["rows"] = _world_rows(job, shape, variants, records, losses, measured)
    result.update(_rank_facts(threads, ps.device, load))
    if args.timeline and rank == 0:
        _write_timelines(args.timeline, variants, precision, regime)
    for v in variants.values():
        v.close()
    collectives.barrier()
    destroy_parallel()
    if rank == 0 and out_path:
        with open(out_path, "w") as f:
            json.dump(result, f)
    return result


def _write_timelines(path: str, variants: dict, precision: str, regime: str) -> None:
    """Each offload variant's per-step phases as --timeline JSON lines + a PNG (plot_timeline)."""
    from plot_timeline import plot

    for name, v in variants.items():
        log = getattr(v, "phase_log", None)
        if not log:
            continue
        rows = [dict(rank=0, iteration=i + 1, phase=p, start=s, end=e)
                for i, phases in enumerate(log) for p, s, e in phases]
        out = f"{path}.{name}"
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        last = rows[-1]["iteration"]
        plot([r for r in rows if r["iteration"] >= last - 2], out + ".png",
             f"{name}, {precision}, {regime}: the last 3 steps")
        print(f"wrote {out} and {out}.png", file=sys.stderr)


# ------------------------------------------------------------------------------------------------
# one world, spawned from the driver

def _spawn_entry(rank, job, port, out_path):
    _rank_main(rank, job, port, out_path)


def run_world(job) -> dict:
    """One world (TP x DP ranks, spawned here), all its variants interleaved; rank 0's result.
    The port is picked free here and bound by rank 0's store seconds later (the ranks' imports):
    where another process took it meanwhile (EADDRINUSE, before any rank did work) the world
    starts again on a fresh port, up to twice."""
    import torch.multiprocessing as mp

    for attempt in range(3):
        try:
            return _run_world_once(job)
        except mp.ProcessRaisedException as exc:
            if "EADDRINUSE" not in str(exc) or attempt == 2:
                raise
    raise AssertionError("unreachable")


def _run_world_once(job) -> dict:
    world = job["tp"] * job["dp"]
    port = free_port()
    fd, out_path = tempfile.mkstemp(prefix="bench_train_", suffix=".json")
    os.close(fd)
    try:
        # every world in fresh processes, one rank too: DeepSpeed keeps its process groups in
        # module globals, which would outlive this world's destroyed groups in the next one
        import torch.multiprocessing as mp

        mp.spawn(_spawn_entry, args=(job, port, out_path), nprocs=world, join=True)
        with open(out_path) as f:
            return json.load(f)
    finally:
        os.unlink(out_path)


def run_isolated(job) -> dict:
    """One single-rank sweep job in its own process (run_world), so its peak RSS is its own; a
    rank that dies (out of memory?) is an `error` entry, and the sweep goes on."""
    import torch.multiprocessing as mp

    try:
        return run_world(job)
    except (mp.ProcessExitedException, mp.ProcessRaisedException) as exc:
        return dict(error=f"rank failed: {str(exc).strip().splitlines()[-1]} (out of memory?)")


def run_sweep_point(args, layers: int, hidden: int, heads: int, variant: str, seq: int, mb: int) -> dict:
    """--sweep: one variant at one model size (1 rank, fp32, optimizer-bound shape) in its own process:
    its median step time and host memory, or why it did not run."""
    n = gpt_params(layers, hidden, args.vocab, seq)
    a = copy.copy(args)
    a.layers, a.hidden, a.heads, a.seq, a.micro_batch = layers, hidden, heads, seq, mb
    job = dict(args=a, tp=1, dp=1, precision="fp32", regime="optimizer-bound", variants=[variant])
    t0 = time.perf_counter()
    res = run_isolated(job)
    row = res["rows"][0] if res.get("rows") else None
    return dict(variant=variant, layers=layers, hidden=hidden, heads=heads, params=n,
                median_step_s=median(row["step_times_s"]["total"]) if row else None,
                peak_host_rss_bytes=res.get("peak_rss_bytes", 0),
                host_rss_after_steps_bytes=res.get("rss_end_bytes", 0), wall_s=time.perf_counter() - t0,
                skipped=res.get("skipped", {}).get(variant) or res.get("error"))
