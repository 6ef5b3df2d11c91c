"""Hugging Face Mixtral (`MixtralForCausalLM`) <-> zo_megatron's mixture-of-experts GPT (megatron-core's
MoELayer, local spec; docs/moe.md): the tensors and the router's semantics.

Mixtral is Mistral's decoder (hf/llama.py maps attention, norms, embeddings) with every MLP a sparse
mixture of experts. On disk (what transformers' save_pretrained writes, whatever layout its model
keeps in memory):

    HF (model.layers.{i}.block_sparse_moe.)    megatron-core (decoder.layers.{i}.mlp.)
    gate.weight [E, h]                      -> router.weight                          (fp32 in the model)
    experts.{e}.w1 [f, h], w3 [f, h]        -> experts.local_experts.{e}.linear_fc1   [w1 (gate); w3 (up)]
    experts.{e}.w2 [h, f]                   -> experts.local_experts.{e}.linear_fc2   (e: the global index)

The router: HF takes softmax over all E logits, the top k of those probabilities and divides them by
their sum; megatron-core's default (--moe-router-score-function softmax without
--moe-router-pre-softmax) takes the top k logits and a softmax over them. Both are
exp(l_i) / sum over the chosen j of exp(l_j) for the same k experts: the same routing, mapped as
megatron's default, --moe-router-topk = num_experts_per_tok. HF's jitter (router_jitter_noise)
multiplies the hidden states that reach both the router and the experts; megatron-core's
--moe-input-jitter-eps only the router's input: a non-zero jitter is refused.

The load-balancing loss is not the same function (docs/moe.md): HF's (output_router_logits, with
router_aux_loss_coef) pools the tokens of every layer into one E * sum_e f_e P_e with f_e the share of
(token, slot) pairs on expert e summed over the k slots; megatron-core's aux_loss is per layer, with f_e
divided by k, summed over layers. With one MoE layer HF's is k times megatron-core's per-layer value.
"""
from __future__ import annotations

import re

import torch

from zo_megatron.checkpoint.arch import full_meta, query_groups
from zo_megatron.checkpoint.hf import llama
from zo_megatron.checkpoint.hf.experts import MIXTRAL_NAMES, check_groups_and_top_k, experts_from_hf, experts_to_hf
from zo_megatron.checkpoint.hf.family import HFFamily, read_checked_state_dict, read_hf_config
from zo_megatron.errors import UserError

_OURS = "gpt."
_LAYER = re.compile(r"^model\.layers\.(\d+)\.block_sparse_moe\.")


def meta_from_config(cfg, where: str) -> dict:
    """GPTConfig's architecture and MoE fields of a transformers MixtralConfig; one line for what
    has no exact mapping."""
    def refuse(what, why):
        raise UserError(f"{where}: {what}: {why}")

    if cfg.hidden_act != "silu":
        refuse(f"hidden_act={cfg.hidden_act!r}", "the experts must be SwiGLU (silu), megatron's --swiglu")
    if float(getattr(cfg, "router_jitter_noise", 0.0) or 0.0) != 0.0:
        refuse(f"router_jitter_noise={cfg.router_jitter_noise}", "HF's jitter scales the experts' input too, "
               "megatron-core's --moe-input-jitter-eps only the router's: no exact mapping")
    window, _ = llama.sliding_layers(llama.VARIANTS[1], cfg)          # Mixtral slides as Mistral does
    if window is not None:
        refuse(f"sliding_window={window}", "a sliding window is not mapped for mixture-of-experts models yet; "
               "set it to null for full attention")
    check_groups_and_top_k(cfg, refuse)
    heads, groups = cfg.num_attention_heads, cfg.num_key_value_heads or cfg.num_attention_heads
    experts, k = cfg.num_local_experts, cfg.num_experts_per_tok
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return dict(num_layers=cfg.num_hidden_layers, hidden_size=cfg.hidden_size, num_attention_heads=heads,
                ffn_hidden_size=cfg.intermediate_size, vocab_size=cfg.vocab_size,
                max_position_embeddings=cfg.max_position_embeddings, make_vocab_size_divisible_by=128,
                **llama._rope_meta(cfg, where), normalization="RMSNorm", layernorm_epsilon=float(cfg.rms_norm_eps),
                swiglu=True, num_query_groups=groups, kv_channels=d,
                untie_embeddings_and_output_weights=not cfg.tie_word_embeddings, add_bias_linear=False,
                add_qkv_bias=False, qk_layernorm=False,
                num_experts=experts, moe_router_topk=k, moe_ffn_hidden_size=cfg.intermediate_size,
                moe_router_pre_softmax=False,
                moe_router_score_function="softmax", moe_router_topk_scaling_factor=None, moe_layer_freq=1,
                # HF's loss has no aux loss unless output_router_logits, and then another function (above)
                moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.0)


def from_hf(sd: dict[str, torch.Tensor], meta: dict) -> dict[str, torch.Tensor]:
    """HF state dict as on disk (full) -> our full tensors (experts by global index)."""
    out = llama.from_hf({k: v for k, v in sd.items() if not _LAYER.match(k)}, meta)
    for i in range(meta["num_layers"]):
        out.update(experts_from_hf(sd, f"model.layers.{i}.block_sparse_moe.", f"{_OURS}decoder.layers.{i}.mlp.",
                                   meta["num_experts"], MIXTRAL_NAMES))
    return {k: v.contiguous() for k, v in out.items()}


def to_hf(weights: dict[str, torch.Tensor], meta: dict) -> dict[str, torch.Tensor]:
    """Our full tensors -> HF state dict in the on-disk layout (no lm_head when tied)."""
    dense = {k: v for k, v in weights.items() if ".mlp." not in k}
    out = llama.to_hf(dense, meta)
    for i in range(meta["num_layers"]):
        out.update(experts_to_hf(weights, f"{_OURS}decoder.layers.{i}.mlp.", f"model.layers.{i}.block_sparse_moe.",
                                 meta["num_experts"], meta["moe_ffn_hidden_size"], MIXTRAL_NAMES))
    return {k: v.clone(memory_format=torch.contiguous_format) for k, v in out.items()}


def hf_shapes(meta: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor of a Mixtral's files (as save_pretrained writes them) and its shape."""
    h, f, e = meta["hidden_size"], meta["moe_ffn_hidden_size"], meta["num_experts"]
    out = {k: v for k, v in llama.hf_shapes({**meta, "ffn_hidden_size": 0}, frozenset()).items()
           if ".mlp." not in k}
    for i in range(meta["num_layers"]):
        m = f"model.layers.{i}.block_sparse_moe."
        out[m + "gate.weight"] = (e, h)
        for j in range(e):
            out.update({f"{m}experts.{j}.w1.weight": (f, h), f"{m}experts.{j}.w3.weight": (f, h),
                        f"{m}experts.{j}.w2.weight": (h, f)})
    return out


class MixtralFamily(HFFamily):
    architecture, model_type = "MixtralForCausalLM", "mixtral"

    def read_config(self, cfg_json: dict, where: str):
        import transformers

        return read_hf_config(transformers.MixtralConfig, cfg_json, where)

    def meta_from_config(self, cfg, where: str) -> tuple[dict, dict]:
        meta = full_meta(meta_from_config(cfg, where))
        return meta, {"hidden_dropout": 0.0, "attention_dropout": float(getattr(cfg, "attention_dropout", 0.0) or 0.0)}

    def read_state(self, input_dir: str, cfg, meta: dict) -> dict[str, torch.Tensor]:
        return from_hf(read_checked_state_dict(input_dir, meta, hf_shapes(meta), self.architecture), meta)

    def why_not(self, meta: dict) -> str | None:
        meta = full_meta(meta)
        needs = (("position_embedding_type", "rope", "rotary positions"), ("normalization", "RMSNorm", "RMSNorm"),
                 ("swiglu", True, "SwiGLU experts"), ("qk_layernorm", False, "no q/k norms"),
                 ("add_bias_linear", False, "no biases"), ("add_qkv_bias", False, "no QKV bias"),
                 ("rotary_percent", 1.0, "RoPE on the whole head"), ("use_rope_scaling", False, "no rope scaling"),
                 ("moe_router_score_function", "softmax", "a softmax router"),
                 ("moe_router_pre_softmax", False, "top-k probabilities renormalised (no --moe-router-pre-softmax)"),
                 ("moe_router_topk_scaling_factor", None, "no top-k scaling factor"),
                 ("moe_router_group_topk", None, "no group-limited routing"),
                 ("moe_shared_expert_intermediate_size", None, "no shared expert"), ("moe_layer_freq", 1, "experts in "
                                                                                       "every layer"),
                 ("moe_expert_capacity_factor", None, "no expert capacity (it drops no tokens)"))
        if meta["num_experts"] is None:
            return "MixtralForCausalLM has experts (num_experts=None)"
        for key, want, what in needs:
            if meta.get(key) != want:
                return f"MixtralForCausalLM has {what} ({key}={meta.get(key)!r})"
        if meta["moe_router_topk"] == 1:
            return "MixtralForCausalLM's top-1 routing renormalises to 1 (moe_router_topk=1)"
        if meta["num_attention_heads"] % query_groups(meta):
            return f"num_query_groups {query_groups(meta)} does not divide the heads"
        return None

    def to_hf_state(self, weights: dict[str, torch.Tensor], meta: dict) -> dict[str, torch.Tensor]:
        return to_hf(weights, meta)

    def config_json_extra(self, meta: dict) -> dict:
        import transformers

        return llama._rope_config_json_extra(transformers.MixtralConfig, meta)

    def hf_config(self, meta: dict, *, dtype: str, args: dict, bos_token_id, eos_token_id, window: dict | None = None):
        import transformers

        assert window is None, "a Mixtral with a sliding window is refused by from-hf"
        cls = transformers.MixtralConfig
        return cls(vocab_size=meta["vocab_size"], hidden_size=meta["hidden_size"],
                   intermediate_size=meta["moe_ffn_hidden_size"], num_hidden_layers=meta["num_layers"],
                   num_attention_heads=meta["num_attention_heads"], num_key_value_heads=query_groups(meta),
                   hidden_act="silu",
                   max_position_embeddings=meta["max_position_embeddings"], rms_norm_eps=meta["layernorm_epsilon"],
                   tie_word_embeddings=not meta["untie_embeddings_and_output_weights"],
                   attention_dropout=float(args.get("attention_dropout") or 0.0), bos_token_id=bos_token_id,
                   eos_token_id=eos_token_id, architectures=[self.architecture], dtype=dtype,
                   num_local_experts=meta["num_experts"], num_experts_per_tok=meta["moe_router_topk"],
                   router_jitter_noise=0.0, sliding_window=None, **llama._rope_config(cls, meta),
                   # MixtralConfig's head_dim is None unless set (hidden / heads then): only when it differs
                   **({"head_dim": meta["kv_channels"]}
                      if meta["kv_channels"] != meta["hidden_size"] // meta["num_attention_heads"] else {}))


FAMILY = MixtralFamily()
