#!/usr/bin/env python
"""The NVMe tier's I/O against the disk's own ceiling, measured in one run (issue 38, docs/nvme.md).

  ceiling   the disk through the tier's own I/O path (offload/nvme_io.py: O_DIRECT where the
            filesystem takes it, page-aligned buffers, blocks of --block-mib on --threads threads,
            a whole --ceiling-mib file in flight per direction): write GB/s, then read GB/s, once
            before and once after the passes; the better of the two is the ceiling.
  pass      the engine's CPU step with the states on disk (offload/nvme_store.py, the kernel the
            engine calls, chunk by chunk through a ring of --buffer-count buffers of --buffer-size
            elements): --elements partition elements, fp32 moments and master on disk (12 B each
            way per element), bf16 gradient in, bf16 parameter out. Reported: the pass's seconds,
            the bytes it read and wrote, its GB/s, and `of_ceiling` = the time the ceiling needs
            for those bytes (read at the read ceiling, then write at the write ceiling: one disk)
            / the pass's time.
  memory    the same kernel over the same partition in memory: the step without the tier, and
            the ratio pass / memory.

The states after the passes are checked against the in-memory run: bitwise equal, or the tool fails.

--job: whole training jobs instead (pretrain/pretrain_gpt.py under torchrun, --mock-data, the model
the flags below give), one per arm: states in memory, the moments on disk, the moments and the
master on disk, each with the synchronous schedule and with --dpu (the CPU step, and so the disk
pass, behind the next step's forward/backward), and with --overlap-arms also --overlap-cpu-step (the
speculated chunks' pass behind the last micro-batch's backward). Reported per arm: the median step_time_s of the
iterations after --warmup, its ratio to the in-memory arm of the same schedule, the disk bytes per
step and the seconds the CPU step waited for the disk (the job's own JSONL), the job's CPU seconds
(launcher and ranks, start to end: less sensitive to a shared machine than the step times), the load average
around the arm (the machine may be shared: the numbers are as noisy as the load says), and the
seconds the disk's ceiling (measured first, as above) needs for the step's bytes.

--checksum: the tier's block checksum alone, on one thread: zlib.crc32 (the tier's checksum without
the extension) and each path of cpu_adam.crc32c (sse4.2, software), GB/s over a --checksum-mib buffer
and over the 4 MiB blocks the tier checksums, the best of --passes. The pass and the jobs report the
checksum their state files used (`checksum`: crc32c or zlib; ZO_NVME_CHECKSUM=zlib forces zlib's).

  python tools/bench_nvme.py --job --dir /nvme/tmp --num-layers 8 --hidden-size 512 --seq-length 32
  python tools/bench_nvme.py --checksum

  python tools/bench_nvme.py --dir /nvme/tmp                      # 1 GiB ceiling, 64M elements
  python tools/bench_nvme.py --dir /nvme/tmp --elements 16M --passes 2 --json out.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from zo_megatron.errors import UserError  # noqa: E402
from zo_megatron.offload import cpu_adam  # noqa: E402
from zo_megatron.offload.nvme_io import AsyncFileIO, StateFile, aligned_empty, checksum_kind  # noqa: E402
from zo_megatron.offload.nvme_store import NvmeConfig, NvmeStateStore  # noqa: E402

STATES = {"master": torch.float32, "exp_avg": torch.float32, "exp_avg_sq": torch.float32}


def _count(text: str) -> int:
    text = text.strip().upper()
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(float(text[:-1] if text[-1:] in "KMG" else text) * scale)


def ceiling(directory: str, mib: int, threads: int, block_mib: int) -> dict:
    """Write then read one file of `mib` MiB, all of it in flight, through AsyncFileIO."""
    n = mib << 20
    io = AsyncFileIO(threads, block_mib << 20)
    buf = aligned_empty(n)
    buf.copy_(torch.randint(0, 256, (n,), dtype=torch.uint8))
    f = StateFile(os.path.join(directory, f"bench_nvme_ceiling.{os.getpid()}.bin"), n)
    try:
        t0 = time.perf_counter()
        io.write(f, 0, buf).wait()
        os.fsync(f.fd)
        t1 = time.perf_counter()
        io.read(f, 0, buf).wait()
        t2 = time.perf_counter()
        return {"bytes": n, "write_gbps": n / (t1 - t0) / 1e9, "read_gbps": n / (t2 - t1) / 1e9, "o_direct": f.direct}
    finally:
        f.close(remove=True)
        io.close()


def _kernel(master, grad, m, v, segs, out, step):
    cpu_adam.adam_step_segments(master, grad, m, v, [(s, e, 0.1) for s, e in segs], step=step, lr=1e-3, beta1=0.9,
                                beta2=0.95, eps=1e-8, param16_out=out)


def passes(directory: str, n: int, count: int, size: int, threads: int, block_mib: int, k: int, seed: int) -> dict:
    """k CPU steps over n elements with the states on disk, then the same k in memory; equal bits."""
    gen = torch.Generator().manual_seed(seed)
    grad = torch.randn(n, generator=gen).to(torch.bfloat16)
    init = torch.randn(n, generator=gen)
    segs = [(0, n // 3), (n // 3, n)]                  # two segments, as a weight/bias boundary cuts one
    cfg = NvmeConfig(directory, buffer_count=count, buffer_size=size, io_threads=threads, block_bytes=block_mib << 20)
    store = NvmeStateStore(cfg, f"bench_nvme.{os.getpid()}", segs, n, STATES)
    out = torch.empty(n, dtype=torch.bfloat16)
    try:
        store.fill_initial([(0, init)])
        times = []
        for step in range(1, k + 1):
            store.reset_counters()
            t0 = time.perf_counter()
            for lo, hi, st in store.stream():
                part = [(max(s, lo) - lo, min(e, hi) - lo) for s, e in segs if s < hi and e > lo]
                _kernel(st["master"], grad[lo:hi], st["exp_avg"], st["exp_avg_sq"], part, out[lo:hi], step)
            store.drain()
            times.append(time.perf_counter() - t0)
        read, written, waited = store.read_bytes, store.written_bytes, store.wait_s
        disk = {key: torch.cat([v[key].clone() for _, _, v in store.stream(write=False)]) for key in STATES}
    finally:
        store.close()
    master, m, v = init.clone(), torch.zeros(n), torch.zeros(n)
    ref_out = torch.empty(n, dtype=torch.bfloat16)
    mem_times = []
    for step in range(1, k + 1):
        t0 = time.perf_counter()
        _kernel(master, grad, m, v, segs, ref_out, step)
        mem_times.append(time.perf_counter() - t0)
    for key, ref in (("master", master), ("exp_avg", m), ("exp_avg_sq", v)):
        if not torch.equal(disk[key].view(torch.int32), ref.view(torch.int32)):
            raise SystemExit(f"bench_nvme: the {key} after the passes on disk differs from the in-memory run")
    if not torch.equal(out.view(torch.int16), ref_out.view(torch.int16)):
        raise SystemExit("bench_nvme: the 16-bit parameters on disk differ from the in-memory run")
    best = min(times)
    return {"elements": n, "chunks": len(store.chunks), "ring_bytes": store.buffer_bytes, "pass_s": best,
            "pass_s_all": times, "read_bytes": read, "written_bytes": written, "wait_s_last": waited,
            "gbps": (read + written) / best / 1e9, "memory_s": min(mem_times), "ratio": best / min(mem_times),
            "bitwise_equal": True}


SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "pretrain", "pretrain_gpt.py")
JOB_ARMS = (("memory", []), ("moments on disk", ["--optimizer-nvme-path", "{dir}"]),
            ("moments + master on disk", ["--optimizer-nvme-path", "{dir}", "--optimizer-nvme-master"]))


def _median(xs: list[float]) -> float | None:
    xs = sorted(xs)
    return None if not xs else (xs[len(xs) // 2] if len(xs) % 2 else (xs[len(xs) // 2 - 1] + xs[len(xs) // 2]) / 2)


def job_arm(directory: str, model: list[str], extra: list[str], a, tag: str) -> dict:
    """One pretrain_gpt.py run: the median step time after the warm-up and the tier's I/O per step."""
    log = os.path.join(directory, f"bench_nvme_job.{os.getpid()}.jsonl")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={a.nproc}", SCRIPT,
           *model, *extra, "--log-jsonl", log]
    load0 = os.getloadavg()[0]
    ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout,
                             env=dict(os.environ, PYTHONUNBUFFERED="1"))
        wall = time.perf_counter() - t0
        # CPU seconds of the whole job (launcher and ranks: each waits for its children), less
        # sensitive than step times to a shared machine's load: what the tier's CPU work adds
        ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)
        load1 = os.getloadavg()[0]
        errors = [x for x in (res.stdout + res.stderr).splitlines() if x.startswith("error:")]
        if res.returncode != 0:
            raise SystemExit(f"bench_nvme: the {tag} job failed (exit {res.returncode}): "
                             f"{errors[0] if errors else res.stderr.strip().splitlines()[-1:]}")
        with open(log) as f:
            rows = [r for r in map(json.loads, f) if r.get("kind") == "train"]
    finally:
        if os.path.exists(log):
            os.unlink(log)
    timed = rows[a.warmup:]
    if not timed:
        raise SystemExit(f"bench_nvme: --train-iters {a.train_iters} leaves no iteration after --warmup {a.warmup}")
    if "--dpu" in extra and not all(r.get("delayed_update") for r in timed):
        raise SystemExit(f"bench_nvme: the {tag} job's timed iterations were not all delayed (its log's delayed_update)")
    return {"arm": tag, "flags": extra, "step_s": _median([r["step_time_s"] for r in timed]),
            "step_s_all": [r["step_time_s"] for r in rows],
            "read_bytes_per_step": _median([r.get("nvme_read_bytes_per_step") or 0 for r in timed]),
            "written_bytes_per_step": _median([r.get("nvme_written_bytes_per_step") or 0 for r in timed]),
            "io_wait_s_per_step": _median([r.get("nvme_io_wait_s_per_step") or 0.0 for r in timed]),
            "loss": [r["loss"] for r in rows], "wall_s": wall, "cpu_s": cpu, "load_before": load0, "load_after": load1}


def jobs(directory: str, a) -> list[dict]:
    model = ["--num-layers", str(a.num_layers), "--hidden-size", str(a.hidden_size), "--num-attention-heads",
             str(a.num_attention_heads), "--seq-length", str(a.seq_length), "--max-position-embeddings",
             str(a.seq_length), "--micro-batch-size", str(a.micro_batch_size), "--global-batch-size",
             str(a.micro_batch_size * a.nproc), "--train-iters", str(a.train_iters), "--lr", "1e-4",
             "--min-lr", "1e-5", "--zero-offload", f"--{a.precision}", "--mock-data", "--eval-iters", "0",
             "--log-interval", "1", "--no-progress-bar", "--optimizer-nvme-buffer-size", str(_count(a.buffer_size)),
             "--optimizer-nvme-buffer-count", str(a.buffer_count)]
    arms = []
    # --dpu delays from update W on (default 40): W = --warmup, so every timed iteration is delayed (the
    # tool checks the log says so). Before, a 6-iteration run never left DPU's exact warm-up.
    dpu = ["--dpu", "--dpu-warmup-steps", str(max(1, a.warmup))]
    schedules = [[]] + ([dpu] if a.dpu_arms else []) + ([["--overlap-cpu-step"]] if a.overlap_arms else [])
    for schedule in schedules:
        for name, extra in JOB_ARMS:
            flags = [x.format(dir=directory) for x in extra] + schedule
            if not extra:                                  # the ring's flags are refused without the tier
                run_model = [x for i, x in enumerate(model) if not model[i].startswith("--optimizer-nvme")
                             and not (i and model[i - 1].startswith("--optimizer-nvme"))]
            else:
                run_model = model
            tag = name + (" + --dpu" if "--dpu" in schedule else "".join(f" + {x}" for x in schedule))
            print(f"  job      {tag} ...", flush=True)
            arms.append(job_arm(directory, run_model, flags, a, tag))
            arms[-1]["schedule"] = schedule
    for arm in arms:                                       # against the in-memory arm of the same schedule
        base = next(b for b in arms if b["flags"] == b["schedule"] == arm["schedule"])
        arm["over_memory"] = arm["step_s"] / base["step_s"]
    return arms


def machine() -> dict:
    model = platform.processor()
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout.splitlines():
            if line.startswith("Model name"):
                model = line.split(":", 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10,
                                cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    return {"cpu": model, "cores": os.cpu_count(), "commit": commit, "cpu_adam_threads": cpu_adam.get_num_threads(),
            "checksum": checksum_kind(), "load_average": list(os.getloadavg())}


def checksums(mib: int, block_mib: int, reps: int) -> dict:
    """GB/s of each checksum function on one thread, over one `mib` buffer and over its `block_mib` blocks."""
    import zlib
    buf = torch.randint(0, 256, (mib << 20,), dtype=torch.uint8)
    view = memoryview(buf.numpy())
    B = block_mib << 20
    # for reference, the memory's own pace: a plain read of the same bytes (torch's int64 sum, one thread)
    funcs = {"read (int64 sum)": lambda v: torch.frombuffer(v, dtype=torch.int64).sum(), "zlib.crc32": zlib.crc32}
    if cpu_adam.has_crc32c():
        for impl in cpu_adam._ext.crc32c_impls():
            def run(v, impl=impl):
                cpu_adam._set_crc32c_impl(impl)
                return cpu_adam.crc32c(v)
            funcs[f"crc32c {impl}"] = run
    out = {"bytes": len(view), "block_bytes": B, "repeats": reps, "gbps": {}, "blocks_gbps": {}}
    default = cpu_adam._ext.crc32c_impl() if cpu_adam.has_crc32c() else None
    torch_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for name, f in funcs.items():
            whole, blocks = [], []
            for _ in range(reps):
                t0 = time.perf_counter()
                f(view)
                t1 = time.perf_counter()
                for s in range(0, len(view), B):
                    f(view[s:s + B])
                blocks.append(time.perf_counter() - t1)
                whole.append(t1 - t0)
            out["gbps"][name] = len(view) / min(whole) / 1e9
            out["blocks_gbps"][name] = len(view) / min(blocks) / 1e9
    finally:
        torch.set_num_threads(torch_threads)
        if default is not None:
            cpu_adam._set_crc32c_impl(default)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default=None, help="directory on the disk to measure (default: a temporary one)")
    ap.add_argument("--ceiling-mib", type=int, default=1024)
    ap.add_argument("--elements", default="64M", help="partition elements of the pass (K/M/G suffixes)")
    ap.add_argument("--buffer-count", type=int, default=4)
    ap.add_argument("--buffer-size", default="16M", help="elements per ring buffer")
    ap.add_argument("--threads", type=int, default=4, help="I/O threads (requests in flight)")
    ap.add_argument("--block-mib", type=int, default=4, help="MiB per request")
    ap.add_argument("--passes", type=int, default=3, help="CPU steps timed (the best is reported)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--json", default=None, help="also write the result here")
    ap.add_argument("--checksum", action="store_true", help="time the block checksum functions instead (one thread)")
    ap.add_argument("--checksum-mib", type=int, default=64, help="MiB of the --checksum buffer")
    g = ap.add_argument_group("--job: whole training jobs with and without the tier")
    g.add_argument("--job", action="store_true", help="time pretrain_gpt.py's steps per arm instead of the pass")
    g.add_argument("--num-layers", type=int, default=8)
    g.add_argument("--hidden-size", type=int, default=512)
    g.add_argument("--num-attention-heads", type=int, default=8)
    g.add_argument("--seq-length", type=int, default=32, help="short: optimizer-bound; long: compute-bound")
    g.add_argument("--micro-batch-size", type=int, default=1)
    g.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    g.add_argument("--train-iters", type=int, default=6)
    g.add_argument("--warmup", type=int, default=2, help="iterations left out of the median (DPU's warm-up too)")
    g.add_argument("--nproc", type=int, default=1, help="ranks (data parallel)")
    g.add_argument("--no-dpu-arms", dest="dpu_arms", action="store_false", help="no --dpu arms")
    g.add_argument("--overlap-arms", action="store_true",
                   help="also each arm with --overlap-cpu-step (the speculated chunks' disk pass behind backward)")
    g.add_argument("--timeout", type=float, default=1800, help="seconds per job")
    args = ap.parse_args(argv)
    if args.job:
        return main_job(args)
    if args.checksum:
        return main_checksum(args)
    try:
        with tempfile.TemporaryDirectory(dir=args.dir) as d:
            res = {"machine": machine(), "dir": args.dir or d}
            before = ceiling(d, args.ceiling_mib, args.threads, args.block_mib)
            res["pass"] = passes(d, _count(args.elements), args.buffer_count, _count(args.buffer_size), args.threads,
                                 args.block_mib, args.passes, args.seed)
            after = ceiling(d, args.ceiling_mib, args.threads, args.block_mib)
            # the disk's best of the two (before and after the passes): the pass is not flattered by a slow one
            res["ceiling"] = {**before, "write_gbps": max(before["write_gbps"], after["write_gbps"]),
                              "read_gbps": max(before["read_gbps"], after["read_gbps"]), "runs": [before, after]}
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    c, p = res["ceiling"], res["pass"]
    p["of_ceiling"] = (p["read_bytes"] / (c["read_gbps"] * 1e9) + p["written_bytes"] / (c["write_gbps"] * 1e9)) / p["pass_s"]
    m = res["machine"]
    print(f"bench_nvme: {m['cpu']}, {m['cores']} cores, commit {m['commit']}, dir {res['dir']} "
          f"({'O_DIRECT' if c['o_direct'] else 'buffered'})")
    runs = "; ".join(f"{r['write_gbps']:.2f}/{r['read_gbps']:.2f}" for r in c["runs"])
    print(f"  ceiling  write {c['write_gbps']:.2f} GB/s, read {c['read_gbps']:.2f} GB/s, the best of before and after "
          f"the passes ({runs}; {c['bytes'] >> 20} MiB, {args.threads} threads, {args.block_mib} MiB requests)")
    print(f"  pass     {p['elements']} elements in {p['chunks']} chunks, ring {p['ring_bytes'] >> 20} MiB: "
          f"{p['pass_s']:.3f} s, read {p['read_bytes'] / 1e9:.2f} GB + wrote {p['written_bytes'] / 1e9:.2f} GB = "
          f"{p['gbps']:.2f} GB/s, {p['of_ceiling']:.0%} of the ceiling")
    print(f"  memory   the same kernel in memory: {p['memory_s']:.3f} s; pass / memory = {p['ratio']:.1f}x; "
          "states bitwise equal")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


def main_checksum(a) -> int:
    res = {"machine": machine(), "mode": "checksum"}
    res["checksum"] = c = checksums(a.checksum_mib, a.block_mib, a.passes)
    res["machine"]["load_average_after"] = list(os.getloadavg())
    m = res["machine"]
    print(f"bench_nvme --checksum: {m['cpu']}, commit {m['commit']}, one thread, best of {a.passes}, load "
          f"{m['load_average'][0]:.2f}-{m['load_average_after'][0]:.2f}")
    base = c["gbps"]["zlib.crc32"]
    for name, gbps in c["gbps"].items():
        print(f"  {name:18s} {gbps:6.2f} GB/s over {c['bytes'] >> 20} MiB ({gbps / base:4.1f}x zlib), "
              f"{c['blocks_gbps'][name]:6.2f} GB/s in {c['block_bytes'] >> 20} MiB blocks")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


def main_job(a) -> int:
    try:
        with tempfile.TemporaryDirectory(dir=a.dir) as d:
            res = {"machine": machine(), "dir": a.dir or d, "mode": "job", "args": {k: v for k, v in vars(a).items()}}
            c = ceiling(d, a.ceiling_mib, a.threads, a.block_mib)
            res["ceiling"], res["jobs"] = c, jobs(d, a)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    m = res["machine"]
    print(f"bench_nvme --job: {m['cpu']}, {m['cores']} cores, commit {m['commit']}, dir {res['dir']}; GPT "
          f"{a.num_layers} x {a.hidden_size}, seq {a.seq_length}, micro-batch {a.micro_batch_size}, {a.precision}, "
          f"{a.nproc} rank(s); disk ceiling write {c['write_gbps']:.2f} / read {c['read_gbps']:.2f} GB/s")
    print(f"  {'arm':34s} {'step s':>8s} {'x memory':>9s} {'GB r+w/step':>12s} {'disk s at ceiling':>18s} "
          f"{'I/O wait s':>11s} {'job CPU s':>10s} {'load':>10s}")
    for j in res["jobs"]:
        disk_s = j["read_bytes_per_step"] / (c["read_gbps"] * 1e9) + j["written_bytes_per_step"] / (c["write_gbps"] * 1e9)
        j["disk_s_at_ceiling"] = disk_s
        print(f"  {j['arm']:34s} {j['step_s']:8.3f} {j['over_memory']:9.2f} "
              f"{(j['read_bytes_per_step'] + j['written_bytes_per_step']) / 1e9:12.3f} {disk_s:18.3f} "
              f"{j['io_wait_s_per_step']:11.3f} {j['cpu_s']:10.1f} {j['load_before']:4.1f}-{j['load_after']:<4.1f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
