"""What a parameter is, from its name alone: the one rule every layer shares (no torch, no imports).

megatron-core names a routed expert's parameters `...mlp.experts.<...>` (SequentialMLP's
`mlp.experts.local_experts.J.linear_fc1.weight`); the router (`mlp.router.`) and Qwen2-MoE's shared
expert (`mlp.shared_experts.`) are not routed experts. Routed experts are the parameters that
split over expert TP instead of TP (model/sharding.py), are reduced and partitioned over the
expert-data-parallel group (offload/expert_parallel.py), and that the planner counts apart
(planner/params.py, whose rows are named from the layer down: `mlp.experts....` without the
`decoder.layers.N.` prefix).
"""
from __future__ import annotations

_ROUTED_EXPERT = "mlp.experts."


def is_routed_expert(name: str) -> bool:
    """True for a routed expert's parameter: `mlp.experts.` at a name-component boundary."""
    return name.startswith(_ROUTED_EXPERT) or "." + _ROUTED_EXPERT in name
