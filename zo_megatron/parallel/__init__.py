"""Process groups: TP x DP (and the expert groups EP x expert TP x expert DP) over torch.distributed, built by
megatron-core's parallel_state."""
from .state import (
    ParallelState,
    destroy_parallel,
    get_parallel_state,
    init_parallel,
    set_seed,
    validate_parallel_config,
)

__all__ = [
    "ParallelState",
    "destroy_parallel",
    "get_parallel_state",
    "init_parallel",
    "set_seed",
    "validate_parallel_config",
]
