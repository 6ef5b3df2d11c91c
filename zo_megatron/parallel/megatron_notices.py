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
SUMMARY = ("hidden: megatron-core's notices that Apex/Transformer Engine are absent (its local layers "
           "are used) and a CUDA-graph deprecation (no graphs are captured); other warnings are shown")


def hide_known_megatron_notices() -> None:
    for pattern in KNOWN_HARMLESS:
        warnings.filterwarnings("ignore", message=pattern, category=UserWarning)
