"""Reading a checkpoint directory's manifest and checking its files before any tensor is touched.

Shared by the job's loader (load.py) and the offline tools (reader.py): both refuse the same
damaged input with the same one line. What is checked:
  - `latest_checkpointed_iteration.txt` names a committed `iter_XXXXXXX` whose checkpoint.json
    is this format and agrees on the iteration;
  - every file the manifest lists exists with the size written at save;
  - its CRC-32 matches the one computed at save (`checksums`, since format 2; integrity against a
    damaged copy, not a defence against an attacker, which safe_load.py is);
  - `.metadata` holds every tensor asked for, with the expected full shape, completely covered.
"""
from __future__ import annotations

import math
import os
import zlib

from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from zo_megatron.checkpoint.layout import LATEST, MANIFEST, iter_dir
from zo_megatron.checkpoint.safe_load import read_json
from zo_megatron.errors import UserError

FORMAT = "zo_megatron/dcp"
FORMAT_VERSION = 2
_CRC_CHUNK = 16 << 20


def find_latest(root: str) -> int:
    path = os.path.join(root, LATEST)
    if not os.path.exists(path):
        if not os.path.isdir(root):
            raise UserError(f"--load {root}: no such directory; point it at a checkpoint directory")
        raise UserError(f"--load {root}: no {LATEST} there; nothing to resume (drop --load to start fresh)")
    with open(path, "rb") as f:
        raw = f.read(64)
    text = raw.decode("ascii", errors="replace").strip()
    if not text.isdigit():
        raise UserError(f"{path}: expected an iteration number, found {text[:40]!r}; fix or delete the file")
    return int(text)


def read_manifest(root: str, iteration: int | None = None) -> tuple[str, dict]:
    """(iteration directory, checkpoint.json) of `iteration`, default the one `latest` names."""
    if iteration is None:
        iteration = find_latest(root)
        if not os.path.isdir(iter_dir(root, iteration)):
            raise UserError(f"{os.path.join(root, LATEST)} names iteration {iteration} but "
                            f"{iter_dir(root, iteration)} does not exist; point --load at a complete checkpoint")
    d = iter_dir(root, iteration)
    if not os.path.isdir(d):
        have = sorted(int(n[5:]) for n in os.listdir(root) if n.startswith("iter_") and n[5:].isdigit()) \
            if os.path.isdir(root) else []
        raise UserError(f"{d} does not exist: no committed checkpoint of iteration {iteration} under {root} "
                        f"(it holds {', '.join(map(str, have)) or 'none'})")
    manifest = read_json(os.path.join(d, MANIFEST), "checkpoint manifest")
    where = os.path.join(d, MANIFEST)
    if manifest.get("format") != FORMAT or manifest.get("format_version") != FORMAT_VERSION:
        raise UserError(f"{where}: format {manifest.get('format')!r} version {manifest.get('format_version')!r} "
                        f"is not {FORMAT} version {FORMAT_VERSION}; this checkpoint was not written by this release")
    if manifest.get("iteration") != iteration:
        raise UserError(f"{where} holds iteration {manifest.get('iteration')!r}, but the directory is {iteration}")
    return d, _window_into_model(manifest)


def _window_into_model(manifest: dict) -> dict:
    """An older from-hf checkpoint recorded its Hugging Face sliding window beside the model ("attention_window":
    W tokens in `layers`), when the job trained it only where the window does not bind; the window is the
    model's own now (window_size, window_attn_skip_freq: planner/window.py): read into its architecture,
    W tokens being --window-size W-1,0."""
    record, model = manifest.get("attention_window"), manifest.get("model")
    if not isinstance(record, dict) or not isinstance(model, dict) or "window_size" in model:
        return manifest
    from zo_megatron.planner.window import from_hf_window

    size, freq = from_hf_window(int(record["tokens"]), record.get("layers") or [], int(model["num_layers"]))
    model.update(window_size=size, window_attn_skip_freq=freq)
    return manifest


def crc32_file(path: str) -> str:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CRC_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"


def check_files(d: str, manifest: dict, *, checksum_share: tuple[int, int] | None = (0, 1)) -> None:
    """Every listed file exists with its saved size; with checksum_share (i, n) this caller also
    verifies the CRC-32 of every n-th listed file from the i-th (ranks split the reading)."""
    files = manifest.get("files")
    if not isinstance(files, dict) or ".metadata" not in files:
        raise UserError(f"{os.path.join(d, MANIFEST)}: no file list; the checkpoint is incomplete")
    for name, size in files.items():
        if os.path.basename(name) != name:
            raise UserError(f"{os.path.join(d, MANIFEST)}: file name {name!r} is not a plain name")
        path = os.path.join(d, name)
        if not os.path.isfile(path):
            raise UserError(f"{path} is missing: the checkpoint is incomplete (a shard was lost or not copied)")
        actual = os.path.getsize(path)
        if actual != size:
            raise UserError(f"{path} is {'truncated' if actual < size else 'larger than written'} "
                            f"({actual} bytes, {size} written): copy the checkpoint again or load another one")
    sums = manifest.get("checksums") or {}
    if checksum_share is None or not isinstance(sums, dict):
        return
    first, every = checksum_share
    for name in sorted(sums)[first::every]:
        if name not in files:
            raise UserError(f"{os.path.join(d, MANIFEST)}: a checksum for {name!r}, which is not a listed file")
        if crc32_file(os.path.join(d, name)) != sums[name]:
            raise UserError(f"{os.path.join(d, name)}: checksum mismatch (CRC-32 differs from the one written at "
                            "save): the file is damaged; copy the checkpoint again or load another one")


def check_tensors(d: str, md, expected: dict[str, tuple[int, ...]]) -> None:
    """Every key asked for exists with the expected full shape, and its saved boxes cover it."""
    where = os.path.join(d, ".metadata")
    for key, shape in expected.items():
        entry = md.state_dict_metadata.get(key)
        if entry is None:
            raise UserError(f"{where}: no tensor {key!r}; the checkpoint does not hold this model's state")
        if not isinstance(entry, TensorStorageMetadata):
            raise UserError(f"{where}: {key!r} is not a tensor (non-tensor items are refused)")
        if tuple(entry.size) != tuple(shape):
            raise UserError(f"{where}: {key!r} has shape {tuple(entry.size)} in the checkpoint, {tuple(shape)} "
                            "in this model: launch with the model flags the checkpoint was trained with")
        covered = sum(math.prod(c.sizes) for c in entry.chunks)
        if covered != math.prod(shape):
            raise UserError(f"{where}: {key!r} covers {covered} of {math.prod(shape)} elements: shards are missing")
