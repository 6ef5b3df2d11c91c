"""--sft-pack-lines (zo_megatron/data/sft_packing.py) against references written here.

The references: the pack boundaries by a plain loop over the lines (greedy: a line joins the pack while the
pack's tokens stay <= seq_length, one longer than that is alone); each line's token count from
tests/test_sft_data.py's independent tokenization (Megatron-LM's per-turn rule, transformers' assistant mask),
every conversation plus its end-of-document token; each packed item built from the unpacked dataset's own
items of its lines (their unpadded tokens concatenated, the segments renumbered, the positions as they
restart per conversation, the padding appended), which themselves equal tests/test_sft_data.py's reference.
Conversations are drawn from a fresh printed seed over the embedded corpus' text.
"""
from __future__ import annotations

import glob
import json
import logging
import os
import random

import numpy as np
import pytest

from tests.seeds import fresh_seed
from tests.test_sft_data import (CHATML, _tok_dir, assert_item_equal, hf_assistant_mask_conversation,
                                 megatron_tokenize_conversation, random_line, reference_item, split_conversations,
                                 write_jsonl)
from zo_megatron.data import DataError
from zo_megatron.data.tokenizer import HuggingFaceTokenizer

FORMATS = {"nemotron-h-aligned": "nemotron", "nemotron-nano-v2": "nemotron", "chat-template": "chatml"}
PADS = {"nemotron-h-aligned": "<SPECIAL_233>", "nemotron-nano-v2": "<unk>"}


@pytest.fixture(scope="module")
def toks(tmp_path_factory):
    base = tmp_path_factory.mktemp("pack_tok")
    return {"nemotron": HuggingFaceTokenizer(_tok_dir(base, "nemotron")),
            "chatml": HuggingFaceTokenizer(_tok_dir(base, "chatml", {"chat_template": CHATML}))}


@pytest.fixture(scope="module")
def words():
    from zo_megatron.data.corpus import iter_corpus_documents

    docs = iter_corpus_documents()
    return [w for _, (_, text) in zip(range(2), docs) for w in text.split()]


# ----------------------------------------------------------------------------- references
def brute_bounds(counts, seq_length):
    """The greedy packing, line by line."""
    bounds, total = [0], 0
    for i, c in enumerate(counts):
        if i > bounds[-1] and total + c > seq_length:
            bounds.append(i)
            total = 0
        total += c
    return bounds + [len(counts)] if len(counts) else bounds


def reference_length(fmt, tok, messages):
    """The tokens a line puts in a pack, by the independent tokenization: each conversation, plus an
    end-of-document token where it does not end with one."""
    hf, eod = tok.hf_tokenizer, tok.hf_tokenizer.eos_token_id
    n = 0
    for conv in split_conversations(messages):
        t = (hf_assistant_mask_conversation(hf, conv) if fmt == "chat-template" else
             megatron_tokenize_conversation(hf, fmt, conv))[0]
        n += len(t) + int(t[-1] != eod)
    return n


def pad_of(fmt, tok):
    hf = tok.hf_tokenizer
    if fmt != "chat-template":
        return hf.convert_tokens_to_ids(PADS[fmt])
    return hf.pad_token_id if hf.pad_token_id is not None else hf.eos_token_id


def reference_pack(items, lengths, seq_length, pad):
    """The sample of a pack from its lines' own (unpacked) items and token counts."""
    if len(items) == 1 and lengths[0] > seq_length:          # a line alone, cut as unpacked
        return {k: v.numpy() for k, v in items[0].items()}
    out = {k: [] for k in ("tokens", "labels", "loss_mask", "position_ids", "segment_ids")}
    segments = 0
    for k, (it, n) in enumerate(zip(items, lengths)):
        labels, mask = it["labels"].numpy()[:n].copy(), it["loss_mask"].numpy()[:n]
        assert mask[n - 1] == 0 and labels[n - 1] == pad         # unpacked: the line's last label is padding
        if k + 1 < len(items):
            # now its last token's label is the next line's first token, which no rule makes a target (a
            # conversation opens with a system or user turn), so it stays out of the loss
            labels[n - 1] = int(items[k + 1]["tokens"][0])
        out["tokens"].append(it["tokens"].numpy()[:n])
        out["labels"].append(labels)
        out["loss_mask"].append(mask)
        out["position_ids"].append(it["position_ids"].numpy()[:n])
        out["segment_ids"].append(it["segment_ids"].numpy()[:n] + segments)
        segments = int(out["segment_ids"][-1][-1]) + 1
    more = seq_length - sum(lengths)
    last_pos, last_seg = int(out["position_ids"][-1][-1]), segments - 1
    out["tokens"].append(np.full(more, pad))
    out["labels"].append(np.full(more, pad))
    out["loss_mask"].append(np.zeros(more, dtype=np.float32))
    out["position_ids"].append(np.arange(last_pos + 1, last_pos + 1 + more))
    out["segment_ids"].append(np.full(more, last_seg))
    return {k: np.concatenate(v) for k, v in out.items()}


def one_conversation(rng, words, fmt):
    """A Hugging Face style line: one conversation (random_line's first)."""
    return split_conversations(random_line(rng, words, fmt))[0]


def long_line(rng, words, fmt, tok, above):
    """A line of more than `above` tokens."""
    msgs = random_line(rng, words, fmt)
    while reference_length(fmt, tok, msgs) <= above:
        msgs += random_line(rng, words, fmt)
    return msgs


def exact_fit(lengths):
    """A seq_length that the first lines fill exactly (the first pack, greedily), about three lines' worth."""
    target, total = 2.5 * float(np.median(lengths)), 0
    for k, n in enumerate(lengths):
        total += n
        if k >= 1 and total >= target:
            return total, k + 1
    raise AssertionError(lengths)


def unpacked_items(path, n_lines, seq_length, tok, fmt, cache):
    """Each line's own sample, from the dataset without the flag (split 1,0,0: sample i is line i)."""
    from zo_megatron.data.sft import build_sft_datasets

    ds = build_sft_datasets([path], "1,0,0", seq_length, 1, tok, fmt, n_lines, 0, 0, cache_dir=cache)[0]
    return [ds[i] for i in range(n_lines)]


# ----------------------------------------------------------------------------- boundaries
def test_pack_bounds_equal_the_greedy_loop():
    from zo_megatron.data.sft_packing import pack_bounds

    rng = np.random.default_rng(fresh_seed("pack bounds"))
    kinds = {"exact": 0, "alone": 0, "several": 0}
    for trial in range(600):
        L = int(rng.integers(1, 80))
        n = int(rng.integers(0, 60))
        style = trial % 3
        if style == 0:                       # short lines: many per pack, exact fits now and then
            counts = rng.integers(1, max(2, L // 3) + 1, n)
        elif style == 1:                     # any length, longer than the pack included
            counts = rng.integers(1, 2 * L + 3, n)
        else:                                # the edges: L - 1, L, L + 1 and what fills a pack exactly
            counts = rng.choice([1, max(1, L - 1), L, L + 1, max(1, L // 2), L - L // 2 or 1], n)
        want = brute_bounds(counts.tolist(), L)
        got = pack_bounds(counts, L)
        assert got.dtype == np.int64 and got.tolist() == want, (L, counts.tolist(), got.tolist(), want)
        for lo, hi in zip(want, want[1:]):
            total = int(counts[lo:hi].sum())
            kinds["exact"] += total == L
            kinds["alone"] += hi - lo == 1 and total > L
            kinds["several"] += hi - lo > 1
    assert all(kinds.values()), kinds
    big = rng.integers(1, 300, 200_000)      # a long file: still the loop's answer
    assert pack_bounds(big, 1024).tolist() == brute_bounds(big.tolist(), 1024)
    assert pack_bounds(np.zeros(0, dtype=np.int32), 8).tolist() == [0]


# ----------------------------------------------------------------------------- items
@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_packed_items_are_their_lines_concatenated(fmt, toks, words, tmp_path):
    """Every element of every packed item (cycling past the last pack) equals its lines' own items joined;
    without the flag the items are today's (tests/test_sft_data.py's reference)."""
    from zo_megatron.data.sft import build_sft_datasets

    tok = toks[FORMATS[fmt]]
    rng = random.Random(fresh_seed(f"sft packing {fmt}"))
    lines = [one_conversation(rng, words, fmt) for _ in range(26)]
    lines[5:5] = [random_line(rng, words, fmt) for _ in range(4)]          # a few lines of several conversations
    lengths = [reference_length(fmt, tok, m) for m in lines]
    L, first = exact_fit(lengths)                                          # the first pack fits exactly
    for at in (9, 20):
        lines.insert(at, long_line(rng, words, fmt, tok, L))               # longer than a pack: alone, cut
        lengths.insert(at, reference_length(fmt, tok, lines[at]))
    path = write_jsonl(tmp_path / "chats.jsonl", lines)
    cache = str(tmp_path / "cache")
    singles = unpacked_items(path, len(lines), L, tok, fmt, cache)
    for i, m in enumerate(lines):
        assert_item_equal(singles[i], reference_item(fmt, tok, m, L), f"unpacked line {i + 1}")
    bounds = brute_bounds(lengths, L)
    pad = pad_of(fmt, tok)
    refs = [reference_pack(singles[lo:hi], lengths[lo:hi], L, pad) for lo, hi in zip(bounds, bounds[1:])]
    n_packs = len(refs)
    train = build_sft_datasets([path], "1,0,0", L, 1, tok, fmt, n_packs + 5, 0, 0, cache_dir=cache,
                               pack_lines=True)[0]
    assert len(train) == n_packs + 5 and n_packs < len(lines) * 0.8, (n_packs, len(lines))
    for k in range(len(train)):
        assert_item_equal(train[k], refs[k % n_packs], f"pack {k % n_packs} (sample {k}), lines "
                                                        f"{bounds[k % n_packs]}:{bounds[k % n_packs + 1]}, L {L}")
    sizes = np.diff(bounds)
    assert bounds[1] == first >= 2 and (sizes >= 2).sum() >= 3 and sum(n > L for n in lengths) >= 2, sizes


def test_blends_and_data_per_split(toks, words, tmp_path):
    """--split cuts lines, then each split packs its own lines; a blend's sample s of dataset d is pack s of
    d's split (modulo); files without weights are weighted by their packs; data per split packs whole files."""
    from zo_megatron.data.sft import build_sft_datasets

    fmt, tok = "chat-template", toks["chatml"]
    rng = random.Random(fresh_seed("sft packing blends"))
    L = rng.randint(90, 200)
    cache = str(tmp_path / "cache")
    files, packs_of = {}, {}
    # b's lines are a few tokens each (many per pack), a's a conversation each: the files' shares of packs are
    # far from their shares of lines
    tiny = (lambda: [{"role": "user", "content": rng.choice(words)},
                     {"role": "assistant", "content": rng.choice(words)}])
    for name, n, line in (("a", 31, lambda: one_conversation(rng, words, fmt)), ("b", 17, tiny)):
        lines = [line() for _ in range(n)]
        lengths = [reference_length(fmt, tok, m) for m in lines]
        path = write_jsonl(tmp_path / f"{name}.jsonl", lines)
        singles = unpacked_items(path, n, L, tok, fmt, cache)
        files[name] = path

        def packs(lo, hi, singles=singles, lengths=lengths):
            b = brute_bounds(lengths[lo:hi], L)
            return [reference_pack(singles[lo + x:lo + y], lengths[lo + x:lo + y], L, pad_of(fmt, tok))
                    for x, y in zip(b, b[1:])]
        edges = [int(round(e * n)) for e in (0.0, 0.6, 0.8, 1.0)]          # megatron-core's rounding of 6,2,2
        packs_of[path] = {"splits": [packs(edges[i], edges[i + 1]) for i in range(3)], "whole": packs(0, n)}
    a, b = files["a"], files["b"]

    def check(ds, paths, which, weights, size):
        assert len(ds) >= size
        ids = np.asarray(ds.dataset_index[:len(ds)])
        for k in range(len(ds)):
            d, s = int(ids[k]), int(ds.dataset_sample_index[k])
            refs = packs_of[paths[d]][which] if which == "whole" else packs_of[paths[d]]["splits"][which]
            item = ds[k]
            assert item["dataset_id"] == d
            assert_item_equal(item, refs[s % len(refs)], f"blend sample {k}: dataset {d}, pack {s % len(refs)}")
        share = np.bincount(ids, minlength=len(paths)) / len(ds)
        assert np.allclose(share, np.array(weights) / sum(weights), atol=1.5 / len(ds)), share

    tr, va, te = build_sft_datasets([a], "6,2,2", L, 1, tok, fmt, 9, 4, 3, cache_dir=cache, pack_lines=True)
    for ds, i, want in ((tr, 0, 9), (va, 1, 4), (te, 2, 3)):
        refs = packs_of[a]["splits"][i]
        assert len(ds) == want
        for k in range(want):
            assert_item_equal(ds[k], refs[k % len(refs)], f"split {i} sample {k}")
    blend, va, _ = build_sft_datasets(["0.7", a, "0.3", b], "6,2,2", L, 1, tok, fmt, 12, 5, 0, cache_dir=cache,
                                      pack_lines=True)
    check(blend, [a, b], 0, [0.7, 0.3], 12)
    check(va, [a, b], 1, [0.7, 0.3], 5)
    tr, _, _ = build_sft_datasets([a, b], "6,2,2", L, 1, tok, fmt, 40, 0, 0, cache_dir=cache, pack_lines=True)
    whole = [len(packs_of[p]["whole"]) for p in (a, b)]
    assert whole[0] / sum(whole) > 31 / 48 + 0.1, whole          # weights by lines would fail the check
    check(tr, [a, b], 0, whole, 40)
    tr, va, te = build_sft_datasets({"train": [a], "valid": ["1", a, "3", b], "test": None}, None, L, 1, tok, fmt,
                                    len(packs_of[a]["whole"]) + 2, 8, 0, cache_dir=cache, pack_lines=True)
    assert te is None
    for k in range(len(tr)):
        refs = packs_of[a]["whole"]
        assert_item_equal(tr[k], refs[k % len(refs)], f"per-split train sample {k}")
    check(va, [a, b], "whole", [1, 3], 8)
    # without the flag a blend's key is what it always was: no word of packing in it
    plain = build_sft_datasets(["0.7", a, "0.3", b], "6,2,2", L, 1, tok, fmt, 12, 0, 0, cache_dir=cache)[0]
    assert "pack_lines" not in plain.unique_description and "pack_lines" in blend.unique_description


# ----------------------------------------------------------------------------- the counts' cache
def _count_tokenize_calls(monkeypatch, cls):
    calls = [0]
    original = cls.tokenize

    def counted(self, *a, **k):
        calls[0] += 1
        return original(self, *a, **k)

    monkeypatch.setattr(cls, "tokenize", counted)
    return calls


def test_counts_are_cached_and_rebuilt_when_the_file_changes(toks, words, tmp_path, monkeypatch, caplog):
    from zo_megatron.data import sft, sft_packing

    fmt, tok = "chat-template", toks["chatml"]
    rng = random.Random(fresh_seed("sft packing cache"))
    lines = [one_conversation(rng, words, fmt) for _ in range(40)]
    lengths = [reference_length(fmt, tok, m) for m in lines]
    L = int(np.median(lengths)) * 3
    lines.append(long_line(rng, words, fmt, tok, L + 1))
    lengths.append(reference_length(fmt, tok, lines[-1]))
    path = write_jsonl(tmp_path / "c.jsonl", lines)
    cache = str(tmp_path / "cache")
    calls = _count_tokenize_calls(monkeypatch, sft.ChatTemplateFormat)

    def build(seq_length=L, pack=True):
        calls[0] = 0
        sft.build_sft_datasets([path], "1,0,0", seq_length, 1, tok, fmt, 5, 0, 0, cache_dir=cache, pack_lines=pack)
        return calls[0], sorted(glob.glob(os.path.join(cache, "sft_line_counts-*.npy")))

    assert build(pack=False) == (0, [])                  # unpacked: nothing counted, nothing written
    monkeypatch.setattr(sft_packing, "_PROGRESS_LINES", 0)
    monkeypatch.setattr(sft_packing, "_PROGRESS_EVERY_S", 0.0)
    with caplog.at_level(logging.INFO, logger="zo_megatron.data.sft_packing"):
        n, files = build()
    assert n >= len(lines) and len(files) == 1
    assert any("lines/s" in r.getMessage() and "%" in r.getMessage() for r in caplog.records)
    counts = np.load(files[0])
    assert counts.dtype == np.int32 and counts.tolist() == [min(x, L + 1) for x in lengths]
    assert build() == (0, files)                         # read back: no line tokenized
    n, more = build(seq_length=L + 7)                    # another seq_length: counted again, its own file
    assert n >= len(lines) and len(more) == 2
    os.utime(path, ns=(os.stat(path).st_atime_ns, os.stat(path).st_mtime_ns + 10**9))   # touched: counted again
    n, after = build()
    assert n >= len(lines) and len(after) == 3
    with open(path, "a") as f:                           # grown: counted again, the new line included
        f.write(json.dumps({"messages": lines[0]}) + "\n")
    n, latest = build()
    new = sorted(set(latest) - set(after))
    assert n >= len(lines) + 1 and len(new) == 1
    assert np.load(new[0]).tolist() == [min(x, L + 1) for x in lengths + lengths[:1]]
    with open(new[0], "r+b") as f:                       # a torn file is not trusted: counted again, rewritten
        f.truncate(100)
    n, _ = build()
    assert n >= len(lines) + 1 and np.load(new[0]).tolist() == [min(x, L + 1) for x in lengths + lengths[:1]]
    assert not glob.glob(os.path.join(cache, ".tmp-*"))


def test_a_bad_line_fails_the_packed_build_naming_it(toks, tmp_path):
    from zo_megatron.data.sft import build_sft_datasets

    good = json.dumps({"messages": [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]})
    path = tmp_path / "bad.jsonl"
    path.write_text(good + "\n\n  \n" + '{"messages": [{"role": "bot", "content": "x"}]}\n' + good + "\n")
    args = ([str(path)], "1,0,0", 32, 1, toks["chatml"], "chat-template", 2, 0, 0)
    build_sft_datasets(*args, cache_dir=str(tmp_path / "cache"))          # unpacked: found when read
    with pytest.raises(DataError) as e:
        build_sft_datasets(*args, cache_dir=str(tmp_path / "cache"), pack_lines=True)
    msg = str(e.value)
    assert msg.startswith(f"{path}:4: ") and "role 'bot'" in msg and "\n" not in msg, msg


# ----------------------------------------------------------------------------- several ranks
def _ranks_world(rank, tok_dir, path, bad, cache, L):
    import torch
    import torch.distributed as dist

    from zo_megatron.data import sft, sft_packing
    from zo_megatron.errors import UserError

    # rank 0 reports after every line: the heartbeat loop runs once a line, and a failure arrives mid-count
    sft_packing._HEARTBEAT_S, sft_packing._STEP_LINES = 0.0, 1
    dist.init_process_group("gloo")
    try:
        tok = HuggingFaceTokenizer(tok_dir)
        calls, original = [0], sft.ChatTemplateFormat.tokenize

        def counted(self, *a, **k):
            calls[0] += 1
            return original(self, *a, **k)

        sft.ChatTemplateFormat.tokenize = counted
        train = sft.build_sft_datasets([path], "1,0,0", L, 1, tok, "chat-template", 6, 0, 0, cache_dir=cache,
                                       pack_lines=True)[0]
        built_calls = calls[0]
        items = [torch.stack([train[k][key] for key in ("tokens", "labels", "position_ids", "segment_ids")])
                 for k in range(len(train))]
        try:
            sft.build_sft_datasets([bad], "1,0,0", L, 1, tok, "chat-template", 2, 0, 0, cache_dir=cache,
                                   pack_lines=True)
            error = ""
        except UserError as exc:
            error = str(exc)
        return {"calls": built_calls, "items": torch.stack(items), "error": error}
    finally:
        dist.destroy_process_group()


def test_two_ranks_rank0_counts_the_other_reads(toks, words, tmp_path):
    from tests.harness import run_world

    rng = random.Random(fresh_seed("sft packing ranks"))
    lines = [one_conversation(rng, words, "chat-template") for _ in range(30)]
    path = write_jsonl(tmp_path / "c.jsonl", lines)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": lines[0]}) + "\n" + json.dumps({"messages": lines[1]}) + "\n"
                   + json.dumps({"messages": []}) + "\n")
    out = run_world(_ranks_world, 2, toks["chatml"].model_dir, path, str(bad), str(tmp_path / "cache"), 160,
                    timeout=120)
    assert out[0]["calls"] >= len(lines) and out[1]["calls"] == 0, [o["calls"] for o in out]
    assert np.array_equal(out[0]["items"].numpy(), out[1]["items"].numpy())
    for o in out:       # rank 0's bad line stops both, with its one line
        assert o["error"].startswith(f"rank 0: {bad}:3: ") and "is empty" in o["error"], o["error"]
