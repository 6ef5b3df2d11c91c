"""Multi-latent attention (--multi-latent-attention; DeepSeek-V2/V3): megatron-core's MLASelfAttention with
the key/value latent's down projection replicated over TP, so that the gradient of the shared rotary key is
whole at any TP.

What MLA computes per token (h hidden, n heads, r_q/r_kv the latent ranks, d_n/d_r/d_v the head dims):

    q  = up_q(norm_q(down_q(x)))              [n, d_n + d_r]    (q_lora_rank None: q = proj_q(x))
    c, k_r = down_kv(x)                       [r_kv], [d_r]     one latent and ONE rotated key per token
    k_n, v = up_kv(norm_kv(c))                [n, d_n], [n, d_v]
    key = [k_n ; rope(k_r) for every head]    query = [q_n ; rope(q_r)]

Over TP the heads split (up_q, up_kv column-parallel; the output projection row-parallel), so each rank's
heads use the same rotated key k_r: its gradient is a sum over every rank's heads. In megatron-core 0.16.1's
local spec down_kv is a column-parallel linear whose output is all-gathered, and the gather's backward
keeps this rank's columns of this rank's partial gradient: without sequence parallelism k_r's gradient
(and through it down_kv's weight and the layer input's) misses the other ranks' heads. Here down_kv is one
replicated [r_kv + d_r, h] weight, as Transformer Engine's "duplicated" linear that Megatron-LM's own spec
uses, and k_r's gradient is summed over TP:

    sequence parallel   x is this rank's tokens; megatron-core all-gathers k_r over the sequence, whose
                        backward reduce-scatters (sums) its gradient; the weight's gradient covers this
                        rank's tokens, so it is tagged sequence_parallel (summed over TP as a norm's)
    otherwise, TP > 1   x is every token on every rank; k_r's gradient is all-reduced over TP here
                        , the weight's is then whole

The full tensor is the same [r_kv + d_r, h] either way: checkpoints and conversions do not change.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from zo_megatron.parallel import collectives


def _megatron_mla():
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    return MLASelfAttention


class _SumGradOverGroup(torch.autograd.Function):
    """Forward: the tensor; backward: its gradient summed over `group`. (megatron-core's
    copy_to_tensor_model_parallel_region all-reduces `grad.contiguous()` and returns `grad`: the sum is
    lost for a non-contiguous gradient, which a slice of the projection's output receives.)"""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return collectives.all_reduce(grad.clone(memory_format=torch.contiguous_format), group=ctx.group), None


class KVLatentProjection(torch.nn.Module):
    """down_kv: x [s, b, h] -> ([s, b, r_kv + d_r], None), weight replicated over TP (see the module doc)."""

    def __init__(self, config, hidden_size: int, kv_lora_rank: int, rope_dim: int, tp_group):
        super().__init__()
        self.kv_lora_rank, self.tp_group = kv_lora_rank, tp_group
        self.sum_rope_grad = tp_group.size() > 1 and not config.sequence_parallel
        self.weight = torch.nn.Parameter(torch.empty(kv_lora_rank + rope_dim, hidden_size, dtype=config.params_dtype))
        self.weight.sequence_parallel = bool(config.sequence_parallel)

    def forward(self, x: torch.Tensor):
        out = F.linear(x, self.weight)
        if self.sum_rope_grad:
            latent, rope = out.split([self.kv_lora_rank, out.size(-1) - self.kv_lora_rank], dim=-1)
            out = torch.cat([latent, _SumGradOverGroup.apply(rope, self.tp_group)], dim=-1)
        return out, None

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        return {}


class MLASelfAttentionTP(_megatron_mla()):
    """megatron-core's MLASelfAttention with `linear_kv_down_proj` a KVLatentProjection."""

    def __init__(self, config, submodules, layer_number: int, attn_mask_type=None, cp_comm_type=None,
                 pg_collection=None):
        kwargs = {} if attn_mask_type is None else {"attn_mask_type": attn_mask_type}
        super().__init__(config, submodules, layer_number, cp_comm_type=cp_comm_type, pg_collection=pg_collection,
                         **kwargs)
        self.linear_kv_down_proj = KVLatentProjection(config, config.hidden_size, config.kv_lora_rank,
                                                      config.qk_pos_emb_head_dim, self.pg_collection.tp)
        if config.sequence_parallel and config.q_lora_rank is not None and self.pg_collection.tp.size() > 1:
            # under sequence parallelism megatron-core all-gathers the query latent over TP and scatters it back
            # to this rank's tokens as a slice: a view that kept the whole gathered sequence alive wherever the
            # next module saved it (a LayerNorm, an fp32 RMSNorm, or linear_q_up_proj without --qk-layernorm).
            # The latent's own copy of this rank's tokens frees it (the module's name and state are unchanged)
            self.q_layernorm.forward = _on_own_storage(self.q_layernorm.forward)


def _on_own_storage(forward):
    def on_own_storage(x, *args, **kwargs):
        return forward(x.clone(memory_format=torch.contiguous_format), *args, **kwargs)

    return on_own_storage
