"""Megatron-LM's --log-params-norm and --log-num-zeros-in-grad (refused before: 11 of Megatron-LM's
example scripts pass them), on 2 forked gloo ranks at TP 2, TP 1 x DP 2 (ZeRO-Offload, half of each
partition in the device tail) and the DDP baseline.

- num_zeros_in_grad of iteration 1 equals the exact zeros of the gradient single-process torch takes
  over the same global batch (megatron-core's model at TP 1, the samples Megatron-LM's sampler gives
  iteration 1): the word-embedding rows of ids the batch never holds are zero, each counted once
  (a TP or DP copy counted twice would double them).
- params_norm of iteration 2 equals the L2 norm, in float64, of the weights the checkpoint of
  iteration 2 holds (read back whole: each tensor once, the TP shards joined), fp32 so the device
  weights are the master's.
"""
from __future__ import annotations

import math

import pytest
import torch

from tests.harness import run_world
from tests.seeds import fresh_seed
from tests.test_pretrain import _job, _rows

# NullTokenizer over 511 ids: 512 rows, unpadded at TP 1 and 2; untied, so unseen ids' embedding rows get no
# gradient (tied, the output layer would give every row one); no linear biases: the key bias's gradient is
# zero in exact arithmetic (softmax ignores a shift shared by a query's scores), in fp32 a residue that
# comes out exactly 0 or not depending on the summation order of the layout
ARGV = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--max-position-embeddings", "16", "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "1e-2",
        "--train-iters", "2", "--log-interval", "1", "--eval-iters", "0", "--mock-data", "--tokenizer-type",
        "NullTokenizer", "--vocab-size", "511", "--untie-embeddings-and-output-weights", "--fp32",
        "--no-progress-bar", "--log-params-norm", "--log-num-zeros-in-grad", "--save-interval", "2",
        "--hidden-dropout", "0", "--attention-dropout", "0", "--disable-bias-linear"]
LAYOUTS = {"TP2": ["--zero-offload", "--tensor-model-parallel-size", "2"],
           "DP2-tail": ["--zero-offload", "--optimizer-offload-fraction", "0.5"],
           "DP2-baseline": []}


def _reference_zeros(rank, argv, cache):
    """Exact zeros of the full gradient of iteration 1 (loss = mean over its 2 x 2 samples) in one process."""
    from tests.job_reference import job_model_and_data
    from zo_megatron.data.datasets import _collate
    from zo_megatron.training.evaluation import loss_inputs

    _, _, model, train_ds, _ = job_model_and_data(argv, cache, 2)
    for first in (0, 2):                               # the two micro-batches of 2 of the global batch of 4
        batch = _collate([train_ds[i] for i in (first, first + 1)])
        (model.loss(*loss_inputs(batch, torch.device("cpu"))) / 2).backward()
    params = list(model.parameters())
    assert sum(p.numel() for p in params) > 0
    return sum(int((p.grad == 0).sum()) for p in params)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_params_norm_and_zeros_in_grad_are_megatron_s(tmp_path, layout):
    from zo_megatron.checkpoint.reader import CheckpointReader

    seed = fresh_seed(f"log norms {layout}")
    ck = tmp_path / "ck"
    log = tmp_path / "log.jsonl"
    argv = [*ARGV, "--seed", str(seed)]
    r = _job([*argv, *LAYOUTS[layout], "--save", str(ck), "--log-jsonl", str(log)], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = {row["iteration"]: row for row in _rows(log, "train")}
    zeros = run_world(_reference_zeros, 1, argv, str(tmp_path / "cache"), timeout=120)[0]
    assert zeros > 1000, zeros                     # most of the 512 embedding rows x 32: the test can see a count
    assert rows[1]["num_zeros_in_grad"] == zeros, (rows[1]["num_zeros_in_grad"], zeros)
    weights = CheckpointReader(str(ck)).read_weights()
    want = math.sqrt(sum(float(w.double().square().sum()) for w in weights.values()))
    assert rows[2]["params_norm"] == pytest.approx(want, rel=1e-6), (rows[2]["params_norm"], want)
    assert f"num zeros {zeros:.1f} | params norm " in r.stdout, r.stdout[-2000:]
