"""zo_megatron: Megatron tensor parallelism (TP) joined with ZeRO-Offload data parallelism (DP).

Layout:
  parallel/   process groups (TP x DP), launcher discovery, megatron-core CPU shims
  model/      the GPT-2-exact GPT built from megatron-core TP layers
  offload/    the ZeRO-Offload engine and the CPU Adam kernel wrapper
  data/       tokenizer, indexed datasets, the embedded SOTU corpus
  training/   arguments, the train loop, schedules, logging
  planner/    the memory model behind tools/estimate_memory.py and the pre-launch check
"""

__version__ = "0.1.0"

# megatron-core's torch.compile decorators off before any of its modules applies them (~2 s of every process's start;
# none is on zo_megatron's path): megatron_jit.py says why
from zo_megatron import megatron_jit as _megatron_jit  # noqa: E402

_megatron_jit.install()
