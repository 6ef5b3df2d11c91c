"""The only place that knows whether the "device" is a GPU: host buffers and async copies.

On CPU the host partition and the device are the same memory and every copy is a plain
synchronous copy, so the CPU path runs the very same algorithm as the GPU path. On CUDA:
- host buffers are pinned at their exact size with cudaHostRegister (torch's caching host
  allocator rounds pinned blocks up to powers of two: ~1.8x host RAM for large models);
- device->host gradient copies run on a side stream that first waits for the compute stream (the
  reduce-scatter wrote the data there), and an event marks when the host may read them;
- host->device parameter copies run on the same side stream; the compute stream waits for them
  before the all-gather.
NOT RUN HERE: this project's machines have no GPU; the CUDA branches below are untested.
"""
from __future__ import annotations

import torch


class DeviceLayer:
    def __init__(self, device: torch.device, pin_memory: bool = True):
        self.device = device
        self.is_cuda = device.type == "cuda"
        self.pin_memory = pin_memory and self.is_cuda
        self._registered: list[torch.Tensor] = []
        self._stream = torch.cuda.Stream(device=device) if self.is_cuda else None
        self._pending: list = []

    def host_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        t = torch.empty(numel, dtype=dtype)
        if self.pin_memory and numel > 0:
            err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0)
            if int(err) != 0:
                raise RuntimeError(f"cudaHostRegister of {t.numel() * t.element_size()} bytes failed ({err}); "
                                   "retry with --no-pin-memory")
            self._registered.append(t)
        return t

    def device_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype, device=self.device)

    def copy_to_host(self, dst: torch.Tensor, src: torch.Tensor):
        """dst (host) <- src (device). Asynchronous on CUDA: `wait_host()` before the host reads
        dst, and `before_reuse(event)` before the device overwrites src. Returns that event."""
        if not self.is_cuda:
            dst.copy_(src)
            return None
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            dst.copy_(src, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(self._stream)
        self._pending.append(ev)
        return ev

    def before_reuse(self, event) -> None:
        """Make the compute stream wait until a device->host copy has finished reading its source."""
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def wait_host(self) -> None:
        """Block the host until every queued device->host copy has landed."""
        for ev in self._pending:
            ev.synchronize()
        self._pending.clear()

    def copy_to_device(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """dst (device) <- src (host); later work on the compute stream sees the data."""
        if not self.is_cuda:
            dst.copy_(src)
            return
        with torch.cuda.stream(self._stream):
            dst.copy_(src, non_blocking=True)
        torch.cuda.current_stream(self.device).wait_stream(self._stream)

    def close(self) -> None:
        for t in self._registered:
            torch.cuda.cudart().cudaHostUnregister(t.data_ptr())
        self._registered.clear()
