"""Megatron-LM's own launch scripts run (issue 35, items 7-8): flags their Llama-3 script passes
that were refused or misread."""
import pytest

from tests.test_pretrain import TINY, _rows, _single, sotu_prefix  # noqa: F401 (a fixture)
from zo_megatron.errors import ConfigError
from zo_megatron.training.arguments import parse_args

SHAPE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
         "--lr", "1e-3", "--train-iters", "4"]


def test_rope_aliases_are_rope():
    a = parse_args([*SHAPE, "--use-rotary-position-embeddings", "--no-position-embedding"])
    assert a.position_embedding_type == "rope"
    with pytest.raises(ConfigError, match="--no-position-embedding without rope leaves the model no positions"):
        parse_args([*SHAPE, "--no-position-embedding"])
    with pytest.raises(ConfigError, match="disagree"):
        parse_args([*SHAPE, "--use-rotary-position-embeddings", "--position-embedding-type", "learned_absolute"])


def test_context_parallel_size_one_is_accepted_and_more_is_refused():
    assert parse_args([*SHAPE, "--context-parallel-size", "1"]).context_parallel_size == 1
    with pytest.raises(ConfigError, match="--context-parallel-size 2: context parallelism is not supported"):
        parse_args([*SHAPE, "--context-parallel-size", "2"])


def test_the_refusals_name_the_right_reason():
    from zo_megatron.training.megatron_flags import REFUSED_WHY

    # --apply-layernorm-1p was refused with "the model is GPT-2" for an RMSNorm Llama; it is built now
    # (tests/test_layernorm_1p.py), so it is no longer refused at all
    assert "--apply-layernorm-1p" not in REFUSED_WHY
    assert parse_args([*SHAPE, "--normalization", "RMSNorm", "--apply-layernorm-1p"]).apply_layernorm_1p
    assert "--use-rotary-position-embeddings" not in REFUSED_WHY and "--no-position-embedding" not in REFUSED_WHY


def test_a_bad_choice_is_one_line_not_the_usage(tmp_path):
    r = _single(["--tokenizer-type", "TikTokenizer"], tmp_path)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "invalid choice: 'TikTokenizer'" in lines[0] and "--help" in lines[0], r.stderr


def test_the_sample_based_schedule_equals_its_iteration_form(sotu_prefix, tmp_path):
    """--train-samples with --lr-warmup-samples / --lr-decay-samples (refused before) give the very
    rates of --train-iters with the matching iterations; a quoted --split "'90,10,0'" parses."""
    tiny = [a for i, a in enumerate(TINY) if a != "--lr-warmup-iters" and TINY[i - 1] != "--lr-warmup-iters"]
    base = ["--zero-offload", "--fp32", "--data-path", sotu_prefix, *tiny, "--split", "'90,10,0'"]
    rates = []
    for flags in (["--train-samples", "24", "--lr-warmup-samples", "8", "--lr-decay-samples", "20"],
                  ["--train-iters", "6", "--lr-warmup-iters", "2", "--lr-decay-iters", "5"]):
        log = tmp_path / f"{flags[0]}.jsonl"
        r = _single([*base, *flags, "--log-jsonl", str(log)], tmp_path)
        assert r.returncode == 0, r.stderr[-3000:]
        rates.append([row["lr"] for row in _rows(log, "train")])
    assert rates[0] == rates[1] and len(rates[0]) == 6, rates
    bad = _single([*base, "--train-samples", "24", "--lr-warmup-samples", "6"], tmp_path)
    assert bad.returncode == 2 and "is not a multiple of the global batch 4" in bad.stderr


def test_every_problem_of_a_command_line_is_in_one_message():
    """Issue 35, item 9: a value out of range and a refused flag came one launch at a time
    (`--lr -1 --pipeline-model-parallel-size 2` reported only the refusal); now one line has all."""
    with pytest.raises(ConfigError) as e:
        parse_args([*SHAPE[:-4], "--train-iters", "4", "--lr", "-1", "--pipeline-model-parallel-size", "2"])
    msg = str(e.value)
    assert "\n" not in msg and "--pipeline-model-parallel-size 2: pipeline parallelism" in msg
    assert "--lr -1.0 is out of range: it must be > 0" in msg and msg.endswith("(1 flag refused, 1 value out of range)")
    with pytest.raises(ConfigError) as two:
        parse_args([*SHAPE, "--lr", "-1", "--min-lr", "-2"])
    assert str(two.value) == ("--lr -1.0 is out of range: it must be > 0 | --min-lr -2.0 is out of range: it must "
                              "be >= 0 (2 values out of range)")
