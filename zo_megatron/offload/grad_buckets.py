"""The offload engine's backward: gradient hooks feeding an ordered window of bucket buffers that
are reduce-scattered over DP, each rank's shard copied home (engine.py's "backward" and its ordering
rules). A mixin of `engine.ZeroOffloadEngine`, which provides `layout`, `dev`, the bucket buffers
(`_grad_buffers`, `_scratch`), the host gradient (`host_grad`, `host_acc`), the device tail cut
(`_cut`, `_tail`), the schedule, `loss_scaler`, `accounting` and the micro-batch counters.

    param.grad --hook--> bucket b open?  yes: absorb into its buffer view
                                         no:  wait in param.grad until b enters the window
    bucket complete and b == next  -->  reduce-scatter (async, in place)  -->  my shard -> host
                                                                              (tail part stays)
    window: buckets [next, next + buffers) hold a buffer, so `next` can always be opened.
"""
from __future__ import annotations

import torch

from zo_megatron.parallel import collectives


class GradientBuckets:
    def backward(self, loss: torch.Tensor, *, last_micro_batch: bool = True) -> None:
        """loss.backward() with loss scaling. Only the last micro-batch communicates, unless
        gradients accumulate on the host (then every micro-batch is reduced and added there)."""
        self.begin_backward(last_micro_batch)
        (loss * self.loss_scaler.scale).backward() if self.loss_scaler.scale != 1.0 else loss.backward()
        self.end_backward(last_micro_batch)

    def begin_backward(self, last_micro_batch: bool) -> None:
        """backward() before loss.backward() (an engine another engine's backward reaches: expert_parallel.py)."""
        if self._micro == 0:
            self.accounting.reset_step()
        self._sync = last_micro_batch or self.accumulate_on_host
        if self._sync:
            self._sync_pending = True
        self.schedule.on_backward_start(self, last_micro_batch)
        if last_micro_batch and self._nvme is not None and self.dpu_warmup_steps is None:
            self._nvme.prefetch()            # the CPU step's first reads, behind backward (nvme_store.py)

    def end_backward(self, last_micro_batch: bool) -> None:
        """What backward() does after loss.backward()."""
        if self.accumulate_on_host:
            self.finish_grad_sync()
            if getattr(self.schedule, "active", False):
                pass                                     # the worker adds each bucket as it lands
            elif self._micro == 0:
                self.host_acc.copy_(self.host_grad)
            else:
                self.host_acc.add_(self.host_grad)
        self._micro = 0 if last_micro_batch else self._micro + 1

    def _make_hook(self, slot):
        def hook(param: torch.Tensor) -> None:
            if self._sync:
                self._grad_ready(slot)
            elif self._fp32_accumulation:
                self._add_to_main_grad(slot)
        return hook

    def _add_to_main_grad(self, slot) -> None:
        """A micro-batch before the last: its 16-bit gradient into the fp32 main_grad, param.grad freed."""
        if self._main_grad is None:
            self._main_grad = self.dev.device_empty(self.layout.numel, torch.float32)
        i = self._slot_index[id(slot)]
        mg = self._main_grad[slot.start:slot.start + slot.numel]
        g = slot.param.grad.reshape(-1)
        mg.add_(g) if self._main_grad_held[i] else mg.copy_(g)
        self._main_grad_held[i] = True
        slot.param.grad = None

    def _reset_bucket_state(self) -> None:
        nb = len(self.layout.buckets)
        self._next = 0                                   # the next bucket to reduce-scatter
        self._open: dict[int, tuple[int, torch.Tensor]] = {}   # bucket -> (buffer index, view)
        self._free = list(range(len(self._grad_buffers)))
        self._in_use: dict[int, tuple] = {}             # buffer -> its pending copies home
        self._waiting: list[list] = [[] for _ in range(nb)]   # slots ready before their bucket opened
        self._absorbed = [False] * len(self.layout.slots)
        self._count = [0] * nb                           # slots absorbed per bucket

    def _grad_ready(self, slot) -> None:
        b = slot.bucket
        if b in self._open:
            self._absorb(slot)
        else:
            self._waiting[b].append(slot)               # param.grad is kept until b has a buffer
            if b < self._next + len(self._grad_buffers):
                self._open_bucket(b)
        self._send_ready()

    def _open_bucket(self, b: int) -> None:
        """Give bucket b (inside the window) a zeroed buffer and absorb its waiting gradients."""
        i = self._free.pop(0)                            # the longest-free buffer: its copy is oldest
        for handle in self._in_use.pop(i, ()):          # its last copies home have read it
            self.dev.release(handle)
        buf = self._grad_buffers[i][: self.layout.buckets[b].numel]
        buf.zero_()
        self._open[b] = (i, buf)
        waiting, self._waiting[b] = self._waiting[b], []
        for s in waiting:
            self._absorb(s)

    def _absorb(self, slot) -> None:
        i = self._slot_index[id(slot)]
        held = self._main_grad_held[i]
        if self._absorbed[i] or (slot.param.grad is None and not held):
            return
        bucket = self.layout.buckets[slot.bucket]
        off = slot.start - bucket.start
        view = self._open[slot.bucket][1][off:off + slot.numel]
        if held:                                         # earlier micro-batches' fp32 sum, then this one's
            view.copy_(self._main_grad[slot.start:slot.start + slot.numel])
            if slot.param.grad is not None:
                view.add_(slot.param.grad.reshape(-1))
            self._main_grad_held[i] = False
        else:
            view.copy_(slot.param.grad.reshape(-1))
        slot.param.grad = None
        self._absorbed[i] = True
        self._count[slot.bucket] += 1

    def _send_ready(self) -> None:
        """Send every complete bucket whose turn it is; open the buckets the window reaches."""
        buckets = self.layout.buckets
        while self._next < len(buckets) and self._next in self._open \
                and self._count[self._next] == len(buckets[self._next].slots):
            self._send(self._next)
            reach = self._next + len(self._grad_buffers) - 1
            if reach < len(buckets) and self._waiting[reach] and reach not in self._open:
                self._open_bucket(reach)

    def _send(self, b: int) -> None:
        """Reduce-scatter bucket b (averaged over DP, async) and queue its shard's copy home."""
        bucket = self.layout.buckets[b]
        i, buf = self._open.pop(b)
        self._sp_grads.reduce(b, buf)
        n = bucket.shard_numel
        if self.grad_divisor > 1:
            buf.div_(self.grad_divisor)
        mine = buf[self.dp_rank * n:(self.dp_rank + 1) * n]
        work = collectives.reduce_scatter(mine, buf, self.dp_group, async_op=True)   # in place
        self.accounting.ring(collectives.wire_bytes("reduce_scatter", buf), self.dp_size)
        hs, m = bucket.host_start, min(n, max(0, self._cut - bucket.host_start))   # m: the host's part
        handles = []
        if m:
            dst = self.host_grad[hs:hs + m]
            scratch = self._scratch[i][:m] if self._scratch[i] is not None else None
            handles.append(self.dev.copy_home(work, dst, mine[:m], scratch))
            self.accounting.d2h_bytes += m * dst.element_size()
            self.schedule.on_bucket_home(self, bucket, handles[-1])
        if m < n:                                        # the device tail's gradients stay on the device
            t0 = hs + m - self._cut
            handles.append(self.dev.copy_home(work, self._tail.grad[t0:t0 + n - m], mine[m:]))
        self._in_use[i] = tuple(handles)
        self._free.append(i)
        self._next = b + 1

    def finish_grad_sync(self) -> None:
        """End of a syncing backward: complete and send, in order, every bucket not yet sent --
        parameters that got no gradient in this micro-batch contribute what they accumulated
        earlier, or zero -- then wait until every shard is on the host."""
        if not self._sync_pending:
            return
        buckets = self.layout.buckets
        while self._next < len(buckets):
            b = self._next
            if b not in self._open:
                self._open_bucket(b)                     # b is the window's first: a buffer is free
            for s in buckets[b].slots:
                self._absorb(s)
            self._send(b)
        self.dev.wait_host()
        self._reset_bucket_state()
        self._sync_pending = False
