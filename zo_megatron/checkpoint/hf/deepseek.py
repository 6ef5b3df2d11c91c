"""Hugging Face DeepSeek-V3 and DeepSeek-V2 (`DeepseekV3ForCausalLM`, `DeepseekV2ForCausalLM`) <-> zo_megatron's
GPT with multi-latent attention (model/mla.py: megatron-core's MLASelfAttention) and DeepSeekMoE layers
(megatron-core's MoELayer with shared experts; docs/moe.md).

Both are one decoder, RMSNorm, SwiGLU, the first `first_k_dense_replace` layers dense and the rest mixtures of
experts with n_shared_experts always-on experts; their differences are data (`VARIANTS`): V3's router scores
with a sigmoid and picks with a bias (e_score_correction_bias), V2's with a softmax; V3 may store its rotary
channels interleaved or not (`rope_interleave`), V2 always rotates interleaved pairs (complex numbers); V3's
files may hold multi-token-prediction layers. On disk (what transformers' save_pretrained writes, whatever
layout its model keeps the experts in memory, and what DeepSeek's own releases hold):

    HF (model.layers.{i}.)                    megatron-core (decoder.layers.{i}.)
    input_layernorm, post_attention_layernorm -> input_layernorm, pre_mlp_layernorm
    self_attn.q_a_proj [r_q, h]             -> self_attention.linear_q_down_proj
    self_attn.q_a_layernorm [r_q]           -> self_attention.q_layernorm      (--qk-layernorm: HF always has it)
    self_attn.q_b_proj [n (d_n + d_r), r_q] -> self_attention.linear_q_up_proj (q_lora_rank null: q_proj [., h]
                                                                                 -> linear_q_proj)
    self_attn.kv_a_proj_with_mqa [r_kv + d_r, h] -> self_attention.linear_kv_down_proj
    self_attn.kv_a_layernorm [r_kv]         -> self_attention.kv_layernorm
    self_attn.kv_b_proj [n (d_n + d_v), r_kv] -> self_attention.linear_kv_up_proj
    self_attn.o_proj [h, n d_v]             -> self_attention.linear_proj
    mlp.gate_proj, up_proj, down_proj       -> mlp.linear_fc1 [gate; up], linear_fc2     (a dense layer)
    mlp.gate.weight [E, h]                  -> mlp.router.weight
    mlp.gate.e_score_correction_bias [E]    -> mlp.router.expert_bias   (V3; a persistent buffer, checkpoints'
                                                                         buffers/, --moe-router-enable-expert-bias)
    mlp.experts.{e}.gate_proj/up_proj/down_proj -> mlp.experts.local_experts.{e}.linear_fc1 [gate; up] / linear_fc2
    mlp.shared_experts.gate_proj/up_proj/down_proj -> mlp.shared_experts.linear_fc1 [gate; up] / linear_fc2

with (HF -> megatron-core) q_lora_rank -> --q-lora-rank, kv_lora_rank -> --kv-lora-rank, qk_nope_head_dim ->
--qk-head-dim, qk_rope_head_dim -> --qk-pos-emb-head-dim, v_head_dim -> --v-head-dim, intermediate_size ->
--ffn-hidden-size (dense layers), moe_intermediate_size -> --moe-ffn-hidden-size, n_shared_experts x
moe_intermediate_size -> --moe-shared-expert-intermediate-size (no gate), first_k_dense_replace -> --moe-layer-freq
[0,..,0,1,..,1], n_routed_experts / num_experts_per_tok -> --num-experts / --moe-router-topk, routed_scaling_factor
-> --moe-router-topk-scaling-factor. Everything else is refused in one line naming the config field where it
has no exact mapping.

Rotary channels. megatron-core's MLA de-interleaves the d_r rotary channels of each query head and of the shared
key (x[0::2], x[1::2]) and rotates the halves: the pairs (x_2j, x_2j+1), which is V2's complex rotation and
V3's with rope_interleave true, so those map as they are. V3 with rope_interleave false rotates (x_j, x_j+d_r/2):
from-hf interleaves those rows of q_b_proj / q_proj (per head) and kv_a_proj_with_mqa (ours[2j] = hf[j],
ours[2j+1] = hf[j + d_r/2]), the same function exactly. to-hf writes rope_interleave true and the rows as ours
(the family interface gives it no record of the source's layout): HF -> ours -> HF is bit for bit for the
interleaved layout (every DeepSeek release's) and the same function, rows permuted, for the other.

RoPE. rope_type default -> --rope-type rope (rope_theta -> --rotary-base); yarn -> --rope-type yarn with factor,
original_max_position_embeddings, beta_fast, beta_slow, mscale, mscale_all_dim as hf/rope.py maps them, except
that MLA's softmax scale is read too: transformers (yarn_apply_mscale) and megatron-core's MLASelfAttention both
scale it by get_mscale(factor, mscale_all_dim)^2, so mscale_all_dim maps as it is and mscale is chosen so that
megatron-core's rotary factor get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim) is exactly the one
transformers computes (its attention_factor, or that ratio when mscale and mscale_all_dim are both non-zero, else
get_mscale(factor)); refused where no float does. truncate false is refused (megatron-core 0.16's MLA rounds the
correction range). The latent norms: transformers' (and DeepSeek's) q_a_layernorm / kv_a_layernorm use eps 1e-6
whatever rms_norm_eps, megatron-core's MLA gives them --norm-epsilon: only rms_norm_eps 1e-6 converts (every
DeepSeek release's).

The router. V3: sigmoid scores s, the top k of s + e_score_correction_bias among the topk_group groups (of
n_group) with the largest sum of their top 2 (s + bias), weights s of the chosen, divided by their sum
(+1e-20) when norm_topk_prob, times routed_scaling_factor. megatron-core's sigmoid router with the expert bias
computes the same, its groups scored by the sum of their top topk // group_topk: equal where that is 2 (DeepSeek-V3:
8 // 4), or where the groups cannot matter (topk_group = n_group: no groups); it renormalises for k > 1 and not
for k = 1, so norm_topk_prob must be true for k > 1 and false for k = 1. V2: softmax over all experts, the top k
(topk_method greedy) or the top k among the topk_group groups with the largest MAX score (group_limited_greedy),
never renormalised (transformers' DeepseekV2 does not read norm_topk_prob: a true one, which DeepSeek's own code
would apply, is refused), times routed_scaling_factor: --moe-router-pre-softmax, groups where a group's max is
megatron-core's sum of its top topk // group_topk = 1 score, or where they cannot matter. A routed_scaling_factor
of 1 is no factor.

Multi-token prediction (V3's num_nextn_predict_layers: DeepSeek-V3's files hold model.layers.61.*, after the 61
decoder layers) is left out, and from-hf says so in one line: transformers' DeepseekV3ForCausalLM does not build it
either (it ignores those tensors on load), it plays no part in the model's logits, and zo_megatron's GPT has no MTP
module to train it with; to-hf writes num_nextn_predict_layers 0.

The load-balancing losses are not converted (the aux loss coefficient is 0, as for the other MoE families):
transformers computes none for either model. DeepSeek-V2's own training adds an expert-level loss
alpha_1 sum_i f_i P_i (f_i = E / (k T) x the tokens routed to i, P_i the mean softmax score of i over the T
tokens), plus device- and communication-level ones, per sequence when seq_aux; megatron-core's aux_loss is
E sum_i f'_i P_i with f'_i = the tokens routed to i / (k T), i.e. the same expert-level term (seq_aux_loss:
per sequence), with no device or communication terms. DeepSeek-V3 trains without it (aux-loss-free: the bias
moves, --moe-router-bias-update-rate) plus a tiny sequence-wise loss alpha sum_i f_i P_i over the sigmoid scores
normalised over all experts, which is megatron-core's seq_aux_loss with the sigmoid score function.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

from zo_megatron.checkpoint.arch import buffer_shapes, full_meta, param_shapes
from zo_megatron.checkpoint.hf import llama
from zo_megatron.checkpoint.hf.experts import QWEN_NAMES, experts_from_hf, experts_to_hf, swiglu_from_hf, swiglu_to_hf
from zo_megatron.checkpoint.hf.family import VariantFamily, read_checked_state_dict, stored_tensor_names
from zo_megatron.checkpoint.hf.rope import attention_factor, get_mscale
from zo_megatron.errors import UserError
from zo_megatron.model.config import ARCH_FIELDS, YARN_FIELDS, GPTConfig, rotary_base

_OURS = "gpt."
# the latent norms' epsilon in transformers' (and DeepSeek's) attention: DeepseekV3RMSNorm's default
LATENT_NORM_EPS = 1e-6
# HF attention module -> our MLA module (names one to one: tests/test_mla.py)
_ATTN = (("q_proj", "linear_q_proj"), ("q_a_proj", "linear_q_down_proj"), ("q_a_layernorm", "q_layernorm"),
         ("q_b_proj", "linear_q_up_proj"), ("kv_a_proj_with_mqa", "linear_kv_down_proj"),
         ("kv_a_layernorm", "kv_layernorm"), ("kv_b_proj", "linear_kv_up_proj"), ("o_proj", "linear_proj"))
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


@dataclass(frozen=True)
class Variant:
    architecture: str
    model_type: str
    config_class: str
    score_function: str         # the router's: "sigmoid" (V3, with e_score_correction_bias) or "softmax" (V2)
    topk_methods: tuple         # the config's topk_method values transformers' model computes (V3: it reads none)
    rope_interleave_field: bool  # the config says whether the rotary rows are interleaved (V3); V2 always is
    mtp: bool                   # multi-token-prediction layers may follow the decoder in the files (V3)
    group_score_topk: int       # a group's score: the sum of its top N scores (V3: 2; V2: 1, its max)


VARIANTS = (Variant("DeepseekV3ForCausalLM", "deepseek_v3", "DeepseekV3Config", "sigmoid", (None, "noaux_tc"), True,
                    True, 2),
            Variant("DeepseekV2ForCausalLM", "deepseek_v2", "DeepseekV2Config", "softmax",
                    ("greedy", "group_limited_greedy"), False, False, 1))


# ---- rope

def _yarn_meta(p: dict, max_position_embeddings: int, refuse) -> dict:
    """The YaRN fields of MLA for a standardized HF yarn rope_parameters (module docstring: RoPE)."""
    if p.get("truncate") is False:
        refuse("rope_parameters truncate=false", "megatron-core 0.16's MLA builds YaRN with the correction range "
               "rounded (truncate true): no exact mapping")
    original = p.get("original_max_position_embeddings") or max_position_embeddings
    factor = p.get("factor")
    factor = float(max_position_embeddings / original if factor is None else factor)   # HF's rule for None
    ms, ms_all = p.get("mscale"), p.get("mscale_all_dim")
    scale_all = float(ms_all or 0.0)                 # the softmax's: get_mscale(factor, mscale_all_dim)^2 both sides
    if p.get("attention_factor") is not None:
        target = float(p["attention_factor"])
    elif ms and ms_all:
        target = attention_factor(factor, float(ms), float(ms_all))
    else:
        target = float(get_mscale(factor))
    candidates = ([float(ms)] if ms is not None else []) + [1.0]
    if factor > 1:                                   # get_mscale(f, m) = 0.1 m ln f + 1: solve for m, then
        lo = hi = (target * get_mscale(factor, scale_all) - 1.0) / (0.1 * math.log(factor))   # the floats near it
        candidates.append(lo)
        for _ in range(16):
            lo, hi = math.nextafter(lo, -math.inf), math.nextafter(hi, math.inf)
            candidates += [lo, hi]
    mscale = next((m for m in candidates if attention_factor(factor, m, scale_all) == target), None)
    if mscale is None:
        refuse(f"yarn attention factor {target!r} with mscale_all_dim={scale_all:g}",
               "megatron-core's MLA derives it as get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim) "
               "and no float mscale gives it exactly")
    return dict(rope_type="yarn", rotary_scaling_factor=factor, yarn_original_max_position_embeddings=int(original),
                yarn_beta_fast=float(p.get("beta_fast") or 32.0), yarn_beta_slow=float(p.get("beta_slow") or 1.0),
                yarn_correction_range_round_to_int=True, mscale=mscale, mscale_all_dim=scale_all)


def _rope_meta(cfg, refuse) -> dict:
    p = llama._rope_params(cfg)
    if "per_layer_type" in p:
        refuse(f"rope_parameters per layer type {p['per_layer_type']}", "one RoPE for every layer is supported")
    partial = p.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", None))
    if partial not in (None, 1, 1.0):
        refuse(f"partial_rotary_factor={partial}", "MLA rotates all qk_rope_head_dim channels")
    out = dict(position_embedding_type="rope", rotary_base=rotary_base(p.get("rope_theta", 10000.0)),
               rotary_percent=1.0, use_rope_scaling=False, rope_scaling_factor=8.0, **YARN_FIELDS)
    kind = p["rope_type"]
    if kind == "default":
        out["rope_type"] = "rope"
    elif kind == "yarn":
        out.update(_yarn_meta(p, cfg.max_position_embeddings, refuse))
    else:
        refuse(f"rope_type={kind!r}", "megatron-core's MLA has RoPE (default) and YaRN (yarn) only")
    return out


def rope_parameters(meta: dict) -> dict:
    """HF's rope_parameters for the model's MLA rope (read back by _rope_meta as the same)."""
    params = {"rope_type": "default", "rope_theta": float(meta["rotary_base"])}
    if meta["rope_type"] != "yarn":
        return params
    f, m, a = float(meta["rotary_scaling_factor"]), float(meta["mscale"]), float(meta["mscale_all_dim"])
    params.update(rope_type="yarn", factor=f,
                  original_max_position_embeddings=int(meta["yarn_original_max_position_embeddings"]),
                  beta_fast=float(meta["yarn_beta_fast"]), beta_slow=float(meta["yarn_beta_slow"]), mscale=m,
                  mscale_all_dim=a)
    ours = attention_factor(f, m, a)
    if not (m and a) and ours != get_mscale(f):     # HF would take get_mscale(factor): say the factor itself
        params["attention_factor"] = ours
    return params


def _rope_schemas(meta: dict) -> tuple[dict, dict]:
    params = rope_parameters(meta)
    scaling = None if params["rope_type"] == "default" else {k: v for k, v in params.items() if k != "rope_theta"}
    return {"rope_parameters": params}, {"rope_theta": params["rope_theta"], "rope_scaling": scaling}


# ---- the router

def _moe_meta(v: Variant, cfg, refuse) -> dict:
    """The MoE fields (empty for a model without MoE layers)."""
    n = cfg.num_hidden_layers
    first = cfg.first_k_dense_replace
    if not isinstance(first, int) or first < 0:
        refuse(f"first_k_dense_replace={first!r}", "transformers builds experts from that layer on: give an integer "
               ">= 0")
    freq = getattr(cfg, "moe_layer_freq", 1)
    if freq not in (None, 1):
        refuse(f"moe_layer_freq={freq}", f"transformers' {v.architecture} ignores it (every layer from "
               "first_k_dense_replace on has experts) while DeepSeek's own code makes only every N-th one sparse: "
               "the model is ambiguous; only 1 converts")
    sparse = [int(i >= first) for i in range(n)]
    if not any(sparse):
        return {}
    e, k, f = cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size
    if not isinstance(e, int) or e < 1:
        refuse(f"n_routed_experts={e!r}", "layers from first_k_dense_replace on have experts: give their number")
    if not isinstance(k, int) or not 1 <= k <= e:
        refuse(f"num_experts_per_tok={k!r}", f"must be between 1 and n_routed_experts={e}")
    if not isinstance(f, int) or f < 1:
        refuse(f"moe_intermediate_size={f!r}", "the experts' FFN size must be >= 1")
    shared = cfg.n_shared_experts
    if not isinstance(shared, int) or shared < 1:
        refuse(f"n_shared_experts={shared!r}", f"transformers' {v.architecture} builds a shared expert of "
               "n_shared_experts x moe_intermediate_size: a model without one is not mapped")
    scoring = getattr(cfg, "scoring_func", None)
    if scoring not in (None, v.score_function):
        refuse(f"scoring_func={scoring!r}", f"transformers' {v.architecture} scores with a {v.score_function} "
               "whatever this field says (DeepSeek's own code reads it): the model is ambiguous")
    method = getattr(cfg, "topk_method", None)
    if method not in v.topk_methods:
        refuse(f"topk_method={method!r}", f"transformers' {v.architecture} routes as "
               f"{' or '.join(m for m in v.topk_methods if m)} (DeepSeek's own code reads the field): no exact mapping")
    scale = float(cfg.routed_scaling_factor)
    if not scale > 0:
        refuse(f"routed_scaling_factor={cfg.routed_scaling_factor}", "megatron-core's top-k scaling factor must be "
               "> 0 (it ignores 0)")
    out = dict(num_experts=e, moe_router_topk=k, moe_ffn_hidden_size=f, moe_shared_expert_intermediate_size=shared * f,
               moe_shared_expert_gate=False, moe_layer_freq=1 if all(sparse) else sparse,
               moe_router_topk_scaling_factor=None if scale == 1.0 else scale,
               moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.0)
    groups, picked = cfg.n_group, cfg.topk_group
    if v.score_function == "sigmoid":
        if k > 1 and not cfg.norm_topk_prob:
            refuse(f"norm_topk_prob=false with num_experts_per_tok={k}", "megatron-core's sigmoid router always "
                   "divides the top-k weights by their sum for k > 1: no exact mapping")
        if k == 1 and cfg.norm_topk_prob:
            refuse("norm_topk_prob=true with num_experts_per_tok=1", "HF divides the one weight by itself (1), "
                   "megatron-core's sigmoid router keeps it: no exact mapping")
        out.update(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                   moe_router_pre_softmax=False)
        grouped = True                      # transformers' DeepseekV3 router always groups
    else:
        if cfg.norm_topk_prob:
            refuse("norm_topk_prob=true", "transformers' DeepseekV2 never renormalises the top-k weights (it does "
                   "not read the field) while DeepSeek-V2's own code does: the model is ambiguous; only false converts")
        out.update(moe_router_score_function="softmax", moe_router_pre_softmax=True)
        grouped = method == "group_limited_greedy"
    if grouped:
        what = f"n_group={groups!r}, topk_group={picked!r}"
        if not isinstance(groups, int) or groups < 1 or e % groups:
            refuse(what, f"transformers' router splits the {e} experts into n_group equal groups: give a divisor")
        if not isinstance(picked, int) or not 1 <= picked <= groups:
            refuse(what, "topk_group must be between 1 and n_group")
        if e // groups < v.group_score_topk:
            refuse(what, f"transformers' router scores each group by its top {v.group_score_topk} experts: a group "
                   f"needs >= {v.group_score_topk}")
        if k > picked * (e // groups):
            refuse(f"num_experts_per_tok={k} with {what}", f"more experts than the {picked} groups hold: HF would "
                   "pick masked ones, megatron-core refuses it")
        if picked < groups:                 # with every group picked the groups change nothing
            if k // picked != v.group_score_topk:
                refuse(f"{what} with num_experts_per_tok={k}", f"{v.architecture} scores a group by "
                       f"{'the sum of its top 2 scores' if v.group_score_topk == 2 else 'its largest score'}, "
                       f"megatron-core by the sum of its top num_experts_per_tok // topk_group = {k // picked}: "
                       "no exact mapping")
            out.update(moe_router_num_groups=groups, moe_router_group_topk=picked)
    return out


# ---- the tensors

def _interleave(t: torch.Tensor, rows: int, d_r: int, head: int) -> torch.Tensor:
    """The last d_r of every `head` rows of t ([rows, ...]) from rotate-half order to interleaved pairs."""
    t = t.reshape(rows // head, head, *t.shape[1:])
    nope, rope = t.split([head - d_r, d_r], dim=1)
    rope = torch.stack(rope.split(d_r // 2, dim=1), dim=2).reshape(rope.shape)
    return torch.cat([nope, rope], dim=1).reshape(rows, *t.shape[2:])


def _deinterleave(t: torch.Tensor, rows: int, d_r: int, head: int) -> torch.Tensor:
    """The inverse of _interleave."""
    t = t.reshape(rows // head, head, *t.shape[1:])
    nope, rope = t.split([head - d_r, d_r], dim=1)
    rope = torch.cat([rope[:, 0::2], rope[:, 1::2]], dim=1)
    return torch.cat([nope, rope], dim=1).reshape(rows, *t.shape[2:])


def _rope_rows(meta: dict) -> dict[str, int]:
    """Our MLA projection -> the rows of each block whose last qk_pos_emb_head_dim rows are rotary."""
    return {"linear_q_proj": meta["qk_head_dim"] + meta["qk_pos_emb_head_dim"],
            "linear_q_up_proj": meta["qk_head_dim"] + meta["qk_pos_emb_head_dim"],
            "linear_kv_down_proj": meta["kv_lora_rank"] + meta["qk_pos_emb_head_dim"]}


def _moe_layers(meta: dict) -> list[bool]:
    return GPTConfig(**{k: meta[k] for k in ARCH_FIELDS}, precision="fp32", attention_backend="sdpa").moe_layers()


def from_hf(sd: dict[str, torch.Tensor], meta: dict, rope_interleave: bool = True) -> dict[str, torch.Tensor]:
    """HF state dict as on disk (full) -> our full tensors (experts by global index) and the expert bias
    buffers under their names; rope_interleave false: the rotary rows interleaved (module docstring)."""
    out = {_OURS + "embedding.word_embeddings.weight": sd["model.embed_tokens.weight"],
           _OURS + "decoder.final_layernorm.weight": sd["model.norm.weight"]}
    if "lm_head.weight" in sd and meta["untie_embeddings_and_output_weights"]:
        out[_OURS + "output_layer.weight"] = sd["lm_head.weight"]
    moe, blocks = _moe_layers(meta), _rope_rows(meta)
    for i in range(meta["num_layers"]):
        h, m = f"model.layers.{i}.", f"{_OURS}decoder.layers.{i}."
        out[m + "input_layernorm.weight"] = sd[h + "input_layernorm.weight"]
        out[m + "pre_mlp_layernorm.weight"] = sd[h + "post_attention_layernorm.weight"]
        for theirs, ours in _ATTN:
            if f"{h}self_attn.{theirs}.weight" in sd:
                t = sd[f"{h}self_attn.{theirs}.weight"]
                if not rope_interleave and ours in blocks:
                    t = _interleave(t, t.shape[0], meta["qk_pos_emb_head_dim"], blocks[ours])
                out[f"{m}self_attention.{ours}.weight"] = t
        if not moe[i]:
            out.update(swiglu_from_hf(sd, h + "mlp.", m + "mlp.", QWEN_NAMES))
            continue
        out.update(experts_from_hf(sd, h + "mlp.", m + "mlp.", meta["num_experts"], QWEN_NAMES))
        out.update(swiglu_from_hf(sd, h + "mlp.shared_experts.", m + "mlp.shared_experts.", QWEN_NAMES))
        if meta["moe_router_enable_expert_bias"]:
            out[m + "mlp.router.expert_bias"] = sd[h + "mlp.gate.e_score_correction_bias"]
    return {k: v.contiguous() for k, v in out.items()}


def to_hf(weights: dict[str, torch.Tensor], meta: dict, expert_bias: bool) -> dict[str, torch.Tensor]:
    """Our full tensors (with the expert bias buffers, where the model has them) -> HF state dict in the on-disk
    layout (no lm_head when tied; expert_bias: write each MoE layer's e_score_correction_bias, zeros where
    the model has none)."""
    out = {"model.embed_tokens.weight": weights[_OURS + "embedding.word_embeddings.weight"],
           "model.norm.weight": weights[_OURS + "decoder.final_layernorm.weight"]}
    if _OURS + "output_layer.weight" in weights:
        out["lm_head.weight"] = weights[_OURS + "output_layer.weight"]
    moe = _moe_layers(meta)
    for i in range(meta["num_layers"]):
        h, m = f"model.layers.{i}.", f"{_OURS}decoder.layers.{i}."
        out[h + "input_layernorm.weight"] = weights[m + "input_layernorm.weight"]
        out[h + "post_attention_layernorm.weight"] = weights[m + "pre_mlp_layernorm.weight"]
        for theirs, ours in _ATTN:
            if f"{m}self_attention.{ours}.weight" in weights:
                out[f"{h}self_attn.{theirs}.weight"] = weights[f"{m}self_attention.{ours}.weight"]
        if not moe[i]:
            out.update(swiglu_to_hf(weights, m + "mlp.", h + "mlp.", meta["ffn_hidden_size"], QWEN_NAMES))
            continue
        out.update(experts_to_hf(weights, m + "mlp.", h + "mlp.", meta["num_experts"], meta["moe_ffn_hidden_size"],
                                 QWEN_NAMES))
        out.update(swiglu_to_hf(weights, m + "mlp.shared_experts.", h + "mlp.shared_experts.",
                                meta["moe_shared_expert_intermediate_size"], QWEN_NAMES))
        if expert_bias:
            bias = weights.get(m + "mlp.router.expert_bias")
            out[h + "mlp.gate.e_score_correction_bias"] = torch.zeros(meta["num_experts"], dtype=torch.float32) \
                if bias is None else bias
    return {k: v.clone(memory_format=torch.contiguous_format) for k, v in out.items()}


def _zeros(meta: dict) -> dict[str, torch.Tensor]:
    """Storage-free stand-ins of our full tensors and buffers (meta device), to derive the HF names and shapes."""
    return {k: torch.empty(shape, device="meta") for k, shape in {**param_shapes(meta), **buffer_shapes(meta)}.items()}


# ---- the family object

class DeepseekFamily(VariantFamily):
    def __init__(self, variant: Variant):
        super().__init__(variant)
        # transformers keeps the router in fp32 (_keep_in_fp32_modules_strict): its bias decides the experts
        self.fp32_tensors = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias")

    def meta_from_config(self, cfg, where: str) -> tuple[dict, dict]:
        def refuse(what, why):
            raise UserError(f"{where}: {what}: {why}")

        quant = getattr(cfg, "quantization_config", None)
        if quant:
            method = quant.get("quant_method") if isinstance(quant, dict) else getattr(quant, "quant_method", None)
            refuse(f"quantization_config (quant_method={method!r})", "quantized weights (DeepSeek-V3's FP8 blocks "
                   "and their weight_scale_inv) are not converted: dequantize to bf16 first (DeepSeek's "
                   "fp8_cast_bf16.py) and drop quantization_config")
        if cfg.hidden_act != "silu":
            refuse(f"hidden_act={cfg.hidden_act!r}", "the MLPs must be SwiGLU (silu), megatron's --swiglu")
        if cfg.attention_bias:
            refuse("attention_bias=true", "megatron-core's MLA projections have no biases")
        if getattr(cfg, "mlp_bias", False):
            refuse("mlp_bias=true", "megatron-core's shared experts have no biases, and its dense MLP and experts "
                   "take them only with every linear layer's")
        heads = cfg.num_attention_heads
        if cfg.num_key_value_heads not in (None, heads):
            refuse(f"num_key_value_heads={cfg.num_key_value_heads}", f"MLA has no key/value groups: transformers' "
                   f"MLA repeats its per-head keys num_attention_heads / num_key_value_heads times, which computes "
                   f"only with num_key_value_heads = num_attention_heads = {heads}")
        if float(cfg.rms_norm_eps) != LATENT_NORM_EPS:
            refuse(f"rms_norm_eps={cfg.rms_norm_eps}", f"transformers' (and DeepSeek's) q/kv latent norms use eps "
                   f"{LATENT_NORM_EPS:g} whatever rms_norm_eps, megatron-core's MLA gives them --norm-epsilon: "
                   f"only {LATENT_NORM_EPS:g} converts")
        if self.variant.mtp:
            extra = getattr(cfg, "num_nextn_predict_layers", 0) or 0
            if not isinstance(extra, int) or extra < 0:
                refuse(f"num_nextn_predict_layers={extra!r}", "must be an integer >= 0")
        h = cfg.hidden_size
        meta = dict(num_layers=cfg.num_hidden_layers, hidden_size=h, num_attention_heads=heads,
                    ffn_hidden_size=cfg.intermediate_size, vocab_size=cfg.vocab_size,
                    max_position_embeddings=cfg.max_position_embeddings, make_vocab_size_divisible_by=128,
                    **_rope_meta(cfg, refuse), normalization="RMSNorm", layernorm_epsilon=float(cfg.rms_norm_eps),
                    swiglu=True, num_query_groups=heads, kv_channels=h // heads if h % heads == 0 else cfg.v_head_dim,
                    untie_embeddings_and_output_weights=not cfg.tie_word_embeddings, add_bias_linear=False,
                    add_qkv_bias=False, qk_layernorm=True, multi_latent_attention=True, q_lora_rank=cfg.q_lora_rank,
                    kv_lora_rank=cfg.kv_lora_rank, qk_head_dim=cfg.qk_nope_head_dim,
                    qk_pos_emb_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim,
                    **_moe_meta(self.variant, cfg, refuse))
        args = {"hidden_dropout": 0.0, "attention_dropout": float(getattr(cfg, "attention_dropout", 0.0) or 0.0)}
        return full_meta(meta), args

    def _rope_interleave(self, cfg) -> bool:
        return bool(getattr(cfg, "rope_interleave", True)) if self.variant.rope_interleave_field else True

    def _mtp_layer(self, cfg):
        """name -> True for a tensor of the multi-token-prediction layers after the decoder's."""
        n = cfg.num_hidden_layers
        extra = (getattr(cfg, "num_nextn_predict_layers", 0) or 0) if self.variant.mtp else 0

        def is_mtp(name: str) -> bool:
            match = _LAYER.match(name)
            return match is not None and n <= int(match.group(1)) < n + extra
        return is_mtp

    def read_state(self, input_dir: str, cfg, meta: dict) -> dict[str, torch.Tensor]:
        expected = {k: tuple(v.shape) for k, v in
                    to_hf(_zeros(meta), meta, meta["moe_router_enable_expert_bias"]).items()}
        sd = read_checked_state_dict(input_dir, meta, expected, self.architecture,
                                     " (layers, q_lora_rank and tying must agree)", drop=self._mtp_layer(cfg))
        return from_hf(sd, meta, self._rope_interleave(cfg))

    def left_out(self, input_dir: str, cfg) -> str | None:
        is_mtp = self._mtp_layer(cfg)
        # (None: a file cannot be read, which reading the weights then says in one line)
        names = sorted(k for k in stored_tensor_names(input_dir) or () if is_mtp(k))
        if not names:
            return None
        layers = sorted({int(_LAYER.match(k).group(1)) for k in names})
        return (f"the multi-token-prediction layer{'s' if len(layers) > 1 else ''} (num_nextn_predict_layers="
                f"{cfg.num_nextn_predict_layers}: {len(names)} tensors model.layers.{'/'.join(map(str, layers))}.*), "
                f"which transformers' {self.architecture} does not build either and zo_megatron's GPT has no "
                "module for; to-hf writes num_nextn_predict_layers 0")

    def why_not(self, meta: dict) -> str | None:
        meta, v, arch = full_meta(meta), self.variant, self.architecture
        if not meta["multi_latent_attention"]:
            return f"{arch} has multi-latent attention (multi_latent_attention=False)"
        needs = (("normalization", "RMSNorm", "RMSNorm"), ("swiglu", True, "a SwiGLU MLP"),
                 ("add_bias_linear", False, "no linear biases"),
                 ("qk_layernorm", True, "RMS norms on the query and key/value latents (--qk-layernorm)"),
                 ("position_embedding_type", "rope", "MLA's rotary embedding only (no learned positions)"),
                 ("rotary_percent", 1.0, "every qk_pos_emb_head_dim channel rotated"),
                 ("layernorm_epsilon", LATENT_NORM_EPS, f"latent norms with eps {LATENT_NORM_EPS:g}, so norms with "
                                                        f"eps {LATENT_NORM_EPS:g} throughout"))
        for key, want, what in needs:
            if meta[key] != want:
                return f"{arch} has {what} ({key}={meta[key]!r})"
        if meta["rope_type"] == "rope" and get_mscale(meta["rotary_scaling_factor"], meta["mscale_all_dim"]) != 1.0:
            return (f"{arch}'s plain RoPE leaves the softmax unscaled (the model scales it by get_mscale("
                    f"{meta['rotary_scaling_factor']:g}, {meta['mscale_all_dim']:g})^2 without YaRN)")
        if meta["num_experts"] is None:
            return self._config_refuses(meta)
        e, k = meta["num_experts"], meta["moe_router_topk"]
        if meta["moe_router_score_function"] != v.score_function:
            return f"{arch} has a {v.score_function} router (moe_router_score_function=" \
                   f"{meta['moe_router_score_function']!r})"
        if v.score_function == "softmax" and not meta["moe_router_pre_softmax"]:
            return f"{arch} never renormalises the top-k softmax weights (--moe-router-pre-softmax)"
        needs = (("moe_shared_expert_gate", False, "an ungated shared expert"),
                 ("moe_expert_capacity_factor", None, "no expert capacity (it drops no tokens)"))
        for key, want, what in needs:
            if meta[key] != want:
                return f"{arch} has {what} ({key}={meta[key]!r})"
        shared, f = meta["moe_shared_expert_intermediate_size"], meta["moe_ffn_hidden_size"]
        if not shared or shared % f:
            return (f"{arch} has n_shared_experts x moe_intermediate_size {f} of shared experts "
                    f"(moe_shared_expert_intermediate_size={shared})")
        layers = _moe_layers(meta)
        first = layers.index(True) if any(layers) else len(layers)
        if layers != [i >= first for i in range(len(layers))]:
            return f"{arch}'s experts are in every layer from first_k_dense_replace on (moe_layer_freq=" \
                   f"{meta['moe_layer_freq']!r})"
        groups, picked = meta["moe_router_num_groups"], meta["moe_router_group_topk"]
        if picked and k // picked != v.group_score_topk:
            how = "the sum of its top 2 scores" if v.group_score_topk == 2 else "its max"
            return (f"{arch} scores a group by {how}, the model by the sum of its top moe_router_topk // "
                    f"moe_router_group_topk = {k // picked}")
        if v.score_function == "sigmoid" and e // (groups or 1) < v.group_score_topk:
            return f"{arch}'s router scores groups of >= 2 experts ({e // (groups or 1)} per group)"
        return self._config_refuses(meta)

    def to_hf_state(self, weights: dict[str, torch.Tensor], meta: dict) -> dict[str, torch.Tensor]:
        return to_hf(weights, full_meta(meta), self.variant.score_function == "sigmoid")

    def config_json_extra(self, meta: dict) -> dict:
        """transformers 4.x reads rope_theta and rope_scaling, 5.x writes only rope_parameters: both."""
        v5, v4 = _rope_schemas(full_meta(meta))
        return v4 if llama._reads_rope_parameters(self._config_class()) else v5

    def hf_config(self, meta: dict, *, dtype: str, args: dict, bos_token_id, eos_token_id, window: dict | None = None):
        assert window is None, "DeepSeek has no sliding window"
        meta, v = full_meta(meta), self.variant
        cls = self._config_class()
        layers = _moe_layers(meta)
        v5, v4 = _rope_schemas(meta)
        kw = dict(vocab_size=meta["vocab_size"], hidden_size=meta["hidden_size"],
                  intermediate_size=meta["ffn_hidden_size"], num_hidden_layers=meta["num_layers"],
                  num_attention_heads=meta["num_attention_heads"], num_key_value_heads=meta["num_attention_heads"],
                  hidden_act="silu", max_position_embeddings=meta["max_position_embeddings"],
                  rms_norm_eps=meta["layernorm_epsilon"],
                  tie_word_embeddings=not meta["untie_embeddings_and_output_weights"],
                  attention_bias=False, attention_dropout=float(args.get("attention_dropout") or 0.0),
                  bos_token_id=bos_token_id, eos_token_id=eos_token_id, architectures=[self.architecture], dtype=dtype,
                  q_lora_rank=meta["q_lora_rank"], kv_lora_rank=meta["kv_lora_rank"],
                  qk_nope_head_dim=meta["qk_head_dim"], qk_rope_head_dim=meta["qk_pos_emb_head_dim"],
                  v_head_dim=meta["v_head_dim"],
                  first_k_dense_replace=layers.index(True) if any(layers) else len(layers),
                  **(v5 if llama._reads_rope_parameters(cls) else v4))
        if v.rope_interleave_field:
            kw.update(rope_interleave=True)              # our rotary rows' layout (module docstring)
        if v.mtp:
            kw.update(num_nextn_predict_layers=0)        # no multi-token-prediction layers are written
        if v.score_function == "softmax":
            kw.update(mlp_bias=False, norm_topk_prob=False)
        if meta["num_experts"] is not None:
            e, k, f = meta["num_experts"], meta["moe_router_topk"], meta["moe_ffn_hidden_size"]
            groups, picked = meta["moe_router_num_groups"], meta["moe_router_group_topk"]
            kw.update(n_routed_experts=e, num_experts_per_tok=k, moe_intermediate_size=f,
                      n_shared_experts=meta["moe_shared_expert_intermediate_size"] // f,
                      routed_scaling_factor=float(meta["moe_router_topk_scaling_factor"] or 1.0))
            if v.score_function == "sigmoid":
                kw.update(n_group=groups or 1, topk_group=picked or 1, norm_topk_prob=k > 1)
            else:
                kw.update(topk_method="group_limited_greedy" if picked else "greedy", n_group=groups, topk_group=picked)
        return cls(**kw)


FAMILIES = tuple(DeepseekFamily(v) for v in VARIANTS)
