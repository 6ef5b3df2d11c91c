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

Zero-centred gamma (Megatron-LM's --apply-layernorm-1p, config.layernorm_zero_centered_gamma): the
norm scales by (1 + weight) and the weight starts at 0, as megatron-core's FusedLayerNorm does
(`self.weight + 1` in the parameter's dtype), so weight decay pulls the scale towards 1, not 0.
WrappedTorchNorm refuses it; Apex and Transformer Engine, which have it, are not used here.
"""
from __future__ import annotations

import torch

from zo_megatron.errors import ConfigError


def _check_config(config) -> None:
    for flag, why in (("persist_layer_norm", "persistent (Apex) layer norm"),
                      ("memory_efficient_layer_norm", "memory-efficient (Apex) layer norm")):
        if getattr(config, flag, False):
            raise ConfigError(f"{why} is not supported by zo_megatron's torch norms: turn {flag} off")


def mark_sequence_parallel(module: torch.nn.Module, sequence_parallel: bool) -> None:
    """Tag the module's own parameters as megatron-core does (its TP gradient rule reads the tag)."""
    for p in module.parameters(recurse=False):
        p.sequence_parallel = bool(sequence_parallel)


def scale_of(norm) -> torch.Tensor | None:
    """The norm's effective scale: its weight, or 1 + weight with a zero-centred gamma."""
    return norm.weight + 1 if norm.zero_centered_gamma and norm.weight is not None else norm.weight


class LayerNorm(torch.nn.LayerNorm):
    """torch.nn.LayerNorm built from megatron-core's norm arguments; parameters tagged for SP."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, persist_layer_norm: bool = False,
                 zero_centered_gamma: bool = False, normalization: str = "LayerNorm",
                 sequence_parallel: bool | None = None):
        _check_config(config)
        super().__init__(normalized_shape=hidden_size, eps=eps)
        self.zero_centered_gamma = bool(getattr(config, "layernorm_zero_centered_gamma", False))
        mark_sequence_parallel(self, config.sequence_parallel if sequence_parallel is None else sequence_parallel)

    def forward(self, x):
        return torch.nn.functional.layer_norm(x, self.normalized_shape, scale_of(self), self.bias, self.eps)


class RMSNorm(torch.nn.RMSNorm):
    """torch.nn.RMSNorm built from megatron-core's norm arguments; parameters tagged for SP."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, persist_layer_norm: bool = False,
                 zero_centered_gamma: bool = False, normalization: str = "RMSNorm",
                 sequence_parallel: bool | None = None):
        _check_config(config)
        super().__init__(normalized_shape=hidden_size, eps=eps)
        self.zero_centered_gamma = bool(getattr(config, "layernorm_zero_centered_gamma", False))
        mark_sequence_parallel(self, config.sequence_parallel if sequence_parallel is None else sequence_parallel)

    def forward(self, x):
        return torch.nn.functional.rms_norm(x, self.normalized_shape, scale_of(self), self.eps)


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
