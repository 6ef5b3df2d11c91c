"""--no-pin-memory says what it costs (issue 34, section 2): on CUDA a copy from pageable host memory
blocks, so backward serialises behind every bucket's copy home. Its --help, the Megatron flags that
follow it, the pinning failure's advice and the job's banner on a CUDA device say so."""
import re
import types
from pathlib import Path

import pytest
import torch

from zo_megatron.training import user_report
from zo_megatron.training.arguments import build_parser, check_batch_sizes, parse_args

CAVEAT = "host copies then block"
SERIAL = "backward serialises behind every copy home"
SHAPE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--micro-batch-size", "2", "--train-iters", "3", "--lr", "1e-3"]


def _flat(text):
    return re.sub(r"\s+", " ", text)


def test_the_help_text_says_backward_serialises():
    parser = build_parser()
    (action,) = [a for a in parser._actions if "--no-pin-memory" in a.option_strings]
    assert CAVEAT in action.help and SERIAL in action.help, action.help
    assert f"--no-pin-memory {_flat(action.help)}" in _flat(parser.format_help())     # as --help prints it


def test_the_megatron_flags_that_follow_it_say_so_too():
    from zo_megatron.training.megatron_flags import NO_OP

    doc = (Path(__file__).resolve().parents[1] / "docs" / "megatron_compat.md").read_text()
    for flag in ("--no-pin-cpu-grads", "--no-pin-cpu-params"):
        assert "--no-pin-memory" in NO_OP[flag] and SERIAL in NO_OP[flag], NO_OP[flag]
        (row,) = [line for line in doc.splitlines() if line.startswith(f"| {flag} |")]
        assert NO_OP[flag] in row, row


def test_the_pinning_failure_advice_says_what_the_retry_costs(monkeypatch):
    from zo_megatron.offload.device import DeviceLayer

    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: types.SimpleNamespace(cudaHostRegister=lambda p, n, f: 2))
    dev = DeviceLayer(torch.device("cuda", 0), pin_memory=True)
    with pytest.raises(RuntimeError) as exc:
        dev.host_empty(16, torch.float32)
    assert "--no-pin-memory" in str(exc.value) and SERIAL in str(exc.value)


def _ps(device):
    return types.SimpleNamespace(device=torch.device(device), world_size=1, tp_size=1, dp_size=1)


@pytest.mark.parametrize("flags,device,warned", [
    (["--zero-offload", "--no-pin-memory"], "cuda", True),
    (["--zero-offload", "--no-pin-memory"], "cpu", False),      # the CPU never pins: nothing changes
    (["--zero-offload"], "cuda", False),
    (["--no-pin-memory"], "cuda", False),                       # no ZeRO-Offload: no host copies at all
])
def test_the_banner_warns_on_a_cuda_device(monkeypatch, flags, device, warned):
    from zo_megatron.model import GPTConfig

    args = parse_args([*SHAPE, *flags])
    check_batch_sizes(args, 1)
    for name, value in (("threads_line", "1 CPU Adam thread"), ("overlap_reason", "CPU step overlap off"),
                        ("overlap_cpu_step", False), ("memory_plan", None)):
        if getattr(args, name, None) is None:
            setattr(args, name, value)
    model = torch.nn.Linear(4, 4)
    optimizer = types.SimpleNamespace(model=model, accounting=types.SimpleNamespace(device_model_state_bytes=0,
                                                                                    host_bytes=0))
    monkeypatch.setattr(user_report, "attention_line", lambda cfg, ps, document_mask=False, **_: "sdpa")
    printed = []
    user_report.banner(types.SimpleNamespace(print=printed.append), args, _ps(device),
                 GPTConfig(num_layers=2, hidden_size=64, num_attention_heads=4, precision="fp32"), optimizer,
                 ["demo"], 0.1)
    lines = [line for line in printed if "--no-pin-memory" in line]
    assert len(lines) == (1 if warned else 0), printed
    if warned:
        assert "\n" not in lines[0] and "warning" in lines[0] and CAVEAT in lines[0] and SERIAL in lines[0]
        assert lines[0] == user_report.pin_memory_warnings(args, _ps(device))[0]
