"""The decoder spec GPTModel is built from: the architecture's layer spec (model/gpt.py's
layer_spec: megatron-core's local spec with RMSNorm / q/k norms as the config says), with our core
attention and norms swapped in where the config asks for them.

  attention_backend "local"  megatron-core's DotProductAttention (materialises s² scores)
                    "sdpa"   model/attention.py's SDPAttention (torch SDPA, causal)
  sequence_parallel, or      model/norms.py's Norm (LayerNorm or RMSNorm, as config.normalization)
  a zero-centred gamma       for the layer norms and the final norm: megatron-core's torch norm
                             refuses both. q/k norms are left as model/gpt.py's layer_spec set
                             them: TPQKNorm (it handles the gamma) acts on this rank's heads over
                             the whole sequence, not on a shard; multi-latent attention's latent
                             norms are Norm already (its latents are this rank's tokens under SP).

With none of these, the spec is the architecture's layer spec untouched: the GPT-2 model is built
from the very same modules as before these options existed.
"""
from __future__ import annotations

from zo_megatron.model.config import GPTConfig


def _our_norms(cfg: GPTConfig, sequence_parallel: bool) -> bool:
    return sequence_parallel or cfg.layernorm_zero_centered_gamma


def layer_spec_with(cfg: GPTConfig, spec, sequence_parallel: bool):
    """`spec` (a fresh layer ModuleSpec, modified in place and returned) with SDPA core attention
    and sequence-parallel norms as `cfg` asks. `sequence_parallel` is what the TransformerConfig
    says (cfg.sequence_parallel turned off at TP = 1)."""
    layer = spec.submodules
    if cfg.attention_backend == "sdpa":
        from zo_megatron.model.attention import SDPAttention

        layer.self_attention.submodules.core_attention = SDPAttention
    if _our_norms(cfg, sequence_parallel):
        from zo_megatron.model.norms import Norm

        layer.input_layernorm = Norm
        layer.pre_mlp_layernorm = Norm
    return spec


def decoder_spec(cfg: GPTConfig, spec, sequence_parallel: bool):
    """What GPTModel's `transformer_layer_spec` gets: the layer spec, or, with sequence
    parallelism or a zero-centred gamma, the block's submodules so that the final norm is ours too
    (megatron-core would build its default torch norm there, which refuses both). `spec` may be a
    list of one layer spec per layer (mixture of experts: dense and MoE layers, --moe-layer-freq):
    then always the block's submodules, with megatron-core's default final norm where ours is not needed."""
    per_layer = spec if isinstance(spec, list) else None
    if per_layer is not None:
        per_layer = [layer_spec_with(cfg, s, sequence_parallel) for s in per_layer]
    else:
        spec = layer_spec_with(cfg, spec, sequence_parallel)
        if not _our_norms(cfg, sequence_parallel):
            return spec
    from megatron.core.transformer.transformer_block import LayerNormImpl, TransformerBlockSubmodules

    from zo_megatron.model.norms import Norm

    return TransformerBlockSubmodules(layer_specs=per_layer or [spec] * cfg.num_layers,
                                      layer_norm=Norm if _our_norms(cfg, sequence_parallel) else LayerNormImpl)
