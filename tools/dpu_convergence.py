#!/usr/bin/env python3
"""Does the delayed parameter update converge like exact updates? Train each way and compare.

    python tools/dpu_convergence.py [--train-iters 300] [--dpu-warmup-steps 40] [--out-dir docs/img]
                                    [--nproc 2] [--mitigation weight-prediction ...]
                                    [-- extra pretrain_gpt.py flags]

Runs pretrain_gpt.py (the demo model on the embedded corpus unless extra flags say otherwise)
with --zero-offload: once with exact updates, once with --dpu, and once with --dpu plus each
staleness mitigation named by --mitigation (default: every one the job has, MITIGATIONS below;
`--mitigation none` for none), from the same seed on the same batches, evaluating every
--eval-interval iterations. Writes dpu_convergence.json (every curve, the final validation losses
and each one's relative gap to exact updates), dpu_convergence.png (training and validation loss
against iteration) and, from the DPU run, dpu_timeline.* (the --timeline files and their plot).
Exit 0 when the best delayed run (plain or mitigated) ends within --tolerance (default 2%) of
exact updates, 1 otherwise.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Staleness mitigations of --dpu the job implements: name -> the flags added to --dpu (docs/dpu.md).
MITIGATIONS = {"weight-prediction": ["--dpu-weight-prediction"]}


def _run(name: str, flags: list[str], nproc: int, out_dir: str) -> dict:
    log = os.path.join(out_dir, f"dpu_convergence_{name}.jsonl")
    if os.path.exists(log):
        os.remove(log)
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    cmd = [torchrun, "--standalone", f"--nproc-per-node={nproc}", os.path.join(ROOT, "pretrain", "pretrain_gpt.py"),
           "--zero-offload", "--log-jsonl", log, "--no-progress-bar", *flags]
    print(f"[{name}] {' '.join(cmd[1:])}", flush=True)
    t0 = time.monotonic()
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        sys.stderr.write(p.stdout[-3000:] + p.stderr[-3000:])
        print(f"error: the {name} run failed (exit {p.returncode}); its output is above", file=sys.stderr)
        sys.exit(2)
    rows = [json.loads(line) for line in open(log)]
    train = [(r["iteration"], r["loss"]) for r in rows if r["kind"] == "train"]
    val = [(r["iteration"], r["val_loss"]) for r in rows if r["kind"] == "eval"]
    step = [r["step_time_s"] for r in rows if r["kind"] == "train"]
    print(f"[{name}] {time.monotonic() - t0:.0f} s; final validation loss {val[-1][1]:.4f}", flush=True)
    return {"train": train, "val": val, "wall_s": time.monotonic() - t0,
            "median_step_time_s": sorted(step)[len(step) // 2]}


def _plot(runs: dict, path: str, warmup: int) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    colors = ["#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3"]
    for name, color in zip(runs, colors):
        it, loss = zip(*runs[name]["train"])
        ax.plot(it, loss, color=color, alpha=0.45, lw=1, label=f"{name}: training loss")
        it, loss = zip(*runs[name]["val"])
        ax.plot(it, loss, "o-", color=color, lw=2, label=f"{name}: validation loss")
    ax.axvline(warmup, color="#999999", ls="--", lw=1, label=f"DPU starts (update {warmup})")
    ax.set_xlabel("iteration")
    ax.set_ylabel("loss (nats)")
    ax.set_title("Delayed parameter update (and its mitigations) vs exact updates\n(same seed, same batches)",
                 fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--train-iters", type=int, default=300)
    ap.add_argument("--eval-interval", type=int, default=25)
    ap.add_argument("--dpu-warmup-steps", type=int, default=40)
    ap.add_argument("--nproc", type=int, default=2, help="ranks (default 2: TP=2 as `make demo`)")
    ap.add_argument("--tensor-parallel", type=int, default=2)
    ap.add_argument("--out-dir", default="docs/img")
    ap.add_argument("--tolerance", type=float, default=0.02, help="relative final validation-loss gap allowed")
    ap.add_argument("--jobs", type=int, default=1,
                    help="runs at once (they are independent: same seed, same batches); each uses --nproc "
                         "processes, so use it where the machine has cores to spare")
    ap.add_argument("--mitigation", action="append", choices=[*MITIGATIONS, "none"],
                    help="a --dpu staleness mitigation to run as well (repeatable; default: all of them)")
    args = ap.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    mitigations = [m for m in (args.mitigation or list(MITIGATIONS)) if m != "none"]
    os.makedirs(args.out_dir, exist_ok=True)
    common = ["--tensor-parallel", str(args.tensor_parallel), "--train-iters", str(args.train_iters),
              "--eval-interval", str(args.eval_interval), *extra]
    timeline = os.path.join(args.out_dir, "dpu_timeline")
    dpu_flags = ["--dpu", "--dpu-warmup-steps", str(args.dpu_warmup_steps)]
    plans = {"exact": common, "dpu": [*common, *dpu_flags, "--timeline", timeline],
             **{f"dpu+{m}": [*common, *dpu_flags, *MITIGATIONS[m]] for m in mitigations}}
    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        futures = {name: pool.submit(_run, name, flags, args.nproc, args.out_dir) for name, flags in plans.items()}
        runs = {name: f.result() for name, f in futures.items()}
    exact, dpu = runs["exact"]["val"][-1][1], runs["dpu"]["val"][-1][1]
    gap = (dpu - exact) / exact             # signed: > 0 when the delayed run ends behind
    rows = {name: {"final_val_loss": r["val"][-1][1], "relative_gap": (r["val"][-1][1] - exact) / exact}
            for name, r in runs.items() if name != "exact"}
    best = min(rows, key=lambda n: rows[n]["relative_gap"])
    result = {"train_iters": args.train_iters, "dpu_warmup_steps": args.dpu_warmup_steps, "nproc": args.nproc,
              "tensor_parallel": args.tensor_parallel, "extra_flags": extra,
              "final_val_loss_exact": exact, "final_val_loss_dpu": dpu, "relative_gap": gap,
              "delayed_runs": rows, "best": best, "best_relative_gap": rows[best]["relative_gap"],
              "within_tolerance": rows[best]["relative_gap"] <= args.tolerance, "tolerance": args.tolerance,
              "runs": runs}
    with open(os.path.join(args.out_dir, "dpu_convergence.json"), "w") as f:
        json.dump(result, f, indent=1)
    _plot(runs, os.path.join(args.out_dir, "dpu_convergence.png"), args.dpu_warmup_steps)
    it = args.dpu_warmup_steps + 5
    subprocess.run([sys.executable, os.path.join(ROOT, "tools", "plot_timeline.py"), timeline, "--iterations",
                    f"{it}:{it + 3}", "--out", timeline + ".png",
                    "--title", f"--dpu timeline, iterations {it}-{it + 3}"], check=True)
    print(f"final validation loss: exact {exact:.4f}")
    for name, row in rows.items():
        print(f"  {name:28s} {row['final_val_loss']:.4f}  gap {row['relative_gap']:+.2%} "
              f"({'within' if row['relative_gap'] <= args.tolerance else 'OUTSIDE'} {args.tolerance:.0%})")
    print(f"best delayed run: {best}; wrote {args.out_dir}/dpu_convergence.json and .png")
    return 0 if result["within_tolerance"] else 1


if __name__ == "__main__":
    sys.exit(main())
