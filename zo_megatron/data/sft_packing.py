"""--sft-pack-lines (ours): a --sft sample packs several consecutive .jsonl lines, not one.

Megatron-LM's SFTDataset makes one sample of one line (sft.py), which suits files packed offline. A file with
one short conversation per line (the Hugging Face layout) then trains mostly on padding at a long
--seq-length. With the flag the samples of a split are runs of its consecutive lines, in line order, packed
greedily: a line joins the pack while the pack's tokens (every conversation as sft.py renders it, with its
end-of-document token) stay <= seq_length, i.e. with the +1 of the label shift they fit in seq_length + 1;
a line that does not fit starts the next pack, and a line that alone does not fit is a pack of its own, cut
as sft.py cuts a line. A pack is then exactly the sample sft.py makes of one line holding all of its lines'
conversations in order: a segment per conversation, positions from 0 in each, the loss on the assistant
turns, the padding at the end. Samples cycle over the packs when more are asked for than there are.

The boundaries need every line's token count first. Each line is tokenized once through sft.py's own path
(line_pieces, so the counts are exact), its count capped at seq_length + 1 (such a line is alone anyway, and
its conversations past the cut are not tokenized, as in its sample). The counts are kept as an int32 .npy in
the index cache, keyed by the file (path, size, mtime), the prompt format's identifiers (tokenizer
fingerprint, template, pad, eod) and seq_length. One process builds them under the cache's lock: global rank
0 under torch.distributed, which reports to the other ranks every _HEARTBEAT_S (so a long count outlives
any collective timeout, and a bad line stops every rank with the same one line), the others then read the
file. A bad line fails the build with sft.py's one-line DataError naming file:line.

This module knows nothing of sft.py (which imports it): the readers are passed in.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import tempfile
import time

from zo_megatron.data.errors import DataError

logger = logging.getLogger(__name__)

_VERSION = 1                 # of the counts' meaning: a change gives new cache keys
_PROGRESS_LINES = 20_000     # files with at least this many lines log their counting
_PROGRESS_EVERY_S = 5.0
_HEARTBEAT_S = 20.0          # rank 0 of a multi-rank build tells the others how it goes this often
_STEP_LINES = 64             # lines counted between looks at the clock


# ----------------------------------------------------------------------------- boundaries
def pack_bounds(counts, seq_length: int):
    """[packs + 1] int64, from 0 to len(counts): pack p is lines bounds[p]:bounds[p + 1]. counts: each line's
    tokens. Greedy over the lines in order: a pack takes lines while their total stays <= seq_length; the line
    that would pass it starts the next pack; a line above seq_length is a pack alone."""
    import numpy as np

    c = np.asarray(counts, dtype=np.int64)
    n, limit = c.size, int(seq_length)
    ends = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(c, out=ends[1:])
    # for every line s: where a pack starting at s would end (the last e with ends[e] - ends[s] <= limit), at
    # least one line on
    after = np.maximum(np.searchsorted(ends, ends[:-1] + limit, side="right") - 1, np.arange(1, n + 1))
    # the packs start at 0, after[0], after[after[0]], ...: one step per pack, through a memoryview (Python
    # ints, ~0.1 us a step) rather than numpy scalars
    step, starts, s = memoryview(after), [], 0
    while s < n:
        starts.append(s)
        s = step[s]
    starts.append(n)
    return np.array(starts, dtype=np.int64)


def split_packs(line_counts: dict | None, dataset_path: str, indices, seq_length: int):
    """The pack bounds of a split's lines (`indices`: lines of `dataset_path`, in order), positions into
    `indices`; None without --sft-pack-lines (line_counts None)."""
    if line_counts is None:
        return None
    return pack_bounds(line_counts[dataset_path][indices], seq_length)


def sample_lines(packs, indices, idx: int) -> list[int]:
    """The lines of sample idx: those of pack idx modulo the packs (samples cycle, as lines do unpacked)."""
    p = int(idx) % (len(packs) - 1)
    return [int(i) for i in indices[packs[p]:packs[p + 1]]]


# ----------------------------------------------------------------------------- counting
def line_token_count(pieces, eod: int, limit: int) -> int:
    """The tokens a line adds to a pack: each conversation's (tokens, targets) in `pieces`, plus an
    end-of-document token where it does not end with one (pack_sample's rule); `limit` at most, the
    conversations after it is reached not tokenized."""
    n = 0
    for tokens, _ in pieces:
        n += len(tokens) + (not len(tokens) or tokens[-1] != eod)
        if n >= limit:
            return int(limit)
    return n


def counts_cache_path(path: str, fmt, seq_length: int, cache: str) -> str:
    """Where the token counts of `path`'s lines for this format and seq_length are kept."""
    st = os.stat(path)
    key = json.dumps({"version": _VERSION, "file": os.path.abspath(path), "size": st.st_size,
                      "mtime_ns": st.st_mtime_ns, "format": fmt.identifiers(), "seq_length": int(seq_length)},
                     sort_keys=True)
    digest = hashlib.sha256(key.encode()).hexdigest()[:20]
    return os.path.join(cache, f"sft_line_counts-{os.path.basename(path)[:60]}-{digest}.npy")


def _load(target: str, lines: int, limit: int):
    """The cached counts, or None where absent or not what this build would write (torn, foreign)."""
    import numpy as np

    try:
        counts = np.load(target, allow_pickle=False)
    except (OSError, ValueError, EOFError):
        return None
    ok = counts.dtype == np.int32 and counts.shape == (lines,) and (
        lines == 0 or (int(counts.min()) >= 1 and int(counts.max()) <= limit))
    return counts if ok else None


def _save(target: str, counts) -> None:
    """Written whole or not at all: a reader never sees half a file (another job may share the cache)."""
    import numpy as np

    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(target), prefix=".tmp-sft-counts-", suffix=".npy")
    try:
        with os.fdopen(fd, "wb") as f:
            np.save(f, counts)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


class _Counting:
    """The counts of one file's lines, built in steps of about `seconds` (between which rank 0 of a multi-rank
    build reports to the others), with progress logged for long files."""

    def __init__(self, path: str, lines, fmt, limit: int, line_pieces, target: str):
        import numpy as np

        self.path, self.lines, self.fmt, self.limit, self.pieces = path, lines, fmt, int(limit), line_pieces
        self.out = np.zeros(len(lines), dtype=np.int32)
        self.done = 0
        self.t0 = self.last_log = time.monotonic()
        self.loud = len(lines) >= _PROGRESS_LINES
        if self.loud:
            logger.info("--sft-pack-lines: counting the tokens of the %d lines of %s (once: kept in %s)",
                        len(lines), path, target)

    def step(self, seconds: float) -> bool:
        """Count on for about `seconds`; whether every line is counted."""
        n, until = len(self.out), time.monotonic() + seconds
        while self.done < n:
            stop = min(n, self.done + _STEP_LINES)
            for i in range(self.done, stop):
                self.out[i] = line_token_count(self.pieces(self.lines, i, self.fmt), self.fmt.eod, self.limit)
            self.done = stop
            now = time.monotonic()
            if self.loud and now - self.last_log >= _PROGRESS_EVERY_S:
                rate = self.done / max(now - self.t0, 1e-9)
                logger.info("--sft-pack-lines: %s: %d of %d lines counted (%.0f%%), %.0f lines/s, about %.0f s left",
                            self.path, self.done, n, 100 * self.done / n, rate, (n - self.done) / rate)
                self.last_log = now
            if now >= until:
                break
        if self.done == n and self.loud:
            took = time.monotonic() - self.t0
            logger.info("--sft-pack-lines: counted the %d lines of %s in %.1f s (%.0f lines/s)", n, self.path, took,
                        n / max(took, 1e-9))
        return self.done == n


class LinePacking:
    """build_sft_datasets' side of --sft-pack-lines: `counts` ({absolute path: int32 [lines]}) of every file it
    builds from, each read from the index cache or built into it (see the module docstring). open_jsonl and
    line_pieces are sft.py's readers (the path's lines; a line's conversations as (tokens, targets))."""

    def __init__(self, fmt, seq_length: int, cache: str, open_jsonl, line_pieces):
        self.fmt, self.seq_length, self.cache = fmt, int(seq_length), cache
        self.open, self.pieces = open_jsonl, line_pieces
        self.counts: dict = {}

    def samples_of(self, path: str) -> int:
        """The packs of the whole file (its counts first: collective, call it on every rank)."""
        if path not in self.counts:
            self.counts[path] = self._agreed_counts(path)
        return len(pack_bounds(self.counts[path], self.seq_length)) - 1

    def _rank0_steps(self, path: str, target: str, seconds: float):
        """Rank 0's part: yields None after each `seconds` of counting, then the counts (read from the cache,
        or built into it under the cache's lock)."""
        from zo_megatron.data.corpus import file_lock

        lines, limit = self.open(path), self.seq_length + 1
        counts = _load(target, len(lines), limit)
        if counts is None:
            with file_lock(os.path.join(self.cache, ".build.lock")):
                counts = _load(target, len(lines), limit)     # another process built it while this one waited
                if counts is None:
                    job = _Counting(path, lines, self.fmt, limit, self.pieces, target)
                    while not job.step(seconds):
                        yield None
                    counts = job.out
                    _save(target, counts)
        yield counts

    def _agreed_counts(self, path: str):
        import torch

        from zo_megatron.parallel import collectives

        target = counts_cache_path(path, self.fmt, self.seq_length, self.cache)
        rank, several = collectives.group_rank(), collectives.group_size() > 1
        steps = self._rank0_steps(path, target, _HEARTBEAT_S if several else math.inf) if rank == 0 else None
        counts = None
        while True:     # every rank loops until rank 0 is done; a failure there ends the loop everywhere
            with collectives.all_ranks_agree():
                if steps is not None:
                    counts = next(steps)
            pending = torch.tensor([int(rank == 0 and counts is None)], dtype=torch.int64)
            if not collectives.all_reduce(pending, "max").item():
                break
        with collectives.all_ranks_agree():
            if counts is None:
                counts = _load(target, len(self.open(path)), self.seq_length + 1)
                if counts is None:
                    raise DataError(f"--sft-pack-lines: rank {rank} cannot read the token counts of {path} that rank "
                                    f"0 wrote to {target}: the index cache (--data-cache-path) must be one directory "
                                    "for every rank")
        return counts
