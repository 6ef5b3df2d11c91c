"""Where a checkpoint lives on disk, and the durable-write helpers every file goes through.

    SAVE/latest_checkpointed_iteration.txt     Megatron's name: the committed iteration
    SAVE/iter_0000100/                         Megatron's name: one committed checkpoint
        .metadata, __<rank>_0.distcp           torch.distributed.checkpoint (tensors, boxes); the
                                               offline tools write __0_<k>.distcp, one per box
        checkpoint.json                        iteration, samples, schedule, layout, args, file sizes
        rng_tp00_dp000.json                    one rank's random streams
    SAVE/iter_0000100.partial/                 a save in progress (or crashed): never loaded

A directory is renamed from .partial only after every file in it is written and fsynced, and
`latest` moves only after that rename is durable.
"""
from __future__ import annotations

import os
import re

LATEST = "latest_checkpointed_iteration.txt"
MANIFEST = "checkpoint.json"
PARTIAL = ".partial"
# checkpoint.json keys from-hf writes that the job's loads and saves carry on (what to-hf writes
# back): the Hugging Face architecture, config.json's bos/eos ids, generation_config.json. (A sliding
# window is the model's own: its architecture fields window_size / window_attn_skip_freq. Older from-hf
# checkpoints recorded it apart as "attention_window": verify.read_manifest reads that into the model.)
CARRIED_KEYS = ("hf_architecture", "hf_config", "hf_generation_config")
_ITER_RE = re.compile(r"^iter_(\d{7,})$")


def iter_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def rng_file(tp_rank: int, dp_rank: int) -> str:
    return f"rng_tp{tp_rank:02d}_dp{dp_rank:03d}.json"


def committed_iterations(root: str) -> list[int]:
    """Iterations with a committed (renamed) directory under root, ascending."""
    out = []
    for name in os.listdir(root) if os.path.isdir(root) else ():
        m = _ITER_RE.match(name)
        if m and os.path.isdir(os.path.join(root, name)):
            out.append(int(m.group(1)))
    return sorted(out)


def stale_dirs(root: str) -> list[str]:
    """Leftovers of interrupted saves: `iter_*.partial` and `iter_*.old` directories."""
    if not os.path.isdir(root):
        return []
    return [os.path.join(root, n) for n in os.listdir(root)
            if n.startswith("iter_") and (n.endswith(PARTIAL) or n.endswith(".old"))]


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durable(path: str, text: str) -> None:
    """Write `text` to path through a temporary file: fsync, rename, fsync the directory."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(os.path.abspath(path)))
