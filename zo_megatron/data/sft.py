"""Supervised fine-tuning data (--sft): Megatron-LM's SFTDataset and SFTTokenizer rules (core_v0.16.1).

    train, valid, test = build_sft_datasets(["chats.jsonl"], "98,1,1", seq_length=4096, seed=1234,
                                            tokenizer=hf_tok, prompt_format="chat-template",
                                            train_samples=N, valid_samples=M, test_samples=0)
    item = train[i]   # tokens, labels, loss_mask, position_ids, segment_ids: [seq_length] each

Input: .jsonl files, one JSON object per line holding "messages": [{"role", "content"}, ...]. A line may
hold several conversations, each starting at a "system" message; one line becomes one sample (Megatron-LM's
packing): each conversation is rendered by the prompt format, tokenized, an end-of-document token appended
unless it ends with one; positions restart at 0 per conversation; the pack is cut at seq_length (+1 for the
shift) or padded with the format's pad id. The loss sees only the assistant turns (less a fixed-length
assistant prefix for the Nemotron formats) and the appended end-of-document tokens. segment_ids number the
conversations (the padding belongs to the last one): token j attends to i iff i <= j and both are in the same
conversation (the model builds that mask). The samples of a split take its lines in file order, cycling
when more samples are asked than there are lines, as Megatron-LM's SFTDataset does (no shuffle; a blend's
order comes from megatron-core's BlendedDataset and `seed`). --sft-pack-lines (ours, sft_packing.py) packs
consecutive lines into each sample instead, for files of one conversation per line.

Large files: the reader indexes the byte offset of every non-blank line once (numpy, chunked, progress
logged) and parses a line only when its sample is read; a bad line is a DataError naming file:line.
Prompt formats: see PROMPT_FORMATS and docs/data.md ("Supervised fine-tuning").
"""

from __future__ import annotations

import collections
import functools
import hashlib
import itertools
import json
import logging
import os
import time
import warnings
from typing import Iterable, Sequence

from zo_megatron.data.errors import DataError

logger = logging.getLogger(__name__)

IGNORE_INDEX = -100          # a target the loss does not see (Megatron-LM's IGNORE_INDEX)
ROLES = ("system", "user", "assistant")
PROMPT_FORMATS = ("nemotron-h-aligned", "nemotron-nano-v2", "chat-template")
_LINE_FORMAT = 'each line must be {"messages": [{"role": "system"|"user"|"assistant", "content": "..."}, ...]}'

# Megatron-LM's Nemotron chat templates (megatron/training/tokenizer/sft_tokenizer.py), character for
# character: the token ids of a conversation depend on every byte of them.
_NEMOTRON_H_ALIGNED = (
    "{% for message in messages %}{% if message['role'] == 'system' %}{{ '<SPECIAL_10>System\n' + "
    "message['content'].strip() + '\n' }}{% elif message['role'] == 'user' %}{{ '<SPECIAL_11>User\n' + "
    "message['content'].strip() + '\n' + '<SPECIAL_11>Assistant\n' }}{% elif message['role'] == 'assistant' %}"
    "{{ message['content'].strip() + '\n' }}{% endif %}{% endfor %}")
_NEMOTRON_NANO_V2 = (
    "{% for message in messages %}{% set content = message['content'] %}{% if message['role'] == 'system' %}"
    "{{ '<SPECIAL_10>System\n' + content.replace('/think', '').replace('/no_think', '').strip() + '\n' }}"
    "{% elif message['role'] == 'user' %}{{ '<SPECIAL_11>User\n' + content.replace('/think', '')"
    ".replace('/no_think', '').strip() + '\n' }}{% elif message['role'] == 'assistant' %}"
    "{{ '<SPECIAL_11>Assistant\n' + content.strip() + '\n<SPECIAL_12>\n' }}{% endif %}{% endfor %}")

# Megatron-LM's PromptConfig of each format (assistant_prefix_len, pad token, has_bos, has_system_role), and
# the special tokens its template writes, which must each be one token of the tokenizer, and the assistant
# prefix that assistant_prefix_len counts.
_NemotronSpec = collections.namedtuple("_NemotronSpec", "template assistant_prefix_len pad_token has_bos "
                                                        "has_system_role special_tokens assistant_prefix")
_NEMOTRON = {
    "nemotron-h-aligned": _NemotronSpec(_NEMOTRON_H_ALIGNED, 0, "<SPECIAL_233>", False, True,
                                        ("<SPECIAL_10>", "<SPECIAL_11>"), ""),
    "nemotron-nano-v2": _NemotronSpec(_NEMOTRON_NANO_V2, 3, "<unk>", False, True,
                                      ("<SPECIAL_10>", "<SPECIAL_11>", "<SPECIAL_12>"),
                                      "<SPECIAL_11>Assistant\n"),
}


# ----------------------------------------------------------------------------- the .jsonl reader
_CHUNK = 16 << 20            # bytes read per step while indexing
_PROGRESS_BYTES = 64 << 20   # files at least this large log their indexing
_PROGRESS_EVERY_S = 5.0


def _index_lines(path: str):
    """(starts, blanks): the byte offset of every line holding non-space text (int64), and for each blank
    line the number of non-blank lines before it (to give file line numbers). Reads the file in chunks:
    a large file is never held in memory, nor parsed."""
    import numpy as np

    space = np.zeros(256, dtype=bool)
    space[[9, 10, 11, 12, 13, 32]] = True
    size = os.path.getsize(path)
    starts, blanks = [], []
    seen = 0                     # non-blank lines so far
    line_start, line_has_text = 0, False     # the line running into the next chunk
    pos, t0 = 0, time.monotonic()
    last_log = t0
    if size >= _PROGRESS_BYTES:
        logger.info("--sft: indexing %s (%.2f GiB)", path, size / 2**30)
    with open(path, "rb") as f:
        while buf := f.read(_CHUNK):
            a = np.frombuffer(buf, dtype=np.uint8)
            nl = np.flatnonzero(a == 10)
            seg_lo = np.concatenate(([0], nl + 1))
            seg_hi = np.concatenate((nl, [a.size]))
            # per newline-separated piece: any non-space byte. A JSON line starts with one, so only pieces
            # that start with a space (or are empty) are looked at whole: a byte-wide pass would cost 5x.
            has = ~space[np.where(seg_lo < seg_hi, a[np.minimum(seg_lo, a.size - 1)], 10)]
            for k in np.flatnonzero(~has):
                has[k] = bool(buf[seg_lo[k]:seg_hi[k]].strip())
            if nl.size:
                lo = np.concatenate(([line_start], pos + nl[:-1] + 1))
                full = has[:nl.size].copy()
                full[0] |= line_has_text
                starts.append(lo[full])
                counted = np.cumsum(full)
                blanks.append(seen + counted[~full])
                seen += int(counted[-1])
                line_start, line_has_text = pos + int(nl[-1]) + 1, bool(has[-1])
            else:
                line_has_text = line_has_text or bool(has[0])
            pos += a.size
            now = time.monotonic()
            if size >= _PROGRESS_BYTES and now - last_log >= _PROGRESS_EVERY_S:
                logger.info("--sft: indexing %s: %.0f%% (%d lines with text), %.0f s", path, 100 * pos / size,
                            seen, now - t0)
                last_log = now
    if line_has_text:            # a last line without a newline
        starts.append(np.array([line_start], dtype=np.int64))
    if size >= _PROGRESS_BYTES:
        logger.info("--sft: indexed %s: %d lines with text in %.1f s", path, sum(map(len, starts)),
                    time.monotonic() - t0)
    cat = (lambda xs: np.concatenate(xs).astype(np.int64) if xs else np.zeros(0, dtype=np.int64))
    return cat(starts), cat(blanks)


def _messages(raw: bytes, where: str) -> list[dict]:
    """The "messages" of one line, checked: DataError naming `where` (file:line) and the fix otherwise."""
    try:
        obj = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise DataError(f"{where}: not valid JSON ({str(e).splitlines()[0][:120]}); {_LINE_FORMAT}") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("messages"), list):
        what = "an object without a \"messages\" list" if isinstance(obj, dict) else f"a JSON {type(obj).__name__}"
        raise DataError(f"{where}: {what}; {_LINE_FORMAT}")
    messages = obj["messages"]
    if not messages:
        raise DataError(f"{where}: \"messages\" is empty; give at least one conversation, or remove the line")
    for k, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise DataError(f"{where}: messages[{k}] is not an object with \"role\" and \"content\"; {_LINE_FORMAT}")
        if m["role"] not in ROLES:
            raise DataError(f"{where}: messages[{k}] has role {m['role']!r}; the roles are {', '.join(ROLES)} "
                            "(lower case)")
        if not isinstance(m["content"], str):
            raise DataError(f"{where}: messages[{k}] has a {type(m['content']).__name__} content; it must be a "
                            "string (text only)")
    for lo, hi in conversation_spans(messages):
        for k in range(lo, hi):
            if messages[k]["role"] != "assistant":
                continue
            # Megatron-LM asserts both (sft_tokenizer.py): a reply answers a user turn, and is not empty
            if k == lo or messages[k - 1]["role"] != "user":
                raise DataError(f"{where}: messages[{k}] is an assistant turn not preceded by a user turn; each "
                                "assistant turn must answer the user turn just before it")
            if not messages[k]["content"]:
                raise DataError(f"{where}: messages[{k}] is an empty assistant turn; give it text, or drop it with "
                                "the user turn before it")
    return messages


def conversation_spans(messages: Sequence[dict]) -> list[tuple[int, int]]:
    """[lo, hi) of each conversation in a line's messages: a new one starts at every system message
    (Megatron-LM's _split_conversations); messages before the first system message are the first one."""
    bounds = [k for k, m in enumerate(messages) if k == 0 or m["role"] == "system"]
    return list(zip(bounds, bounds[1:] + [len(messages)]))


class JsonlConversations:
    """The low-level dataset of one .jsonl file: element i is the checked "messages" list of its i-th line
    holding text (blank lines are skipped, as Megatron-LM's JSON loader does). Lines are read with pread,
    so forked data-loader workers can share the object."""

    def __init__(self, path: str):
        self.path = os.path.abspath(path)
        self._starts, self._blanks = _index_lines(self.path)
        self._fd = None
        if not len(self._starts):
            raise DataError(f"{self.path} holds no conversations (no line with text); {_LINE_FORMAT}")

    def __len__(self) -> int:
        return len(self._starts)

    def line_number(self, i: int) -> int:
        """The 1-based line of the file that element i is."""
        import numpy as np

        return int(i) + 1 + int(np.searchsorted(self._blanks, i, side="right"))

    def where(self, i: int) -> str:
        return f"{self.path}:{self.line_number(i)}"

    def raw(self, i: int) -> bytes:
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDONLY)
        parts, offset, n = [], int(self._starts[i]), 1 << 16
        while chunk := os.pread(self._fd, n, offset):
            j = chunk.find(b"\n")
            if j >= 0:
                parts.append(chunk[:j])
                break
            parts.append(chunk)
            offset, n = offset + len(chunk), min(2 * n, 1 << 26)
        return b"".join(parts)

    def __getitem__(self, i: int) -> list[dict]:
        return _messages(self.raw(i), self.where(i))

    def __getstate__(self):
        return {**self.__dict__, "_fd": None}

    def __del__(self):
        if getattr(self, "_fd", None) is not None:
            os.close(self._fd)


_OPENED: dict = {}


def open_jsonl(path: str) -> JsonlConversations:
    """The indexed file, indexed once per process while it is unchanged (the builder asks again per split)."""
    path = os.path.abspath(path)
    st = os.stat(path)
    key = (path, st.st_size, st.st_mtime_ns, st.st_ino)
    if key not in _OPENED:
        _OPENED[key] = JsonlConversations(path)
    return _OPENED[key]


# ----------------------------------------------------------------------------- prompt formats
class ConversationFormat:
    """How one conversation becomes (tokens, targets): a prompt format over a Hugging Face tokenizer.
    targets[k] is tokens[k] where the loss sees it, IGNORE_INDEX elsewhere. `pad` and `eod` are ids."""

    name = ""
    template = ""

    def __init__(self, tokenizer):
        self.tok = tokenizer.hf_tokenizer
        self.eod = int(tokenizer.eod)
        self.vocab_size = int(tokenizer.vocab_size)
        self.fingerprint = getattr(tokenizer, "fingerprint", None)
        self.model_dir = getattr(tokenizer, "model_dir", "")

    def render(self, messages, where: str, generation_prompt: bool = False) -> str:
        try:        # transformers renders in its sandboxed Jinja environment: a template runs no user code
            return self.tok.apply_chat_template(list(messages), chat_template=self.template, tokenize=False,
                                                add_generation_prompt=generation_prompt)
        except Exception as e:  # noqa: BLE001 - a user template raises anything Jinja or its code raises
            first = (str(e).strip().splitlines() or [""])[0][:160]
            raise DataError(f"{where}: the {self.name} chat template fails on it ({type(e).__name__}: {first})") \
                from None

    def encode(self, texts: list[str], offsets: bool = False):
        # as apply_chat_template(tokenize=True): no BOS/EOS added (templates write their own), special-token
        # text parsed into the special ids (a template's markup is meant)
        return self.tok(texts, add_special_tokens=False, split_special_tokens=False,
                        return_offsets_mapping=offsets)

    def identifiers(self) -> dict:
        return {"prompt_format": self.name, "tokenizer": self.fingerprint, "pad": self.pad, "eod": self.eod,
                "template_sha256": hashlib.sha256(self.template.encode()).hexdigest()}


class NemotronFormat(ConversationFormat):
    """Megatron-LM's SFTTokenizer.tokenize_conversation: the whole conversation tokenized at once; each turn
    rendered and tokenized alone gives its length; system and user turns, and the first assistant_prefix_len
    tokens of each assistant turn, are IGNORE. The turns alone must tokenize as they do together (Megatron-LM
    asserts it; here a DataError)."""

    def __init__(self, tokenizer, name: str):
        super().__init__(tokenizer)
        self.name, self.spec = name, _NEMOTRON[name]
        self.template = self.spec.template
        unk = self.tok.unk_token_id
        for t in (*self.spec.special_tokens, self.spec.pad_token):
            i = self.tok.convert_tokens_to_ids(t)
            # the pad need only be an id; the template's tokens must also stay one token inside text
            ok = isinstance(i, int) and (i != unk or t == self.tok.unk_token) and (
                t == self.spec.pad_token or self.encode([t])["input_ids"][0] == [i])
            if not ok:
                raise DataError(f"--sft-tokenizer-prompt-format {name} writes {t}, which is not a special token of "
                                f"the tokenizer {self.model_dir} (it needs {', '.join(self.spec.special_tokens)} and "
                                f"the pad {self.spec.pad_token}: a Nemotron tokenizer); use "
                                "--sft-tokenizer-prompt-format chat-template for other tokenizers")
        self.pad = int(self.tok.convert_tokens_to_ids(self.spec.pad_token))
        if self.spec.assistant_prefix:
            n = len(self.encode([self.spec.assistant_prefix])["input_ids"][0])
            if n != self.spec.assistant_prefix_len:
                # Megatron-LM masks a fixed count (3, Nemotron's tokenizer); with another the mask is off
                logger.warning("--sft-tokenizer-prompt-format %s masks the first %d tokens of each assistant turn "
                               "(Megatron-LM's rule), but this tokenizer writes its prefix %r in %d tokens",
                               name, self.spec.assistant_prefix_len, self.spec.assistant_prefix, n)

    def tokenize(self, conversation: list[dict], where: str) -> tuple[list[int], list[int]]:
        if not self.spec.has_system_role and conversation[0]["role"] == "system":
            conversation = conversation[1:]
        texts = [self.render(conversation, where)] + [self.render([m], where) for m in conversation]
        ids = self.encode(texts)["input_ids"]
        tokens, pieces, targets = ids[0], [], []
        for k, (m, turn) in enumerate(zip(conversation, ids[1:])):
            if self.spec.has_bos and k > 0:
                turn = turn[1:]          # one BOS, at the start of the conversation
            pieces += turn
            if m["role"] == "assistant":
                n = min(self.spec.assistant_prefix_len, len(turn))
                targets += [IGNORE_INDEX] * n + turn[n:]
            else:
                targets += [IGNORE_INDEX] * len(turn)
        if pieces != tokens:
            raise DataError(f"{where}: its turns tokenize differently alone than together (Megatron-LM's {self.name} "
                            "masking needs them equal, and asserts it); use --sft-tokenizer-prompt-format "
                            "chat-template, which locates the turns by characters")
        return tokens, targets


class ChatTemplateFormat(ConversationFormat):
    """The tokenizer's own chat template (tokenizer_config.json). Assistant turn i's text is located by
    rendering prefixes: messages[:i] with the generation prompt ends where it starts, messages[:i+1] where it
    ends (its end-of-turn markup included); the whole conversation is tokenized once and a token is a target
    when its characters (the fast tokenizer's offsets) overlap such a span, the rule of transformers'
    return_assistant_tokens_mask. Per-turn renderings need not be pieces of the whole (Llama 3's and Qwen's
    templates add system blocks); each prefix rendering must be a prefix of the whole, which templates
    that rewrite earlier turns break: such a conversation is refused."""

    name = "chat-template"

    def __init__(self, tokenizer):
        super().__init__(tokenizer)
        template = self.tok.chat_template
        if isinstance(template, dict):           # named templates: the default one renders conversations
            template = template.get("default")
        if not template:
            raise DataError(f"--sft-tokenizer-prompt-format chat-template: the tokenizer {self.model_dir} has no "
                            "chat template; add \"chat_template\" to its tokenizer_config.json (or a "
                            "chat_template.jinja), or use nemotron-h-aligned / nemotron-nano-v2")
        self.template = template
        pad = self.tok.pad_token_id
        self.pad = int(self.eod if pad is None else pad)

    def tokenize(self, conversation: list[dict], where: str) -> tuple[list[int], list[int]]:
        whole = self.render(conversation, where)
        spans = []
        for i, m in enumerate(conversation):
            if m["role"] != "assistant":
                continue
            begin = self.render(conversation[:i], where, generation_prompt=True)
            end = self.render(conversation[:i + 1], where)
            if not (whole.startswith(begin) and whole.startswith(end) and len(end) > len(begin)):
                which = "the turns before it with the generation prompt" if not whole.startswith(begin) else \
                    "the turns up to it" if not whole.startswith(end) else "it (no text after the generation prompt)"
                raise DataError(f"{where}: the chat template renders {which} differently from the whole "
                                f"conversation (assistant turn messages[{i}] of this conversation), so its text "
                                "cannot be located: the template rewrites earlier turns once later ones follow; "
                                "use a template that renders each turn the same whatever follows")
            spans.append((len(begin), len(end)))
        enc = self.encode([whole], offsets=True)
        tokens, offsets = enc["input_ids"][0], enc["offset_mapping"][0]
        targets = [IGNORE_INDEX] * len(tokens)
        s = 0
        for k, (lo, hi) in enumerate(offsets):       # spans and offsets ascend: one sweep
            while s < len(spans) and lo >= spans[s][1]:
                s += 1
            if s == len(spans):
                break
            if hi > spans[s][0]:
                targets[k] = tokens[k]
        return tokens, targets


def conversation_format(tokenizer, prompt_format: str) -> ConversationFormat:
    """The --sft-tokenizer-prompt-format over the run's tokenizer (a HuggingFaceTokenizer, as Megatron-LM's
    SFTTokenizer); DataError in one line otherwise."""
    from zo_megatron.data.tokenizer import HuggingFaceTokenizer

    if not isinstance(tokenizer, HuggingFaceTokenizer):
        raise DataError(f"--sft renders conversations with a Hugging Face tokenizer, not "
                        f"{getattr(tokenizer, 'tokenizer_type', type(tokenizer).__name__)} (as Megatron-LM's "
                        "SFTTokenizer): use --tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR")
    if prompt_format == "chat-template":
        return ChatTemplateFormat(tokenizer)
    if prompt_format in _NEMOTRON:
        return NemotronFormat(tokenizer, prompt_format)
    raise DataError(f"--sft-tokenizer-prompt-format {prompt_format}: the formats are {', '.join(PROMPT_FORMATS)}")


# ----------------------------------------------------------------------------- packing
def pack_sample(pieces: Iterable[tuple[list[int], list[int]]], seq_length: int, eod: int, pad: int) -> dict:
    """One sample from the (tokens, targets) of a line's conversations, Megatron-LM's SFTDataset packing.

    Each conversation gets an end-of-document token (target: itself) unless it ends with one, and positions
    from 0. The pack stops at the conversation that makes it seq_length + 1 tokens or more (the +1 is the
    label shift; later conversations are not tokenized), keeping seq_length tokens and then one pad; a
    shorter pack is padded to seq_length + 1 with `pad` (positions counting on). labels are the targets
    shifted by one, with the next input token where the target is IGNORE, so every label is a valid id;
    loss_mask is 0 there and on padding. segment_ids: each position's conversation (0, 1, ...); the padding
    belongs to the last one (Megatron-LM's cu_seqlens end at seq_length)."""
    import torch

    n = int(seq_length)
    tokens, targets, positions, cu = [], [], [], [0]
    for toks, tgts in pieces:
        toks, tgts = list(toks), list(tgts)
        if not toks or toks[-1] != eod:
            toks.append(eod)
            tgts.append(eod)
        tokens += toks
        targets += tgts
        positions += range(len(toks))
        cu.append(len(tokens))
        if len(tokens) >= n + 1:
            # Megatron-LM 0.16.1 writes pack_tokens.extend(pad) with an int pad here (a TypeError); its intent,
            # per its own comment (every list seq_length + 1 long), is seq_length tokens, then one pad.
            tokens, targets, positions = tokens[:n] + [pad], targets[:n] + [pad], positions[:n + 1]
            cu[-1] = n
            break
    real = min(len(tokens), n)      # positions >= real are padding (the pad after a cut included)
    if len(tokens) < n + 1:
        more = n + 1 - len(tokens)
        tokens += [pad] * more
        targets += [pad] * more
        positions += range(positions[-1] + 1, positions[-1] + 1 + more)
        cu[-1] = n
    t = torch.tensor(tokens, dtype=torch.int64)
    g = torch.tensor(targets, dtype=torch.int64)
    ignore = g[1:] == IGNORE_INDEX
    labels = torch.where(ignore, t[1:], g[1:])
    # Padding is masked by position, not by comparing labels with the pad id as Megatron-LM does: where
    # pad == eos (chat-template tokenizers without a pad token) that would also mask every real EOS target.
    loss_mask = (~ignore).to(torch.float32)
    loss_mask[real - 1:] = 0.0           # label j is token j + 1: padding from position real - 1 on
    bounds = torch.tensor(cu, dtype=torch.int64)
    segment_ids = torch.searchsorted(bounds, torch.arange(n), right=True) - 1
    return {"tokens": t[:-1].clone(), "labels": labels, "loss_mask": loss_mask,
            "position_ids": torch.tensor(positions[:-1], dtype=torch.int64), "segment_ids": segment_ids}


def line_pieces(conversations: JsonlConversations, i: int, fmt: ConversationFormat):
    """The (tokens, targets) of each conversation of element i, tokenized as it is consumed (lazily: the
    pack that stops early tokenizes no more). --sft-pack-lines counts a line's tokens through this too."""
    messages, where = conversations[i], conversations.where(i)
    return (fmt.tokenize(messages[lo:hi], f"{where}: conversation {c + 1} (messages[{lo}:{hi}])")
            for c, (lo, hi) in enumerate(conversation_spans(messages)))


def sft_sample(conversations: JsonlConversations, i: int, fmt: ConversationFormat, seq_length: int) -> dict:
    """The packed sample of element i of a .jsonl file (see pack_sample)."""
    return pack_sample(line_pieces(conversations, i, fmt), seq_length, fmt.eod, fmt.pad)


@functools.cache
def _dataset_class():
    """SFTDataset, defined on first use: megatron-core takes seconds to import, and importing this module
    (the launcher's checks) must not."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed")
        from megatron.core.datasets.megatron_dataset import MegatronDataset
    from zo_megatron.data.sft_packing import sample_lines, split_packs

    class SFTDataset(MegatronDataset):
        """Megatron-LM's SFTDataset: element idx is the packed sample of line indices[idx % len(indices)] of the
        split (lines in file order, cycling), or of pack idx % packs under --sft-pack-lines; len() the samples
        asked for (one epoch when None)."""

        def __init__(self, dataset, dataset_path, indices, num_samples, index_split, config):
            super().__init__(dataset, dataset_path, indices, num_samples, index_split, config)
            self.format = config.tokenizer.format
            # --sft-pack-lines: pack p is lines indices[packs[p]:packs[p + 1]] (sft_packing.py); None: one a line
            self.packs = split_packs(config.tokenizer.line_counts, dataset_path, indices, config.sequence_length)

        @staticmethod
        def numel_low_level_dataset(low_level_dataset) -> int:
            return len(low_level_dataset)

        @staticmethod
        def build_low_level_dataset(dataset_path, config):
            return open_jsonl(dataset_path)

        def __len__(self) -> int:
            if self.num_samples is not None:
                return int(self.num_samples)
            return len(self.indices) if self.packs is None else len(self.packs) - 1

        def __getitem__(self, idx: int) -> dict:
            if self.packs is None:
                line = int(self.indices[int(idx) % len(self.indices)])
                return sft_sample(self.dataset, line, self.format, self.config.sequence_length)
            # a pack is one sample of all its lines' conversations, in order: as one line holding them all
            pieces = itertools.chain.from_iterable(line_pieces(self.dataset, i, self.format)
                                                   for i in sample_lines(self.packs, self.indices, idx))
            return pack_sample(pieces, self.config.sequence_length, self.format.eod, self.format.pad)

    SFTDataset.__module__, SFTDataset.__qualname__ = __name__, "SFTDataset"
    return SFTDataset


def __getattr__(name):
    if name == "SFTDataset":
        return _dataset_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class _ConfigTokenizer:
    """What megatron-core's config and MegatronDataset read from a tokenizer (eod, vocab_size,
    unique_identifiers: part of the cache key of a blend's indices), and the format the samples use. It has
    no `pad`: MegatronDataset would warn where pad == eos, and padding here is masked by position.
    line_counts: {file: its lines' token counts} under --sft-pack-lines (which the key then names), else None."""

    def __init__(self, fmt: ConversationFormat, files: Sequence[str], line_counts: dict | None = None):
        self.format, self.line_counts = fmt, line_counts
        self.eod, self.vocab_size = fmt.eod, fmt.vocab_size
        data = {}
        for f in files:
            st = os.stat(f)
            data[f] = f"{st.st_size}:{st.st_mtime_ns}"
        self.unique_identifiers = collections.OrderedDict([("class", "SFTTokenizer"), *fmt.identifiers().items(),
                                                           ("data", data)])
        if line_counts is not None:     # only then: the key of an unpacked run stays what it was
            self.unique_identifiers["pack_lines"] = True


# ----------------------------------------------------------------------------- building
def _checked_jsonl(path: str) -> str:
    """The absolute path of a --data-path entry for --sft: an existing .jsonl file (one line otherwise)."""
    p = os.path.abspath(os.path.expanduser(str(path)))
    flag = f"--data-path {path}"
    if os.path.isdir(p):
        raise DataError(f"{flag} is a directory; --sft reads .jsonl files: name each one (WEIGHT FILE pairs blend "
                        "them)")
    if not p.endswith(".jsonl"):
        hint = "give the .jsonl file itself, as Megatron-LM's --sft does"
        if os.path.isfile(p + ".jsonl"):
            hint = f"did you mean {path}.jsonl?"
        elif os.path.isfile(p + ".idx") or os.path.isfile(p + ".bin"):
            hint = "that is a preprocessed (indexed) dataset; --sft reads the conversations themselves, a .jsonl file"
        raise DataError(f"{flag}: --sft reads .jsonl files of conversations; {hint}")
    if not os.path.isfile(p):
        raise DataError(f"{flag}: no such file; --sft reads .jsonl files of conversations ({_LINE_FORMAT})")
    return p


def _sft_blend(data_path, samples_of=None) -> tuple[tuple[list[str], list[float] | None], list[int]]:
    """((absolute .jsonl paths, weights), their line counts) of one --data-path list; weights None for one
    file, the files' sample counts where none are given (megatron's own proportions): their lines, or
    `samples_of(path)` (--sft-pack-lines: the packs of the file, which counts its tokens first)."""
    from zo_megatron.data.datasets import parse_data_path

    paths, weights = parse_data_path(data_path)
    paths = [_checked_jsonl(p) for p in paths]
    lines = [len(open_jsonl(p)) for p in paths]
    samples = [samples_of(p) for p in paths] if samples_of else lines
    if len(paths) == 1:
        weights = None
    elif weights is None:
        weights = [float(n) for n in samples]
    return (paths, weights), lines


def _config(fmt, seq_length, seed, cache, files, line_counts=None, **blend):
    from zo_megatron.data.datasets import _megatron

    GPTDatasetConfig = _megatron()[2]
    return GPTDatasetConfig(
        random_seed=int(seed), sequence_length=int(seq_length), path_to_cache=cache, mmap_bin_files=True,
        tokenizer=_ConfigTokenizer(fmt, files, line_counts), reset_position_ids=False, reset_attention_mask=False,
        eod_mask_loss=False, create_attention_mask=False, num_dataset_builder_threads=1, **blend)


def build_sft_datasets(data_path, split: str | None, seq_length: int, seed: int, tokenizer, prompt_format: str,
                       train_samples: int, valid_samples: int, test_samples: int, cache_dir: str | None = None,
                       pack_lines: bool = False):
    """(train, valid, test) SFTDatasets (or megatron-core BlendedDatasets of them); an entry is None where its
    split asks for no samples.

    data_path: ["a.jsonl"], ["w1", "a.jsonl", "w2", "b.jsonl", ...] (weights, normalised) or [paths] (weighted
    by line count), cut by `split` ("969,30,1" style, by lines); or a dict {"train", "valid", "test": such a
    list or None}, each split's own files used whole (split unused). prompt_format: one of PROMPT_FORMATS.
    Items: tokens, labels, loss_mask, position_ids, segment_ids, each [seq_length] (plus an int dataset_id
    from a blend). pack_lines (--sft-pack-lines, ours): a sample packs consecutive lines of its split
    (sft_packing.py), each file's lines tokenized once first to count them. Collective when
    torch.distributed is initialised (call it on every rank), as build_gpt_datasets; DataError in one
    line on bad files, paths or splits (and, with pack_lines, on the first bad line of a file).
    """
    from zo_megatron.data.datasets import (
        _index_build_lock, _megatron, _parse_split, _process_group_if_needed, _split_that_fits, index_cache_dir)
    from zo_megatron.data.sft_packing import LinePacking

    if int(seq_length) < 1:
        raise DataError(f"--seq-length {seq_length}: must be >= 1")
    sizes = [int(train_samples), int(valid_samples), int(test_samples)]
    if any(s < 0 for s in sizes):
        raise DataError(f"sample counts must be >= 0, got train/valid/test {sizes}")
    if not data_path:
        raise DataError("--sft trains on .jsonl files of conversations: add --data-path FILE.jsonl")
    fmt = conversation_format(tokenizer, prompt_format)
    names = ("train", "valid", "test")
    cache = index_cache_dir(cache_dir)
    Builder = _megatron()[0]
    packing = LinePacking(fmt, seq_length, cache, open_jsonl, line_pieces) if pack_lines else None
    samples_of, line_counts = (packing.samples_of, packing.counts) if packing else (None, None)
    if isinstance(data_path, dict):
        missing = [n for n, size in zip(names, sizes) if size and not data_path.get(n)]
        if missing:
            raise DataError(f"{sizes[names.index(missing[0])]} {missing[0]} samples were requested but no "
                            f"--{missing[0]}-data-path is given")
        blends = [_sft_blend(data_path[n], samples_of)[0] if data_path.get(n) and size else None
                  for n, size in zip(names, sizes)]
        files = [p for b in blends if b for p in b[0]]
        config = _config(fmt, seq_length, seed, cache, files, line_counts, blend_per_split=blends, split=None)
        blended = any(b[1] is not None for b in blends if b)
    else:
        _parse_split(split)
        (paths, weights), lines = _sft_blend(data_path, samples_of)
        config = _config(fmt, seq_length, seed, cache, paths, line_counts, blend=(paths, weights),
                         split=str(split).strip())
        for i, bookends in enumerate(config.split_matrix):
            if bookends is None:
                continue
            if sizes[i] == 0:            # a split asked for nothing is not built
                config.split_matrix[i] = None
                continue
            # an SFTDataset over no lines would divide by zero on its first item
            for p, n in zip(paths, lines):
                if int(round(bookends[1] * n)) <= int(round(bookends[0] * n)):
                    fits = _split_that_fits(i, min(lines))
                    ways = {1: "--eval-iters 0 (no evaluation)", 2: "no test samples"}.get(i, "")
                    raise DataError(f"--split {split} leaves the {names[i]} split of {p} ({n} lines) without "
                                    f"lines, but {sizes[i]} {names[i]} samples were requested: "
                                    + (f"use --split {fits} (gives it at least one line)" if fits else
                                       "the file has too few lines to split; use a larger one")
                                    + (f", or {ways}" if ways else ""))
        blended = weights is not None
    with _index_build_lock(cache), _process_group_if_needed(blended):
        return tuple(Builder(_dataset_class(), sizes, lambda: True, config).build())


def check_sft_source(data_path, tokenizer, prompt_format: str) -> None:
    """Before launch, cheaply: the tokenizer suits the prompt format, every path is an existing .jsonl file,
    and each file's first line with text parses and renders (a wrong format fails there). DataError in one
    line otherwise. Lines further on are checked when their samples are read."""
    from zo_megatron.data.datasets import parse_data_path

    fmt = conversation_format(tokenizer, prompt_format)
    blends = data_path.values() if isinstance(data_path, dict) else [data_path]
    for blend in blends:
        for p in (parse_data_path(blend)[0] if blend else ()):
            path = _checked_jsonl(p)
            with open(path, "rb") as f:
                for number, raw in enumerate(f, 1):
                    if raw.strip():
                        messages = _messages(raw, f"{path}:{number}")
                        for c, (lo, hi) in enumerate(conversation_spans(messages)):
                            fmt.tokenize(messages[lo:hi], f"{path}:{number}: conversation {c + 1} "
                                                          f"(messages[{lo}:{hi}])")
                        break
                else:
                    raise DataError(f"{path} holds no conversations (no line with text); {_LINE_FORMAT}")
