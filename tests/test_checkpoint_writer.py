"""The offline tools' checkpoint writer holds about one box at a time, not a whole data file.

Until a data file is done, DCP's FileSystemWriter keeps the last tensor it resolved for every key
in it; the tools wrote one file for everything, so a conversion held one box of every parameter at
the end (the whole converted checkpoint at TP 1: a 70B model in fp32 is 280 GB). Each box now gets
its own data file; the old writer fails this test (it held one box per key plus the one being
written).
"""
from __future__ import annotations

import os
import warnings

import torch
import torch.distributed.checkpoint as dcp

from torch.multiprocessing.reductions import StorageWeakRef

from tests.seeds import fresh_seed
from zo_megatron.checkpoint import writer
from zo_megatron.checkpoint.boxes import flat_range_boxes
from zo_megatron.checkpoint.writer import TensorSpec, write_checkpoint


def _specs_and_tensors(seed: int):
    gen = torch.Generator().manual_seed(seed)
    tensors, specs = {}, []
    for i, shape in enumerate([(24, 16), (40,), (8, 8, 6), (33, 7), (5, 9), (64,)]):
        t = torch.randn(shape, generator=gen)
        n = t.numel()
        cuts = sorted({0, n, *torch.randint(1, n, (2,), generator=gen).tolist()})
        boxes = tuple(b for s, e in zip(cuts, cuts[1:]) for b in flat_range_boxes(shape, s, e))
        tensors[f"model.p{i}"] = t
        specs.append(TensorSpec(f"model.p{i}", shape, torch.float32, boxes))
    return specs, tensors


def test_the_writer_holds_one_box_at_a_time_and_writes_every_element(tmp_path, monkeypatch):
    seed = fresh_seed("checkpoint writer")
    specs, tensors = _specs_and_tensors(seed)
    n_boxes = sum(len(s.boxes) for s in specs)
    resolved, most = [], [0]

    class Counting(writer._StreamingSavePlanner):
        """Counts the resolved boxes whose memory is still alive whenever DCP asks for the next one."""

        def resolve_data(self, write_item):
            t = super().resolve_data(write_item)
            resolved.append(StorageWeakRef(t.untyped_storage()))
            most[0] = max(most[0], sum(not r.expired() for r in resolved))
            return t

    monkeypatch.setattr(writer, "_StreamingSavePlanner", Counting)

    def fetch(key, box):
        t = tensors[key]
        for axis, (o, n) in enumerate(zip(box.offsets, box.sizes)):
            t = t.narrow(axis, o, n)
        return t

    d = write_checkpoint(str(tmp_path / "ck"), iteration=0, specs=specs, fetch=fetch, manifest={})
    assert n_boxes >= 8
    assert most[0] <= 2, f"DCP held {most[0]} of {n_boxes} boxes at once"
    data_files = [n for n in os.listdir(d) if n.endswith(".distcp")]
    assert len(data_files) == n_boxes, data_files
    got = {k: torch.full(t.shape, float("nan")) for k, t in tensors.items()}
    with warnings.catch_warnings():         # "assuming the intent is to load in a single process"
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(got, storage_reader=dcp.FileSystemReader(d), no_dist=True)
    for k, t in tensors.items():
        assert torch.equal(got[k], t), k
