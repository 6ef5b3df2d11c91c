"""The ZeRO-Offload paper's reference points and our own maxima, evaluated with the planner."""
from __future__ import annotations

from typing import Any

from zo_megatron.planner.inputs import PlanInput
from zo_megatron.planner.memory import _compute
from zo_megatron.planner.presets import HARDWARE_PRESETS, model_preset
from zo_megatron.planner.search import max_model, plan
from zo_megatron.planner.units import GiB


def _paper_inputs() -> list[tuple[str, PlanInput, bool, str]]:
    v100 = dict(seq_length=1024, precision="fp16", recompute="full", gpus_per_node=1,
                gpu_memory_bytes=HARDWARE_PRESETS["v100-32gb"]["gpu_memory_bytes"],
                host_memory_bytes_per_node=1536 * GiB)
    dgx2 = dict(v100, gpus_per_node=16)
    return [
        ("13B, 1x V100-32GB, ZeRO-Offload, mb 4",
         PlanInput(**model_preset("13b"), micro_batch_size=4, zero_offload=True, **v100),
         True, "paper: 13B fits"),
        ("13B, 1x V100-32GB, no offload, mb 4",
         PlanInput(**model_preset("13b"), micro_batch_size=4, zero_offload=False, **v100),
         False, "paper: PyTorch alone tops out at 1.4B"),
        ("70B, DGX-2 TP=16, ZeRO-Offload, mb 8",
         PlanInput(**model_preset("70b"), tensor_parallel=16, micro_batch_size=8,
                   zero_offload=True, **dgx2),
         True, "paper: 70B fits with MP=16"),
        ("70B, DGX-2 TP=16, no offload, mb 8",
         PlanInput(**model_preset("70b"), tensor_parallel=16, micro_batch_size=8,
                   zero_offload=False, **dgx2),
         False, "paper: Megatron alone tops out at 15B"),
        ("15B, DGX-2 TP=16, no offload, mb 8",
         PlanInput(**model_preset("15b"), tensor_parallel=16, micro_batch_size=8,
                   zero_offload=False, **dgx2),
         True, "paper: Megatron alone trains 15B"),
    ]


def paper_checks() -> list[dict[str, Any]]:
    """The paper's headline points, evaluated with this planner.

    Shapes: seq 1024, vocab 50257 (padded), fp16 (V100 has no bf16), full recompute
    (activation checkpointing, as in the paper); 13B = 65 layers x 4096 hidden x 32 heads,
    15B = 78 x 4096 x 32, 70B = 69 x 9216 x 96 heads (12·L·h² = 13.1B / 15.7B / 70.3B).
    Also reports the no-offload maxima (paper: 1.4B on one V100, 15B on a DGX-2) for context.
    """
    rows = []
    for name, inp, expected, paper in _paper_inputs():
        p = plan(inp)
        rows.append({"name": name, "params": p.params_total, "expected_fits": expected,
                     "fits": p.fits, "ok": p.fits == expected, "paper": paper,
                     "device_bytes_per_gpu": p.device_bytes_per_gpu,
                     "host_bytes_per_node": p.host_bytes_per_node,
                     "gpu_memory_bytes": inp.gpu_memory_bytes,
                     "host_memory_bytes_per_node": inp.host_memory_bytes_per_node})
    return rows


def baseline_maxima() -> list[dict[str, Any]]:
    """Largest models WITHOUT ZeRO-Offload (to set beside the paper's 1.4B and 15B)."""
    v100 = _paper_inputs()[1][1]  # 13B no-offload template; we vary the shape
    dgx2 = _paper_inputs()[3][1]
    out = []
    for name, tmpl, paper in (
            ("no offload, 1x V100-32GB, h=2048 (16 heads), mb 4",
             v100.replace(hidden_size=2048, num_attention_heads=16), "paper (PyTorch): 1.4B"),
            ("no offload, DGX-2 TP=16, h=4096 (32 heads), mb 8",
             dgx2.replace(hidden_size=4096, num_attention_heads=32), "paper (Megatron): 15B")):
        mp, shape = max_model(tmpl, "layers")
        out.append({"name": name, "max_params": mp, "shape": shape, "paper": paper})
    return out


GOALS = {"v100": 15e9, "dgx2": 100e9}


def our_maxima() -> list[dict[str, Any]]:
    """Our goal: >= 15B on one V100-32GB and >= 100B on one DGX-2, with ZeRO-Offload, full
    recompute, bf16 optimizer states (host), fp16 on the GPU, micro-batch 1, seq 1024."""
    common = dict(seq_length=1024, precision="fp16", recompute="full", micro_batch_size=1,
                  zero_offload=True, bf16_optimizer_states=True,
                  gpu_memory_bytes=HARDWARE_PRESETS["v100-32gb"]["gpu_memory_bytes"],
                  host_memory_bytes_per_node=1536 * GiB)
    cases = [
        ("1x V100-32GB, h=4096 (32 heads), layers grow", "v100",
         PlanInput(num_layers=1, hidden_size=4096, num_attention_heads=32, gpus_per_node=1,
                   **common)),
        ("DGX-2 TP=16, h=10240 (80 heads), layers grow", "dgx2",
         PlanInput(num_layers=1, hidden_size=10240, num_attention_heads=80, tensor_parallel=16,
                   gpus_per_node=16, **common)),
    ]
    rows = []
    for name, key, tmpl in cases:
        mp, shape = max_model(tmpl, "layers")
        p = plan(tmpl.replace(**shape))
        limit = "device" if not _compute(tmpl.replace(num_layers=shape["num_layers"] + 1)).fits_device \
            else "host"
        rows.append({"name": name, "max_params": mp, "shape": shape, "goal": GOALS[key],
                     "meets_goal": mp >= GOALS[key], "limited_by": limit,
                     "device_bytes_per_gpu": p.device_bytes_per_gpu,
                     "host_bytes_per_node": p.host_bytes_per_node})
    return rows

