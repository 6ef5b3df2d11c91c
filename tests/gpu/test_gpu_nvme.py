"""Optimizer states on NVMe with the model on a CUDA GPU (issue 38): the engine's gradients land in
pinned host buffers from the GPU, the CPU Adam streams the states through the disk tier in chunks, and
the updated parameters return to the GPU. Each run is bitwise the in-memory engine on the same GPU
(tests/test_nvme_engine.py's check: losses, norms, the flat device buffer, every master and moment
element): bf16 with the master on disk and a clip that clips, fp32 with DPU, and bf16 with partial
offload (the device tail on the GPU, the host part's states on disk). One rank: the disk tier is per
rank, and NCCL refuses two ranks on one GPU."""
import pytest

from tests.harness import run_world
from tests.seeds import fresh_seed
from tests.test_nvme_engine import RUNS, _check, _pair_world

pytest.importorskip("transformers")


def test_nvme_engine_on_cuda_is_bitwise_the_in_memory_engine(tmp_path):
    seed = fresh_seed("gpu nvme engine")
    runs = RUNS["tp1dp2"]
    results = run_world(_pair_world, 1, 1, seed, runs, str(tmp_path), timeout=300)
    _check(results, runs)
