"""Issue 34, 2.2 and 2.6: no untimed host wait on a CUDA device.

The job's host reads (the step's loss, the evaluation's sum) and its batch copies used to block in
cudaStreamSynchronize behind every queued collective: with a dead NCCL peer that wait never ends
and NCCL's watchdog aborts the survivor without the job's one line. A schedule's worker waited for
each copy home in cudaEventSynchronize, spinning a core. Now every such wait polls with the job's
host-wait timeout (offload/device.py). CUDA is stood in for by fakes here: what is checked is the
order and the kind of each wait, not CUDA itself (tests/gpu does that on a GPU)."""
import ast
import os
import time

import pytest
import torch

from zo_megatron.offload import device as D
from zo_megatron.parallel import collectives

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class _NeverDone:
    """A CUDA event whose work never completes (a collective of a dead peer)."""

    def __init__(self):
        self.queries = 0

    def query(self):
        self.queries += 1
        return False

    def synchronize(self):              # the untimed wait: must never be called
        raise AssertionError("an untimed cudaEventSynchronize")

    def record(self, stream=None):
        pass


@pytest.fixture
def timeout():
    old = collectives.host_wait_timeout()
    collectives.set_host_wait_timeout(0.3)
    yield 0.3
    collectives.set_host_wait_timeout(old)


def test_a_wait_on_a_collective_that_never_ends_times_out_without_spinning(timeout):
    ev = _NeverDone()
    t0 = time.monotonic()
    with pytest.raises(collectives.CollectiveTimeout, match="a peer died or hung"):
        D.wait_event(ev, time.monotonic(), torch.device("cuda", 3))
    took = time.monotonic() - t0
    assert timeout <= took < timeout + 0.5, took
    # it slept between queries (at most 1 ms apart after the first few): no spinning core
    assert ev.queries < took / 1e-3 + 30, ev.queries


def test_the_workers_wait_for_a_copy_home_is_the_timed_poll(timeout, monkeypatch):
    layer = D.DeviceLayer.__new__(D.DeviceLayer)
    layer.device, layer.is_cuda = torch.device("cuda", 1), True
    with pytest.raises(collectives.CollectiveTimeout):
        layer.wait_landed(_NeverDone())


class _FakeCudaTensor:
    """Stands in for a CUDA scalar: .cpu() / .item() are the host reads, .device says cuda."""

    device = torch.device("cuda", 0)

    def __init__(self, log):
        self.log = log

    def cpu(self):
        self.log.append("cpu")
        return torch.tensor(1.5)

    def item(self):
        self.log.append("item")
        return 1.5


def test_a_host_read_waits_for_the_device_with_the_timeout_first(timeout, monkeypatch):
    log = []
    monkeypatch.setattr(torch.cuda, "Event", _NeverDone)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    with pytest.raises(collectives.CollectiveTimeout):
        D.host_value(_FakeCudaTensor(log))
    assert log == []                                   # nothing read before the timed wait gave up

    class Done(_NeverDone):
        def query(self):
            return True
    monkeypatch.setattr(torch.cuda, "Event", Done)
    assert D.host_value(_FakeCudaTensor(log)).item() == 1.5 and log == ["cpu"]


def test_batches_go_to_a_cuda_device_pinned_and_non_blocking():
    calls = []

    class FakeHostTensor:
        def __init__(self, pinned=False):
            self.pinned = pinned

        def pin_memory(self):
            calls.append("pin")
            return FakeHostTensor(True)

        def to(self, device, non_blocking=False):
            calls.append(("to", str(device), self.pinned, non_blocking))
            return self

    out = D.batch_to_device({"tokens": FakeHostTensor(), "labels": FakeHostTensor()}, torch.device("cuda", 0))
    assert set(out) == {"tokens", "labels"}
    assert calls == ["pin", ("to", "cuda:0", True, True)] * 2
    cpu = D.batch_to_device({"tokens": torch.arange(3)}, torch.device("cpu"))
    assert torch.equal(cpu["tokens"], torch.arange(3))


# The modules the training loop runs through (training/loop.py before the trainer was split out of it)
# (the MoE job's aux-loss log, moe_losses.py, is read at every log row after NCCL all-reduces: its
# untimed .item() and .cpu() were found by review on 2026-12-07)
LOOP_MODULES = ("trainer.py", "evaluation.py", "step_log.py", "checkpointing.py", "loop.py", "moe_losses.py")


def test_the_training_loop_reads_device_values_only_through_host_value():
    """Every host read (.item(), .cpu(), .tolist()) in the training loop's modules reads a host tensor:
    host_value(...) or a tensor built on the host (the all-reduced stats, the routing counts brought
    home); the old loop called step_loss.item() on the device tensor."""
    host_names = {"stats", "flag", "counts", "sums", "gathered"}   # CPU tensors: host_value's, gloo reductions
    bad, src = [], ""
    for name in LOOP_MODULES:
        text = open(os.path.join(ROOT, "zo_megatron", "training", name)).read()
        src += text
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                    node.func.attr in ("item", "cpu", "tolist"):
                recv = node.func.value
                ok = (isinstance(recv, ast.Call) and getattr(recv.func, "id", None) == "host_value") or (
                    isinstance(recv, ast.Subscript) and getattr(recv.value, "id", None) in host_names) or (
                    isinstance(recv, ast.Name) and recv.id in host_names) or (
                    isinstance(recv, ast.Call) and isinstance(recv.func, ast.Attribute)     # counts.max().item()
                    and getattr(recv.func.value, "id", None) in host_names)
                if not ok:
                    bad.append((name, node.lineno, ast.unparse(node)))
    assert not bad, bad
    assert 'b["tokens"].to(' not in src and "batch_to_device(" in src   # batches go through batch_to_device


@pytest.mark.parametrize("schedule", ["synchronous", "dpu"])
def test_on_cuda_the_hosts_torch_passes_get_the_cpu_adams_cores(schedule):
    """Issue 34, 2.4: under torchrun (OMP_NUM_THREADS=1) the host-side torch passes ran on one core
    on a CUDA job; they now get the CPU Adam's threads."""
    import argparse
    import types

    from zo_megatron.offload import cpu_adam
    from zo_megatron.training.components import set_threads as _set_threads

    old_torch, old_adam = torch.get_num_threads(), cpu_adam.info()["threads"]
    torch.set_num_threads(1)                                  # what torchrun leaves
    try:
        args = argparse.Namespace(dpu=schedule == "dpu", overlap_cpu_step=False, dpu_adam_threads=None)
        _set_threads(args, types.SimpleNamespace(device=torch.device("cuda", 0)), 2)
        assert torch.get_num_threads() == 2, args.threads_line
        assert cpu_adam.info()["threads"] == (1 if schedule == "dpu" else 2)   # DPU leaves one core to launch
    finally:
        torch.set_num_threads(old_torch)
        cpu_adam.set_num_threads(old_adam)


def test_the_engines_bring_device_values_home_only_through_host_value():
    """The engines' per-step copies of device values to the host (.cpu()) go through host_value's timed
    wait: the partial-offload tail's gradient statistics were an untimed .cpu() (found by review on
    2026-12-07; reachable by the expert engine since partial offload with EP is allowed)."""
    bad = []
    for name in ("engine.py", "grad_buckets.py", "expert_parallel.py", "device_optimizer.py", "schedules.py"):
        text = open(os.path.join(ROOT, "zo_megatron", "offload", name)).read()
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "cpu":
                bad.append((name, node.lineno, ast.unparse(node)))
    assert not bad, bad
