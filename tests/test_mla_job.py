"""The training job trains a DeepSeek-V3-shaped model (multi-latent attention with a query latent and YaRN,
a first dense layer, then mixture-of-experts layers with a sigmoid router, group-limited routing, a top-k
scaling factor and a shared expert), as Megatron-LM's DeepSeek launch lines give it, through ZeRO-Offload:

- at TP 2 with sequence parallelism and experts at EP 2 (expert TP 1), every iteration's logged loss
  equals a single-process torch reference (our model at TP 1, torch AdamW, the same batches:
  tests/test_moe_job.py's reference world);
- saved at iteration 2 and resumed there, iterations 3-4 log the uninterrupted run's losses and grad
  norms bit for bit; resumed at another layout (TP 1, DP 2: the checkpoint resharded online) they
  continue within fp32 reduction order.
"""
import pytest

from tests.harness import run_world
from tests.seeds import fresh_seed
from tests.test_moe_job import ITERS, _close, _reference_world, _run

DEEPSEEK = ["--num-layers", "3", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
            "--max-position-embeddings", "64", "--position-embedding-type", "rope", "--no-rope-fusion",
            "--normalization", "RMSNorm", "--norm-epsilon", "1e-6", "--swiglu", "--disable-bias-linear",
            "--untie-embeddings-and-output-weights", "--ffn-hidden-size", "48",
            "--multi-latent-attention", "--q-lora-rank", "24", "--kv-lora-rank", "16", "--qk-head-dim", "8",
            "--qk-pos-emb-head-dim", "8", "--v-head-dim", "12", "--qk-layernorm",
            "--rotary-scaling-factor", "4", "--mscale", "1.0", "--mscale-all-dim", "1.0",
            "--num-experts", "4", "--moe-layer-freq", "[0]*1+[1]*2", "--moe-ffn-hidden-size", "16",
            "--moe-router-score-function", "sigmoid", "--moe-router-topk", "2", "--moe-router-num-groups", "2",
            "--moe-router-group-topk", "1", "--moe-router-pre-softmax", "--moe-router-topk-scaling-factor", "2.5",
            "--moe-shared-expert-intermediate-size", "16", "--moe-aux-loss-coeff", "0.5",
            "--moe-router-load-balancing-type", "seq_aux_loss", "--moe-router-dtype", "fp32",
            "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "1e-2", "--lr-warmup-iters", "0",
            "--min-lr", "1e-3", "--lr-decay-style", "cosine", "--log-interval", "1", "--eval-interval", "100",
            "--eval-iters", "1", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128",
            "--no-progress-bar", "--zero-offload", "--fp32", "--hidden-dropout", "0", "--attention-dropout", "0",
            "--weight-decay", "0", "--clip-grad", "0.5"]
TP2_EP2 = ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--expert-model-parallel-size", "2",
           "--expert-tensor-parallel-size", "1", "--moe-token-dispatcher-type", "alltoall"]


def _argv(seed, iters=ITERS):
    return [*DEEPSEEK, "--seed", str(seed), "--train-iters", str(iters)]


def test_a_deepseek_shaped_job_trains_as_torch_adamw(tmp_path):
    seed = fresh_seed("MLA + MoE job TP2 SP EP2")
    rows, r = _run(tmp_path, "tp2ep2", _argv(seed) + TP2_EP2)
    ref, _ = run_world(_reference_world, 1, _argv(seed), str(tmp_path / "cache"), timeout=180)[0]
    got = [rows[i]["loss"] for i in range(1, ITERS + 1)]
    assert all(_close(g, w) for g, w in zip(got, ref)), (got, ref)
    assert got[-1] < got[0], got                   # it learns (lr 1e-2 on counting ids)
    assert "torch SDPA" in r.stdout, r.stdout[:2000]


@pytest.mark.parametrize("resume_layout", ["same", "tp1-dp2"])
def test_a_deepseek_shaped_job_resumes(tmp_path, resume_layout):
    seed = fresh_seed(f"MLA + MoE resume {resume_layout}")
    ck = tmp_path / "ck"
    argv = _argv(seed)
    whole, _ = _run(tmp_path, "whole", [*argv, *TP2_EP2, "--save", str(ck), "--save-interval", "2"])
    layout = TP2_EP2 if resume_layout == "same" else ["--moe-token-dispatcher-type", "alltoall"]
    resumed, r = _run(tmp_path, "resumed", [*argv, *layout, "--load", str(ck), "--ckpt-step", "2"])
    assert sorted(resumed) == [3, 4], r.stdout[-2000:]
    if resume_layout == "same":
        keys = ("loss", "grad_norm", "seq_load_balancing_loss")
        assert {i: [whole[i][k] for k in keys] for i in resumed} == {i: [resumed[i][k] for k in keys] for i in resumed}
    else:
        for i in resumed:
            assert _close(resumed[i]["loss"], whole[i]["loss"]), (i, resumed[i]["loss"], whole[i]["loss"])
