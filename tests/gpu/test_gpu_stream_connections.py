"""Issue 27 item 4: does CUDA_DEVICE_MAX_CONNECTIONS=1 serialise the compute stream behind a side
stream's wait on a collective?

The engine's copy home (offload/device.py) makes a side stream wait for the bucket's
reduce-scatter and then copies; the compute stream goes on with backward. With one hardware
queue (CUDA_DEVICE_MAX_CONNECTIONS=1, which the job sets at TP > 1 as Megatron-LM does), work of
every stream is fed through one in-order queue, so compute kernels queued after that wait may not
start until the collective ends -- backward would serialise behind each reduce-scatter, where
Megatron waits for its gradient reduce-scatters only at the end of backward.

Measured here without NCCL, on one GPU, in a fresh process per setting (the variable is read when
CUDA starts): a "collective" stream runs a long kernel (torch.cuda._sleep) and records an event;
the side stream waits for it and copies; the compute stream then queues matmuls. overlap = the
share of the compute stream's work that finished before the "collective" did. The default setting
must overlap (else the measurement is broken); the value at 1 is printed and recorded (with
ZO_GPU_MEASURE_DIR set, as JSON) for docs/gpu.md.
"""
import json
import os
import subprocess
import sys

import pytest

from tests.gpu.conftest import needs_cuda

PROBE = r"""
import json, os, time, torch
if os.environ.get("ZO_PROBE_SET_LATE"):
    # as the job did before issue 34: the variable set after torch.cuda.is_available() ran
    torch.cuda.is_available()
    os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = os.environ["ZO_PROBE_SET_LATE"]
dev = torch.device("cuda", 0)
comm, side, compute = (torch.cuda.Stream(dev) for _ in range(3))
a = torch.randn(2048, 2048, device=dev)
src, dst = torch.randn(1 << 20, device=dev), torch.empty(1 << 20, pin_memory=True)
narrow = torch.empty(1 << 20, device=dev, dtype=torch.bfloat16)
# Warm every stream with the work it will time (the first matmul on a stream sets up its cuBLAS
# workspace, an allocation; the first GPU run of this probe timed that and saw no overlap even at
# the default setting: comm 17.8 ms, compute 28.3 ms).
for st in (torch.cuda.current_stream(dev), comm, side, compute):
    with torch.cuda.stream(st):
        for _ in range(3):
            a @ a
        narrow.copy_(src)
        dst.copy_(src, non_blocking=True)
        torch.cuda._sleep(1000)
torch.cuda.synchronize()
# cycles for ~50 ms of sleep on this GPU
t = time.perf_counter(); torch.cuda._sleep(10**7); torch.cuda.synchronize(); per = (time.perf_counter() - t) / 10**7
cycles = int(0.05 / per)
done_comm, done_compute = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
start = torch.cuda.Event(enable_timing=True)
start.record(torch.cuda.current_stream(dev))
comm.wait_stream(torch.cuda.current_stream(dev)); side.wait_stream(torch.cuda.current_stream(dev))
compute.wait_stream(torch.cuda.current_stream(dev))
with torch.cuda.stream(comm):
    torch.cuda._sleep(cycles)                  # the collective
    ev = torch.cuda.Event(); ev.record(comm)
    done_comm.record(comm)
with torch.cuda.stream(side):
    side.wait_event(ev)                        # the copy home waits for it
    narrow.copy_(src)                          # a kernel, as the engine's bf16 narrowing (issue 34 2.3)
    dst.copy_(src, non_blocking=True)
with torch.cuda.stream(compute):
    for _ in range(20):                        # backward goes on
        a @ a
    done_compute.record(compute)
torch.cuda.synchronize()
print(json.dumps(dict(comm_ms=start.elapsed_time(done_comm), compute_ms=start.elapsed_time(done_compute))))
"""


def _measure(connections: str | None, late: bool = False) -> dict:
    env = dict(os.environ)
    env.pop("CUDA_DEVICE_MAX_CONNECTIONS", None)
    env.pop("ZO_PROBE_SET_LATE", None)
    if connections is not None:
        env["ZO_PROBE_SET_LATE" if late else "CUDA_DEVICE_MAX_CONNECTIONS"] = connections
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@needs_cuda("stream scheduling on a GPU")
def test_side_stream_wait_and_the_compute_stream_with_one_or_many_connections():
    results = {}
    for name, setting, late in (("default", None, False), ("CUDA_DEVICE_MAX_CONNECTIONS=1", "1", False),
                                ("CUDA_DEVICE_MAX_CONNECTIONS=1 set after torch.cuda.is_available()", "1", True)):
        r = _measure(setting, late)
        r["compute_done_before_collective"] = r["compute_ms"] < r["comm_ms"]
        results[name] = r
    print("stream connections:", json.dumps(results))
    where = os.environ.get("ZO_GPU_MEASURE_DIR")
    if where:
        with open(os.path.join(where, "stream_connections.json"), "w") as f:
            json.dump(results, f, indent=1)
    assert results["default"]["compute_done_before_collective"], results   # the probe can see overlap
