"""faults.is_lost_peer: a peer that died or went silent ends the rank with one line; an error of
this rank's own (an NCCL usage error, an out-of-memory, a CUDA error) keeps its type, message and
traceback even when its message names NCCL, gloo or a socket. The exceptions are built with the
classes and messages torch, gloo and NCCL raise (torch/csrc/distributed/c10d, gloo/transport/tcp)."""
import pytest
import torch
import torch.distributed as dist

from zo_megatron.training import faults

LOST = [
    dist.DistNetworkError("Connection reset by peer"),
    dist.DistStoreError("Timed out after 31 seconds waiting for clients. 1/2 clients joined."),
    RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:4321"),
    RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 30000ms for recv operation to complete"),
    dist.DistBackendError("[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=41, "
                          "OpType=_REDUCE_SCATTER_BASE, Timeout(ms)=30000) ran for 30012 milliseconds before timing out."),
    dist.DistBackendError("NCCL error in: ProcessGroupNCCL.cpp:2046, remote process exited or there was a network "
                          "error, NCCL version 2.21.5\nncclRemoteError: A call failed possibly due to a network error "
                          "or a remote process exiting prematurely."),
    dist.DistBackendError("NCCL communicator was aborted on rank 1."),
]

OWN = [
    dist.DistBackendError("NCCL error in: ProcessGroupNCCL.cpp:1970, invalid usage (run with NCCL_DEBUG=WARN for "
                          "details), NCCL version 2.21.5\nncclInvalidUsage: This usually reflects invalid usage of "
                          "NCCL library."),
    dist.DistBackendError("NCCL error in: ProcessGroupNCCL.cpp:1970, invalid argument, NCCL version 2.21.5\n"
                          "ncclInvalidArgument: Invalid value for an argument."),
    torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (NCCL buffers, socket 0); "
                           "the peer timeout is 30 s"),
    dist.DistBackendError("NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled cuda error (run with "
                          "NCCL_DEBUG=INFO for details), NCCL version 2.21.5"),
    RuntimeError("Tensors must be CUDA and dense (nccl)"),
    RuntimeError("ProcessGroupGloo::allreduce: unsupported device type meta"),
    ValueError("timeout must be positive"),
    KeyError("socket"),
]


@pytest.mark.parametrize("exc", LOST, ids=lambda e: type(e).__name__ + ":" + str(e)[:40])
def test_a_lost_or_silent_peer_is_recognised(exc):
    assert faults.is_lost_peer(exc)


@pytest.mark.parametrize("exc", OWN, ids=lambda e: type(e).__name__ + ":" + str(e)[:40])
def test_an_error_of_this_rank_keeps_its_type_and_traceback(exc):
    assert not faults.is_lost_peer(exc)


class _Event:
    """A CUDA event stand-in: complete after `polls` queries (never, when None)."""

    def __init__(self, polls):
        self.polls = polls

    def query(self):
        if self.polls is None:
            return False
        self.polls -= 1
        return self.polls < 0

    def synchronize(self):
        raise AssertionError("an unbounded synchronize: a dead peer would block here until NCCL's watchdog")


class _Stream:
    def synchronize(self):
        pass


@pytest.fixture
def host_wait_timeout():
    from zo_megatron.parallel import collectives

    def set_(seconds):
        collectives.set_host_wait_timeout(seconds)

    yield set_
    collectives.set_host_wait_timeout(None)


def _cuda_like_layer(pending, reads=()):
    from zo_megatron.offload.device import DeviceLayer

    layer = DeviceLayer(torch.device("cpu"))
    layer.is_cuda, layer._stream = True, _Stream()       # the CUDA branch, with stand-in events
    layer._pending, layer._reads = list(pending), list(reads)
    return layer


@pytest.mark.parametrize("wait", ["wait_host", "wait_device_reads"])
def test_a_collective_that_never_completes_ends_the_host_wait_as_a_lost_peer(host_wait_timeout, wait):
    """Under NCCL a reduce-scatter whose peer died never completes; the host's wait for its copy
    home must end within the timeout with an error the training loop reports as a lost peer."""
    import time

    host_wait_timeout(0.3)
    now = time.monotonic()
    stuck = [(_Event(3), now), (_Event(None), now)]
    layer = _cuda_like_layer(stuck if wait == "wait_host" else (), stuck if wait == "wait_device_reads" else ())
    t0 = time.monotonic()
    with pytest.raises(RuntimeError) as info:
        getattr(layer, wait)()
    assert 0.25 <= time.monotonic() - t0 < 5.0
    assert faults.is_lost_peer(info.value), info.value
    assert "timed out after 0 s" not in str(info.value)


def test_collectives_that_complete_are_waited_for_without_error(host_wait_timeout):
    import time

    host_wait_timeout(30.0)
    now = time.monotonic()
    layer = _cuda_like_layer([(_Event(5), now), (_Event(0), now)], [(_Event(2), now)])
    layer.wait_device_reads()
    layer.wait_host()
    assert layer._pending == [] and layer._reads == []
