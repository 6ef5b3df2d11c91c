"""Saving a checkpoint so that a crash at any moment leaves the previous one loadable.

DCP writes data files under their final names and `.metadata` last, and re-saving into an
existing directory silently mixes old and new data; atomicity is ours:
  1. rank 0 removes leftovers of interrupted saves and creates a fresh iter_XXXXXXX.partial/;
  2. every rank writes its boxes (DCP, fsynced) and its RNG file (fsynced);
  3. rank 0 copies a Hugging Face tokenizer's files into tokenizer/ (so converters can ship the
     tokenizer the run trained with), writes checkpoint.json (with every file's size and the
     tokenizer_type), fsyncs the directory, renames it to
     iter_XXXXXXX, fsyncs SAVE/, and only then replaces latest_checkpointed_iteration.txt;
  4. with --keep-last K, older committed iterations are removed after that.
A test hook (ZO_MEGATRON_TEST_KILL_SAVE=<point>@<iteration>, point = shards | before_rename |
before_latest) kills the process at one of those moments; unset in normal runs, it costs nothing.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from zo_megatron.checkpoint import content
from zo_megatron.checkpoint.layout import (LATEST, MANIFEST, PARTIAL, committed_iterations, fsync_dir, iter_dir,
                                           rng_file, stale_dirs, write_durable)
from zo_megatron.checkpoint.planner import BoxSavePlanner
from zo_megatron.checkpoint.verify import FORMAT, FORMAT_VERSION, crc32_file
from zo_megatron.data.tokenizer import CHECKPOINT_TOKENIZER_DIR, copy_tokenizer_files
from zo_megatron.parallel import collectives
from zo_megatron.parallel.rng_state import capture_rng_state

KILL_HOOK = "ZO_MEGATRON_TEST_KILL_SAVE"
_POINTS = ("shards", "before_rename", "before_latest")


def _kill_point(iteration: int) -> str | None:
    spec = os.environ.get(KILL_HOOK)
    if not spec:
        return None
    point, _, it = spec.partition("@")
    if point not in _POINTS or not it.isdigit():
        raise ValueError(f"{KILL_HOOK}={spec!r}: expected <{'|'.join(_POINTS)}>@<iteration>")
    return point if int(it) == iteration else None


_CRC_PREFIX = "checksums_rank"


def _collect_checksums(partial: str) -> dict[str, str]:
    """Merge and remove the ranks' checksum files (they are not part of the checkpoint)."""
    out: dict[str, str] = {}
    for name in sorted(os.listdir(partial)):
        if name.startswith(_CRC_PREFIX):
            with open(os.path.join(partial, name)) as f:
                out.update(json.load(f))
            os.remove(os.path.join(partial, name))
    return out


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def json_safe(d: dict) -> dict:
    """The JSON-representable part of a flat dict (the run's arguments): no pickle anywhere."""
    out = {}
    for k, v in d.items():
        try:
            json.dumps(v)
        except (TypeError, ValueError):
            continue
        out[k] = v
    return out


def save_checkpoint(root: str, iteration: int, *, ps, model, optimizer, vocab_size: int, train_state: dict,
                    model_meta: dict, args: dict, keep_last: int | None = None, tokenizer=None) -> str:
    """Write SAVE/iter_XXXXXXX atomically (see the module docstring); collective over all ranks.

    train_state: iteration-independent counters and the LR schedule (consumed_samples,
    consumed_valid_samples, opt_param_scheduler); model_meta: the architecture a loader must
    match; args: the run's flags (stored as JSON); tokenizer: the run's (data/tokenizer.py), whose
    own files, if any, go to tokenizer/."""
    optimizer.flush()                           # a pending delayed update belongs in the checkpoint
    final = iter_dir(root, iteration)
    partial = final + PARTIAL
    kill = _kill_point(iteration)
    with _every_rank_or_none(partial):
        if ps.rank == 0:
            os.makedirs(root, exist_ok=True)
            for d in stale_dirs(root):
                shutil.rmtree(d, ignore_errors=True)
            os.makedirs(partial)
    planner = BoxSavePlanner(content.pieces(model, optimizer, ps, vocab_size, saving=True),
                             crash_after_items=1 if kill == "shards" else None)
    writer = dcp.FileSystemWriter(partial, single_file_per_rank=True, sync_files=True, thread_count=1)
    try:
        dcp.save({}, storage_writer=writer, planner=planner)
    except CheckpointException as exc:          # a BaseException: would escape `except Exception`
        failures = list(getattr(exc, "failures", {}).values())
        first = failures[0] if failures else exc
        first = first[0] if isinstance(first, tuple) else first      # DCP wraps (exception, traceback)
        raise RuntimeError(f"saving {partial} failed: {type(first).__name__}: {first}") from None
    rng_name = rng_file(ps.tp_rank, ps.dp_rank)
    with _every_rank_or_none(partial):
        write_durable(os.path.join(partial, rng_name), json.dumps(capture_rng_state()))
        # Each rank checksums what it wrote (read back from the page cache), so no rank reads it all.
        mine = [n for n in os.listdir(partial) if n.startswith(f"__{ps.rank}_") or n == rng_name]
        write_durable(os.path.join(partial, f"{_CRC_PREFIX}{ps.rank}.json"),
                      json.dumps({n: crc32_file(os.path.join(partial, n)) for n in mine}))
    with _every_rank_or_none(partial):
        if ps.rank == 0:
            manifest = _manifest(partial, iteration, ps=ps, model=model, optimizer=optimizer, vocab_size=vocab_size,
                                 train_state=train_state, model_meta=model_meta, args=args, tokenizer=tokenizer)
            _commit(partial, final, root, iteration, manifest, keep_last, kill)
    return final


@contextlib.contextmanager
def _every_rank_or_none(partial: str):
    """A barrier that carries a file error: the section's file work (rank 0's directories and commit,
    each rank's RNG and checksum files) failing on one rank -- a full disk -- fails the save on every
    rank with that rank's error, as DCP's own write does, instead of the others waiting at the next
    collective until they lose contact."""
    message = None
    try:
        yield
    except OSError as exc:
        message = f"{type(exc).__name__}: {exc}"
    failed = collectives.first_error(message)
    if failed is not None:
        rank, text = failed
        raise RuntimeError(f"saving {partial} failed: rank {rank}: {text}") from None


def _manifest(partial: str, iteration: int, *, ps, model, optimizer, vocab_size: int, train_state: dict,
              model_meta: dict, args: dict, tokenizer) -> dict:
    """Rank 0: what checkpoint.json says of the written directory (layout, optimizer, model, the files'
    sizes and checksums); copies the tokenizer's own files into it first."""
    tokenizer_files = copy_tokenizer_files(tokenizer, os.path.join(partial, CHECKPOINT_TOKENIZER_DIR))
    checksums = _collect_checksums(partial)
    files = {n: os.path.getsize(os.path.join(partial, n)) for n in sorted(os.listdir(partial))
             if os.path.isfile(os.path.join(partial, n))}
    checksums[".metadata"] = crc32_file(os.path.join(partial, ".metadata"))
    manifest = {
        "format": FORMAT, "format_version": FORMAT_VERSION, "iteration": iteration, **train_state,
        "layout": {"tensor_parallel": ps.tp_size, "data_parallel": ps.dp_size,
                   **({"expert_parallel": ps.ep_size} if getattr(ps, "ep_size", 1) > 1 else {}),
                   **({"expert_tensor_parallel": ps.etp_size} if getattr(ps, "experts_apart", False)
                      and ps.etp_size != ps.tp_size else {})},
        "optimizer": {"kind": content.optimizer_kind(optimizer), "step": int(optimizer.step_count),
                      "loss_scaler": optimizer.loss_scaler.state_dict()},
        "model": model_meta, "params": content.full_shapes(model, ps.tp_rank, ps.tp_size, vocab_size),
        "args": json_safe(args), "files": files, "checksums": checksums,
        "tokenizer_type": getattr(tokenizer, "tokenizer_type", None),
        "tokenizer_fingerprint": getattr(tokenizer, "fingerprint", None),
        **(getattr(model, "checkpoint_carried", None) or {}),     # from the checkpoint it loaded (load.py)
    }
    if tokenizer_files:
        manifest["tokenizer_files"] = [f"{CHECKPOINT_TOKENIZER_DIR}/{n}" for n in tokenizer_files]
    return manifest


def _commit(partial: str, final: str, root: str, iteration: int, manifest: dict, keep_last: int | None,
            kill: str | None) -> None:
    """Rank 0: the manifest, then the rename and `latest` (each durable before the next), then the
    checkpoints past --keep-last go."""
    write_durable(os.path.join(partial, MANIFEST), json.dumps(manifest, indent=1, sort_keys=True))
    fsync_dir(partial)
    if kill == "before_rename":
        _die()
    if os.path.exists(final):               # an uncommitted leftover (latest never reached it)
        os.replace(final, final + ".old")
    os.replace(partial, final)
    fsync_dir(root)
    if kill == "before_latest":
        _die()
    write_durable(os.path.join(root, LATEST), f"{iteration}\n")
    shutil.rmtree(final + ".old", ignore_errors=True)
    if keep_last:
        # the K newest up to this one; newer directories belong to an abandoned run: left alone
        for old in [i for i in committed_iterations(root) if i <= iteration][:-keep_last]:
            shutil.rmtree(iter_dir(root, old), ignore_errors=True)
