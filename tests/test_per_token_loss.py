"""Megatron-LM's --eod-mask-loss and --calculate-per-token-loss (refused, and accepted as a no-op,
before), on 2 forked gloo ranks (ZeRO-Offload, fp32, 2 micro-batches per rank) over a corpus of short
documents, so that every sample holds end-of-document tokens.

The reference is single-process torch over the very samples Megatron-LM's sampler gives each
iteration, its loss mask computed here from the tokens (0 where the input token is the EOD id). Its
objective:
- --eod-mask-loss alone: the mean of the 4 micro-batches' masked means;
- with --calculate-per-token-loss: the masked tokens' mean over the whole global batch (all ranks);
then clip_grad_norm_ and AdamW at Megatron-LM's rate. The logged training and validation losses are
the masked tokens' mean in both modes (Megatron-LM's loss_func reports [loss sum, tokens] and its
train_step / evaluate divide the sums); every one equals the reference's, and the two runs part, so
the weighting shows. A mixture of experts in per-token mode: megatron-core's router multiplies its aux
losses by its tokens and Megatron-LM divides every gradient by the batch's tokens -- the reference
applies that rule itself (its model built without the flag).
"""
from __future__ import annotations

import json
import random

import pytest
import torch

from tests.harness import run_world
from tests.megatron_reference import megatron_get_lr
from tests.seeds import fresh_seed
from tests.test_pretrain import _job, _rows

ITERS, RTOL = 4, 5e-6     # fp32 job vs fp32 torch: <= 7e-7 apart seen (reduction order)
ARGV = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "3e-2", "--min-lr", "3e-3",
        "--lr-warmup-iters", "1", "--lr-decay-style", "cosine", "--train-iters", str(ITERS), "--log-interval", "1",
        "--eval-interval", str(ITERS), "--eval-iters", "1", "--split", "90,10,0", "--zero-offload", "--fp32",
        "--hidden-dropout", "0", "--attention-dropout", "0", "--weight-decay", "0", "--clip-grad", "0.5",
        "--no-progress-bar", "--eod-mask-loss"]


@pytest.fixture(scope="module")
def short_docs(tmp_path_factory):
    """300 documents, alternately of 1-2 and of 8-16 words (GPT-2 BPE): samples with many EOD tokens
    next to samples with few, so the two weightings part."""
    from zo_megatron.data.preprocess import preprocess

    d = tmp_path_factory.mktemp("short_docs")
    rng = random.Random(7)
    words = "the a of state union nation people year work law freedom peace we our new".split()
    with open(d / "docs.jsonl", "w") as f:
        for i in range(300):
            n = rng.randint(1, 2) if i % 2 else rng.randint(8, 16)
            f.write(json.dumps({"text": " ".join(rng.choice(words) for _ in range(n))}) + "\n")
    preprocess([str(d / "docs.jsonl")], str(d / "docs"), progress=False)
    return str(d / "docs_text_document")


def _reference_world(rank, argv, cache, per_token):
    from tests.job_reference import job_model_and_data
    from zo_megatron.data.datasets import _collate

    args, tok, model, train_ds, valid_ds = job_model_and_data(argv, cache, 2)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_eps, weight_decay=0.0)

    def micro_batches(ds, start):
        """(masked loss sum, unmasked tokens) of the 4 micro-batches (2 per rank, Megatron-LM's order) of
        the global batch starting at sample `start`, the mask computed here."""
        out = []
        for m in range(2):
            for r in range(2):
                first = start + 4 * m + 2 * r
                batch = _collate([ds[i] for i in (first, first + 1)])
                mask = (batch["tokens"] != tok.eod).float()
                assert torch.equal(batch["loss_mask"], mask)          # megatron-core's --eod-mask-loss rule
                out.append(((_token_losses(model, batch) * mask).sum(), mask.sum()))
        return out

    def token_mean(parts):
        return sum(s for s, _ in parts) / sum(t for _, t in parts)

    def objective(parts):           # Megatron-LM's: per token, or the mean of the micro-batches' means
        return token_mean(parts) if per_token else sum(s / t for s, t in parts) / len(parts)

    losses = []
    for it in range(ITERS):
        parts = micro_batches(train_ds, 8 * it)
        objective(parts).backward()
        torch.nn.utils.clip_grad_norm_(params, args.clip_grad)
        for g in opt.param_groups:
            g["lr"] = megatron_get_lr(8 * it, init_lr=0.0, max_lr=args.lr, min_lr=args.min_lr, lr_warmup_steps=8,
                                      lr_decay_steps=8 * ITERS, lr_decay_style="cosine")
        opt.step()
        opt.zero_grad()
        losses.append(token_mean(parts).item())        # the logged loss: the tokens' mean in both modes
    with torch.no_grad():
        val = token_mean(micro_batches(valid_ds, 0)).item()
    return losses, val


def _token_losses(model, batch):
    """Per-token cross-entropy of the model (one TP rank: the vocab-parallel one is the plain one)."""
    from megatron.core import tensor_parallel

    logits = model.forward(batch["tokens"], batch["position_ids"])
    return tensor_parallel.vocab_parallel_cross_entropy(logits.float(), batch["labels"])


def test_eod_mask_and_per_token_loss_are_megatron_s(tmp_path, short_docs):
    seed = fresh_seed("eod mask, per-token loss")
    out = {}
    for name, extra in (("mean_of_means", []), ("per_token", ["--calculate-per-token-loss"])):
        argv = [*ARGV, "--seed", str(seed), "--data-path", short_docs, *extra]
        log = tmp_path / f"{name}.jsonl"
        r = _job([*argv, "--log-jsonl", str(log)], tmp_path)
        assert r.returncode == 0, r.stderr[-3000:]
        rows = {row["iteration"]: row["loss"] for row in _rows(log, "train")}
        val = [row["val_loss"] for row in _rows(log, "eval")]
        ref, ref_val = run_world(_reference_world, 1, argv, str(tmp_path / "cache"), name == "per_token",
                                 timeout=120)[0]
        got = [rows[i] for i in range(1, ITERS + 1)]
        assert all(abs(g - w) <= RTOL * abs(w) for g, w in zip(got, ref)), (seed, name, got, ref)
        assert len(val) == 1 and abs(val[0] - ref_val) <= RTOL * abs(ref_val), (seed, name, val, ref_val)
        out[name] = got
    # the weighting shows: the two runs part by 20x the tolerance or more from the 2nd iteration on (the 1st
    # logs the same tokens' mean of the same weights), so a wrong weighting cannot pass for the right one
    assert out["per_token"][0] == pytest.approx(out["mean_of_means"][0], rel=RTOL)
    apart = max(abs(a - b) / abs(a) for a, b in zip(out["per_token"], out["mean_of_means"]))
    assert apart > 20 * RTOL, (apart, out)


def _moe_reference(rank, argv, cache):
    """The MoE job's losses in per-token mode, single process (see the module docstring)."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    from tests.job_reference import job_model_and_data
    from zo_megatron.data.datasets import _collate

    # the router without the flag: the reference multiplies its aux losses by its tokens itself
    args, _, model, train_ds, _ = job_model_and_data(argv, cache, 2, calculate_per_token_loss=False)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_eps, weight_decay=0.0)
    gb, micro, losses = args.global_batch_size, args.micro_batch_size, []
    for it in range(ITERS):
        batches = [_collate([train_ds[i] for i in range(gb * it + k * micro, gb * it + (k + 1) * micro)])
                   for k in range(gb // micro)]
        total = sum(float(b["loss_mask"].sum()) for b in batches)
        # the router's aux losses x its tokens (micro x sequence), then every gradient / the batch's tokens
        MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(micro * args.seq_length / total))
        logged = 0.0
        for b in batches:
            loss_sum = _token_losses(model, b).mul(b["loss_mask"]).sum()
            (loss_sum / total).backward()
            logged += loss_sum.item() / total
        torch.nn.utils.clip_grad_norm_(params, args.clip_grad)
        for g in opt.param_groups:
            g["lr"] = megatron_get_lr(gb * it, init_lr=0.0, max_lr=args.lr, min_lr=args.min_lr, lr_warmup_steps=0,
                                      lr_decay_steps=gb * ITERS, lr_decay_style="cosine")
        opt.step()
        opt.zero_grad()
        losses.append(logged)
    return losses


@pytest.mark.parametrize("layout", ["EP1", "EP2"])
def test_a_mixture_of_experts_in_per_token_mode_is_megatron_s(tmp_path, layout):
    """--calculate-per-token-loss on 2 ranks, the load-balancing and z losses on: at EP 1 (the dense
    engine, experts replicated over DP 2) and at EP 2 (the two engines, the alltoall dispatcher; each
    rank routes its own tokens, whose count scales its router's aux losses)."""
    from tests.test_moe_job import EP2, LAYOUTS, MOE

    seed = fresh_seed(f"MoE per-token loss {layout}")
    argv = [*MOE, "--seed", str(seed), "--train-iters", str(ITERS), "--calculate-per-token-loss", "--eod-mask-loss"]
    log = tmp_path / "moe.jsonl"
    r = _job([*argv, *(EP2 if layout == "EP2" else []), "--log-jsonl", str(log)], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert LAYOUTS[layout][1] in r.stdout, r.stdout[:3000]           # the layout the banner names
    got = [row["loss"] for row in _rows(log, "train")]
    ref = run_world(_moe_reference, 1, argv, str(tmp_path / "cache"), timeout=120)[0]
    assert len(got) == ITERS and all(abs(g - w) <= 2e-5 * abs(w) for g, w in zip(got, ref)), (seed, got, ref)
