"""The only place that knows whether the "device" is a GPU: host buffers, streams and copies.

The engine runs one algorithm on both; this layer decides how each hand-off is ordered.

    CUDA  host buffers are pinned at their exact size with cudaHostRegister (torch's caching host
          allocator rounds pinned blocks up to powers of two: ~1.8x host RAM for large models) and
          unregistered in close(), which a finalizer also runs if an error path skips it.
          Device->host: a side stream waits for the bucket's reduce-scatter Work (a stream wait,
          the host does not block), copies the shard home and records an event; the compute
          stream waits on that event before it reuses the bucket buffer.
          Host->device: the side stream first waits for the compute stream (kernels may still
          read the parameters being overwritten), copies, and the compute stream waits for it.
          The copy reads pinned host memory asynchronously: an event recorded after it lets the
          host wait (wait_device_reads) before it rewrites that memory (the next CPU Adam, a
          reload from the master), whether or not a syncing backward came in between.
    CPU   "host" and "device" are the same memory. An async gloo collective runs on gloo's own
          thread, so the copy home is deferred: it runs (after Work.wait()) when the bucket
          buffer is needed again or when the host needs the gradients -- backward keeps going
          meanwhile, which is the overlap bucketing is for.
"""
from __future__ import annotations

import threading
import time
import weakref

import torch

from zo_megatron.parallel import collectives


def _unregister(ptrs: list[int]) -> None:
    for ptr in ptrs:
        torch.cuda.cudart().cudaHostUnregister(ptr)
    ptrs.clear()


class _DeferredCopy:
    """CPU: a copy home that waits for its collective first (run once, on demand, by whichever
    thread needs it first: the main thread reusing the bucket buffer, or a schedule's worker
    waiting for the shard; the lock makes the other wait until it is done)."""

    __slots__ = ("work", "dst", "src", "lock")

    def __init__(self, work, dst, src):
        self.work, self.dst, self.src = work, dst, src
        self.lock = threading.Lock()

    def run(self) -> None:
        with self.lock:
            if self.src is None:
                return
            if self.work is not None:
                self.work.wait()
            self.dst.copy_(self.src)
            self.work = self.dst = self.src = None


class DeviceLayer:
    def __init__(self, device: torch.device, pin_memory: bool = True):
        self.device = device
        self.is_cuda = device.type == "cuda"
        self.pin_memory = pin_memory and self.is_cuda
        self._registered: list[int] = []          # data pointers registered with cudaHostRegister
        self._keep: list[torch.Tensor] = []       # the tensors behind them stay alive until close()
        self._finalizer = weakref.finalize(self, _unregister, self._registered)
        self._stream = torch.cuda.Stream(device=device) if self.is_cuda else None
        self._pending: list = []                  # CUDA events / CPU deferred copies not yet waited for
        self._reads: list = []                    # CUDA events: host->device copies that may still read

    # ------------------------------------------------------------------------------ allocation
    def host_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        t = torch.empty(numel, dtype=dtype)
        if self.pin_memory and numel > 0:
            nbytes = t.numel() * t.element_size()
            err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), nbytes, 0)
            if int(err) != 0:
                raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed ({err}); retry with --no-pin-memory "
                                   "(host copies then block: backward serialises behind every copy home)")
            self._registered.append(t.data_ptr())
            self._keep.append(t)
        return t

    def device_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype, device=self.device)

    # ------------------------------------------------------------------------- device -> host
    def copy_home(self, work, dst: torch.Tensor, src: torch.Tensor, scratch: torch.Tensor | None = None):
        """dst (host) <- src (device) once the collective `work` (or None) has produced src.

        `scratch` (device, dst's dtype, src's size) is where CUDA narrows src to dst's dtype before
        the copy, so only dst's bytes cross the bus. dst may also be a device tensor (the device
        tail of a partial offload): the same ordering, no bus. Returns a handle for `release()`."""
        if not self.is_cuda:
            handle = _DeferredCopy(work, dst, src)
            self._pending.append(handle)
            return handle
        compute = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(compute)
        with torch.cuda.stream(self._stream):
            if work is not None:
                work.wait()                        # the side stream waits for the collective
            if src.dtype != dst.dtype and scratch is not None:
                scratch.copy_(src)
                src = scratch
            dst.copy_(src, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(self._stream)
        self._pending.append((ev, time.monotonic()))
        return ev

    def release(self, handle) -> None:
        """Before the device overwrites the source of a copy home: wait until it was read."""
        if handle is None:
            return
        if self.is_cuda:
            torch.cuda.current_stream(self.device).wait_event(handle)
        else:
            handle.run()

    def wait_landed(self, handle) -> None:
        """Block the calling thread (any thread) until the copy home behind `handle` has landed:
        on CUDA by polling with a timeout from now (a schedule's worker must neither spin a core in
        cudaEventSynchronize nor wait forever behind a dead peer's collective)."""
        if handle is None:
            return
        if self.is_cuda:
            wait_event(handle, time.monotonic(), self.device)
        else:
            handle.run()

    def wait_host(self) -> None:
        """Block the host until every copy home has landed (and the side stream is idle)."""
        if self.is_cuda:
            for ev, issued in self._pending:       # each behind its collective: a dead peer times out
                self._wait_event(ev, issued)
            self._stream.synchronize()
        else:
            for handle in self._pending:
                handle.run()
        self._pending.clear()
        self._reads.clear()                        # the side stream is idle: every copy has read

    def _wait_event(self, ev, issued: float) -> None:
        wait_event(ev, issued, self.device)

    def wait_device_reads(self) -> None:
        """Block the host until every host->device copy issued so far has read its host source:
        call before the host rewrites a buffer such a copy reads (the CPU Adam's output, a
        reload from the master). The compute stream's wait in copy_to_device orders only device
        work; without this the host could overwrite pinned memory an async copy is still reading.
        On the CPU the copy ran synchronously: nothing to wait for."""
        for ev, issued in self._reads:
            self._wait_event(ev, issued)
        self._reads.clear()

    # ------------------------------------------------------------------------- host -> device
    def copy_to_device(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """dst (device) <- src (host); later work on the compute stream sees the data.

        The side stream first waits for the compute stream: kernels queued there may still read
        the parameters that dst overwrites (write-after-read)."""
        if not self.is_cuda:
            dst.copy_(src)
            return
        compute = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(compute)
        with torch.cuda.stream(self._stream):
            dst.copy_(src, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(self._stream)
        self._reads.append((ev, time.monotonic()))   # src must not be rewritten before ev (wait_device_reads)
        compute.wait_stream(self._stream)

    # ---------------------------------------------------------------------------------- close
    @property
    def registered_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._keep)

    def close(self) -> None:
        """Unregister pinned host memory (idempotent). Pending copies -- and on the CPU the async
        collectives they wait on -- are waited for first: nothing is left in flight."""
        if self.is_cuda and self._stream is not None:
            self._stream.synchronize()
        elif not self.is_cuda:
            # A deferred copy home still holds its async gloo Work: wait for it here, so that no
            # collective outlives close() (gloo's thread finishing one while the interpreter shuts
            # down can abort the process at exit). An error path may find it failed: it is done.
            for handle in self._pending:
                try:
                    handle.run()
                except Exception:  # noqa: BLE001 - the collective ended; the caller's error stands
                    handle.work = handle.dst = handle.src = None
        self._pending.clear()
        self._reads.clear()
        self._finalizer()
        self._keep.clear()


def wait_event(ev, issued: float, device) -> None:
    """ev.synchronize(), but polled (the host sleeps between queries, up to 1 ms: no core spins in
    cudaEventSynchronize), and a collective that never completes (a dead or hung NCCL peer) ends
    the wait after collectives.host_wait_timeout() seconds from `issued` with CollectiveTimeout,
    instead of blocking until NCCL's watchdog aborts the process without a word."""
    limit = collectives.host_wait_timeout()
    deadline, pause = (None if limit is None else issued + limit), 1e-5
    while not ev.query():
        if deadline is not None and time.monotonic() > deadline:
            raise collectives.CollectiveTimeout(
                f"timed out after {limit:g} s waiting on {device} for a collective's result "
                "(a peer died or hung)")
        time.sleep(pause)
        pause = min(2 * pause, 1e-3)


def host_value(t: torch.Tensor) -> torch.Tensor:
    """`t` on the host, for a host read (.item()). On CUDA the work queued before it is waited for
    with wait_event's timeout first: a plain .item() blocks in cudaStreamSynchronize, behind any
    collective of a dead peer, until NCCL's watchdog aborts the survivor (issue 34, 2.2)."""
    if t.device.type != "cuda":
        return t
    ev = torch.cuda.Event()
    ev.record(torch.cuda.current_stream(t.device))
    wait_event(ev, time.monotonic(), t.device)
    return t.cpu()


def batch_to_device(batch: dict, device: torch.device) -> dict:
    """A host batch's tensors on `device`. On CUDA through pinned memory and non-blocking: a copy
    from pageable memory makes the host wait for the stream (untimed, see host_value); torch's
    pinned-memory cache keeps each pinned buffer until its copy has read it."""
    if device.type != "cuda":
        return {k: v.to(device) for k, v in batch.items()}
    return {k: v.pin_memory().to(device, non_blocking=True) for k, v in batch.items()}

