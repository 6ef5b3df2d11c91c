"""A Mixtral-shaped mixture of experts trained by the offload engine on one CUDA GPU (issue 39):
megatron-core's MoELayer (router, top-k, the local experts, the token dispatcher) runs its forward and
backward on CUDA, the engine moves the experts' gradients home with the dense ones and returns the
updated parameters. The same check as tests/test_moe_training.py: 5 steps, 2 micro-batches accumulated,
a clip that clips, weight decay on the router and experts; losses and gradient norms within 1e-5 of
single-process torch AdamW on transformers' MixtralForCausalLM (CPU, float64), every weight within
tests/fp32_bounds.py's bounds. One rank (EP 1): expert parallelism needs an all-to-all between GPUs,
which NCCL refuses to two ranks on one GPU."""
import pytest

from tests.harness import run_world
from tests.seeds import fresh_seed
from tests.test_moe_model import _configs, _random_hf
from tests.test_moe_training import _engine_world, assert_trains_as_torch_adamw

pytest.importorskip("transformers")


def test_moe_engine_on_cuda_trains_as_torch_adamw(tmp_path):
    seed = fresh_seed("gpu moe engine")
    directory = _random_hf(tmp_path / "mixtral", _configs()["mixtral"], seed)
    out = run_world(_engine_world, 1, directory, seed, 1, 1, timeout=400)[0]
    assert_trains_as_torch_adamw(out, directory, tmp_path, seed)
