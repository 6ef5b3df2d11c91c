#!/usr/bin/env python
"""Checkpoint save/load time of the DCP format against plain torch.save/torch.load, one process.

The state is what one rank of the offload engine checkpoints: fp32 master, exp_avg, exp_avg_sq of
a GPT-2-shaped model (TP=1, DP=1: every parameter is one fragment), built directly on host
buffers so that ~1B parameters fit a 24 GiB machine (12 GB of state, loaded back into the same
buffers; the engine's other buffers are not needed to measure the format). Both formats write the same bytes to the same disk, fsync
included. Loads read through a warm page cache (the files were just written; dropping the cache
would slow everyone else on a shared machine), so they measure the format's CPU cost, not the disk.

    python tools/bench_checkpoint.py --layers 4 --hidden 256            # the demo model
    python tools/bench_checkpoint.py --layers 18 --hidden 2048          # ~1.0B parameters
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402


def gpt_shapes(layers: int, h: int, vocab: int = 50257, seq: int = 1024) -> list[tuple[str, tuple]]:
    out = [("embedding.word_embeddings.weight", (vocab, h)), ("embedding.position_embeddings.weight", (seq, h))]
    for i in range(layers):
        p = f"decoder.layers.{i}."
        out += [(p + "ln1.weight", (h,)), (p + "ln1.bias", (h,)), (p + "qkv.weight", (3 * h, h)),
                (p + "qkv.bias", (3 * h,)), (p + "proj.weight", (h, h)), (p + "proj.bias", (h,)),
                (p + "ln2.weight", (h,)), (p + "ln2.bias", (h,)), (p + "fc1.weight", (4 * h, h)),
                (p + "fc1.bias", (4 * h,)), (p + "fc2.weight", (h, 4 * h)), (p + "fc2.bias", (h,))]
    return out + [("final_ln.weight", (h,)), ("final_ln.bias", (h,))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    a = ap.parse_args()
    import torch.distributed.checkpoint as dcp

    from zo_megatron.checkpoint.boxes import flat_range_boxes
    from zo_megatron.checkpoint.planner import BoxLoadPlanner, BoxSavePlanner, Piece
    from zo_megatron.checkpoint.safe_load import SafeFileSystemReader

    shapes = gpt_shapes(a.layers, a.hidden)
    n = sum(torch.Size(s).numel() for _, s in shapes)
    bufs = {k: torch.rand(n) for k in ("model", "exp_avg", "exp_avg_sq")}

    def pieces(dest):
        out, off = [], 0
        for name, shape in shapes:
            k = torch.Size(shape).numel()
            for b in flat_range_boxes(shape, 0, k):
                for key, buf in dest.items():
                    out.append(Piece(f"{key}/{name}", shape, b, buf[off + b.flat_start:off + b.flat_start + b.numel].view(b.sizes)))
            off += k
        return out

    root = a.dir or tempfile.mkdtemp(prefix="bench_ckpt_")
    gb = 3 * n * 4 / 1e9
    print(f"{n / 1e6:.1f}M parameters, {gb:.2f} GB of fp32 state (master + 2 moments) in {root}")
    rows = []
    d = os.path.join(root, "dcp")
    t = time.perf_counter()
    dcp.save({}, storage_writer=dcp.FileSystemWriter(d, single_file_per_rank=True, sync_files=True),
             planner=BoxSavePlanner(pieces(bufs)), no_dist=True)
    rows.append(("dcp save", time.perf_counter() - t))
    p = os.path.join(root, "plain.pt")
    t = time.perf_counter()
    with open(p, "wb") as f:
        torch.save(bufs, f)
        f.flush()
        os.fsync(f.fileno())
    rows.append(("torch.save", time.perf_counter() - t))
    # Load back into the same buffers (one copy of the state in memory: 1B parameters fit 24 GiB).
    sums = {k: v.double().sum().item() for k, v in bufs.items()}
    for v in bufs.values():
        v.zero_()
    t = time.perf_counter()
    dcp.load({}, storage_reader=SafeFileSystemReader(d), planner=BoxLoadPlanner(pieces(bufs)), no_dist=True)
    rows.append(("dcp load", time.perf_counter() - t))
    assert all(v.double().sum().item() == sums[k] for k, v in bufs.items())
    del bufs
    t = time.perf_counter()
    torch.load(p, weights_only=True)
    rows.append(("torch.load", time.perf_counter() - t))
    base = dict(rows)
    for name, s in rows:
        ref = base["torch.save"] if "save" in name else base["torch.load"]
        print(f"  {name:11s} {s:8.2f} s  {gb / s:6.2f} GB/s  x{s / ref:.2f} of torch")
    if a.dir is None:
        shutil.rmtree(root)


if __name__ == "__main__":
    main()
