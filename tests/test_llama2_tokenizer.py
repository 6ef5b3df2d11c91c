"""--tokenizer-type Llama2Tokenizer (a SentencePiece model file; Megatron-LM's Llama-2 and Mixtral
recipes) against Megatron-LM's own definition (tests/megatron_reference.py, transcribed from
core_v0.16.1's _Llama2Tokenizer and tools/preprocess_data.py), on a SentencePiece BPE model trained
here on the embedded corpus (600 pieces, byte fallback):
  - ids of random corpus slices and random unicode text, one by one and batched: [bos] + pieces,
    every id; vocab_size = the piece count, eod = eos; decode = decode_ids; "</s>" / "<s>" text inside
    a document stays text (no eos or bos id mid-document);
  - tools/preprocess_data.py's .bin/.idx: each document's ids + eod, every id, read back with
    megatron-core's IndexedDataset; a worker process rebuilds the same tokenizer (spec);
  - bad flags: no --tokenizer-model, a directory, a file that is not a SentencePiece model, GPT-2's
    --vocab-file with it, --parse-special-tokens: one line each.
"""
import os
import random

import pytest

from tests.megatron_reference import megatron_llama2_tokenize, megatron_preprocess_document
from tests.seeds import fresh_seed

spm = pytest.importorskip("sentencepiece")


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory):
    from zo_megatron.data.corpus import iter_corpus_documents

    d = tmp_path_factory.mktemp("sentencepiece")
    docs = [text for _, text in iter_corpus_documents()][:40]
    spm.SentencePieceTrainer.train(sentence_iterator=iter(docs), model_prefix=str(d / "tokenizer"), vocab_size=600,
                                   model_type="bpe", byte_fallback=True, max_sentence_length=1 << 20,
                                   minloglevel=2)
    return str(d / "tokenizer.model"), docs


def _texts(docs, seed):
    rng = random.Random(seed)
    out = []
    for _ in range(40):
        doc = rng.choice(docs)
        a = rng.randrange(len(doc))
        out.append(doc[a:a + rng.randrange(1, 400)])
    out += ["".join(chr(rng.choice([rng.randrange(32, 127), rng.randrange(0xA0, 0x2FFF)])) for _ in range(60))
            for _ in range(10)]
    return out + ["", " ", "a </s> b <s> c", "\n\n  tabs\tand  spaces  "]


def test_ids_are_megatron_lms_llama2_tokenizer(sp_model):
    from zo_megatron.data.tokenizer import build_tokenizer, tokenizer_from_spec

    path, docs = sp_model
    seed = fresh_seed("llama2 tokenizer")
    sp = spm.SentencePieceProcessor(model_file=path)
    tok = build_tokenizer(tokenizer_type="Llama2Tokenizer", tokenizer_model=path)
    assert (tok.tokenizer_type, tok.vocab_size, tok.eod) == ("Llama2Tokenizer", sp.vocab_size(), sp.eos_id())
    assert tok.vocab_size == 600 and tok.files == (os.path.abspath(path),)
    texts = _texts(docs, seed)
    want = [megatron_llama2_tokenize(sp, t) for t in texts]
    assert [tok.encode(t) for t in texts] == want
    assert tok.encode_batch(texts) == want
    again = tokenizer_from_spec(tok.spec())
    assert again.fingerprint == tok.fingerprint and again.encode_batch(texts) == want
    for t, ids in zip(texts, want):
        assert tok.decode(ids[1:]) == sp.decode_ids(ids[1:])
    mid = tok.encode("a </s> b <s> c")
    assert sp.eos_id() not in mid and mid.count(sp.bos_id()) == 1 and mid[0] == sp.bos_id()
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.decode([600])


def test_preprocess_writes_megatron_lms_ids_plus_eod(sp_model, tmp_path):
    import numpy as np
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from zo_megatron.data.preprocess import preprocess

    path, docs = sp_model
    seed = fresh_seed("llama2 preprocess")
    texts = [t for t in _texts(docs, seed) if t.strip()][:30]
    src = tmp_path / "docs.jsonl"
    import json

    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    res = preprocess([str(src)], str(tmp_path / "out"), tokenizer_type="Llama2Tokenizer", tokenizer_model=path,
                     workers=2, progress=False)
    sp = spm.SentencePieceProcessor(model_file=path)
    ds = IndexedDataset(str(tmp_path / "out_text_document"))
    assert len(ds) == len(texts), (len(ds), len(texts), res)
    for i, t in enumerate(texts):
        assert np.asarray(ds[i]).tolist() == megatron_preprocess_document(sp, t), i


def test_bad_llama2_flags_are_one_line(sp_model, tmp_path):
    from zo_megatron.data.errors import DataError
    from zo_megatron.data.tokenizer import build_tokenizer

    path, _ = sp_model
    junk = tmp_path / "tokenizer.model"
    junk.write_bytes(b"not a sentencepiece model")
    cases = [
        (dict(), "--tokenizer-type Llama2Tokenizer needs --tokenizer-model FILE"),
        (dict(tokenizer_model=str(tmp_path)), "no such file (a directory: give its tokenizer.model file)"),
        (dict(tokenizer_model=str(junk)), "not a SentencePiece model"),
        (dict(tokenizer_model=path, vocab_file="vocab.json"), "--vocab-file belong to GPT2BPETokenizer"),
        (dict(tokenizer_model=path, parse_special_tokens=True), "--parse-special-tokens applies to"),
    ]
    for kwargs, says in cases:
        with pytest.raises(DataError) as e:
            build_tokenizer(tokenizer_type="Llama2Tokenizer", **kwargs)
        assert says in str(e.value) and "\n" not in str(e.value), (kwargs, str(e.value))
