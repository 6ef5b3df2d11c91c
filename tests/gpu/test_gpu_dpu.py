"""Delayed parameter update on one CUDA GPU against the same delayed AdamW reference as
tests/test_dpu.py: the worker's CPU Adam runs while CUDA kernels of the next step are queued and
running, the parameters return through the side stream and pinned buffers, and the race check
(the flat device buffer must not change between the first forward and the end of backward of an
overlapped step) is on. DP=2 runs through gloo for CUDA tensors (NCCL refuses two ranks on one GPU;
see test_gpu_engine.py for what that proves and what it does not)."""
import pytest
import torch

from tests.fp32_bounds import assert_fp32_weights_match, fp32_spread
from tests.gpu.conftest import dp2_backend
from tests.harness import run_world
from tests.seeds import fresh_seed
from tests.test_dpu import STEPS, WARMUP, _dpu_world, _reference

pytest.importorskip("transformers")


def _check(out, seed, dp, accum, tol, bias_tol, **ref_kw):
    """tol None: an fp32 run, held to tests/fp32_bounds.py's bounds."""
    ref_losses, ref_final = _reference(out["init"], seed, dp, accum, WARMUP, **ref_kw)
    for ours, ref in zip(out["losses"], ref_losses):
        assert abs(ours - ref) / abs(ref) <= (tol or 1e-5), (ours, ref)
    if tol is None:
        torch32 = fp32_spread(lambda init: _reference(init, seed, dp, accum, WARMUP, dtype=torch.float32, **ref_kw)[1],
                              out["init"])
        assert_fp32_weights_match(out["final"], ref_final, torch32)
        return
    for name, ref in ref_final.items():
        err = ((out["final"][name] - ref).norm() / ref.norm()).item()
        assert err <= (bias_tol if name.endswith(".bias") else tol), (name, err)


PREDICT = {"dpu_weight_prediction": True}


@pytest.mark.parametrize("precision,engine_kw,tol,bias_tol", [
    ("fp32", {}, None, None),
    ("bf16", {}, 2e-2, 1e-1),
    ("bf16", {"host_grad_dtype": "fp32"}, 2e-2, 1e-1),
    # --dpu-corrector weight-prediction: the CPU Adam kernel writes w_new + (w_new - w_old) into the
    # pinned buffer the parameters return through (fp32 output in the fp32 run)
    ("fp32", PREDICT, None, None),
    ("bf16", PREDICT, 2e-2, 1e-1)], ids=["fp32", "bf16", "bf16-host32", "fp32-predict", "bf16-predict"])
def test_dpu_on_cuda_equals_the_delayed_reference(precision, engine_kw, tol, bias_tol):
    seed = fresh_seed(f"gpu dpu {precision} {engine_kw}")
    out = run_world(_dpu_world, 1, 1, precision, seed, 2, engine_kw, None, 6)[0]
    assert out["in_flight"] == [i >= WARMUP - 1 for i in range(STEPS)]
    _check(out, seed, 1, 2, tol, bias_tol, flush_at=6, predict=bool(engine_kw.get("dpu_weight_prediction")))


def test_dpu_two_ranks_on_one_gpu():
    seed = fresh_seed("gpu dpu dp2")
    backend = dp2_backend()
    out = run_world(_dpu_world, 2, 1, "fp32", seed, 2, {}, None, None, backend)[0]
    _check(out, seed, 2, 2, None, None)
