"""The launch scripts of examples/: their pretrain_gpt.py command lines, their stated hardware and
the planner command their headers quote.

`launch(path, tmp)` runs the script itself with bash, its launcher (torchrun, mpirun, srun) replaced
by a stub on PATH that records its arguments, so every shell variable resolves as the script
resolves it (defaults, $((...)), arrays, "$@"). `hardware(path)` reads the header's "Hardware :"
line (GPU model and count, host memory per node). `planner_argv(path)` is the header's
"Planner : python tools/estimate_memory.py ..." command, continued over `#` lines ending in a
backslash.
"""
from __future__ import annotations

import os
import re
import shlex
import stat
import subprocess
from dataclasses import dataclass
from pathlib import Path

from zo_megatron import planner as P

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted(p for p in (ROOT / "examples").iterdir() if p.suffix in (".sh", ".sbatch"))
LAUNCHERS = ("torchrun", "mpirun", "srun")
ENTRY = "pretrain/pretrain_gpt.py"

# what torch.cuda.get_device_properties().total_memory reports, per GPU model named in a header
GPU_MEMORY = {"V100-32GB": P.HARDWARE_PRESETS["v100-32gb"]["gpu_memory_bytes"],
              "A100-80GB": P.HARDWARE_PRESETS["a100-80gb"]["gpu_memory_bytes"],
              "H100-80GB": P.HARDWARE_PRESETS["h100-80gb"]["gpu_memory_bytes"]}
UNITS = {"TiB": 2**40, "GiB": 2**30, "TB": 10**12, "GB": 10**9}


def header_lines(path: Path) -> list[str]:
    return [ln[1:].strip() for ln in path.read_text().splitlines() if ln.startswith("#") and not ln.startswith("#!")]


def sbatch_options(path: Path) -> dict[str, str]:
    """#SBATCH --key=value lines."""
    out = {}
    for ln in path.read_text().splitlines():
        m = re.match(r"#SBATCH\s+--([\w-]+)(?:=(\S+))?", ln)
        if m:
            out[m.group(1)] = m.group(2) or ""
    return out


@dataclass
class Launch:
    launcher: str           # torchrun | mpirun | srun
    launcher_argv: list[str]
    job_argv: list[str]     # pretrain_gpt.py's command line
    world_size: int
    ranks_per_node: int


def launches_pretrain(path: Path) -> bool:
    return ENTRY in path.read_text()


def launch(path: Path, tmp: Path, env: dict[str, str] | None = None, args: list[str] = ()) -> Launch:
    """Run the script with stub launchers (no process is started) and return what it launches."""
    bindir = tmp / "bin"
    bindir.mkdir(parents=True, exist_ok=True)
    out = tmp / "launched"
    for name in LAUNCHERS:
        stub = bindir / name
        stub.write_text(f'#!/usr/bin/env bash\nprintf "%s\\0" "{name}" "$@" > "{out}"\n')
        stub.chmod(stub.stat().st_mode | stat.S_IXUSR)
    sb = sbatch_options(path)
    full_env = {"PATH": f"{bindir}:{os.environ['PATH']}", "HOME": str(tmp), "ZO_ROOT": str(tmp)}
    if "nodes" in sb:                   # what SLURM sets in the allocation the script asks for
        full_env.update(SLURM_JOB_NUM_NODES=sb["nodes"], SLURM_NNODES=sb["nodes"])
    full_env.update(env or {})
    if out.exists():
        out.unlink()
    r = subprocess.run(["bash", str(path), *args], env=full_env, cwd=tmp, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0 and out.exists(), f"{path.name}: rc {r.returncode}: {r.stderr}"
    argv = out.read_bytes().decode().split("\0")[:-1]
    launcher, rest = argv[0], argv[1:]
    i = next(k for k, a in enumerate(rest) if a.endswith(ENTRY))
    job = rest[i + 1:]
    if launcher == "torchrun":
        per_node = int(_opt(rest[:i], "--nproc-per-node", "--nproc_per_node"))
        world = per_node * int(_opt(rest[:i], "--nnodes") or 1)
    elif launcher == "mpirun":
        world = int(_opt(rest[:i], "-np", "-n"))
        m = re.search(r"ppr:(\d+):node", " ".join(rest[:i]))
        per_node = int(m.group(1)) if m else world
    else:                               # srun inside the sbatch allocation
        per_node = int(sb["ntasks-per-node"])
        world = per_node * int(sb["nodes"])
    return Launch(launcher, rest[:i], job, world, per_node)


def _opt(argv: list[str], *names: str) -> str | None:
    for k, a in enumerate(argv):
        for n in names:
            if a == n:
                return argv[k + 1]
            if a.startswith(n + "="):
                return a.split("=", 1)[1]
    return None


@dataclass
class Hardware:
    gpu: str | None             # None: a CPU run (the device is the host)
    gpu_memory_bytes: int | None
    gpus_per_node: int | None
    host_memory_bytes_per_node: int


def hardware(path: Path) -> Hardware:
    """The header's "Hardware :" line: e.g. "1x DGX-2 = 16x V100-SXM3-32GB (NVSwitch), 1.5 TiB host
    RAM", "1x H100-80GB (or A100-80GB) and >= 192 GiB host RAM", "any ... machine with >= 2 cores and
    >= 4 GiB RAM" (no GPU: a CPU run). A DGX-2 is 16x V100-32GB with 1.5 TiB."""
    line = next(ln for ln in header_lines(path) if ln.startswith("Hardware"))
    text = line.split(":", 1)[1]
    host = re.search(r"([\d.]+)\s*(TiB|GiB|TB|GB)\s+(?:host\b|RAM\b)", text)
    gpu = re.search(r"(\d+)x\s+(?:NVIDIA\s+)?([AHV]100)[-\w]*?-(\d+)GB", text)
    if re.search(r"(?:\d+|NODES)\s*x\s+DGX-2", text):     # a DGX-2 node: 16x V100-32GB, 1.5 TiB
        assert gpu is None or (gpu.group(1), gpu.group(2), gpu.group(3)) == ("16", "V100", "32"), line
        assert host is None or int(float(host.group(1)) * UNITS[host.group(2)]) == 1536 * 2**30, line
        return Hardware("V100-32GB", GPU_MEMORY["V100-32GB"], 16, 1536 * 2**30)
    assert host, f"{path.name}: no host memory in {line!r}"
    host_bytes = int(float(host.group(1)) * UNITS[host.group(2)])
    if gpu is None:
        return Hardware(None, None, None, host_bytes)
    name = f"{gpu.group(2)}-{gpu.group(3)}GB"
    return Hardware(name, GPU_MEMORY[name], int(gpu.group(1)), host_bytes)


def planner_argv(path: Path) -> list[str]:
    """The arguments of the header's `python tools/estimate_memory.py ...` command."""
    lines = header_lines(path)
    start = next(i for i, ln in enumerate(lines) if ln.startswith("Planner") and "estimate_memory.py" in ln)
    cmd = lines[start].split(":", 1)[1].strip()
    i = start
    while cmd.endswith("\\"):
        i += 1
        cmd = cmd[:-1].strip() + " " + lines[i].strip()
    argv = shlex.split(cmd)
    return argv[argv.index("tools/estimate_memory.py") + 1:]
