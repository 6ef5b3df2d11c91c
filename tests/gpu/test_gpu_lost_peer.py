"""A dead or hung peer under NCCL (issue 27, item 2): the same two-node job as
tests/test_faults.py's lost-node test, one GPU per node (CUDA_VISIBLE_DEVICES), so DP=2 runs over
NCCL. The survivor must end the way it does under gloo: one line naming the rank and the
iteration, within the timeout, nothing left running. Not NCCL's watchdog tearing the process down
with SIGABRT and no word -- what happened before the engine's timed host wait
(offload/device.py, DeviceLayer._wait_event) -- and not a hang in a stream synchronize.

Needs two GPUs: NCCL refuses two ranks on one. With ZO_GPU_SUITE_ON_CPU=1 it runs on the CPU
(gloo), which checks the test, not NCCL."""
import signal

import pytest
import torch

from tests.gpu.conftest import HAVE_CUDA
from tests.test_faults import assert_the_survivor_ended_with_one_line, corpus, lose_a_node  # noqa: F401 - a fixture

TWO_GPUS = torch.cuda.device_count() >= 2


@pytest.mark.skipif(HAVE_CUDA and not TWO_GPUS, reason="needs two GPUs: NCCL refuses two ranks on one GPU")
@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGSTOP], ids=["node-dies", "node-hangs"])
def test_a_lost_node_under_nccl_ends_the_survivor_with_one_line(corpus, tmp_path, how):  # noqa: F811
    node_env = (lambda node: {"CUDA_VISIBLE_DEVICES": str(node)}) if HAVE_CUDA else (lambda node: {})
    returncode, out, err, waited = lose_a_node(corpus, tmp_path, how, node_env)
    if HAVE_CUDA:
        assert "device cuda" in out, out[:2000]
    assert "SIGABRT" not in err and "Signal 6" not in err, err[-3000:]      # not NCCL's watchdog
    assert_the_survivor_ended_with_one_line(corpus, how, returncode, err, waited)
