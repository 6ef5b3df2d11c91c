#!/usr/bin/env python3
"""A mixture of experts against the dense model of its active size, under ZeRO-Offload (issue 39).

    python tools/bench_moe.py                                    # the three arms, 2 ranks, fp32
    python tools/bench_moe.py --train-iters 30 --json moe.json   # + moe.png
    python tools/bench_moe.py --arms dense,moe_ep2 --experts 16 --topk 2

Each arm is the training job itself (`pretrain_gpt.py --zero-offload`, launched by torchrun on
--nproc ranks, gloo on CPUs, mock data), so what is timed is what a user runs:

  dense     a SwiGLU GPT whose MLP has the MoE's active size: FFN = top-k x the experts' FFN (the
            parameters one token goes through, less the router's E x h per layer)
  moe_ep1   the MoE (--num-experts E, top-k, --moe-ffn-hidden-size F) at EP 1: every rank holds
            every expert, the plain engine partitions experts with the dense parameters over DP
  moe_ep2   the same MoE at --expert-model-parallel-size 2 (alltoall dispatcher): each EP rank
            holds E / 2 experts, offload/expert_parallel.py's two engines (dense over DP, experts
            over expert DP)

Reported per arm (table, `--json FILE` and a PNG next to it): total and active parameters, the
median step time and tokens/s over the iterations after --skip (the JSONL's `step_time_s`,
`tokens_per_s`), the CPU Adam's time per iteration and its share of the step (from `--timeline`:
the `cpu_step` phases of every engine of rank 0, summed per iteration), the forward+backward time,
and the host bytes of model states per rank (`host_model_state_bytes`). Same seed, shapes, batches
and data in every arm; the MoE's aux loss is on (0.01) as a Megatron-LM run would have it.

The step times are wall clock on a shared machine: the header prints the CPU and the load average,
and the arms run interleaved in rounds (--rounds) so a load change hits every arm.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARMS = ("dense", "moe_ep1", "moe_ep2")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arms", default=",".join(ARMS), help="comma-separated subset of " + ", ".join(ARMS))
    p.add_argument("--nproc", type=int, default=2, help="ranks (DP; EP 2 needs an even number)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--moe-ffn", type=int, default=512, help="each expert's FFN size (--moe-ffn-hidden-size)")
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--train-iters", type=int, default=12)
    p.add_argument("--skip", type=int, default=2, help="first iterations not timed (set-up, first touches)")
    p.add_argument("--rounds", type=int, default=1, help="runs of every arm, interleaved")
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--json", metavar="FILE", help="write the rows as JSON (and a PNG next to it)")
    args = p.parse_args(argv)
    args.arm_list = [a.strip() for a in args.arms.split(",") if a.strip()]
    bad = [a for a in args.arm_list if a not in ARMS]
    if bad or not args.arm_list:
        p.error(f"--arms: unknown {','.join(bad) or 'empty'}; choose from {', '.join(ARMS)}")
    if "moe_ep2" in args.arm_list and (args.nproc % 2 or args.experts % 2):
        p.error(f"moe_ep2 needs an even --nproc and --experts (got {args.nproc}, {args.experts})")
    if not 1 <= args.topk <= args.experts:
        p.error(f"--topk {args.topk} must be between 1 and --experts {args.experts}")
    if args.hidden % args.heads:
        p.error(f"--hidden {args.hidden} is not divisible by --heads {args.heads}")
    if args.train_iters <= args.skip:
        p.error(f"--train-iters {args.train_iters} must exceed --skip {args.skip}")
    return args


def common_flags(a) -> list[str]:
    return ["--num-layers", a.layers, "--hidden-size", a.hidden, "--num-attention-heads", a.heads,
            "--seq-length", a.seq, "--max-position-embeddings", a.seq, "--position-embedding-type", "rope",
            "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
            "--untie-embeddings-and-output-weights", "--micro-batch-size", a.micro_batch,
            "--global-batch-size", a.micro_batch * a.nproc, "--train-iters", a.train_iters,
            "--lr", "3e-4", "--lr-warmup-iters", "0", "--log-interval", "1", "--eval-interval", a.train_iters + 1,
            "--eval-iters", "0", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", a.vocab,
            "--no-progress-bar", "--zero-offload", f"--{a.precision}", "--seed", a.seed]


def arm_flags(a, arm: str) -> list[str]:
    if arm == "dense":
        return ["--ffn-hidden-size", a.topk * a.moe_ffn]
    moe = ["--ffn-hidden-size", a.topk * a.moe_ffn, "--num-experts", a.experts, "--moe-router-topk", a.topk,
           "--moe-ffn-hidden-size", a.moe_ffn, "--moe-aux-loss-coeff", "0.01"]
    if arm == "moe_ep2":
        moe += ["--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall"]
    return moe


def parameter_counts(a, arm: str) -> tuple[int, int]:
    """(total, active): active counts, per MoE layer, the router and top-k of the E experts."""
    sys.path.insert(0, REPO)
    from zo_megatron.model.config import GPTConfig

    kw = dict(num_layers=a.layers, hidden_size=a.hidden, num_attention_heads=a.heads, vocab_size=a.vocab,
              max_position_embeddings=a.seq, position_embedding_type="rope", normalization="RMSNorm",
              swiglu=True, add_bias_linear=False, untie_embeddings_and_output_weights=True,
              ffn_hidden_size=a.topk * a.moe_ffn)
    if arm == "dense":
        n = GPTConfig(**kw).num_parameters()
        return n, n
    cfg = GPTConfig(**kw, num_experts=a.experts, moe_router_topk=a.topk, moe_ffn_hidden_size=a.moe_ffn)
    total = cfg.num_parameters()
    per_expert = 3 * a.hidden * a.moe_ffn                       # SwiGLU fc1 [gate; up] + fc2, no biases
    moe_layers = sum(1 for moe in cfg.moe_layers() if moe)
    return total, total - moe_layers * (a.experts - a.topk) * per_expert


def run_arm(a, arm: str, workdir: str) -> dict:
    log, timeline = os.path.join(workdir, f"{arm}.jsonl"), os.path.join(workdir, f"{arm}.timeline")
    for stale in [log] + [f"{timeline}.rank{r}" for r in range(a.nproc)] + [timeline]:
        if os.path.exists(stale):
            os.remove(stale)
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    cmd = [torchrun, "--standalone", "--nproc-per-node", str(a.nproc), os.path.join(REPO, "pretrain", "pretrain_gpt.py"),
           *map(str, common_flags(a) + arm_flags(a, arm)), "--log-jsonl", log, "--timeline", timeline]
    env = {**os.environ, "ZO_MEGATRON_CACHE": os.path.join(workdir, "cache"), "PYTHONUNBUFFERED": "1"}
    t0 = time.perf_counter()
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if r.returncode:
        tail = (r.stdout + r.stderr).strip().splitlines()[-15:]
        raise SystemExit(f"error: arm {arm} failed (exit {r.returncode}):\n  " + "\n  ".join(tail))
    with open(log) as f:
        rows = [row for row in map(json.loads, f) if row.get("kind") == "train" and row["iteration"] > a.skip]
    return {"rows": rows, "cpu_step_s": cpu_step_per_iteration(timeline, a), "wall_s": time.perf_counter() - t0}


def cpu_step_per_iteration(timeline: str, a) -> dict[int, float]:
    """Rank 0's CPU Adam seconds per iteration: every `cpu_step` phase (one per engine) summed."""
    path = f"{timeline}.rank0" if a.nproc > 1 else timeline
    out: dict[int, float] = {}
    with open(path) as f:
        for row in map(json.loads, f):
            if row["phase"] == "cpu_step" and row["iteration"] > a.skip:
                out[row["iteration"]] = out.get(row["iteration"], 0.0) + row["end"] - row["start"]
    return out


def summarize(a, arm: str, runs: list[dict]) -> dict:
    rows = [r for run in runs for r in run["rows"]]
    step = statistics.median(r["step_time_s"] for r in rows)
    cpu = [s for run in runs for s in run["cpu_step_s"].values()]
    cpu_s = statistics.median(cpu) if cpu else 0.0
    total, active = parameter_counts(a, arm)
    return {"arm": arm, "total_params": total, "active_params": active,
            "median_step_s": step, "min_step_s": min(r["step_time_s"] for r in rows),
            "max_step_s": max(r["step_time_s"] for r in rows),
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in rows),
            "cpu_step_s": cpu_s, "cpu_step_share": cpu_s / step if step else None,
            "host_model_state_bytes": rows[-1]["host_model_state_bytes"],
            "iterations_timed": len(rows), "runs": len(runs),
            "iterations": [{"run": i, "iteration": r["iteration"], "step_time_s": r["step_time_s"],
                            "tokens_per_s": r["tokens_per_s"], "cpu_step_s": run["cpu_step_s"].get(r["iteration"])}
                           for i, run in enumerate(runs) for r in run["rows"]]}


def print_table(rows: list[dict]) -> None:
    print(f"{'arm':<9} {'total':>8} {'active':>8} {'step s':>8} {'tokens/s':>9} {'CPU Adam s':>10} "
          f"{'share':>6} {'host states/rank':>16}")
    for r in rows:
        print(f"{r['arm']:<9} {r['total_params'] / 1e6:>7.2f}M {r['active_params'] / 1e6:>7.2f}M "
              f"{r['median_step_s']:>8.3f} {r['tokens_per_s']:>9.0f} {r['cpu_step_s']:>10.3f} "
              f"{r['cpu_step_share']:>6.1%} {r['host_model_state_bytes'] / 2**20:>13.1f} MiB")


def plot(rows: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    names = [r["arm"] for r in rows]
    cpu = [r["cpu_step_s"] for r in rows]
    rest = [r["median_step_s"] - r["cpu_step_s"] for r in rows]
    ax1.bar(names, rest, label="rest of the step", color="#4c72b0")
    ax1.bar(names, cpu, bottom=rest, label="CPU Adam", color="#dd8452")
    ax1.set_ylabel("median step time (s)")
    ax1.legend()
    ax2.bar(names, [r["tokens_per_s"] for r in rows], color="#55a868")
    ax2.set_ylabel("tokens/s")
    for ax in (ax1, ax2):
        ax.tick_params(axis="x", labelrotation=15)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "unknown")
    except OSError:
        return "unknown"


def main(argv=None) -> int:
    a = parse_args(argv)
    load0 = os.getloadavg()
    print(f"bench_moe: {cpu_name()}, {os.cpu_count()} CPUs, load {load0[0]:.1f}; {a.nproc} ranks, {a.precision}, "
          f"{a.layers} x {a.hidden}, E={a.experts} top-{a.topk} expert FFN {a.moe_ffn} (dense FFN "
          f"{a.topk * a.moe_ffn}), seq {a.seq} x micro-batch {a.micro_batch}, {a.train_iters} iterations "
          f"(first {a.skip} untimed), {a.rounds} round(s)", flush=True)
    runs: dict[str, list[dict]] = {arm: [] for arm in a.arm_list}
    with tempfile.TemporaryDirectory(prefix="bench_moe_") as work:
        for rnd in range(a.rounds):
            for arm in a.arm_list:
                print(f"[round {rnd + 1}/{a.rounds}] {arm} ...", flush=True)
                runs[arm].append(run_arm(a, arm, work))
    rows = [summarize(a, arm, runs[arm]) for arm in a.arm_list]
    print_table(rows)
    load1 = os.getloadavg()
    if a.json:
        meta = {"cpu": cpu_name(), "cpus": os.cpu_count(), "load_before": load0[0], "load_after": load1[0],
                "args": {k: v for k, v in vars(a).items() if k != "arm_list"}}
        with open(a.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
        png = os.path.splitext(a.json)[0] + ".png"
        plot(rows, png, f"MoE E={a.experts} top-{a.topk} vs dense of its active size, {a.nproc} ranks, "
                        f"{a.precision}, {cpu_name()}")
        print(f"wrote {a.json} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
