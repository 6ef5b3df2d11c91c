"""--reset-position-ids (Megatron-LM's): each document's positions start again at 0 after its end-of-document
token, through megatron-core's GPTDataset, for a --data-path blend and data per split (--mock-data passes the
same flag to the same config: its index takes tens of seconds to build here, so it is not rebuilt); the job's
batches carry them to the model. The reference is written here: a counter over the sample's input tokens that
restarts after every EOD id. Without the flag the positions are 0..s-1."""
from tests.test_per_split_data import two_prefixes  # noqa: F401 (a fixture, used by name)
from tests.test_pretrain import TINY

SEQ = 64


def _reference_positions(tokens, eod: int) -> list[int]:
    out, p = [], 0
    for t in tokens:
        out.append(p)
        p = 0 if t == eod else p + 1
    return out


def _check(ds, eod: int, reset: bool) -> int:
    restarts = 0
    for i in range(len(ds)):
        s = ds[i]
        tokens, positions = s["tokens"].tolist(), s["position_ids"].tolist()
        want = _reference_positions(tokens, eod) if reset else list(range(SEQ))
        assert positions == want, (i, tokens, positions, want)
        restarts += sum(1 for t in tokens[:-1] if t == eod)
    return restarts


def test_positions_restart_after_each_document(two_prefixes, tmp_path):  # noqa: F811
    from zo_megatron.data import build_gpt_datasets, build_tokenizer

    a, b = two_prefixes
    tok = build_tokenizer()
    kw = dict(seq_length=SEQ, seed=3, tokenizer=tok, test_samples=0)
    for reset in (True, False):
        blend, valid, _ = build_gpt_datasets([a, b], "60,40,0", train_samples=40, valid_samples=8,
                                             cache_dir=str(tmp_path / f"blend{reset}"), reset_position_ids=reset, **kw)
        per_split, _, _ = build_gpt_datasets({"train": [b], "valid": None, "test": None}, None, train_samples=40,
                                             valid_samples=0, cache_dir=str(tmp_path / f"split{reset}"),
                                             reset_position_ids=reset, **kw)
        restarts = sum(_check(ds, tok.eod, reset) for ds in (blend, valid, per_split))
        assert restarts > 0                    # documents end inside samples: the rule is exercised


def test_the_job_builds_its_datasets_with_the_flag(two_prefixes, tmp_path, monkeypatch):  # noqa: F811
    """The job's flag reaches the datasets it trains and evaluates on (components.build_datasets, as the
    trainer calls it), whose samples then carry the reset positions (model.loss reads them: learned positions)."""
    from zo_megatron.data import build_tokenizer
    from zo_megatron.training import components
    from zo_megatron.training.arguments import check_batch_sizes, parse_args
    from zo_megatron.training.data_flags import data_source

    a, _ = two_prefixes
    monkeypatch.setenv("ZO_MEGATRON_CACHE", str(tmp_path / "cache"))
    for reset in (True, False):
        args = parse_args([*TINY, "--data-path", a, "--split", "70,30,0", "--train-iters", "4", "--seq-length",
                           str(SEQ)] + (["--reset-position-ids"] if reset else []))
        check_batch_sizes(args, 1)
        tok = build_tokenizer()
        args.model_vocab_size = tok.vocab_size
        train, valid = components.build_datasets(args, tok, data_source(args), 1)
        assert train.config.reset_position_ids is reset and valid.config.reset_position_ids is reset
        assert _check(train, tok.eod, reset) + _check(valid, tok.eod, reset) > 0
