"""Async file I/O for the NVMe tier of the optimizer states (issue 38): one job, moving bytes
between page-aligned host buffers and files, fast and checked.

  - Buffers: anonymous mmap pages (page-aligned, what O_DIRECT needs), viewed as uint8 tensors.
    They are never pinned: the states they carry only meet the CPU Adam, never the device.
  - Files: opened with O_DIRECT where the filesystem takes it (no second copy in the page cache);
    elsewhere (tmpfs, some network filesystems) buffered I/O, with a one-line `note` for the banner.
    The whole file is reserved at open (posix_fallocate), so a disk too small fails at the start.
  - Requests: a transfer is cut into blocks of `block_bytes`; each block is one os.preadv /
    os.pwritev on a thread of a pool (both release the GIL), so several blocks are in flight.
  - Checksums: each block written gets a CRC32C (the extension's cpu_adam.crc32c: SSE4.2, several
    times zlib.crc32's speed; it releases the GIL, so the I/O threads checksum in parallel), kept in
    memory; a block read back must match it, or the read fails: a state file truncated or changed
    between steps is refused (`StateFileError`), never trained on. A block never written is refused.
    Without the extension (a failed build) a file checksums with zlib.crc32 instead: another
    function, so each file picks its kind once, at open, and every entry says which function made
    it (below): a value is only ever compared with the same function's. The checksums live in
    this process only (the files never outlive the run), so nothing else needs to agree on a kind.
  - Errors: ENOSPC (disk full) and the others become one-line UserErrors naming the file and the
    fix; they are raised by `Request.wait()` on the caller's thread.

Offsets and sizes are multiples of ALIGN (4 KiB): O_DIRECT's rule on every common filesystem.
"""
from __future__ import annotations

import errno
import mmap
import os
import threading
import zlib
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from zo_megatron.errors import UserError
from zo_megatron.offload import cpu_adam

ALIGN = 4096                          # bytes: offsets, sizes and buffer addresses of every request
DEFAULT_BLOCK_BYTES = 4 << 20         # bytes per request (and per checksum)
DEFAULT_THREADS = 4                   # requests in flight

# The system calls, module-level so a test can inject a fault (ENOSPC) in one place.
_pwritev = os.pwritev
_preadv = os.preadv


# The two checksum kinds. An entry of StateFile.crc is (length, CRC-32) for zlib.crc32 -- the form the
# dict always had, which NvmeStateStore.resync still writes after a checkpoint load -- and
# (length, CRC32C, "crc32c") for cpu_adam.crc32c, so read_block checks each with its own function.
CRC32C, ZLIB = "crc32c", "zlib"


def checksum_kind() -> str:
    """The kind a new StateFile uses: CRC32C when the extension has it, else zlib's CRC-32.
    ZO_NVME_CHECKSUM=zlib|crc32c (private: the benchmarks' before/after comparison) forces one."""
    env = os.environ.get("ZO_NVME_CHECKSUM", "").strip().lower()
    if env not in ("", CRC32C, ZLIB):
        raise UserError(f"ZO_NVME_CHECKSUM={env!r}: expected crc32c or zlib (or unset it)")
    if env == CRC32C and not cpu_adam.has_crc32c():
        raise UserError("ZO_NVME_CHECKSUM=crc32c but the C++ extension has no crc32c: rebuild with "
                        "`pip install --no-build-isolation -e .` or unset it")
    return env or (CRC32C if cpu_adam.has_crc32c() else ZLIB)


class StateFileError(UserError):
    """A state file that does not hold what was written to it (truncated, corrupted, never written)."""


def round_up(n: int, multiple: int = ALIGN) -> int:
    return -(-n // multiple) * multiple


def aligned_empty(nbytes: int) -> torch.Tensor:
    """An uninitialised uint8 tensor of nbytes whose storage starts on a page boundary (an
    anonymous mapping; the tensor keeps it alive)."""
    mm = mmap.mmap(-1, max(round_up(nbytes, mmap.PAGESIZE), mmap.PAGESIZE))
    return torch.frombuffer(mm, dtype=torch.uint8)[:nbytes]


def _as_bytes(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory."""
    if not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError("I/O buffers must be contiguous CPU tensors")
    return memoryview(t.view(-1).view(torch.uint8).numpy()).cast("B")


def _disk_error(e: OSError, path: str, what: str) -> UserError:
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return UserError(f"{path}: no space left on the device while {what} (--optimizer-nvme-path): free "
                         "space there or point --optimizer-nvme-path at a larger disk")
    return UserError(f"{path}: {os.strerror(e.errno) if e.errno else e} while {what}: check the disk "
                     "under --optimizer-nvme-path")


class StateFile:
    """One file of `nbytes` (a multiple of ALIGN), reserved at open; the checksum of every block written
    (CRC32C, or zlib's CRC-32 without the extension: `checksum`, one kind per file)."""

    def __init__(self, path: str, nbytes: int, *, direct: bool = True):
        if nbytes % ALIGN:
            raise ValueError(f"state file size {nbytes} is not a multiple of {ALIGN}")
        self.checksum = checksum_kind()    # chosen once (before the file exists): every block it writes uses it
        self.path, self.nbytes = path, nbytes
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
        self.direct = bool(direct and hasattr(os, "O_DIRECT"))
        try:
            try:
                self.fd = os.open(path, flags | (os.O_DIRECT if self.direct else 0), 0o600)
            except OSError as e:
                if not self.direct or e.errno != errno.EINVAL:
                    raise
                self.direct = False              # the filesystem refuses O_DIRECT (tmpfs, ...): buffered
                self.fd = os.open(path, flags, 0o600)
        except FileExistsError:
            raise UserError(f"{path} already exists: another job uses this --optimizer-nvme-path, or a killed "
                            "one left it: remove it or use another directory") from None
        except OSError as e:
            raise _disk_error(e, path, "creating an optimizer state file") from None
        try:
            try:
                os.posix_fallocate(self.fd, 0, nbytes)
            except OSError as e:
                if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                    raise
                os.ftruncate(self.fd, nbytes)             # no fallocate on this filesystem: a sparse file
        except OSError as e:
            self.close(remove=True)
            raise _disk_error(e, path, f"reserving {nbytes} bytes for optimizer states") from None
        self.crc: dict[int, tuple] = {}               # block offset -> (length, CRC-32) | (length, CRC32C, "crc32c")
        self._lock = threading.Lock()

    def close(self, remove: bool = False) -> None:
        fd, self.fd = getattr(self, "fd", None), None
        if fd is not None:
            os.close(fd)
        if remove:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass

    def checksum_entry(self, view: memoryview) -> tuple:
        """The crc entry of a block holding `view`, in this file's kind (CRC32C or zlib's CRC-32)."""
        return (len(view), cpu_adam.crc32c(view), CRC32C) if self.checksum == CRC32C else (len(view), zlib.crc32(view))

    # The two block operations, on an I/O thread.
    def write_block(self, offset: int, view: memoryview) -> None:
        entry = self.checksum_entry(view)
        done = 0
        try:
            while done < len(view):          # a short write (rare) continues where it stopped
                n = _pwritev(self.fd, [view[done:]], offset + done)
                if n <= 0:
                    raise OSError(errno.EIO, "short write")
                done += n
        except OSError as e:
            raise _disk_error(e, self.path, f"writing optimizer states at byte {offset + done}") from None
        with self._lock:
            self.crc[offset] = entry

    def read_block(self, offset: int, view: memoryview) -> None:
        with self._lock:
            expected = self.crc.get(offset)
        if expected is None or expected[0] != len(view):
            raise StateFileError(f"{self.path}: bytes {offset}..{offset + len(view)} were never written by this job "
                                 "and cannot be read as optimizer states (an internal error: report it)")
        done = 0
        try:
            while done < len(view):
                n = _preadv(self.fd, [view[done:]], offset + done)
                if n == 0:
                    raise StateFileError(f"{self.path} is truncated (ends before byte {offset + len(view)}): the "
                                         "optimizer states on disk are lost; resume from the last checkpoint")
                done += n
        except OSError as e:
            raise _disk_error(e, self.path, f"reading optimizer states at byte {offset + done}") from None
        if (cpu_adam.crc32c(view) if expected[2:] == (CRC32C,) else zlib.crc32(view)) != expected[1]:
            raise StateFileError(f"{self.path}: bytes {offset}..{offset + len(view)} changed on disk since they were "
                                 "written (checksum mismatch): the optimizer states are corrupted; resume from "
                                 "the last checkpoint")


class Request:
    """The blocks of one transfer in flight; wait() joins them and raises the first error."""

    def __init__(self, futures: list[Future]):
        self.futures = futures

    @classmethod
    def joined(cls, requests: list[Request]) -> Request:
        """Several Requests as one. Their blocks stay in order, so wait() raises the error that waiting
        on each Request in turn would have raised first."""
        return cls([f for r in requests for f in r.futures])

    def done(self) -> bool:
        return all(f.done() for f in self.futures)

    def failed(self) -> bool:
        """Some block has ended in an error (the others may still run)."""
        return any(f.done() and not f.cancelled() and f.exception() is not None for f in self.futures)

    def wait(self) -> None:
        first = None
        for f in self.futures:            # every block is joined, even after an error
            try:
                f.result()
            except BaseException as e:   # noqa: BLE001 - re-raised below
                first = first or e
        if first is not None:
            raise first


class AsyncFileIO:
    """A pool of I/O threads; read()/write() cut a transfer into blocks and return a Request."""

    def __init__(self, threads: int = DEFAULT_THREADS, block_bytes: int = DEFAULT_BLOCK_BYTES):
        if threads < 1 or block_bytes < ALIGN or block_bytes % ALIGN:
            raise ValueError(f"threads >= 1 and a block of a multiple of {ALIGN} bytes (got {threads}, {block_bytes})")
        self.block_bytes = block_bytes
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="zo-nvme-io")

    def _submit(self, op, f: StateFile, offset: int, buf: torch.Tensor) -> Request:
        view = _as_bytes(buf)
        n = len(view)
        if offset % ALIGN or n % ALIGN or offset + n > f.nbytes:
            raise ValueError(f"{f.path}: request of {n} bytes at {offset} is not {ALIGN}-aligned or ends past "
                             f"the file ({f.nbytes} bytes)")
        if f.direct and buf.data_ptr() % ALIGN:
            raise ValueError("O_DIRECT needs a page-aligned buffer (nvme_io.aligned_empty)")
        B = self.block_bytes
        return Request([self.pool.submit(op, f, offset + s, view[s:s + B]) for s in range(0, n, B)])

    def write(self, f: StateFile, offset: int, buf: torch.Tensor) -> Request:
        return self._submit(StateFile.write_block, f, offset, buf)

    def read(self, f: StateFile, offset: int, buf: torch.Tensor) -> Request:
        return self._submit(StateFile.read_block, f, offset, buf)

    def close(self) -> None:
        self.pool.shutdown(wait=True)
