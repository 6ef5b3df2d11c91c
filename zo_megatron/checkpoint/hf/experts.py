"""The tensors of a mixture-of-experts MLP, HF <-> megatron-core, shared by hf/mixtral.py and
hf/qwen_moe.py: the two name their SwiGLU projections differently (Mixtral w1/w3/w2, Qwen gate_proj/
up_proj/down_proj) but lay them out alike:

    HF ({mlp}.)                               megatron-core ({ours}, decoder.layers.{i}.mlp.)
    gate.weight [E, h]                     -> router.weight
    experts.{e}.{gate}, {up} [f, h]        -> experts.local_experts.{e}.linear_fc1   [gate; up]
    experts.{e}.{down} [h, f]              -> experts.local_experts.{e}.linear_fc2   (e: the global index)

Only weights: no MoE family here has biases on its experts.
"""
from __future__ import annotations

import torch

def check_groups_and_top_k(cfg, refuse) -> None:
    """What every HF MoE config needs to map exactly (hf/mixtral.py, hf/gpt_oss.py): key/value heads that divide the
    heads, 1 < top-k <= experts. Top-1 has no exact form: HF's softmax over the one chosen logit is 1, megatron-core's
    top-1 routing needs --moe-router-pre-softmax (a softmax over every expert: another weight)."""
    heads = cfg.num_attention_heads
    groups = cfg.num_key_value_heads or heads
    if heads % groups:
        refuse(f"num_key_value_heads={groups}", f"does not divide num_attention_heads={heads}")
    experts, k = cfg.num_local_experts, cfg.num_experts_per_tok
    if not 1 <= k <= experts:
        refuse(f"num_experts_per_tok={k}", f"must be between 1 and num_local_experts={experts}")
    if k == 1:
        refuse("num_experts_per_tok=1", "HF renormalises the one chosen probability to 1, which megatron-core's "
               "top-1 routing (--moe-router-pre-softmax, its rule for k = 1) does not: no exact mapping")


# the HF names of a SwiGLU MLP's (gate, up, down) projections
QWEN_NAMES = ("gate_proj", "up_proj", "down_proj")
MIXTRAL_NAMES = ("w1", "w3", "w2")


def swiglu_from_hf(sd: dict[str, torch.Tensor], hf: str, ours: str, names: tuple[str, str, str]) -> dict:
    """One SwiGLU MLP under HF prefix `hf` -> our linear_fc1 ([gate; up], as megatron's --swiglu
    splits it) and linear_fc2 under prefix `ours`."""
    gate, up, down = names
    return {ours + "linear_fc1.weight": torch.cat([sd[f"{hf}{gate}.weight"], sd[f"{hf}{up}.weight"]]),
            ours + "linear_fc2.weight": sd[f"{hf}{down}.weight"]}


def swiglu_to_hf(weights: dict[str, torch.Tensor], ours: str, hf: str, ffn: int, names: tuple[str, str, str]) -> dict:
    """The inverse of swiglu_from_hf: `ffn` rows of linear_fc1 are the gate's, the next `ffn` the up's."""
    gate, up, down = names
    g, u = weights[ours + "linear_fc1.weight"].split([ffn, ffn])
    return {f"{hf}{gate}.weight": g, f"{hf}{up}.weight": u, f"{hf}{down}.weight": weights[ours + "linear_fc2.weight"]}


def experts_from_hf(sd: dict[str, torch.Tensor], hf: str, ours: str, num_experts: int,
                    names: tuple[str, str, str]) -> dict:
    """The router and every expert of one MoE layer (HF prefix `hf`, ours `ours`) as our tensors."""
    out = {ours + "router.weight": sd[hf + "gate.weight"]}
    for e in range(num_experts):
        out.update(swiglu_from_hf(sd, f"{hf}experts.{e}.", f"{ours}experts.local_experts.{e}.", names))
    return out


def experts_to_hf(weights: dict[str, torch.Tensor], ours: str, hf: str, num_experts: int, ffn: int,
                  names: tuple[str, str, str]) -> dict:
    """The inverse of experts_from_hf (`ffn`: --moe-ffn-hidden-size)."""
    out = {hf + "gate.weight": weights[ours + "router.weight"]}
    for e in range(num_experts):
        out.update(swiglu_to_hf(weights, f"{ours}experts.local_experts.{e}.", f"{hf}experts.{e}.", ffn, names))
    return out
