"""The decoder spec GPTModel is built from: megatron-core's local layer spec, with our core
attention and norms swapped in where the config asks for them.

  attention_backend "local"  megatron-core's DotProductAttention (materialises s² scores)
                    "sdpa"   model/attention.py's SDPAttention (torch SDPA, causal)
  sequence_parallel          model/norms.py's Norm for every LayerNorm/RMSNorm (megatron-core's
                             torch norm refuses sequence parallelism), the final one included

With neither, this is exactly get_gpt_layer_local_spec(): the GPT-2 model is built from the very
same modules as before these options existed.
"""
from __future__ import annotations

from zo_megatron.model.config import GPTConfig


def layer_spec(cfg: GPTConfig, sequence_parallel: bool | None = None):
    """The ModuleSpec of one transformer layer. `sequence_parallel` is what the TransformerConfig
    says (cfg.sequence_parallel turned off at TP = 1); default cfg.sequence_parallel."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.spec_utils import ModuleSpec

    sp = cfg.sequence_parallel if sequence_parallel is None else sequence_parallel
    spec = get_gpt_layer_local_spec()
    layer = spec.submodules
    attention = layer.self_attention.submodules
    if cfg.attention_backend == "sdpa":
        from zo_megatron.model.attention import SDPAttention

        attention.core_attention = SDPAttention
    if sp:
        from zo_megatron.model.norms import Norm

        layer.input_layernorm = Norm
        layer.pre_mlp_layernorm = Norm
        # q/k norms act on this rank's heads, not on a sequence shard: built untagged.
        for name in ("q_layernorm", "k_layernorm"):
            if getattr(attention, name, IdentityOp) not in (IdentityOp, None):
                setattr(attention, name, ModuleSpec(module=Norm, params={"sequence_parallel": False}))
    return spec


def decoder_spec(cfg: GPTConfig, sequence_parallel: bool | None = None):
    """What GPTModel's `transformer_layer_spec` gets: the layer spec, or, with sequence
    parallelism, the block's submodules so that the final norm is ours too (megatron-core would
    build its default torch norm there, which refuses sequence parallelism)."""
    sp = cfg.sequence_parallel if sequence_parallel is None else sequence_parallel
    spec = layer_spec(cfg, sp)
    if not sp:
        return spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    from zo_megatron.model.norms import Norm

    return TransformerBlockSubmodules(layer_specs=[spec] * cfg.num_layers, layer_norm=Norm)
