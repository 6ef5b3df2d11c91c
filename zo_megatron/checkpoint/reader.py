"""Reading a checkpoint outside a job, one process, no torch.distributed: the conversion tools' reader.

The tensors are DCP keys over FULL (TP-merged, unpadded) tensors (content.py), so reading a key,
or any box of it, is one `dcp.load` with the same box planner the job uses: a TP shard of a
layout the checkpoint was never saved at is just another box. The files are checked exactly as
the job checks them (verify.py: sizes, CRC-32, shapes) before anything is read.
"""
from __future__ import annotations

import math
import os
import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from zo_megatron.checkpoint.boxes import Box
from zo_megatron.checkpoint.content import EXP_AVG, EXP_AVG_SQ, MODEL
from zo_megatron.checkpoint.planner import BoxLoadPlanner, Piece
from zo_megatron.checkpoint.safe_load import SafeFileSystemReader, first_line, read_dcp_metadata, read_json
from zo_megatron.checkpoint.verify import check_files, check_tensors, read_manifest
from zo_megatron.errors import UserError
from zo_megatron.model.config import complete_arch_meta


class CheckpointReader:
    """One committed iteration of a zo_megatron checkpoint, checked on open."""

    def __init__(self, root: str, iteration: int | None = None, *, verify_checksums: bool = True):
        self.root = root
        self.dir, self.manifest = read_manifest(root, iteration)
        check_files(self.dir, self.manifest, checksum_share=(0, 1) if verify_checksums else None)
        self.metadata = read_dcp_metadata(self.dir)
        params = self.manifest.get("params")
        if not isinstance(params, dict) or not params:
            raise UserError(f"{os.path.join(self.dir, 'checkpoint.json')}: no parameter list; the checkpoint is incomplete")
        self.shapes: dict[str, tuple[int, ...]] = {k: tuple(v) for k, v in params.items()}
        check_tensors(self.dir, self.metadata, {MODEL + k: s for k, s in self.shapes.items()})

    # ---- what it is
    @property
    def iteration(self) -> int:
        return int(self.manifest["iteration"])

    @property
    def layout(self) -> tuple[int, int]:
        lay = self.manifest.get("layout", {})
        return int(lay.get("tensor_parallel", 1)), int(lay.get("data_parallel", 1))

    @property
    def model_meta(self) -> dict:
        """The recorded architecture, every ARCH_FIELDS field (older checkpoints: GPT-2's values)."""
        return complete_arch_meta(self.manifest.get("model", {}), self.manifest.get("args", {}))

    @property
    def args(self) -> dict:
        return dict(self.manifest.get("args", {}))

    @property
    def has_optimizer_state(self) -> bool:
        keys = self.metadata.state_dict_metadata
        return all(EXP_AVG + k in keys and EXP_AVG_SQ + k in keys for k in self.shapes)

    def num_parameters(self) -> int:
        return sum(math.prod(s) for s in self.shapes.values())

    def dtype(self, key: str) -> torch.dtype:
        return self._entry(key).properties.dtype

    def describe(self) -> str:
        tp, dp = self.layout
        if self.manifest.get("weights_only"):
            origin = f"converted from {self.manifest.get('converted_from')}, stored at TP{tp}"
        else:
            origin = f"saved at TP{tp} x DP{dp} by the {self.manifest.get('optimizer', {}).get('kind', '?')} optimizer"
        state = "weights and optimizer state" if self.has_optimizer_state else "weights only"
        return (f"read {self.dir}: iteration {self.iteration}, {origin}, {self.num_parameters():,} parameters "
                f"({state})")

    # ---- reading
    def _entry(self, key: str):
        """The saved tensor's metadata (size, dtype); a key the checkpoint lacks is one UserError."""
        entry = self.metadata.state_dict_metadata.get(key)
        if entry is None:
            raise UserError(f"{os.path.join(self.dir, '.metadata')}: no tensor {key!r}; the checkpoint does "
                            "not hold it (weights-only checkpoints have no optimizer state)")
        return entry

    def read_boxes(self, wanted: list[tuple[str, Box]]) -> list[torch.Tensor]:
        """The tensors of `wanted` (key, box of the full tensor), in their saved dtypes."""
        pieces = []
        for key, box in wanted:
            entry = self._entry(key)
            pieces.append(Piece(key, tuple(entry.size), box, torch.empty(box.sizes, dtype=entry.properties.dtype)))
        try:
            with warnings.catch_warnings():       # "assuming the intent is to load in a single process"
                warnings.simplefilter("ignore", UserWarning)
                dcp.load({}, storage_reader=SafeFileSystemReader(self.dir), planner=BoxLoadPlanner(pieces),
                         no_dist=True)
        except CheckpointException as exc:      # a BaseException
            failures = list(getattr(exc, "failures", {}).values())
            first = failures[0] if failures else exc
            raise UserError(f"{self.dir}: reading the tensors failed ({type(first).__name__}: {first_line(first)}); "
                            "a data file is corrupt or was tampered with") from None
        return [p.tensor for p in pieces]

    def read_full(self, keys: list[str]) -> dict[str, torch.Tensor]:
        sizes = [tuple(self._entry(k).size) for k in keys]
        return dict(zip(keys, self.read_boxes([(k, Box((0,) * len(s), s, 0)) for k, s in zip(keys, sizes)])))

    def read_weights(self, names: list[str] | None = None) -> dict[str, torch.Tensor]:
        """fp32 master weights by parameter name (full, unpadded)."""
        names = list(self.shapes) if names is None else names
        got = self.read_full([MODEL + n for n in names])
        return {n: got[MODEL + n] for n in names}

    def rng_file(self, name: str) -> dict | None:
        path = os.path.join(self.dir, name)
        return read_json(path, "RNG state") if name in self.manifest.get("files", {}) else None
