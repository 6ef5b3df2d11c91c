#!/usr/bin/env python
"""Convergence of bf16 vs fp32 Adam states (ZeRO-Offload CPU Adam) on real text.

    python tools/compare_optimizer_states.py                     # the demo: 300 iterations, 2 x ~6 min
    python tools/compare_optimizer_states.py --iters 40          # a quick smoke run
    python tools/compare_optimizer_states.py --json out.json     # also write the numbers
    python tools/compare_optimizer_states.py --reuse-logs        # re-read the logs of the last run
    python tools/compare_optimizer_states.py -- --adam-beta2 0.999   # extra flags for both runs

What it does: runs pretrain/pretrain_gpt.py twice, back to back (never in parallel), with torchrun
(TP=2 x ZeRO-Offload, the demo defaults: GPT-2 4 layers x 256 hidden x 4 heads, seq 256,
micro-batch 8, cosine lr 1e-3, bf16 compute, the embedded State of the Union corpus), the same
seed and data order; once with fp32 Adam moments (--exp-avg-dtype fp32, the default) and once with
bf16 moments (--exp-avg-dtype bf16 --exp-avg-sq-dtype bf16). Each run writes a JSONL log
(--log-jsonl); the script reads both and prints

  * train loss side by side, smoothed over --window iterations (the log's 10-iteration rows,
    averaged weighted by the iterations each row covers), and the difference bf16 - fp32;
  * validation loss (and perplexity) at every evaluation (--eval-interval, default 50) and the
    difference;
  * the final differences, host model-state bytes per rank (the train rows'
    host_model_state_bytes: fp32 master + Adam moments + 16-bit staging buffer) and the Adam-moment
    bytes derived from them, and throughput (median tokens/s over the log rows after the first,
    plus wall time).

The moment bytes: the two runs differ only in the moments' dtype, so (fp32 total - bf16 total) is
exactly the bytes the bf16 moments save = half of the fp32 moments' bytes; the script reports
fp32 moments = 2 x that difference and bf16 moments = 1 x that difference.

With --seed-baseline it also runs fp32 states with seed + 1 (a third run): the fp32-vs-fp32 gap
across seeds is the yardstick for whether a bf16-vs-fp32 gap is large.

Tokens/s on a shared machine is noisy (other processes take the cores); trust the loss columns,
treat the throughput columns as indicative only (the CPU Adam is a small part of a demo step).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

VARIANTS = {  # name -> extra flags for pretrain_gpt.py
    "fp32": ["--exp-avg-dtype", "fp32", "--exp-avg-sq-dtype", "fp32"],
    "bf16": ["--exp-avg-dtype", "bf16", "--exp-avg-sq-dtype", "bf16"],
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--iters", type=int, default=300, help="training iterations per run (demo: 300)")
    p.add_argument("--eval-interval", type=int, default=50, help="iterations between validation evaluations")
    p.add_argument("--window", type=int, default=50, help="train-loss smoothing window in iterations")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--seed-baseline", action="store_true",
                   help="also run fp32 states with --seed + 1: the seed-to-seed gap as a yardstick")
    p.add_argument("--nproc", type=int, default=2, help="torchrun processes")
    p.add_argument("--tensor-parallel", type=int, default=2)
    p.add_argument("--torchrun", default=None, help="torchrun executable (default: .venv/bin/torchrun, else torchrun)")
    p.add_argument("--out-dir", default=os.path.join(REPO, "runs", "compare_optimizer_states"),
                   help="where the JSONL logs and console logs go")
    p.add_argument("--reuse-logs", action="store_true",
                   help="do not train: read the JSONL logs already in --out-dir")
    p.add_argument("--json", default=None, metavar="OUT", help="write the numbers to this JSON file")
    p.add_argument("extra", nargs="*", help="after --: extra flags passed to both pretrain_gpt.py runs")
    args = p.parse_args(argv)
    if args.iters < 1 or args.eval_interval < 1 or args.window < 1:
        p.error("--iters, --eval-interval and --window must be >= 1")
    args.out_dir = os.path.abspath(args.out_dir)
    return args


def _torchrun(args) -> str:
    if args.torchrun:
        return args.torchrun
    local = os.path.join(REPO, ".venv", "bin", "torchrun")
    return local if os.access(local, os.X_OK) else "torchrun"


def run_one(args, name: str, flags: list[str], seed: int) -> tuple[str, float]:
    """Train one variant; returns (jsonl path, wall seconds). Output goes to the console and a log."""
    os.makedirs(args.out_dir, exist_ok=True)
    jsonl = os.path.join(args.out_dir, f"{name}.jsonl")
    console = os.path.join(args.out_dir, f"{name}.console.txt")
    if os.path.exists(jsonl):
        os.remove(jsonl)  # the job appends to --log-jsonl
    cmd = [_torchrun(args), "--standalone", "--nproc-per-node", str(args.nproc),
           os.path.join(REPO, "pretrain", "pretrain_gpt.py"), "--tensor-parallel", str(args.tensor_parallel),
           "--zero-offload", "--no-progress-bar", "--log-jsonl", jsonl, "--eval-interval", str(args.eval_interval),
           "--train-iters", str(args.iters), "--seed", str(seed), *flags, *args.extra]
    print(f"[{name}] {' '.join(cmd)}", flush=True)
    t0 = time.monotonic()
    with open(console, "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                bufsize=1)
        tail: list[str] = []
        try:
            for line in proc.stdout:
                log.write(line)
                tail = (tail + [line])[-40:]
                if " iter " in line or "validation loss" in line or "done:" in line or "model:" in line:
                    print(f"[{name}] {line.rstrip()}", flush=True)
            rc = proc.wait()
        except BaseException:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
            raise
    wall = time.monotonic() - t0
    if rc != 0:
        sys.stderr.write("".join(tail))
        raise SystemExit(f"[{name}] pretrain_gpt.py failed with exit status {rc} (full output: {console})")
    return jsonl, wall


def read_log(path: str) -> dict:
    train, evals = [], []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            row = json.loads(line)
            (train if row.get("kind") == "train" else evals if row.get("kind") == "eval" else []).append(row)
    if not train:
        raise SystemExit(f"{path}: no train rows")
    return {"train": train, "eval": evals}


def smoothed(train: list[dict], window: int) -> dict[int, float]:
    """Mean train loss per window of iterations (w, 2w, ...; the last one may be shorter), each log row
    weighted by the iterations it covers."""
    out: dict[int, list[float]] = {}
    prev = 0
    for r in train:
        it, n = r["iteration"], r["iteration"] - prev
        prev = it
        end = min(math.ceil(it / window) * window, train[-1]["iteration"])
        s = out.setdefault(end, [0.0, 0])
        s[0] += r["loss"] * n
        s[1] += n
    return {k: v[0] / v[1] for k, v in sorted(out.items())}


def summarize(log: dict, window: int, wall_s: float | None) -> dict:
    train, evals = log["train"], log["eval"]
    tps = [r["tokens_per_s"] for r in train[1:]] or [train[0]["tokens_per_s"]]
    return {
        "iterations": train[-1]["iteration"],
        "train_loss_smoothed": smoothed(train, window),
        "val_loss": {r["iteration"]: r["val_loss"] for r in evals},
        "val_ppl": {r["iteration"]: r["val_ppl"] for r in evals},
        "final_train_loss_window": list(smoothed(train, window).values())[-1],
        "final_val_loss": evals[-1]["val_loss"] if evals else None,
        "host_model_state_bytes": train[-1]["host_model_state_bytes"],
        "device_model_state_bytes": train[-1]["device_model_state_bytes"],
        "tokens_per_s_median": statistics.median(tps),
        "step_time_s_median": statistics.median(r["step_time_s"] for r in (train[1:] or train)),
        "train_elapsed_s": train[-1].get("elapsed_s"),
        "wall_s": wall_s,
        "skipped": sum(r["skipped"] for r in train),
        "nan_iterations": sum(r["nan_iterations"] for r in train),
    }


def mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def report(s: dict, window: int) -> dict:
    a, b = s["fp32"], s["bf16"]
    ref = s.get("fp32_seed+1")
    lines = []
    hdr = f"{'iter':>6} | {'fp32 states':>11} | {'bf16 states':>11} | {'bf16 - fp32':>11}"
    if ref:
        hdr += f" | {'fp32 seed+1':>11} | {'seed gap':>8}"
    print(f"\nTrain loss (nats), mean over {window}-iteration windows")
    print(hdr)
    print("-" * len(hdr))
    for it, la in a["train_loss_smoothed"].items():
        lb = b["train_loss_smoothed"].get(it)
        row = f"{it:>6} | {la:>11.4f} | " + (f"{lb:>11.4f} | {lb - la:>+11.4f}" if lb is not None
                                             else f"{'-':>11} | {'-':>11}")
        if ref:
            lr = ref["train_loss_smoothed"].get(it)
            row += f" | {lr:>11.4f} | {lr - la:>+8.4f}" if lr is not None else ""
        print(row)
    print("\nValidation loss (nats) and perplexity at each evaluation")
    hdr = (f"{'iter':>6} | {'fp32 states':>11} | {'bf16 states':>11} | {'bf16 - fp32':>11} | "
           f"{'ppl fp32':>9} | {'ppl bf16':>9}")
    if ref:
        hdr += f" | {'fp32 seed+1':>11} | {'seed gap':>8}"
    print(hdr)
    print("-" * len(hdr))
    val_diffs = {}
    for it, va in a["val_loss"].items():
        vb = b["val_loss"].get(it)
        if vb is None:
            continue
        val_diffs[it] = vb - va
        row = (f"{it:>6} | {va:>11.4f} | {vb:>11.4f} | {vb - va:>+11.4f} | {a['val_ppl'][it]:>9.2f} | "
               f"{b['val_ppl'][it]:>9.2f}")
        if ref and it in ref["val_loss"]:
            row += f" | {ref['val_loss'][it]:>11.4f} | {ref['val_loss'][it] - va:>+8.4f}"
        print(row)

    d_host = a["host_model_state_bytes"] - b["host_model_state_bytes"]
    moments_fp32, moments_bf16 = 2 * d_host, d_host
    result = {
        "final_val_loss_fp32": a["final_val_loss"], "final_val_loss_bf16": b["final_val_loss"],
        "final_val_loss_diff": (b["final_val_loss"] - a["final_val_loss"])
        if a["final_val_loss"] is not None and b["final_val_loss"] is not None else None,
        "max_abs_val_loss_diff": max((abs(v) for v in val_diffs.values()), default=None),
        "final_train_loss_window_diff": b["final_train_loss_window"] - a["final_train_loss_window"],
        "host_model_state_bytes_fp32": a["host_model_state_bytes"],
        "host_model_state_bytes_bf16": b["host_model_state_bytes"],
        "host_model_state_change": -d_host / a["host_model_state_bytes"],
        "adam_moment_bytes_fp32": moments_fp32, "adam_moment_bytes_bf16": moments_bf16,
        "tokens_per_s_fp32": a["tokens_per_s_median"], "tokens_per_s_bf16": b["tokens_per_s_median"],
    }
    if ref and ref["final_val_loss"] is not None:
        result["seed_gap_final_val_loss"] = ref["final_val_loss"] - a["final_val_loss"]

    print("\nSummary")
    if result["final_val_loss_diff"] is not None:
        print(f"  final validation loss  : fp32 {a['final_val_loss']:.4f}, bf16 {b['final_val_loss']:.4f}, "
              f"bf16 - fp32 {result['final_val_loss_diff']:+.4f} nats "
              f"(max |diff| over {len(val_diffs)} evals {result['max_abs_val_loss_diff']:.4f})")
    if "seed_gap_final_val_loss" in result:
        print(f"  seed yardstick         : fp32 seed+1 - fp32 seed {result['seed_gap_final_val_loss']:+.4f} nats")
    print(f"  final train window     : bf16 - fp32 {result['final_train_loss_window_diff']:+.4f} nats")
    print(f"  host model states/rank : fp32 states {mib(a['host_model_state_bytes'])}, bf16 states "
          f"{mib(b['host_model_state_bytes'])} ({100 * result['host_model_state_change']:+.1f}%)")
    if moments_fp32 > 0:
        print(f"  Adam moments/rank      : fp32 {mib(moments_fp32)}, bf16 {mib(moments_bf16)} "
              f"({100 * (moments_bf16 - moments_fp32) / moments_fp32:+.1f}%)")
    print(f"  tokens/s (median)      : fp32 {a['tokens_per_s_median']:,.0f}, bf16 {b['tokens_per_s_median']:,.0f} "
          f"(shared machine: indicative only)")
    for name in s:
        x = s[name]
        wall = f", wall {x['wall_s'] / 60:.1f} min" if x.get("wall_s") else ""
        print(f"  {name:<22} : {x['iterations']} iterations, median {x['step_time_s_median'] * 1000:.0f} ms/it"
              f"{wall}, skipped {x['skipped']}, nan {x['nan_iterations']}")
    return result


def main(argv=None) -> int:
    args = parse_args(argv)
    plan = [("fp32", VARIANTS["fp32"], args.seed), ("bf16", VARIANTS["bf16"], args.seed)]
    if args.seed_baseline:
        plan.append(("fp32_seed+1", VARIANTS["fp32"], args.seed + 1))
    summaries = {}
    for name, flags, seed in plan:
        if args.reuse_logs:
            path, wall = os.path.join(args.out_dir, f"{name}.jsonl"), None
            if not os.path.exists(path):
                if name == "fp32_seed+1":
                    continue
                raise SystemExit(f"--reuse-logs: {path} does not exist")
        else:
            path, wall = run_one(args, name, flags, seed)
        summaries[name] = summarize(read_log(path), args.window, wall)
    load = os.getloadavg()
    print(f"\nSetup: TP {args.tensor_parallel}, {args.nproc} processes, ZeRO-Offload, seed {args.seed}, "
          f"{summaries['fp32']['iterations']} iterations, eval every {args.eval_interval}; "
          f"extra flags: {' '.join(args.extra) or '(none)'}; load average now {load[0]:.2f}")
    result = report(summaries, args.window)
    if args.json:
        out = {"setup": {"iters": args.iters, "eval_interval": args.eval_interval, "window": args.window,
                         "seed": args.seed, "tensor_parallel": args.tensor_parallel, "nproc": args.nproc,
                         "extra": args.extra},
               "runs": summaries, "result": result}
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
