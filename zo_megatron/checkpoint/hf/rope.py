"""Hugging Face's rope types <-> megatron-core 0.16's RoPE variants (docs/models.md, "RoPE scaling").

    HF rope_type   megatron-core                                   zo_megatron / Megatron-LM flags
    default        RotaryEmbedding                                 --position-embedding-type rope
    llama3         RotaryEmbedding(rope_scaling=True)              --use-rope-scaling --rope-scaling-factor F
    yarn           YarnRotaryEmbedding + the attention's mscale    --position-embedding-type yarn
                                                                   --rotary-scaling-factor F ... (below)

YaRN is the same computation on both sides (transformers' _compute_yarn_parameters, megatron-core's
yarn_rotary_pos_embedding): inverse frequencies blended between theta^(-2i/d) and it / factor by a
linear ramp over the dims whose rotations at the original context lie between beta_slow and
beta_fast (rounded outward when HF's `truncate` / megatron's correction_range_round_to_int), and
cos and sin scaled by one attention factor. The names:

    HF rope_parameters                 GPTConfig field (Megatron-LM's arg)      default
    factor                             rotary_scaling_factor                    (1.0)
    original_max_position_embeddings   yarn_original_max_position_embeddings    (4096)
    beta_fast / beta_slow              yarn_beta_fast / yarn_beta_slow          32 / 1
    truncate                           yarn_correction_range_round_to_int       true
    mscale / mscale_all_dim            mscale / mscale_all_dim                  (1, 0)
    attention_factor                   (derived: megatron has no such setting)

The attention factor is where they differ in form: HF takes `attention_factor` if given, else
get_mscale(f, mscale) / get_mscale(f, mscale_all_dim) when both are non-zero, else get_mscale(f)
(get_mscale(f, m) = 0.1 m ln f + 1, 1 for f <= 1); megatron-core always takes the ratio (its
defaults 1 and 0 give get_mscale(f)). So (mscale, mscale_all_dim) map as they are when both are
non-zero and to (1, 0) otherwise; an explicit attention_factor converts when some (mscale,
mscale_all_dim) gives exactly it (what to-hf writes for a pair HF would read otherwise), else it is
refused.
"""
from __future__ import annotations

import math

from zo_megatron.model.config import YARN_FIELDS

ROPE_TYPES = ("default", "llama3", "yarn")
# the rope types transformers has that megatron-core 0.16 cannot compute: why, in a clause
ROPE_REFUSED = {
    "linear": "linear position interpolation exists in megatron-core (seq_len_interpolation_factor) but Megatron-LM's "
              "--rotary-seq-len-interpolation-factor never reaches its GPTModel (gpt_builders.py), so Megatron-LM "
              "would compute another model",
    "dynamic": "dynamic NTK scaling changes the frequencies with the sequence length at run time, which "
               "megatron-core's RoPE does not",
    "longrope": "megatron-core has no LongRoPE (per-dimension short/long factors)",
    "proportional": "megatron-core has no proportional RoPE",
}


def get_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention-factor term, as both transformers and megatron-core compute it."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def attention_factor(factor: float, mscale: float, mscale_all_dim: float) -> float:
    """megatron-core's concentration factor (_yarn_get_concentration_factor) for our fields."""
    return float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim))


def yarn_meta(p: dict, max_position_embeddings: int, refuse) -> dict:
    """GPTConfig's YaRN fields from a standardized HF rope_parameters dict; refuse(what, fix) otherwise."""
    original = p.get("original_max_position_embeddings") or max_position_embeddings
    factor = p.get("factor")
    factor = float(max_position_embeddings / original if factor is None else factor)   # HF's rule for None
    ms, ms_all = p.get("mscale"), p.get("mscale_all_dim")
    pairs = [(float(ms), float(ms_all))] if ms is not None and ms_all is not None else []
    if p.get("attention_factor") is None:
        pair = (float(ms), float(ms_all)) if ms and ms_all else (1.0, 0.0)
    else:
        want = float(p["attention_factor"])
        pair = next((q for q in pairs + [(1.0, 0.0)] if attention_factor(factor, *q) == want), None)
        if pair is None:
            refuse(f"yarn attention_factor={want}", "megatron-core derives it from factor, mscale and mscale_all_dim: "
                   f"get_mscale({factor:g}, mscale) / get_mscale({factor:g}, mscale_all_dim) = "
                   f"{attention_factor(factor, *(pairs or [(1.0, 0.0)])[0])}; drop attention_factor or give "
                   "the mscale pair that yields it")
    return dict(position_embedding_type="yarn", rotary_scaling_factor=factor,
                yarn_original_max_position_embeddings=int(original),
                yarn_beta_fast=float(p.get("beta_fast") or 32.0), yarn_beta_slow=float(p.get("beta_slow") or 1.0),
                yarn_correction_range_round_to_int=bool(p.get("truncate", True)), mscale=pair[0], mscale_all_dim=pair[1])


def yarn_parameters(meta: dict) -> dict:
    """HF's rope_parameters (less rope_theta) for our YaRN fields, read back by yarn_meta as the same."""
    m = {k: meta.get(k, v) for k, v in YARN_FIELDS.items()}
    out = dict(rope_type="yarn", factor=float(m["rotary_scaling_factor"]),
               original_max_position_embeddings=int(m["yarn_original_max_position_embeddings"]))
    for hf_key, ours in (("beta_fast", "yarn_beta_fast"), ("beta_slow", "yarn_beta_slow"),
                         ("truncate", "yarn_correction_range_round_to_int")):
        if m[ours] != YARN_FIELDS[ours]:        # HF's defaults are megatron-core's: only what differs
            out[hf_key] = type(YARN_FIELDS[ours])(m[ours])
    pair = (float(m["mscale"]), float(m["mscale_all_dim"]))
    if pair[0] and pair[1]:                     # HF takes the same ratio
        out.update(mscale=pair[0], mscale_all_dim=pair[1])
    elif pair != (1.0, 0.0):                    # HF would take get_mscale(factor): say the factor itself
        out.update(attention_factor=attention_factor(out["factor"], *pair), mscale=pair[0], mscale_all_dim=pair[1])
    return out
