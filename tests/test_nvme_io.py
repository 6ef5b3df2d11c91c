"""The NVMe tier's file I/O (offload/nvme_io.py): bytes come back as written with several blocks in
flight, O_DIRECT or buffered; a truncated or altered file and a block never written are refused; a
full disk (ENOSPC, injected) is one line naming the flag; a file already there is refused."""
import errno
import os
import random
import zlib

import pytest
import torch

from tests.seeds import fresh_seed
from zo_megatron.errors import UserError
from zo_megatron.offload import cpu_adam, nvme_io
from zo_megatron.offload.nvme_io import ALIGN, AsyncFileIO, StateFile, StateFileError, aligned_empty


def _random_bytes(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def io():
    io = AsyncFileIO(threads=3, block_bytes=2 * ALIGN)
    yield io
    io.close()


@pytest.mark.parametrize("direct", [True, False])
def test_round_trip_many_blocks_in_flight(tmp_path, io, direct):
    seed = fresh_seed("nvme io round trip")
    n = 64 * ALIGN
    f = StateFile(str(tmp_path / "s.bin"), n, direct=direct)
    assert f.direct == (direct and f.direct)          # buffered when asked; O_DIRECT where the FS takes it
    data = _random_bytes(n, seed)
    buf = aligned_empty(n)
    assert buf.data_ptr() % ALIGN == 0
    buf.copy_(data)
    # eight requests at once at scattered offsets, each cut into 2-page blocks
    pieces = [(k * 8 * ALIGN, buf[k * 8 * ALIGN:(k + 1) * 8 * ALIGN]) for k in range(8)]
    reqs = [io.write(f, off, piece) for off, piece in reversed(pieces)]
    for r in reqs:
        r.wait()
    assert len(f.crc) == 32
    back = aligned_empty(n)
    back.zero_()
    reqs = [io.read(f, off, back[off:off + 8 * ALIGN]) for off, _ in pieces]
    for r in reqs:
        r.wait()
    assert torch.equal(back, data)
    with open(f.path, "rb") as fh:                     # and the file holds exactly those bytes
        assert torch.equal(torch.frombuffer(bytearray(fh.read()), dtype=torch.uint8), data)
    f.close(remove=True)
    assert not os.path.exists(f.path)


def test_a_filesystem_without_o_direct_falls_back_to_buffered_io(tmp_path, monkeypatch):
    # tmpfs before Linux 6.6 (and some network filesystems) refuse O_DIRECT at open with EINVAL
    real_open = os.open

    def no_direct(path, flags, mode=0o777):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        return real_open(path, flags, mode)

    monkeypatch.setattr(nvme_io.os, "open", no_direct)
    f = StateFile(str(tmp_path / "s.bin"), 4 * ALIGN)
    assert not f.direct                                # buffered, not an error
    io = AsyncFileIO(threads=2, block_bytes=ALIGN)
    buf = aligned_empty(4 * ALIGN)
    buf.copy_(_random_bytes(4 * ALIGN, fresh_seed("no O_DIRECT")))
    io.write(f, 0, buf).wait()
    back = aligned_empty(4 * ALIGN)
    io.read(f, 0, back).wait()
    assert torch.equal(back, buf)
    io.close()
    f.close(remove=True)


def _written(tmp_path, io, n=8 * ALIGN):
    f = StateFile(str(tmp_path / "s.bin"), n)
    buf = aligned_empty(n)
    buf.copy_(_random_bytes(n, fresh_seed("nvme io fault")))
    io.write(f, 0, buf).wait()
    return f, buf


def test_a_changed_byte_is_refused_in_the_block_it_hits(tmp_path, io):
    f, buf = _written(tmp_path, io)
    with open(f.path, "r+b") as fh:                    # another process alters one byte between steps
        fh.seek(5 * ALIGN + 17)
        old = fh.read(1)
        fh.seek(5 * ALIGN + 17)
        fh.write(bytes([old[0] ^ 0x01]))
    back = aligned_empty(8 * ALIGN)
    io.read(f, 0, back[:4 * ALIGN]).wait()            # blocks 0, 1: untouched, read fine
    with pytest.raises(StateFileError, match=r"changed on disk.*checksum mismatch.*last checkpoint") as e:
        io.read(f, 4 * ALIGN, back[4 * ALIGN:]).wait()
    assert "\n" not in str(e.value)
    f.close(remove=True)


def test_a_truncated_file_is_refused(tmp_path, io):
    f, _ = _written(tmp_path, io)
    os.truncate(f.path, 3 * ALIGN)
    with pytest.raises(StateFileError, match=r"is truncated"):
        io.read(f, 0, aligned_empty(8 * ALIGN)).wait()
    f.close(remove=True)


def test_a_block_never_written_is_refused(tmp_path, io):
    f = StateFile(str(tmp_path / "s.bin"), 4 * ALIGN)
    io.write(f, 0, aligned_empty(2 * ALIGN).zero_()).wait()
    with pytest.raises(StateFileError, match="never written"):
        io.read(f, 2 * ALIGN, aligned_empty(2 * ALIGN)).wait()
    f.close(remove=True)


def test_disk_full_is_one_line_naming_the_flag(tmp_path, io, monkeypatch):
    f = StateFile(str(tmp_path / "s.bin"), 4 * ALIGN)
    calls = []

    def full(fd, bufs, offset):
        calls.append(offset)
        if offset >= 2 * ALIGN:                        # the disk fills after the first block
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return os.pwritev(fd, bufs, offset)

    monkeypatch.setattr(nvme_io, "_pwritev", full)
    with pytest.raises(UserError, match=r"no space left on the device.*--optimizer-nvme-path") as e:
        io.write(f, 0, aligned_empty(4 * ALIGN).zero_()).wait()
    assert "\n" not in str(e.value) and sorted(calls) == [0, 2 * ALIGN]   # both blocks were tried
    assert list(f.crc) == [0]                          # only the block that landed is readable
    f.close(remove=True)


def test_an_existing_file_is_refused_and_misaligned_requests_are_errors(tmp_path, io):
    f = StateFile(str(tmp_path / "s.bin"), 2 * ALIGN)
    with pytest.raises(UserError, match="already exists"):
        StateFile(f.path, 2 * ALIGN)
    with pytest.raises(ValueError, match="aligned"):
        io.write(f, 100, aligned_empty(ALIGN))
    with pytest.raises(ValueError, match="past"):
        io.write(f, 0, aligned_empty(3 * ALIGN))
    f.close(remove=True)


# The checksum: CRC32C from the extension (tests/test_cpu_adam.py checks the function itself against
# a bytewise reference), zlib's CRC-32 without it; one kind per file, each entry checked by its own.
KINDS = [nvme_io.CRC32C, nvme_io.ZLIB] if cpu_adam.has_crc32c() else [nvme_io.ZLIB]


@pytest.mark.parametrize("kind", KINDS)
def test_each_block_has_its_files_checksum_and_a_flipped_bit_is_refused(tmp_path, io, monkeypatch, kind):
    rng = random.Random(fresh_seed(f"nvme checksum {kind}"))
    monkeypatch.setenv("ZO_NVME_CHECKSUM", kind)
    n = 8 * ALIGN
    f = StateFile(str(tmp_path / "s.bin"), n)
    assert f.checksum == kind
    buf = aligned_empty(n)
    buf.copy_(_random_bytes(n, rng.randrange(2**31)))
    io.write(f, 0, buf).wait()
    raw = buf.numpy().tobytes()
    B = io.block_bytes
    for off in range(0, n, B):                        # every block: its length and its own kind's value
        block = raw[off:off + B]
        want = (B, cpu_adam.crc32c(block), nvme_io.CRC32C) if kind == nvme_io.CRC32C else (B, zlib.crc32(block))
        assert f.crc[off] == want
    pos, bit = rng.randrange(n), rng.randrange(8)     # one bit flipped on disk between steps
    with open(f.path, "r+b") as fh:
        fh.seek(pos)
        old = fh.read(1)[0]
        fh.seek(pos)
        fh.write(bytes([old ^ (1 << bit)]))
    hit = pos // B * B
    back = aligned_empty(n)
    for off in range(0, n, B):
        if off == hit:
            with pytest.raises(StateFileError, match=r"changed on disk.*checksum mismatch.*last checkpoint") as e:
                io.read(f, off, back[off:off + B]).wait()
            assert f"bytes {off}..{off + B} changed" in str(e.value) and "\n" not in str(e.value)
        else:                                          # the other blocks still read back as written
            io.read(f, off, back[off:off + B]).wait()
            assert back[off:off + B].numpy().tobytes() == raw[off:off + B]
    f.close(remove=True)


def test_an_entry_of_the_zlib_form_is_checked_with_zlib_in_a_crc32c_file(tmp_path, io):
    # a (length, zlib.crc32) entry (a file of a build without the extension; NvmeStateStore.resync set
    # those before it took StateFile.checksum_entry) is checked with zlib whatever the file's own kind
    f, buf = _written(tmp_path, io, n=4 * ALIGN)
    B = io.block_bytes
    raw = bytearray(buf.numpy().tobytes())
    raw[B + 5] ^= 0x10                                 # the "checkpoint" changes block 1
    with open(f.path, "r+b") as fh:
        fh.seek(B)
        fh.write(raw[B:2 * B])
    f.crc[B] = (B, zlib.crc32(bytes(raw[B:2 * B])))   # ... and takes its checksum
    back = aligned_empty(4 * ALIGN)
    io.read(f, 0, back).wait()
    assert back.numpy().tobytes() == bytes(raw)
    f.crc[B] = (B, zlib.crc32(bytes(raw[B:2 * B])) ^ 1)
    with pytest.raises(StateFileError, match="checksum mismatch"):
        io.read(f, B, back[B:2 * B]).wait()
    f.close(remove=True)


def test_the_entry_a_resync_takes_is_the_one_a_write_takes(tmp_path, io):
    """NvmeStateStore.resync checksums what a checkpoint wrote into the mapped files with
    StateFile.checksum_entry: the entry write_block takes for the same bytes, in the file's own kind."""
    f, buf = _written(tmp_path, io, n=4 * ALIGN)
    B = io.block_bytes
    raw = buf.numpy().tobytes()
    for off in range(0, len(raw), B):
        assert f.checksum_entry(memoryview(raw[off:off + B])) == f.crc[off], off
    assert (f.crc[0][2:] == (nvme_io.CRC32C,)) == (f.checksum == nvme_io.CRC32C)
    f.close(remove=True)


def test_the_checksum_kind_without_the_extension_and_a_bad_switch(tmp_path, monkeypatch):
    monkeypatch.delenv("ZO_NVME_CHECKSUM", raising=False)
    assert nvme_io.checksum_kind() == (nvme_io.CRC32C if cpu_adam.has_crc32c() else nvme_io.ZLIB)
    monkeypatch.setattr(cpu_adam, "_ext", None)        # a failed build: zlib's CRC-32, per file
    f = StateFile(str(tmp_path / "s.bin"), 2 * ALIGN)
    assert f.checksum == nvme_io.ZLIB
    f.close(remove=True)
    monkeypatch.setenv("ZO_NVME_CHECKSUM", "crc32c")
    with pytest.raises(UserError, match="ZO_NVME_CHECKSUM=crc32c.*no crc32c"):
        nvme_io.checksum_kind()
    monkeypatch.setenv("ZO_NVME_CHECKSUM", "md5")
    with pytest.raises(UserError, match="ZO_NVME_CHECKSUM='md5'") as e:
        StateFile(str(tmp_path / "t.bin"), 2 * ALIGN)
    assert "\n" not in str(e.value) and not os.path.exists(tmp_path / "t.bin")
