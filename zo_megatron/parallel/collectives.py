"""Every torch.distributed collective zo_megatron issues goes through this module.

The rule, in one place: process groups carry one backend per device type --
``cpu:gloo,cuda:nccl`` on GPUs, ``gloo`` on CPU-only machines (``default_backend``) -- and
megatron-core's TP/DP subgroups inherit that map. So a collective runs where its tensor lives:
bucket reduce-scatters and parameter all-gathers on CUDA tensors go through NCCL, the small
host-side agreements (overflow flag + grad norm, layout checks, logged losses) stay on CPU
tensors and go through gloo, and no tensor is moved just to satisfy a backend. A tensor whose
device type the group has no backend for is refused with one line here, not deep inside torch.

gloo (every CPU tensor) runs all_reduce as a pipelined ring but reduce_scatter and all_gather
with slower algorithms: on the 2-core EPYC, 2 ranks, 10M fp32 elements, all_reduce took 0.07 s,
reduce_scatter 0.19 s and all_gather 0.18 s (at 45M: 0.13 / 0.51 / 0.33 s). So large CPU
reduce-scatters, and large all-gathers of 4-byte elements, run as one all_reduce of the whole
buffer: twice the bytes on the wire, a third of the time (``wire_bytes`` reports what is really
sent). The results are the same sums (an all-gather adds zeros to the other ranks' shards, which
is exact; a -0.0 becomes +0.0). NCCL (CUDA tensors) keeps the real collectives.

gloo runs each collective on one of its worker threads, and that thread drops its references to
the collective's tensors only after wait() has returned. Dropping the last reference to a tensor
that Python created takes the GIL; once the interpreter is finalizing, a thread that asks for the
GIL is ended by CPython, and ending a C++ thread that way aborts the process ("terminate called
without an active exception", SIGABRT) after correct results (issue #27, item 7: measured 2 aborts
in 60 runs of tests/scripts/engine_close_exit.py on the 2-core EPYC). So every collective on CPU
tensors hands the backend private aliases (``detach()``: same memory, a reference count of their
own) and returns, or lets its Work's wait() return, only once the backend has let go of them
(``_settle``): nothing of ours is left in flight, whatever the process does next.

A size-1 group never communicates. Without an initialised process group every call acts as a
size-1 group (single-process tools and tests). ``tests/test_collectives.py`` fails if code
outside this module calls a torch.distributed collective directly.
"""
from __future__ import annotations

import contextlib
import time
import warnings

import torch
import torch.distributed as dist

from zo_megatron.errors import ConfigError, UserError

__all__ = ["default_backend", "group_size", "group_rank", "all_reduce", "reduce_scatter", "all_gather",
           "all_gather_list", "barrier", "wait_all", "wire_bytes",
           "first_error", "all_ranks_agree"]

# torch >= 2.12 renamed the tensor forms; older torch (a cluster's CUDA build) has only the old names.
_reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
_devices_of_group: dict[int, frozenset[str]] = {}


class CollectiveTimeout(RuntimeError):
    """A host-side wait for a device collective's result timed out: a peer died or hung (its
    message says "timed out", so the training loop's lost-peer handling prints its one line)."""


_host_wait_timeout_s: float | None = None


def set_host_wait_timeout(seconds: float | None) -> None:
    """How long a host-side wait for a device collective (DeviceLayer) may last before it raises
    CollectiveTimeout; None: wait without limit. init_parallel sets it below the process group's
    timeout, so the wait ends before NCCL's watchdog tears the process down without a word."""
    global _host_wait_timeout_s
    _host_wait_timeout_s = seconds


def host_wait_timeout() -> float | None:
    return _host_wait_timeout_s


def default_backend(device: torch.device) -> str:
    """The backend map for a process group whose compute device is `device`."""
    return "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"


def _active() -> bool:
    return dist.is_available() and dist.is_initialized()


def group_size(group=None) -> int:
    return dist.get_world_size(group) if _active() else 1


def group_rank(group=None) -> int:
    return dist.get_rank(group) if _active() else 0


def _check_device(t: torch.Tensor, group) -> None:
    key = id(group)
    devices = _devices_of_group.get(key)
    if devices is None:
        config = dist.get_backend_config(group)     # e.g. "cpu:gloo,cuda:nccl"
        devices = frozenset(part.split(":")[0] for part in config.split(",") if ":" in part)
        _devices_of_group[key] = devices
    if devices and t.device.type not in devices:
        raise ConfigError(
            f"a collective on a {t.device.type} tensor was issued on a process group with backends "
            f"{dist.get_backend_config(group)!r}: initialise torch.distributed with "
            f"backend={default_backend(torch.device('cuda'))!r} (zo_megatron.parallel.init_parallel does)")


_gloo_types_of_group: dict[int, frozenset[str]] = {}


def _gloo_device_types(group) -> frozenset[str]:
    """The device types whose tensors this group hands to gloo: "cpu" always on our groups, "cuda"
    too where CUDA tensors go through gloo (two ranks sharing one GPU: `cpu:gloo,cuda:gloo`)."""
    key = id(group)
    types = _gloo_types_of_group.get(key)
    if types is None:
        config = dist.get_backend_config(group) if _active() else "gloo"
        parts = [p.split(":") for p in config.split(",")]
        if len(parts) == 1 and len(parts[0]) == 1:          # one backend for every device ("gloo")
            types = frozenset({"cpu", "cuda"}) if parts[0][0] == "gloo" else frozenset()
        else:
            types = frozenset(p[0] for p in parts if len(p) == 2 and p[1] == "gloo")
        _gloo_types_of_group[key] = types
    return types


def _aliases(*tensors: torch.Tensor, group=None) -> tuple[torch.Tensor, ...]:
    """What the backend gets: tensors gloo handles as private aliases to settle (module
    docstring), on the CPU and, where a group sends CUDA tensors through gloo, on the GPU too
    (issue 34, 2.6: the two-ranks-on-one-GPU test worlds); tensors NCCL handles as they are
    (NCCL's wait() only orders streams, so the host cannot wait for NCCL to let go without losing
    the overlap; destroy_process_group shuts NCCL down)."""
    gloo = _gloo_device_types(group)
    return tuple(t.detach() if t.device.type in gloo else t for t in tensors)


def _held_by_gloo(aliases, group) -> list:
    gloo = _gloo_device_types(group)
    return [a for a in aliases if a.device.type in gloo]


SETTLE_LIMIT_S = 30.0           # a backend that keeps references longer: warn once, stop settling
# Tensor._use_count (the TensorImpl's reference count) is private: a torch without it is not settled
_settling = hasattr(torch.Tensor, "_use_count")


def _settle(aliases) -> None:
    """Return once the backend holds no reference to `aliases` (each then has a count of one: ours).

    The GIL is released while waiting (time.sleep), which the worker may need to drop them."""
    global _settling
    start, delay = None, 1e-5
    for a in aliases:
        while _settling and a._use_count() > 1:
            if start is None:
                start = time.monotonic()
            elif time.monotonic() - start > SETTLE_LIMIT_S:
                _settling = False
                warnings.warn(f"the process group's backend still held a collective's tensor {SETTLE_LIMIT_S:.0f} s "
                              "after it completed; no longer waiting for it (an abort at exit becomes possible)",
                              RuntimeWarning, stacklevel=3)
                return
            time.sleep(delay)
            delay = min(2 * delay, 1e-3)


class _Settling:
    """An async collective's Work: wait() returns once it completed and the backend let go of its
    tensors (then its Work handle is dropped too: it also holds them)."""

    def __init__(self, work, aliases):
        self._work, self._aliases = work, aliases

    def wait(self) -> bool:
        if self._work is not None:
            self._work.wait()
            self._work = None
            _settle(self._aliases)
            self._aliases = ()
        return True


def _issue(fn, tensors, async_op: bool, **kwargs):
    """fn(*aliases of tensors, **kwargs): settled before it returns, or by its Work's wait()."""
    group = kwargs.get("group")
    aliases = _aliases(*tensors, group=group)
    work = fn(*aliases, async_op=async_op, **kwargs)
    held = _held_by_gloo(aliases, group)
    if not async_op:
        del work
        _settle(held)
        return None
    return _Settling(work, held)


def all_reduce(t: torch.Tensor, op: str = "sum", group=None) -> torch.Tensor:
    """In place over `group` (default: the whole world); returns `t`."""
    if group_size(group) > 1:
        _check_device(t, group)
        _issue(dist.all_reduce, (t,), False, op=_OPS[op], group=group)
    return t


def _flat_collective(fn, output: torch.Tensor, input: torch.Tensor, group, async_op: bool):
    """A size-1 group only copies (nothing when in place); otherwise `fn` on the group."""
    if group_size(group) == 1:
        if output.data_ptr() != input.data_ptr():
            output.copy_(input)
        return None
    _check_device(input, group)
    return _issue(fn, (output, input), async_op, group=group)


GLOO_ALL_REDUCE_MIN_NUMEL = 1 << 20     # below this gloo's own reduce_scatter/all_gather are as fast


def _as_all_reduce(kind: str, t: torch.Tensor) -> bool:
    """Whether this reduce_scatter / all_gather over gloo runs as one all_reduce (module docstring)."""
    if t.device.type != "cpu" or t.numel() < GLOO_ALL_REDUCE_MIN_NUMEL:
        return False
    return kind == "reduce_scatter" or t.element_size() >= 4


def wire_bytes(kind: str, full: torch.Tensor) -> int:
    """Bytes a ring sends for collective `kind` over the whole buffer `full` (the reduce-scatter's
    input, the all-gather's output): an all_reduce moves twice a reduce-scatter's or all-gather's."""
    nbytes = full.numel() * full.element_size()
    return 2 * nbytes if kind == "all_reduce" or _as_all_reduce(kind, full) else nbytes


class _ThenCopy:
    """A Work whose wait() also copies this rank's reduced shard to a separate output."""

    def __init__(self, work, dst: torch.Tensor, src: torch.Tensor):
        self._work, self._dst, self._src = work, dst, src

    def wait(self) -> bool:
        if self._work is not None:
            self._work.wait()
            self._dst.copy_(self._src)
            self._work = None
        return True


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, group, async_op: bool = False):
    """output (1/N of input) <- sum over ranks of this rank's shard of input.

    `output` may be this rank's own shard of `input` (in place, as NCCL allows); the rest of
    `input` is left undefined. With async_op=True returns a Work handle to wait() on (None when
    nothing was sent)."""
    if group_size(group) > 1 and _as_all_reduce("reduce_scatter", input):
        _check_device(input, group)
        work = _issue(dist.all_reduce, (input,), async_op, group=group)
        shard = input.narrow(0, group_rank(group) * output.numel(), output.numel())
        if shard.data_ptr() == output.data_ptr():
            return work
        if not async_op:
            output.copy_(shard)
            return None
        return _ThenCopy(work, output, shard)
    return _flat_collective(_reduce_scatter_tensor, output, input, group, async_op)


def all_gather(output: torch.Tensor, input: torch.Tensor, group, async_op: bool = False):
    """output (N x input) <- every rank's input, in rank order; `input` may be its own slot of
    `output` (in place). With async_op=True returns the Work handle (None when nothing was sent)."""
    if group_size(group) > 1 and _as_all_reduce("all_gather", output):
        _check_device(output, group)
        k, r = input.numel(), group_rank(group)
        own = output.narrow(0, r * k, k)
        if own.data_ptr() != input.data_ptr():
            own.copy_(input)
        output.narrow(0, 0, r * k).zero_()                  # the others' slots: zeros to add to
        output.narrow(0, (r + 1) * k, output.numel() - (r + 1) * k).zero_()
        return _issue(dist.all_reduce, (output,), async_op, group=group)
    return _flat_collective(_all_gather_tensor, output, input, group, async_op)


def all_gather_list(t: torch.Tensor, group) -> list[torch.Tensor]:
    """Every rank's `t` (same shape everywhere), in rank order."""
    n = group_size(group)
    if n == 1:
        return [t]
    _check_device(t, group)
    parts = [torch.empty_like(t) for _ in range(n)]
    src = _aliases(t.contiguous(), group=group)
    dist.all_gather(parts, src[0], group=group)
    _settle(_held_by_gloo(parts + list(src), group))
    return parts


def barrier(group=None) -> None:
    if group_size(group) > 1:
        dist.barrier(group=group)


def wait_all(works) -> None:
    """Wait for async Work handles (on CUDA: the current stream waits; the host does not block)."""
    for w in works:
        if w is not None:
            w.wait()


_MESSAGE_BYTES = 2048


def first_error(message: str | None, group=None) -> tuple[int, str] | None:
    """Every rank says "ok" (None) or why it failed; every rank gets the same answer: the lowest
    failing rank and its message (cut to 2 KiB), or None. One CPU all-gather, so that a check failing
    on rank 3 is not a silent exit there and a hang or "connection closed" everywhere else."""
    if group_size(group) == 1:
        return None if message is None else (0, message)
    raw = b"" if message is None else message.encode("utf-8", "replace")[:_MESSAGE_BYTES - 1]
    t = torch.zeros(_MESSAGE_BYTES + 1, dtype=torch.uint8)
    t[0] = message is not None
    t[1:1 + len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
    for rank, part in enumerate(all_gather_list(t, group)):
        if part[0]:
            return rank, bytes(part[1:].tolist()).rstrip(b"\0").decode("utf-8", "replace")
    return None


@contextlib.contextmanager
def all_ranks_agree(group=None):
    """Run per-rank checks; at the end of the block the ranks agree on the outcome before going on.

    If any rank failed, every rank raises the same `UserError("rank R: message")` (R the lowest
    failing rank), printed once as `error: ...` by rank 0 of `group` before the ranks leave (the
    exception carries `reported = True` so the CLI does not print it again). An unexpected exception keeps its traceback on
    the rank it happened on, and a CollectiveTimeout (a peer that stopped answering) leaves at once.
    The block must not issue collectives itself: a rank that failed early would never reach them --
    except another agreement over the same group, entered by every rank (the job's flush before a
    save holds DPU's agreed join): its outcome, which every rank raises, passes through unchanged."""
    message, original = None, None
    try:
        yield
    except CollectiveTimeout:
        raise                   # a peer stopped answering: agreeing would wait for it once more
    except Exception as exc:  # noqa: BLE001 - a bug on one rank must not leave the others hanging
        if getattr(exc, "_agreed_over", _NOT_AGREED) is group:
            raise               # an inner agreement's outcome: every rank of the group raises it now
        message = str(exc) if isinstance(exc, UserError) else \
            f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''} (traceback on that rank)"
        original = exc
    failed = first_error(message, group)
    if failed is None:
        return
    rank, text = failed
    if group_size(group) == 1:
        original._agreed_over = group
        raise original
    err = UserError(f"rank {rank}: {text}")
    err._agreed_over = group
    if group_rank(group) == 0:
        # Printed here, before the barrier: once a rank exits, launchers (torchrun, srun) kill the
        # others, and rank 0 might otherwise die before its line is out. The CLI does not repeat it.
        import sys

        print(f"error: {err}", file=sys.stderr, flush=True)
    err.reported = True
    barrier(group)
    if original is not None and not isinstance(original, UserError):
        original._agreed_over = group
        raise original
    raise err from None


_NOT_AGREED = object()      # (no group is this object: an exception no agreement has handled)
