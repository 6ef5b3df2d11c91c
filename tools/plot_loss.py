#!/usr/bin/env python3
"""Loss curves of pretrain_gpt.py runs as a PNG: train and validation loss against iterations and
against tokens, every run overlaid and labelled.

    python tools/plot_loss.py LOG.jsonl [LOG2.jsonl ...] [--output loss.png] [--labels A B ...]

Each LOG is what --log-jsonl wrote. A file may hold several runs (--log-jsonl appends): each run
starts with its "header" record (arguments, versions, git commit, world layout), so a resumed run
is its own labelled curve. Tokens are iterations x global batch x sequence length of that run.
Files from before header records are one run each (no token axis: the batch is unknown).
"""
from __future__ import annotations

import argparse
import json
import os
import sys


def fail(msg: str) -> None:
    print(f"error: {msg}", file=sys.stderr)
    sys.exit(2)


def runs_of(path: str) -> list[dict]:
    """[{header, train: [(iteration, loss)], eval: [(iteration, val_loss)]}] in file order."""
    if not os.path.isfile(path):
        fail(f"{path}: no such file; pass the file given to --log-jsonl")
    runs: list[dict] = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                r = json.loads(line)
            except json.JSONDecodeError:
                fail(f"{path}:{n}: not a JSON line; is this a --log-jsonl file?")
            kind = r.get("kind") if isinstance(r, dict) else None
            if kind == "header" or not runs:
                runs.append({"header": r if kind == "header" else {}, "train": [], "eval": []})
            if kind == "train" and "loss" in r:
                runs[-1]["train"].append((r["iteration"], r["loss"]))
            elif kind == "eval" and "val_loss" in r:
                runs[-1]["eval"].append((r["iteration"], r["val_loss"]))
    runs = [r for r in runs if r["train"] or r["eval"]]
    if not runs:
        fail(f"{path}: no train or eval records")
    return runs


def label_of(path: str, i: int, n: int, header: dict) -> str:
    base = os.path.basename(path)
    name = base if n == 1 else f"{base} run {i + 1}"
    a, w = header.get("args", {}), header.get("world", {})
    bits = []
    if a.get("num_layers"):
        bits.append(f"{a['num_layers']}x{a.get('hidden_size')}")
    if w:
        bits.append(f"TP{w.get('tensor_parallel')}xDP{w.get('data_parallel')}")
    if header.get("git_commit"):
        bits.append(header["git_commit"][:7])
    return f"{name} ({', '.join(bits)})" if bits else name


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Plot train/validation loss of --log-jsonl files.")
    ap.add_argument("logs", nargs="+", metavar="LOG.jsonl")
    ap.add_argument("--output", "-o", default="loss.png")
    ap.add_argument("--labels", nargs="*", default=None, help="one label per run, in order")
    a = ap.parse_args(argv)
    curves = []
    for path in a.logs:
        rs = runs_of(path)
        for i, r in enumerate(rs):
            curves.append((label_of(path, i, len(rs), r["header"]), r))
    if a.labels is not None:
        if len(a.labels) != len(curves):
            fail(f"--labels gives {len(a.labels)} labels for {len(curves)} runs")
        curves = [(lab, r) for lab, (_, r) in zip(a.labels, curves)]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_it, ax_tok) = plt.subplots(1, 2, figsize=(13, 4.8))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for k, (lab, r) in enumerate(curves):
        c = colors[k % len(colors)]
        args = r["header"].get("args", {})
        per_it = (args.get("global_batch_size") or 0) * (args.get("seq_length") or 0)
        for ax, scale in ((ax_it, 1), (ax_tok, per_it)):
            if not scale:
                continue
            if r["train"]:
                x, y = zip(*r["train"])
                ax.plot([i * scale for i in x], y, color=c, lw=1.2, label=f"{lab} train")
            if r["eval"]:
                x, y = zip(*r["eval"])
                ax.plot([i * scale for i in x], y, color=c, lw=0, marker="o", ms=5, label=f"{lab} validation")
    ax_it.set_xlabel("iteration")
    ax_tok.set_xlabel("tokens")
    for ax in (ax_it, ax_tok):
        ax.set_ylabel("loss (nats)")
        ax.grid(alpha=0.3)
    ax_it.legend(fontsize=7)
    if not ax_tok.lines:
        ax_tok.text(0.5, 0.5, "no header record: tokens unknown", ha="center", transform=ax_tok.transAxes)
    fig.suptitle("zo_megatron loss")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(a.output)), exist_ok=True)
    fig.savefig(a.output, dpi=110)
    print(f"wrote {a.output}: {len(curves)} run(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
