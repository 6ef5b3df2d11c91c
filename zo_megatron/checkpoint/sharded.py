"""Per-rank checkpoints, written atomically, loaded without running any pickled code.

    SAVE/latest_checkpointed_iteration.txt      (Megatron's name; replaced atomically)
    SAVE/iter_0000100/metadata.json             layout + model shape: what a loader must match
    SAVE/iter_0000100/mp_rank_01_dp_000.pt       this rank's model shard + optimizer partition

Every rank writes into iter_XXXXXXX.partial/; only after all ranks are done does rank 0 rename it
into place and then update the `latest` file, so a crash mid-save never leaves a checkpoint that
looks complete. Files hold only tensors and plain containers and are read with
torch.load(weights_only=True). Loading needs the same TP x DP layout for now; the resharding
tools arrive with the checkpoint issue and read the same per-parameter fragments.
"""
from __future__ import annotations

import json
import os
import shutil

import torch

from zo_megatron.errors import UserError
from zo_megatron.parallel import collectives

LATEST = "latest_checkpointed_iteration.txt"
FORMAT_VERSION = 1


def _iter_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def _rank_file(d: str, tp_rank: int, dp_rank: int) -> str:
    return os.path.join(d, f"mp_rank_{tp_rank:02d}_dp_{dp_rank:03d}.pt")


def _barrier():
    collectives.barrier()


def _atomic_write_text(path: str, text: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_checkpoint(root: str, iteration: int, *, ps, model, optimizer, metadata: dict, consumed_samples: int) -> str:
    final = _iter_dir(root, iteration)
    partial = final + ".partial"
    if ps.rank == 0:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(partial, ignore_errors=True)
        os.makedirs(partial)
    _barrier()
    state = {
        "format_version": FORMAT_VERSION,
        "iteration": iteration,
        "consumed_samples": consumed_samples,
        "optimizer": optimizer.state_dict(),
        "rng": {"torch": torch.get_rng_state()},
    }
    offload = optimizer.holds_master_weights
    # Offload: the fp32 master in the optimizer partition is the truth; DP rank 0 also keeps the
    # 16-bit shard for inference/conversion tools. Baseline: every rank needs its model copy.
    if ps.dp_rank == 0 or not offload:
        state["model"] = {n: p.detach().cpu().clone() for n, p in model.named_parameters()}
    path = _rank_file(partial, ps.tp_rank, ps.dp_rank)
    torch.save(state, path + ".tmp")
    os.replace(path + ".tmp", path)
    _barrier()
    if ps.rank == 0:
        meta = {"format_version": FORMAT_VERSION, "iteration": iteration, "consumed_samples": consumed_samples,
                "tensor_parallel": ps.tp_size, "data_parallel": ps.dp_size, **metadata}
        _atomic_write_text(os.path.join(partial, "metadata.json"), json.dumps(meta, indent=2, sort_keys=True))
        if os.path.exists(final):
            old = final + ".old"
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
            shutil.rmtree(old, ignore_errors=True)
        os.replace(partial, final)
        _atomic_write_text(os.path.join(root, LATEST), f"{iteration}\n")
    _barrier()
    return final


def find_latest(root: str) -> int | None:
    path = os.path.join(root, LATEST)
    if not os.path.exists(path):
        return None
    text = open(path).read().strip()
    if not text.isdigit():
        raise UserError(f"{path}: expected an iteration number, found {text[:40]!r}; fix or delete the file")
    return int(text)


def read_metadata(root: str, iteration: int) -> dict:
    path = os.path.join(_iter_dir(root, iteration), "metadata.json")
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise UserError(f"{path} is missing: the checkpoint is incomplete; point --load at a complete one") from None
    except json.JSONDecodeError as exc:
        raise UserError(f"{path} is corrupt ({exc.msg}); point --load at another checkpoint") from None


def check_compatible(meta: dict, expected: dict, path: str) -> None:
    """Refuse a checkpoint whose model shape or layout differs from this run."""
    diffs = [f"{k}: checkpoint {meta.get(k)!r}, this run {v!r}" for k, v in expected.items() if meta.get(k) != v]
    if diffs:
        raise UserError(f"checkpoint {path} does not match this run ({'; '.join(diffs)}); launch with the "
                        "saved settings (TP/DP resharding lands with the checkpoint tools)")


def load_checkpoint(root: str, *, ps, model, optimizer, expected: dict) -> tuple[int, int]:
    """Restore model, optimizer and RNG; returns (iteration, consumed_samples)."""
    iteration = find_latest(root)
    if iteration is None:
        raise UserError(f"--load {root}: no {LATEST} there; nothing to resume (drop --load to start fresh)")
    d = _iter_dir(root, iteration)
    meta = read_metadata(root, iteration)
    check_compatible(meta, {"tensor_parallel": ps.tp_size, "data_parallel": ps.dp_size, **expected}, d)
    path = _rank_file(d, ps.tp_rank, ps.dp_rank)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise UserError(f"{path} is missing: the checkpoint is incomplete") from None
    except Exception as exc:  # noqa: BLE001 - torch raises many types for a damaged file
        raise UserError(f"{path} cannot be read ({type(exc).__name__}: {str(exc).splitlines()[0][:200]}); "
                        "the file is corrupt or not a zo_megatron checkpoint") from None
    if state.get("format_version") != FORMAT_VERSION:
        raise UserError(f"{path}: checkpoint format {state.get('format_version')} is not {FORMAT_VERSION}")
    if not optimizer.holds_master_weights:
        if "model" not in state:
            raise UserError(f"{path} holds no model weights; it was not written by a baseline run")
        model.load_state_dict(state["model"], strict=True)
    optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["rng"]["torch"])
    return int(state["iteration"]), int(state["consumed_samples"])
