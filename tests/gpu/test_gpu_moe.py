"""A Mixtral-shaped mixture of experts trained by the offload engine on one CUDA GPU (issue 39):
megatron-core's MoELayer (router, top-k, the local experts, the token dispatcher) runs its forward and
backward on CUDA, the engine moves the experts' gradients home with the dense ones and returns the
updated parameters. The same check as tests/test_moe_training.py: 5 steps, 2 micro-batches accumulated,
a clip that clips, weight decay on the router and experts; losses and gradient norms within 1e-5 of
single-process torch AdamW on transformers' MixtralForCausalLM (CPU, float64), every weight within
tests/fp32_bounds.py's bounds. One rank (EP 1): expert parallelism needs an all-to-all between GPUs,
which NCCL refuses to two ranks on one GPU."""
import pytest
import torch

from tests.fp32_bounds import assert_fp32_weights_match
from tests.harness import run_world
from tests.seeds import fresh_seed
from tests.test_moe_model import _configs, _random_hf
from tests.test_moe_training import CLIP, STEPS, _engine_world, _torch_adamw

pytest.importorskip("transformers")


def test_moe_engine_on_cuda_trains_as_torch_adamw(tmp_path):
    seed = fresh_seed("gpu moe engine")
    directory = _random_hf(tmp_path / "mixtral", _configs()["mixtral"], seed)
    out = run_world(_engine_world, 1, directory, seed, 1, 1, timeout=400)[0]
    losses, norms, ref = _torch_adamw(directory, tmp_path, seed, torch.float64)
    assert min(norms) > CLIP                               # the clip is exercised
    for step in range(STEPS):
        assert abs(out["losses"][step] - losses[step]) <= 1e-5 * abs(losses[step]), (step, out["losses"], losses)
        assert abs(out["norms"][step] - norms[step]) <= 1e-5 * norms[step], (step, out["norms"], norms)
    assert set(out["final"]) == set(ref)
    assert_fp32_weights_match(out["final"], ref, _torch_adamw(directory, tmp_path, seed, torch.float32)[2],
                              max_rtol=1e-5)
