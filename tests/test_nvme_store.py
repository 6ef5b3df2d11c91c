"""The NVMe tier's state store (offload/nvme_store.py), against plain tensors in memory: the chunk
plan only cuts where the CPU Adam may cut, passes through the ring (any depth, any chunk order)
read and write back exactly what an in-memory update gives, every element; one job per directory
(the lock), a killed run's files reclaimed, a disk too small refused before anything is written, a
disk that fills mid-pass and a file changed between passes are one-line errors, never a hang."""
import errno
import os
import random

import pytest
import torch

from tests.seeds import fresh_seed
from zo_megatron.errors import ConfigError, UserError
from zo_megatron.offload import nvme_io, nvme_store
from zo_megatron.offload.nvme_io import StateFileError
from zo_megatron.offload.nvme_store import KERNEL_CUT, NvmeConfig, NvmeStateStore, plan_chunks

DTYPES = {"master": torch.float32, "exp_avg": torch.bfloat16, "exp_avg_sq": torch.bfloat16}


def _segments(rng, total):
    cuts = sorted(rng.sample(range(1, total), rng.randint(0, min(12, total - 1))))
    bounds = [0, *cuts, total]
    return [(a, b) for a, b in zip(bounds, bounds[1:])]


def test_chunk_cuts_lie_where_the_kernel_may_cut():
    rng = random.Random(fresh_seed("nvme chunk plan"))
    for _ in range(200):
        total = rng.randint(1, 5000)
        segs = _segments(rng, total)
        size = KERNEL_CUT * rng.randint(1, 20)
        chunks = plan_chunks(segs, total, size)
        assert chunks[0][0] == 0 and chunks[-1][1] == total
        assert all(a[1] == b[0] for a, b in zip(chunks, chunks[1:]))
        for a, b in chunks:
            assert 0 < b - a <= size
            seg = next((x for x in segs if x[0] < b < x[1]), None)         # the segment a cut falls inside
            assert seg is None or (b - seg[0]) % KERNEL_CUT == 0, (segs, size, chunks)
    with pytest.raises(ValueError, match="end to end"):
        plan_chunks([(0, 5), (6, 10)], 10, 64)


def _store(tmp_path, segs, total, tag="t", **kw):
    cfg = NvmeConfig(str(tmp_path), **kw)
    return NvmeStateStore.open_on_every_rank(cfg, tag, segs, total, DTYPES)


@pytest.mark.parametrize("depth", [1, 2, 4])
def test_passes_through_the_ring_equal_the_same_updates_in_memory(tmp_path, depth):
    seed = fresh_seed(f"nvme store passes depth {depth}")
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    total = rng.randint(3000, 9000)
    segs = _segments(rng, total)
    ref = {k: torch.randn(total, generator=gen).to(dt) for k, dt in DTYPES.items()}
    store = _store(tmp_path, segs, total, buffer_count=depth, buffer_size=KERNEL_CUT * rng.randint(3, 12),
                   io_threads=rng.randint(1, 3), block_bytes=4096)
    try:
        assert len(store.chunks) > depth
        store.fill(lambda a, b, v: [v[k].copy_(ref[k][a:b]) for k in v])
        for p in range(6):                                   # in order, then a shuffled subset: a chunk's
            ids = list(range(len(store.chunks)))             # write behind may still be in flight
            if p == 0:                                       # writes landed: prefetch fills the whole ring
                store.drain()
                store.prefetch()
                assert store.prefetched_chunks == min(depth, len(store.chunks))
            elif rng.random() < 0.6:
                store.prefetch()                             # reads started early (backward), used or dropped
            if p % 2:
                rng.shuffle(ids)
                ids = ids[:rng.randint(1, len(ids))]
            for a, b, v in store.stream(None if p % 2 == 0 else ids):
                for k, t in v.items():
                    assert torch.equal(t, ref[k][a:b]), (p, k, a, b)
                    t.mul_(1.5).add_(p)
                    ref[k][a:b].mul_(1.5).add_(p)
        back = {k: torch.cat([v[k].clone() for _, _, v in store.stream(write=False)]) for k in DTYPES}
        for k in DTYPES:
            assert torch.equal(back[k], ref[k]), k
        assert store.read_bytes > 0 and store.written_bytes > 0 and store.prefetched_chunks > 0
    finally:
        store.close()
    assert os.listdir(tmp_path) == []                        # files and lock gone


def test_one_job_per_directory_and_a_killed_runs_files_are_reclaimed(tmp_path):
    segs = [(0, 1000)]
    a = _store(tmp_path, segs, 1000, tag="zo_optimizer.tp0.dp0")
    with pytest.raises(UserError, match=rf"is in use by another job \(pid {os.getpid()} on host") as e:
        _store(tmp_path, segs, 1000, tag="zo_optimizer.tp0.dp0")
    assert "\n" not in str(e.value)
    a.close(remove=False)                                    # a killed run: files left, lock released
    left = sorted(os.listdir(tmp_path))
    assert left == sorted([f"zo_optimizer.tp0.dp0.{k}.bin" for k in DTYPES] + ["zo_optimizer.tp0.dp0.lock"])
    b = _store(tmp_path, segs, 1000, tag="zo_optimizer.tp0.dp0")
    assert b.reclaimed == sorted(f"zo_optimizer.tp0.dp0.{k}.bin" for k in DTYPES)
    b.close()
    assert os.listdir(tmp_path) == []


def test_a_disk_too_small_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    real = os.statvfs

    class Small:
        def __init__(self, st):
            self.f_frsize, self.f_bavail = st.f_frsize, 1

    monkeypatch.setattr(nvme_store.os, "statvfs", lambda p: Small(real(p)))
    with pytest.raises(ConfigError, match=r"GiB free, this rank's optimizer states need 0\.00 GiB: free space") as e:
        _store(tmp_path, [(0, 100000)], 100000)
    assert "\n" not in str(e.value) and os.listdir(tmp_path) == []


def test_disk_full_mid_pass_and_a_changed_file_are_one_line(tmp_path, monkeypatch):
    seed = fresh_seed("nvme store faults")
    store = _store(tmp_path, [(0, 4096)], 4096, buffer_size=512, buffer_count=2, block_bytes=4096)
    try:
        store.fill(lambda a, b, v: [t.fill_(seed % 7) for t in v.values()])
        with open(store.files["exp_avg"].path, "r+b") as f:  # changed on disk between two passes
            f.seek(3 * store.slot_bytes["exp_avg"] + 11)
            f.write(b"\x7f")
        with pytest.raises(StateFileError, match="checksum mismatch"):
            for _ in store.stream():
                pass
        calls = []

        def full(fd, bufs, offset):
            calls.append(offset)
            if len(calls) > 4:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return os.pwritev(fd, bufs, offset)

        monkeypatch.setattr(nvme_io, "_pwritev", full)
        with pytest.raises(UserError, match="no space left on the device") as e:
            for _ in store.stream(range(3)):                 # chunks 0-2 (chunk 3 is the corrupted one)
                pass
            store.drain()
        assert "\n" not in str(e.value)
    finally:
        store.close()
    assert os.listdir(tmp_path) == []
