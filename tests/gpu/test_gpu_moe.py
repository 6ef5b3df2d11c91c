"""Mixtures of experts on one CUDA GPU (issue 39).

- The engine: a Mixtral-shaped model trained by the offload engine: megatron-core's MoELayer
  (router, top-k, the local experts, the token dispatcher) runs its forward and backward on CUDA,
  the engine moves the experts' gradients home with the dense ones and returns the updated
  parameters. The same check as tests/test_moe_training.py: 5 steps, 2 micro-batches accumulated, a
  clip that clips, weight decay on the router and experts; losses and gradient norms within 1e-5 of
  single-process torch AdamW on transformers' MixtralForCausalLM (CPU, float64), every weight within
  tests/fp32_bounds.py's bounds.
- The job: pretrain_gpt.py with Megatron-LM's MoE flags under torchrun on the GPU, stopped by
  --exit-interval at iteration 3 and resumed to 6, against the same 6 iterations uninterrupted: the
  resumed losses follow (the peers' MoE resume bug class is a stale Adam step: a resume that restarts
  the step count moved iteration 5's loss by 2.1%, 200x the bound, on the CPU check at seed
  664000206), the checkpoint records step 3, and every row logs the router's losses and the tokens
  per expert.
One rank (EP 1): expert parallelism needs an all-to-all between GPUs, which NCCL refuses to two
ranks on one GPU."""
import json

import pytest
import torch

from tests.gpu.test_gpu_memory_and_job import _run
from tests.harness import run_world
from tests.seeds import fresh_seed
from tests.test_moe_job import MOE
from tests.test_moe_model import _configs, _random_hf
from tests.test_moe_training import _engine_world, assert_trains_as_torch_adamw

pytest.importorskip("transformers")


def test_moe_engine_on_cuda_trains_as_torch_adamw(tmp_path):
    seed = fresh_seed("gpu moe engine")
    directory = _random_hf(tmp_path / "mixtral", _configs()["mixtral"], seed)
    out = run_world(_engine_world, 1, directory, seed, 1, 1, timeout=400)[0]
    assert_trains_as_torch_adamw(out, directory, tmp_path, seed)


# fp32 on CUDA: the uninterrupted and the resumed run differ only by CUDA's atomics (the experts'
# token scatter), ~1e-7 per step; a wrong resume moves the loss by 1e-3 or more
RESUME_RTOL = 1e-4


def test_moe_job_on_cuda_resumes_where_it_left_off(tmp_path):
    seed = fresh_seed("gpu moe job")
    argv = [*MOE, "--seed", str(seed), "--train-iters", "6"]

    def job(name, extra):
        log = tmp_path / f"{name}.jsonl"
        r = _run([*argv, "--log-jsonl", str(log), *extra], tmp_path, timeout=400)
        assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
        rows = [json.loads(line) for line in open(log)]
        return {x["iteration"]: x for x in rows if x["kind"] == "train"}, r.stdout

    straight, out = job("straight", [])
    assert f"device {'cuda' if torch.cuda.is_available() else 'cpu'}" in out, out[:2000]
    save = tmp_path / "ckpt"
    first, _ = job("first", ["--save", str(save), "--exit-interval", "3"])
    assert sorted(first) == [1, 2, 3]
    meta = json.loads((save / "iter_0000003" / "checkpoint.json").read_text())
    assert meta["optimizer"]["step"] == 3, meta["optimizer"]
    resumed, out = job("resumed", ["--load", str(save)])
    assert "resumed from" in out and sorted(resumed) == [4, 5, 6], out[-2000:]
    for it in range(1, 7):
        row = (first if it <= 3 else resumed)[it]
        ref = straight[it]["loss"]
        assert abs(row["loss"] - ref) <= RESUME_RTOL * abs(ref), (it, row["loss"], ref)
        assert row["load_balancing_loss"] > 0 and row["z_loss"] > 0, row
        assert row["tokens_per_expert_min"] <= row["tokens_per_expert_mean"] <= row["tokens_per_expert_max"], row
