"""One job per save directory: SAVE/zo_megatron.lock names the job that writes there.

Two jobs with the same --save would interleave their checkpoints (and race on `latest`). The lock
is a JSON file created atomically (O_EXCL) by global rank 0 once every check has passed; it holds
the holder's host, pid, the pid's start time (so a reused pid is not mistaken for the holder) and
the job's start time. It is removed when the job ends. A lock whose holder is a dead process on
THIS host is stale and taken over (a crashed or killed job); a holder on another host cannot be
checked from here, so taking it over needs --force-save-lock.
"""
from __future__ import annotations

import json
import os
import socket
import time

from zo_megatron.errors import UserError

LOCK = "zo_megatron.lock"


def _proc_start(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (/proc/PID/stat field 22); None off Linux."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _alive(pid: int, start: str | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass                                # exists, owned by someone else
    now = _proc_start(pid)
    return start is None or now is None or now == start


def _read(path: str) -> dict | None:
    try:
        with open(path) as f:
            info = json.load(f)
        return info if isinstance(info, dict) else {}
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}                           # unreadable: treated as another job's


def _describe(info: dict) -> str:
    started = info.get("started")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)) if isinstance(started, (int, float)) else "?"
    return f"pid {info.get('pid', '?')} on host {info.get('host', '?')}, started {when}"


def check_save_lock(save: str, force: bool) -> str | None:
    """Refuse (UserError) when another live job holds SAVE's lock; returns a note when a stale lock
    will be taken over, else None. Reads only: nothing is written here."""
    path = os.path.join(save, LOCK)
    info = _read(path)
    if info is None:
        return None
    host = socket.gethostname()
    pid = info.get("pid")
    if info.get("host") == host and isinstance(pid, int) and (pid == os.getpid() or not _alive(pid, info.get("pid_start"))):
        # (this very process: a job it ran before ended without its release, e.g. a test harness)
        return f"taking over the stale lock {path} of a job that is gone ({_describe(info)})"
    if force:
        return f"taking over the lock {path} held by {_describe(info)} (--force-save-lock)"
    where = "this host" if info.get("host") == host else "another host: this job cannot see whether it still runs"
    raise UserError(f"--save {save} is in use by another job ({_describe(info)}; {where}): two jobs saving to one "
                    f"directory would interleave their checkpoints; use another --save, wait for it, or pass "
                    f"--force-save-lock if that job is gone")


class SaveLock:
    """Hold SAVE's lock (rank 0) for the job's life."""

    def __init__(self, save: str, force: bool):
        self.path = os.path.join(save, LOCK)
        self.created_dir = not os.path.exists(save)
        self.save = save
        os.makedirs(save, exist_ok=True)
        me = {"host": socket.gethostname(), "pid": os.getpid(), "pid_start": _proc_start(os.getpid()),
              "started": time.time()}
        check_save_lock(save, force)        # again, now: the other job may have started meanwhile
        if os.path.exists(self.path):       # stale or forced (check_save_lock refused the rest)
            os.remove(self.path)
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            raise UserError(f"--save {save} was locked by another job that started at the same moment "
                            f"({_describe(_read(self.path) or {})}): use another --save") from None
        with os.fdopen(fd, "w") as f:
            json.dump(me, f)
        self.me = me

    def release(self, *, wrote_checkpoint: bool = True) -> None:
        info = _read(self.path)
        if info and info.get("pid") == self.me["pid"] and info.get("host") == self.me["host"]:
            os.remove(self.path)
        if self.created_dir and not wrote_checkpoint:
            try:
                os.rmdir(self.save)         # only if empty: a failed run leaves no empty directory
            except OSError:
                pass
