"""Training datasets: megatron-core's GPTDataset/BlendedDataset, prefix validation, DP batching.

    train, valid, test = build_gpt_datasets([prefix], "969,30,1", seq_length=1024, seed=1234,
                                            tokenizer=tok, train_samples=N, valid_samples=M,
                                            test_samples=0)
    for batch in dp_batches(train, micro_batch_size=4, dp_rank=r, dp_size=d, start_sample=k):
        batch["tokens"], batch["labels"], batch["loss_mask"], batch["position_ids"]  # [mbs, seq]

Splits follow megatron: each prefix's documents are cut into contiguous train/valid/test ranges by
`split` (one document = one sequence in datasets from tools/preprocess_data.py), then each range is
shuffled deterministically from `seed` and cut into seq_length+1-token windows (megatron-core's
GPTDataset; the last sample of an epoch is padded and its padding masked out of the loss).

Index cache and torch.distributed: megatron-core caches the document/sample/shuffle indices as .npy
files under `cache_dir` (default ``$ZO_MEGATRON_CACHE/gpt_indices``). With torch.distributed
initialised, build_gpt_datasets is collective: global rank 0 builds the indices, every rank then
loads them (megatron's barrier), so in multi-node jobs `cache_dir` must be on a file system all
ranks see (the job checks that first: training/components.py, one line naming the ranks that do not). Without torch.distributed, a blend of several prefixes needs a process group inside
megatron's BlendedDataset (it calls torch.distributed.get_rank() when caching), so this module
initialises a private 1-rank gloo group for the duration of the build and destroys it afterwards;
single-prefix builds need none; independent processes (no torch.distributed) sharing a cache
take turns through an fcntl lock in it. The cache key includes a fingerprint of each prefix's
.idx, so re-running the preprocessing at the same prefix never reuses stale indices.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import logging
import os
import re
import struct
import tempfile
import warnings
from typing import Iterator, NamedTuple, Sequence

from zo_megatron.data.dataset_meta import read_dataset_meta
from zo_megatron.data.errors import DataError

logger = logging.getLogger(__name__)

# The on-disk format of megatron-core's indexed dataset (megatron/core/datasets/indexed_dataset.py):
# header: magic(9) version<Q>=1 dtype<B> sequence_count<Q> document_count<Q>  = 34 bytes, then
# int32 sequence_lengths[S], int64 sequence_pointers[S], int64 document_indices[D] (D = docs + 1).
_INDEX_MAGIC = b"MMIDIDX\x00\x00"
_HEADER_LEN = 34
_DTYPE_CODES = {1: "uint8", 2: "int8", 3: "int16", 4: "int32", 5: "int64", 6: "float64",
                7: "float32", 8: "uint16"}
_FULL_SCAN_BYTES = 256 << 20  # scan every token of .bin files up to this size, sample larger ones


class DatasetInfo(NamedTuple):
    prefix: str
    dtype: str
    sequences: int
    documents: int
    tokens: int


def _preprocess_hint(prefix: str) -> str:
    out = prefix[: -len("_text_document")] if prefix.endswith("_text_document") else prefix
    return f"build it with: python tools/preprocess_data.py --input <text> --output-prefix {out}"


OTHER_TOKENIZER_FLAG = "--allow-other-tokenizer-data"


def validate_data_prefix(prefix: str, tokenizer=None, other_tokenizer: str = "error") -> DatasetInfo:
    """Check a Megatron dataset prefix (PREFIX.bin + PREFIX.idx) before training on it.

    Raises DataError (one line naming the file and the fix) for: missing files, an .idx that is
    truncated, corrupt or not an index, a .bin whose size disagrees with the index, and — given a
    tokenizer (anything with .vocab_size) — a token dtype that cannot hold the vocabulary or a token
    id >= vocab_size. The ids are checked against the largest id recorded by the preprocessing in
    PREFIX.meta.json when that record still matches the pair (dataset_meta.py), else by reading
    the tokens (all of them up to 256 MB of .bin, evenly spread windows beyond). A record naming
    another tokenizer whose ids fit means the ids stand for other text: `other_tokenizer` "error"
    (the default) refuses it, "warn" (the job's --allow-other-tokenizer-data) says it once, "accept"
    says nothing (a second look at data already checked).
    """
    import numpy as np

    prefix = os.path.expanduser(str(prefix))
    if prefix.endswith((".bin", ".idx")):
        raise DataError(f"data prefix {prefix}: pass the prefix without the .bin/.idx extension "
                        f"({prefix[:-4]})")
    idx_path, bin_path = prefix + ".idx", prefix + ".bin"
    missing = [p for p in (bin_path, idx_path) if not os.path.isfile(p)]
    if missing:
        hint = _preprocess_hint(prefix)
        if os.path.isfile(prefix + "_text_document.idx"):
            hint = f"did you mean {prefix}_text_document?"
        raise DataError(f"data prefix {prefix}: {' and '.join(missing)} not found; {hint}")

    size = os.path.getsize(idx_path)
    with open(idx_path, "rb") as f:
        head = f.read(_HEADER_LEN)
    if len(head) >= 9 and head[:9] != _INDEX_MAGIC:
        raise DataError(f"{idx_path} is not a Megatron indexed-dataset index (bad magic); "
                        f"{_preprocess_hint(prefix)}")
    if len(head) < _HEADER_LEN:
        raise DataError(f"{idx_path} is truncated ({size} bytes, the header alone is "
                        f"{_HEADER_LEN}); {_preprocess_hint(prefix)}")
    version, code, n_seq, n_doc = struct.unpack("<QBQQ", head[9:])
    if version != 1:
        raise DataError(f"{idx_path} has index version {version}, expected 1; "
                        f"{_preprocess_hint(prefix)}")
    if code not in _DTYPE_CODES:
        raise DataError(f"{idx_path} has unknown token dtype code {code} (corrupt); "
                        f"{_preprocess_hint(prefix)}")
    dtype = np.dtype(_DTYPE_CODES[code])
    expected = _HEADER_LEN + n_seq * 12 + n_doc * 8
    if size != expected:
        if size == expected + n_seq:
            raise DataError(f"{idx_path} is a multimodal index, which GPT training does not read")
        what = "truncated" if size < expected else "corrupt (trailing bytes)"
        raise DataError(f"{idx_path} is {what}: {size} bytes, but its header ({n_seq} sequences, "
                        f"{max(n_doc - 1, 0)} documents) implies {expected}; "
                        f"{_preprocess_hint(prefix)}")
    if n_seq == 0:
        raise DataError(f"{idx_path} holds no sequences (empty dataset); {_preprocess_hint(prefix)}")

    idx = np.memmap(idx_path, dtype=np.uint8, mode="r")
    lengths = np.frombuffer(idx, dtype=np.int32, count=n_seq, offset=_HEADER_LEN)
    pointers = np.frombuffer(idx, dtype=np.int64, count=n_seq, offset=_HEADER_LEN + 4 * n_seq)
    docs = np.frombuffer(idx, dtype=np.int64, count=n_doc, offset=_HEADER_LEN + 12 * n_seq)
    lengths64 = lengths.astype(np.int64)
    ends = np.cumsum(lengths64) * dtype.itemsize
    if (n_doc < 2 or docs[0] != 0 or docs[-1] != n_seq or np.any(np.diff(docs) < 0)
            or np.any(lengths < 0) or pointers[0] != 0
            or np.any(pointers[1:] != ends[:-1])):
        raise DataError(f"{idx_path} is corrupt (inconsistent sequence/document tables); "
                        f"{_preprocess_hint(prefix)}")
    n_tokens = int(lengths64.sum())
    bin_size = os.path.getsize(bin_path)
    if bin_size != n_tokens * dtype.itemsize:
        raise DataError(f"{bin_path} is {bin_size} bytes but {idx_path} describes "
                        f"{n_tokens * dtype.itemsize} ({n_tokens} {dtype.name} tokens): the pair is "
                        f"truncated or from different runs; {_preprocess_hint(prefix)}")
    del idx

    if tokenizer is not None:
        vocab = int(tokenizer.vocab_size)
        if dtype.kind not in "iu" or np.iinfo(dtype).max < vocab - 1:
            raise DataError(f"{idx_path} stores tokens as {dtype.name}, which cannot hold the "
                            f"tokenizer's {vocab}-token vocabulary: the dataset was made for another "
                            f"tokenizer; {_preprocess_hint(prefix)}")
        meta = read_dataset_meta(prefix)
        if meta is not None:
            lo, hi = int(meta["min_token_id"]), int(meta["max_token_id"])
            made_by = (f"{meta.get('tokenizer_type')}"
                       f"{' ' + str(meta['tokenizer_model']) if meta.get('tokenizer_model') else ''}"
                       f" with {meta['vocab_size']} tokens")
            if hi >= vocab or lo < 0:
                bad = hi if hi >= vocab else lo
                raise DataError(f"{bin_path} holds token id {bad}, outside this run's vocabulary [0, {vocab}): it "
                                f"was preprocessed with {made_by}; re-run tools/preprocess_data.py with this "
                                f"run's tokenizer (--tokenizer-type/--tokenizer-model), or train with that one")
            fp = getattr(tokenizer, "fingerprint", None)
            if fp is not None and meta.get("tokenizer_fingerprint") != fp and other_tokenizer != "accept":
                what = (f"{prefix} was preprocessed with {made_by}, not this run's tokenizer "
                        f"({getattr(tokenizer, 'tokenizer_type', type(tokenizer).__name__)}): its ids fit the "
                        "vocabulary, but they mean other text")
                if other_tokenizer == "error":
                    raise DataError(f"{what}; re-run tools/preprocess_data.py with this run's tokenizer "
                                    f"(--tokenizer-type/--tokenizer-model), or add {OTHER_TOKENIZER_FLAG} if that "
                                    "is intended")
                if os.environ.get("RANK", "0") == "0":          # once per job, not once per rank
                    logger.warning("%s (%s given)", what, OTHER_TOKENIZER_FLAG)
            return DatasetInfo(prefix, dtype.name, int(n_seq), int(n_doc - 1), n_tokens)
        data = np.memmap(bin_path, dtype=dtype, mode="r")
        if bin_size <= _FULL_SCAN_BYTES:
            lo, hi = int(data.min()), int(data.max())
        else:  # 1024 windows of 64K tokens spread over the file
            win = 1 << 16
            starts = np.linspace(0, data.size - win, 1024).astype(np.int64)
            lo = min(int(data[s:s + win].min()) for s in starts)
            hi = max(int(data[s:s + win].max()) for s in starts)
        del data
        if hi >= vocab or lo < 0:
            bad = hi if hi >= vocab else lo
            raise DataError(f"{bin_path} holds token id {bad}, outside the tokenizer's vocabulary "
                            f"[0, {vocab}): the dataset was tokenized with another vocabulary; "
                            f"re-run tools/preprocess_data.py with this tokenizer")
    return DatasetInfo(prefix, dtype.name, int(n_seq), int(n_doc - 1), n_tokens)


# ----------------------------------------------------------------------------- building
def parse_data_path(data_path: Sequence[str] | str) -> tuple[list[str], list[float] | None]:
    """Megatron's --data-path forms: ["p"], ["p1", "p2"] (no weights) or
    ["w1", "p1", "w2", "p2", ...] (weights; any positive numbers, normalised)."""
    if isinstance(data_path, (str, os.PathLike)):
        data_path = [data_path]
    items = [str(x).strip() for x in data_path]
    if not items or any(not x for x in items):
        raise DataError(f"--data-path {' '.join(items)!r}: expected PREFIX or WEIGHT PREFIX pairs")

    def as_float(s):
        try:
            return float(s)
        except ValueError:
            return None

    if len(items) % 2 == 1 and as_float(items[0]) is not None:
        what = f"{items[-1]} has no prefix after it" if as_float(items[-1]) is not None else \
            "a weight or a prefix is missing"
        raise DataError(f"--data-path {' '.join(items)}: {len(items)} items, but a blend is WEIGHT PREFIX pairs "
                        f"({what}); e.g. --data-path 0.7 PREFIX_A 0.3 PREFIX_B, or one PREFIX alone")
    if len(items) % 2 == 0 and all(as_float(w) is not None for w in items[0::2]):
        weights = [as_float(w) for w in items[0::2]]
        prefixes = items[1::2]
        if any(w <= 0 or w != w or w == float("inf") for w in weights):
            raise DataError(f"--data-path weights must be positive numbers, got {items[0::2]}")
    else:
        if len(items) % 2 == 0 and any(as_float(w) is not None for w in items[0::2]):
            raise DataError(f"--data-path {' '.join(items)}: mixes weights and prefixes; give "
                            f"WEIGHT PREFIX pairs or prefixes only")
        weights, prefixes = None, items
    return prefixes, weights


def _parse_split(split: str) -> list[float]:
    """Megatron's --split: up to three weights separated by commas (or '/'), e.g. '969,30,1'."""
    # Megatron-LM's scripts write --split "'99,1,0'" (the inner quotes reach argv); Megatron strips them
    text = str(split).strip().strip("'\"").strip()
    vals = []
    if re.fullmatch(r"[0-9.]+(\s*[,/]\s*[0-9.]+){0,2}", text):
        try:
            vals = [float(p) for p in re.findall(r"[.0-9]+", text)]
        except ValueError:
            vals = []
    if not vals or sum(vals) <= 0:
        raise DataError(f"--split {split!r}: expected up to three non-negative weights like "
                        f"'969,30,1' (train,valid,test)")
    return vals


def _idx_fingerprint(prefix: str) -> str:
    h = hashlib.sha256()
    with open(prefix + ".idx", "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    h.update(str(os.path.getsize(prefix + ".bin")).encode())
    return h.hexdigest()[:16]


class _MegatronTokenizer:
    """What megatron-core's GPTDataset needs from a tokenizer: .eod, .vocab_size and
    .unique_identifiers (part of the index cache key: the tokenizer actually used and the data
    content). GPT-2's identifiers are its files' hashes (unchanged, so existing caches stay valid);
    any other tokenizer adds its fingerprint (a hash of all its files)."""

    def __init__(self, tokenizer, data_fingerprints: dict):
        self._tokenizer = tokenizer
        self.eod = int(tokenizer.eod)
        self.vocab_size = int(tokenizer.vocab_size)
        ids = [("class", type(tokenizer).__name__), ("vocab_size", self.vocab_size),
               ("eod", self.eod), ("vocab_sha256", getattr(tokenizer, "vocab_sha256", None)),
               ("merges_sha256", getattr(tokenizer, "merges_sha256", None))]
        if getattr(tokenizer, "vocab_sha256", None) is None:
            ids.append(("fingerprint", getattr(tokenizer, "fingerprint", None)))
        self.unique_identifiers = collections.OrderedDict([*ids, ("data", data_fingerprints)])

    def tokenize(self, text):
        return self._tokenizer.encode(text)

    def detokenize(self, ids):
        return self._tokenizer.decode(ids)


def _megatron():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed")
        from megatron.core.datasets.blended_megatron_dataset_builder import (
            BlendedMegatronDatasetBuilder,
        )
        from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    return BlendedMegatronDatasetBuilder, GPTDataset, GPTDatasetConfig


def index_cache_dir(cache_dir: str | None) -> str:
    """Where megatron-core keeps the datasets' document/sample/shuffle indices (created)."""
    from zo_megatron.data.corpus import default_cache_dir

    cache = os.path.abspath(os.path.expanduser(cache_dir or os.path.join(default_cache_dir(), "gpt_indices")))
    os.makedirs(cache, exist_ok=True)
    return cache


def _index_build_lock(cache: str):
    """Under torch.distributed megatron orders the ranks itself (rank 0 builds, barrier); independent
    processes sharing the cache take a file lock, so one builds while the others wait."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return contextlib.nullcontext()
    from zo_megatron.data.corpus import file_lock

    return file_lock(os.path.join(cache, ".build.lock"))


@contextlib.contextmanager
def _process_group_if_needed(needed: bool):
    """A private 1-rank gloo group while megatron's BlendedDataset needs get_rank()."""
    import torch.distributed as dist

    if not needed or not dist.is_available() or dist.is_initialized():
        yield
        return
    with tempfile.TemporaryDirectory(prefix="zo_data_pg_") as d:
        store = dist.FileStore(os.path.join(d, "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()


def _split_that_fits(which: int, documents: int) -> str | None:
    """The --split closest to Megatron's 969,30,1 (valid/test shares in whole percent) that gives
    split `which` at least one of `documents` documents, by megatron-core's own rounding."""
    for share in range(1, 51):
        weights = [100 - share, 0, share] if which == 2 else [100 - share, share, 0]
        edges = [0.0]
        for w in weights:
            edges.append(edges[-1] + w / 100)
        if int(round(edges[which + 1] * documents)) - int(round(edges[which] * documents)) >= 1:
            return ",".join(str(w) for w in weights)
    return None


def build_gpt_datasets(data_path: Sequence[str] | str, split: str, seq_length: int, seed: int,
                       tokenizer, train_samples: int, valid_samples: int, test_samples: int,
                       cache_dir: str | None = None, other_tokenizer: str = "error", eod_mask_loss: bool = False,
                       reset_position_ids: bool = False, reset_attention_mask: bool = False):
    """(train, valid, test) megatron-core datasets; an entry is None when its split is empty.

    data_path: ["prefix"], ["w1", "p1", "w2", "p2", ...] (weights, normalised) or
    ["p1", "p2", ...] (weighted by token count). split: "969,30,1" style, train/valid/test. Or a dict
    {"train", "valid", "test": such a list or None}: each split's own data, used whole (split unused).
    Each split holds at least the requested number of samples (megatron rounds blends up and
    repeats epochs as needed). Items are dicts of torch tensors: tokens, labels (tokens shifted by
    one), loss_mask, position_ids, each [seq_length] (plus an int dataset_id from a blend); the
    attention mask is the model's business. eod_mask_loss (Megatron-LM's --eod-mask-loss): the loss
    mask is 0 where the input token is the end-of-document id (megatron-core's rule). reset_position_ids
    (Megatron-LM's --reset-position-ids): each document's positions start again at 0 after an end-of-document
    token (megatron-core's rule). reset_attention_mask (Megatron-LM's --reset-attention-mask): items also
    carry segment_ids (:class:`DocumentSegments`), the documents the model's attention keeps apart.
    Validates every prefix first (DataError on bad data).
    Collective when torch.distributed is initialised (call it on every rank).
    """
    if int(seq_length) < 1:
        raise DataError(f"--seq-length {seq_length}: must be >= 1")
    sizes = [int(train_samples), int(valid_samples), int(test_samples)]
    if any(s < 0 for s in sizes):
        raise DataError(f"sample counts must be >= 0, got train/valid/test {sizes}")
    if isinstance(data_path, dict):
        return with_document_segments(
            _build_per_split(data_path, seq_length, seed, tokenizer, sizes, cache_dir, other_tokenizer,
                             eod_mask_loss, reset_position_ids, reset_attention_mask),
            tokenizer.eod, reset_attention_mask)
    _parse_split(split)
    (prefixes, weights), infos = _blend(data_path, tokenizer, other_tokenizer)

    Builder, GPTDataset, GPTDatasetConfig = _megatron()
    cache = index_cache_dir(cache_dir)
    adapter = _MegatronTokenizer(tokenizer, {p: _idx_fingerprint(p) for p in prefixes})
    config = GPTDatasetConfig(
        random_seed=int(seed), sequence_length=int(seq_length), blend=(prefixes, weights),
        split=str(split).strip(), path_to_cache=cache,
        mmap_bin_files=True, tokenizer=adapter, reset_position_ids=bool(reset_position_ids),
        reset_attention_mask=bool(reset_attention_mask), eod_mask_loss=bool(eod_mask_loss), create_attention_mask=False,
        num_dataset_builder_threads=1)

    # megatron loops forever on a split range without documents when samples are requested
    # (0 tokens per epoch); a range that is empty for some prefix is an error if samples are
    # wanted from it, and is not built otherwise.
    names = ("train", "valid", "test")
    for i, bookends in enumerate(config.split_matrix):
        if bookends is None:
            continue
        empty = [info for info in infos
                 if int(round(bookends[1] * info.sequences))
                 <= int(round(bookends[0] * info.sequences))]
        if empty:
            if sizes[i] > 0:
                fits = _split_that_fits(i, min(info.sequences for info in infos))
                ways = {1: "--eval-iters 0 (no evaluation)", 2: "no test samples"}.get(i, "")
                raise DataError(f"--split {split} leaves the {names[i]} split of {empty[0].prefix} "
                                f"({empty[0].sequences} documents) without documents, but "
                                f"{sizes[i]} {names[i]} samples were requested: "
                                + (f"use --split {fits} (gives it at least one document)" if fits else
                                   "the dataset has too few documents to split; use a larger one")
                                + (f", or {ways}" if ways else ""))
            config.split_matrix[i] = None
    with _index_build_lock(cache), _process_group_if_needed(weights is not None):
        datasets = Builder(GPTDataset, sizes, lambda: True, config).build()
    return with_document_segments(datasets, tokenizer.eod, reset_attention_mask)


def _blend(data_path, tokenizer, other_tokenizer: str) -> tuple[tuple[list[str], list[float] | None], list]:
    """((absolute prefixes, weights), their DatasetInfo) of one --data-path list, every prefix validated;
    weights None for one prefix (no blending layer), the token counts where none are given."""
    prefixes, weights = parse_data_path(data_path)
    prefixes = [os.path.abspath(os.path.expanduser(p)) for p in prefixes]
    infos = [validate_data_prefix(p, tokenizer, other_tokenizer) for p in prefixes]
    if len(prefixes) == 1:
        weights = None  # one dataset: no blending layer
    elif weights is None:
        # megatron would weight by sample counts and cap the blend at one epoch of everything;
        # weighting by token counts instead keeps the same proportions for any number of samples.
        weights = [float(info.tokens) for info in infos]
    return (prefixes, weights), infos


def _build_per_split(data_path: dict, seq_length: int, seed: int, tokenizer, sizes: list[int],
                     cache_dir: str | None, other_tokenizer: str, eod_mask_loss: bool, reset_position_ids: bool,
                     reset_attention_mask: bool):
    """(train, valid, test) from a blend per split ({"train", "valid", "test": --data-path list or None}),
    each used whole: megatron-core's blend_per_split (Megatron-LM's --train-data-path ...). A split
    without data is None; one asked for samples without data is refused."""
    names = ("train", "valid", "test")
    missing = [n for n, size in zip(names, sizes) if size and not data_path.get(n)]
    if missing:
        raise DataError(f"{sizes[names.index(missing[0])]} {missing[0]} samples were requested but no "
                        f"--{missing[0]}-data-path is given")
    blends = [_blend(data_path[n], tokenizer, other_tokenizer)[0] if data_path.get(n) and size else None
              for n, size in zip(names, sizes)]
    prefixes = [p for blend in blends if blend for p in blend[0]]
    Builder, GPTDataset, GPTDatasetConfig = _megatron()
    cache = index_cache_dir(cache_dir)
    config = GPTDatasetConfig(
        random_seed=int(seed), sequence_length=int(seq_length), blend_per_split=blends, split=None,
        path_to_cache=cache, mmap_bin_files=True,
        tokenizer=_MegatronTokenizer(tokenizer, {p: _idx_fingerprint(p) for p in prefixes}),
        reset_position_ids=bool(reset_position_ids), reset_attention_mask=bool(reset_attention_mask),
        eod_mask_loss=bool(eod_mask_loss), create_attention_mask=False, num_dataset_builder_threads=1)
    blended = any(blend[1] is not None for blend in blends if blend)
    with _index_build_lock(cache), _process_group_if_needed(blended):
        return tuple(Builder(GPTDataset, sizes, lambda: True, config).build())


def build_mock_gpt_datasets(split: str, seq_length: int, seed: int, tokenizer, train_samples: int,
                            valid_samples: int, test_samples: int = 0, cache_dir: str | None = None,
                            eod_mask_loss: bool = False, reset_position_ids: bool = False,
                            reset_attention_mask: bool = False):
    """(train, valid, test) of Megatron-LM's --mock-data: megatron-core's MockGPTDataset, built as
    Megatron-LM's pretrain_gpt.py builds it (no blend: config.mock). Its documents are megatron-core's
    own (100,000 of random length, each 1, 2, 3, ... modulo the vocabulary, then the end-of-document
    id; the lengths are drawn from a fixed seed, the order from `seed`), so a run measures speed and
    memory, not learning. Items are those of :func:`build_gpt_datasets`. Collective as it is."""
    _parse_split(split)
    if int(seq_length) < 1:
        raise DataError(f"--seq-length {seq_length}: must be >= 1")
    sizes = [int(train_samples), int(valid_samples), int(test_samples)]
    Builder, _, GPTDatasetConfig = _megatron()
    from megatron.core.datasets.gpt_dataset import MockGPTDataset

    cache = index_cache_dir(cache_dir)         # the index of ~200M mock tokens takes seconds: kept, as Megatron's
    config = GPTDatasetConfig(
        random_seed=int(seed), sequence_length=int(seq_length), blend=None, split=str(split).strip(),
        path_to_cache=cache, tokenizer=_MegatronTokenizer(tokenizer, {"mock": "MockGPTDataset"}),
        reset_position_ids=bool(reset_position_ids), reset_attention_mask=bool(reset_attention_mask),
        eod_mask_loss=bool(eod_mask_loss), create_attention_mask=False, num_dataset_builder_threads=1)
    for i, bookends in enumerate(config.split_matrix):      # a split asked for nothing is not built
        if bookends is not None and sizes[i] == 0:
            config.split_matrix[i] = None
    with _index_build_lock(cache), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*mock.*")
        datasets = Builder(MockGPTDataset, sizes, lambda: True, config).build()
    return with_document_segments(datasets, tokenizer.eod, reset_attention_mask)


# ----------------------------------------------------------------------------- documents
def document_segment_ids(tokens, eod: int):
    """[s] int64: the document each input token belongs to, counted from 0 in the sample; a document ends
    WITH its end-of-document token, so the token after an EOD starts the next one -- megatron-core's
    --reset-attention-mask rule (gpt_dataset.py _get_ltor_masks_and_position_ids: after an EOD at i, rows
    > i cannot see columns <= i). Token j may attend to i <= j of its own segment only."""
    import torch

    ends = (tokens == eod).to(torch.int64)
    return torch.cumsum(ends, 0) - ends


class DocumentSegments:
    """A dataset whose items also carry `segment_ids` (:func:`document_segment_ids`), computed from the
    item's tokens: megatron-core builds an [s, s] mask per sample for this (create_attention_mask), which
    the model here builds itself from the ids, once per micro-batch. Everything else is the wrapped dataset's."""

    def __init__(self, dataset, eod: int):
        self.dataset, self.eod = dataset, int(eod)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i):
        item = dict(self.dataset[i])
        item["segment_ids"] = document_segment_ids(item["tokens"], self.eod)
        return item

    def __getattr__(self, name):            # config, indices, ... of the wrapped dataset
        if name == "dataset":
            raise AttributeError(name)
        return getattr(self.dataset, name)


def with_document_segments(datasets, eod: int, on: bool) -> tuple:
    """The (train, valid, test) datasets, each wrapped in DocumentSegments where `on` (None stays None)."""
    return tuple(DocumentSegments(d, eod) if on and d is not None else d for d in datasets)


# ----------------------------------------------------------------------------- batching
def _collate(items: list[dict]) -> dict:
    import torch

    out = {}
    for key in items[0]:
        vals = [it[key] for it in items]
        out[key] = torch.stack(vals) if isinstance(vals[0], torch.Tensor) else torch.as_tensor(vals)
    return out


class DPBatches:
    """Data-parallel micro-batches, Megatron's MegatronPretrainingSampler + collation.

    The global order is the dataset's. A global batch of micro_batch_size * dp_size consecutive
    samples is cut into dp_size consecutive chunks: global sample i goes to rank
    (i // micro_batch_size) % dp_size (counting from 0). Each rank reads only its own samples.
    `consumed_samples` counts samples consumed by all ranks together (as in Megatron) and is
    advanced when a batch is handed out, so saving it after a step and passing it back as
    start_sample resumes with exactly the next batch. drop_last=False also hands out the final
    partial global batch, in which some ranks may get fewer (or no) samples.
    """

    def __init__(self, dataset, micro_batch_size: int, dp_rank: int, dp_size: int,
                 consumed_samples: int = 0, drop_last: bool = True):
        if micro_batch_size < 1 or dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise ValueError(f"bad micro_batch_size={micro_batch_size}, dp_rank={dp_rank}, "
                             f"dp_size={dp_size}")
        if not 0 <= consumed_samples <= len(dataset):
            raise ValueError(f"consumed_samples={consumed_samples} outside [0, {len(dataset)}] "
                             f"(the dataset has {len(dataset)} samples)")
        self.dataset = dataset
        self.micro_batch_size = micro_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.consumed_samples = consumed_samples
        self.drop_last = drop_last

    @property
    def global_micro_batch(self) -> int:
        return self.micro_batch_size * self.dp_size

    def _my_indices(self, start: int) -> range:
        n = len(self.dataset)
        lo = min(start + self.dp_rank * self.micro_batch_size, n)
        return range(lo, min(lo + self.micro_batch_size, start + self.global_micro_batch, n))

    def __len__(self) -> int:
        """Micro-batches this rank still gets."""
        remaining = len(self.dataset) - self.consumed_samples
        full, rest = divmod(remaining, self.global_micro_batch)
        if not self.drop_last and rest:
            full += len(self._my_indices(len(self.dataset) - rest)) > 0
        return full

    def __iter__(self) -> Iterator[dict]:
        n = len(self.dataset)
        while self.consumed_samples < n:
            start = self.consumed_samples
            if start + self.global_micro_batch > n and self.drop_last:
                return
            idx = self._my_indices(start)
            self.consumed_samples = min(start + self.global_micro_batch, n)
            if len(idx):
                yield _collate([self.dataset[i] for i in idx])

    def state_dict(self) -> dict:
        return {"consumed_samples": self.consumed_samples}


def dp_batches(dataset, micro_batch_size: int, dp_rank: int, dp_size: int, start_sample: int = 0,
               drop_last: bool = True) -> DPBatches:
    """Iterator of this DP rank's micro-batches (dicts of stacked tensors), resumable from the
    global consumed-sample index `start_sample`; see DPBatches."""
    return DPBatches(dataset, micro_batch_size, dp_rank, dp_size, start_sample, drop_last)
