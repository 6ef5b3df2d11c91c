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


# A CPU (gloo) rank's own resident set, not counting model states or activations, and torchrun's
# launcher, measured by tools/find_max_model.py (docs/memory_planner.md, "The edge, measured"):
# - a rank: 0.37 GiB after imports, process group and data (0.37-0.38 at every size measured), plus
#   0.06-0.12 GiB more once it trains (not itemized: what the rank grows beyond its model states and
#   planned activations at hidden 256-1024, 4-40 layers, bf16 and fp32; issue 35 item 16)
#   -> 0.49 GiB per rank;
# - the launcher: 0.22 GiB, once per node (it was counted per rank, as 0.6 GiB per rank, which
#   over-counted it at DP=2).
# These hold because the job keeps glibc from holding freed tensors (training/host_allocator.py):
# without that a rank's resident set grew by up to 0.42 GiB more at hidden 512 (+14% at 3 GiB).
CPU_PROCESS_OVERHEAD_BYTES = 502 * MiB
CPU_LAUNCHER_OVERHEAD_BYTES = 222 * MiB

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
        device_overhead_bytes=0, host_overhead_bytes_per_rank=CPU_PROCESS_OVERHEAD_BYTES,
        host_overhead_bytes_per_node=CPU_LAUNCHER_OVERHEAD_BYTES,
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


def _gpt2_shape(layers: int, hidden: int, heads: int) -> dict[str, Any]:
    return {"num_layers": layers, "hidden_size": hidden, "num_attention_heads": heads}


# Llama-family shapes: the fields of their public Hugging Face config.json, in GPTConfig's names
# (rope theta and the norm epsilon do not change memory; they are kept for the job's flags)
_LLAMA = dict(position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
              untie_embeddings_and_output_weights=True, add_bias_linear=False)

# name -> PlanInput fields (shape, vocabulary, architecture); GPT-2 architecture unless given
MODEL_PRESETS: dict[str, dict[str, Any]] = {
    "gpt2-small": _gpt2_shape(12, 768, 12),
    "gpt2-medium": _gpt2_shape(24, 1024, 16),
    "gpt2-large": _gpt2_shape(36, 1280, 20),
    "gpt2-xl": _gpt2_shape(48, 1600, 25),
    "1.3b": _gpt2_shape(24, 2048, 16),
    "2.7b": _gpt2_shape(32, 2560, 32),
    "6.7b": _gpt2_shape(32, 4096, 32),
    "10b": _gpt2_shape(50, 4096, 32),  # paper-style shapes: 12·L·h² at h = 4096
    "13b": _gpt2_shape(65, 4096, 32),
    "15b": _gpt2_shape(78, 4096, 32),
    "70b": _gpt2_shape(69, 9216, 96),  # 12·69·9216² = 70.3B; 96 heads (head dim 96) so TP=16 divides them
    "100b": _gpt2_shape(80, 10240, 80),
    "175b": _gpt2_shape(96, 12288, 96),  # GPT-3
    # meta-llama/Meta-Llama-3-8B: 8,030,261,248 parameters
    "llama3-8b": dict(_gpt2_shape(32, 4096, 32), num_query_groups=8, ffn_hidden_size=14336, vocab_size=128256,
                      **_LLAMA),
    # meta-llama/Meta-Llama-3-70B: 70,553,706,496 parameters
    "llama3-70b": dict(_gpt2_shape(80, 8192, 64), num_query_groups=8, ffn_hidden_size=28672, vocab_size=128256,
                       **_LLAMA),
    # Qwen/Qwen2-7B: 7,615,616,512 parameters (qkv bias, no other bias)
    "qwen2-7b": dict(_gpt2_shape(28, 3584, 28), num_query_groups=4, ffn_hidden_size=18944, vocab_size=152064,
                     add_qkv_bias=True, **_LLAMA),
}

# The numerics of those presets that do not change memory, as the job's flags want them.
MODEL_PRESET_NUMERICS: dict[str, dict[str, Any]] = {
    "llama3-8b": {"rotary_base": 500000, "layernorm_epsilon": 1e-5},
    "llama3-70b": {"rotary_base": 500000, "layernorm_epsilon": 1e-5},
    "qwen2-7b": {"rotary_base": 1000000, "layernorm_epsilon": 1e-6},
}


def model_preset(name: str) -> dict[str, Any]:
    """The PlanInput fields of a model preset (shape; vocabulary and architecture where not GPT-2)."""
    if name not in MODEL_PRESETS:
        raise ValueError(f"unknown model preset {name!r}; one of {list(MODEL_PRESETS)}")
    return dict(MODEL_PRESETS[name])
