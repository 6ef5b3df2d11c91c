"""Text -> Megatron indexed dataset (PREFIX_text_document.bin/.idx), Megatron-LM-compatible CLI.

    python tools/preprocess_data.py --input corpus/ --output-prefix data/my --workers 2
    python tools/preprocess_data.py --input docs.jsonl --json-keys text --output-prefix data/my

Inputs (``--input``, repeatable): a text file (one document), a directory (every ``.txt``, ``.md``,
``.markdown``, ``.rst`` and ``.text`` file below it, sorted by relative path, one document each), a
glob pattern (``'notes/**/*.org'``, sorted) or a JSON-lines file (one document per non-blank line,
its text under each of ``--json-keys``). Megatron-LM reads every input as JSON lines; here a file is
JSON lines when its name ends in ``.jsonl``/``.json``/``.ndjson``/``.jsonlines``, or -- whatever its
name -- when its first non-blank line is a JSON object holding the first ``--json-keys`` key (the
obvious case; a notice says so). Any other file is one plain-text document. Each document is encoded with
the tokenizer (``--tokenizer-type GPT2BPETokenizer``, the default: the bundled GPT-2 BPE;
``--tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR``: ``AutoTokenizer(DIR)(text).input_ids``,
BOS as its config says; ``--tokenizer-type Llama2Tokenizer --tokenizer-model FILE``: [bos] + the
SentencePiece ids, as Megatron-LM's) and followed by EOD, the tokenizer's end-of-text / eos token
(``--append-eod``, on by default; ``--no-append-eod`` turns it off). One output dataset per JSON
key: ``{output_prefix}_{key}_document.{bin,idx}``, written with
megatron-core's IndexedDatasetBuilder, one sequence per document, token dtype uint16 when the
vocabulary has fewer than 65500 entries (megatron's rule), else int32. Empty documents are skipped.
Beside each pair, ``PREFIX.meta.json`` records the tokenizer (type, directory, fingerprint, vocabulary
size) and the largest id written, so training refuses a dataset made with another vocabulary
without reading all of it (zo_megatron/data/dataset_meta.py).

Files are written under temporary names and renamed at the end (.idx last), so an interrupted run
never leaves a half-written dataset under the final name. Bad input is a one-line ``error:`` and exit
status 2. Text files are read as UTF-8 with line endings untouched, so decoding a document's tokens
(without the EOD) gives back the file's text exactly.

This module imports neither torch nor megatron at import time (megatron-core costs seconds to
import): input errors are reported before either is loaded.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import glob
import json
import logging
import os
import re
import shlex
import sys
import time
import warnings
from typing import Iterable, Iterator, Sequence

from zo_megatron.data.errors import DataError
from zo_megatron.data.dataset_meta import dataset_meta, meta_path
from zo_megatron.data.tokenizer import GPT2_TOKENIZER, TEXT_TOKENIZER_TYPES, Tokenizer, build_tokenizer, tokenizer_from_spec

logger = logging.getLogger(__name__)

JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson", ".jsonlines")
_SURROGATE = re.compile("[\ud800-\udfff]")
_BATCH_BYTES = 1 << 20  # text per encode task
_BATCH_DOCS = 512


def output_prefix_for(output_prefix: str, key: str) -> str:
    """Megatron-LM's naming: the dataset prefix written for one JSON key."""
    return f"{output_prefix}_{key}_document"


@dataclasses.dataclass
class PreprocessResult:
    documents: int          # documents written (per key, counted once per input document)
    tokens: int             # tokens written over all keys, EODs included
    seconds: float          # wall time of the whole call
    prefixes: dict          # json key -> dataset prefix (without .bin/.idx)
    skipped_empty: int = 0  # empty documents skipped
    work_seconds: float = 0.0  # reading + tokenizing + writing (no imports/pool start-up)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / max(self.work_seconds or self.seconds, 1e-9)


# ----------------------------------------------------------------------------- inputs
@dataclasses.dataclass
class _Source:
    path: str
    kind: str   # "text" | "jsonl"
    size: int


def _looks_like_json_lines(path: str, key: str) -> bool:
    """The first non-blank line (read up to 1 MiB) is a JSON object with `key`."""
    try:
        with open(path, "rb") as f:
            for raw in f:
                if raw.strip():
                    obj = json.loads(raw[: 1 << 20])
                    return isinstance(obj, dict) and key in obj
    except (OSError, ValueError):
        pass
    return False


# A directory's documents: plain text and the usual text markups, one document per file.
TEXT_SUFFIXES = (".txt", ".md", ".markdown", ".rst", ".text")


def resolve_inputs(inputs: Sequence[str], json_key: str = "text") -> list[_Source]:
    """Expand --input values into files; DataError for anything that is not there."""
    if isinstance(inputs, (str, os.PathLike)):
        inputs = [inputs]
    if not inputs:
        raise DataError("no --input given")
    sources: list[_Source] = []
    for raw in inputs:
        path = os.path.expanduser(str(raw))
        if not os.path.exists(path) and glob.has_magic(path):     # --input 'notes/*.md' (quoted or not)
            matches = sorted(m for m in glob.glob(path, recursive=True) if os.path.isfile(m))
            if not matches:
                raise DataError(f"--input {path}: the pattern matches no files")
            sources += resolve_inputs(matches, json_key)
            continue
        if os.path.isdir(path):
            found = []
            for root, dirs, files in os.walk(path):
                dirs.sort()
                found += [os.path.join(root, f) for f in files if f.lower().endswith(TEXT_SUFFIXES)]
            if not found:
                raise DataError(f"--input {path}: directory has no text files ({' '.join(TEXT_SUFFIXES)}): "
                                "pass files of other names directly or as a pattern (--input 'DIR/**/*.ext')")
            for f in sorted(found, key=lambda p: os.path.relpath(p, path)):
                sources.append(_Source(f, "text", os.path.getsize(f)))
        elif os.path.isfile(path):
            kind = "jsonl" if path.lower().endswith(JSONL_SUFFIXES) else "text"
            if kind == "text" and _looks_like_json_lines(path, json_key):
                kind = "jsonl"
                logger.info("%s: read as JSON lines (its first line is a JSON object with key %r); "
                            "name it .jsonl to say so", path, json_key)
            sources.append(_Source(path, kind, os.path.getsize(path)))
        else:
            raise DataError(f"--input {path}: no such file or directory")
    return sources


def _read_text(path: str) -> str:
    try:
        with open(path, "r", encoding="utf-8", newline="") as f:  # keep \r\n as is
            return f.read()
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text (byte {e.start}): convert it to UTF-8") from None


def _iter_jsonl(path: str, keys: Sequence[str]) -> Iterator[tuple[list[str], int]]:
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            nbytes = len(raw)
            if not raw.strip():
                yield None, nbytes  # blank line: no document, but progress
                continue
            try:
                obj = json.loads(raw)
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise DataError(f"{path}:{lineno}: not a JSON object ({e})") from None
            if not isinstance(obj, dict):
                raise DataError(f"{path}:{lineno}: expected a JSON object, got {type(obj).__name__}")
            texts = []
            for key in keys:
                if key not in obj:
                    raise DataError(f"{path}:{lineno}: JSON line has no key {key!r} (keys: "
                                    f"{', '.join(map(repr, list(obj)[:8]))}); choose the text field "
                                    f"with --json-keys")
                if not isinstance(obj[key], str):
                    raise DataError(f"{path}:{lineno}: value of {key!r} is a "
                                    f"{type(obj[key]).__name__}, expected a string")
                bad = _SURROGATE.search(obj[key])
                if bad:
                    raise DataError(f"{path}:{lineno}: value of {key!r} holds a lone UTF-16 surrogate "
                                    f"(\\u{ord(bad.group()):04x} at character {bad.start()}), which is not text: "
                                    f"fix the line's escapes (a pair \\ud83d\\ude00 is fine) or drop the line")
                texts.append(obj[key])
            yield texts, nbytes


def _iter_documents(sources: Sequence[_Source], keys: Sequence[str]
                    ) -> Iterator[tuple[list[str] | None, int]]:
    """(texts per key, bytes consumed) per document; texts None for a blank JSONL line."""
    for src in sources:
        if src.kind == "jsonl":
            yield from _iter_jsonl(src.path, keys)
        else:
            if len(keys) != 1:
                raise DataError(f"--input {src.path}: a text file holds one field; more than one "
                                f"--json-keys ({' '.join(keys)}) needs JSONL input")
            yield [_read_text(src.path)], src.size


def _iter_batches(docs: Iterable[tuple[list[str] | None, int]]):
    """Group documents into encode tasks of about _BATCH_BYTES of text."""
    batch, nbytes, size = [], 0, 0
    for texts, n in docs:
        nbytes += n
        if texts is not None:
            batch.append(texts)
            size += sum(len(t) for t in texts)
        if size >= _BATCH_BYTES or len(batch) >= _BATCH_DOCS:
            yield batch, nbytes
            batch, nbytes, size = [], 0, 0
    if batch or nbytes:
        yield batch, nbytes


# ----------------------------------------------------------------------------- encoding
def _encode_batch(tokenizer: Tokenizer, batch: list[list[str]], dtype) -> list[list]:
    """batch[doc][key] text -> [doc][key] numpy token array (EOD not yet appended)."""
    import numpy as np

    if not batch:
        return []
    nkeys = len(batch[0])
    flat = [doc[k] for doc in batch for k in range(nkeys)]
    ids = tokenizer.encode_batch(flat)
    arrays = [np.asarray(x, dtype=dtype) for x in ids]
    return [arrays[i * nkeys:(i + 1) * nkeys] for i in range(len(batch))]


_WORKER_TOKENIZER = None
_WORKER_DTYPE = None


def _worker_init(spec, fingerprint, dtype_name):
    global _WORKER_TOKENIZER, _WORKER_DTYPE
    import numpy as np

    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per worker process
    _WORKER_DTYPE = np.dtype(dtype_name)
    # An initializer that raises makes the pool respawn workers forever: keep the error for the
    # first task instead, which hands it back to the parent.
    try:
        tok = tokenizer_from_spec(spec)
        if tok.fingerprint != fingerprint:   # the files changed since the parent read them
            raise DataError(f"the tokenizer files of {spec[1:]} changed while preprocessing: run again")
        _WORKER_TOKENIZER = tok
    except DataError as e:
        _WORKER_TOKENIZER = e


def _worker_encode(batch):
    if isinstance(_WORKER_TOKENIZER, DataError):
        raise _WORKER_TOKENIZER
    return _encode_batch(_WORKER_TOKENIZER, batch, _WORKER_DTYPE)


def _encoded_stream(batches, tokenizer: Tokenizer, dtype, workers: int):
    """Yield (encoded batch, bytes) in input order; with workers > 1, a bounded-window process pool
    (spawned, so no forked tokenizer threads; at most 2 tasks per worker in flight)."""
    if workers <= 1:
        for batch, nbytes in batches:
            yield _encode_batch(tokenizer, batch, dtype), nbytes
        return
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    with ctx.Pool(workers, initializer=_worker_init,
                  initargs=(tokenizer.spec(), tokenizer.fingerprint, dtype.name)) as pool:
        pending = collections.deque()
        for batch, nbytes in batches:
            pending.append((pool.apply_async(_worker_encode, (batch,)), nbytes))
            while len(pending) >= 2 * workers:
                res, n = pending.popleft()
                yield res.get(), n
        while pending:
            res, n = pending.popleft()
            yield res.get(), n


# ----------------------------------------------------------------------------- progress
class _Progress:
    """tqdm over input bytes on a terminal; otherwise a log line every `interval` seconds."""

    def __init__(self, total_bytes: int, enabled: bool, interval: float):
        self.total, self.done, self.docs, self.tokens = total_bytes, 0, 0, 0
        self.t0 = self.last = time.monotonic()
        self.interval = interval
        self.enabled = enabled
        self.bar = None
        if enabled and sys.stderr.isatty():
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total_bytes, unit="B", unit_scale=True, unit_divisor=1024,
                                desc="tokenizing", file=sys.stderr, dynamic_ncols=True)
            except ImportError:
                pass

    def update(self, nbytes: int, docs: int, tokens: int):
        self.done += nbytes
        self.docs += docs
        self.tokens += tokens
        if self.bar is not None:
            self.bar.update(nbytes)
            self.bar.set_postfix(docs=self.docs, tokens=self.tokens, refresh=False)
        elif self.enabled and time.monotonic() - self.last >= self.interval:
            self.last = time.monotonic()
            dt = self.last - self.t0
            logger.info("%d documents, %d tokens, %.1f/%.1f MB (%.0f%%), %.0f tokens/s",
                        self.docs, self.tokens, self.done / 1e6, self.total / 1e6,
                        100.0 * self.done / max(self.total, 1), self.tokens / max(dt, 1e-9))

    def close(self):
        if self.bar is not None:
            self.bar.close()


# ----------------------------------------------------------------------------- writing
def _indexed_dataset_module():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed")
        from megatron.core.datasets import indexed_dataset
    return indexed_dataset


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def preprocess(inputs: Sequence[str], output_prefix: str, json_keys: Sequence[str] = ("text",),
               vocab_file: str | None = None, merge_file: str | None = None,
               allow_custom_vocab: bool = False, append_eod: bool = True, workers: int = 1,
               log_interval: float = 10.0, progress: bool = True,
               tokenizer: Tokenizer | None = None,
               documents: Iterable[tuple[str, int]] | None = None, *,
               tokenizer_type: str = GPT2_TOKENIZER, tokenizer_model: str | None = None,
               parse_special_tokens: bool = False) -> PreprocessResult:
    """Tokenize `inputs` into ``{output_prefix}_{key}_document.{bin,idx}`` per json key.

    `documents` (internal, used by the embedded corpus): an iterable of (text, nbytes) used instead
    of `inputs`, for a single key. Raises DataError for bad input, before anything is written.
    """
    t0 = time.monotonic()
    if isinstance(inputs, (str, os.PathLike)):
        inputs = [inputs]
    keys = list(json_keys) if json_keys else ["text"]
    if len(set(keys)) != len(keys):
        raise DataError(f"--json-keys has duplicates: {' '.join(keys)}")
    docs, total_bytes = _document_stream(inputs, keys, documents)
    if workers < 1:
        raise DataError(f"--workers {workers}: must be >= 1")
    if tokenizer is None:
        tokenizer = build_tokenizer(vocab_file, merge_file, allow_custom_vocab, tokenizer_type=tokenizer_type,
                                    tokenizer_model=tokenizer_model, parse_special_tokens=parse_special_tokens)
    output_prefix = os.path.abspath(os.path.expanduser(str(output_prefix)))
    created = _make_dirs(os.path.dirname(output_prefix))
    import numpy as np

    dtype = np.dtype(_indexed_dataset_module().DType.optimal_dtype(tokenizer.vocab_size))
    writers = _KeyWriters({k: output_prefix_for(output_prefix, k) for k in keys}, dtype,
                          eod=tokenizer.eod if append_eod else None)
    progress_ = _Progress(total_bytes, progress, log_interval)
    n_docs = n_tokens = 0
    try:
        writers.open()
        t_work = time.monotonic()
        for encoded, nbytes in _encoded_stream(_iter_batches(docs), tokenizer, dtype, workers):
            b_docs = b_tokens = 0
            for doc in encoded:
                tokens = writers.add(doc)
                b_docs += tokens > 0
                b_tokens += tokens
            n_docs += b_docs
            n_tokens += b_tokens
            progress_.update(nbytes, b_docs, b_tokens)
        progress_.close()
        writers.check_nonempty(" ".join(map(str, inputs)) if documents is None else "document stream")
        writers.commit(tokenizer)
    except BaseException:
        progress_.close()
        writers.abort()
        for d in created:              # deepest first; only if still empty
            try:
                os.rmdir(d)
            except OSError:
                break
        raise
    t_end = time.monotonic()
    return PreprocessResult(documents=n_docs, tokens=n_tokens, seconds=t_end - t0,
                            prefixes=writers.prefixes, skipped_empty=writers.n_empty, work_seconds=t_end - t_work)


def _document_stream(inputs, keys, documents):
    """(documents as ([text per key], nbytes), their total bytes) from the input files or a given stream."""
    if documents is None:
        sources = resolve_inputs(inputs, keys[0])
        return _iter_documents(sources, keys), sum(s.size for s in sources)
    if len(keys) != 1:
        raise DataError("a document stream has exactly one key")
    documents = list(documents)
    return (([text], n) for text, n in documents), sum(n for _, n in documents)


def _make_dirs(out_dir: str) -> list[str]:
    """Create `out_dir`; returns the directories created, deepest first (removed again if the run
    fails: no empty folder left behind)."""
    created = []
    d = out_dir
    while not os.path.exists(d):
        created.append(d)
        d = os.path.dirname(d)
    os.makedirs(out_dir, exist_ok=True)
    return created


class _KeyWriters:
    """One indexed dataset per json key, written under temporary names and committed by rename: a
    dataset is either complete or absent by its final name, and a failed run leaves nothing."""

    def __init__(self, prefixes: dict[str, str], dtype, eod: int | None):
        import numpy as np

        self.prefixes, self.dtype = prefixes, dtype
        self.eod = None if eod is None else np.asarray([eod], dtype=dtype)
        tag = f".tmp-{os.getpid()}-{int(time.time() * 1000) % 10**9}"
        self.tmp = {k: (p + tag + ".bin", p + tag + ".idx", p + tag + ".meta") for k, p in prefixes.items()}
        self.builders = {}
        self.id_range = {k: [None, None] for k in prefixes}    # min, max id written per key
        self.n_docs = {k: 0 for k in prefixes}
        self.n_tokens = {k: 0 for k in prefixes}
        self.n_empty = 0

    def open(self) -> None:
        idx_mod = _indexed_dataset_module()
        for k in self.prefixes:
            self.builders[k] = idx_mod.IndexedDatasetBuilder(self.tmp[k][0], dtype=self.dtype.type)

    def add(self, doc) -> int:
        """One document (an array of ids per key, in key order); returns the tokens written (0: all empty)."""
        import numpy as np

        written = 0
        for k, arr in zip(self.prefixes, doc):
            if arr.size == 0:
                self.n_empty += 1
                continue
            if self.eod is not None:
                arr = np.concatenate([arr, self.eod])
            lo, hi = int(arr.min()), int(arr.max())
            rng = self.id_range[k]
            rng[0] = lo if rng[0] is None else min(rng[0], lo)
            rng[1] = hi if rng[1] is None else max(rng[1], hi)
            self.n_docs[k] += 1
            self.n_tokens[k] += arr.size
            self.builders[k].add_document(arr, [arr.size])
            written += arr.size
        return written

    def check_nonempty(self, where: str) -> None:
        for k in self.prefixes:
            if len(self.builders[k].sequence_lengths) == 0:
                raise DataError(f"--input {where}: no non-empty {k!r} documents, nothing to write")

    def commit(self, tokenizer) -> None:
        for k in self.prefixes:
            b, i, m = self.tmp[k]
            self.builders[k].finalize(i)
            _fsync(b)
            _fsync(i)
            meta = dataset_meta(tokenizer, idx_path=i, bin_path=b, min_token_id=self.id_range[k][0],
                                max_token_id=self.id_range[k][1], documents=self.n_docs[k], tokens=self.n_tokens[k])
            with open(m, "w", encoding="utf-8") as f:
                json.dump(meta, f, indent=1)
                f.flush()
                os.fsync(f.fileno())
        # The .idx appears last, so a dataset is either complete or absent by its final name
        # (a leftover .meta.json of an older pair no longer matches the new .idx and is ignored).
        for k, p in self.prefixes.items():
            if os.path.exists(p + ".idx"):
                os.unlink(p + ".idx")
            os.replace(self.tmp[k][0], p + ".bin")
            os.replace(self.tmp[k][2], meta_path(p))
            os.replace(self.tmp[k][1], p + ".idx")

    def abort(self) -> None:
        for k, (b, i, m) in self.tmp.items():
            if k in self.builders:
                try:
                    self.builders[k].data_file.close()
                except Exception:
                    pass
            for f in (b, i, m):
                if os.path.exists(f):
                    os.unlink(f)


# ----------------------------------------------------------------------------- CLI
def get_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="preprocess_data.py",
        description="Tokenize text / JSONL into a Megatron indexed dataset "
                    "(OUTPUT_PREFIX_<key>_document.bin/.idx, plus .meta.json naming the tokenizer) with the "
                    "bundled GPT-2 tokenizer or a Hugging Face tokenizer directory.")
    g = p.add_argument_group("input data")
    g.add_argument("--input", action="extend", nargs="+", required=True, metavar="PATH",
                   help="a text file (one document), a directory of .txt/.md/.markdown/.rst/.text files, a glob "
                        "pattern, or a JSON-lines file "
                        "(.jsonl/.json/.ndjson/.jsonlines, or any file whose first line is a JSON object "
                        "with the --json-keys key; one document per line); repeatable")
    g.add_argument("--json-keys", nargs="+", default=["text"], metavar="KEY",
                   help="JSON fields to extract; one output dataset per key (default: text)")
    g.add_argument("--split-sentences", action="store_true", help=argparse.SUPPRESS)
    g.add_argument("--keep-newlines", action="store_true", help=argparse.SUPPRESS)
    g = p.add_argument_group("tokenizer")
    g.add_argument("--tokenizer-type", default=GPT2_TOKENIZER, choices=TEXT_TOKENIZER_TYPES,
                   help="GPT2BPETokenizer (default: the bundled GPT-2 BPE), HuggingFaceTokenizer "
                        "(AutoTokenizer from --tokenizer-model, offline, no remote code) or Llama2Tokenizer "
                        "(the SentencePiece model --tokenizer-model)")
    g.add_argument("--tokenizer-model", default=None, metavar="PATH",
                   help="HuggingFaceTokenizer: a local directory with tokenizer.json and tokenizer_config.json; "
                        "Llama2Tokenizer: a SentencePiece tokenizer.model file")
    g.add_argument("--vocab-file", default=None, help="GPT-2 vocab.json (default: bundled copy)")
    g.add_argument("--merge-file", default=None, help="GPT-2 merges.txt (default: bundled copy)")
    g.add_argument("--allow-custom-vocab", action="store_true",
                   help="accept --vocab-file/--merge-file that are not GPT-2's (hash is logged)")
    g.add_argument("--parse-special-tokens", action="store_true",
                   help="HuggingFaceTokenizer: special-token text inside a document (\"</s>\", \"<|im_start|>\") "
                        "becomes the special ids, as Megatron-LM's tokenizer does (default: encoded as ordinary "
                        "text, so a document cannot inject an end-of-document or BOS id)")
    g.add_argument("--append-eod", action=argparse.BooleanOptionalAction, default=True,
                   help="append the end-of-document token after each document: GPT-2's <|endoftext|>, a "
                        "Hugging Face tokenizer's eos token (default: on)")
    g = p.add_argument_group("output data")
    g.add_argument("--output-prefix", required=True, help="path prefix of the output dataset(s)")
    g = p.add_argument_group("runtime")
    g.add_argument("--workers", type=int, default=1,
                   help="tokenizer processes (1: tokenize in this process, which may still use "
                        "several threads; set TOKENIZERS_PARALLELISM=false to forbid that)")
    g.add_argument("--log-interval", type=float, default=10.0,
                   help="seconds between progress log lines when stderr is not a terminal")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = get_parser().parse_args(argv)
    log = logging.getLogger("zo_megatron.data")
    if not log.handlers and not logging.getLogger().handlers:  # ours only, not megatron's chatter
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)
        log.propagate = False
    log.setLevel(logging.INFO)
    try:
        if args.split_sentences:
            raise DataError("--split-sentences is not supported (GPT pretraining wants whole "
                            "documents): drop the flag")
        res = preprocess(args.input, args.output_prefix, json_keys=args.json_keys,
                         vocab_file=args.vocab_file, merge_file=args.merge_file,
                         allow_custom_vocab=args.allow_custom_vocab, append_eod=args.append_eod,
                         workers=args.workers, log_interval=args.log_interval,
                         tokenizer_type=args.tokenizer_type, tokenizer_model=args.tokenizer_model,
                         parse_special_tokens=args.parse_special_tokens)
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: no output written", file=sys.stderr)
        return 130
    logger.info("done: %d documents, %d tokens in %.1f s (%.1f s tokenizing, %.0f tokens/s)%s",
                res.documents, res.tokens, res.seconds, res.work_seconds, res.tokens_per_second,
                f"; skipped {res.skipped_empty} empty" if res.skipped_empty else "")
    for k, prefix in res.prefixes.items():
        logger.info("  %s: %s.bin (%.2f MB) + .idx  -> --data-path %s", k, prefix,
                    os.path.getsize(prefix + ".bin") / 1e6, shlex.quote(prefix))
    return 0


if __name__ == "__main__":
    sys.exit(main())
