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
