"""LayerNorm and RMSNorm that megatron-core's layer spec accepts with sequence parallelism.

megatron-core's CPU-usable norm, WrappedTorchNorm, asserts `not config.sequence_parallel`; its
sequence-parallel norms need Apex (FusedLayerNorm) or Transformer Engine (TENorm). The math of a
norm does not change under sequence parallelism -- each rank normalises its own tokens -- only
its weight gradient does: every TP rank holds 1/TP of the sequence, so its weight/bias gradient
is a partial sum. megatron-core marks such parameters `sequence_parallel = True` and its
finalize_model_grads sums their gradients over the TP group; our optimizers do the same for
every parameter so marked (offload/engine.py, training/plain_optimizer.py). megatron-core's own
RowParallelLinear marks its (replicated) bias the same way.

These are torch.nn.LayerNorm / torch.nn.RMSNorm themselves (same parameter names `weight` and
`bias`, same kernels): a model built with them computes exactly what WrappedTorchNorm's does,
and checkpoints do not depend on the choice.
"""
from __future__ import annotations

import torch

from zo_megatron.errors import ConfigError


def _check_config(config) -> None:
    for flag, why in (("layernorm_zero_centered_gamma", "zero-centred gamma"),
                      ("persist_layer_norm", "persistent (Apex) layer norm"),
                      ("memory_efficient_layer_norm", "memory-efficient (Apex) layer norm")):
        if getattr(config, flag, False):
            raise ConfigError(f"{why} is not supported by zo_megatron's torch norms: turn {flag} off")


def mark_sequence_parallel(module: torch.nn.Module, sequence_parallel: bool) -> None:
    """Tag the module's own parameters as megatron-core does (its TP gradient rule reads the tag)."""
    for p in module.parameters(recurse=False):
        p.sequence_parallel = bool(sequence_parallel)


class LayerNorm(torch.nn.LayerNorm):
    """torch.nn.LayerNorm built from megatron-core's norm arguments; parameters tagged for SP."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, persist_layer_norm: bool = False,
                 zero_centered_gamma: bool = False, normalization: str = "LayerNorm",
                 sequence_parallel: bool | None = None):
        _check_config(config)
        super().__init__(normalized_shape=hidden_size, eps=eps)
        mark_sequence_parallel(self, config.sequence_parallel if sequence_parallel is None else sequence_parallel)


class RMSNorm(torch.nn.RMSNorm):
    """torch.nn.RMSNorm built from megatron-core's norm arguments; parameters tagged for SP."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, persist_layer_norm: bool = False,
                 zero_centered_gamma: bool = False, normalization: str = "RMSNorm",
                 sequence_parallel: bool | None = None):
        _check_config(config)
        super().__init__(normalized_shape=hidden_size, eps=eps)
        mark_sequence_parallel(self, config.sequence_parallel if sequence_parallel is None else sequence_parallel)


class Norm:
    """The norm `config.normalization` names (LayerNorm | RMSNorm), as megatron-core's
    WrappedTorchNorm picks it, minus its sequence-parallel assertion.

    Used as a layer-spec module (megatron builds it with config, hidden_size, eps).
    `sequence_parallel=False` builds a norm that acts on TP-split heads rather than on the
    sequence (q/k layernorm): its weight is not tagged.
    """

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, persist_layer_norm: bool = False,
                zero_centered_gamma: bool = False, normalization: str | None = None,
                sequence_parallel: bool | None = None):
        kind = config.normalization
        norm_cls = {"LayerNorm": LayerNorm, "RMSNorm": RMSNorm}.get(kind)
        if norm_cls is None:
            raise ConfigError(f"normalization {kind!r} is not supported: use LayerNorm or RMSNorm")
        return norm_cls(config, hidden_size, eps=eps, sequence_parallel=sequence_parallel)
