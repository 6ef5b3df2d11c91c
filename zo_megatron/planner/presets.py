"""Hardware and model-shape presets."""
from __future__ import annotations

from typing import Any

from zo_megatron.planner.inputs import PlanInput
from zo_megatron.planner.units import GiB, MiB


def _host_ram_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import os
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 16 * GiB


# GPU capacities are what torch.cuda.get_device_properties().total_memory reports (approximately);
# the CUDA context is a separate line item (device_overhead_bytes).
HARDWARE_PRESETS: dict[str, dict[str, Any]] = {
    "v100-32gb": dict(  # the paper's single-GPU runs: one V100 of a DGX-2, with its host memory
        gpu_memory_bytes=32510 * MiB, gpus_per_node=1, host_memory_bytes_per_node=1536 * GiB,
        precision="fp16", description="1x V100-32GB, 1.5 TiB host (the paper's single-GPU setup)"),
    "dgx2": dict(
        gpu_memory_bytes=32510 * MiB, gpus_per_node=16, host_memory_bytes_per_node=1536 * GiB,
        precision="fp16", description="DGX-2: 16x V100-32GB, 1.5 TiB host"),
    "a100-80gb": dict(
        gpu_memory_bytes=int(79.1 * GiB), gpus_per_node=8, host_memory_bytes_per_node=2048 * GiB,
        precision="bf16", description="DGX A100 80GB: 8x A100-80GB, 2 TiB host"),
    "h100-80gb": dict(
        gpu_memory_bytes=int(79.1 * GiB), gpus_per_node=8, host_memory_bytes_per_node=2048 * GiB,
        precision="bf16", description="DGX H100: 8x H100-80GB, 2 TiB host"),
    "cpu": dict(  # CPU runs (gloo): one process per "GPU", all of them in this machine's RAM
        gpu_memory_bytes=None, gpus_per_node=None, host_memory_bytes_per_node=None,
        device_overhead_bytes=0, host_overhead_bytes_per_rank=1 * GiB, host_reserve_bytes=1 * GiB,
        device_is_host=True, fused_softmax=False, description="this machine's CPU and RAM (device = host RAM)"),
}


def apply_hardware_preset(inp: PlanInput, name: str, *, keep_precision: bool = False) -> PlanInput:
    """Return `inp` with a hardware preset's memory sizes (and its default precision unless
    keep_precision)."""
    if name not in HARDWARE_PRESETS:
        raise ValueError(f"unknown hardware preset {name!r}; one of {sorted(HARDWARE_PRESETS)}")
    fields = {k: v for k, v in HARDWARE_PRESETS[name].items() if k != "description"}
    if name == "cpu":
        ram = _host_ram_bytes()
        fields["gpu_memory_bytes"] = ram
        fields["host_memory_bytes_per_node"] = ram
    if keep_precision:
        fields.pop("precision", None)
    return inp.replace(**fields)


# name -> (num_layers, hidden_size, num_attention_heads)
MODEL_PRESETS: dict[str, tuple[int, int, int]] = {
    "gpt2-small": (12, 768, 12),
    "gpt2-medium": (24, 1024, 16),
    "gpt2-large": (36, 1280, 20),
    "gpt2-xl": (48, 1600, 25),
    "1.3b": (24, 2048, 16),
    "2.7b": (32, 2560, 32),
    "6.7b": (32, 4096, 32),
    "10b": (50, 4096, 32),  # paper-style shapes: 12·L·h² at h = 4096
    "13b": (65, 4096, 32),
    "15b": (78, 4096, 32),
    "70b": (69, 9216, 96),  # 12·69·9216² = 70.3B; 96 heads (head dim 96) so TP=16 divides them
    "100b": (80, 10240, 80),
    "175b": (96, 12288, 96),  # GPT-3
}


def model_preset(name: str) -> dict[str, int]:
    if name not in MODEL_PRESETS:
        raise ValueError(f"unknown model preset {name!r}; one of {list(MODEL_PRESETS)}")
    L, h, a = MODEL_PRESETS[name]
    return {"num_layers": L, "hidden_size": h, "num_attention_heads": a}

