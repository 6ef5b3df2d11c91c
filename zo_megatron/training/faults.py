"""What the job does when things go wrong at run time: a signal, a lost peer, a run of bad steps.

- Signals (`--exit-signal-handler`, Megatron's name; on by default with `--save`). The first
  SIGTERM/SIGINT only sets a flag: SLURM's preemption sends SIGTERM and SIGKILL after a grace
  period. At the next iteration boundary the ranks agree on the flag with one small all-reduce,
  so a signal that reached only some ranks still stops all of them. They save a checkpoint and
  exit 0. A second signal exits at once.
- Lost peers. A collective that fails because a peer died or timed out
  (`--distributed-timeout-minutes`) ends the rank: it prints one line (rank, iteration, the
  error) and exits 1 without tearing down the process groups, which could block on the dead peer.
- Runs of skipped steps. With a NaN/inf loss or gradient, every rank skips the step (the engine's
  overflow rule). `--max-skipped-iters K` consecutive skips stop the run. With fp16 only skips at
  the minimum loss scale count, because the dynamic scaler legitimately skips while it searches
  for its scale.
- Test hooks (ZO_FAULT_INJECT; off unless the variable is set): `nan@R:I,J` multiplies rank R's
  loss by NaN in iterations I and J; `kill@R:I` SIGKILLs rank R at the start of iteration I;
  `term@R:I` sends rank R a SIGTERM there; `enospc@R:I` makes every fsync of rank R's checkpoint
  save at iteration I fail with "No space left on device". Several faults: separated by `;`.
- A checkpoint save that fails (disk full, I/O error) stops the run with one line naming the
  directory and the error; the previous checkpoint stays `latest` (saves are atomic).
"""
from __future__ import annotations

import contextlib
import errno
import os
import signal
import sys

import torch
import torch.distributed as dist

from zo_megatron.parallel import collectives

# What a collective says when a peer is gone or silent: gloo's "Connection closed by peer" /
# "Connection reset by peer" / "Timed out waiting ... for recv", NCCL's watchdog timeout
# ("... ran for N milliseconds before timing out"), ncclRemoteError ("remote process exited or
# there was a network error") and a communicator aborted after one of those.
_PEER_MARKERS = ("connection closed", "connection reset", "connection refused", "broken pipe", "timed out",
                 "timeout", "remote process exited", "ncclremoteerror", "network error",
                 "communicator was aborted", "socket closed")
# What says the error is this rank's own, whatever else the message mentions: NCCL's usage and
# argument errors, CUDA errors and memory exhaustion keep their type and traceback.
_OWN_ERROR_MARKERS = ("invalid usage", "ncclinvalidusage", "invalid argument", "ncclinvalidargument",
                      "out of memory", "unhandled cuda error", "cuda error", "illegal memory access")


# torch.OutOfMemoryError is the newer name; torch.cuda.OutOfMemoryError is the same class there
_OUT_OF_MEMORY = tuple({getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError), torch.cuda.OutOfMemoryError})


def is_lost_peer(exc: BaseException) -> bool:
    """A collective failed because another rank is gone or never answered -- not because this
    rank misused it or ran out of memory (those are bugs or resource errors: they keep their
    message, type and traceback, even when the message names NCCL or gloo)."""
    if isinstance(exc, _OUT_OF_MEMORY):
        return False
    if isinstance(exc, (getattr(dist, "DistNetworkError", ()), getattr(dist, "DistStoreError", ()))):
        return True                        # the transport or the rendezvous store lost a peer
    if not isinstance(exc, RuntimeError):   # DistBackendError and gloo's plain RuntimeError: read them
        return False
    msg = str(exc).lower()
    if any(m in msg for m in _OWN_ERROR_MARKERS):
        return False
    return any(m in msg for m in _PEER_MARKERS)


def exit_lost_peer(exc: BaseException, rank: int, iteration: int, timeout_min: float) -> None:
    """Print one line and leave now: destroying the groups could wait for the dead peer."""
    first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
    from zo_megatron.errors import report_error

    report_error(f"rank {rank} lost contact with its peers in a collective during iteration {iteration + 1} "
                 f"(last completed iteration {iteration}; timeout {timeout_min:g} min): {first}. Another rank or "
                 "node died or hung; resume from the last checkpoint with --load")
    sys.stdout.flush()
    os._exit(1)


class SaveFailed(Exception):
    """A checkpoint could not be written: `message` is the one line to print; `everywhere` when
    every rank got the failure (DCP gathers write results), so one rank prints it."""

    def __init__(self, everywhere: bool, message: str):
        super().__init__(message)
        self.everywhere, self.message = everywhere, message


class StopSignal:
    """SIGTERM/SIGINT -> stop at the next iteration boundary, agreed by every rank."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.received = 0
        self._previous = {}
        if enabled:
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        if self.received:                   # the second signal: leave at once
            os._exit(128 + signum)
        self.received = signum

    def agreed(self) -> int:
        """The signal some rank received (0: none); one all-reduce over the world."""
        flag = torch.tensor([self.received], dtype=torch.int64)
        collectives.all_reduce(flag, "max")
        return int(flag.item())

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}


class FaultInjection:
    """Test hooks from ZO_FAULT_INJECT (see the module docstring); inert when unset."""

    def __init__(self, spec: str, rank: int):
        self.nan_iters: set[int] = set()
        self.kill_iter: int | None = None
        self.term_iter: int | None = None
        self.enospc_iters: set[int] = set()
        for part in filter(None, (p.strip() for p in spec.split(";"))):
            kind, _, rest = part.partition("@")
            who, _, iters = rest.partition(":")
            if int(who) != rank:
                continue
            its = {int(i) for i in iters.split(",") if i}
            if kind == "nan":
                self.nan_iters |= its
            elif kind == "kill":
                self.kill_iter = min(its)
            elif kind == "term":
                self.term_iter = min(its)
            elif kind == "enospc":
                self.enospc_iters |= its
            else:
                raise ValueError(f"ZO_FAULT_INJECT: unknown fault {kind!r}")

    @classmethod
    def from_env(cls, rank: int) -> "FaultInjection":
        return cls(os.environ.get("ZO_FAULT_INJECT", ""), rank)

    def at_iteration_start(self, iteration: int) -> None:
        if self.kill_iter == iteration:
            os.kill(os.getpid(), signal.SIGKILL)
        if self.term_iter == iteration:
            os.kill(os.getpid(), signal.SIGTERM)

    @contextlib.contextmanager
    def saving(self, iteration: int):
        """Around a checkpoint save: with `enospc` at this iteration, every fsync fails."""
        if iteration not in self.enospc_iters:
            yield
            return
        real = os.fsync

        def full(fd):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        os.fsync = full
        try:
            yield
        finally:
            os.fsync = real

    def loss(self, iteration: int, loss: torch.Tensor) -> torch.Tensor:
        return loss * float("nan") if iteration in self.nan_iters else loss
