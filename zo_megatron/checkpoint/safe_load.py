"""Reading checkpoint files without ever running code from them.

torch.distributed.checkpoint reads `.metadata` with an unrestricted `pickle.load` and non-tensor
items with `torch.load(weights_only=False)`: a planted payload would run on load. Here:
  - `.metadata` goes through an Unpickler that resolves only the classes real DCP metadata holds;
  - tensor data is read by DCP with `torch.load(weights_only=True)` (its default for tensors);
  - we write no non-tensor DCP items (the load planner refuses any), everything else is JSON.
DCP reports failures as CheckpointException, a BaseException: callers catch it explicitly.
"""
from __future__ import annotations

import json
import pickle

import torch
from torch.distributed.checkpoint import FileSystemReader

from zo_megatron.errors import UserError

_DCP_MD = "torch.distributed.checkpoint.metadata"
_DCP_PLAN = "torch.distributed.checkpoint.planner"
_ALLOWED = {
    (_DCP_MD, "Metadata"), (_DCP_MD, "TensorStorageMetadata"), (_DCP_MD, "TensorProperties"),
    (_DCP_MD, "ChunkStorageMetadata"), (_DCP_MD, "MetadataIndex"), (_DCP_MD, "StorageMeta"),
    # Megatron-LM's torch_dist: its non-tensor items, and the save plans megatron-core keeps in the metadata
    (_DCP_MD, "BytesStorageMetadata"), (_DCP_PLAN, "SavePlan"), (_DCP_PLAN, "WriteItem"),
    (_DCP_PLAN, "WriteItemType"), (_DCP_PLAN, "TensorWriteData"), (_DCP_PLAN, "BytesIOWriteData"),
    (_DCP_MD, "_MEM_FORMAT_ENCODING"), ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"), ("torch", "Size"), ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"), ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}: not part of checkpoint metadata")


def read_dcp_metadata(path: str):
    """The DCP Metadata object of checkpoint directory `path`, unpickled with the allow-list."""
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

    file = f"{path}/.metadata"
    try:
        with open(file, "rb") as f:
            md = _MetadataUnpickler(f).load()
    except FileNotFoundError:
        raise UserError(f"{file} is missing: the checkpoint is incomplete; point --load at a complete one") from None
    except Exception as exc:  # noqa: BLE001 - a damaged or hostile pickle raises many types
        raise UserError(f"{file} cannot be read safely ({type(exc).__name__}: {first_line(exc)}); "
                        "the file is corrupt or was tampered with") from None
    if not isinstance(md, Metadata):
        raise UserError(f"{file} does not hold checkpoint metadata (found {type(md).__name__})")
    if getattr(md, "storage_meta", None) is None:
        md.storage_meta = StorageMeta()
    return md


class SafeFileSystemReader(FileSystemReader):
    """DCP's file reader with the metadata read through the allow-list unpickler."""

    def read_metadata(self, *args):     # no **kwargs: DCP then never tries per-rank metadata files
        md = read_dcp_metadata(str(self.path))
        md.storage_meta.load_id = self.load_id
        return md


def read_json(path: str, what: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise UserError(f"{path} is missing: the checkpoint is incomplete; point --load at a complete one") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UserError(f"{path} is not valid JSON ({first_line(exc)}): the {what} is corrupt or was "
                        "tampered with") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: the {what} must be a JSON object, found {type(data).__name__}")
    return data


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:200] if text else type(exc).__name__
