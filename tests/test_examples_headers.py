"""The memory figures in the headers of examples/ are what the planner says today.

Each example's header names the planner command it was computed with ("Planner  : python
tools/estimate_memory.py ...", continued over `#` lines ending in a backslash) and quotes its two
totals (device per GPU and host per node, in GiB, two decimals). The command is re-run here
in-process through the tool's job_plan: the job's resolutions included (--optimizer-offload-fraction
auto, the CPU-step overlap's default `auto` on a GPU), so the host total holds the overlap's
rollback state as the job plans it; a planner change that moves a total fails this test until the
header is updated. (tests/test_examples_fit.py checks that the command is the script's own.)
"""
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted(p for p in (ROOT / "examples").iterdir() if p.suffix in (".sh", ".sbatch"))
# (device total, host total) as each header words them
_DEVICE = re.compile(r'(?:device per GPU :|"device" per rank :|device) ([\d,]+\.\d\d) GiB')
_HOST = re.compile(r"(?:host per node  :|host per machine  :|host) ([\d,]+\.\d\d) GiB")


def _header(path: Path) -> tuple[list[str], str]:
    """(the header's planner command's arguments, the header's text)."""
    from tests import example_scripts as X

    return X.planner_argv(path), "\n".join(X.header_lines(path))


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_header_totals_are_the_planners(path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("estimate_memory", ROOT / "tools" / "estimate_memory.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    from zo_megatron import planner as P

    argv, text = _header(path)
    p, _ = tool.job_plan(tool.build_parser().parse_args(argv))
    device, host = _DEVICE.search(text), _HOST.search(text)
    assert device and host, f"{path.name}: no device/host totals in the header"
    assert float(device.group(1).replace(",", "")) == round(p.device_bytes_per_gpu / P.GiB, 2), \
        (path.name, device.group(1), p.device_bytes_per_gpu / P.GiB)
    assert float(host.group(1).replace(",", "")) == round(p.host_bytes_per_node / P.GiB, 2), \
        (path.name, host.group(1), p.host_bytes_per_node / P.GiB)
