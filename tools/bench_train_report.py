"""What tools/bench_train.py makes of the measurements: per-variant rows of one world (medians,
spreads, ratios to zo_offload, FLOPs, the loss and update check: summarize), the printed table and
run header / footer, the JSON file, and the charts (step time per variant; --sweep's step time and
host memory against model size).
"""
from __future__ import annotations

import json
import os

from bench_loss_check import check_losses
from bench_train_common import (HF_VARIANTS, VARIANTS, cpu_model, gpt_params, median, regime_shape,
                                world_name)


# ------------------------------------------------------------------------------------------------
# rows

def _flops_per_step(row, args) -> float:
    """Model FLOPs of one step: Megatron-LM's count (zo_megatron.training.metrics.flops_per_token, the
    one the training log uses) x tokens, with the benchmark's vocabulary as every variant sees it."""
    from zo_megatron.training.metrics import flops_per_token

    return float(flops_per_token(args.layers, args.hidden, row["seq"], args.vocab, None) * row["tokens_per_step"])


def summarize(res: dict, args, cpus: int) -> list[dict]:
    """Per-variant rows with medians, spreads, ratios and the loss check of one world."""
    rows = []
    for r in res["rows"]:
        st = r["step_times_s"]
        tot = st["total"]
        med = median(tot)
        phases = {k: median(v) for k, v in st.items() if k != "total"}
        overhead = median([t - f - b for t, f, b in zip(tot, st["forward"], st["backward"])])
        q = sorted(tot)
        row = dict(r)
        row.update(median_step_s=med, min_step_s=q[0], max_step_s=q[-1],
                   spread_s=(q[-1] - q[0]), tokens_per_s=r["tokens_per_step"] / med,
                   model_tflops=_flops_per_step(r, args) / med / 1e12, phases_s=phases,
                   engine_overhead_s=overhead, threads_per_rank=res["threads"],
                   oversubscribed=r["ranks"] * res["threads"] > cpus,
                   load_average_during=[min(res["load_average_during"]), max(res["load_average_during"])],
                   device=res["device"], device_name=res["device_name"])
        row["params"] = gpt_params(args.layers, args.hidden, args.vocab, r["seq"])
        rows.append(row)
    ref = next((x for x in rows if x["variant"] == "zo_offload"), None)
    for x in rows:
        x["ratio_to_zo_offload"] = x["median_step_s"] / ref["median_step_s"] if ref else None
        x["overhead_ratio_to_zo_offload"] = (x["engine_overhead_s"] / ref["engine_overhead_s"]
                                             if ref and ref["engine_overhead_s"] > 0 else None)
    # loss agreement: every variant that saw the same global batch, against their median
    # groups that saw the same global batches: all variants, except in a TP world, where the HF
    # variants (pure DP over every rank) form their own group
    groups: dict[str, list] = {}
    for x in rows:
        own = x["variant"] in HF_VARIANTS and x["world_tp"] > 1
        groups.setdefault("dpu" if x["variant"].startswith("zo_offload_dpu") else "hf" if own else "all", []).append(x)
    for key, members in groups.items():
        if key == "dpu" or len(members) < 2:
            for x in members:
                if key == "dpu":
                    x["loss_rel_diff"], x["loss_check"] = None, "n/a: DPU's updates are one step stale by design"
                    continue
                x["loss_rel_diff"], x["loss_check"] = None, "n/a: no other variant saw the same batches"
            continue
        check_losses(members, members[0]["precision"])
        if key != "all":
            for x in members:
                x["loss_check"] += (": against the other HF variant only (pure DP over the TP world's ranks: "
                                    "another global batch)")
    for name, why in res.get("skipped", {}).items():
        rows.append(dict(variant=name, skipped=why, world=res["rows"][0]["world"] if res["rows"] else None,
                         precision=rows[0]["precision"] if rows else None,
                         regime=rows[0]["regime"] if rows else None))
    return rows


def fmt_bytes(n) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


_PHASE_ORDER = ("forward", "backward", "grad_sync", "grad_norm", "cpu_adam", "cpu_adam_wait", "cpu_adam_off_path",
                "param_return", "optimizer")


def print_table(rows: list[dict]) -> None:
    head = (f"  {'variant':<18}{'tp':>3}{'dp':>3}{'median':>9}{'min':>8}{'max':>8}{'tok/s':>9}{'TFLOP/s':>9}"
            f"{'x zo_off':>9}{'overhd':>8}{'sent/rank':>11}{'dev state':>11}{'host state':>11}{'loss_after':>12}  check")
    print(head)
    for x in rows:
        if x.get("skipped"):
            print(f"  {x['variant']:<18}  skipped: {x['skipped']}")
            continue
        ratio = f"{x['ratio_to_zo_offload']:.2f}x" if x["ratio_to_zo_offload"] else "-"
        print(f"  {x['variant']:<18}{x['tp']:>3}{x['dp']:>3}{x['median_step_s']:>8.3f}s{x['min_step_s']:>7.3f}s"
              f"{x['max_step_s']:>7.3f}s{x['tokens_per_s']:>9.0f}{x['model_tflops']:>9.4f}{ratio:>9}"
              f"{x['engine_overhead_s']:>7.3f}s{fmt_bytes(x['comm_bytes_per_rank']):>11}"
              f"{fmt_bytes(x['device_state_bytes']):>11}{fmt_bytes(x['host_state_bytes']):>11}"
              f"{x['loss_after']:>12.6f}  {x['loss_check'].split(':')[0]}"
              f"{' (vs the other HF variant)' if 'HF variant only' in x['loss_check'] else ''}")
    print("  phases (medians, s):")
    for x in rows:
        if x.get("skipped"):
            continue
        ph = x["phases_s"]
        print("    " + f"{x['variant']:<18}" + "  ".join(f"{k} {ph[k]:.3f}" for k in _PHASE_ORDER if k in ph))


def plot(rows: list[dict], path: str) -> str | None:
    """Bar chart: one panel per (regime, precision), a bar group per world, a bar per variant."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install matplotlib): no chart"
    ok = [x for x in rows if not x.get("skipped")]
    panels = sorted({(x["regime"], x["precision"]) for x in ok})
    if not panels:
        return "no rows to plot"
    variants = [v for v in VARIANTS if any(x["variant"] == v for x in ok)]
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.2), squeeze=False)
    for ax, (regime, prec) in zip(axes[0], panels):
        worlds = [w for w in dict.fromkeys(x["world"] for x in ok if x["regime"] == regime and x["precision"] == prec)]
        width = 0.8 / max(1, len(variants))
        for j, v in enumerate(variants):
            ys, errs = [], [[], []]
            for w in worlds:
                r = next((x for x in ok if (x["regime"], x["precision"], x["world"], x["variant"]) ==
                          (regime, prec, w, v)), None)
                ys.append(r["median_step_s"] if r else 0.0)
                errs[0].append(r["median_step_s"] - r["min_step_s"] if r else 0.0)
                errs[1].append(r["max_step_s"] - r["median_step_s"] if r else 0.0)
            xs = [i + (j - (len(variants) - 1) / 2) * width for i in range(len(worlds))]
            ax.bar(xs, ys, width, yerr=errs, capsize=2, label=v)
        ax.set_xticks(range(len(worlds)))
        ax.set_xticklabels([f"world {w}" for w in worlds])
        ax.set_ylabel("median step time (s), min-max")
        ax.set_title(f"{regime}, {prec}")
    axes[0][0].legend(fontsize=8)
    fig.suptitle("tools/bench_train.py: step time per variant (lower is better)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None




# ------------------------------------------------------------------------------------------------
# the run: header, one world's header, footer + JSON

def print_header(args, cpus: int, cuda: bool, ds_ok: bool, ds_info: str) -> None:
    import torch

    print(f"bench_train: GPT {args.layers} layers x {args.hidden} hidden x {args.heads} heads, vocab {args.vocab}; "
          f"{args.steps} timed steps per variant after {args.warmup} warm-up, interleaved")
    print(f"  host: {cpu_model()}, {cpus} CPU(s); device: {'CUDA ' + torch.cuda.get_device_name(0) if cuda else 'cpu'};"
          f" torch {torch.__version__}; deepspeed: {ds_info if ds_ok else 'not available'}")
    if not ds_ok:
        print(f"  deepspeed_offload rows are skipped: {ds_info}")


def print_world_header(args, regime: str, prec: str, tp: int, dp: int, cpus: int, cuda: bool) -> None:
    world = tp * dp
    threads = args.threads or max(1, cpus // world)
    shape = regime_shape(args, regime)
    print()
    print(f"== {regime} (seq {shape['seq']}, micro-batch {shape['micro_batch']}), {prec}, world "
          f"{world_name(tp, dp)} (TP={tp} x DP={dp}, {world} rank(s), {threads} thread(s) each)")
    if world * threads > cpus:
        print(f"  NOTE: {world} ranks x {threads} thread(s) on {cpus} CPU(s): OVERSUBSCRIBED -- "
              "the ranks time-share the cores, step times are not a scaling measurement")
    if tp > 1 and any(v in HF_VARIANTS for v in args.variant_list):
        print(f"  NOTE: HF GPT-2 has no TP: torch_ddp / deepspeed_offload run pure DP={world} on the "
              f"same {world} ranks ({tp}x our global batch per step: compare tokens/s; their loss is checked "
              "against each other only)")
    if prec == "bf16" and cuda is False:
        print("  NOTE: bf16 on a CPU without native bf16 (AVX2) is emulated: slow for every variant")


def finish(args, all_rows: list[dict], load_samples: list, wall: float, cpus: int, ds_ok: bool, ds_info: str) -> int:
    """The footer (load, loss mismatches, chart, wall time) and --json; the exit status: 1 on a mismatch."""
    import torch

    loads = [s[0] for s in load_samples]
    print()
    print(f"load average (1 min) during the run: min {min(loads):.2f}, max {max(loads):.2f} on {cpus} CPU(s) "
          "(a shared machine: read the min-max spread before trusting a ratio)")
    bad = [x for x in all_rows if not x.get("skipped") and x["loss_check"].startswith(("DIFFERS", "INCONCLUSIVE"))]
    for x in bad:
        print(f"LOSS MISMATCH: {x['variant']} {x['regime']} {x['precision']} world {x['world']}: "
              f"loss_after {x['loss_after']:.6f}, {x['loss_check']}")
    png = args.plot or (os.path.splitext(args.json)[0] + ".png" if args.json else None)
    if png:
        why = plot(all_rows, png)
        print(f"chart: {png}" if why is None else f"chart not written: {why}")
    print(f"wall time {wall:.0f}s")
    if args.json:
        out = dict(tool="tools/bench_train.py", config={k: v for k, v in vars(args).items()
                                                       if k not in ("world_list",)},
                   cpu_model=cpu_model(), cpus=cpus, torch=torch.__version__,
                   deepspeed=ds_info if ds_ok else None, deepspeed_skip_reason=None if ds_ok else ds_info,
                   load_average_samples=loads, load_average_min_max=[min(loads), max(loads)], wall_s=wall,
                   loss_mismatches=len(bad), rows=all_rows)
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 1 if bad else 0


# ------------------------------------------------------------------------------------------------
# --sweep: cost against model size

def print_sweep_header(variants: list, seq: int, mb: int, avail: int, limit: float, ds_ok: bool, ds_info: str) -> None:
    print(f"bench_train --sweep: {', '.join(variants)}, 1 rank, fp32, seq {seq}, micro-batch {mb}; "
          f"{fmt_bytes(avail)} available -> models up to {limit / 1e6:.0f}M params")
    if not ds_ok:
        print(f"  deepspeed_offload skipped: {ds_info}")


def print_sweep_point(pt: dict) -> None:
    print(f"  {pt['variant']:<18} {pt['params'] / 1e6:8.1f}M params: step {pt['median_step_s'] or float('nan'):.3f}s, "
          f"host RSS after the steps {fmt_bytes(pt['host_rss_after_steps_bytes'])} "
          f"(peak {fmt_bytes(pt['peak_host_rss_bytes'])}, setup included)")


def write_sweep(args, points: list[dict], cpus: int, avail: int) -> None:
    """--sweep's chart (--plot, or the --json path with .png) and JSON."""
    png = args.plot or (os.path.splitext(args.json)[0] + ".png" if args.json else None)
    if png:
        plot_sweep(points, png)
        print(f"chart: {png}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(tool="tools/bench_train.py --sweep", cpus=cpus, cpu_model=cpu_model(),
                           mem_available_bytes=avail, load_average=os.getloadavg(), points=points), f, indent=1)


def plot_sweep(points, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for v in dict.fromkeys(p["variant"] for p in points):
        ps = [p for p in points if p["variant"] == v and p["median_step_s"]]
        a1.plot([p["params"] / 1e6 for p in ps], [p["median_step_s"] for p in ps], "o-", label=v)
        a2.plot([p["params"] / 1e6 for p in ps], [p["host_rss_after_steps_bytes"] / 2**30 for p in ps], "o-",
                 label=v)
    for ax, lab in ((a1, "median step time (s)"), (a2, "host RSS after the steps (GiB)")):
        ax.set_xscale("log")
        ax.set_xlabel("parameters (M)")
        ax.set_ylabel(lab)
        ax.legend()
        ax.grid(alpha=0.3)
    fig.suptitle("tools/bench_train.py --sweep: 1 rank, fp32, seq 32, micro-batch 1")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
