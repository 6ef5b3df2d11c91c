"""Megatron-LM's own Llama-3 launch script reaches its first step in one launch (issue 35, "done when"),
and what its default (MOCK) branch needs: --mock-data as megatron-core's MockGPTDataset, the
NullTokenizer, --profile as a torch.profiler trace per profiled rank."""
import json
import os

import pytest

from tests.seeds import fresh_seed
from tests.test_pretrain import _job, _rows
from zo_megatron.errors import ConfigError
from zo_megatron.training.arguments import parse_args

# A copy of the command line examples/llama/train_llama3_8b_h100_fp8.sh (NVIDIA/Megatron-LM, commit
# 157006d6) builds with its defaults (TOKENIZER_ARG = DATA_ARG = MOCK), flag for flag and in its order,
# with two edits only: the sizes shrunk (layers 32 -> 2, hidden 4096 -> 64, ffn 14336 -> 224, heads 32 -> 4,
# groups 8 -> 2, kv-channels 128 -> 16, sequence 8192 -> 64, global batch 128 -> 4, vocabulary 128256 ->
# 1000, samples 1953125000/1949218748/3906252 -> 24/20/4, eval-iters 32 -> 1) and its DTYPE_ARGS
# (--fp8-format hybrid --fp8-amax-history-len 1024 --fp8-amax-compute-algo max --fp8-param-gather) removed.
# Paths (SAVE, CACHE, TB) are filled in by the test.
LLAMA3_8B_SCRIPT = """
--use-mcore-models --num-layers 2 --hidden-size 64 --ffn-hidden-size 224 --num-attention-heads 4
--group-query-attention --num-query-groups 2 --kv-channels 16 --seq-length 64 --max-position-embeddings 64
--position-embedding-type rope --rotary-base 1000000 --rotary-percent 1.0 --attention-dropout 0.0
--hidden-dropout 0.0 --swiglu --init-method-std 0.0134 --attention-backend fused --apply-layernorm-1p
--untie-embeddings-and-output-weights --disable-bias-linear
--micro-batch-size 1 --global-batch-size 4 --train-samples 24 --lr-decay-samples 20 --lr-warmup-samples 4
--lr 0.00015 --min-lr 0.00001 --decoupled-lr 5.0e-4 --decoupled-min-lr 4.5e-5 --lr-decay-style cosine
--clip-grad 1.0 --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --bf16 --grad-reduce-in-bf16
--cross-entropy-loss-fusion --calculate-per-token-loss --manual-gc --empty-unused-memory-level 1
--exit-duration-in-mins 235
--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather
--tensor-model-parallel-size 1 --context-parallel-size 1 --sequence-parallel
--mock-data --tokenizer-type NullTokenizer --vocab-size 1000 --data-cache-path CACHE --tiktoken-pattern v2
--split '99,1,0' --no-create-attention-mask-in-dataloader --no-mmap-bin-files --num-workers 1
--log-interval 1 --eval-iters 1 --eval-interval 100 --save-interval 1000 --log-throughput --profile
--profile-step-start 4 --profile-step-end 6 --ckpt-format torch_dist --distributed-timeout-minutes 60
--save SAVE --load SAVE --tensorboard-dir TB
"""


def _script_argv(tmp_path) -> list[str]:
    fill = {"SAVE": str(tmp_path / "ck"), "CACHE": str(tmp_path / "cache_idx"), "TB": str(tmp_path / "tb")}
    return [fill.get(tok, tok) for tok in LLAMA3_8B_SCRIPT.split()]


def test_megatron_lm_llama3_script_reaches_its_steps_in_one_launch(tmp_path):
    """The first launch of the script (its --load names the empty --save directory) trains all 6
    iterations on 2 ranks, on megatron-core's mock data, and rank 0 writes the --profile trace of
    iterations 5-6 into --tensorboard-dir (where Megatron-LM's trace handler writes)."""
    log = tmp_path / "log.jsonl"
    r = _job([*_script_argv(tmp_path), "--log-jsonl", str(log), "--no-progress-bar"], tmp_path, nproc=2)
    assert r.returncode == 0, r.stderr[-4000:]
    rows = _rows(log, "train")
    assert [row["iteration"] for row in rows] == [1, 2, 3, 4, 5, 6], rows
    assert "MockGPTDataset" in r.stdout and "norm-1p" in r.stdout, r.stdout[:3000]
    trace = tmp_path / "tb" / "rank0.iter5-6.pt.trace.json"
    traces = sorted(n for n in os.listdir(tmp_path / "tb") if n.endswith(".pt.trace.json"))
    assert traces == [trace.name]                                       # --profile-ranks: rank 0 only
    with open(trace) as f:
        events = json.load(f)["traceEvents"]
    assert any("aten::" in str(e.get("name", "")) for e in events), events[:5]


def test_mock_data_is_megatron_core_s_mock_documents():
    """Every sample of --mock-data is a window of megatron-core's mock documents: ids 1, 2, 3, ...
    (modulo the vocabulary) ending in the end-of-document id; labels are the tokens shifted by one.
    Checked on randomly drawn samples of both splits, every position of each."""
    import torch

    from zo_megatron.data import build_mock_gpt_datasets, build_tokenizer

    seed = fresh_seed()
    tok = build_tokenizer(tokenizer_type="NullTokenizer", vocab_size=97)          # wraps around often
    train, valid, test = build_mock_gpt_datasets("99,1,0", 32, seed, tok, train_samples=16, valid_samples=4)
    assert test is None and len(train) >= 16 and len(valid) >= 4
    g = torch.Generator().manual_seed(seed)
    for ds in (train, valid):
        for i in torch.randint(0, len(ds), (8,), generator=g).tolist():
            item = ds[i]
            seq = torch.cat([item["tokens"], item["labels"][-1:]])
            assert torch.equal(item["labels"], seq[1:]) and bool((item["loss_mask"] == 1).all())
            for a, b in zip(seq[:-1].tolist(), seq[1:].tolist()):
                # within a document: the next count modulo the tokenizer's vocabulary (98: megatron-core's
                # mock counts through the EOD id too); its end: EOD; after EOD: 1
                assert b == (a + 1) % tok.vocab_size or b == tok.eod or (a == tok.eod and b == 1), (seed, i, a, b)


def test_null_tokenizer_is_megatron_s():
    from zo_megatron.data import build_tokenizer
    from zo_megatron.data.errors import DataError

    tok = build_tokenizer(tokenizer_type="NullTokenizer", vocab_size=1000)
    assert (tok.vocab_size, tok.eod) == (1001, 1000)               # Megatron-LM: N ids + the EOD id N
    assert tok.encode("5 0 999") == [5, 0, 999] and tok.decode([7, 1000]) == "7 1000"
    with pytest.raises(DataError, match="needs --vocab-size N"):
        build_tokenizer(tokenizer_type="NullTokenizer")
    shape = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--lr", "1e-3", "--seq-length", "64",
             "--train-iters", "4"]
    with pytest.raises(ConfigError, match="cannot tokenize the embedded corpus: add --mock-data"):
        parse_args([*shape, "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000"])
    with pytest.raises(ConfigError, match="--data-path and --mock-data contradict"):
        parse_args([*shape, "--mock-data", "--data-path", "x"])
    from zo_megatron.training.prelaunch import model_vocab_size

    a = parse_args([*shape, "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000", "--mock-data"])
    assert model_vocab_size(a, tok) == 1001                        # padded from N + 1, as Megatron-LM


def test_profile_flags_are_checked_at_launch():
    from zo_megatron.training.profiling import check_profile_args

    base = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--lr", "1e-3", "--seq-length", "64",
            "--train-iters", "8", "--profile"]
    check_profile_args(parse_args([*base, "--profile-step-start", "6", "--profile-step-end", "8"]), 2)
    for extra, world, msg in (([], 2, "--profile-step-end 12 is past --train-iters 8"),     # Megatron's 10-12
                              (["--profile-step-start", "4", "--profile-step-end", "4"], 2, "0 <= start < end"),
                              (["--profile-step-start", "2", "--profile-step-end", "9"], 2, "past --train-iters 8"),
                              (["--profile-step-start", "2", "--profile-step-end", "4", "--profile-ranks", "0", "2"],
                               2, "rank 2 is not in this job of 2 ranks")):
        with pytest.raises(ConfigError, match=msg):
            check_profile_args(parse_args([*base, *extra]), world)


def test_a_null_tokenizer_checkpoint_resumes_with_its_own_args(tmp_path):
    """--use-checkpoint-args restores NullTokenizer's --vocab-size N (the model holds N + 1 rows)."""
    from tests.test_pretrain import TINY, _single

    ck = tmp_path / "ck"
    base = ["--zero-offload", "--fp32", "--mock-data", "--save", str(ck)]
    r = _single([*base, *TINY, "--train-iters", "2", "--tokenizer-type", "NullTokenizer", "--vocab-size", "300"],
                tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    again = _single([*base, "--load", str(ck), "--use-checkpoint-args", "--use-checkpoint-opt_param-scheduler",
                     "--train-iters", "3",
                     "--no-progress-bar"], tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "vocab 301 (padded 384)" in again.stdout and "iter      3/3" in again.stdout, again.stdout[-3000:]
