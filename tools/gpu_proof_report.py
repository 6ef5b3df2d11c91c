"""gpu_proof's report (tools/gpu_proof.py): OUT/gpu_proof.json (written atomically after every phase),
OUT/gpu_proof.md (the tables for docs/gpu.md, every one saying where its figures were measured) and
OUT/gpu_proof.png (step time and phases per schedule)."""
from __future__ import annotations

import json
import os

GiB = 1 << 30


def write_report(out: str, result: dict) -> None:
    with open(os.path.join(out, "gpu_proof.json.partial"), "w") as f:
        json.dump(result, f, indent=1, default=str)
    os.replace(os.path.join(out, "gpu_proof.json.partial"), os.path.join(out, "gpu_proof.json"))
    with open(os.path.join(out, "gpu_proof.md"), "w") as f:
        f.write(markdown(result))


def _pct(v) -> str:
    return "-" if v is None else f"{v:.1%}"


def _gib(b) -> str:
    return "-" if not b else f"{b / GiB:.2f}"


def markdown(r: dict) -> str:
    facts = r["preflight"]["facts"]
    where = r["measured_on"]
    lines = [f"### gpu_proof {r['commit']}, {r['started']}: measured on {where}", "",
             f"Device: {facts.get('device_name', 'none')} ({_gib(facts.get('device_memory_bytes'))} GiB), driver "
             f"{facts.get('nvml') or '-'}, torch {facts.get('torch')} (CUDA {facts.get('cuda') or '-'}, NCCL "
             f"{facts.get('nccl') or '-'}), host {facts.get('cpu_model')} x {facts.get('cpus')} CPUs, "
             f"{_gib(facts.get('host_memory_bytes'))} GiB; tool `tools/gpu_proof.py`.", ""]
    s = r.get("suite")
    if s:
        c = s["counts"]
        lines += [f"Suite: {c['passed']} passed, {c['failed']} failed, {c['error']} errors, {c['skipped']} skipped "
                  f"in {s['seconds']} s (rc {s['returncode']}).", "",
                  "| test | outcome | s | before (docs/gpu.md) |", "|---|---|---|---|"]
        lines += [f"| `{t['id']}` | {t['outcome']}{' (first pass on a GPU)' if t.get('first_gpu_pass') else ''} | "
                  f"{t['seconds']:.1f} | {t.get('before', '-')} |" for t in s["tests"]]
        lines.append("")
        lines += memory_test_table(s.get("measurements") or {})
    rows = [x for x in r.get("sweep", []) if "median_step_s" in x] + ([r["largest"]] if r.get("largest", {}).get(
        "median_step_s") else [])
    if rows:
        lines += ["| run | params | s/step | tokens/s | TFLOP/s | MFU | phases (median s) | NVML peak GiB | plan device GiB "
                  "| host RSS GiB | plan host GiB |", "|---|---|---|---|---|---|---|---|---|---|---|"]
        for x in rows:
            plan = x.get("plan") or {}
            ph = ", ".join(f"{k} {v:.3f}" for k, v in (x.get("phases_median_s") or {}).items())
            lines.append(f"| {x['name']} | {(plan.get('params_total') or 0) / 1e9:.2f}B | {x['median_step_s']:.3f} | "
                         f"{x['tokens_per_s']:,.0f} | {x['tflops_per_rank']:.1f} | "
                         f"{_pct(x.get('mfu'))} | {ph} | {_gib(x.get('nvml_peak_bytes'))} | "
                         f"{_gib(plan.get('device_bytes_per_gpu'))} | {_gib(x.get('host_rss_peak_bytes'))} | "
                         f"{_gib(plan.get('host_bytes_per_node'))} |")
    started = [x for x in rows if any("elapsed_s" in v for v in (x.get("setup_phases") or {}).values())]
    if started:
        lines += ["", "Start-up (s: when each set-up phase ended, from the trainer's start; the launch's wall time "
                  "includes imports, the process group and every iteration):", "",
                  "| run | launch wall | data | model | optimizer |", "|---|---|---|---|---|"]
        for x in started:
            ph = x["setup_phases"]
            lines.append(f"| {x['name']} | {x.get('wall_s', '-')} | " + " | ".join(
                str((ph.get(k) or {}).get("elapsed_s", "-")) for k in ("data", "model", "optimizer")) + " |")
    split_rows = [x for x in rows if x.get("device_memory_split")]
    if split_rows:
        lines += ["", "Where the device memory went (GiB; NVML's job peak = outside the allocator + reserved; reserved = "
                  "allocated + cached; `tools/gpu_proof.py` device_memory_split):", "",
                  "| run | NVML job peak | outside the allocator | plan framework_overhead | reserved peak | allocator "
                  "cache | plan allocator_fragmentation | allocated peak | plan's other lines |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for x in split_rows:
            d = x["device_memory_split"]
            lines.append(f"| {x['name']} | {_gib(d['nvml_job_peak_bytes'])} | {_gib(d['outside_allocator_bytes'])} | "
                         f"{_gib(d['plan_framework_overhead_bytes'])} | {_gib(d['reserved_peak_bytes'])} | "
                         f"{_gib(d['allocator_cache_bytes'])} | {_gib(d['plan_allocator_fragmentation_bytes'])} | "
                         f"{_gib(d['allocated_peak_bytes'])} | {_gib(d['plan_rest_bytes'])} |")
    failed = [x for x in r.get("sweep", []) + [r.get("largest") or {}] if x.get("returncode") not in (0, None)]
    for x in failed:
        lines += ["", f"{x['name']} failed (rc {x['returncode']}):", "```", (x.get("output_tail") or "")[-1500:], "```"]
    return "\n".join(lines) + "\n"


def memory_test_table(measurements: dict) -> list[str]:
    """test_device_memory_stays_within_the_plan's figures (MB), one row per case, failed or not."""
    rows = [(k, v) for k, v in sorted(measurements.items()) if k.startswith("device_memory_") and "error" not in v]
    if not rows:
        return []
    mb = lambda b: "-" if b is None else f"{b / 1e6:,.1f}"       # noqa: E731
    out = ["The device-memory test (MB; NVML: this process on the GPU, context included):", "",
           "| case | NVML process | reserved peak | allocated peak | plan total | plan framework_overhead |",
           "|---|---|---|---|---|---|"]
    for k, v in rows:
        out.append(f"| {k[len('device_memory_'):]} | {mb(v.get('nvml'))} | {mb(v.get('reserved'))} | {mb(v.get('peak'))} | "
                   f"{mb(v.get('planned_total'))} | {mb((v.get('items') or {}).get('framework_overhead'))} |")
    return out + [""]


def plot(out: str, result: dict) -> None:
    rows = [x for x in result.get("sweep", []) if "median_step_s" in x]
    if not rows:
        return
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(8, 4))
    names = [x["name"] for x in rows]
    phases = sorted({k for x in rows for k in (x.get("phases_median_s") or {})})
    for i, x in enumerate(rows):
        ax.bar(i - 0.2, x["median_step_s"], 0.35, color="black", label="step" if i == 0 else None)
        bottom = 0.0
        for j, ph in enumerate(phases):
            v = (x.get("phases_median_s") or {}).get(ph, 0.0)
            ax.bar(i + 0.2, v, 0.35, bottom=bottom, color=plt.cm.tab10(j % 10), label=ph if i == 0 else None)
            bottom += v
    ax.set_xticks(range(len(names)), names, rotation=15)
    ax.set_ylabel("seconds")
    ax.set_title(f"gpu_proof {result['commit']} on {result['measured_on']}", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "gpu_proof.png"), dpi=110)
