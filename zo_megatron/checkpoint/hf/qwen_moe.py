"""Hugging Face Qwen2-MoE and Qwen3-MoE (`Qwen2MoeForCausalLM`, `Qwen3MoeForCausalLM`) <-> zo_megatron's
mixture-of-experts GPT (megatron-core's MoELayer; docs/moe.md).

Both are the Qwen2 / Qwen3 decoder (hf/llama.py maps attention, norms, embeddings and the dense MLP of
the layers without experts) with sparse layers; their differences are data (`VARIANTS`): Qwen2-MoE
has QKV biases (`qkv_bias`) and a shared expert with a sigmoid gate, Qwen3-MoE q/k norms and its own
head_dim. On disk (model.layers.{i}.mlp.):

    HF                                          megatron-core (decoder.layers.{i}.mlp.)
    gate.weight [E, h]                       -> router.weight
    experts.{e}.gate_proj, up_proj [f, h]    -> experts.local_experts.{e}.linear_fc1   [gate; up]
    experts.{e}.down_proj [h, f]             -> experts.local_experts.{e}.linear_fc2
    shared_expert.gate_proj/up_proj/down_proj -> shared_experts.linear_fc1 [gate; up] / linear_fc2 (Qwen2-MoE)
    shared_expert_gate.weight [1, h]         -> shared_experts.gate_weight   (sigmoid(x . w) x the shared expert)
    gate_proj, up_proj, down_proj            -> linear_fc1, linear_fc2 of a dense layer (mlp_only_layers, or
                                                not (i + 1) % decoder_sparse_step == 0): --moe-layer-freq's list

The router: softmax over E, the top k; `norm_topk_prob` true divides them by their sum (megatron-core's
default, as Mixtral), false keeps them (`--moe-router-pre-softmax`). HF's sparse layers are those
with (i + 1) % decoder_sparse_step == 0 and i not in mlp_only_layers; megatron's integer
--moe-layer-freq N makes i % N == 0 sparse, so anything but every layer is written as the 0/1 list.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from zo_megatron.checkpoint.arch import full_meta, param_shapes, query_groups
from zo_megatron.checkpoint.hf import llama
from zo_megatron.checkpoint.hf.experts import QWEN_NAMES, experts_from_hf, experts_to_hf, swiglu_from_hf, swiglu_to_hf
from zo_megatron.checkpoint.hf.family import VariantFamily, read_checked_state_dict
from zo_megatron.errors import UserError
from zo_megatron.model.config import ARCH_FIELDS, MOE_FIELDS, GPTConfig

_OURS = "gpt."
_MOE_KEY = re.compile(r"^model\.layers\.\d+\.mlp\.(gate\.|experts\.|shared_expert\.|shared_expert_gate\.)")


@dataclass(frozen=True)
class Variant:
    architecture: str
    model_type: str
    config_class: str
    llama_variant: str          # hf/llama.py's family for the attention (biases, q/k norms)
    shared_expert: bool


VARIANTS = (Variant("Qwen2MoeForCausalLM", "qwen2_moe", "Qwen2MoeConfig", "Qwen2ForCausalLM", True),
            Variant("Qwen3MoeForCausalLM", "qwen3_moe", "Qwen3MoeConfig", "Qwen3ForCausalLM", False))


def sparse_layers(cfg) -> list[int]:
    """1 for the layers transformers' model of this config builds with experts, 0 for dense ones."""
    only = set(getattr(cfg, "mlp_only_layers", None) or ())
    step = getattr(cfg, "decoder_sparse_step", 1) or 1
    return [int(i not in only and cfg.num_experts > 0 and (i + 1) % step == 0) for i in range(cfg.num_hidden_layers)]


def from_hf(sd: dict[str, torch.Tensor], meta: dict) -> dict[str, torch.Tensor]:
    """HF state dict as on disk (full) -> our full tensors (experts by global index)."""
    out = llama.from_hf({k: v for k, v in sd.items() if not _MOE_KEY.match(k)}, meta)
    for i in range(meta["num_layers"]):
        h, m = f"model.layers.{i}.mlp.", f"{_OURS}decoder.layers.{i}.mlp."
        if h + "gate.weight" not in sd:
            continue                                       # a dense layer: llama.from_hf mapped it
        out.update(experts_from_hf(sd, h, m, meta["num_experts"], QWEN_NAMES))
        if h + "shared_expert.gate_proj.weight" in sd:
            out.update(swiglu_from_hf(sd, h + "shared_expert.", m + "shared_experts.", QWEN_NAMES))
            out[m + "shared_experts.gate_weight"] = sd[h + "shared_expert_gate.weight"]
    return {k: v.contiguous() for k, v in out.items()}


def to_hf(weights: dict[str, torch.Tensor], meta: dict) -> dict[str, torch.Tensor]:
    """Our full tensors -> HF state dict in the on-disk layout (no lm_head when tied)."""
    moe_keys = (".mlp.router.", ".mlp.experts.", ".mlp.shared_experts.")
    out = llama.to_hf({k: v for k, v in weights.items() if not any(s in k for s in moe_keys)}, meta)
    f, s = meta["moe_ffn_hidden_size"], meta["moe_shared_expert_intermediate_size"]
    for i in range(meta["num_layers"]):
        h, m = f"model.layers.{i}.mlp.", f"{_OURS}decoder.layers.{i}.mlp."
        if m + "router.weight" not in weights:
            continue
        out.update(experts_to_hf(weights, m, h, meta["num_experts"], f, QWEN_NAMES))
        if s:
            out.update(swiglu_to_hf(weights, m + "shared_experts.", h + "shared_expert.", s, QWEN_NAMES))
            out[h + "shared_expert_gate.weight"] = weights[m + "shared_experts.gate_weight"]
    return {k: v.clone(memory_format=torch.contiguous_format) for k, v in out.items()}


class QwenMoeFamily(VariantFamily):
    def __init__(self, variant: Variant):
        super().__init__(variant)
        self.llama = next(f for f in llama.FAMILIES if f.architecture == variant.llama_variant)

    def meta_from_config(self, cfg, where: str) -> tuple[dict, dict]:
        def refuse(what, why):
            raise UserError(f"{where}: {what}: {why}")

        if getattr(cfg, "use_sliding_window", False):
            refuse("use_sliding_window=true", "a sliding window is not mapped for mixture-of-experts models yet")
        if getattr(cfg, "attention_bias", False):
            refuse("attention_bias=True", "megatron-core gives biases to all linear layers or only to QKV, not to "
                   "q, k, v and o alone")
        k, e = cfg.num_experts_per_tok, cfg.num_experts
        if not 1 <= k <= e:
            refuse(f"num_experts_per_tok={k}", f"must be between 1 and num_experts={e}")
        if k == 1 and cfg.norm_topk_prob:
            refuse("num_experts_per_tok=1 with norm_topk_prob=true", "HF renormalises the one chosen probability "
                   "to 1, which megatron-core's top-1 routing (--moe-router-pre-softmax) does not: no exact mapping")
        if self.variant.shared_expert and not cfg.shared_expert_intermediate_size:
            refuse("shared_expert_intermediate_size=0", "the shared expert must have a size")
        # the attention, norms and embeddings as the dense family reads them (a MoE config has their fields)
        meta, args = self.llama.meta_from_config(cfg, where)
        if self.variant.shared_expert:                 # Qwen2-MoE says its QKV bias (Qwen2 always has one)
            meta.update(add_qkv_bias=bool(getattr(cfg, "qkv_bias", True)))
        freq = sparse_layers(cfg)
        meta.update(num_experts=e, moe_router_topk=k, moe_ffn_hidden_size=cfg.moe_intermediate_size,
                    moe_router_pre_softmax=not cfg.norm_topk_prob, moe_router_score_function="softmax",
                    moe_shared_expert_intermediate_size=cfg.shared_expert_intermediate_size
                    if self.variant.shared_expert else None,
                    moe_shared_expert_gate=self.variant.shared_expert,
                    moe_layer_freq=1 if all(freq) else freq, moe_router_load_balancing_type="aux_loss",
                    moe_aux_loss_coeff=0.0)
        return full_meta(meta), args

    def read_state(self, input_dir: str, cfg, meta: dict) -> dict[str, torch.Tensor]:
        expected = {k: tuple(v.shape) for k, v in to_hf(_zeros(meta), meta).items()}
        return from_hf(read_checked_state_dict(input_dir, meta, expected, self.architecture), meta)

    def why_not(self, meta: dict) -> str | None:
        meta = full_meta(meta)
        if meta["num_experts"] is None:
            return f"{self.architecture} has experts (num_experts=None)"
        dense = self.llama.why_not({**meta, **MOE_FIELDS})
        if dense is not None:
            return dense
        shared = self.variant.shared_expert
        needs = (("moe_router_score_function", "softmax", "a softmax router"),
                 ("moe_router_topk_scaling_factor", None, "no top-k scaling factor"),
                 ("moe_router_group_topk", None, "no group-limited routing"),
                 ("moe_shared_expert_gate", shared, "a gated shared expert" if shared else "no shared expert"),
                 ("moe_expert_capacity_factor", None, "no expert capacity (it drops no tokens)"))
        for key, want, what in needs:
            if meta.get(key) != want:
                return f"{self.architecture} has {what} ({key}={meta.get(key)!r})"
        if shared != bool(meta["moe_shared_expert_intermediate_size"]):
            return f"{self.architecture} has {'a' if shared else 'no'} shared expert"
        if meta["moe_router_topk"] == 1 and not meta["moe_router_pre_softmax"]:
            return f"{self.architecture}'s top-1 routing without --moe-router-pre-softmax has no HF form"
        return None

    def to_hf_state(self, weights: dict[str, torch.Tensor], meta: dict) -> dict[str, torch.Tensor]:
        return to_hf(weights, meta)

    def config_json_extra(self, meta: dict) -> dict:
        return llama._rope_config_json_extra(self._config_class(), meta)

    def hf_config(self, meta: dict, *, dtype: str, args: dict, bos_token_id, eos_token_id, window: dict | None = None):
        assert window is None, "a mixture-of-experts model with a sliding window is refused by from-hf"
        cls = self._config_class()
        sparse = [i for i, on in enumerate(_moe_layers(meta)) if on]
        extra = {"qkv_bias": bool(meta["add_qkv_bias"])} if self.variant.shared_expert else \
            {"head_dim": meta["kv_channels"], "attention_bias": False}
        if self.variant.shared_expert:
            extra["shared_expert_intermediate_size"] = meta["moe_shared_expert_intermediate_size"]
        return cls(vocab_size=meta["vocab_size"], hidden_size=meta["hidden_size"],
                   intermediate_size=meta["ffn_hidden_size"], moe_intermediate_size=meta["moe_ffn_hidden_size"],
                   num_hidden_layers=meta["num_layers"], num_attention_heads=meta["num_attention_heads"],
                   num_key_value_heads=query_groups(meta), hidden_act="silu",
                   max_position_embeddings=meta["max_position_embeddings"], rms_norm_eps=meta["layernorm_epsilon"],
                   tie_word_embeddings=not meta["untie_embeddings_and_output_weights"],
                   attention_dropout=float(args.get("attention_dropout") or 0.0), bos_token_id=bos_token_id,
                   eos_token_id=eos_token_id, architectures=[self.architecture], dtype=dtype,
                   num_experts=meta["num_experts"], num_experts_per_tok=meta["moe_router_topk"],
                   norm_topk_prob=not meta["moe_router_pre_softmax"], decoder_sparse_step=1,
                   mlp_only_layers=[i for i in range(meta["num_layers"]) if i not in sparse],
                   use_sliding_window=False, **llama._rope_config(cls, meta), **extra)


def _moe_layers(meta: dict) -> list[bool]:
    return GPTConfig(**{k: meta[k] for k in ARCH_FIELDS}, precision="fp32").moe_layers()


def _zeros(meta: dict) -> dict[str, torch.Tensor]:
    """Storage-free stand-ins of our full tensors (meta device), to derive the HF names and shapes."""
    return {k: torch.empty(shape, device="meta") for k, shape in param_shapes(meta).items()}


FAMILIES = tuple(QwenMoeFamily(v) for v in VARIANTS)
