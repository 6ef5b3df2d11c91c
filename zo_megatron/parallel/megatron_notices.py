"""megatron-core's import-time notices that do not apply to zo_megatron, hidden by exact pattern.

megatron-core warns when NVIDIA Apex or Transformer Engine is absent (zo_megatron uses its local
layers and torch's LayerNorm/optimizer on purpose) and about a CUDA-graph config default it
deprecates (zo_megatron does not capture CUDA graphs). Only these exact messages are hidden;
every other warning still reaches the user.
"""
from __future__ import annotations

import warnings

KNOWN_HARMLESS = (
    r"Apex is not installed\. Falling back to Torch Norm",
    r"Transformer Engine and Apex are not installed\. Falling back to",
    r"full scope is deprecated\. Use empty cuda_graph_scope to capture the whole layer",
)
# torch 2.13 deprecates the two collectives megatron-core's sequence-parallel mappings call
# (tensor_parallel/mappings.py); zo_megatron's own collectives call their successors
# (parallel/collectives.py), so these FutureWarnings of every TP x SP run are megatron-core's
TORCH_DEPRECATIONS_MEGATRON_CALLS = (
    r"`torch\.distributed\.all_gather_into_tensor` is deprecated\. Please use `torch\.distributed\.all_gather_single`",
    r"`torch\.distributed\.reduce_scatter_tensor` is deprecated\. Please use `torch\.distributed\.reduce_scatter_single`",
)
SUMMARY = ("hidden: megatron-core's notices that Apex/Transformer Engine are absent (its local layers "
           "are used), a CUDA-graph deprecation (no graphs are captured) and torch's deprecation of two "
           "collectives its sequence-parallel layers call; other warnings are shown")


def hide_known_megatron_notices() -> None:
    for pattern in KNOWN_HARMLESS:
        warnings.filterwarnings("ignore", message=pattern, category=UserWarning)
    for pattern in TORCH_DEPRECATIONS_MEGATRON_CALLS:
        warnings.filterwarnings("ignore", message=pattern, category=FutureWarning)
