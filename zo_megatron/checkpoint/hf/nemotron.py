"""Hugging Face Nemotron (NemotronForCausalLM: Nemotron-4, Minitron, Nemotron-Mini) <-> zo_megatron.

The decoder Megatron-LM trains with `--squared-relu --apply-layernorm-1p --rotary-percent 0.5
--disable-bias-linear --untie-embeddings-and-output-weights`:

    HF (model.layers.{i}.)                     megatron-core (decoder.layers.{i}.)
    input_layernorm (LayerNorm1P)           -> input_layernorm        weight (scale 1 + weight) and bias
    self_attn.q_proj, k_proj, v_proj        -> self_attention.linear_qkv   grouped per query group (llama.py's)
    self_attn.o_proj                        -> self_attention.linear_proj
    post_attention_layernorm (LayerNorm1P)  -> pre_mlp_layernorm
    mlp.up_proj                             -> mlp.linear_fc1          relu(x)^2 (--squared-relu), no gate
    mlp.down_proj                           -> mlp.linear_fc2
    model.embed_tokens / model.norm / lm_head -> embedding.word_embeddings / decoder.final_layernorm / output_layer

LayerNorm1P scales by 1 + weight as megatron-core's zero-centred gamma (--apply-layernorm-1p) does, so
the weights move as they are (`zero_centred_norms`: to-hf hands this family zero-centred weights).
`partial_rotary_factor` is --rotary-percent: both rotate the first head_dim x factor channels of each
head with rotate_half (megatron's non-interleaved RoPE) and the frequencies of that many channels.
"""
from __future__ import annotations

import torch

from zo_megatron.checkpoint.arch import full_meta, head_dim, query_groups
from zo_megatron.checkpoint.hf.family import HFFamily, read_checked_state_dict, read_hf_config
from zo_megatron.checkpoint.hf.llama import _pack_qkv, _reads_rope_parameters, _rope_params, _unpack_qkv
from zo_megatron.errors import UserError

_OURS = "gpt."
_NORMS = (("input_layernorm", "input_layernorm"), ("pre_mlp_layernorm", "post_attention_layernorm"))


def _pairs(i: int, bias: bool) -> list[tuple[str, str]]:
    """(ours, HF) for the one-to-one tensors of layer i."""
    m, h = f"{_OURS}decoder.layers.{i}.", f"model.layers.{i}."
    out = [(m + o + "." + p, h + t + "." + p) for o, t in _NORMS for p in ("weight", "bias")]
    linears = (("self_attention.linear_proj", "self_attn.o_proj"), ("mlp.linear_fc1", "mlp.up_proj"),
               ("mlp.linear_fc2", "mlp.down_proj"))
    kinds = ("weight", "bias") if bias else ("weight",)
    out += [(m + o + "." + p, h + t + "." + p) for o, t in linears for p in kinds]
    return out


def _top(meta: dict) -> list[tuple[str, str]]:
    out = [(_OURS + "embedding.word_embeddings.weight", "model.embed_tokens.weight"),
           (_OURS + "decoder.final_layernorm.weight", "model.norm.weight"),
           (_OURS + "decoder.final_layernorm.bias", "model.norm.bias")]
    if meta.get("untie_embeddings_and_output_weights"):
        out.append((_OURS + "output_layer.weight", "lm_head.weight"))
    return out


def hf_shapes(meta: dict) -> dict[str, tuple[int, ...]]:
    h, f, v, d = meta["hidden_size"], meta["ffn_hidden_size"], meta["vocab_size"], head_dim(meta)
    q, kv = meta["num_attention_heads"] * d, query_groups(meta) * d
    out = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,), "model.norm.bias": (h,)}
    if meta.get("untie_embeddings_and_output_weights"):
        out["lm_head.weight"] = (v, h)
    for i in range(meta["num_layers"]):
        m = f"model.layers.{i}."
        for _, norm in _NORMS:
            out[m + norm + ".weight"] = out[m + norm + ".bias"] = (h,)
        for name, shape in (("self_attn.q_proj", (q, h)), ("self_attn.k_proj", (kv, h)), ("self_attn.v_proj", (kv, h)),
                            ("self_attn.o_proj", (h, q)), ("mlp.up_proj", (f, h)), ("mlp.down_proj", (h, f))):
            out[m + name + ".weight"] = shape
            if meta["add_bias_linear"]:
                out[m + name + ".bias"] = shape[:1]
    return out


def from_hf(sd: dict[str, torch.Tensor], meta: dict) -> dict[str, torch.Tensor]:
    heads, groups, bias = meta["num_attention_heads"], query_groups(meta), meta["add_bias_linear"]
    out = {ours: sd[hf] for ours, hf in _top(meta)}
    for i in range(meta["num_layers"]):
        out.update({ours: sd[hf] for ours, hf in _pairs(i, bias)})
        h = f"model.layers.{i}.self_attn."
        for kind in ("weight", "bias") if bias else ("weight",):
            out[f"{_OURS}decoder.layers.{i}.self_attention.linear_qkv.{kind}"] = _pack_qkv(
                *(sd[h + f"{p}_proj.{kind}"] for p in "qkv"), heads, groups)
    return {k: v.contiguous() for k, v in out.items()}


def to_hf(weights: dict[str, torch.Tensor], meta: dict) -> dict[str, torch.Tensor]:
    heads, groups, bias = meta["num_attention_heads"], query_groups(meta), meta["add_bias_linear"]
    out = {hf: weights[ours] for ours, hf in _top(meta)}
    for i in range(meta["num_layers"]):
        out.update({hf: weights[ours] for ours, hf in _pairs(i, bias)})
        h = f"model.layers.{i}.self_attn."
        for kind in ("weight", "bias") if bias else ("weight",):
            q, k, v = _unpack_qkv(weights[f"{_OURS}decoder.layers.{i}.self_attention.linear_qkv.{kind}"], heads,
                                  groups, head_dim(meta))
            out.update({h + f"q_proj.{kind}": q, h + f"k_proj.{kind}": k, h + f"v_proj.{kind}": v})
    return {k: v.clone(memory_format=torch.contiguous_format) for k, v in out.items()}


def _rope(cfg, where: str) -> tuple[int, float]:
    """(rotary base, rotary percent) from either config schema (llama._rope_params); one line for what
    megatron-core's RoPE cannot express here (scaling: this family's models are unscaled)."""
    p = _rope_params(cfg)
    kind = "per layer type" if "per_layer_type" in p else p["rope_type"]
    if kind != "default":
        raise UserError(f"{where}: rope_type={kind!r}: megatron-core's RoPE cannot express it here (only 'default')")
    theta = float(p.get("rope_theta", 10000.0))
    if theta != int(theta):
        raise UserError(f"{where}: rope_theta={theta}: --rotary-base is an integer, as in Megatron-LM")
    return int(theta), float(p.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", None) or 1.0))


def _rope_schemas(meta: dict) -> tuple[dict, dict]:
    """The rope as transformers 5's `rope_parameters` and as 4.x's keys."""
    theta, partial = float(meta["rotary_base"]), float(meta["rotary_percent"])
    return ({"rope_parameters": {"rope_type": "default", "rope_theta": theta, "partial_rotary_factor": partial}},
            {"rope_theta": theta, "partial_rotary_factor": partial})


class NemotronFamily(HFFamily):
    architecture, model_type = "NemotronForCausalLM", "nemotron"
    zero_centred_norms = True

    def read_config(self, cfg_json: dict, where: str):
        import transformers

        return read_hf_config(transformers.NemotronConfig, cfg_json, where)

    def meta_from_config(self, cfg, where: str) -> tuple[dict, dict]:
        if cfg.hidden_act != "relu2":
            raise UserError(f"{where}: hidden_act={cfg.hidden_act!r}: the MLP must be relu(x)^2 ('relu2'), "
                            "megatron's --squared-relu")
        if bool(cfg.attention_bias) != bool(cfg.mlp_bias):
            raise UserError(f"{where}: attention_bias={cfg.attention_bias}, mlp_bias={cfg.mlp_bias}: megatron-core "
                            "gives biases to all linear layers (--add-bias-linear) or to none")
        heads = cfg.num_attention_heads
        groups = cfg.num_key_value_heads or heads
        if heads % groups:
            raise UserError(f"{where}: num_key_value_heads={groups}: does not divide num_attention_heads={heads}")
        base, percent = _rope(cfg, where)
        meta = dict(num_layers=cfg.num_hidden_layers, hidden_size=cfg.hidden_size, num_attention_heads=heads,
                    ffn_hidden_size=cfg.intermediate_size, vocab_size=cfg.vocab_size,
                    max_position_embeddings=cfg.max_position_embeddings, make_vocab_size_divisible_by=128,
                    position_embedding_type="rope", rotary_base=base, rotary_percent=percent,
                    normalization="LayerNorm", layernorm_epsilon=float(cfg.norm_eps),
                    layernorm_zero_centered_gamma=True,
                    squared_relu=True, num_query_groups=groups,
                    kv_channels=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
                    untie_embeddings_and_output_weights=not cfg.tie_word_embeddings,
                    add_bias_linear=bool(cfg.attention_bias))
        args = {"hidden_dropout": 0.0, "attention_dropout": float(getattr(cfg, "attention_dropout", 0.0) or 0.0)}
        return full_meta(meta), args

    def read_state(self, input_dir: str, cfg, meta: dict) -> dict[str, torch.Tensor]:
        sd = read_checked_state_dict(input_dir, meta, hf_shapes(meta), self.architecture,
                                     " (biases, tying and layers must agree)")
        return from_hf(sd, meta)

    def why_not(self, meta: dict) -> str | None:
        meta = full_meta(meta)
        needs = (("num_experts", None, "no experts"), ("position_embedding_type", "rope", "rotary positions"),
                 ("normalization", "LayerNorm", "LayerNorm (LayerNorm1P)"),
                 ("squared_relu", True, "a squared-ReLU MLP"),
                 ("qk_layernorm", False, "no q/k norms"), ("use_rope_scaling", False, "no rope scaling"))
        for key, want, what in needs:
            if meta.get(key) != want:
                return f"{self.architecture} has {what} ({key}={meta.get(key)!r})"
        if meta["add_qkv_bias"] and not meta["add_bias_linear"]:
            return f"{self.architecture} has biases on every linear layer or none (add_qkv_bias=True alone)"
        if meta["num_attention_heads"] % query_groups(meta):
            return f"num_query_groups {query_groups(meta)} does not divide the heads"
        return None

    def to_hf_state(self, weights: dict[str, torch.Tensor], meta: dict) -> dict[str, torch.Tensor]:
        return to_hf(weights, meta)

    def config_json_extra(self, meta: dict) -> dict:
        """The rope keys of the transformers schema the installed config class does not write (a 4.x
        reader of 5's file would take theta 10000 and the whole head)."""
        import transformers

        v5, v4 = _rope_schemas(meta)
        return v4 if _reads_rope_parameters(transformers.NemotronConfig) else v5

    def hf_config(self, meta: dict, *, dtype: str, args: dict, bos_token_id, eos_token_id, window: dict | None = None):
        import transformers

        assert window is None, "convert.to_hf writes a window only with the family it was read from"
        return transformers.NemotronConfig(
            vocab_size=meta["vocab_size"], hidden_size=meta["hidden_size"], intermediate_size=meta["ffn_hidden_size"],
            num_hidden_layers=meta["num_layers"], num_attention_heads=meta["num_attention_heads"],
            head_dim=head_dim(meta), num_key_value_heads=query_groups(meta), hidden_act="relu2",
            max_position_embeddings=meta["max_position_embeddings"], norm_eps=meta["layernorm_epsilon"],
            tie_word_embeddings=not meta.get("untie_embeddings_and_output_weights", False),
            **_rope_schemas(meta)[0 if _reads_rope_parameters(transformers.NemotronConfig) else 1],
            attention_bias=meta["add_bias_linear"], mlp_bias=meta["add_bias_linear"],
            attention_dropout=float(args.get("attention_dropout") or 0.0), bos_token_id=bos_token_id,
            eos_token_id=eos_token_id, architectures=[self.architecture], dtype=dtype)


FAMILY = NemotronFamily()
