"""Run a function on a local gloo world of N ranks, with a timeout so a hang fails fast.

Ranks are started through a forkserver that has already imported torch and megatron-core, so each
world costs a fork, not a fresh ~5 s import per rank (and no OpenMP state is inherited from the
test process). With CUDA available ranks are spawned instead (CUDA and fork do not mix). `fn` must be a module-level function: it receives the rank and the extra args, and
its return value (picklable) comes back in rank order. An exception on any rank fails the test
with that rank's traceback.
"""
from __future__ import annotations

import io
import multiprocessing as mp
import os
import queue
import shutil
import socket
import tempfile
import time
import traceback

import torch

_CTX = None


def _context():
    global _CTX
    if _CTX is None:
        if torch.cuda.is_available():
            # CUDA must not be touched in a parent that forks: fresh interpreters for GPU worlds.
            _CTX = mp.get_context("spawn")
        else:
            _CTX = mp.get_context("forkserver")
            _CTX.set_forkserver_preload(["torch", "megatron.core.parallel_state", "zo_megatron.model.gpt"])
    return _CTX


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PortTaken(Exception):
    """A launch whose rendezvous port another process took between its pick and the store's bind
    (EADDRINUSE: no rank has started its work)."""


def on_a_fresh_port(launch, attempts: int = 3):
    """launch(port) on a port picked now; where it raises PortTaken it is started again on
    another, up to attempts times in all (the launchers' processes bind the port seconds after
    the pick: their imports)."""
    for attempt in range(attempts):
        try:
            return launch(free_port())
        except PortTaken:
            if attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")


_ports_taken = 0                    # next_port() calls in this rank (every rank calls it in one order)


def next_port(timeout: float = 120.0) -> int:
    """MASTER_PORT for this world's next process group, chosen by rank 0 just before use and read by
    the other ranks from a file of the world's own directory. A world that runs several jobs one
    after another must not take their ports when the test starts: minutes later another test's
    world may have bound one, and the ranks then join that world's store (a chance failure seen in
    test_checkpoint_resume: "Gloo connectFullMesh failed ... Connection refused")."""
    global _ports_taken
    _ports_taken += 1
    path = os.path.join(os.environ["ZO_TEST_PORT_DIR"], f"port.{_ports_taken}")
    if os.environ["RANK"] == "0":
        with open(path + ".tmp", "w") as f:
            f.write(str(free_port()))
        os.replace(path + ".tmp", path)
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank 0 published no port {_ports_taken} in {timeout:.0f} s")
        time.sleep(0.02)
    with open(path) as f:
        os.environ["MASTER_PORT"] = f.read()
    return int(os.environ["MASTER_PORT"])


def _worker(fn, rank, world_size, port, threads, results, args, kwargs, port_dir):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      ZO_CPU_ADAM_THREADS=str(threads), ZO_TEST_PORT_DIR=port_dir)
    import torch

    torch.set_num_threads(threads)
    try:
        out = fn(rank, *args, **kwargs)
        # Serialise here: tensors sent through the queue as shared fds die with this process.
        buf = io.BytesIO()
        torch.save(out, buf)
        results.put((rank, True, buf.getvalue()))
    except BaseException:  # noqa: BLE001 - report every failure to the parent
        results.put((rank, False, traceback.format_exc()))
    finally:
        try:
            from zo_megatron.parallel import destroy_parallel

            destroy_parallel()
        except Exception:  # noqa: BLE001
            pass


def run_world(fn, world_size: int, *args, timeout: float = 180.0, **kwargs) -> list:
    """Run `fn` on every rank; a world whose rendezvous port was taken by another process between
    free_port() and the store's bind (EADDRINUSE: no rank has started its work) is run again on a
    fresh port, up to twice."""
    for attempt in range(3):
        try:
            return _run_world_once(fn, world_size, args, kwargs, timeout)
        except AssertionError as exc:
            if "EADDRINUSE" not in str(exc) or attempt == 2:
                raise
    raise AssertionError("unreachable")


def _run_world_once(fn, world_size: int, args: tuple, kwargs: dict, timeout: float) -> list:
    ctx = _context()
    results = ctx.Queue()
    port = free_port()
    threads = max(1, (os.cpu_count() or 2) // world_size)
    port_dir = tempfile.mkdtemp(prefix="zo_ports_")             # next_port()'s files
    procs = [ctx.Process(target=_worker, args=(fn, r, world_size, port, threads, results, args, kwargs, port_dir),
                         daemon=True) for r in range(world_size)]
    for p in procs:
        p.start()
    outs: dict[int, object] = {}
    errors = []
    try:
        deadline = time.monotonic() + timeout
        for _ in range(world_size):
            while True:
                try:
                    rank, ok, val = results.get(timeout=1.0)
                    break
                except queue.Empty:
                    dead = [p.exitcode for p in procs if not p.is_alive() and p.exitcode not in (0, None)]
                    if dead:
                        raise AssertionError(f"a rank died with exit code {dead[0]} before reporting") from None
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"gloo world of {world_size} timed out after {timeout:.0f}s "
                                           f"(ranks done: {sorted(outs)})") from None
            if ok:
                outs[rank] = torch.load(io.BytesIO(val), weights_only=True)
            else:
                errors.append(f"--- rank {rank} ---\n{val}")
                # Other ranks may now hang in a collective: fail fast, but give the rank that
                # failed first (its peers often only report "connection closed") a moment to report.
                grace = time.monotonic() + 5.0
                while time.monotonic() < grace and len(errors) + len(outs) < world_size:
                    try:
                        r2, ok2, val2 = results.get(timeout=0.5)
                    except queue.Empty:
                        dead = [(i, p.exitcode) for i, p in enumerate(procs) if p.exitcode not in (0, None)]
                        if dead and len(dead) + len(errors) + len(outs) >= world_size:
                            break
                        continue
                    if not ok2:
                        errors.append(f"--- rank {r2} ---\n{val2}")
                dead = [f"rank {i} exit code {p.exitcode}" for i, p in enumerate(procs) if p.exitcode not in (0, None)]
                if dead:
                    errors.append("--- exited: " + ", ".join(dead))
                break
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
        shutil.rmtree(port_dir, ignore_errors=True)
    if errors:
        raise AssertionError("rank failed:\n" + "\n".join(errors))
    return [outs[r] for r in range(world_size)]


def built_once(tmp_path_factory, name: str, build):
    """`build(directory)` run once per test session and shared by every pytest-xdist worker: the
    first worker to ask builds it under a lock (xdist's recipe: the workers' base temp directories
    share a parent), the others wait and read its result (anything run_world can return) and files.
    For an expensive module fixture whose tests xdist spreads over both workers. Returns (result,
    the directory build wrote to)."""
    import fcntl

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    directory, done = root / f"once_{name}", root / f"once_{name}.pt"
    with open(root / f"once_{name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if not done.exists():
                directory.mkdir(exist_ok=True)
                buf = io.BytesIO()
                torch.save(build(directory), buf)
                tmp = done.with_suffix(".tmp")
                tmp.write_bytes(buf.getvalue())
                os.replace(tmp, done)
            return torch.load(io.BytesIO(done.read_bytes()), weights_only=True), directory
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
