"""CUDA_DEVICE_MAX_CONNECTIONS=1 at TP > 1 is set before anything can start CUDA (issue 34, section 2).

CUDA reads the variable once, when it initialises. The job set it after parsing its flags, and
parsing calls torch.cuda.is_available() (cpu_precision.default_precision), so on a GPU it could come
too late. pretrain_gpt.py's main() now sets it first, from the raw command line
(training/cuda_connections.py); checked here in a fresh process that records the environment at
the first call into CUDA.
"""
import json
import os
import random
import subprocess
import sys

import pytest

from tests.seeds import fresh_seed
from zo_megatron.training.cuda_connections import set_cuda_device_max_connections, tensor_parallel_from_argv

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("argv,tp", [
    ([], 1),
    (["--tensor-parallel", "2"], 2),
    (["--tensor-parallel=4"], 4),
    (["--tensor-model-parallel-size", "8", "--zero-offload"], 8),
    (["--zero-offload", "--tensor-model-parallel-size=16"], 16),
    (["--tensor-parallel", "2", "--tensor-model-parallel-size", "1"], 1),      # the last one wins, as in argparse
    (["--tensor-parallel", "1"], 1),
    (["--tensor-parallel", "two"], 1),                  # argparse reports it
    (["--tensor-parallel"], 1),
    (["--tensor-parallel-size", "2"], 1),               # not a spelling arguments.py accepts
    (["--tensor-para", "2"], 1),                        # no abbreviations (allow_abbrev=False)
    (["--model-parallel-size", "2"], 1),                # Megatron's old name is refused by the parser
    (["--lr", "2", "--", "--tensor-parallel", "2"], 1),
])
def test_tensor_parallel_from_argv(argv, tp):
    assert tensor_parallel_from_argv(argv) == tp


def test_the_argv_spellings_are_the_parsers(monkeypatch):
    """Every spelling the scanner reads is one the parser takes for the TP size, with either form."""
    from zo_megatron.training.arguments import build_parser
    from zo_megatron.training.cuda_connections import TP_FLAGS

    parser = build_parser()
    (action,) = [a for a in parser._actions if a.dest == "tensor_parallel"]
    assert set(action.option_strings) == set(TP_FLAGS)
    tp = random.Random(fresh_seed("TP flag spelling")).randint(2, 64)
    for flag in TP_FLAGS:
        for argv in ([flag, str(tp)], [f"{flag}={tp}"]):
            assert parser.parse_args(argv).tensor_parallel == tensor_parallel_from_argv(argv) == tp


def test_set_only_above_tp_1_and_never_over_the_users_value(monkeypatch):
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    assert not set_cuda_device_max_connections(["--tensor-parallel", "1"])
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in os.environ
    assert set_cuda_device_max_connections(["--tensor-parallel=2"])
    assert os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "8")
    assert set_cuda_device_max_connections(["--tensor-model-parallel-size", "2"])
    assert os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] == "8"
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", "--tensor-parallel", "4"])
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS")
    assert set_cuda_device_max_connections()                     # argv None: the process's command line
    assert os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"


# Records the variable at the first call into torch.cuda that can start CUDA, then runs main().
_PROBE = r"""
import json, os, sys
import torch
sys.path.insert(0, os.path.join(sys.argv[1], "pretrain"))
seen = []
for name in ("is_available", "device_count", "_lazy_init", "init"):
    orig = getattr(torch.cuda, name)
    def spy(*a, _orig=orig, _name=name, **k):
        seen.append([_name, os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS")])
        return _orig(*a, **k)
    setattr(torch.cuda, name, spy)
import pretrain_gpt
rc = pretrain_gpt.main(sys.argv[2:])
print("PROBE " + json.dumps({"rc": rc, "seen": seen}))
"""


@pytest.mark.parametrize("argv,expected", [
    (["--tensor-parallel", "2"], "1"),                  # one process: TP 2 does not divide world size 1
    (["--tensor-parallel=1", "--micro-batch-size", "2", "--global-batch-size", "3"], None),   # not a multiple
])
def test_main_sets_the_variable_before_cuda_is_first_touched(argv, expected):
    env = {k: v for k, v in os.environ.items()
           if k not in ("CUDA_DEVICE_MAX_CONNECTIONS", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    r = subprocess.run([sys.executable, "-c", _PROBE, ROOT, *argv], env=env, capture_output=True, text=True,
                       timeout=120, cwd=ROOT)
    lines = [x for x in r.stdout.splitlines() if x.startswith("PROBE ")]
    assert len(lines) == 1, r.stdout[-3000:] + r.stderr[-3000:]
    out = json.loads(lines[0][len("PROBE "):])
    assert out["rc"] == 2, r.stderr[-3000:]            # the job stops with its one line, after parsing
    assert "error: " in r.stderr and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert out["seen"], "parsing the flags no longer calls into torch.cuda: the probe sees nothing"
    first, value = out["seen"][0]
    assert value == expected, f"torch.cuda.{first}() ran with CUDA_DEVICE_MAX_CONNECTIONS={value!r}"
