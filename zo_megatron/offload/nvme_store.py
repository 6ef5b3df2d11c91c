"""The NVMe tier's state store (issue 38, docs/nvme.md): this rank's Adam moments (and, with
--optimizer-nvme-master, the fp32 master) in files under --optimizer-nvme-path, streamed through a
bounded ring of page-aligned buffers for the CPU Adam.

The partition [0, n) is cut into chunks of at most `buffer_size` elements; chunk i of state k lives
in k's file at i x slot_bytes(k) (each chunk padded to 4 KiB, O_DIRECT's unit). `buffer_count` ring
slots hold one chunk of every on-disk state each. A pass over the chunks (stream()) reads ahead as
far as the ring allows while the caller (the CPU Adam) works on the current chunk, and writes each
chunk back behind it; the writes of a pass's last chunks stay in flight until a slot or that chunk
is needed again (the next step, or drain()).

  ring slots   |chunk j: writing|chunk j+1: Adam|chunk j+2: reading|chunk j+3: reading|

Exact: chunk cuts inside a segment of the partition lie a multiple of 64 elements from the
segment's start, where the CPU Adam kernel's own work split may cut (cpu_adam.adam_step_segments),
so the kernel computes every element with the same instructions as one call over the whole
partition: the result is bitwise that of the in-memory engine.

One job per directory: each rank holds an flock on `<tag>.lock` (its holder's pid, host and start
inside) while its files exist; a second job on the directory finds rank tp0.dp0's lock held and is
refused. The kernel drops the lock of a killed process, so state files found under a free lock are
a killed run's: they are reclaimed (removed, the banner says so). Nothing in them is worth keeping:
the job resumes from its last checkpoint, which holds the states. A clean close removes the files
and the lock.

Shadow slots (--overlap-cpu-step, schedules.SpeculativeSchedule): the first `shadow_chunks` chunks
(those the overlap may speculate: ending within its budget) have a second place in each file, after
the n main ones. A speculated pass (`shadow=True`) reads a chunk where it lives and writes it to its
other place; commit_shadow() then moves the chunk there, discard_shadow() (a rollback) forgets the
write, so the state before the step is still on disk: the rollback costs no host memory, only disk.

  file   |chunk 0|chunk 1| ... |chunk n-1|other place of chunk 0| ... |of chunk shadow_chunks-1|

Only the thread running the CPU step uses a store (the main thread, or a schedule's worker under
--dpu and during --overlap-cpu-step's speculating backward); drain() and close() are called when
that thread is joined.
"""
from __future__ import annotations

import bisect
import fcntl
import json
import mmap
import os
import socket
import time
from dataclasses import dataclass

import torch

from zo_megatron.errors import ConfigError, UserError
from zo_megatron.offload.nvme_io import (DEFAULT_BLOCK_BYTES, DEFAULT_THREADS, AsyncFileIO, Request, StateFile,
                                         aligned_empty, round_up)
from zo_megatron.parallel import collectives

KERNEL_CUT = 64                        # elements: where adam_step_segments may cut a segment
DEFAULT_BUFFER_COUNT = 4
DEFAULT_BUFFER_SIZE = 1 << 24          # partition elements per ring slot (64 MiB of fp32 per state)


@dataclass(frozen=True)
class NvmeConfig:
    """--optimizer-nvme-path and its companions (the engine's `nvme` argument)."""
    path: str
    master: bool = False               # --optimizer-nvme-master: the fp32 master on disk too
    buffer_count: int = DEFAULT_BUFFER_COUNT
    buffer_size: int = DEFAULT_BUFFER_SIZE
    io_threads: int = DEFAULT_THREADS
    block_bytes: int = DEFAULT_BLOCK_BYTES

    def check(self, need_dir: bool = True) -> None:
        if self.buffer_count < 1:
            raise ConfigError(f"--optimizer-nvme-buffer-count must be >= 1 (got {self.buffer_count})")
        if self.buffer_size < KERNEL_CUT or self.buffer_size % KERNEL_CUT:
            raise ConfigError(f"--optimizer-nvme-buffer-size must be a positive multiple of {KERNEL_CUT} elements "
                              f"(got {self.buffer_size})")
        if need_dir and not os.path.isdir(self.path):
            raise ConfigError(f"--optimizer-nvme-path {self.path} is not a directory: create it (on the NVMe disk)")


RAM_FILESYSTEMS = ("tmpfs", "ramfs", "devtmpfs", "hugetlbfs")


def filesystem_type(path: str) -> str:
    """The type of the filesystem holding path (/proc/self/mounts' longest matching mount point)."""
    real, best, kind = os.path.realpath(path), -1, "unknown"
    try:
        with open("/proc/self/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) < 3:
                    continue
                mnt = parts[1].replace("\\040", " ")
                inside = real == mnt or real.startswith(mnt.rstrip("/") + "/")
                if inside and len(mnt) > best:
                    best, kind = len(mnt), parts[2]
    except OSError:
        pass
    return kind


def plan_chunks(segments, total: int, size: int) -> list[tuple[int, int]]:
    """Cut [0, total) into chunks of at most `size` elements (a multiple of 64) where the CPU Adam's
    result does not depend on the cut: at a segment boundary, or a multiple of 64 elements from the
    start of the segment the cut falls in. `segments`: (start, end, ...) covering [0, total) in order."""
    starts = [s[0] for s in segments]
    if not segments or starts[0] != 0 or segments[-1][1] != total or \
            any(a[1] != b[0] for a, b in zip(segments, segments[1:])):
        raise ValueError("the segments must cover the partition end to end")
    if size < KERNEL_CUT or size % KERNEL_CUT:
        raise ValueError(f"chunk size {size} is not a positive multiple of {KERNEL_CUT}")
    chunks, a = [], 0
    while a < total:
        p = a + size
        if p >= total:
            b = total
        else:
            s = starts[bisect.bisect_right(starts, p) - 1]
            b = s + (p - s) // KERNEL_CUT * KERNEL_CUT     # > a: see the note in docs/nvme.md
        chunks.append((a, b))
        a = b
    return chunks


class NvmeStateStore:
    """The on-disk states of one rank: `dtypes` maps each state ("master", "exp_avg", "exp_avg_sq")
    to its dtype; files `<tag>.<state>.bin` under config.path."""

    def __init__(self, config: NvmeConfig, tag: str, segments, total: int, dtypes: dict[str, torch.dtype],
                 shadow_elements: int = 0):
        self.config = config
        self.chunks = plan_chunks(segments, total, config.buffer_size)
        self._starts = [a for a, _ in self.chunks]     # (bisect: the chunk holding a partition element)
        # chunks [0, shadow_chunks) have a second place (see the module docstring)
        self.shadow_chunks = sum(1 for _, b in self.chunks if b <= shadow_elements)
        self._side = [0] * len(self.chunks)            # 1: chunk i lives in its other place
        self._pending: set[int] = set()                # written to the other place, not committed
        self.dtypes = dict(dtypes)
        most = max(b - a for a, b in self.chunks)
        self.slot_bytes = {k: round_up(most * dt.itemsize) for k, dt in self.dtypes.items()}
        self.files: dict[str, StateFile] = {}
        self.io = self.ring = None
        self._maps: dict | None = None                 # checkpoints: the files mapped (mapped_views)
        self._prefetched: dict[int, object] = {}       # prefetch(): chunk -> its reads in flight
        self.prefetched_chunks = 0                     # (counted for tests and the curious)
        self._lock_fd, self._lock_path = None, os.path.join(config.path, f"{tag}.lock")
        self.reclaimed = self._lock(tag)
        try:
            places = len(self.chunks) + self.shadow_chunks
            need = places * sum(self.slot_bytes.values())
            st = os.statvfs(config.path)
            if st.f_bavail * st.f_frsize < need:
                raise ConfigError(f"--optimizer-nvme-path {config.path} has {st.f_bavail * st.f_frsize / 2**30:.2f} GiB "
                                  f"free, this rank's optimizer states need {need / 2**30:.2f} GiB: free space there "
                                  "or use a larger disk")
            self.io = AsyncFileIO(config.io_threads, min(config.block_bytes, max(self.slot_bytes.values())))
            for k in self.dtypes:
                self.files[k] = StateFile(os.path.join(config.path, f"{tag}.{k}.bin"), places * self.slot_bytes[k])
        except BaseException:
            self.close()
            raise
        slots = min(config.buffer_count, len(self.chunks))
        self.ring = [{k: aligned_empty(self.slot_bytes[k]) for k in self.dtypes} for _ in range(slots)]
        self._slot_write: list = [None] * slots        # the write in flight from each slot
        self._chunk_write: dict[int, object] = {}     # chunk -> its write in flight
        self.read_bytes = self.written_bytes = 0       # since reset_counters()
        self.wait_s = 0.0                              # the CPU step's time waiting for the disk

    @classmethod
    def open_on_every_rank(cls, *args) -> "NvmeStateStore":
        """The store of this rank, opened by every rank of the world together: when one rank is refused
        (its directory is in use, too small, not writable, ...) every rank raises that rank's line
        (printed once, by rank 0), none waits at a collective for it."""
        store = None
        try:
            with collectives.all_ranks_agree():
                try:
                    store = cls(*args)
                except OSError as e:        # the lock, a stale file of another user, the ring's memory
                    raise UserError(f"--optimizer-nvme-path {args[0].path}: setting up this rank's state files "
                                    f"failed ({type(e).__name__}: {e}): check the directory's permissions, files "
                                    "another user left there, and its free space") from None
        except BaseException:
            if store is not None:
                store.close()
            raise
        return store

    def _lock(self, tag: str) -> list[str]:
        """Take this rank's lock on the directory (refused while another job holds it) and remove the
        state files a killed run left under it. Returns the names removed."""
        fd = os.open(self._lock_path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                held = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
            except (OSError, ValueError):
                held = {}
            os.close(fd)
            raise UserError(f"--optimizer-nvme-path {self.config.path} is in use by another job (pid {held.get('pid', '?')} "
                            f"on host {held.get('host', '?')}): give each job its own directory") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}).encode(), 0)
        self._lock_fd = fd
        stale = sorted(f for f in os.listdir(self.config.path) if f.startswith(tag + ".") and f.endswith(".bin"))
        for f in stale:
            os.unlink(os.path.join(self.config.path, f))
        return stale

    # ------------------------------------------------------------------------------ accounting
    @property
    def buffer_bytes(self) -> int:
        return len(self.ring) * sum(self.slot_bytes.values())

    @property
    def disk_bytes(self) -> int:
        return sum(f.nbytes for f in self.files.values())

    @property
    def bytes_per_pass(self) -> int:
        """Bytes a CPU step reads (and writes back): every chunk of every state once."""
        return sum(self._nbytes(i, k) for i in range(len(self.chunks)) for k in self.dtypes)

    @property
    def direct(self) -> bool:
        return all(f.direct for f in self.files.values())

    def reset_counters(self) -> None:
        self.read_bytes = self.written_bytes = 0
        self.wait_s = 0.0

    # ----------------------------------------------------------------------------------- passes
    def _views(self, slot: int, i: int, kinds) -> dict[str, torch.Tensor]:
        a, b = self.chunks[i]
        return {k: self.ring[slot][k][:(b - a) * self.dtypes[k].itemsize].view(self.dtypes[k]) for k in kinds}

    def _nbytes(self, i: int, k: str) -> int:
        a, b = self.chunks[i]
        return round_up((b - a) * self.dtypes[k].itemsize)

    def _wait(self, req) -> None:
        t0 = time.monotonic()
        req.wait()
        self.wait_s += time.monotonic() - t0

    def _free(self, slot: int, block: bool) -> bool:
        """Whether the slot's last write is done (waited for when block)."""
        req = self._slot_write[slot]
        if req is None:
            return True
        # a write that failed is left for a blocking wait: the non-blocking ones (read-ahead, run on
        # one rank between the ranks' agreements) must not raise a disk error the other ranks miss
        if not block and (not req.done() or req.failed()):
            return False
        self._slot_write[slot] = None
        try:
            self._wait(req)
        finally:
            for i, r in list(self._chunk_write.items()):
                if r is req:
                    del self._chunk_write[i]
        return True

    def _place(self, k: str, i: int, side: int) -> int:
        """Byte offset of chunk i of state k in its file: its main place, or (side 1) its other one."""
        return (i if side == 0 else len(self.chunks) + i) * self.slot_bytes[k]

    def _read_side(self, i: int) -> int:
        """Where chunk i's newest bytes are: a speculated write not yet committed is read back too."""
        return 1 - self._side[i] if i in self._pending else self._side[i]

    def _write(self, slot: int, i: int, shadow: bool = False) -> None:
        if shadow:                                     # to the chunk's other place, until commit_shadow()
            if i >= self.shadow_chunks:
                raise ValueError(f"chunk {i} has no other place (the first {self.shadow_chunks} have)")
            self._pending.add(i)
        elif i in self._pending:
            raise ValueError(f"chunk {i} holds an uncommitted speculated write: commit or discard it first")
        side = 1 - self._side[i] if shadow else self._side[i]
        req = self._transfer(self.io.write, slot, i, self.dtypes, side)
        self._slot_write[slot] = req
        self._chunk_write[i] = req
        self.written_bytes += sum(self._nbytes(i, k) for k in self.dtypes)

    def commit_shadow(self) -> None:
        """The speculated writes become the chunks' states (their old places become the other ones)."""
        for i in self._pending:
            self._side[i] ^= 1
        self._pending.clear()

    def discard_shadow(self) -> None:
        """A rollback: forget the speculated writes; each chunk's state is again the one before them.
        Reads issued ahead since may hold speculated bytes: they are dropped too."""
        if self._pending:
            self._drop_prefetch()
            self._pending.clear()

    def chunk_range(self, lo: int, hi: int) -> range:
        """The chunks holding partition elements [lo, hi)."""
        starts = self._starts
        return range(bisect.bisect_right(starts, lo) - 1, bisect.bisect_left(starts, hi)) if hi > lo else range(0)

    def stream(self, chunk_ids=None, kinds=None, write: bool = True, shadow: bool = False):
        """Yield (a, b, {state: view}) for each chunk of `chunk_ids` (default: all, in order), its
        `kinds` (default: every state) read from disk; with `write`, every state of the chunk is
        written back after the caller's turn (so `kinds` must then be all), to its other place with
        `shadow`. Reads run up to the ring's depth ahead; chunk i always uses ring slot i % depth, so
        a pass over consecutive chunks takes the reads prefetch() started for them."""
        ids = list(range(len(self.chunks))) if chunk_ids is None else list(chunk_ids)
        kinds = tuple(self.dtypes) if kinds is None else tuple(kinds)
        if write and set(kinds) != set(self.dtypes):
            raise ValueError("a pass that writes back reads every state")
        K = len(self.ring)
        if ids == list(range(ids[0], ids[0] + len(ids))) if ids else True:
            reads = self._take_prefetched(ids)         # chunk -> the reads in flight into its slot
        else:                                          # (any order: tests) slots may collide, start clean
            self._drop_prefetch()
            reads = {}

        def issue(i: int, block: bool) -> bool:
            req = self._issue_read(i, kinds, block)
            if req is not None:
                reads[i] = req
            return req is not None

        try:
            for pos, i in enumerate(ids):
                if i not in reads:                     # this chunk's read must start now
                    issue(i, block=True)
                busy = {r % K for r in reads}          # slots holding a read of this pass
                for j in ids[pos + 1:pos + K]:         # read ahead as far as free slots allow
                    if j in reads:
                        continue
                    if j % K in busy or not issue(j, block=False):
                        break
                    busy.add(j % K)
                self._wait(reads.pop(i))
                a, b = self.chunks[i]
                yield a, b, self._views(i % K, i, kinds)
                if write:
                    self._write(i % K, i, shadow)
        finally:
            for req in reads.values():                 # a pass left early: nothing in flight into the ring
                try:
                    req.wait()
                except Exception:              # noqa: BLE001 - the pass's own error is the one raised
                    pass

    def _take_prefetched(self, ids: list[int]) -> dict[int, object]:
        """The prefetched reads of chunks in `ids` (a prefetch reads every state: any pass may use
        them); those of later chunks stay for a later pass when their slots are not this pass's."""
        pre, self._prefetched = self._prefetched, {}
        mine, K = set(ids), len(self.ring)
        slots = {i % K for i in ids}
        taken = {}
        for i, req in pre.items():
            if i in mine:
                taken[i] = req
            elif i % K not in slots:
                self._prefetched[i] = req
            else:
                self._quiet_wait(req)
        return taken

    def _issue_read(self, i: int, kinds, block: bool):
        """Read chunk i's `kinds` into its ring slot once the slot's and the chunk's last writes are
        done (without `block`: None if they are not yet)."""
        slot = i % len(self.ring)
        if not self._free(slot, block):
            return None
        if i in self._chunk_write:                     # this chunk's last write is from another slot
            if not block and (not self._chunk_write[i].done() or self._chunk_write[i].failed()):
                return None
            self._wait(self._chunk_write.pop(i))
        self.read_bytes += sum(self._nbytes(i, k) for k in kinds)
        return self._transfer(self.io.read, slot, i, kinds, self._read_side(i))

    def _transfer(self, op, slot: int, i: int, kinds, side: int) -> Request:
        """A Request for `op` (self.io.read or write) of chunk i's `kinds` at `side`: files <-> ring slot `slot`."""
        return Request.joined([op(self.files[k], self._place(k, i, side), self.ring[slot][k][:self._nbytes(i, k)])
                               for k in kinds])

    def prefetch(self, start: int = 0) -> None:
        """Start the reads of chunks start, start + 1, ... now, into their ring slots while their writes
        are done: the engine calls it when the last micro-batch's backward starts (and the overlap's
        worker after each speculated pass), so the disk works while the device does (the reads do not
        depend on the gradients). Only the thread that runs the passes calls it."""
        if self._maps is not None:
            return
        K = len(self.ring)
        held = {i % K for i in self._prefetched}
        for i in range(start, min(start + K, len(self.chunks))):
            if i in self._prefetched:
                continue
            if i % K in held:                          # its slot holds another chunk's read
                break
            req = self._issue_read(i, tuple(self.dtypes), block=False)
            if req is None:
                break
            self._prefetched[i] = req
            held.add(i % K)
            self.prefetched_chunks += 1

    @staticmethod
    def _quiet_wait(req) -> None:
        try:
            req.wait()
        except Exception:                      # noqa: BLE001 - the next full pass reads it again and finds it
            pass

    def _drop_prefetch(self) -> None:
        """Wait for prefetched reads nobody will use (a checkpoint, a rollback): their errors are the
        next pass's to find."""
        reads, self._prefetched = self._prefetched, {}
        for req in reads.values():
            self._quiet_wait(req)

    def update(self, run, segments, master, grad, out, prefetch_after: bool = False, shadow: bool = False) -> None:
        """The engine's CPU step over `segments` (consecutive, covering a range of the partition) as
        one pass over the chunks holding them: run(master, grad, exp_avg, exp_avg_sq, segments, out,
        False) on each chunk's slices, the segments clipped and shifted to the chunk (`master`: the
        partition's in memory, or None when it is on disk; `out` may be a prefix of the partition
        holding the segments). shadow: --overlap-cpu-step's speculated update, written to the chunks'
        other places (the segments' range must then be whole chunks), then the next chunks' reads
        started. prefetch_after (--dpu's worker, off the critical path): then let the writes land and
        start the next pass's first reads."""
        ids = self.chunk_range(segments[0][0], segments[-1][1]) if segments else range(0)
        if shadow and ids and (self.chunks[ids[0]][0] != segments[0][0] or self.chunks[ids[-1]][1] != segments[-1][1]):
            raise ValueError("a speculated update covers whole chunks")
        for lo, hi, st in self.stream(ids, shadow=shadow):
            segs = [(max(s, lo) - lo, min(e, hi) - lo, *rest) for s, e, *rest in segments if s < hi and e > lo]
            run(st.get("master", master[lo:hi] if master is not None else None), grad[lo:hi], st["exp_avg"],
                st["exp_avg_sq"], segs, out[lo:hi], False)
        if shadow and ids:
            self.prefetch(ids[-1] + 1)
        if prefetch_after:
            self.drain()
            self.prefetch()

    def copy_master_to(self, out: torch.Tensor) -> None:
        """out[:] = the fp32 master on disk, narrowed to out's dtype, chunk by chunk."""
        for lo, hi, st in self.stream(kinds=("master",), write=False):
            out[lo:hi].copy_(st["master"].to(out.dtype))

    def fill(self, fn) -> None:
        """Write every chunk from fn(a, b, {state: view}), which sets every element of the views."""
        self._drop_prefetch()
        for i, (a, b) in enumerate(self.chunks):
            slot = i % len(self.ring)
            self._free(slot, block=True)
            fn(a, b, self._views(slot, i, self.dtypes))
            self._write(slot, i)

    def fill_initial(self, master_pieces) -> None:
        """The states' first values: zero moments and, on disk, the fp32 master from
        `master_pieces` [(partition offset, values)] (sorted, disjoint; elements outside them zero)."""
        pieces = sorted(master_pieces, key=lambda p: p[0])
        starts = [h for h, _ in pieces]

        def init(a: int, b: int, views) -> None:
            for v in views.values():
                v.zero_()
            if "master" in views:
                j = max(0, bisect.bisect_right(starts, a) - 1)
                while j < len(pieces) and pieces[j][0] < b:
                    h, src = pieces[j]
                    lo, hi = max(h, a), min(h + src.numel(), b)
                    if lo < hi:
                        views["master"][lo - a:hi - a].copy_(src[lo - h:hi - h])
                    j += 1
        self.fill(init)

    # ------------------------------------------------------------------------ checkpoints (DCP)
    def mapped_views(self) -> dict[str, list[torch.Tensor]]:
        """Each state's chunks as tensors over a shared mapping of its file: a checkpoint reads from or
        writes into them in place, through the page cache (the kernel's to evict), never a copy of the
        states in process memory. After writing call resync(). Waits for the writes in flight first."""
        if self._pending:
            raise RuntimeError("the states hold an uncommitted speculated update: commit or discard it first")
        self._drop_prefetch()
        self.drain()
        if self._maps is None:
            self._maps = {}
            for k, f in self.files.items():
                fd = os.open(f.path, os.O_RDWR | getattr(os, "O_CLOEXEC", 0))
                try:
                    mm = mmap.mmap(fd, f.nbytes)
                finally:
                    os.close(fd)
                self._maps[k] = (mm, torch.frombuffer(mm, dtype=torch.uint8))
        out = {}
        for k, (_, t) in self._maps.items():
            dt, slot = self.dtypes[k], self.slot_bytes[k]
            out[k] = [t[self._place(k, i, self._side[i]):][:(b - a) * dt.itemsize].view(dt)
                      for i, (a, b) in enumerate(self.chunks)]
        return out

    def fragment_views(self, fragments, in_memory: dict[str, torch.Tensor]):
        """For each (slot, partition offset, parameter offset, length) of `fragments`, cut at chunk
        boundaries: (name, param, parameter offset, length, {state: view}), the states on disk as
        mapped views, those in memory (`in_memory`, whole-partition tensors) as slices."""
        maps = self.mapped_views()
        starts = self._starts
        for s, host, pstart, n in fragments:
            pos = host
            while pos < host + n:
                i = bisect.bisect_right(starts, pos) - 1
                a, b = self.chunks[i]
                e = min(b, host + n)
                views = {k: v[i][pos - a:e - a] for k, v in maps.items()}
                views.update({k: t[pos:e] for k, t in in_memory.items()})
                yield s.name, s.param, pstart + pos - host, e - pos, views
                pos = e

    def resync(self) -> None:
        """After a checkpoint wrote into the mapped views: flush the mapping to the files and take the
        checksums of what they now hold (the blocks every pass reads)."""
        if self._maps is None:
            return
        B = self.io.block_bytes
        for k, (mm, _) in self._maps.items():
            mm.flush()
            f = self.files[k]
            with memoryview(mm) as whole:
                for i in range(len(self.chunks)):
                    off, n = self._place(k, i, self._side[i]), self._nbytes(i, k)
                    for s in range(0, n, B):
                        block = whole[off + s:off + min(n, s + B)]
                        f.crc[off + s] = f.checksum_entry(block)
                        block.release()
        self._maps = None                      # (a mapping lives while a checkpoint's tensors do)

    def drain(self) -> None:
        """Wait for every write in flight (their errors are raised here)."""
        self._drop_prefetch()
        for slot in range(len(self.ring)):
            self._free(slot, block=True)

    def close(self, remove: bool = True) -> None:
        """Wait for the I/O in flight and close the files (removing them by default). Idempotent."""
        try:
            if self.ring is not None:
                for slot in range(len(self.ring)):
                    try:
                        self._free(slot, block=True)
                    except Exception:          # noqa: BLE001 - the files are going away anyway
                        pass
        finally:
            if self.io is not None:
                self.io.close()
                self.io = None
            for f in self.files.values():
                f.close(remove=remove)
            self.files = {}
            if self._lock_fd is not None:          # removed while held: no other job can take a dead name
                if remove:
                    os.unlink(self._lock_path)
                os.close(self._lock_fd)
                self._lock_fd = None

