#!/usr/bin/env python3
"""Loss curves of pretrain_gpt.py runs as a PNG: train and validation loss against iterations and
against tokens, every run overlaid and labelled.

    python tools/plot_loss.py LOG.jsonl [LOG2.jsonl ...] [--output loss.png] [--labels A B ...]

Each LOG is what --log-jsonl wrote. A file may hold several runs (--log-jsonl appends): each run
starts with its "header" record (arguments, versions, git commit, world layout), so a resumed run
is its own labelled curve. The token axis is each record's `consumed_tokens` (the job's count, right
across a resume that changed the global batch); logs from before that field fall back to iterations
x global batch x sequence length of the run's header. Files from before header records are one run
each (no token axis: the batch is unknown).
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
    """[{header, train: [(iteration, loss, consumed_tokens)], eval: [(iteration, val_loss, consumed_tokens)]}]
    in file order (consumed_tokens None in logs from before that field)."""
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
                runs[-1]["train"].append((r["iteration"], r["loss"], r.get("consumed_tokens")))
            elif kind == "eval" and "val_loss" in r:
                runs[-1]["eval"].append((r["iteration"], r["val_loss"], r.get("consumed_tokens")))
    runs = [r for r in runs if r["train"] or r["eval"]]
    if not runs:
        fail(f"{path}: no train or eval records")
    return runs


def token_axis(run: dict, kind: str) -> list[int] | None:
    """The x values of a run's `kind` ("train"/"eval") records on the token axis: each record's
    consumed_tokens, else iteration x global batch x sequence length (None: unknown)."""
    recs = run[kind]
    if recs and all(t is not None for _, _, t in recs):
        return [t for _, _, t in recs]
    args = run["header"].get("args", {})
    per_it = (args.get("global_batch_size") or 0) * (args.get("seq_length") or 0)
    return [i * per_it for i, _, _ in recs] if per_it else None


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
        for kind, style in (("train", dict(lw=1.2)), ("eval", dict(lw=0, marker="o", ms=5))):
            if not r[kind]:
                continue
            name = "train" if kind == "train" else "validation"
            y = [v for _, v, _ in r[kind]]
            ax_it.plot([i for i, _, _ in r[kind]], y, color=c, label=f"{lab} {name}", **style)
            x_tok = token_axis(r, kind)
            if x_tok is not None:
                ax_tok.plot(x_tok, y, color=c, label=f"{lab} {name}", **style)
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
