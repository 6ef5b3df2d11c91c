"""The TP GPT in its Llama / Mistral / Qwen2 / Qwen3 shapes equals Hugging Face transformers.

The parent builds each transformers model (eager attention, fp32) from a small random config with
odd sizes (hidden 96, 8 heads, 4 KV groups, FFN 200, RoPE theta 500000), perturbs every weight
(norm weights too), and maps the weights to our full, unpadded tensors with the mapping below,
written here independently of zo_megatron's converters. Each TP world loads those full tensors
into the TP model (sharded by zo_megatron.model.sharding), runs one forward/backward and sends
back the gathered logits, loss and gradients; the parent compares them with transformers' own on
the same batch, every element, every gradient mapped back through the same mapping.
"""
import pytest
import torch
import torch.distributed as dist

from tests.harness import run_world
from tests.seeds import fresh_seed

transformers = pytest.importorskip("transformers")

LAYERS, HIDDEN, HEADS, GROUPS, FFN, SEQ, BATCH, VOCAB = 2, 96, 8, 4, 200, 12, 2, 251

_COMMON_HF = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                  num_attention_heads=HEADS, num_key_value_heads=GROUPS, max_position_embeddings=64,
                  rms_norm_eps=1e-5, attention_dropout=0.0)
_COMMON_OURS = dict(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, num_query_groups=GROUPS,
                    ffn_hidden_size=FFN, vocab_size=VOCAB, max_position_embeddings=64, precision="fp32",
                    position_embedding_type="rope", normalization="RMSNorm", layernorm_epsilon=1e-5,
                    swiglu=True, add_bias_linear=False)
_ROPE = {"rope_type": "default", "rope_theta": 500000.0}
_LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}

# name: (transformers class, its config class, config kwargs, our GPTConfig kwargs)
ARCHS = {
    "llama": ("LlamaForCausalLM", "LlamaConfig", dict(tie_word_embeddings=False, rope_parameters=_ROPE),
              dict(rotary_base=500000, untie_embeddings_and_output_weights=True)),
    "llama3_rope_scaling": ("LlamaForCausalLM", "LlamaConfig",
                            dict(tie_word_embeddings=False, rope_parameters=_LLAMA3_ROPE),
                            dict(rotary_base=500000, use_rope_scaling=True, rope_scaling_factor=8.0,
                                 untie_embeddings_and_output_weights=True)),
    "qwen2_tied": ("Qwen2ForCausalLM", "Qwen2Config", dict(tie_word_embeddings=True, rope_parameters=_ROPE),
                   dict(rotary_base=500000, add_qkv_bias=True)),
    "mistral_head_dim16": ("MistralForCausalLM", "MistralConfig",
                           dict(tie_word_embeddings=False, rope_parameters=_ROPE, sliding_window=None, head_dim=16),
                           dict(rotary_base=500000, kv_channels=16, untie_embeddings_and_output_weights=True)),
    "qwen3_qk_norm": ("Qwen3ForCausalLM", "Qwen3Config",
                      dict(tie_word_embeddings=False, rope_parameters=_ROPE, head_dim=16, attention_bias=False),
                      dict(rotary_base=500000, kv_channels=16, qk_layernorm=True,
                           untie_embeddings_and_output_weights=True)),
}


# ---------------------------------------------------------------- the independent HF -> ours mapping
def hf_to_ours(sd: dict, heads: int, groups: int, tied: bool) -> dict:
    """Full HF tensors (q/k/v/gate/up separate) -> our full tensors (`gpt.` names): linear_qkv is
    [q heads of group g; k_g; v_g] for each query group g, linear_fc1 is [gate; up]."""
    out = {"gpt.embedding.word_embeddings.weight": sd["model.embed_tokens.weight"],
           "gpt.decoder.final_layernorm.weight": sd["model.norm.weight"]}
    if not tied:
        out["gpt.output_layer.weight"] = sd["lm_head.weight"]
    for i in range(LAYERS):
        hf, me = f"model.layers.{i}.", f"gpt.decoder.layers.{i}."
        for suffix in ("weight", "bias"):
            q = sd.get(f"{hf}self_attn.q_proj.{suffix}")
            if q is None:
                continue
            k, v = sd[f"{hf}self_attn.k_proj.{suffix}"], sd[f"{hf}self_attn.v_proj.{suffix}"]
            rest = q.shape[1:]
            grouped = torch.cat([q.reshape(groups, -1, *rest), k.reshape(groups, -1, *rest),
                                 v.reshape(groups, -1, *rest)], dim=1)
            out[f"{me}self_attention.linear_qkv.{suffix}"] = grouped.reshape(-1, *rest)
        out[f"{me}self_attention.linear_proj.weight"] = sd[f"{hf}self_attn.o_proj.weight"]
        if f"{hf}self_attn.q_norm.weight" in sd:
            out[f"{me}self_attention.q_layernorm.weight"] = sd[f"{hf}self_attn.q_norm.weight"]
            out[f"{me}self_attention.k_layernorm.weight"] = sd[f"{hf}self_attn.k_norm.weight"]
        out[f"{me}input_layernorm.weight"] = sd[f"{hf}input_layernorm.weight"]
        out[f"{me}pre_mlp_layernorm.weight"] = sd[f"{hf}post_attention_layernorm.weight"]
        out[f"{me}mlp.linear_fc1.weight"] = torch.cat([sd[f"{hf}mlp.gate_proj.weight"], sd[f"{hf}mlp.up_proj.weight"]])
        out[f"{me}mlp.linear_fc2.weight"] = sd[f"{hf}mlp.down_proj.weight"]
    return out


def _hf_model(arch: str, seed: int):
    cls, config_cls, hf_kw, _ = ARCHS[arch]
    config = getattr(transformers, config_cls)(**_COMMON_HF, **hf_kw)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = getattr(transformers, cls)(config).float()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():      # every weight random, norms around 1
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1 + (1.0 if "norm" in name else 0.0))
    return model


def _tied(arch: str) -> bool:
    return ARCHS[arch][2]["tie_word_embeddings"]


# ------------------------------------------------------------------------------------ the TP world
def _world(rank, tp, cases, batch_seed):
    from zo_megatron.model import GPTConfig, build_gpt_model
    from zo_megatron.model.sharding import gather_full, load_full_params, model_shard_infos
    from zo_megatron.parallel import init_parallel

    ps = init_parallel(tp, seed=batch_seed)
    gen = torch.Generator().manual_seed(batch_seed)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    results = {}
    for arch, full in cases.items():
        cfg = GPTConfig(**_COMMON_OURS, **ARCHS[arch][3])
        model = build_gpt_model(cfg, ps.tp_rank, ps.tp_size, seed=batch_seed)
        load_full_params(model, full, ps.tp_rank, ps.tp_size, VOCAB)
        infos = model_shard_infos(model, ps.tp_rank, ps.tp_size, VOCAB)
        logits = model(tokens)
        loss = model.loss(tokens, labels)
        loss.backward()
        shards = [torch.empty_like(logits) for _ in range(tp)]
        dist.all_gather(shards, logits.detach().contiguous(), group=ps.tp_group)
        results[arch] = dict(
            logits=torch.cat(shards, dim=-1)[..., :VOCAB], loss=loss.item(),
            grads={n: gather_full(p.grad, infos[n], ps.tp_group, tp) for n, p in model.named_parameters()},
            strides={n: getattr(p, "partition_stride", None) for n, p in model.named_parameters()})
    return (results, tokens, labels) if rank == 0 else None


def _rel_err(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-30)).item()


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_tp_model_matches_transformers(tp):
    seed = fresh_seed(f"llama-family TP{tp}")
    hf_models = {arch: _hf_model(arch, seed + i) for i, arch in enumerate(ARCHS)}
    cases = {arch: hf_to_ours({k: v.detach().clone() for k, v in m.state_dict().items()}, HEADS, GROUPS, _tied(arch))
             for arch, m in hf_models.items()}
    results, tokens, labels = run_world(_world, tp, tp, cases, seed, timeout=300)[0]
    for arch, hf in hf_models.items():
        out = results[arch]
        logits = hf(tokens).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))
        loss.backward()
        ref_grads = hf_to_ours({n: p.grad for n, p in hf.named_parameters()}, HEADS, GROUPS, _tied(arch))
        assert _rel_err(out["logits"], logits.detach()) <= 1e-5, arch
        assert abs(out["loss"] - loss.item()) <= 1e-5 * abs(loss.item()), arch
        assert set(out["grads"]) == set(ref_grads), (arch, set(out["grads"]) ^ set(ref_grads))
        for name, g in out["grads"].items():
            assert g.shape == ref_grads[name].shape, (arch, name)
            assert _rel_err(g, ref_grads[name]) <= 1e-5, (arch, name, _rel_err(g, ref_grads[name]))
        # SwiGLU's fc1 is the stride-2 parameter (the strided layout is what this test exercises)
        fc1 = [n for n in out["strides"] if n.endswith("mlp.linear_fc1.weight")]
        assert fc1 and all(out["strides"][n] == 2 for n in fc1)


def test_num_parameters_matches_transformers():
    for i, arch in enumerate(ARCHS):
        from zo_megatron.model import GPTConfig

        hf = _hf_model(arch, i)
        cfg = GPTConfig(**_COMMON_OURS, **ARCHS[arch][3])
        assert cfg.num_parameters() == sum(p.numel() for p in hf.parameters()), arch


def _layout_world(rank, tp, seed):
    """Gathered full initial weights, and for every parameter whether the by-name offline layout
    (checkpoint/tp_layout.py) puts this rank's shard where the live one (model/sharding.py) does."""
    from zo_megatron.checkpoint.tp_layout import tp_shard_boxes
    from zo_megatron.model import GPTConfig, build_gpt_model
    from zo_megatron.model.sharding import gather_full, model_shard_infos
    from zo_megatron.parallel import init_parallel

    ps = init_parallel(tp, seed=seed)
    out = {}
    for arch in ("llama", "qwen2_tied", "qwen3_qk_norm"):
        cfg = GPTConfig(**_COMMON_OURS, **ARCHS[arch][3])
        model = build_gpt_model(cfg, ps.tp_rank, ps.tp_size, seed)
        infos = model_shard_infos(model, ps.tp_rank, ps.tp_size, VOCAB)
        full = {n: gather_full(p.detach(), infos[n], ps.tp_group, tp) for n, p in model.named_parameters()}
        mismatched = []
        for n, p in model.named_parameters():
            boxes = tp_shard_boxes(n.removeprefix("gpt."), tuple(full[n].shape), ps.tp_rank, tp,
                                   cfg.padded_vocab_size(tp), swiglu=cfg.swiglu)
            local = p.detach().reshape(-1)
            for b in boxes:       # the box of the full tensor == the local elements from flat_start
                piece = full[n][tuple(slice(o, o + s) for o, s in zip(b.offsets, b.sizes))]
                if b.offsets and infos[n].tp_axis == 1:
                    ok = torch.equal(piece, p.detach()[:, :b.sizes[1]])
                else:
                    ok = torch.equal(piece.reshape(-1), local[b.flat_start:b.flat_start + b.numel])
                if not ok:
                    mismatched.append(n)
            if sum(b.numel for b in boxes) != (full[n].numel() if infos[n].replicated else
                                               infos[n].valid * p[0].numel() if infos[n].tp_axis == 0 else p.numel()):
                mismatched.append(n)
        out[arch] = (full, mismatched)
    return out if rank == 0 else None


def test_init_and_offline_layout_are_the_same_at_every_tp():
    """One seed gives the same full weights at TP 1, 2, 4 (SwiGLU's fc1 drawn whole, then sharded
    with stride 2; the untied output layer; RMSNorm and q/k norm weights 1), and tp_layout's
    by-name boxes match the live shards."""
    seed = fresh_seed("llama init layout")
    res = {tp: run_world(_layout_world, tp, tp, seed, timeout=300)[0] for tp in (1, 2, 4)}
    for arch, (full1, bad1) in res[1].items():
        assert not bad1, (arch, bad1)
        assert all(torch.equal(t, torch.ones_like(t)) for n, t in full1.items() if n.endswith("norm.weight"))
        for tp in (2, 4):
            full, bad = res[tp][arch]
            assert not bad, (tp, arch, bad)
            assert set(full) == set(full1)
            for n, t in full1.items():
                assert torch.equal(full[n], t), (tp, arch, n)
