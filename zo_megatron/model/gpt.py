"""The GPT: megatron-core's GPTModel (local layer spec) configured to equal Hugging Face GPT-2.

GPT-2 exactly means: learned absolute positions, pre-LayerNorm (eps 1e-5), GELU with the tanh
approximation, biases everywhere, tied input/output embeddings, a final LayerNorm, attention
scaled by 1/sqrt(head_dim) with softmax in fp32. Splits over TP (megatron-core layers):

    embedding.word_embeddings   VocabParallelEmbedding  [V_pad/t, h]  rows split (also the LM head)
    self_attention.linear_qkv   ColumnParallel          [3h/t, h]     whole heads per rank
    self_attention.linear_proj  RowParallel             [h, h/t]      bias replicated
    mlp.linear_fc1              ColumnParallel          [4h/t, h]
    mlp.linear_fc2              RowParallel             [h, 4h/t]     bias replicated
    LayerNorms, position embeddings                     replicated on every TP rank
"""
from __future__ import annotations

import functools
import zlib

import torch
import torch.nn.functional as F

from zo_megatron.errors import ConfigError
from zo_megatron.model.config import GPTConfig
from zo_megatron.model.sharding import shard_info, shard_of


def causal_attention_mask(seq_length: int, device) -> torch.Tensor:
    """Bool [1, 1, s, s], True = masked. Always explicit: with None megatron builds it on 'cuda'."""
    return torch.triu(torch.ones(seq_length, seq_length, dtype=torch.bool, device=device), diagonal=1)[None, None]


def transformer_config(cfg: GPTConfig, tensor_parallel: int):
    from megatron.core.transformer.transformer_config import TransformerConfig

    recompute = {}
    if cfg.recompute == "full":
        recompute = dict(recompute_granularity="full", recompute_method=cfg.recompute_method,
                         recompute_num_layers=cfg.recompute_num_layers)
    elif cfg.recompute == "selective":
        recompute = dict(recompute_granularity="selective")
    return TransformerConfig(
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        ffn_hidden_size=cfg.ffn_size,
        hidden_dropout=cfg.hidden_dropout,
        attention_dropout=cfg.attention_dropout,
        layernorm_epsilon=cfg.layernorm_epsilon,
        init_method_std=cfg.init_method_std,
        activation_func=functools.partial(F.gelu, approximate="tanh"),
        add_bias_linear=True,
        apply_query_key_layer_scaling=False,
        attention_softmax_in_fp32=True,
        tensor_model_parallel_size=tensor_parallel,
        # Weights are created in fp32 on the host and initialised by init_weights_() below, the
        # same full tensors at any TP; the engine then moves them to the device in 16 bits.
        params_dtype=torch.float32,
        use_cpu_initialization=True,
        perform_initialization=False,
        bf16=cfg.precision == "bf16",
        fp16=cfg.precision == "fp16",
        # Fusions: CUDA kernels / torch.compile; the unfused paths are the same math.
        gradient_accumulation_fusion=False,
        masked_softmax_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        # megatron-LM turns sequence parallelism off at TP = 1 (there is no sequence to split)
        sequence_parallel=cfg.sequence_parallel and tensor_parallel > 1,
        **recompute,
    )


class GPTModelTP(torch.nn.Module):
    """A megatron-core GPTModel plus the loss: vocab-parallel cross-entropy over real tokens only."""

    def __init__(self, cfg: GPTConfig, tp_rank: int, tp_size: int):
        super().__init__()
        from megatron.core.models.gpt import GPTModel

        from zo_megatron.model.spec import decoder_spec

        self.cfg = cfg
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.padded_vocab_size = cfg.padded_vocab_size(tp_size)
        config = transformer_config(cfg, tp_size)
        self.sequence_parallel = config.sequence_parallel
        self.gpt = GPTModel(
            config=config,
            transformer_layer_spec=decoder_spec(cfg, config.sequence_parallel),
            vocab_size=self.padded_vocab_size,
            max_sequence_length=cfg.max_position_embeddings,
            share_embeddings_and_output_weights=True,
            position_embedding_type="learned_absolute",
            parallel_output=True,
        )
        _mark_tp_split_params(self.gpt)
        local_vocab = self.padded_vocab_size // tp_size
        first = tp_rank * local_vocab
        n_pad = max(0, first + local_vocab - max(first, cfg.vocab_size))
        # Pad columns of this rank's logits shard; they must never reach the softmax.
        self._n_vocab_pad = n_pad
        self._mask_cache: dict = {}

    def _mask(self, seq_length: int, device) -> torch.Tensor:
        key = (seq_length, str(device))
        if key not in self._mask_cache:
            self._mask_cache[key] = causal_attention_mask(seq_length, device)
        return self._mask_cache[key]

    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """tokens [b, s] -> this TP rank's logits shard [b, s, V_pad/t]; pad columns are -inf."""
        b, s = tokens.shape
        if self.sequence_parallel and s % self.tp_size:
            raise ConfigError(f"sequence parallelism splits the sequence over TP: sequence length {s} is not "
                              f"divisible by TP {self.tp_size}; use a multiple of {self.tp_size}")
        if position_ids is None:
            position_ids = torch.arange(s, device=tokens.device).unsqueeze(0).expand(b, s)
        # SDPA attention is causal by construction (no s x s mask is built or read).
        mask = None if self.cfg.attention_backend == "sdpa" else self._mask(s, tokens.device)
        logits = self.gpt(tokens, position_ids, mask)
        if self._n_vocab_pad:
            logits = logits.float()
            logits[..., logits.shape[-1] - self._n_vocab_pad:] = float("-inf")
        return logits

    def loss(self, tokens: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor | None = None,
             position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Mean next-token cross-entropy (fp32) over unmasked tokens of this micro-batch."""
        from megatron.core import tensor_parallel

        logits = self.forward(tokens, position_ids)
        per_token = tensor_parallel.vocab_parallel_cross_entropy(logits.float(), labels)
        if loss_mask is None:
            return per_token.mean()
        loss_mask = loss_mask.to(per_token.dtype)
        return (per_token * loss_mask).sum() / loss_mask.sum().clamp(min=1.0)


def _mark_tp_split_params(module: torch.nn.Module) -> None:
    """Megatron sets the TP-split attributes only inside its own initialisers, which we skip
    (perform_initialization=False): mark the split weights here so sharding/clipping see them."""
    from megatron.core import tensor_parallel as tp

    for m in module.modules():
        if isinstance(m, (tp.ColumnParallelLinear, tp.VocabParallelEmbedding)):
            dim = 0
        elif isinstance(m, tp.RowParallelLinear):
            dim = 1
        else:
            continue
        w = getattr(m, "weight", None)
        if w is not None:
            w.tensor_model_parallel, w.partition_dim, w.partition_stride = True, dim, 1


def _param_seed(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63 - 1)


@torch.no_grad()
def init_weights_(model: GPTModelTP, seed: int) -> None:
    """GPT-2 initialisation, identical full weights at any TP/DP layout for one seed.

    Each parameter's FULL unpadded tensor is drawn from its own generator (seed, name), then this
    rank keeps its shard: so TP=1/2/4 runs start from the same model. Weights N(0, 0.02), output
    projections N(0, 0.02/sqrt(2L)) (GPT-2 and Megatron), biases 0, LayerNorm weights 1.
    """
    cfg = model.cfg
    out_std = cfg.init_method_std / (2.0 * cfg.num_layers) ** 0.5
    for name, p in model.named_parameters():
        local_name = name.removeprefix("gpt.")
        info = shard_info(local_name, p, model.tp_rank, model.tp_size, cfg.vocab_size)
        if local_name.endswith("layernorm.weight"):
            p.fill_(1.0)
            continue
        if local_name.endswith(".bias"):
            p.zero_()
            continue
        std = out_std if local_name.endswith(("linear_proj.weight", "linear_fc2.weight")) else cfg.init_method_std
        gen = torch.Generator().manual_seed(_param_seed(seed, local_name))
        full = torch.empty(info.full_shape, dtype=torch.float32).normal_(0.0, std, generator=gen)
        p.copy_(shard_of(full, info).to(p.device, p.dtype))


def build_gpt_model(cfg: GPTConfig, tp_rank: int, tp_size: int, seed: int, device=None) -> GPTModelTP:
    """Build, initialise (layout-independent) and place the model; params stay fp32 here.

    The training engine casts parameters to cfg.dtype (flat 16-bit buffer); for a standalone
    16-bit model call `.to(cfg.dtype)`.
    """
    from zo_megatron.parallel import megatron_cpu

    megatron_cpu.apply()
    model = GPTModelTP(cfg, tp_rank, tp_size)
    init_weights_(model, seed)
    if device is not None:
        model.to(device)
    return model
