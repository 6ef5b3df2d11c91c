"""The GPT's shape and numerics, independent of how it is laid out over TP/DP."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from zo_megatron.errors import ConfigError

PRECISIONS = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass
class GPTConfig:
    """A GPT-2-architecture model (learned positions, pre-LN, tanh-GELU, biases, tied embeddings)."""

    num_layers: int = 4
    hidden_size: int = 256
    num_attention_heads: int = 4
    vocab_size: int = 50257
    max_position_embeddings: int = 1024
    ffn_hidden_size: int | None = None          # default 4 * hidden_size, as GPT-2
    make_vocab_size_divisible_by: int = 128     # Megatron's default
    precision: str = "bf16"                     # bf16 | fp16 | fp32: dtype of params and activations
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    init_method_std: float = 0.02
    layernorm_epsilon: float = 1e-5
    recompute: str | None = None                # None | "full" (whole layers) | "selective" (attention core)
    recompute_method: str = "uniform"           # full only: "uniform" (groups of N layers) | "block" (first N)
    recompute_num_layers: int = 1               # full only: N (megatron's --recompute-num-layers)
    label_smoothing: float = 0.0
    attention_backend: str = "local"            # "local": megatron's DotProductAttention | "sdpa": torch SDPA
    sequence_parallel: bool = False             # megatron's sequence parallelism (no effect at TP = 1)

    def __post_init__(self):
        if self.precision not in PRECISIONS:
            raise ConfigError(f"precision must be one of {sorted(PRECISIONS)} (got {self.precision!r})")
        for name in ("num_layers", "hidden_size", "num_attention_heads", "vocab_size",
                     "max_position_embeddings", "make_vocab_size_divisible_by"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1 (got {getattr(self, name)})")
        if self.hidden_size % self.num_attention_heads != 0:
            raise ConfigError(
                f"--hidden-size {self.hidden_size} is not divisible by --num-attention-heads "
                f"{self.num_attention_heads}: pick hidden = heads x head_dim")
        if self.recompute is True:
            self.recompute = "full"
        if self.recompute not in (None, False, "full", "selective"):
            raise ConfigError(f"recompute must be 'full' or 'selective' (got {self.recompute!r})")
        self.recompute = self.recompute or None
        if self.recompute_method not in ("uniform", "block"):
            raise ConfigError(f"recompute_method must be 'uniform' or 'block' (got {self.recompute_method!r})")
        if not 1 <= self.recompute_num_layers <= self.num_layers:
            raise ConfigError(f"--recompute-num-layers {self.recompute_num_layers} must be between 1 and "
                              f"--num-layers {self.num_layers}")
        if self.recompute == "full" and self.recompute_method == "uniform" and self.num_layers % self.recompute_num_layers:
            raise ConfigError(f"--recompute-num-layers {self.recompute_num_layers} does not divide --num-layers "
                              f"{self.num_layers} (megatron-core's uniform method checkpoints whole groups): use a divisor")
        if self.attention_backend not in ("local", "sdpa"):
            raise ConfigError(f"attention_backend must be 'local' or 'sdpa' (got {self.attention_backend!r})")
        if self.label_smoothing != 0.0:
            # megatron-core's vocab_parallel_cross_entropy smooths over the local vocab shard only,
            # which is wrong at TP > 1; refuse rather than train on a silently wrong loss.
            raise ConfigError("label smoothing is not supported (megatron-core's vocab-parallel "
                              "cross-entropy applies it to one TP shard only): drop --label-smoothing")

    @property
    def dtype(self) -> torch.dtype:
        return PRECISIONS[self.precision]

    @property
    def ffn_size(self) -> int:
        return self.ffn_hidden_size or 4 * self.hidden_size

    def padded_vocab_size(self, tensor_parallel: int) -> int:
        """Megatron's padding: a multiple of make_vocab_size_divisible_by x TP."""
        multiple = self.make_vocab_size_divisible_by * tensor_parallel
        return -(-self.vocab_size // multiple) * multiple

    def num_parameters(self) -> int:
        """Unpadded total parameter count (the number HF GPT-2 reports)."""
        h, f, L = self.hidden_size, self.ffn_size, self.num_layers
        per_layer = 4 * h + (3 * h * h + 3 * h) + (h * h + h) + (f * h + f) + (h * f + h)
        return self.vocab_size * h + self.max_position_embeddings * h + L * per_layer + 2 * h
