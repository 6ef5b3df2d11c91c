"""DCP planners that declare each rank's pieces of a tensor as boxes of the full tensor.

DCP's default planners accept whole tensors or DTensors. A ZeRO fragment is neither (it is a flat
range of a TP shard, see boxes.py), so these two subclasses of the public planner API declare
the pieces themselves: on save a WriteItem per box (DCP records the boxes as the tensor's chunks
in `.metadata`); on load `create_read_items_for_chunk_list` intersects this rank's boxes with the
saved ones, which is all resharding needs. Loading into a new layout is computing its boxes.
"""
from __future__ import annotations

import os
import signal
from dataclasses import dataclass

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import (LoadPlan, SavePlan, TensorWriteData, WriteItem,
                                                  WriteItemType)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from zo_megatron.checkpoint.boxes import Box


@dataclass
class Piece:
    """One box of tensor `key` (whose full shape is `shape`) and the local tensor holding it."""

    key: str
    shape: tuple[int, ...]
    box: Box
    tensor: torch.Tensor          # sizes == box.sizes; a view into the owner's buffer


class BoxSavePlanner(DefaultSavePlanner):
    def __init__(self, pieces: list[Piece], crash_after_items: int | None = None):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.pieces = {(p.key, p.box.offsets): p for p in pieces}
        self._crash_after = crash_after_items        # test hook: see save.py
        self._written = 0

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator: bool = False) -> None:
        self.state_dict = {}
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> SavePlan:
        items = [WriteItem(index=MetadataIndex(p.key, torch.Size(p.box.offsets)), type=WriteItemType.SHARD,
                           tensor_data=TensorWriteData(
                               chunk=ChunkStorageMetadata(offsets=torch.Size(p.box.offsets),
                                                          sizes=torch.Size(p.box.sizes)),
                               properties=TensorProperties(dtype=p.tensor.dtype), size=torch.Size(p.shape)))
                 for p in self.pieces.values()]
        self.plan = SavePlan(items)
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor:
        if self._crash_after is not None and self._written >= self._crash_after:
            os.kill(os.getpid(), signal.SIGKILL)      # the test hook: die while shards are written
        self._written += 1
        return exact_storage_alias(self.pieces[(write_item.index.fqn, tuple(write_item.index.offset))].tensor)


def exact_storage_alias(t: torch.Tensor) -> torch.Tensor:
    """`t`'s values in a tensor whose storage is exactly its bytes, for DCP to write.

    torch.save of a view writes its whole storage (the owner's flat buffer), so the writer needs a
    tensor with a storage of its own size. A copy would do, but DCP's FileSystemWriter keeps every
    tensor it has resolved for a file until the file is finished (its `tensor_dict`), and with one
    file per rank that is a second copy of every model state: measured +5.6 GiB on a 556M-parameter
    job whose states are 9.1 GiB (docs/memory_planner.md). So a contiguous host piece is aliased:
    a tensor over exactly its bytes (torch.frombuffer of that byte range), sharing them, no copy.
    Safe for the same reason the copy was: nothing writes the states while the job saves. Device
    pieces (and non-contiguous ones) are copied to the host, as DCP would do itself."""
    t = t.detach()
    if t.device.type != "cpu" or not t.is_contiguous():
        return torch.empty(t.shape, dtype=t.dtype, device="cpu").copy_(t)
    if t.untyped_storage().nbytes() == t.nbytes or t.numel() == 0:
        return t
    raw = t.reshape(-1).view(torch.uint8).numpy()     # the piece's bytes, shared (numpy holds no copy)
    return torch.frombuffer(raw, dtype=torch.uint8).view(t.dtype).view(t.shape)


class BoxLoadPlanner(DefaultLoadPlanner):
    def __init__(self, pieces: list[Piece]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.by_key: dict[str, list[Piece]] = {}
        for p in pieces:
            self.by_key.setdefault(p.key, []).append(p)

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        self.state_dict = {}
        self.metadata = metadata
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> LoadPlan:
        items = []
        for key, pieces in self.by_key.items():
            chunks = [ChunkStorageMetadata(offsets=torch.Size(p.box.offsets), sizes=torch.Size(p.box.sizes))
                      for p in pieces]
            items += create_read_items_for_chunk_list(key, self.metadata.state_dict_metadata[key], chunks)
        return LoadPlan(items)

    def load_bytes(self, read_item, value) -> None:
        raise ValueError(f"{read_item.dest_index.fqn}: non-tensor items are refused (they would be unpickled)")

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return self.by_key[index.fqn][index.index].tensor
