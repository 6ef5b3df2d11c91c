"""Megatron-LM's own Mixtral-8x7B launch line (examples/mixtral/train_mixtral_8x7b_distributed.sh,
NVIDIA/Megatron-LM commit 9b8acfd0) runs with --zero-offload in one launch, unchanged but for sizes
(issue 39, "done when"): its --moe-grouped-gemm, --overlap-* and --use-distributed-optimizer are
accepted as no-ops, its Llama2Tokenizer reads a SentencePiece model (trained here on the embedded
corpus, the data preprocessed with it by tools/preprocess_data.py), its --save X --load X starts fresh
on the first launch and resumes on the second."""
import json

import pytest

from tests.test_llama2_tokenizer import sp_model  # noqa: F401 - the module fixture
from tests.test_pretrain import _job, _rows

pytest.importorskip("sentencepiece")

# The script's MODEL_ARGS, MOE_ARGS, DATA_ARGS, TRAINING_ARGS, MODEL_PARALLEL_ARGS and LOGGING_ARGS in its
# order, flag for flag, with sizes shrunk only: layers 32 -> 2, hidden 4096 -> 64, ffn 14336 -> 96, heads
# 32 -> 4, groups 8 -> 2, sequence 4096 -> 64, positions 32768 -> 64, experts 8 -> 4, global batch 256 -> 4,
# iterations 500000 / 320000 / 500 -> 4 / 4 / 1, save / eval intervals 10000 / 1000 -> 2, eval iterations
# 10 -> 1, pipeline stages 4 -> 1, EP 8 -> 2 (the two ranks here). TOK, DATA, CK are filled in by the test.
MIXTRAL_SCRIPT = """
--use-mcore-models --disable-bias-linear --seq-length 64 --max-position-embeddings 64 --num-layers 2
--hidden-size 64 --ffn-hidden-size 96 --num-attention-heads 4 --init-method-std 0.01 --attention-dropout 0.0
--hidden-dropout 0.0 --normalization RMSNorm --position-embedding-type rope --swiglu
--untie-embeddings-and-output-weights --group-query-attention --num-query-groups 2 --no-masked-softmax-fusion
--no-position-embedding --rotary-base 1000000
--num-experts 4 --moe-router-topk 2 --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-2
--moe-grouped-gemm --moe-token-dispatcher-type alltoall --overlap-param-gather --overlap-grad-reduce
--tokenizer-type Llama2Tokenizer --tokenizer-model TOK --data-path DATA --split 99990,8,2
--micro-batch-size 1 --global-batch-size 4 --lr 1e-4 --train-iters 4 --lr-decay-iters 4 --lr-decay-style cosine
--min-lr 1.0e-5 --weight-decay 0.1 --lr-warmup-iters 1 --clip-grad 1.0 --bf16
--tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 --expert-model-parallel-size 2
--use-distributed-optimizer --sequence-parallel
--log-interval 1 --save-interval 2 --eval-interval 2 --eval-iters 1 --save CK --load CK
--tensorboard-dir CK/tensorboard --no-load-optim --no-load-rng
"""


def test_megatron_lm_mixtral_script_trains_and_resumes_with_zero_offload(sp_model, tmp_path):  # noqa: F811
    from zo_megatron.data.preprocess import preprocess

    from zo_megatron.data.corpus import iter_corpus_documents

    path, _ = sp_model
    docs = [text for _, text in iter_corpus_documents()]
    # the corpus's sentences as documents: enough (20,000) that the script's --split 99990,8,2 leaves its
    # valid split two documents, as a real corpus leaves it thousands
    sentences = [s + "." for d in docs for s in d.split(". ") if s.strip()][:20000]
    assert len(sentences) == 20000
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in sentences))
    preprocess([str(src)], str(tmp_path / "data"), tokenizer_type="Llama2Tokenizer", tokenizer_model=path,
               progress=False)
    ck = tmp_path / "ck"
    fill = {"TOK": path, "DATA": str(tmp_path / "data_text_document"), "CK": str(ck),
            "CK/tensorboard": str(ck / "tensorboard")}
    argv = [fill.get(tok, tok) for tok in MIXTRAL_SCRIPT.split()] + ["--zero-offload", "--no-progress-bar"]
    log = tmp_path / "log.jsonl"
    r = _job([*argv, "--log-jsonl", str(log)], tmp_path, nproc=2)
    assert r.returncode == 0, r.stderr[-4000:]
    assert [row["iteration"] for row in _rows(log, "train")] == [1, 2, 3, 4]
    assert "--moe-grouped-gemm" in r.stdout and "Llama2Tokenizer" in r.stdout, r.stdout[:4000]
    assert (ck / "latest_checkpointed_iteration.txt").read_text().strip() == "4"
    more = [*argv, "--train-iters", "6", "--lr-decay-iters", "6", "--log-jsonl", str(tmp_path / "log2.jsonl")]
    r = _job(more, tmp_path, nproc=2)
    assert r.returncode == 0, r.stderr[-4000:]
    assert [row["iteration"] for row in _rows(tmp_path / "log2.jsonl", "train")] == [5, 6]

    # the checkpoint keeps the SentencePiece model; --use-checkpoint-args takes that copy; to-hf asks for an
    # HF tokenizer of the same model in one line
    saved = ck / "iter_0000006"
    manifest = json.loads((saved / "checkpoint.json").read_text())
    assert manifest["tokenizer_type"] == "Llama2Tokenizer"
    assert (saved / manifest["tokenizer_files"][0]).read_bytes() == open(path, "rb").read()
    from zo_megatron.training.arguments import parse_args

    i = argv.index("--tokenizer-type")
    assert argv[i + 2] == "--tokenizer-model"
    args = parse_args([*argv[:i], *argv[i + 4:], "--use-checkpoint-args"])      # the tokenizer flags dropped
    assert (args.tokenizer_type, args.tokenizer_model) == ("Llama2Tokenizer", str(saved / manifest["tokenizer_files"][0]))
    from tests.test_convert_llama import _cli

    rc = _cli().main(["to-hf", "--load", str(ck), "--output", str(tmp_path / "hf")])
    assert rc == 2 and not (tmp_path / "hf").exists()
