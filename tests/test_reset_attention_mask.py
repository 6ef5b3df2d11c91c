"""--reset-attention-mask (Megatron-LM's): each document of a packed sample attends only to itself.

The data: every sample carries segment_ids (the document of each input token; a document ends WITH its
end-of-document token), checked against a counter written here, for a --data-path blend and data per split.
The job: a run on 2 forked gloo ranks over a corpus of short documents (many per sample) equals a
single-process torch reference that never sees a mask: it runs every document of every sample through the
model ON ITS OWN (its tokens and its positions, as the job's samples give them) and joins the per-token
losses; then clip_grad_norm_ and AdamW at Megatron-LM's rate. At TP 2 + sequence parallelism on torch SDPA,
and at DP 2 on megatron-core's local attention. Without the flag the same run differs (a document sees the
ones before it), so the reference can tell them apart.
"""
from __future__ import annotations

import pytest
import torch

from tests.harness import run_world
from tests.seeds import fresh_seed
from tests.test_per_split_data import two_prefixes  # noqa: F401 (a fixture, used by name)
from tests.test_per_token_loss import short_docs  # noqa: F401 (a fixture, used by name)
from tests.test_pretrain import TINY, _job, _rows

SEQ = 64
ITERS, RTOL = 3, 5e-6     # fp32 job vs fp32 torch (reduction order only)
ARGV = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "3e-2", "--min-lr", "3e-3",
        "--lr-warmup-iters", "1", "--lr-decay-style", "cosine", "--train-iters", str(ITERS), "--log-interval", "1",
        "--eval-interval", str(ITERS), "--eval-iters", "1", "--split", "90,10,0", "--zero-offload", "--fp32",
        "--hidden-dropout", "0", "--attention-dropout", "0", "--weight-decay", "0", "--clip-grad", "0.5",
        "--no-progress-bar"]
LAYOUTS = {"tp2_sp_sdpa": ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--use-flash-attn"],
           "dp2_local": []}


def _reference_segments(tokens, eod: int) -> list[int]:
    out, seg = [], 0
    for t in tokens:
        out.append(seg)
        if t == eod:
            seg += 1
    return out


def _check(ds, eod: int) -> int:
    """Every sample's segment ids are the counter's; how many samples hold more than one document."""
    several = 0
    for i in range(len(ds)):
        s = ds[i]
        tokens = s["tokens"].tolist()
        assert s["segment_ids"].tolist() == _reference_segments(tokens, eod), (i, tokens)
        assert s["segment_ids"].dtype == torch.int64
        several += s["segment_ids"][-1].item() > 0
    return several


def test_every_sample_carries_its_documents(two_prefixes, tmp_path):  # noqa: F811
    from zo_megatron.data import build_gpt_datasets, build_tokenizer

    a, b = two_prefixes
    tok = build_tokenizer()
    kw = dict(seq_length=SEQ, seed=3, tokenizer=tok, test_samples=0)
    blend, valid, _ = build_gpt_datasets([a, b], "60,40,0", train_samples=40, valid_samples=8,
                                         cache_dir=str(tmp_path / "blend"), reset_attention_mask=True, **kw)
    per_split, _, _ = build_gpt_datasets({"train": [b], "valid": None, "test": None}, None, train_samples=40,
                                         valid_samples=0, cache_dir=str(tmp_path / "split"),
                                         reset_attention_mask=True, **kw)
    assert sum(_check(ds, tok.eod) for ds in (blend, valid, per_split)) > 0    # the rule is exercised
    assert blend.config.reset_attention_mask is True
    plain, _, _ = build_gpt_datasets([a, b], "60,40,0", train_samples=40, valid_samples=8,
                                     cache_dir=str(tmp_path / "blend"), **kw)
    assert "segment_ids" not in plain[0]
    # the wrapped dataset's samples are the plain one's, plus the ids
    for i in range(len(plain)):
        assert all(torch.equal(plain[i][k], blend[i][k]) for k in ("tokens", "labels", "loss_mask", "position_ids"))


def test_the_batches_hand_the_ids_to_the_model():
    """evaluation.loss_inputs: the fifth argument of model.loss where the batch carries them, none otherwise."""
    from zo_megatron.training.evaluation import loss_inputs

    seed = fresh_seed("loss inputs")
    g = torch.Generator().manual_seed(seed)
    batch = {k: torch.randint(0, 9, (2, 8), generator=g) for k in ("tokens", "labels", "loss_mask", "position_ids")}
    assert len(loss_inputs(batch, torch.device("cpu"))) == 4
    batch["segment_ids"] = torch.randint(0, 3, (2, 8), generator=g).sort(dim=1).values
    got = loss_inputs(batch, torch.device("cpu"))
    assert len(got) == 5 and torch.equal(got[4], batch["segment_ids"]) and torch.equal(got[0], batch["tokens"])


def _reference_world(rank, argv, cache, dp):
    """Every document of every sample through the model on its own (tests/job_reference.py)."""
    from tests.job_reference import job_model_and_data, separate_pieces_training

    args, tok, model, train_ds, valid_ds = job_model_and_data(argv, cache, dp)

    def starts_of(tokens, positions):
        # a document ends with its EOD token: the next one starts after it
        ends = [i + 1 for i, t in enumerate(tokens.tolist()) if t == tok.eod]
        return sorted({0, *ends} - {len(tokens)})

    return separate_pieces_training(args, model, train_ds, valid_ds, starts_of, ITERS)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_each_document_trains_on_its_own(layout, tmp_path, short_docs):  # noqa: F811
    seed = fresh_seed(f"reset attention mask {layout}")
    argv = [*ARGV, "--seed", str(seed), "--data-path", short_docs, *LAYOUTS[layout]]
    dp = 1 if "--tensor-model-parallel-size" in argv else 2
    got = {}
    for flag in (["--reset-attention-mask"], []):
        log = tmp_path / f"run{len(flag)}.jsonl"
        r = _job([*argv, *flag, "--log-jsonl", str(log)], tmp_path)
        assert r.returncode == 0, r.stderr[-3000:]
        if flag:
            assert "attention per document (--reset-attention-mask)" in r.stdout
        got[bool(flag)] = ([row["loss"] for row in _rows(log, "train")], [row["val_loss"] for row in _rows(log, "eval")])
    ref, ref_val, documents = run_world(_reference_world, 1, [*argv, "--reset-attention-mask"],
                                        str(tmp_path / "cache"), dp, timeout=180)[0]
    assert documents > 3 * ITERS * 8, documents          # samples hold several documents each
    train, val = got[True]
    assert len(train) == ITERS and all(abs(g - w) <= RTOL * abs(w) for g, w in zip(train, ref)), (seed, train, ref)
    assert len(val) == 1 and abs(val[0] - ref_val) <= RTOL * abs(ref_val), (seed, val, ref_val)
    # without the flag a document sees the ones before it: the reference tells the runs apart
    apart = max(abs(g - w) / abs(w) for g, w in zip(got[False][0], ref))
    assert apart > 10 * RTOL, (seed, got[False][0], ref)             # the accepted run: within RTOL


def test_the_job_builds_its_datasets_with_the_flag(two_prefixes, tmp_path, monkeypatch):  # noqa: F811
    from zo_megatron.data import build_tokenizer
    from zo_megatron.training import components
    from zo_megatron.training.arguments import check_batch_sizes, parse_args
    from zo_megatron.training.data_flags import data_source

    a, _ = two_prefixes
    monkeypatch.setenv("ZO_MEGATRON_CACHE", str(tmp_path / "cache"))
    args = parse_args([*TINY, "--data-path", a, "--split", "70,30,0", "--train-iters", "4", "--seq-length",
                       str(SEQ), "--reset-attention-mask"])
    check_batch_sizes(args, 1)
    tok = build_tokenizer()
    args.model_vocab_size = tok.vocab_size
    train, valid = components.build_datasets(args, tok, data_source(args), 1)
    assert _check(train, tok.eod) + _check(valid, tok.eod) > 0
