"""Hugging Face tokenizers end to end (--tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR):
the ids against transformers' AutoTokenizer, preprocessing with 1 and 2 workers, the dataset record,
cache keys, the training job with its checkpoint's tokenizer/ folder, and bad tokenizer input.

The tokenizer is the small byte-level BPE of tests/hf_tokenizer.py (trained offline on the corpus)."""
import json
import os
import random
import subprocess
import sys

import numpy as np
import pytest

from tests.hf_tokenizer import HF_VOCAB_SIZE, make_hf_tokenizer
from tests.seeds import fresh_seed
from zo_megatron.data import DataError, build_tokenizer
from zo_megatron.data.corpus import extract_corpus

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HF = ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model"]


def _one_line(err) -> str:
    msg = str(err.value if hasattr(err, "value") else err)
    assert "\n" not in msg and msg.strip() == msg and msg
    return msg


def _reference(tok_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tok_dir)


def _read_docs(prefix):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(prefix)
    return [np.asarray(ds[i]).tolist() for i in range(len(ds))]


def _random_texts(seed: int, corpus: list[str], n: int) -> list[str]:
    """Slices of real text with random unicode, whitespace and the special tokens' spellings mixed in."""
    rng = random.Random(seed)
    alphabet = "abcXYZ 0123456789 \t\n\r\n  .,;'\"-ñéß日本語😀\u200b<s></s>"
    out = []
    for _ in range(n):
        src = rng.choice(corpus)
        a = rng.randrange(len(src))
        text = src[a:a + rng.randrange(1, 400)]
        text += "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 60)))
        out.append(text + src[:rng.randrange(0, 50)])
    return out


def test_tokenizer_matches_autotokenizer(hf_tokenizer_dir):
    seed = fresh_seed("hf tokenizer")
    ref = _reference(hf_tokenizer_dir)
    tok = build_tokenizer(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=hf_tokenizer_dir)
    assert (tok.tokenizer_type, tok.vocab_size, tok.eod) == ("HuggingFaceTokenizer", len(ref), ref.eos_token_id)
    assert tok.vocab_size == HF_VOCAB_SIZE and tok.eod == 1 and tok.bos == 0
    corpus = [open(f, encoding="utf-8").read() for f in extract_corpus(os.path.join(hf_tokenizer_dir, "..", "c"),
                                                                           limit=2)]
    texts = _random_texts(seed, corpus, 40) + corpus
    batch = tok.encode_batch(texts)
    for text, ids in zip(texts, batch):
        expected = ref(text, split_special_tokens=True).input_ids   # "</s>" in a text is text (issue 35, 14)
        assert ids == expected == tok.encode(text)
        assert ids[0] == ref.bos_token_id                  # the config adds BOS, as Llama's does
        assert tok.decode(ids) == ref.decode(expected, skip_special_tokens=False)
    with pytest.raises(ValueError):
        tok.decode([tok.vocab_size])
    # the same files elsewhere: the same fingerprint; another vocabulary: another one
    other = make_hf_tokenizer(os.path.join(hf_tokenizer_dir, "..", "copy"))
    assert build_tokenizer(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=other).fingerprint == tok.fingerprint
    assert build_tokenizer().fingerprint != tok.fingerprint


@pytest.mark.parametrize("workers", [1, 2])
def test_preprocess_ids_equal_autotokenizer(hf_tokenizer_dir, tmp_path, workers):
    seed = fresh_seed(f"hf preprocess workers={workers}")
    ref = _reference(hf_tokenizer_dir)
    corpus = [open(f, encoding="utf-8").read() for f in extract_corpus(str(tmp_path / "txt"), limit=3)]
    texts = corpus + _random_texts(seed, corpus, 30)
    path = tmp_path / "docs.jsonl"
    with open(path, "w", encoding="utf-8") as f:
        for t in texts:
            f.write(json.dumps({"text": t}) + "\n")
    from zo_megatron.data.preprocess import main

    assert main(["--input", str(path), "--output-prefix", str(tmp_path / "o"), "--workers", str(workers),
                 *HF, hf_tokenizer_dir]) == 0                # the CLI's code path, in this process
    prefix = str(tmp_path / "o_text_document")
    docs = _read_docs(prefix)
    assert len(docs) == len(texts)
    for text, ids in zip(texts, docs):                   # every id against transformers
        assert ids == ref(text, split_special_tokens=True).input_ids + [ref.eos_token_id]
    meta = json.load(open(prefix + ".meta.json"))
    flat = [i for d in docs for i in d]
    assert meta["tokenizer_type"] == "HuggingFaceTokenizer" and meta["tokenizer_model"] == hf_tokenizer_dir
    assert (meta["vocab_size"], meta["eod"], meta["max_token_id"], meta["min_token_id"], meta["tokens"]) == \
        (len(ref), ref.eos_token_id, max(flat), min(flat), len(flat))
    assert meta["tokenizer_fingerprint"] == build_tokenizer(tokenizer_type="HuggingFaceTokenizer",
                                                            tokenizer_model=hf_tokenizer_dir).fingerprint


def test_special_token_text_inside_a_document_is_text_unless_parsed(hf_tokenizer_dir, tmp_path):
    """Issue 35, item 14: "</s>" / "<s>" written inside a document became real EOD / BOS ids mid-document
    on the HF path (the GPT-2 path encodes them as text). Now text by default; --parse-special-tokens
    gives Megatron-LM's ids (tokenizer(text).input_ids). Checked against AutoTokenizer, every id."""
    from transformers import AutoTokenizer

    from zo_megatron.data.preprocess import main as preprocess_main

    seed = fresh_seed()
    print(f"seed {seed}")
    rng = random.Random(seed)
    ref = AutoTokenizer.from_pretrained(hf_tokenizer_dir, local_files_only=True)
    words = ["state", "union", "the", "</s>", "<s>", "law", "of", "people"]
    texts = [" ".join(rng.choice(words) for _ in range(rng.randint(3, 30))) + " </s> end" for _ in range(12)]
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    eos, bos = ref.eos_token_id, ref.bos_token_id
    for parse in (False, True):
        out = tmp_path / f"p{int(parse)}"
        rc = preprocess_main(["--input", str(src), "--output-prefix", str(out), *HF, hf_tokenizer_dir,
                              "--workers", "2", *(["--parse-special-tokens"] if parse else [])])   # spec() carries it
        assert rc == 0
        docs = _read_docs(f"{out}_text_document")
        want = [list(ref(t, split_special_tokens=not parse).input_ids) + [eos] for t in texts]
        assert docs == want
        inner = [i for d in docs for i in d[1:-1]]          # BOS first, the appended EOD last
        assert (eos in inner or bos in inner) == parse
    with pytest.raises(DataError) as e:                      # GPT-2's BPE never parses them
        build_tokenizer(parse_special_tokens=True)
    assert "--parse-special-tokens applies to --tokenizer-type HuggingFaceTokenizer" in _one_line(e)


def test_dataset_record_and_vocabulary_check(hf_tokenizer_dir, tmp_path):
    """The job's cheap check uses the recorded max id while the record matches the pair, and
    reads the tokens once it does not; data from another tokenizer is refused in one line."""
    from zo_megatron.data import validate_data_prefix
    from zo_megatron.data.dataset_meta import read_dataset_meta
    from zo_megatron.data.preprocess import preprocess

    hf = build_tokenizer(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=hf_tokenizer_dir)
    gpt2 = build_tokenizer()
    files = extract_corpus(str(tmp_path / "txt"), limit=2)
    g = preprocess(files, str(tmp_path / "g"), progress=False).prefixes["text"]
    h = preprocess(files, str(tmp_path / "h"), progress=False, tokenizer=hf).prefixes["text"]
    assert read_dataset_meta(g)["tokenizer_type"] == "GPT2BPETokenizer"
    assert read_dataset_meta(h)["max_token_id"] == max(max(d) for d in _read_docs(h))

    with pytest.raises(DataError) as e:                  # GPT-2 ids (up to 50256) in a 2000-token model
        validate_data_prefix(g, hf)
    msg = _one_line(e)
    assert g + ".bin" in msg and "GPT2BPETokenizer" in msg and f"[0, {HF_VOCAB_SIZE})" in msg
    import logging

    # fits, but another tokenizer made it: the ids mean other text, refused (issue 35, item 17: was a
    # warning, said twice); --allow-other-tokenizer-data ("warn") says it once, "accept" not at all
    with pytest.raises(DataError) as e:
        validate_data_prefix(h, gpt2)
    msg = _one_line(e)
    assert "HuggingFaceTokenizer" in msg and "not this run's tokenizer" in msg and "--allow-other-tokenizer-data" in msg
    seen = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: seen.append(record.getMessage())
    log = logging.getLogger("zo_megatron.data.datasets")
    log.addHandler(handler)
    try:
        validate_data_prefix(h, gpt2, "warn")
        validate_data_prefix(h, gpt2, "accept")
    finally:
        log.removeHandler(handler)
    assert len(seen) == 1 and "HuggingFaceTokenizer" in seen[0] and "not this run's tokenizer" in seen[0]
    validate_data_prefix(h, hf)

    # a .bin rewritten in place (same size, new mtime): the record no longer describes it
    data = np.memmap(h + ".bin", dtype=np.uint16, mode="r+")
    data[len(data) // 2] = HF_VOCAB_SIZE + 5
    data.flush()
    del data
    os.utime(h + ".bin", ns=(1, 1))
    assert read_dataset_meta(h) is None
    with pytest.raises(DataError) as e:
        validate_data_prefix(h, hf)
    assert str(HF_VOCAB_SIZE + 5) in _one_line(e)


def test_cache_keys_follow_the_tokenizer(hf_tokenizer_dir, tmp_path, monkeypatch):
    """The same corpus with two tokenizers: two corpus cache entries and two index caches."""
    from zo_megatron.data import build_gpt_datasets, corpus
    from zo_megatron.data.corpus import corpus_key, default_data_prefix
    from zo_megatron.data.dataset_meta import read_dataset_meta
    from zo_megatron.data.preprocess import preprocess

    hf = build_tokenizer(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=hf_tokenizer_dir)
    gpt2 = build_tokenizer()
    assert corpus_key(tokenizer=gpt2) == corpus_key()    # GPT-2's entry is the one it always was
    assert corpus_key(tokenizer=hf) != corpus_key()
    other = make_hf_tokenizer(tmp_path / "other", config_update={"eos_token": "<s>"})
    hf2 = build_tokenizer(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=other)
    assert len({corpus_key(tokenizer=t) for t in (gpt2, hf, hf2)}) == 3

    # the embedded corpus (cut to 3 addresses to keep it fast) under each tokenizer: its own entry
    few = list(corpus.iter_corpus_documents())[:3]
    monkeypatch.setattr(corpus, "iter_corpus_documents", lambda *a, **k: iter(few))
    entries = {name: default_data_prefix(str(tmp_path / "corpus_cache"), tokenizer=t)
               for name, t in (("gpt2", gpt2), ("hf", hf), ("hf2", hf2))}
    assert len(set(entries.values())) == 3
    assert default_data_prefix(str(tmp_path / "corpus_cache")) == entries["gpt2"]
    for name, t in (("gpt2", gpt2), ("hf", hf), ("hf2", hf2)):
        meta = read_dataset_meta(entries[name])
        assert (meta["tokenizer_fingerprint"], meta["documents"]) == (t.fingerprint, 3)

    files = extract_corpus(str(tmp_path / "txt"), limit=2)
    prefix = preprocess(files, str(tmp_path / "d"), progress=False, tokenizer=hf).prefixes["text"]
    caches = {}
    for name, tok in (("a", hf), ("b", hf2)):
        cache = tmp_path / f"cache_{name}"
        # hf2 did not make the data (refused by default since issue 35, item 17): accepted here on purpose
        build_gpt_datasets([prefix], "100,0,0", 32, 1, tok, 8, 0, 0, cache_dir=str(cache), other_tokenizer="accept")
        caches[name] = {f for _, _, fs in os.walk(cache) for f in fs if f.endswith(".npy")}
        assert caches[name]
    assert not caches["a"] & caches["b"]                  # file names carry the key's hash


# ----------------------------------------------------------------------------- bad input
def _bad_dirs(root):
    """(name, directory, text the one error line must hold)."""
    no_json = make_hf_tokenizer(os.path.join(root, "no_json"), without=("tokenizer.json",))
    no_cfg = make_hf_tokenizer(os.path.join(root, "no_cfg"), without=("tokenizer_config.json",))
    remote = make_hf_tokenizer(os.path.join(root, "remote"),
                               config_update={"auto_map": {"AutoTokenizer": ["tok.MyTokenizer", None]}})
    no_eos = make_hf_tokenizer(os.path.join(root, "no_eos"), config_update={"eos_token": None})
    with open(os.path.join(root, "no_eos", "special_tokens_map.json"), "w") as f:
        json.dump({"bos_token": "<s>"}, f)
    broken = make_hf_tokenizer(os.path.join(root, "broken"))
    with open(os.path.join(broken, "tokenizer.json"), "w") as f:
        f.write("{not json")
    return [("no tokenizer.json", no_json, "has no tokenizer.json"),
            ("no tokenizer_config.json", no_cfg, "has no tokenizer_config.json"),
            ("needs trust_remote_code", remote, "trust_remote_code"),
            ("no eos token", no_eos, "has no eos token"),
            ("broken tokenizer.json", broken, "AutoTokenizer cannot load it"),
            ("missing directory", os.path.join(root, "nowhere"), "no such directory")]


def test_bad_tokenizer_directories(tmp_path):
    for name, d, needle in _bad_dirs(str(tmp_path)):
        with pytest.raises(DataError) as e:
            build_tokenizer(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=d)
        assert needle in _one_line(e) and d in str(e.value), name
    with pytest.raises(DataError) as e:
        build_tokenizer(tokenizer_type="HuggingFaceTokenizer")
    assert "needs --tokenizer-model" in _one_line(e)
    with pytest.raises(DataError) as e:
        build_tokenizer(tokenizer_model=str(tmp_path))
    assert "--tokenizer-type HuggingFaceTokenizer" in _one_line(e)
    with pytest.raises(DataError) as e:
        build_tokenizer(vocab_file="v.json", tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(tmp_path))
    assert "--vocab-file" in _one_line(e)


def test_preprocess_cli_bad_tokenizer_exits_2(hf_tokenizer_dir, tmp_path):
    """Each bad tokenizer: one error line, exit 2, nothing written (one process runs the table)."""
    txt = tmp_path / "a.txt"
    txt.write_text("Some text.", encoding="utf-8")
    cases = [(["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", d], needle)
             for _, d, needle in _bad_dirs(str(tmp_path / "toks"))]
    cases += [(["--tokenizer-type", "HuggingFaceTokenizer"], "needs --tokenizer-model"),
              (["--tokenizer-model", hf_tokenizer_dir], "only read with --tokenizer-type HuggingFaceTokenizer")]
    script = ("import contextlib, io, json, sys\n"
              "from zo_megatron.data.preprocess import main\n"
              "out = []\n"
              "for argv in json.loads(sys.argv[1]):\n"
              "    err = io.StringIO()\n"
              "    with contextlib.redirect_stderr(err):\n"
              "        rc = main(argv)\n"
              "    out.append([rc, err.getvalue()])\n"
              "print(json.dumps(out))\n")
    argvs = [["--input", str(txt), "--output-prefix", str(tmp_path / "out" / "o"), *extra] for extra, _ in cases]
    r = subprocess.run([sys.executable, "-c", script, json.dumps(argvs)], capture_output=True, text=True,
                       timeout=300, env={**os.environ, "PYTHONPATH": ROOT})
    assert r.returncode == 0, r.stderr[-2000:]
    results = json.loads(r.stdout.strip().splitlines()[-1])
    for (extra, needle), (rc, err) in zip(cases, results):
        errors = [ln for ln in err.splitlines() if ln.startswith("error:")]
        assert rc == 2 and len(errors) == 1 and needle in errors[0] and "Traceback" not in err, (extra, err)
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------- the training job
def test_pretrain_with_hf_tokenizer_saves_it(hf_tokenizer_dir, tmp_path):
    """pretrain_gpt.py trains on data preprocessed with the HF tokenizer; the model's vocabulary is
    len(tokenizer), and the checkpoint carries the tokenizer's files."""
    from zo_megatron.data.preprocess import preprocess
    from zo_megatron.data.tokenizer import hf_tokenizer_files

    hf = build_tokenizer(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=hf_tokenizer_dir)
    prefix = preprocess(extract_corpus(str(tmp_path / "txt"), limit=4), str(tmp_path / "d"), progress=False,
                        tokenizer=hf).prefixes["text"]
    save, log = tmp_path / "ckpt", tmp_path / "log.jsonl"
    argv = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
            "--micro-batch-size", "4", "--lr", "3e-3", "--lr-decay-iters", "8", "--log-interval", "1",
            "--eval-iters", "0", "--no-progress-bar", "--split", "100,0,0", "--fp32", "--data-path", prefix,
            "--save", str(save), "--log-jsonl", str(log), *HF, hf_tokenizer_dir]
    from tests.test_pretrain import _single

    r = _single([*argv, "--train-iters", "6"], tmp_path, timeout=300)      # one forked rank
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert f"tokenizer: HuggingFaceTokenizer {hf_tokenizer_dir}" in r.stdout and "vocab 2000 (padded 2048)" in r.stdout
    losses = [row["loss"] for row in map(json.loads, open(log)) if row["kind"] == "train"]
    assert len(losses) == 6 and losses[0] < np.log(HF_VOCAB_SIZE) + 0.5   # a 2000-way start, not GPT-2's 50257
    it = save / "iter_0000006"
    manifest = json.load(open(it / "checkpoint.json"))
    assert (manifest["tokenizer_type"], manifest["tokenizer_fingerprint"]) == ("HuggingFaceTokenizer", hf.fingerprint)
    assert manifest["model"]["vocab_size"] == HF_VOCAB_SIZE
    (emb,) = [v for k, v in manifest["params"].items() if k.endswith("word_embeddings.weight")]
    assert list(emb) == [HF_VOCAB_SIZE, 64]              # saved unpadded (the model pads to 2048)
    names = sorted(os.path.basename(f) for f in hf_tokenizer_files(hf_tokenizer_dir))
    assert sorted(os.listdir(it / "tokenizer")) == names and manifest["tokenizer_files"] == \
        [f"tokenizer/{n}" for n in names]
    for n in names:
        assert (it / "tokenizer" / n).read_bytes() == open(os.path.join(hf_tokenizer_dir, n), "rb").read()
    ref = _reference(str(it / "tokenizer"))                # the copy loads as the same tokenizer
    assert ref("Fellow citizens").input_ids == hf.encode("Fellow citizens")
    # it resumes (the tokenizer/ folder is no obstacle to the checkpoint's checks)
    r = _single([*argv, "--train-iters", "8", "--load", str(save)], tmp_path, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    resumed = [row for row in map(json.loads, open(log)) if row["kind"] == "train"][len(losses):]
    assert [row["iteration"] for row in resumed] == [7, 8]
    assert sorted(os.listdir(save / "iter_0000008" / "tokenizer")) == names
