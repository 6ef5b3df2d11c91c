"""Who am I, and where is the rendezvous? Launch-environment discovery for torchrun, MPI and SLURM.

Pure Python: this module imports neither torch nor megatron, and imports mpi4py only when an MPI
launch leaves MASTER_ADDR unset (so torchrun users never pay for it).

    env = discover_launch_env()          # collective under MPI without MASTER_ADDR: call on every rank
    export_torch_env(env)                # RANK, WORLD_SIZE, LOCAL_RANK, ... for init_method="env://"
    torch.distributed.init_process_group("nccl" or "gloo")

Precedence (the first launcher whose variables are present wins):

    torchrun  RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT
    openmpi   OMPI_COMM_WORLD_RANK/SIZE/LOCAL_RANK/LOCAL_SIZE
    mpich     PMI_RANK, PMI_SIZE, MPI_LOCALRANKID, MPI_LOCALNRANKS   (MPICH / Intel MPI hydra)
    slurm     SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, tasks-per-node, SLURM_JOB_NODELIST
    single    rank 0 of 1 on 127.0.0.1 and a free port

MASTER_ADDR / MASTER_PORT from the environment always win over what is derived here. See
docs/launch.md for the details of each launcher.
"""
from __future__ import annotations

import os
import re
import socket
import warnings
from dataclasses import dataclass
from typing import Mapping, MutableMapping

from zo_megatron.errors import ConfigError

__all__ = [
    "LaunchEnv",
    "discover_launch_env",
    "export_torch_env",
    "parse_slurm_nodelist",
    "parse_slurm_tasks_per_node",
    "slurm_master_port",
    "find_free_port",
    "default_cpu_adam_threads",
]

LAUNCHERS = ("torchrun", "openmpi", "mpich", "slurm", "single")
DEFAULT_MASTER_PORT = 29500  # torchrun's default; used when an address is given without a port
SLURM_PORT_BASE = 20000  # derived SLURM ports live in [20000, 30000): below Linux's ephemeral range
SLURM_PORT_SPAN = 10000

_MPI_HINT = ("set MASTER_ADDR/MASTER_PORT or pip install 'zo_megatron[mpi]' "
             "(mpi4py lets rank 0 broadcast its address and a free port)")


@dataclass(frozen=True)
class LaunchEnv:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    launcher: str  # one of LAUNCHERS

    def __post_init__(self):
        if self.launcher not in LAUNCHERS:
            raise ValueError(f"launcher must be one of {LAUNCHERS}, got {self.launcher!r}")
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is not in [0, world_size={self.world_size})")
        if self.local_world_size < 1:
            raise ValueError(f"local_world_size must be >= 1, got {self.local_world_size}")
        if not 0 <= self.local_rank < self.local_world_size:
            raise ValueError(f"local_rank {self.local_rank} is not in "
                             f"[0, local_world_size={self.local_world_size})")
        if not 0 < self.master_port < 65536:
            raise ValueError(f"master_port {self.master_port} is not a TCP port")
        if not self.master_addr:
            raise ValueError("master_addr is empty")


# ----------------------------------------------------------------------------------------------
# small parsing helpers (every error names the variable it came from)

def _get_int(env: Mapping[str, str], name: str, *, minimum: int = 0) -> int:
    raw = env[name]
    try:
        value = int(str(raw).strip())
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer") from None
    if value < minimum:
        raise ValueError(f"{name}={value} must be >= {minimum}")
    return value


def _require(env: Mapping[str, str], names: tuple[str, ...], launcher: str) -> None:
    missing = [n for n in names if n not in env]
    if missing:
        raise ValueError(f"{launcher} launch detected but {', '.join(missing)} "
                         f"{'is' if len(missing) == 1 else 'are'} not set")


def _check_pair(rank: int, size: int, rank_name: str, size_name: str) -> None:
    if rank >= size:
        raise ValueError(f"{rank_name}={rank} must be < {size_name}={size}")


def _port_from_env(env: Mapping[str, str]) -> int | None:
    if "MASTER_PORT" not in env or str(env["MASTER_PORT"]).strip() == "":
        return None
    port = _get_int(env, "MASTER_PORT", minimum=1)
    if port > 65535:
        raise ValueError(f"MASTER_PORT={port} is not a TCP port (1-65535)")
    return port


def _addr_from_env(env: Mapping[str, str]) -> str | None:
    addr = str(env.get("MASTER_ADDR", "")).strip()
    return addr or None


def find_free_port() -> int:
    """A TCP port that was free a moment ago (bind to port 0 and read it back)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _routable_host_address() -> str:
    """This host's address as other nodes should see it: a non-loopback IP if one is found,
    else the hostname (cluster DNS usually resolves it)."""
    hostname = socket.gethostname()
    try:
        ip = socket.gethostbyname(hostname)
        if not ip.startswith("127."):
            return ip
    except OSError:
        pass
    try:  # the interface the default route uses; connect() on UDP sends no packet
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.254.254.254", 1))
            ip = s.getsockname()[0]
            if ip and not ip.startswith("127.") and ip != "0.0.0.0":
                return ip
    except OSError:
        pass
    return hostname


# ----------------------------------------------------------------------------------------------
# SLURM helpers

def _split_top_level(text: str) -> list[str]:
    """Split on commas that are not inside [...]."""
    parts, depth, cur = [], 0, []
    for ch in text:
        if ch == "[":
            depth += 1
            if depth > 1:
                raise ValueError(f"nested '[' in SLURM host list {text!r}")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced ']' in SLURM host list {text!r}")
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if depth != 0:
        raise ValueError(f"unbalanced '[' in SLURM host list {text!r}")
    parts.append("".join(cur))
    return [p.strip() for p in parts if p.strip()]


def _expand_range_list(body: str, whole: str) -> list[str]:
    out = []
    for item in body.split(","):
        item = item.strip()
        if not item:
            raise ValueError(f"empty range in SLURM host list {whole!r}")
        if "-" in item:
            lo, hi = item.split("-", 1)
            if not (lo.isdigit() and hi.isdigit()):
                raise ValueError(f"bad range {item!r} in SLURM host list {whole!r}")
            if int(hi) < int(lo):
                raise ValueError(f"descending range {item!r} in SLURM host list {whole!r}")
            width = len(lo)  # "08-10" -> 08 09 10; "8-10" -> 8 9 10
            out.extend(str(i).zfill(width) for i in range(int(lo), int(hi) + 1))
        else:
            if not item.isdigit():
                raise ValueError(f"bad index {item!r} in SLURM host list {whole!r}")
            out.append(item)
    return out


def parse_slurm_nodelist(nodelist: str) -> list[str]:
    """Expand SLURM's compressed host list, keeping zero padding and SLURM's order.

    >>> parse_slurm_nodelist("node[01-03,07]")
    ['node01', 'node02', 'node03', 'node07']
    >>> parse_slurm_nodelist("rack[1-2]-n[1-2]")
    ['rack1-n1', 'rack1-n2', 'rack2-n1', 'rack2-n2']
    """
    hosts: list[str] = []
    for part in _split_top_level(nodelist.strip()):
        # alternate literal text and [...] groups; cartesian product, first group outermost
        pieces = re.split(r"(\[[^\]]*\])", part)
        expanded = [""]
        for piece in pieces:
            if piece.startswith("["):
                choices = _expand_range_list(piece[1:-1], nodelist)
            elif piece:
                if "]" in piece or "[" in piece:
                    raise ValueError(f"unbalanced brackets in SLURM host list {nodelist!r}")
                choices = [piece]
            else:
                continue
            expanded = [prefix + c for prefix in expanded for c in choices]
        hosts.extend(expanded)
    return hosts


def parse_slurm_tasks_per_node(value: str, name: str = "SLURM_TASKS_PER_NODE") -> list[int]:
    """'2(x3),1' -> [2, 2, 2, 1]; '16' -> [16]."""
    out: list[int] = []
    for item in str(value).split(","):
        item = item.strip()
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", item)
        if not m:
            raise ValueError(f"{name}={value!r} is not a SLURM tasks-per-node list like '2(x3),1'")
        count = int(m.group(1))
        repeat = int(m.group(2)) if m.group(2) else 1
        if count < 1 or repeat < 1:
            raise ValueError(f"{name}={value!r} has a zero entry")
        out.extend([count] * repeat)
    return out


def slurm_master_port(job_id: int) -> int:
    """Deterministic rendezvous port for a SLURM job: every task of the job derives the same one,
    two concurrent jobs on the same first node get different ones (unless their ids collide
    modulo 10000). Range [20000, 30000), below Linux's ephemeral ports (32768+)."""
    return SLURM_PORT_BASE + int(job_id) % SLURM_PORT_SPAN


# ----------------------------------------------------------------------------------------------
# per-launcher discovery

def _from_torchrun(env: Mapping[str, str]) -> LaunchEnv:
    _require(env, ("RANK", "WORLD_SIZE"), "torchrun (RANK/WORLD_SIZE)")
    world = _get_int(env, "WORLD_SIZE", minimum=1)
    rank = _get_int(env, "RANK")
    _check_pair(rank, world, "RANK", "WORLD_SIZE")
    local_world = _get_int(env, "LOCAL_WORLD_SIZE", minimum=1) if "LOCAL_WORLD_SIZE" in env else None
    local_rank = _get_int(env, "LOCAL_RANK") if "LOCAL_RANK" in env else None
    if local_world is None:
        if local_rank is not None and world > 1 and local_rank != rank:
            raise ValueError("LOCAL_RANK is set but LOCAL_WORLD_SIZE is not (multi-node launch?)")
        local_world = world
    if local_rank is None:
        local_rank = rank if local_world == world else None
        if local_rank is None:
            raise ValueError("LOCAL_WORLD_SIZE is set but LOCAL_RANK is not")
    _check_pair(local_rank, local_world, "LOCAL_RANK", "LOCAL_WORLD_SIZE")
    if local_world > world:
        raise ValueError(f"LOCAL_WORLD_SIZE={local_world} must be <= WORLD_SIZE={world}")
    addr, port = _addr_from_env(env), _port_from_env(env)
    if addr is None:
        if local_world != world:
            raise ValueError("MASTER_ADDR is not set for a multi-node RANK/WORLD_SIZE launch")
        addr = "127.0.0.1"
    if port is None:
        port = DEFAULT_MASTER_PORT if world > 1 else find_free_port()
    return LaunchEnv(rank, world, local_rank, local_world, addr, port, "torchrun")


def _mpi_comm(use_mpi: bool):
    if not use_mpi:
        raise RuntimeError("MPI launch detected without MASTER_ADDR/MASTER_PORT and use_mpi=False: "
                           + _MPI_HINT)
    try:
        from mpi4py import MPI  # lazy: initialises MPI
    except ImportError as exc:
        raise RuntimeError(f"MPI launch detected without MASTER_ADDR, and mpi4py is not "
                           f"importable ({exc}): {_MPI_HINT}") from None
    return MPI


def _mpi_rendezvous(env: Mapping[str, str], rank: int, world: int, local_world: int,
                    use_mpi: bool) -> tuple[str, int]:
    addr, port = _addr_from_env(env), _port_from_env(env)
    if addr is not None:
        return addr, port if port is not None else DEFAULT_MASTER_PORT
    if world == 1:
        return "127.0.0.1", port if port is not None else find_free_port()
    MPI = _mpi_comm(use_mpi)
    comm = MPI.COMM_WORLD
    if comm.Get_size() != world or comm.Get_rank() != rank:
        raise RuntimeError(f"mpi4py's COMM_WORLD (rank {comm.Get_rank()} of {comm.Get_size()}) "
                           f"disagrees with the launcher's variables (rank {rank} of {world})")
    payload = None
    # every rank here before rank 0 picks the port: a port picked free is bound only when the store
    # starts (init_process_group), and another process on the host may take it in between; the
    # barrier keeps that window to the broadcast, not to the slowest rank's start-up
    comm.Barrier()
    if rank == 0:
        # one node: loopback is always right; several: an address the other nodes can reach
        picked_addr = "127.0.0.1" if local_world == world else _routable_host_address()
        payload = (picked_addr, port if port is not None else find_free_port())
    addr, port = comm.bcast(payload, root=0)
    return addr, int(port)


def _from_openmpi(env: Mapping[str, str], use_mpi: bool) -> LaunchEnv:
    names = ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
             "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE")
    _require(env, names, "Open MPI")
    rank = _get_int(env, names[0])
    world = _get_int(env, names[1], minimum=1)
    local_rank = _get_int(env, names[2])
    local_world = _get_int(env, names[3], minimum=1)
    _check_pair(rank, world, names[0], names[1])
    _check_pair(local_rank, local_world, names[2], names[3])
    addr, port = _mpi_rendezvous(env, rank, world, local_world, use_mpi)
    return LaunchEnv(rank, world, local_rank, local_world, addr, port, "openmpi")


def _from_pmi(env: Mapping[str, str], use_mpi: bool) -> LaunchEnv:
    _require(env, ("PMI_RANK", "PMI_SIZE"), "MPICH/PMI")
    rank = _get_int(env, "PMI_RANK")
    world = _get_int(env, "PMI_SIZE", minimum=1)
    _check_pair(rank, world, "PMI_RANK", "PMI_SIZE")
    local = None
    if "SLURM_PROCID" in env and "SLURM_LOCALID" in env:
        # srun --mpi=pmi2: SLURM placed the tasks and knows the node-local rank; an MPI split can
        # disagree (or be unavailable), and a wrong local rank puts every rank on cuda:0.
        slurm = _from_slurm_local(env)
        if slurm[0] != rank or slurm[1] != world:
            raise ValueError(f"PMI_RANK={rank}/PMI_SIZE={world} disagree with SLURM's task {slurm[0]} of "
                             f"{slurm[1]}: launch with one launcher (srun --mpi=pmi2 sets both consistently)")
        local = (slurm[2], slurm[3], "SLURM_LOCALID", "tasks per node")
        for r_name, s_name in (("MPI_LOCALRANKID", "MPI_LOCALNRANKS"), ("PMI_LOCAL_RANK", "PMI_LOCAL_SIZE")):
            if r_name in env and s_name in env and (_get_int(env, r_name), _get_int(env, s_name)) != local[:2]:
                raise ValueError(f"{r_name}={env[r_name]}/{s_name}={env[s_name]} disagree with SLURM_LOCALID="
                                 f"{local[0]} of {local[1]} tasks on this node: check the srun/mpirun placement")
    for r_name, s_name in (("MPI_LOCALRANKID", "MPI_LOCALNRANKS"), ("PMI_LOCAL_RANK", "PMI_LOCAL_SIZE")):
        if local is not None:
            break
        if r_name in env and s_name in env:
            local = (_get_int(env, r_name), _get_int(env, s_name, minimum=1), r_name, s_name)
            break
    if local is None:
        if world == 1:
            local = (0, 1, "MPI_LOCALRANKID", "MPI_LOCALNRANKS")
        else:
            try:
                MPI = _mpi_comm(use_mpi)
            except RuntimeError:
                raise ValueError("MPI_LOCALRANKID/MPI_LOCALNRANKS are not set and mpi4py is not "
                                 "available to compute the node-local rank") from None
            node = MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED)
            local = (node.Get_rank(), node.Get_size(), "MPI_LOCALRANKID", "MPI_LOCALNRANKS")
            node.Free()
    local_rank, local_world, r_name, s_name = local
    _check_pair(local_rank, local_world, r_name, s_name)
    addr, port = _mpi_rendezvous(env, rank, world, local_world, use_mpi)
    return LaunchEnv(rank, world, local_rank, local_world, addr, port, "mpich")


def _slurm_local_world_size(env: Mapping[str, str], rank: int, world: int, nnodes: int) -> int:
    for name in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
        if env.get(name):
            counts = parse_slurm_tasks_per_node(env[name], name)
            if len(counts) == 1:
                return counts[0]
            if "SLURM_NODEID" in env:
                node = _get_int(env, "SLURM_NODEID")
                if node >= len(counts):
                    raise ValueError(f"SLURM_NODEID={node} is beyond {name}={env[name]!r}")
                return counts[node]
            acc = 0  # no node id: assume SLURM's default block distribution
            for c in counts:
                acc += c
                if rank < acc:
                    return c
            raise ValueError(f"SLURM_PROCID={rank} is beyond {name}={env[name]!r}")
    if env.get("SLURM_NTASKS_PER_NODE"):
        return _get_int(env, "SLURM_NTASKS_PER_NODE", minimum=1)
    if nnodes >= 1 and world % nnodes == 0:
        return world // nnodes
    raise ValueError("cannot tell tasks per node: set SLURM_TASKS_PER_NODE or SLURM_NTASKS_PER_NODE")


def _from_slurm_local(env: Mapping[str, str]) -> tuple[int, int, int, int]:
    """(rank, world, local rank, local world) as SLURM's variables state them."""
    size_name = "SLURM_STEP_NUM_TASKS" if "SLURM_STEP_NUM_TASKS" in env else "SLURM_NTASKS"
    _require(env, ("SLURM_PROCID", size_name, "SLURM_LOCALID"), "SLURM")
    rank, world = _get_int(env, "SLURM_PROCID"), _get_int(env, size_name, minimum=1)
    nodelist = next((env[n] for n in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
                     if env.get(n)), None)
    hosts = parse_slurm_nodelist(nodelist) if nodelist else []
    local_world = _slurm_local_world_size(env, rank, world, len(hosts))
    local_rank = _get_int(env, "SLURM_LOCALID")
    _check_pair(local_rank, local_world, "SLURM_LOCALID", "tasks per node")
    return rank, world, local_rank, local_world


def _from_slurm(env: Mapping[str, str]) -> LaunchEnv:
    size_name = "SLURM_STEP_NUM_TASKS" if "SLURM_STEP_NUM_TASKS" in env else "SLURM_NTASKS"
    _require(env, ("SLURM_PROCID", size_name), "SLURM")
    rank = _get_int(env, "SLURM_PROCID")
    world = _get_int(env, size_name, minimum=1)
    _check_pair(rank, world, "SLURM_PROCID", size_name)
    local_rank = _get_int(env, "SLURM_LOCALID") if "SLURM_LOCALID" in env else 0

    nodelist_name = next((n for n in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
                          if env.get(n)), None)
    hosts = parse_slurm_nodelist(env[nodelist_name]) if nodelist_name else []
    local_world = _slurm_local_world_size(env, rank, world, len(hosts))
    _check_pair(local_rank, local_world, "SLURM_LOCALID", "tasks per node")

    if world > 1 and "SLURM_STEP_ID" not in env and "SLURM_STEPID" not in env:
        warnings.warn(f"SLURM variables say {world} tasks, but this process was not started by "
                      "srun (no SLURM_STEP_ID): it will wait for peers that may never start. "
                      "Launch with srun, or unset SLURM_NTASKS for a single process.",
                      RuntimeWarning, stacklevel=3)

    addr = _addr_from_env(env)
    if addr is None:
        if not hosts:
            if local_world != world:
                raise ValueError("SLURM_JOB_NODELIST is not set and MASTER_ADDR is not set")
            addr = "127.0.0.1"
        else:
            addr = hosts[0]
    port = _port_from_env(env)
    if port is None:
        port = (slurm_master_port(_get_int(env, "SLURM_JOB_ID")) if env.get("SLURM_JOB_ID")
                else DEFAULT_MASTER_PORT)
    return LaunchEnv(rank, world, local_rank, local_world, addr, port, "slurm")


def discover_launch_env(environ: Mapping[str, str] | None = None, use_mpi: bool = True) -> LaunchEnv:
    """Rank, world size, node-local rank/size and rendezvous address of this process.

    Under Open MPI / MPICH with MASTER_ADDR unset this is a collective call: rank 0 picks its
    address and a free port and broadcasts them with mpi4py (every rank must call it).
    Raises ValueError (naming the variable) on inconsistent or non-integer values, and
    RuntimeError when an MPI launch needs mpi4py and it is missing (or use_mpi=False).
    """
    env = os.environ if environ is None else environ
    if "RANK" in env or "WORLD_SIZE" in env:
        return _from_torchrun(env)
    if "OMPI_COMM_WORLD_RANK" in env or "OMPI_COMM_WORLD_SIZE" in env:
        return _from_openmpi(env, use_mpi)
    if "PMI_RANK" in env or "PMI_SIZE" in env:
        return _from_pmi(env, use_mpi)
    if "SLURM_PROCID" in env:
        return _from_slurm(env)
    addr = _addr_from_env(env) or "127.0.0.1"
    port = _port_from_env(env)
    return LaunchEnv(0, 1, 0, 1, addr, port if port is not None else find_free_port(), "single")


def export_torch_env(env: LaunchEnv, environ: MutableMapping[str, str] | None = None) -> None:
    """Write the variables torch.distributed's env:// rendezvous reads (and torchrun would set)."""
    target = os.environ if environ is None else environ
    target["RANK"] = str(env.rank)
    target["WORLD_SIZE"] = str(env.world_size)
    target["LOCAL_RANK"] = str(env.local_rank)
    target["LOCAL_WORLD_SIZE"] = str(env.local_world_size)
    target["MASTER_ADDR"] = env.master_addr
    target["MASTER_PORT"] = str(env.master_port)


# ----------------------------------------------------------------------------------------------
# CPU Adam threads

def _first_int(raw: str, name: str) -> int:
    # OMP_NUM_THREADS may be a nested list "8,2": the outer level is what a parallel region gets
    head = str(raw).split(",")[0].strip()
    try:
        value = int(head)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not an integer: set it to a thread count or unset it") from None
    if value < 1:
        raise ConfigError(f"{name}={raw!r} must be >= 1: set it to a thread count or unset it")
    return value


def _available_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def _parse_cpu_list(text: str) -> int:
    """'0-3,8-11' -> 8."""
    count = 0
    for item in text.strip().split(","):
        item = item.strip()
        if not item:
            continue
        if "-" in item:
            lo, hi = item.split("-", 1)
            count += int(hi) - int(lo) + 1
        else:
            count += 1
    return count


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _cgroup_cpus() -> int | None:
    """CPUs the cgroup of this process may use (cpuset, capped by a CFS quota), or None if unknown.

    This is the pool every rank of a container / SLURM step shares, as opposed to one rank's
    affinity mask. cgroup v2 and v1 layouts; None when nothing can be read."""
    lines = _read("/proc/self/cgroup")
    if not lines:
        return None
    cpus: int | None = None
    quota: float | None = None
    for line in lines.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        path = path.strip() or "/"
        if controllers == "":  # cgroup v2 (unified)
            for base in ("/sys/fs/cgroup", "/sys/fs/cgroup/unified"):
                text = _read(f"{base}{path.rstrip('/')}/cpuset.cpus.effective")
                if text and cpus is None:
                    cpus = _parse_cpu_list(text)
                mx = _read(f"{base}{path.rstrip('/')}/cpu.max")
                if mx and quota is None:
                    q, _, period = mx.partition(" ")
                    if q != "max" and period:
                        quota = int(q) / int(period)
        names = controllers.split(",")
        if "cpuset" in names and cpus is None:
            for fname in ("cpuset.effective_cpus", "cpuset.cpus"):
                text = _read(f"/sys/fs/cgroup/cpuset{path.rstrip('/')}/{fname}")
                if text:
                    cpus = _parse_cpu_list(text)
                    break
        if "cpu" in names and quota is None:
            for base in ("/sys/fs/cgroup/cpu", "/sys/fs/cgroup/cpu,cpuacct"):
                q = _read(f"{base}{path.rstrip('/')}/cpu.cfs_quota_us")
                period = _read(f"{base}{path.rstrip('/')}/cpu.cfs_period_us")
                if q and period and int(q) > 0:
                    quota = int(q) / int(period)
                    break
    if quota is not None:
        q = max(1, int(quota + 0.999))
        cpus = q if cpus is None else min(cpus, q)
    return cpus


def default_cpu_adam_threads(local_world_size: int, environ: Mapping[str, str] | None = None, *,
                             available_cpus: int | None = None, node_cpus: int | None = None) -> int:
    """OpenMP threads for this rank's CPU Adam, so the node's ranks do not oversubscribe its cores.

    1. ZO_CPU_ADAM_THREADS, if set, is used as given.
    2. OMP_NUM_THREADS, if set, is respected (capped at the cores this rank may run on) - except
       the OMP_NUM_THREADS=1 that torchrun exports by default for nproc-per-node > 1 (detected by
       TORCHELASTIC_RUN_ID), which would leave a DGX-2's CPU Adam on 16 of 96 threads; export
       ZO_CPU_ADAM_THREADS=1 to really ask for one thread.
    3. SLURM_CPUS_PER_TASK, if set: SLURM gave each task that many cores.
    4. Otherwise min(cores in this rank's affinity mask, cores shared by all local ranks //
       local_world_size), >= 1. The shared pool is the cgroup's cpuset (capped by a CFS quota) or
       os.cpu_count(). So ranks sharing one mask split it evenly, and ranks the launcher bound
       to their own cores (mpirun --map-by ...:PE=n, srun --cpu-bind=cores) use their own slice.

    available_cpus / node_cpus override the measured affinity size / shared pool (for tests).
    """
    if local_world_size < 1:
        raise ValueError(f"local_world_size must be >= 1, got {local_world_size}")
    env = os.environ if environ is None else environ
    avail = max(1, available_cpus if available_cpus is not None else _available_cpus())

    if env.get("ZO_CPU_ADAM_THREADS", "").strip():
        return _first_int(env["ZO_CPU_ADAM_THREADS"], "ZO_CPU_ADAM_THREADS")
    if env.get("OMP_NUM_THREADS", "").strip():
        omp = _first_int(env["OMP_NUM_THREADS"], "OMP_NUM_THREADS")
        torchrun_default = omp == 1 and "TORCHELASTIC_RUN_ID" in env and local_world_size > 1
        if not torchrun_default:
            return max(1, min(omp, avail))
    if env.get("SLURM_CPUS_PER_TASK", "").strip():
        return max(1, min(_first_int(env["SLURM_CPUS_PER_TASK"], "SLURM_CPUS_PER_TASK"), avail))
    if node_cpus is None:
        node_cpus = _cgroup_cpus() or os.cpu_count() or avail
    pool = max(node_cpus, 1)
    return max(1, min(avail, pool // local_world_size))


# ----------------------------------------------------------------------------------------------
# host memory the job may use

_NO_LIMIT = 1 << 60   # cgroup v1 reports "no limit" as a huge page-rounded number


def _cgroup_memory_limit(root: str = "/") -> int | None:
    """The memory limit of this process's cgroup (v2 memory.max, v1 memory.limit_in_bytes), or
    None when there is none or nothing can be read. Walks up the hierarchy: a parent's limit
    binds too (SLURM puts the job's limit on the job cgroup, the step is below it)."""
    lines = _read(os.path.join(root, "proc/self/cgroup"))
    if not lines:
        return None
    limits = []
    for line in lines.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        path = path.strip().rstrip("/") or ""
        if controllers == "":
            bases, fname = ("sys/fs/cgroup", "sys/fs/cgroup/unified"), "memory.max"
        elif "memory" in controllers.split(","):
            bases, fname = ("sys/fs/cgroup/memory",), "memory.limit_in_bytes"
        else:
            continue
        for base in bases:
            p = path
            while True:
                text = _read(os.path.join(root, base + p, fname))
                if text and text != "max" and text.isdigit() and int(text) < _NO_LIMIT:
                    limits.append(int(text))
                if not p:
                    break
                p = p.rsplit("/", 1)[0]
    return min(limits) if limits else None


def _slurm_memory_limit(env: Mapping[str, str]) -> int | None:
    """srun/sbatch --mem (SLURM_MEM_PER_NODE, MiB) or --mem-per-cpu (SLURM_MEM_PER_CPU, MiB, times
    the CPUs of this node: SLURM_CPUS_ON_NODE) in bytes; None when neither is set."""
    if env.get("SLURM_MEM_PER_NODE", "").strip():
        mb = int(env["SLURM_MEM_PER_NODE"].strip().rstrip("M"))
        return mb * 1024 ** 2 if mb > 0 else None      # --mem=0 means "all of the node"
    if env.get("SLURM_MEM_PER_CPU", "").strip():
        cpus = env.get("SLURM_CPUS_ON_NODE", "").strip()
        n = _first_int(cpus, "SLURM_CPUS_ON_NODE") if cpus else 1
        return int(env["SLURM_MEM_PER_CPU"].strip().rstrip("M")) * 1024 ** 2 * n
    return None


def memory_limit_bytes(environ: Mapping[str, str] | None = None, *, root: str = "/",
                       physical_bytes: int | None = None) -> int:
    """Host memory this node's ranks may use together: the smallest of physical RAM, the cgroup
    limit (containers, SLURM's cgroup plugin) and SLURM's --mem / --mem-per-cpu. `root` and
    `physical_bytes` are for tests (a fake /proc and /sys tree)."""
    env = os.environ if environ is None else environ
    if physical_bytes is None:
        physical_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    limits = [physical_bytes, _cgroup_memory_limit(root), _slurm_memory_limit(env)]
    return min(v for v in limits if v is not None)
