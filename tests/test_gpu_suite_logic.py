"""The GPU suite's choices that can be checked without a GPU."""
import pytest

from tests.gpu.conftest import dp2_backend


@pytest.mark.parametrize("gpus,want", [(0, "gloo"), (1, "cpu:gloo,cuda:gloo"), (2, "cpu:gloo,cuda:nccl"),
                                       (8, "cpu:gloo,cuda:nccl")])
def test_dp2_worlds_use_nccl_when_each_rank_has_a_gpu(gpus, want):
    assert dp2_backend(gpus) == want
