#!/usr/bin/env python3
"""Draw a `--timeline` file of pretrain_gpt.py as a PNG: what overlaps what, per rank.

    python tools/plot_timeline.py run.timeline [--out timeline.png] [--iterations 45:50]

FILE is what --timeline was given; its per-rank files FILE.rank0, FILE.rank1, ... are found
automatically. Each rank gets two lanes: the main thread (forward, backward, gradient sync,
waiting for the CPU step, parameter return) and the CPU optimizer (cpu_step: under --dpu it runs
on a worker thread, overlapping the next step's forward/backward; cpu_step_speculated: under
--overlap-cpu-step each bucket's CPU Adam on a worker during backward, cpu_step_rollback and a
cpu_step redo where the speculation was wrong). It also prints, per rank, the
mean time of each phase and how much of the CPU step overlapped forward/backward.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import sys
from collections import defaultdict

COLORS = {"forward": "#4c72b0", "backward": "#55a868", "grad_sync": "#c44e52", "cpu_step_wait": "#bbbbbb",
          "param_return": "#8172b2", "cpu_step": "#dd8452", "optimizer_step": "#dd8452",
          "cpu_step_speculated": "#ccb974", "cpu_step_rollback": "#8c0000"}
WORKER = ("cpu_step", "optimizer_step", "cpu_step_speculated", "cpu_step_rollback")


def fail(msg: str) -> None:
    print(f"error: {msg}", file=sys.stderr)
    sys.exit(2)


def load(path: str) -> list[dict]:
    files = [path] if os.path.isfile(path) else sorted(glob.glob(glob.escape(path) + ".rank*"))
    if not files:
        fail(f"{path}: no such timeline (nor {path}.rankN files); pass the FILE given to --timeline")
    rows = []
    for f in files:
        with open(f) as fh:
            for n, line in enumerate(fh, 1):
                try:
                    r = json.loads(line)
                    rows.append({k: r[k] for k in ("rank", "iteration", "phase", "start", "end")})
                except (ValueError, KeyError, TypeError):
                    fail(f"{f}:{n} is not a timeline line (want JSON with rank, iteration, phase, start, end)")
    if not rows:
        fail(f"{path}: the timeline is empty (did the run reach its first step?)")
    return rows


def overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Total length of the intersection of two sets of intervals."""
    total = 0.0
    for s1, e1 in a:
        for s2, e2 in b:
            total += max(0.0, min(e1, e2) - max(s1, s2))
    return total


def summarize(rows: list[dict]) -> dict:
    out = {}
    for rank in sorted({r["rank"] for r in rows}):
        mine = [r for r in rows if r["rank"] == rank]
        by = defaultdict(list)
        for r in mine:
            by[r["phase"]].append((r["start"], r["end"]))
        compute = by["forward"] + by["backward"]
        cpu = by.get("cpu_step", []) + by.get("cpu_step_speculated", [])
        cpu_total = sum(e - s for s, e in cpu)
        out[rank] = {
            "mean_ms": {p: 1e3 * sum(e - s for s, e in v) / len(v) for p, v in sorted(by.items())},
            "cpu_step_overlapped_with_forward_backward": overlap(cpu, compute) / cpu_total if cpu_total else None,
        }
    return out


def plot(rows: list[dict], out: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = min(r["start"] for r in rows)
    ranks = sorted({r["rank"] for r in rows})
    fig, ax = plt.subplots(figsize=(12, 1.1 * len(ranks) + 1.5))
    labels, seen = [], set()
    for i, rank in enumerate(ranks):
        for r in rows:
            if r["rank"] != rank:
                continue
            y = 2 * i + (1 if r["phase"] in WORKER else 0)
            kw = {} if r["phase"] in seen else {"label": r["phase"]}
            seen.add(r["phase"])
            ax.broken_barh([(1e3 * (r["start"] - t0), 1e3 * (r["end"] - r["start"]))], (y - 0.4, 0.8),
                           color=COLORS.get(r["phase"], "#999999"), **kw)
        labels += [f"rank {rank} main", f"rank {rank} CPU Adam"]
    ax.set_yticks(range(len(labels)), labels)
    ax.set_xlabel("ms")
    ax.set_title(title)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=7, fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("timeline", help="the FILE given to pretrain_gpt.py --timeline")
    ap.add_argument("--out", default=None, help="PNG to write (default: FILE.png)")
    ap.add_argument("--iterations", default=None, metavar="A:B", help="only iterations A..B (inclusive)")
    ap.add_argument("--title", default="zo_megatron step timeline")
    args = ap.parse_args(argv)
    rows = load(args.timeline)
    if args.iterations:
        try:
            a, b = (int(x) for x in args.iterations.split(":"))
        except ValueError:
            fail(f"--iterations {args.iterations!r}: want A:B, e.g. 45:50")
        # the CPU step of iteration i is reported with i+1 under DPU: keep it with its window
        rows = [r for r in rows if a <= r["iteration"] <= b + (1 if r["phase"] in WORKER else 0)]
        if not rows:
            fail(f"--iterations {args.iterations}: no phases recorded in that range")
    for rank, s in summarize(rows).items():
        phases = ", ".join(f"{p} {ms:.1f}" for p, ms in s["mean_ms"].items())
        ov = s["cpu_step_overlapped_with_forward_backward"]
        print(f"rank {rank}: mean ms {phases}" + (f"; CPU step overlapped with forward/backward: {ov:.0%}"
                                                  if ov is not None else ""))
    out = args.out or args.timeline + ".png"
    plot(rows, out, args.title)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
