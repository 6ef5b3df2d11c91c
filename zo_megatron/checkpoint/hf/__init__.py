"""Hugging Face model families <-> zo_megatron: one mapping module per family, chosen here.

    gpt2.py    GPT2LMHeadModel
    llama.py   LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM
               (their differences are data: llama.VARIANTS)
    nongated.py NemotronForCausalLM (Nemotron-4, Minitron: squared-ReLU MLP, LayerNorm1P, partial RoPE),
               Starcoder2ForCausalLM (tanh GELU, biases, LayerNorm): LayerNorm and a non-gated MLP
    mixtral.py MixtralForCausalLM (mixture of experts: Mistral's decoder, experts and router)
    gpt_oss.py GptOssForCausalLM (GPT-OSS: attention sinks, alternating sliding window, YaRN, experts with
               biases and a clamped quick GeGLU, read unquantized or from OpenAI's MXFP4 files: mxfp4.py)
    qwen_moe.py Qwen2MoeForCausalLM, Qwen3MoeForCausalLM (experts, Qwen2-MoE's gated shared expert)
    deepseek.py DeepseekV3ForCausalLM, DeepseekV2ForCausalLM (multi-latent attention, DeepSeekMoE: shared
               experts, first dense layers; V3's sigmoid router with its expert bias, V2's softmax one:
               deepseek.VARIANTS)
    (experts.py: the router and SwiGLU experts' tensors, as the MoE modules name and lay them out;
     family.py: the config and weight-file reading every family shares)

from-hf picks the family from config.json's `architectures` (or, when a config has none, its
`model_type`); to-hf from the architecture the checkpoint was converted from, a name given by
the user, or else the first family that expresses the model exactly (GPT-2, then Llama, Mistral,
Qwen2, Qwen3: a Llama-shaped model with QKV biases only is a Qwen2, one with q/k norms a Qwen3;
Nemotron for a squared-ReLU MLP, StarCoder2 for a GELU one with RoPE; then Mixtral, Qwen2-MoE, Qwen3-MoE for models
with experts, GPT-OSS for those with attention sinks and quick-GeGLU experts; DeepSeek-V3 for multi-latent
attention with a sigmoid router or none, DeepSeek-V2 with a softmax one). A
model with multi-latent attention is written by the DeepSeek families only: the others' attention is another function.
Likewise attention sinks (softmax_type) and a quick GeGLU, an offset or a clamp in the MLP (GLU_FIELDS): GPT-OSS only.
"""
from __future__ import annotations

import os

from zo_megatron.checkpoint.arch import full_meta
from zo_megatron.checkpoint.hf import deepseek, gpt2, gpt_oss, llama, mixtral, nongated, qwen_moe
from zo_megatron.checkpoint.hf.family import CONFIG, HFFamily, read_config_json, weight_files
from zo_megatron.errors import UserError
from zo_megatron.model.config import GLU_FIELDS
from zo_megatron.planner.window import hf_window

FAMILIES: dict[str, HFFamily] = {f.architecture: f for f in (gpt2.FAMILY, *llama.FAMILIES, *nongated.FAMILIES,
                                                                 mixtral.FAMILY, *qwen_moe.FAMILIES,
                                                                 gpt_oss.FAMILY, *deepseek.FAMILIES)}
SUPPORTED = tuple(FAMILIES)
_MLA_FAMILIES = frozenset(f.architecture for f in deepseek.FAMILIES)
_GPT_OSS_FAMILIES = frozenset({gpt_oss.FAMILY.architecture})     # attention sinks, the clamped quick GeGLU
__all__ = ["CONFIG", "FAMILIES", "SUPPORTED", "HFFamily", "family_for_config", "family_for_model", "read_config_json",
           "weight_files"]


def family_for_config(cfg_json: dict, input_dir: str) -> HFFamily:
    where = os.path.join(input_dir, CONFIG)
    archs = cfg_json.get("architectures")
    if isinstance(archs, list) and archs:
        name = archs[0]
        family = FAMILIES.get(name)
    else:
        name = f"model_type={cfg_json.get('model_type')!r}"
        family = next((f for f in FAMILIES.values() if f.model_type == cfg_json.get("model_type")), None)
    if family is None:
        raise UserError(f"{where}: {name} is not supported; supported architectures: {', '.join(SUPPORTED)}")
    return family


def why_not(family: HFFamily, meta: dict) -> str | None:
    """family.why_not, with multi-latent attention refused by every family but DeepSeek's (the others'
    why_not predate MLA and read only the fields their attention has)."""
    meta = full_meta(meta)
    if meta["multi_latent_attention"] and family.architecture not in _MLA_FAMILIES:
        return f"{family.architecture} has no multi-latent attention (multi_latent_attention=True)"
    if family.architecture not in _GPT_OSS_FAMILIES:     # their why_not predate these fields and read none
        if meta["softmax_type"] != "vanilla":
            return (f"{family.architecture} has no attention sinks or softmax offset "
                    f"(softmax_type={meta['softmax_type']!r})")
        glu = {k: meta[k] for k, v in GLU_FIELDS.items() if meta[k] != v}
        if glu:
            said = ", ".join(f"{k}={v!r}" for k, v in glu.items())
            return f"{family.architecture}'s MLP has no quick GeGLU, offset or clamp ({said})"
    window = hf_window(meta["window_size"], meta["window_attn_skip_freq"], meta["num_layers"])
    if window is not None and family.window_support() is None:
        return f"{family.architecture} has no sliding window (window_size={meta['window_size']})"
    if window is not None and family.window_support() == "every_layer" and \
            len(window["layers"]) != meta["num_layers"]:
        return (f"{family.architecture}'s sliding window limits every layer (window_attn_skip_freq="
                f"{meta['window_attn_skip_freq']})")
    return family.why_not(meta)


def family_for_model(meta: dict, architecture: str | None, where: str) -> HFFamily:
    """The HF architecture to write the model `meta` as (see the module docstring)."""
    if architecture is not None:
        family = FAMILIES.get(architecture)
        if family is None:
            raise UserError(f"--architecture {architecture}: not supported; supported: {', '.join(SUPPORTED)}")
        why = why_not(family, meta)
        if why is not None:
            others = [name for name, f in FAMILIES.items() if name != architecture and why_not(f, meta) is None]
            fix = (f"write it as --architecture {others[0]} (or leave --architecture out)" if others else
                   "no supported architecture expresses it; to-megatron and to-fp32 write any model")
            raise UserError(f"{where}: the model cannot be written as {architecture}: {why}; {fix}")
        return family
    reasons = []
    for family in FAMILIES.values():
        why = why_not(family, meta)
        if why is None:
            return family
        reasons.append(why)
    raise UserError(f"{where}: no supported Hugging Face architecture expresses this model ({'; '.join(reasons)}): "
                    "to-megatron and to-fp32 write any model")
