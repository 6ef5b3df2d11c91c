"""Data layer: tokenizer, preprocessing, megatron GPT datasets, DP batching, embedded corpus.

Real text throughout: a few State of the Union addresses taken from the embedded archive.
"""

import json
import os
import shutil
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from zo_megatron.data import DataError, build_tokenizer
from zo_megatron.data.corpus import extract_corpus
from zo_megatron.data.tokenizer import (
    BUNDLED_MERGE_FILE, BUNDLED_VOCAB_FILE, GPT2_MERGES_SHA256, GPT2_VOCAB_SHA256, sha256_file)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _one_line(err) -> str:
    msg = str(err.value if hasattr(err, "value") else err)
    assert "\n" not in msg and msg.strip() == msg and msg
    return msg


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.fixture(scope="module")
def sotu_files(tmp_path_factory):
    return extract_corpus(str(tmp_path_factory.mktemp("sotu")), limit=3)


@pytest.fixture(scope="module")
def small_prefix(sotu_files, tmp_path_factory):
    from zo_megatron.data.preprocess import preprocess

    out = tmp_path_factory.mktemp("ds") / "sotu3"
    res = preprocess([os.path.dirname(sotu_files[0])], str(out), progress=False)
    assert res.documents == 3
    return res.prefixes["text"]


def _read_docs(prefix):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(prefix)
    assert list(ds.document_indices) == list(range(len(ds) + 1))  # one sequence per document
    return [np.asarray(ds[i]).tolist() for i in range(len(ds))]


# ----------------------------------------------------------------------------- tokenizer
def test_tokenizer_basics(tok):
    assert tok.encode("Hello world") == [15496, 995]
    assert (tok.vocab_size, tok.eod) == (50257, 50256)
    assert tok.decode([tok.eod]) == "<|endoftext|>"
    # the literal string is text, not a document boundary
    assert tok.eod not in tok.encode("a <|endoftext|> b")
    assert sha256_file(BUNDLED_VOCAB_FILE) == GPT2_VOCAB_SHA256
    assert sha256_file(BUNDLED_MERGE_FILE) == GPT2_MERGES_SHA256


def test_tokenizer_round_trip_real_text(tok, sotu_files):
    texts = [open(f, encoding="utf-8", newline="").read() for f in sotu_files]
    tricky = "  two  spaces,\ttab\r\nCRLF\n\n\n 123 4567 ñ 日本語 😀 \x02 end  "
    for text, ids in zip(texts + [tricky], tok.encode_batch(texts + [tricky])):
        assert ids == tok.encode(text)
        assert tok.decode(ids) == text
    with pytest.raises(ValueError):
        tok.decode([tok.vocab_size])


def test_tokenizer_matches_huggingface(tok, sotu_files, tmp_path):
    transformers = pytest.importorskip("transformers")
    d = tmp_path / "gpt2"
    d.mkdir()
    shutil.copy(BUNDLED_VOCAB_FILE, d / "vocab.json")
    shutil.copy(BUNDLED_MERGE_FILE, d / "merges.txt")
    hf = transformers.GPT2TokenizerFast.from_pretrained(str(d))
    text = "".join(open(f, encoding="utf-8").read()[:2000] for f in sotu_files)
    text += "  Multiple   spaces\n\n\tand tabs, numbers 1,234.56 and it's done's.  "
    assert len(text) > 6000
    assert tok.encode(text) == hf.encode(text)
    assert tok.decode(hf.encode(text)) == hf.decode(hf.encode(text)) == text


def test_vocab_with_wrong_hash_is_refused(tmp_path):
    vocab = json.load(open(BUNDLED_VOCAB_FILE, encoding="utf-8"))
    custom = tmp_path / "vocab.json"
    custom.write_text(json.dumps(vocab, indent=1), encoding="utf-8")  # same vocab, other bytes
    with pytest.raises(DataError) as e:
        build_tokenizer(vocab_file=str(custom))
    msg = _one_line(e)
    assert str(custom) in msg and GPT2_VOCAB_SHA256 in msg and sha256_file(str(custom)) in msg
    assert "--allow-custom-vocab" in msg
    t = build_tokenizer(vocab_file=str(custom), allow_custom_vocab=True)
    assert t.encode("Hello world") == [15496, 995]
    with pytest.raises(DataError) as e:
        build_tokenizer(merge_file=str(tmp_path / "missing.txt"))
    assert "missing.txt" in _one_line(e)


# ----------------------------------------------------------------------------- preprocessing
def test_preprocess_directory_round_trip(tok, sotu_files, small_prefix):
    texts = [open(f, encoding="utf-8", newline="").read() for f in sotu_files]  # sorted = input order
    docs = _read_docs(small_prefix)
    assert len(docs) == 3
    for text, ids in zip(texts, docs):
        assert ids[-1] == tok.eod and tok.eod not in ids[:-1]
        assert tok.decode(ids[:-1]) == text
    assert not [f for f in os.listdir(os.path.dirname(small_prefix)) if ".tmp" in f]


def test_preprocess_jsonl_keys_and_workers(tok, sotu_files, tmp_path):
    from zo_megatron.data.preprocess import preprocess

    texts = [open(f, encoding="utf-8").read() for f in sotu_files]
    path = tmp_path / "docs.jsonl"
    with open(path, "w", encoding="utf-8") as f:
        for i, t in enumerate(texts):
            f.write(json.dumps({"body": t, "title": os.path.basename(sotu_files[i])}) + "\n")
            f.write("\n")  # blank lines are skipped
    res = preprocess([str(path)], str(tmp_path / "out" / "j"), json_keys=["body", "title"],
                     workers=2, progress=False)
    assert set(res.prefixes) == {"body", "title"}
    assert res.prefixes["body"].endswith("j_body_document")
    body, title = _read_docs(res.prefixes["body"]), _read_docs(res.prefixes["title"])
    assert [tok.decode(d[:-1]) for d in body] == texts
    assert [tok.decode(d[:-1]) for d in title] == [os.path.basename(f) for f in sotu_files]
    assert all(d[-1] == tok.eod for d in body + title)
    assert res.tokens == sum(map(len, body + title))


def test_preprocess_bad_input_writes_nothing(tmp_path):
    from zo_megatron.data.preprocess import preprocess

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"body": "no text key"}\n', encoding="utf-8")
    with pytest.raises(DataError) as e:
        preprocess([str(bad)], str(tmp_path / "o"), progress=False)
    assert f"{bad}:2" in _one_line(e) and "'text'" in str(e.value)
    assert os.listdir(tmp_path) == ["bad.jsonl"]  # no half dataset, no temp files
    with pytest.raises(DataError) as e:
        preprocess([str(tmp_path / "missing.txt")], str(tmp_path / "o"), progress=False)
    assert "missing.txt" in _one_line(e)


def test_cli_missing_input_exits_2(tmp_path):
    missing = tmp_path / "nope.jsonl"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "preprocess_data.py"),
                        "--input", str(missing), "--output-prefix", str(tmp_path / "o")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and str(missing) in lines[0]
    assert not list(tmp_path.iterdir())


# ----------------------------------------------------------------------------- GPT datasets
def test_gpt_datasets(tok, small_prefix, tmp_path):
    from zo_megatron.data import build_gpt_datasets

    seq = 32
    kw = dict(split="2,1,0", seq_length=seq, tokenizer=tok, train_samples=150, valid_samples=20,
              test_samples=0)
    train, valid, test = build_gpt_datasets([small_prefix], seed=1234, cache_dir=str(tmp_path / "a"), **kw)
    assert test is None and len(train) >= 150 and len(valid) >= 20
    for ds in (train, valid):
        for i in (0, 1, len(ds) - 1):
            s = ds[i]
            assert set(s) >= {"tokens", "labels", "loss_mask", "position_ids"}
            assert all(s[k].shape == (seq,) for k in ("tokens", "labels", "loss_mask", "position_ids"))
            assert (s["tokens"][1:] == s["labels"][:-1]).all()
            assert (s["position_ids"] == np.arange(seq)).all()
    # documents split by range: 3 documents -> 2 train, 1 valid
    assert set(train.indices.tolist()) == {0, 1} and set(valid.indices.tolist()) == {2}
    assert set(train.document_index.tolist()) <= {0, 1} and set(valid.document_index.tolist()) == {2}
    # a valid sample's text comes from document 2 only
    docs = _read_docs(small_prefix)
    v = valid[0]["tokens"].tolist()
    doc2 = docs[2] + docs[2]
    assert any(doc2[j:j + 8] == v[:8] for j in range(len(docs[2])))

    # deterministic: same seed in a fresh cache gives the same order; another seed does not
    same, _, _ = build_gpt_datasets([small_prefix], seed=1234, cache_dir=str(tmp_path / "b"), **kw)
    other, _, _ = build_gpt_datasets([small_prefix], seed=99, cache_dir=str(tmp_path / "a"), **kw)
    first = lambda ds: np.stack([ds[i]["tokens"].numpy() for i in range(20)])  # noqa: E731
    assert (first(train) == first(same)).all()
    assert not (first(train) == first(other)).all()


def test_gpt_datasets_blend_and_split_errors(tok, small_prefix, tmp_path):
    from zo_megatron.data import build_gpt_datasets

    kw = dict(seq_length=32, seed=1, tokenizer=tok, cache_dir=str(tmp_path))
    train, valid, test = build_gpt_datasets(["0.3", small_prefix, "0.7", small_prefix], "2,1,0",
                                            train_samples=50, valid_samples=5, test_samples=0, **kw)
    assert len(train) >= 50 and len(valid) >= 5 and test is None  # megatron rounds each part up
    import torch.distributed as dist

    assert not dist.is_initialized()  # the private 1-rank group used for the blend is gone
    train, _, _ = build_gpt_datasets([small_prefix, small_prefix], "1", train_samples=500,
                                     valid_samples=0, test_samples=0, **kw)
    assert len(train) >= 500  # no weights: weighted by tokens, not capped at one epoch
    assert "dataset_id" in train[0] and train[0]["tokens"].shape == (32,)
    with pytest.raises(DataError) as e:  # 3 documents leave the test split empty
        build_gpt_datasets([small_prefix], "969,30,1", train_samples=10, valid_samples=0,
                           test_samples=5, **kw)
    assert "test split" in _one_line(e) and small_prefix in str(e.value)
    with pytest.raises(DataError):
        build_gpt_datasets([small_prefix], "a,b", train_samples=1, valid_samples=0,
                           test_samples=0, **kw)


def test_dp_batches_partition_and_resume(tok, small_prefix, tmp_path):
    from zo_megatron.data import build_gpt_datasets, dp_batches

    train, _, _ = build_gpt_datasets([small_prefix], "1", seq_length=16, seed=7, tokenizer=tok,
                                     train_samples=100, valid_samples=0, test_samples=0,
                                     cache_dir=str(tmp_path))
    mbs, dp = 2, 3
    gbs = mbs * dp
    n_steps = len(train) // gbs
    per_rank = [list(dp_batches(train, mbs, r, dp)) for r in range(dp)]
    assert all(len(b) == n_steps for b in per_rank)
    for step in range(n_steps):
        got = np.concatenate([per_rank[r][step]["tokens"].numpy() for r in range(dp)])
        want = np.stack([train[i]["tokens"].numpy() for i in range(step * gbs, (step + 1) * gbs)])
        assert (got == want).all()  # the ranks' chunks, in rank order, are the global batch
    # rank r reads global samples i with (i // mbs) % dp == r, and no other
    for r in range(dp):
        it = dp_batches(train, mbs, r, dp)
        b = next(iter(it))
        assert it.consumed_samples == gbs
        want = np.stack([train[i]["tokens"].numpy() for i in range(gbs) if (i // mbs) % dp == r])
        assert (b["tokens"].numpy() == want).all() and b["loss_mask"].shape == (mbs, 16)
    # resume after k consumed samples: exactly the batches after k
    k = 2 * gbs
    for r in range(dp):
        resumed = list(dp_batches(train, mbs, r, dp, start_sample=k))
        assert len(resumed) == n_steps - 2
        for a, b in zip(resumed, per_rank[r][2:]):
            assert all((a[key] == b[key]).all() for key in a)


# ----------------------------------------------------------------------------- bad datasets
def test_validate_data_prefix_errors(tok, small_prefix, tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    from zo_megatron.data import validate_data_prefix

    info = validate_data_prefix(small_prefix, tok)
    assert info.documents == 3 and info.dtype == "uint16"

    missing = str(tmp_path / "nothing_text_document")
    with pytest.raises(DataError) as e:
        validate_data_prefix(missing, tok)
    assert missing in _one_line(e) and "preprocess_data.py" in str(e.value)

    def copy(name):
        dst = str(tmp_path / name)
        for ext in (".bin", ".idx"):
            shutil.copy(small_prefix + ext, dst + ext)
        return dst

    trunc = copy("trunc")
    with open(trunc + ".idx", "r+b") as f:
        f.truncate(os.path.getsize(trunc + ".idx") - 8)
    with pytest.raises(DataError) as e:
        validate_data_prefix(trunc, tok)
    assert trunc + ".idx" in _one_line(e) and "truncated" in str(e.value)

    short_bin = copy("shortbin")
    with open(short_bin + ".bin", "r+b") as f:
        f.truncate(100)
    with pytest.raises(DataError) as e:
        validate_data_prefix(short_bin, tok)
    assert short_bin + ".bin" in _one_line(e)

    garbage = copy("garbage")
    with open(garbage + ".idx", "r+b") as f:
        f.write(b"NOTANIDX!")
    with pytest.raises(DataError) as e:
        validate_data_prefix(garbage, tok)
    assert garbage + ".idx" in _one_line(e)

    small = str(tmp_path / "uint8")  # a dtype that cannot hold GPT-2's vocabulary
    b = IndexedDatasetBuilder(small + ".bin", dtype=np.uint8)
    b.add_document(np.array([1, 2, 3]), [3])
    b.finalize(small + ".idx")
    with pytest.raises(DataError) as e:
        validate_data_prefix(small, tok)
    assert small + ".idx" in _one_line(e) and "uint8" in str(e.value)

    class TinyVocab:  # the real data has ids beyond a 1000-token vocabulary
        vocab_size, eod = 1000, 999

    with pytest.raises(DataError) as e:
        validate_data_prefix(small_prefix, TinyVocab())
    assert small_prefix + ".bin" in _one_line(e) and "1000" in str(e.value)


# ----------------------------------------------------------------------------- embedded corpus
def test_default_data_prefix_builds_once(tok, tmp_path):
    from zo_megatron.data import default_data_prefix, validate_data_prefix

    cache = str(tmp_path / "cache")
    results = []
    threads = [threading.Thread(target=lambda: results.append(default_data_prefix(cache)))
               for _ in range(2)]  # two callers at once: one builds, the other waits
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 2 and results[0] == results[1]
    prefix = results[0]
    info = validate_data_prefix(prefix, tok)
    assert info.documents == 233 and 2_000_000 < info.tokens < 2_150_000
    assert sorted(os.listdir(cache)) == [os.path.basename(os.path.dirname(prefix)),
                                         os.path.basename(os.path.dirname(prefix)) + ".lock"]
    stat = {ext: os.stat(prefix + ext) for ext in (".bin", ".idx")}
    t0 = time.perf_counter()
    assert default_data_prefix(cache) == prefix
    assert time.perf_counter() - t0 < 0.5
    for ext, st in stat.items():
        st2 = os.stat(prefix + ext)
        assert (st2.st_ino, st2.st_mtime_ns, st2.st_size) == (st.st_ino, st.st_mtime_ns, st.st_size)
    # every address decodes back to its text; the documents are in a fixed shuffled order so that
    # Megatron's range split holds out a random sample of years, not the most recent ones
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    from zo_megatron.data import iter_corpus_documents

    texts = [text for _, text in iter_corpus_documents()]
    ds = IndexedDataset(prefix)  # keep it alive: its items are views of its mmap
    decoded = [tok.decode(ds[i][:-1].tolist()) for i in range(len(ds))]
    assert all(int(ds[i][-1]) == tok.eod for i in range(len(ds)))
    assert sorted(decoded) == sorted(texts)
    assert decoded != texts

