"""Writing outputs of the offline tools: atomically, and zo_megatron checkpoints without a job.

`atomic_output(path)` is the tools' rule for every output (a directory or a file): it is written
under a temporary sibling name and renamed into place only when complete, so an interrupted
conversion never leaves something that looks finished. A non-empty target is refused unless
`force`, and then replaced only at the very end.

`write_checkpoint` produces the same layout as the job's save (layout.py): DCP data, checkpoint.json
with sizes and CRC-32s, RNG files, `latest`. Tensors are declared as boxes -- each parameter split
into the TP shards of the target layout -- and fetched one box at a time while DCP writes. Until a
data file is finished, DCP's FileSystemWriter keeps the last tensor it resolved for every key in
that file (filesystem.py's `tensor_dict`), so with one file for everything the tools held one box
of every parameter at the end: the whole converted checkpoint at TP 1, 1/TP of it otherwise. One
data file per box (DCP's `single_file_per_rank=False`: `__0_<k>.distcp`) holds one box at a time
(tests/test_checkpoint_writer.py). The job's own save writes one file per rank, of aliases
(planner.py).
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import warnings
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from zo_megatron.checkpoint.boxes import Box
from zo_megatron.checkpoint.layout import LATEST, MANIFEST, fsync_dir, iter_dir, write_durable
from zo_megatron.checkpoint.planner import BoxSavePlanner, Piece
from zo_megatron.checkpoint.verify import FORMAT, FORMAT_VERSION, crc32_file
from zo_megatron.data.tokenizer import CHECKPOINT_TOKENIZER_DIR, HF_TOKENIZER_FILES
from zo_megatron.errors import UserError


@contextlib.contextmanager
def atomic_output(path: str, *, force: bool = False, is_dir: bool = True):
    """Yield a temporary path next to `path`; move it to `path` when the block succeeds."""
    path = os.path.abspath(path.rstrip("/"))
    if os.path.exists(path):
        empty_dir = os.path.isdir(path) and not os.listdir(path)
        if not empty_dir and not force:
            raise UserError(f"{path} exists and is not empty: choose a new output path, or pass --force to replace it")
        if os.path.isdir(path) != is_dir and not empty_dir:
            raise UserError(f"{path} is a {'directory' if os.path.isdir(path) else 'file'}: "
                            f"the output must be a {'directory' if is_dir else 'file'}")
    parent = os.path.dirname(path)
    if not os.path.isdir(parent):
        raise UserError(f"{parent} does not exist: create the output's parent directory first")
    tmp = f"{path}.tmp-{os.getpid()}"
    if is_dir:
        os.makedirs(tmp)
    try:
        yield tmp
        if is_dir:
            _fsync_tree(tmp)
        old = f"{path}.old-{os.getpid()}"
        if os.path.exists(path):
            os.replace(path, old)
        os.replace(tmp, path)
        fsync_dir(parent)
        if os.path.isdir(old):
            shutil.rmtree(old, ignore_errors=True)
        elif os.path.exists(old):
            os.remove(old)
    except BaseException:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
        elif os.path.exists(tmp):
            os.remove(tmp)
        raise


def _fsync_tree(root: str) -> None:
    for d, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(d, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(d)


def tree_bytes(root: str) -> tuple[int, int]:
    """(files, bytes) under root, or of a single file."""
    if os.path.isfile(root):
        return 1, os.path.getsize(root)
    n = size = 0
    for d, _, files in os.walk(root):
        for name in files:
            n += 1
            size += os.path.getsize(os.path.join(d, name))
    return n, size


@dataclass(frozen=True)
class TensorSpec:
    """One DCP key to write: its full shape, dtype and the boxes it is stored as."""

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    boxes: tuple[Box, ...]


class _StreamingSavePlanner(BoxSavePlanner):
    """BoxSavePlanner whose pieces are fetched when DCP writes them (DCP then holds each until its
    file is written: one file per box, see the module docstring)."""

    def __init__(self, specs: list[TensorSpec], fetch: Callable[[str, Box], torch.Tensor],
                 progress: Callable[[int, int], None] | None):
        pieces = [Piece(s.key, s.shape, b, torch.empty(b.sizes, dtype=s.dtype, device="meta"))
                  for s in specs for b in s.boxes]
        super().__init__(pieces)
        self._fetch, self._progress, self._total = fetch, progress, len(pieces)

    def resolve_data(self, write_item) -> torch.Tensor:
        p = self.pieces[(write_item.index.fqn, tuple(write_item.index.offset))]
        t = self._fetch(p.key, p.box)
        if tuple(t.shape) != tuple(p.box.sizes):
            raise ValueError(f"{p.key}: fetched {tuple(t.shape)} for a box of {p.box.sizes}")
        self._written += 1
        if self._progress is not None:
            self._progress(self._written, self._total)
        return torch.empty(t.shape, dtype=p.tensor.dtype).copy_(t)


def write_checkpoint(root: str, *, iteration: int, specs: list[TensorSpec],
                     fetch: Callable[[str, Box], torch.Tensor], manifest: dict,
                     rng_files: dict[str, dict] | None = None,
                     progress: Callable[[int, int], None] | None = None,
                     tokenizer_from: str | None = None) -> str:
    """Write checkpoint root/iter_XXXXXXX (+ latest) from `specs`; root must be a fresh directory
    (callers wrap it in atomic_output). `manifest` holds everything but format, iteration, files
    and checksums, which are filled in here. The Hugging Face tokenizer files found in
    `tokenizer_from` go to iter_XXXXXXX/tokenizer/, as the job's saves keep them (listed in the
    manifest's tokenizer_files)."""
    d = iter_dir(root, iteration)
    os.makedirs(d)
    writer = dcp.FileSystemWriter(d, single_file_per_rank=False, sync_files=True, thread_count=1)
    try:
        with warnings.catch_warnings():         # "assuming the intent is to save in a single process"
            warnings.simplefilter("ignore", UserWarning)
            dcp.save({}, storage_writer=writer, planner=_StreamingSavePlanner(specs, fetch, progress), no_dist=True)
    except CheckpointException as exc:          # a BaseException
        failures = list(getattr(exc, "failures", {}).values())
        first = failures[0] if failures else exc
        first = first[0] if isinstance(first, tuple) else first
        if isinstance(first, KeyboardInterrupt):
            raise KeyboardInterrupt from None
        if isinstance(first, OSError):          # disk full, permissions: the user's to fix
            raise UserError(f"writing {d} failed: {type(first).__name__}: {first}") from None
        raise RuntimeError(f"writing {d} failed: {type(first).__name__}: {first}") from None
    for name, state in (rng_files or {}).items():
        write_durable(os.path.join(d, name), json.dumps(state))
    tokenizer = copy_hf_tokenizer(tokenizer_from, os.path.join(d, CHECKPOINT_TOKENIZER_DIR)) if tokenizer_from else []
    if tokenizer:
        manifest = {**manifest, "tokenizer_files": [f"{CHECKPOINT_TOKENIZER_DIR}/{n}" for n in tokenizer]}
    files = {n: os.path.getsize(os.path.join(d, n)) for n in sorted(os.listdir(d)) if os.path.isfile(os.path.join(d, n))}
    full = {**manifest, "format": FORMAT, "format_version": FORMAT_VERSION, "iteration": iteration,
            "files": files, "checksums": {n: crc32_file(os.path.join(d, n)) for n in files}}
    write_durable(os.path.join(d, MANIFEST), json.dumps(full, indent=1, sort_keys=True))
    write_durable(os.path.join(root, LATEST), f"{iteration}\n")
    return d


def copy_hf_tokenizer(src: str, dst: str) -> list[str]:
    """Copy the Hugging Face tokenizer files (data/tokenizer.py's list) found in `src` into `dst`
    (created if any); returns their names. Callers write under atomic_output, which fsyncs them."""
    names = [n for n in HF_TOKENIZER_FILES if os.path.isfile(os.path.join(src, n))]
    if names:
        os.makedirs(dst, exist_ok=True)
        for n in names:
            shutil.copyfile(os.path.join(src, n), os.path.join(dst, n))
    return names
