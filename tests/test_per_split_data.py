"""Data given per split (Megatron-LM's --train-data-path / --valid-data-path / --test-data-path, and the
--data-args-path / --per-split-data-args-path files): each split's own prefixes, used whole.

The reference for a split's dataset is the same prefix built as a --data-path blend whose --split gives
that split everything ("1,0,0" for train, "0,1,0" for valid): megatron-core builds both from the whole
prefix with the same seed, so they must hold the same samples in the same order."""
import json

import numpy as np
import pytest

from tests.test_pretrain import TINY, _rows, _single
from zo_megatron.errors import ConfigError
from zo_megatron.training.arguments import parse_args

SEQ = 32


@pytest.fixture(scope="module")
def two_prefixes(tmp_path_factory):
    from zo_megatron.data import extract_corpus
    from zo_megatron.data.preprocess import preprocess

    d = tmp_path_factory.mktemp("sotu")
    files = extract_corpus(str(d / "txt"), limit=8)
    preprocess(files[:5], str(d / "a"), progress=False)
    preprocess(files[5:], str(d / "b"), progress=False)
    return str(d / "a_text_document"), str(d / "b_text_document")


def _tokens(ds, n):
    return np.stack([ds[i]["tokens"].numpy() for i in range(n)])


def test_each_split_is_its_own_data_used_whole(two_prefixes, tmp_path):
    from zo_megatron.data import build_gpt_datasets, build_tokenizer

    a, b = two_prefixes
    tok = build_tokenizer()
    kw = dict(seq_length=SEQ, seed=7, tokenizer=tok, test_samples=0)
    train, valid, test = build_gpt_datasets({"train": [a], "valid": [b], "test": None}, None, train_samples=60,
                                            valid_samples=10, cache_dir=str(tmp_path / "per"), **kw)
    assert test is None
    ref_train, _, _ = build_gpt_datasets([a], "1,0,0", train_samples=60, valid_samples=0,
                                         cache_dir=str(tmp_path / "ref_a"), **kw)
    _, ref_valid, _ = build_gpt_datasets([b], "0,1,0", train_samples=0, valid_samples=10,
                                         cache_dir=str(tmp_path / "ref_b"), **kw)
    assert len(train) == len(ref_train) and len(valid) == len(ref_valid)
    assert (_tokens(train, len(train)) == _tokens(ref_train, len(train))).all()
    assert (_tokens(valid, len(valid)) == _tokens(ref_valid, len(valid))).all()
    assert train.dataset.path_prefix == a and valid.dataset.path_prefix == b

    # a weighted blend for one split
    blended, _, _ = build_gpt_datasets({"train": ["0.3", a, "0.7", b], "valid": None, "test": None}, None,
                                       train_samples=40, valid_samples=0, cache_dir=str(tmp_path / "blend"), **kw)
    ids = {int(blended[i]["dataset_id"]) for i in range(len(blended))}
    assert len(blended) >= 40 and ids == {0, 1}


def _parse(*extra):
    return parse_args(["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
                       "--lr", "1e-3", "--train-iters", "4", *extra])


def test_the_flags_and_files(two_prefixes, tmp_path):
    a, b = two_prefixes
    args = _parse("--train-data-path", "0.5", a, "0.5", b, "--valid-data-path", b)
    assert args.data_per_split == {"train": ["0.5", a, "0.5", b], "valid": [b], "test": None}
    assert args.split is None and args.data_path is None
    assert _parse("--data-path", a).split == "969, 30, 1"            # Megatron-LM's default for a blend
    spec = tmp_path / "splits.json"
    spec.write_text(json.dumps({"train": f"1 {a}", "valid": [b]}))
    assert _parse("--per-split-data-args-path", str(spec)).data_per_split == \
        {"train": ["1", a], "valid": [b], "test": None}
    listed = tmp_path / "blend.txt"
    listed.write_text(f"0.4 {a}\n0.6 {b}\n")
    assert _parse("--data-args-path", str(listed)).data_path == ["0.4", a, "0.6", b]
    refused = {("--data-path", a, "--train-data-path", a): "contradict each other",
               ("--train-data-path", a, "--split", "9,1,0", "--valid-data-path", b): "drop --split",
               ("--valid-data-path", b): "without --train-data-path",
               ("--train-data-path", a): "without --valid-data-path but --eval-iters 100",
               ("--train-data-path",): "without a prefix",
               ("--per-split-data-args-path", str(listed)): "not a readable JSON file",
               ("--per-split-data-args-path", str(spec), "--train-data-path", a): "not both",
               ("--data-args-path", str(tmp_path / "missing.txt")): "cannot be read"}
    for argv, words in refused.items():
        with pytest.raises(ConfigError, match=words) as e:
            _parse(*argv)
        assert "\n" not in str(e.value)
    assert _parse("--train-data-path", a, "--eval-iters", "0").data_per_split["valid"] is None
    only_valid = tmp_path / "valid_only.json"
    only_valid.write_text(json.dumps({"valid": [b]}))
    with pytest.raises(ConfigError, match=f'{only_valid} has no "train": there is nothing to train on; add it'):
        _parse("--per-split-data-args-path", str(only_valid))


def test_the_job_trains_and_evaluates_on_its_own_splits(two_prefixes, tmp_path):
    a, b = two_prefixes
    log = tmp_path / "log.jsonl"
    r = _single(["--train-data-path", a, "--valid-data-path", b, "--test-data-path", a, "--train-iters", "4",
                 "--log-jsonl", str(log), *TINY[:TINY.index("--split")]], tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert f"train: {a}; valid: {b}; test: {a}" in r.stdout, r.stdout[:3000]
    assert [row["iteration"] for row in _rows(log, "train")] == [1, 2, 3, 4]
    evals, tests = _rows(log, "eval"), _rows(log, "test")
    # validation at iteration 4 (--eval-interval 4), then the test data once at the end, a record of its own
    assert [(e["iteration"], e["split"]) for e in evals] == [(4, "validation")], evals
    assert [(t["iteration"], t["split"], t["eval_samples"]) for t in tests] == [(4, "test", 2 * 4)], tests
    assert tests[0]["test_loss"] != evals[0]["val_loss"] and "val_loss" not in tests[0]
    assert " test loss at iteration 4 | lm loss" in r.stdout, r.stdout[-2000:]
