"""--sft data (zo_megatron/data/sft.py) against references written here.

The references: Megatron-LM's own rules re-implemented from megatron/training/tokenizer/sft_tokenizer.py
(tokenize_conversation: whole conversation, then each turn alone, masks by turn lengths) and
megatron/training/datasets/sft_dataset.py (the packing loop, transcribed, with its truncation bug fixed as
intended), over conversations rendered by Python written here (not the module's Jinja templates); for the
chat-template format, transformers' apply_chat_template(..., return_assistant_tokens_mask=True) on
templates carrying {% generation %} tags. Conversations are drawn from a fresh printed seed over the
embedded corpus' text.
"""
from __future__ import annotations

import json
import os
import pickle
import random

import numpy as np
import pytest

from tests.seeds import fresh_seed
from zo_megatron.data import DataError
from zo_megatron.data.tokenizer import HuggingFaceTokenizer

SPECIAL = ["<SPECIAL_10>", "<SPECIAL_11>", "<SPECIAL_12>", "<SPECIAL_233>", "<unk>", "<|im_start|>", "<|im_end|>",
           "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|pad|>"]
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' }}{% if m['role'] == 'assistant' %}"
          "{% generation %}{{ m['content'] + '<|im_end|>\n' }}{% endgeneration %}{% else %}"
          "{{ m['content'] + '<|im_end|>\n' }}{% endif %}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# Llama 3's shape: a system block always, a default one when the conversation has none
LLAMA_LIKE = ("{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] | trim %}"
              "{% set messages = messages[1:] %}{% else %}{% set system = 'Cutting Knowledge Date: 2023' %}{% endif %}"
              "{{ '<|start_header_id|>system<|end_header_id|>\n\n' + system + '<|eot_id|>' }}"
              "{% for m in messages %}{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\n\n' }}"
              "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] | trim + '<|eot_id|>' }}"
              "{% endgeneration %}{% else %}{{ m['content'] | trim + '<|eot_id|>' }}{% endif %}{% endfor %}"
              "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
# the generation prompt ends in a space that the first word's token takes in (" word"): a token straddling
# the start of the assistant text, which is a target (it overlaps it), as transformers' mask has it
SPACED = ("{% for m in messages %}{{ m['role'] + ': ' }}{% if m['role'] == 'assistant' %}{% generation %}"
          "{{ m['content'] | trim + '</s>' }}{% endgeneration %}{% else %}{{ m['content'] | trim + '\n' }}{% endif %}"
          "{% endfor %}{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}")
# rewrites earlier turns: an assistant turn that is not the last is cut to 3 characters
REWRITING = ("{% for m in messages %}{{ m['role'] + ': ' }}{% if m['role'] == 'assistant' and not loop.last %}"
             "{{ m['content'][:3] }}{% else %}{{ m['content'] }}{% endif %}{{ '\n' }}{% endfor %}"
             "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}")


def _one_line(exc) -> str:
    msg = str(exc.value)
    assert msg and "\n" not in msg and msg == msg.strip(), msg
    return msg


def _tok_dir(base, name, config_update=None) -> str:
    from tokenizers import Tokenizer

    from tests.hf_tokenizer import make_hf_tokenizer

    d = make_hf_tokenizer(base / name, config_update=config_update)
    t = Tokenizer.from_file(os.path.join(d, "tokenizer.json"))
    t.add_special_tokens(SPECIAL)
    t.save(os.path.join(d, "tokenizer.json"))
    return d


@pytest.fixture(scope="module")
def toks(tmp_path_factory, hf_tokenizer_dir):
    base = tmp_path_factory.mktemp("sft_tok")
    return {"nemotron": HuggingFaceTokenizer(_tok_dir(base, "nemotron")),
            "chatml": HuggingFaceTokenizer(_tok_dir(base, "chatml", {"chat_template": CHATML})),
            "llama": HuggingFaceTokenizer(_tok_dir(base, "llama", {"chat_template": LLAMA_LIKE,
                                                                  "eos_token": "<|eot_id|>", "pad_token": "<|pad|>"})),
            "spaced": HuggingFaceTokenizer(_tok_dir(base, "spaced", {"chat_template": SPACED})),
            "rewriting": HuggingFaceTokenizer(_tok_dir(base, "rewriting", {"chat_template": REWRITING})),
            "plain": HuggingFaceTokenizer(hf_tokenizer_dir)}


@pytest.fixture(scope="module")
def words():
    from zo_megatron.data.corpus import iter_corpus_documents

    docs = iter_corpus_documents()
    return [w for _, (_, text) in zip(range(2), docs) for w in text.split()]


# ----------------------------------------------------------------------------- references
def render_turn(fmt: str, m: dict) -> str:
    """One turn as Megatron-LM's Nemotron templates write it (Python here, not Jinja)."""
    c = m["content"]
    if fmt == "nemotron-h-aligned":
        return {"system": "<SPECIAL_10>System\n" + c.strip() + "\n",
                "user": "<SPECIAL_11>User\n" + c.strip() + "\n" + "<SPECIAL_11>Assistant\n",
                "assistant": c.strip() + "\n"}[m["role"]]
    clean = c.replace("/think", "").replace("/no_think", "").strip()
    return {"system": "<SPECIAL_10>System\n" + clean + "\n", "user": "<SPECIAL_11>User\n" + clean + "\n",
            "assistant": "<SPECIAL_11>Assistant\n" + c.strip() + "\n<SPECIAL_12>\n"}[m["role"]]


def megatron_tokenize_conversation(hf, fmt: str, conv: list[dict]):
    """sft_tokenizer.py's tokenize_conversation: whole, then turn by turn (has_bos False, system role kept)."""
    prefix_len = {"nemotron-h-aligned": 0, "nemotron-nano-v2": 3}[fmt]
    enc = (lambda text: hf(text, add_special_tokens=False).input_ids)
    tokens = np.array(enc("".join(render_turn(fmt, m) for m in conv)))
    target = tokens.copy()
    idx = 0
    for m in conv:
        turn = enc(render_turn(fmt, m))
        if m["role"] in ("system", "user"):
            target[idx:idx + len(turn)] = -100
        elif prefix_len > 0:
            target[idx:idx + prefix_len] = -100
        assert np.array_equal(tokens[idx:idx + len(turn)], turn)
        idx += len(turn)
    assert idx == len(tokens)
    return tokens, target


def hf_assistant_mask_conversation(hf, conv: list[dict]):
    out = hf.apply_chat_template(conv, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    tokens = np.array(out["input_ids"])
    return tokens, np.where(np.array(out["assistant_masks"]) == 1, tokens, -100)


def split_conversations(messages):
    convs, cur = [], []
    for m in messages:
        if m["role"] == "system" and cur:
            convs.append(cur)
            cur = []
        cur.append(m)
    return convs + [cur]


def megatron_pack(pieces, seq_length, eod, pad):
    """sft_dataset.py's __getitem__ loop (context parallel 1), its truncation written as intended; also
    returns which of the seq_length + 1 entries are padding."""
    L = seq_length
    pack_tokens, pack_targets, pack_positions, is_pad, cu = [], [], [], [], [0]
    cut = False
    for tokens, targets in pieces:
        tl, gl = tokens.tolist(), targets.tolist()
        if tl[-1] != eod:
            tl.append(eod)
            gl.append(eod)
        pack_tokens += tl
        pack_targets += gl
        pack_positions += range(len(tl))
        is_pad += [False] * len(tl)
        cu.append(len(pack_tokens))
        if len(pack_tokens) >= L + 1:
            pack_tokens = pack_tokens[:L] + [pad]        # 0.16.1: .extend(pad) with an int
            pack_targets = pack_targets[:L] + [pad]
            pack_positions = pack_positions[:L + 1]
            is_pad = is_pad[:L] + [True]
            cu[-1] = len(pack_tokens) - 1
            cut = True
            break
    if len(pack_tokens) < L + 1:
        n = L + 1 - len(pack_tokens)
        pack_tokens += [pad] * n
        pack_targets += [pad] * n
        pack_positions += range(pack_positions[-1] + 1, pack_positions[-1] + 1 + n)
        is_pad += [True] * n
        cu[-1] = len(pack_tokens) - 1
    assert len(pack_tokens) == len(pack_targets) == len(pack_positions) == L + 1
    return pack_tokens, pack_targets, pack_positions, is_pad, cu, cut


def reference_item(fmt: str, tok: HuggingFaceTokenizer, messages, seq_length: int, megatron_loss_mask: bool = False):
    hf = tok.hf_tokenizer
    pad = (hf.convert_tokens_to_ids({"nemotron-h-aligned": "<SPECIAL_233>", "nemotron-nano-v2": "<unk>"}[fmt])
           if fmt != "chat-template" else (hf.pad_token_id if hf.pad_token_id is not None else hf.eos_token_id))
    convs = split_conversations(messages)
    pieces = (megatron_tokenize_conversation(hf, fmt, c) if fmt != "chat-template" else
              hf_assistant_mask_conversation(hf, c) for c in convs)
    toks, tgts, pos, is_pad, cu, cut = megatron_pack(pieces, seq_length, hf.eos_token_id, pad)
    labels = np.array(tgts[1:])
    if megatron_loss_mask:            # Megatron-LM's: by id
        loss_mask = np.ones(seq_length, dtype=np.float32)
        loss_mask[labels == pad] = 0
        loss_mask[labels == -100] = 0
    else:                             # by position
        loss_mask = ((labels != -100) & ~np.array(is_pad[1:])).astype(np.float32)
    segments = [c for c in range(len(cu) - 1) for _ in range(cu[c + 1] - cu[c])]
    return {"tokens": np.array(toks[:-1]), "labels": np.where(labels == -100, np.array(toks[1:]), labels),
            "loss_mask": loss_mask, "position_ids": np.array(pos[:-1]), "segment_ids": np.array(segments),
            "cut": cut, "padded": is_pad[-2]}


def assert_item_equal(item, ref, what):
    import torch

    dtypes = {"tokens": torch.int64, "labels": torch.int64, "loss_mask": torch.float32, "position_ids": torch.int64,
              "segment_ids": torch.int64}
    assert set(item) - {"dataset_id"} == set(dtypes), what
    for k, dtype in dtypes.items():
        assert item[k].dtype == dtype and item[k].shape == ref[k].shape, (what, k)
        assert np.array_equal(item[k].numpy(), ref[k]), (what, k, item[k].tolist(), ref[k].tolist())


# ----------------------------------------------------------------------------- random conversations
def _text(rng, words, fmt):
    s = rng.randrange(len(words) - 40)
    text = " ".join(words[s:s + rng.randint(1, 30)])
    r = rng.random()
    if r < 0.15:
        text = "  " + text + " \n"
    elif r < 0.25:
        text += " é😀 naïve"
    elif r < 0.3 and fmt == "nemotron-nano-v2":
        text = "/think " + text + " /no_think"
    return text


def random_line(rng, words, fmt):
    msgs = []
    for c in range(rng.randint(1, 3)):
        if c > 0 or rng.random() < 0.7:
            msgs.append({"role": "system", "content": _text(rng, words, fmt)})
        for _ in range(rng.randint(0 if msgs else 1, 3)):
            msgs.append({"role": "user", "content": _text(rng, words, fmt)})
            if rng.random() < 0.2:
                msgs.append({"role": "user", "content": _text(rng, words, fmt)})
            if rng.random() < 0.85:
                msgs.append({"role": "assistant", "content": _text(rng, words, fmt)})
    return msgs


def write_jsonl(path, lines):
    with open(path, "w", encoding="utf-8") as f:
        for m in lines:
            f.write(json.dumps({"messages": m}) + "\n")
    return str(path)


FORMAT_TOK = {"nemotron-h-aligned": "nemotron", "nemotron-nano-v2": "nemotron", "chat-template": "chatml"}


@pytest.mark.parametrize("fmt,tok_name", [*FORMAT_TOK.items(), ("chat-template", "llama"),
                                                  ("chat-template", "spaced")])
def test_random_conversations_match_reference(fmt, tok_name, toks, words, tmp_path):
    """Every element of every item equals the reference: Megatron-LM's rules for the Nemotron formats
    (and its own id-based loss mask gives the same), transformers' assistant mask for chat-template."""
    from zo_megatron.data.sft import build_sft_datasets

    rng = random.Random(fresh_seed(f"sft {fmt} {tok_name}"))
    seq_length = rng.randint(48, 160)
    lines = [random_line(rng, words, fmt) for _ in range(24)]
    lines[0] = [m for _ in range(4) for m in random_line(rng, words, fmt)]       # long: cut
    lines[1] = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]   # short: padded
    path = write_jsonl(tmp_path / "chats.jsonl", lines)
    tok = toks[tok_name]
    train, valid, test = build_sft_datasets([path], "1,0,0", seq_length, 1234, tok, fmt, len(lines), 0, 0,
                                            cache_dir=str(tmp_path / "cache"))
    assert valid is None and test is None and len(train) == len(lines)
    cut = padded = 0
    for i, messages in enumerate(lines):
        item = train[i]
        ref = reference_item(fmt, tok, messages, seq_length)
        assert_item_equal(item, ref, f"line {i + 1}, seq_length {seq_length}")
        if fmt != "chat-template":
            assert np.array_equal(reference_item(fmt, tok, messages, seq_length, megatron_loss_mask=True)["loss_mask"],
                                  ref["loss_mask"])
        cut += ref["cut"]
        padded += ref["padded"]
        assert int(item["labels"].min()) >= 0 and int(item["labels"].max()) < tok.vocab_size
    assert cut and padded
    if tok_name == "chatml":   # pad == eos: the appended end-of-document targets stay in the loss
        pad = train.format.pad
        assert pad == tok.eod
        assert any(bool(((it["labels"] == pad) & (it["loss_mask"] == 1)).any()) for it in (train[i] for i in range(4)))


def test_pack_boundaries():
    """seq_length + 1 tokens exactly is cut (its last replaced by the pad); one fewer is padded by one."""
    from zo_megatron.data.sft import IGNORE_INDEX, pack_sample

    L, eod, pad = 6, 1, 9
    for total in range(2, 10):          # one conversation of `total` tokens ending in eod, then another
        toks = np.array(list(range(20, 20 + total - 1)) + [eod])
        tgts = np.where(np.arange(total) < 2, IGNORE_INDEX, toks)
        pieces = [(toks, tgts), (np.array([50, 51]), np.array([IGNORE_INDEX, 51]))]
        item = pack_sample([(a.tolist(), b.tolist()) for a, b in pieces], L, eod, pad)
        ref_t, ref_g, ref_p, is_pad, cu, _ = megatron_pack(iter(pieces), L, eod, pad)
        assert item["tokens"].tolist() == ref_t[:-1]
        assert item["labels"].tolist() == [t if g == IGNORE_INDEX else g for t, g in zip(ref_t[1:], ref_g[1:])]
        assert item["loss_mask"].tolist() == [float(g != IGNORE_INDEX and not p) for g, p in zip(ref_g[1:], is_pad[1:])]
        assert item["position_ids"].tolist() == ref_p[:-1]
        assert item["segment_ids"].tolist() == [c for c in range(len(cu) - 1) for _ in range(cu[c + 1] - cu[c])]
    item = pack_sample([([3, 4, 5, 6, 7, 8, eod], [3, 4, 5, 6, 7, 8, eod])], L, eod, pad)   # exactly L + 1
    assert item["tokens"].tolist() == [3, 4, 5, 6, 7, 8] and item["labels"].tolist() == [4, 5, 6, 7, 8, pad]
    assert item["loss_mask"].tolist() == [1, 1, 1, 1, 1, 0]


# ----------------------------------------------------------------------------- blends, splits, cycling
def _distinct_lines(n, tag):
    return [[{"role": "system", "content": f"{tag} file"}, {"role": "user", "content": f"{tag} question {i}"},
             {"role": "assistant", "content": f"answer {i} of {tag}"}] for i in range(n)]


def test_splits_blends_and_cycling(toks, tmp_path):
    from zo_megatron.data.sft import build_sft_datasets

    tok, fmt, L = toks["chatml"], "chat-template", 40
    a_lines, b_lines = _distinct_lines(10, "alpha"), _distinct_lines(7, "beta")
    a = write_jsonl(tmp_path / "a.jsonl", a_lines)
    b = write_jsonl(tmp_path / "b.jsonl", b_lines)
    cache = str(tmp_path / "cache")
    ref = {(p, i): reference_item(fmt, tok, m, L) for p, ls in ((a, a_lines), (b, b_lines)) for i, m in enumerate(ls)}

    # one file, --split 6,2,2: lines 0-5 / 6-7 / 8-9, in file order, cycling past the end
    tr, va, te = build_sft_datasets([a], "6,2,2", L, 1, tok, fmt, 14, 5, 3, cache_dir=cache)
    for ds, (lo, n), want in ((tr, (0, 6), 14), (va, (6, 2), 5), (te, (8, 2), 3)):
        assert len(ds) == want
        for k in range(want):
            assert_item_equal(ds[k], ref[(a, lo + k % n)], f"sample {k}")

    # a weighted blend: every sample is its dataset's line; the proportions are the weights
    def check_blend(ds, paths, starts, counts, weights, size):
        assert len(ds) >= size
        ids = np.asarray(ds.dataset_index[:len(ds)])
        for k in range(len(ds)):
            d, s = int(ids[k]), int(ds.dataset_sample_index[k])
            item = ds[k]
            assert item["dataset_id"] == d
            assert_item_equal(item, ref[(paths[d], starts[d] + s % counts[d])], f"blend sample {k}")
        share = np.bincount(ids, minlength=len(paths)) / len(ds)
        assert np.allclose(share, np.array(weights) / sum(weights), atol=1.5 / len(ds)), share

    tr, va, _ = build_sft_datasets(["0.7", a, "0.3", b], "6,2,2", L, 1, tok, fmt, 20, 6, 0, cache_dir=cache)
    check_blend(tr, [a, b], [0, 0], [6, 4], [0.7, 0.3], 20)
    check_blend(va, [a, b], [6, 4], [2, 2], [0.7, 0.3], 6)
    tr, _, _ = build_sft_datasets([a, b], "6,2,2", L, 1, tok, fmt, 17, 0, 0, cache_dir=cache)   # by line count
    check_blend(tr, [a, b], [0, 0], [6, 4], [10, 7], 17)

    # data per split, each used whole
    tr, va, te = build_sft_datasets({"train": [a], "valid": ["1", a, "3", b], "test": None}, None, L, 1, tok, fmt,
                                    12, 8, 0, cache_dir=cache)
    assert te is None and len(tr) == 12
    for k in range(12):
        assert_item_equal(tr[k], ref[(a, k % 10)], f"per-split sample {k}")
    check_blend(va, [a, b], [0, 0], [10, 7], [1, 3], 8)

    with pytest.raises(DataError) as e:       # a split without lines that samples are asked from
        build_sft_datasets([write_jsonl(tmp_path / "three.jsonl", a_lines[:3])], "98,1,1", L, 1, tok, fmt, 4, 2, 0,
                           cache_dir=cache)
    assert "--split" in _one_line(e) and "three.jsonl" in str(e.value) and "--eval-iters 0" in str(e.value)
    with pytest.raises(DataError) as e:
        build_sft_datasets({"train": [a]}, None, L, 1, tok, fmt, 4, 2, 0, cache_dir=cache)
    assert "--valid-data-path" in _one_line(e)


# ----------------------------------------------------------------------------- refusals
BAD_LINES = [
    (b"{not json", "not valid JSON"),
    (b"[1, 2]", "a JSON list"),
    (b'{"text": "hi"}', "without a \"messages\" list"),
    (b'{"messages": "hi"}', "without a \"messages\" list"),
    (b'{"messages": []}', "is empty"),
    (b'{"messages": ["hi"]}', "messages[0] is not an object"),
    (b'{"messages": [{"role": "user"}]}', "messages[0] is not an object"),
    (b'{"messages": [{"role": "bot", "content": "x"}]}', "role 'bot'"),
    (b'{"messages": [{"role": "User", "content": "x"}]}', "role 'User'"),
    (b'{"messages": [{"role": "user", "content": ["x"]}]}', "list content"),
    (b'{"messages": [{"role": "assistant", "content": "x"}]}', "messages[0] is an assistant turn not preceded"),
    (b'{"messages": [{"role": "system", "content": "s"}, {"role": "assistant", "content": "x"}]}', "messages[1] is an"),
    (b'{"messages": [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}, '
     b'{"role": "system", "content": "s"}, {"role": "assistant", "content": "x"}]}', "messages[3] is an assistant"),
    (b'{"messages": [{"role": "user", "content": "u"}, {"role": "assistant", "content": ""}]}', "empty assistant"),
    (b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}', "not valid JSON"),
]
GOOD = b'{"messages": [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]}'


def test_bad_lines_name_file_and_line(toks, tmp_path):
    from zo_megatron.data.sft import check_sft_source, conversation_format, open_jsonl, sft_sample

    tok = toks["chatml"]
    fmt = conversation_format(tok, "chat-template")
    for n, (bad, says) in enumerate(BAD_LINES):
        path = str(tmp_path / f"bad{n}.jsonl")
        with open(path, "wb") as f:           # good line, blank lines (counted), the bad one at line 4
            f.write(GOOD + b"\n\n  \r\n" + bad + b"\n" + GOOD + b"\n")
        data = open_jsonl(path)
        assert len(data) == 3 and sft_sample(data, 2, fmt, 16)["tokens"].shape == (16,)
        with pytest.raises(DataError) as e:
            sft_sample(data, 1, fmt, 16)
        msg = _one_line(e)
        assert msg.startswith(f"{path}:4: ") and says in msg, msg
        first = str(tmp_path / f"first{n}.jsonl")
        with open(first, "wb") as f:
            f.write(b"\n" + bad + b"\n")
        with pytest.raises(DataError) as e:
            check_sft_source([first], tok, "chat-template")
        assert _one_line(e).startswith(f"{first}:2: ") and says in str(e.value)


def test_refusals(toks, tmp_path):
    from zo_megatron.data import build_tokenizer
    from zo_megatron.data.sft import build_sft_datasets, check_sft_source, conversation_format, open_jsonl, sft_sample

    good = write_jsonl(tmp_path / "good.jsonl", _distinct_lines(3, "x"))
    (tmp_path / "other.json").write_text(open(good).read())
    (tmp_path / "stem.jsonl").write_text(open(good).read())
    (tmp_path / "empty.jsonl").write_text("\n \n")
    cases = [([str(tmp_path / "missing.jsonl")], "no such file"), ([str(tmp_path)], "is a directory"),
             ([str(tmp_path / "other.json")], ".jsonl files"), ([str(tmp_path / "stem")], "did you mean"),
             ([str(tmp_path / "empty.jsonl")], "holds no conversations"), (["0.5", good, "0.5"], "WEIGHT PREFIX")]
    for path, says in cases:
        for call in (lambda: check_sft_source(path, toks["chatml"], "chat-template"),
                     lambda: build_sft_datasets(path, "1,0,0", 8, 1, toks["chatml"], "chat-template", 1, 0, 0,
                                                cache_dir=str(tmp_path / "cache"))):
            with pytest.raises(DataError) as e:
                call()
            assert says in _one_line(e), (path, str(e.value))
    tokenizer_cases = [(build_tokenizer(), "nemotron-h-aligned", "Hugging Face tokenizer"),
                       (toks["nemotron"], "chat-template", "no chat template"),
                       (toks["plain"], "nemotron-h-aligned", "<SPECIAL_10>, which is not a special token"),
                       (toks["plain"], "nemotron-nano-v2", "which is not a special token"),
                       (toks["chatml"], "chatml", "the formats are")]
    for tok, fmt, says in tokenizer_cases:
        with pytest.raises(DataError) as e:
            check_sft_source([good], tok, fmt)
        assert says in _one_line(e), str(e.value)

    # a template that rewrites earlier turns: refused, naming the line and the conversation
    two_turns = [{"role": "user", "content": "first question"}, {"role": "assistant", "content": "first answer"},
                 {"role": "user", "content": "second"}, {"role": "assistant", "content": "second answer"}]
    path = write_jsonl(tmp_path / "rw.jsonl", [two_turns[:2], [{"role": "system", "content": "s"}] + two_turns])
    fmt = conversation_format(toks["rewriting"], "chat-template")
    sft_sample(open_jsonl(path), 0, fmt, 32)      # one assistant turn: nothing follows it to rewrite it
    with pytest.raises(DataError) as e:
        sft_sample(open_jsonl(path), 1, fmt, 32)
    assert _one_line(e).startswith(f"{path}:2: conversation 1 (messages[0:5])")
    assert "rewrites earlier turns" in str(e.value)

    # templates run sandboxed: attribute games are refused, in one line
    sandbox = write_jsonl(tmp_path / "sandbox.jsonl", [two_turns[:2]])
    fmt.template = "{{ ''.__class__.__mro__ }}"
    with pytest.raises(DataError) as e:
        sft_sample(open_jsonl(sandbox), 0, fmt, 32)
    assert "SecurityError" in _one_line(e) and f"{sandbox}:1" in str(e.value)


def test_indexing_chunks_blank_lines_and_progress(tmp_path, monkeypatch, caplog):
    """Line offsets and numbers, across chunk edges or within one chunk, equal Python's own split; large
    files log progress."""
    import logging

    from zo_megatron.data import sft

    rng = random.Random(fresh_seed("sft indexing"))
    pieces = [GOOD, b"", b"  ", b" \t\r", GOOD + b"\r", b" \t" + GOOD,
              b'{"messages": [{"role": "user", "content": "' + "é".encode() * 5 + b'"}]}']
    monkeypatch.setattr(sft, "_PROGRESS_BYTES", 0)
    monkeypatch.setattr(sft, "_PROGRESS_EVERY_S", 0.0)
    for n, (chunk, end) in enumerate([(c, e) for c in (rng.randint(3, 40), 1 << 16) for e in (b"", b"\n", b"\n  ")]):
        body = b"\n".join(rng.choice(pieces) for _ in range(200)) + b"\n" + GOOD + end
        path = tmp_path / f"chunks{n}.jsonl"
        path.write_bytes(body)
        lines, want, offset = body.split(b"\n"), [], 0
        for number, line in enumerate(lines, 1):
            if line.strip():
                want.append((offset, number))
            offset += len(line) + 1
        monkeypatch.setattr(sft, "_CHUNK", chunk)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="zo_megatron.data.sft"):
            data = sft.JsonlConversations(str(path))
        assert [(int(data._starts[i]), data.line_number(i)) for i in range(len(data))] == want, (chunk, end)
        for i, (_, number) in enumerate(want):
            assert data.raw(i) == lines[number - 1]
            assert data[i] == json.loads(lines[number - 1])["messages"]
        assert any("indexing" in r.getMessage() and "%" in r.getMessage() for r in caplog.records)
    clone = pickle.loads(pickle.dumps(data))        # data-loader workers: no file descriptor travels
    assert clone._fd is None and clone[len(clone) - 1] == data[len(data) - 1]
