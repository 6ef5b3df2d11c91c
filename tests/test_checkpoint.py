"""Checkpoint format pieces in one process: flat ranges as boxes, the DCP planners resharding
them, and the metadata unpickler's allow-list."""
import math
import pickle
import random

import numpy as np
import pytest
import torch

from tests.seeds import fresh_seed
from zo_megatron.checkpoint.boxes import flat_range_boxes
from zo_megatron.checkpoint.planner import BoxLoadPlanner, BoxSavePlanner, Piece
from zo_megatron.checkpoint.safe_load import SafeFileSystemReader, read_dcp_metadata
from zo_megatron.errors import UserError


def test_flat_ranges_become_at_most_2ndim_minus_1_boxes_covering_exactly_the_range():
    rng = random.Random(fresh_seed("boxes"))
    for _ in range(300):
        shape = tuple(rng.randint(1, 6) for _ in range(rng.randint(1, 4)))
        n = math.prod(shape)
        s = rng.randint(0, n)
        e = rng.randint(s, n)
        boxes = flat_range_boxes(shape, s, e)
        assert len(boxes) <= 2 * (len(shape) - 1) + 1
        flat_ids = np.arange(n).reshape(shape)          # independent: numpy's own row-major numbering
        covered = np.zeros(n, dtype=np.int64)
        expect_start = 0
        for b in boxes:
            ids = flat_ids[tuple(slice(o, o + z) for o, z in zip(b.offsets, b.sizes))].reshape(-1)
            # each box is the contiguous run [s + flat_start, s + flat_start + numel)
            assert b.flat_start == expect_start
            np.testing.assert_array_equal(ids, np.arange(s + b.flat_start, s + b.flat_start + b.numel))
            covered[ids] += 1
            expect_start += b.numel
        want = np.zeros(n, dtype=np.int64)
        want[s:e] = 1
        np.testing.assert_array_equal(covered, want)


def _pieces(key, full, cuts, dest=None):
    """Split `full` into flat ranges at `cuts`; each range's boxes, viewing `dest` (or a copy)."""
    out = []
    flat = (full if dest is None else dest).reshape(-1)
    for s, e in zip(cuts[:-1], cuts[1:]):
        for b in flat_range_boxes(tuple(full.shape), s, e):
            out.append(Piece(key, tuple(full.shape), b, flat[s + b.flat_start:s + b.flat_start + b.numel].view(b.sizes)))
    return out


def test_dcp_planners_load_fragments_saved_at_one_partition_into_another(tmp_path):
    import torch.distributed.checkpoint as dcp

    g = torch.Generator().manual_seed(fresh_seed("dcp boxes"))
    a = torch.randn(7, 5, 3, generator=g)
    b = torch.randn(11, 4, generator=g).to(torch.bfloat16)
    saved = _pieces("a", a, [0, 17, 40, 41, a.numel()]) + _pieces("b", b, [0, 9, b.numel()])
    dcp.save({}, storage_writer=dcp.FileSystemWriter(str(tmp_path)), planner=BoxSavePlanner(saved), no_dist=True)
    a2, b2 = torch.zeros_like(a), torch.zeros_like(b)
    # another partition, and a piece left out: those elements must stay untouched
    target = _pieces("a", a, [0, 3, 64, 100], a2) + _pieces("b", b, [5, 30], b2)
    dcp.load({}, storage_reader=SafeFileSystemReader(str(tmp_path)), planner=BoxLoadPlanner(target), no_dist=True)
    assert torch.equal(a2.reshape(-1)[:100], a.reshape(-1)[:100]) and not a2.reshape(-1)[100:].any()
    assert torch.equal(b2.reshape(-1)[5:30], b.reshape(-1)[5:30])
    assert not b2.reshape(-1)[:5].any() and not b2.reshape(-1)[30:].any()


class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_metadata_unpickler_refuses_anything_but_checkpoint_metadata(tmp_path):
    import torch.distributed.checkpoint as dcp

    t = torch.arange(6.0).view(2, 3)
    dcp.save({}, storage_writer=dcp.FileSystemWriter(str(tmp_path)),
             planner=BoxSavePlanner(_pieces("t", t, [0, 6])), no_dist=True)
    md = read_dcp_metadata(str(tmp_path))                  # real metadata passes the allow-list
    assert tuple(md.state_dict_metadata["t"].size) == (2, 3)
    marker = tmp_path / "ran"
    (tmp_path / ".metadata").write_bytes(pickle.dumps(_Payload(str(marker))))
    with pytest.raises(UserError, match="cannot be read safely") as exc:
        read_dcp_metadata(str(tmp_path))
    assert "\n" not in str(exc.value) and not marker.exists()
