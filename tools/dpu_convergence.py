#!/usr/bin/env python3
"""Does the delayed parameter update converge like exact updates? Train each way and compare.

    python tools/dpu_convergence.py [--mode demo|long] [--seeds 3] [--precision fp32 ...]
                                    [--dpu-warmup-steps 40] [--mitigation weight-prediction ...]
                                    [--nproc N] [--tensor-parallel N] [--jobs N] [--out-dir docs/img]
                                    [--runs-dir DIR] [--reuse] [-- extra pretrain_gpt.py flags]

Runs pretrain_gpt.py with --zero-offload: with exact updates, with --dpu, and with --dpu plus each
staleness mitigation named by --mitigation (default: every one the job has, MITIGATIONS below;
`--mitigation none` for none), each arm with --seeds seeds (--seed, --seed + 1, ...: the seed sets
the initialisation and the data order, so one seed gives every arm the same start and batches).

  --mode demo   the demo model (4 x 256, seq 256) on the embedded corpus, 300 iterations,
                evaluated every 25 (the tool's mode before issue 37; default; --nproc 2, TP=2).
  --mode long   2 x 128, seq 128, same recipe, 2000 iterations (W=40 is 2% of the run),
                evaluated every 100 (--nproc 1, TP=1: small enough for 2 cores), with a 4096-token
                byte-level BPE trained on the embedded corpus (tools/dpu_report.corpus_tokenizer,
                cached in $ZO_MEGATRON_CACHE/dpu_tokenizers; passed as --tokenizer-type
                HuggingFaceTokenizer --tokenizer-model DIR) instead of GPT-2's 50257 tokens.

Per arm and seed it records, from the job's JSONL (--log-interval 1): the training loss of every
iteration, the validation curve, the loss spikes (tools/dpu_report.py), tokens/s, and the job's own
host and device model-state bytes; and, every 10 updates, ||device weights - exact weights|| /
||last update|| (the engine's debug path ZO_DPU_DIAGNOSTICS, offload/dpu_diagnostics.py; 0 by
construction with exact updates).

Writes under --out-dir, named dpu_convergence[_long][_PRECISION] (PRECISION when --precision is
given: one report per precision): .json (every curve, each arm's mean, spread and gap to exact with
its uncertainty, the diagnostics, the cost: tokens/s relative to exact and to plain DPU, extra host
and device bytes) and .png (loss curves and the weight error, mean over seeds with a min..max band);
in the demo mode at the job's default precision also dpu_timeline.png from plain DPU's first seed.
Each run's log is written while it runs under $ZO_MEGATRON_CACHE/dpu_convergence_live and, once
complete, gzip-compressed into --runs-dir (default docs/img/dpu_runs, committed, so a measurement
outlives the session that ran it): <arm>_seed<N>.jsonl.gz and .diag.jsonl.gz. --reuse reads a
complete log there with the same settings (the tokenizer named by its tokenizer.json's sha256, not
its path) instead of running again, so an interrupted measurement resumes, in another session too.
Exit 0 when the best delayed arm's mean gap is within --tolerance (default 2%) of exact updates in
every precision, 1 otherwise.
"""
from __future__ import annotations

import argparse
import glob
import gzip
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))

import dpu_report  # noqa: E402

# Staleness mitigations of --dpu the job implements: name -> the flags added to --dpu (docs/dpu.md).
MITIGATIONS = {"weight-prediction": ["--dpu-weight-prediction"]}
DEFAULT_LAYOUT = {"demo": (2, 2), "long": (1, 1)}          # (--nproc, --tensor-parallel)
# Complete runs' logs live in git (docs/img/dpu_runs/<report>/), so a measurement of hours that a
# session could not finish resumes in the next one with --reuse; gzip keeps a 2000-iteration log
# to a fraction of its ~1 MB.
DEFAULT_RUNS_DIR = os.path.join(ROOT, "docs", "img", "dpu_runs")
TIMELINE = "dpu_timeline"          # the demo's first dpu run's --timeline files, beside its log


class RunFailed(Exception):
    pass


def mode_flags(mode: str, train_iters: int | None, eval_interval: int | None,
               tokenizer_cache: str | None = None) -> list[str]:
    """pretrain_gpt.py flags of a mode. demo: the job's own demo defaults; long: the same recipe
    spelled out (a model shape given, the demo's defaults no longer apply) and, where the mode
    names a vocabulary, the corpus's own BPE of that size (trained into `tokenizer_cache` once)."""
    m = dpu_report.MODES[mode]
    iters = train_iters or m["train_iters"]
    flags = ["--train-iters", str(iters), "--eval-interval", str(eval_interval or m["eval_interval"]),
             "--log-interval", "1"]
    if mode == "long":
        flags += ["--num-layers", str(m["layers"]), "--hidden-size", str(m["hidden"]),
                  "--num-attention-heads", str(m["heads"]), "--seq-length", str(m["seq"]),
                  "--micro-batch-size", str(m["batch"]), "--lr", "1e-3", "--min-lr", "1e-4",
                  "--lr-warmup-iters", "30", "--lr-decay-style", "cosine", "--weight-decay", "0.1",
                  "--adam-beta2", "0.95", "--eval-iters", "10"]
    if m.get("vocab"):
        flags += ["--tokenizer-type", "HuggingFaceTokenizer",
                  "--tokenizer-model", dpu_report.corpus_tokenizer(m["vocab"], tokenizer_cache)]
    return flags


def canonical_flags(flags: list[str]) -> list[str]:
    """The flags as a log records them: the tokenizer directory (a path on this machine) replaced
    by its tokenizer.json's sha256, so a committed log is recognised in another checkout."""
    out = list(flags)
    if "--tokenizer-model" in out:
        i = out.index("--tokenizer-model") + 1
        out[i] = dpu_report.tokenizer_digest(out[i])
    return out


def read_jsonl(path: str) -> list[dict]:
    """The records of a JSONL log, gzip-compressed (.gz) or not."""
    with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
        return [json.loads(line) for line in f if line.strip()]


def write_gz(rows: list[dict], path: str) -> None:
    """Records as gzip-compressed JSONL, reproducibly (no name or time in the gzip header), renamed
    into place so an interrupted write never leaves a truncated log under the final name."""
    with open(path + ".partial", "wb") as raw:
        with gzip.GzipFile(filename="", mode="wb", fileobj=raw, compresslevel=9, mtime=0) as f:
            f.write("".join(json.dumps(r) + "\n" for r in rows).encode())
    os.replace(path + ".partial", path)


def _complete(log: str, flags: list[str]) -> bool:
    """A log that ran these flags (canonical_flags) to the end (its header's command line, its last
    evaluation)."""
    if not os.path.exists(log):
        return False
    rows = read_jsonl(log)
    heads = [r for r in rows if r.get("kind") == "header"]
    iters = int(flags[flags.index("--train-iters") + 1])
    return (len(heads) == 1 and heads[0].get("argv", flags) == flags
            and any(r.get("kind") == "eval" and r["iteration"] == iters for r in rows))


def run_one(name: str, seed: int, flags: list[str], nproc: int, runs_dir: str, reuse: bool,
            live_dir: str | None = None) -> dict:
    """One arm, one seed: the job (its logs written in `live_dir`, then compressed into `runs_dir`),
    then its curves, diagnostics and cost from the compressed logs."""
    tag = f"{name}_seed{seed}"
    log_gz, diag_gz = os.path.join(runs_dir, f"{tag}.jsonl.gz"), os.path.join(runs_dir, f"{tag}.diag.jsonl.gz")
    live_dir = live_dir or runs_dir
    log, diag = os.path.join(live_dir, f"{tag}.jsonl"), os.path.join(live_dir, f"{tag}.diag.jsonl")
    flags = [*flags, "--seed", str(seed)]
    canon = canonical_flags(flags)
    t0 = time.monotonic()
    if not (reuse and _complete(log_gz, canon)):
        for path in (log, diag, log_gz, diag_gz):
            if os.path.exists(path):
                os.remove(path)
        torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
        cmd = [torchrun, "--standalone", f"--nproc-per-node={nproc}", os.path.join(ROOT, "pretrain", "pretrain_gpt.py"),
               "--zero-offload", "--log-jsonl", log, "--no-progress-bar", *flags]
        env = dict(os.environ)
        if "--dpu" in flags:
            env["ZO_DPU_DIAGNOSTICS"] = f"{diag}:{dpu_report.DIAG_EVERY}"
        print(f"[{tag}] {' '.join(cmd[1:])}", flush=True)
        p = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if p.returncode != 0:
            sys.stderr.write(p.stdout[-3000:] + p.stderr[-3000:])
            raise RunFailed(f"the {tag} run failed (exit {p.returncode}); its output is above")
        rows = read_jsonl(log)
        for r in rows:            # the tool's flags, so --reuse can tell a run of other settings
            if r.get("kind") == "header":
                r["argv"] = canon
        if os.path.exists(diag):  # the diagnostics first: a log without its diagnostics is not complete
            write_gz(read_jsonl(diag), diag_gz)
            os.remove(diag)
        if "--timeline" in flags:     # kept beside the log, so a later --reuse still draws it
            src = flags[flags.index("--timeline") + 1]
            for f in sorted(glob.glob(glob.escape(src) + ".rank*")):
                shutil.copyfile(f, os.path.join(runs_dir, TIMELINE + f[len(src):]))
        write_gz(rows, log_gz)
        os.remove(log)
    rows = read_jsonl(log_gz)
    train = [r for r in rows if r["kind"] == "train"]
    val = [(r["iteration"], r["val_loss"]) for r in rows if r["kind"] == "eval" and r.get("split", "validation") == "validation"]
    weight_error = [(r["update"], r["weight_error"]) for r in read_jsonl(diag_gz)
                    if r["weight_error"] is not None] if os.path.exists(diag_gz) else []
    if "--dpu" not in flags:
        weight_error = [(r["iteration"], 0.0) for r in train if r["iteration"] % dpu_report.DIAG_EVERY == 0]
    warm = int(flags[flags.index("--dpu-warmup-steps") + 1]) if "--dpu-warmup-steps" in flags else 40
    steady = [r for r in train if r["iteration"] > warm + 5] or train
    last = train[-1]
    print(f"[{tag}] {time.monotonic() - t0:.0f} s; final validation loss {val[-1][1]:.4f}", flush=True)
    return {"train": [(r["iteration"], r["loss"]) for r in train], "val": val, "weight_error": weight_error,
            "grad_norm": [(r["iteration"], r["grad_norm"]) for r in train],
            "final_val_loss": val[-1][1], "wall_s": time.monotonic() - t0,
            "median_tokens_per_s": statistics.median(r["tokens_per_s"] for r in steady),
            "median_step_time_s": statistics.median(r["step_time_s"] for r in steady),
            "host_model_state_bytes": last["host_model_state_bytes"],
            "device_model_state_bytes": last["device_model_state_bytes"],
            "host_peak_bytes_max": last.get("host_peak_bytes_max"),
            "spikes": dpu_report.spike_counts([(r["iteration"], r["loss"]) for r in train])}


def cost(runs: dict) -> dict:
    """Per arm: tokens/s (mean over seeds of each run's median after the delay starts), relative to
    exact and to plain DPU, and the model-state bytes it adds to exact's (host and device, as the
    job's accounting counts them) and its measured host peak's difference."""
    def mean(arm, key):
        vals = [r[key] for r in runs[arm].values() if r.get(key) is not None]
        return statistics.fmean(vals) if vals else None

    out = {}
    for arm in runs:
        tps = mean(arm, "median_tokens_per_s")
        row = {"tokens_per_s": tps}
        for ref in ("exact", "dpu"):
            if ref in runs and ref != arm:
                row[f"tokens_per_s_vs_{ref}"] = tps / mean(ref, "median_tokens_per_s")
        if "exact" in runs:
            for key, label in (("host_model_state_bytes", "extra_host_bytes"),
                               ("device_model_state_bytes", "extra_device_bytes"),
                               ("host_peak_bytes_max", "extra_host_peak_bytes")):
                a, e = mean(arm, key), mean("exact", key)
                row[label] = None if a is None or e is None else a - e
        out[arm] = row
    return out


def diagnostics(runs: dict, warmup: int) -> dict:
    """Per arm: the weight error averaged over the delayed updates (mean over seeds) and the loss
    spikes per seed."""
    out = {}
    for arm, by_seed in runs.items():
        errs = [statistics.fmean(v for it, v in r["weight_error"] if it > warmup and v is not None)
                for r in by_seed.values() if any(it > warmup for it, _ in r["weight_error"])]
        out[arm] = {"mean_weight_error_after_warmup": statistics.fmean(errs) if errs else None,
                    "spikes_per_seed": {s: r["spikes"]["total"] for s, r in by_seed.items()}}
    return out


def report(runs: dict, args, precision: str | None, extra: list[str]) -> dict:
    """The JSON of one precision (the keys of the tool before issue 37 kept, now means over seeds)."""
    finals = {arm: {s: r["final_val_loss"] for s, r in by.items()} for arm, by in runs.items()}
    as_issued = args.dpu_warmup_steps == 40 and not args.train_iters and not extra
    summary = dpu_report.summary(finals, args.mode if as_issued else "")
    exact = summary["exact"]["final_val_loss"]["mean"]
    rows = {arm: {"final_val_loss": row["final_val_loss"]["mean"], "relative_gap": row["gap_to_exact"]["gap"],
                  "gap_2sigma": row["gap_to_exact"]["gap_2sigma"]}
            for arm, row in summary.items() if arm != "exact"}
    best = min(rows, key=lambda n: rows[n]["relative_gap"])
    return {"mode": args.mode, "precision": precision or "job default", "seeds": sorted(finals["exact"]),
            "train_iters": runs["exact"][min(runs["exact"])]["train"][-1][0],
            "dpu_warmup_steps": args.dpu_warmup_steps, "nproc": args.nproc, "tensor_parallel": args.tensor_parallel,
            "jobs": args.jobs, "extra_flags": extra, "final_val_loss_exact": exact,
            "final_val_loss_dpu": rows["dpu"]["final_val_loss"], "relative_gap": rows["dpu"]["relative_gap"],
            "delayed_runs": rows, "best": best, "best_relative_gap": rows[best]["relative_gap"],
            "within_tolerance": rows[best]["relative_gap"] <= args.tolerance, "tolerance": args.tolerance,
            "summary": summary, "diagnostics": diagnostics(runs, args.dpu_warmup_steps), "cost": cost(runs),
            "runs": runs}


def _report_json(result: dict) -> str:
    """The report indented, except each run's curves: one line per run (indenting 2000-point curves
    of 9 runs tripled the file to ~2 MB; the numbers are the same)."""
    head = json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=1)
    runs = ",\n".join(f"  {json.dumps(arm)}: {{" + ", ".join(f"{json.dumps(str(s))}: {json.dumps(r, separators=(',', ':'))}"
                                                             for s, r in by.items()) + "}"
                      for arm, by in result["runs"].items())
    return head[:-2] + ',\n "runs": {\n' + runs + "\n }\n}\n"


def _fmt(x) -> str:
    return "n/a" if x is None else f"{x:.3f}"


def _timeline(runs_dir: str, out_dir: str, warmup: int) -> None:
    """dpu_timeline.png from the --timeline files the first seed's dpu run left beside its log."""
    timeline = os.path.join(runs_dir, TIMELINE)
    if not glob.glob(glob.escape(timeline) + ".rank*"):
        print(f"no --timeline of the dpu run in {runs_dir} (a log from before they were kept): "
              f"{os.path.join(out_dir, 'dpu_timeline.png')} not redrawn", flush=True)
        return
    it = warmup + 5
    subprocess.run([sys.executable, os.path.join(ROOT, "tools", "plot_timeline.py"), timeline, "--iterations",
                    f"{it}:{it + 3}", "--out", os.path.join(out_dir, "dpu_timeline.png"),
                    "--title", f"--dpu timeline, iterations {it}-{it + 3}"], check=True)


def _parse(argv):
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=sorted(dpu_report.MODES), default="demo")
    ap.add_argument("--seeds", type=int, default=3, help="seeds per arm (init and data order)")
    ap.add_argument("--seed", type=int, default=1234, help="the first seed")
    ap.add_argument("--precision", action="append", choices=["fp32", "bf16"],
                    help="run every arm in this precision (repeatable; default: the job's own choice)")
    ap.add_argument("--train-iters", type=int, default=None, help="default: the mode's")
    ap.add_argument("--eval-interval", type=int, default=None, help="default: the mode's")
    ap.add_argument("--dpu-warmup-steps", type=int, default=40)
    ap.add_argument("--nproc", type=int, default=None, help="ranks (default: demo 2 as `make demo`, long 1)")
    ap.add_argument("--tensor-parallel", type=int, default=None, help="default: demo 2, long 1")
    ap.add_argument("--out-dir", default="docs/img")
    ap.add_argument("--runs-dir", default=DEFAULT_RUNS_DIR,
                    help="the complete runs' logs, gzip-compressed (default: docs/img/dpu_runs, committed)")
    ap.add_argument("--reuse", action="store_true", help="read a complete log of the same settings instead of running")
    ap.add_argument("--tolerance", type=float, default=0.02, help="relative final validation-loss gap allowed")
    ap.add_argument("--jobs", type=int, default=1,
                    help="runs at once (independent); each uses --nproc processes: use it where the machine has "
                         "cores to spare (tokens/s are then measured under each other's load)")
    ap.add_argument("--mitigation", action="append", choices=[*MITIGATIONS, "none"],
                    help="a --dpu staleness mitigation to run as well (repeatable; default: all of them)")
    args = ap.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    nproc, tp = DEFAULT_LAYOUT[args.mode]
    args.nproc = args.nproc or nproc
    args.tensor_parallel = args.tensor_parallel or tp
    return args, extra


def main(argv=None) -> int:
    args, extra = _parse(sys.argv[1:] if argv is None else argv)
    mitigations = [m for m in (args.mitigation or list(MITIGATIONS)) if m != "none"]
    from zo_megatron.data.corpus import default_cache_dir

    out_ok = True
    for precision in args.precision or [None]:
        base = "dpu_convergence" + ("" if args.mode == "demo" else f"_{args.mode}") + (f"_{precision}" if precision else "")
        runs_dir = os.path.join(args.runs_dir, base)
        live_dir = os.path.join(default_cache_dir(), "dpu_convergence_live", base)
        for d in (runs_dir, live_dir, args.out_dir):
            os.makedirs(d, exist_ok=True)
        common = ["--tensor-parallel", str(args.tensor_parallel),
                  *mode_flags(args.mode, args.train_iters, args.eval_interval),
                  *([f"--{precision}"] if precision else []), *extra]
        dpu_flags = ["--dpu", "--dpu-warmup-steps", str(args.dpu_warmup_steps)]
        plans = {"exact": common, "dpu": [*common, *dpu_flags],
                 **{f"dpu+{m}": [*common, *dpu_flags, *MITIGATIONS[m]] for m in mitigations}}
        seeds = [args.seed + i for i in range(args.seeds)]
        timeline = args.mode == "demo" and precision is None
        with ThreadPoolExecutor(max(1, args.jobs)) as pool:       # seed-major: paired runs finish together
            futures = {(n, s): pool.submit(run_one, n, s, f + (["--timeline", os.path.join(live_dir, "dpu_timeline")]
                                                               if timeline and n == "dpu" and s == seeds[0] else []),
                                           args.nproc, runs_dir, args.reuse, live_dir)
                       for s in seeds for n, f in plans.items()}
            try:
                runs = {n: {s: futures[n, s].result() for s in seeds} for n in plans}
            except RunFailed as e:
                for f in futures.values():
                    f.cancel()
                print(f"error: {e}", file=sys.stderr)
                return 2
        result = report(runs, args, precision, extra)
        with open(os.path.join(args.out_dir, base + ".json"), "w") as f:
            f.write(_report_json(result))
        dpu_report.plot(runs, os.path.join(args.out_dir, base + ".png"),
                        f"DPU vs exact, {args.mode} mode{', ' + precision if precision else ''}", args.dpu_warmup_steps)
        if timeline:
            _timeline(runs_dir, args.out_dir, args.dpu_warmup_steps)
        print(f"final validation loss, {args.mode} mode{', ' + precision if precision else ''} "
              f"({len(seeds)} seeds):")
        print("\n".join(dpu_report.format_summary(result["summary"])))
        for arm, c in result["cost"].items():
            print(f"  {arm:28s} {c['tokens_per_s']:.0f} tokens/s"
                  + "".join(f", x{c[k]:.3f} vs {k.rsplit('_', 1)[1]}" for k in ("tokens_per_s_vs_exact", "tokens_per_s_vs_dpu") if k in c)
                  + (f", +{c['extra_host_bytes'] / 2**20:.1f} MiB host, +{c['extra_device_bytes'] / 2**20:.1f} MiB device"
                     if c.get("extra_host_bytes") is not None else "")
                  + f"; weight error {_fmt(result['diagnostics'][arm]['mean_weight_error_after_warmup'])}")
        print(f"best delayed run: {result['best']}; wrote {args.out_dir}/{base}.json and .png")
        out_ok = out_ok and result["within_tolerance"]
    return 0 if out_ok else 1


if __name__ == "__main__":
    sys.exit(main())
