"""Multi-latent attention (--multi-latent-attention: megatron-core's MLASelfAttention, DeepSeek-V2/V3) equals
Hugging Face transformers' DeepseekV3 attention.

The parent builds dense DeepseekV3ForCausalLM models (eager attention, fp32; every layer dense:
first_k_dense_replace = layers) with odd small sizes, perturbs every weight, and maps them to our full
tensors with the mapping below, written here independently of zo_megatron's converters (the names are
one to one; megatron-core de-interleaves the rotary channels as HF's rope_interleave does). Each world
loads them at TP 1, 2, and 2 with sequence parallelism, runs one forward/backward and sends back the
gathered logits, loss and every gradient; the parent compares them with transformers' own, every element.
On a CPU the value heads are padded to the query/key head dim for torch's flash kernel (it
takes equal dims only; its math path would store the s x s probabilities): the test checks that kernel ran.
Cases: a query latent (q_lora_rank) with YaRN (DeepSeek-V3's rope_scaling: factor, mscale, mscale_all_dim,
which also scales the softmax), and queries projected directly (DeepSeek-V2-Lite's shape) with plain RoPE.
"""
import pytest
import torch
import torch.distributed as dist

from tests.harness import run_world
from tests.seeds import fresh_seed

transformers = pytest.importorskip("transformers")

LAYERS, HIDDEN, HEADS, FFN, SEQ, BATCH, VOCAB = 2, 64, 4, 120, 12, 2, 203
KV_RANK, NOPE, ROPE, V = 24, 12, 8, 10

_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
         "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.9, "mscale_all_dim": 0.8}
# name: (HF config kwargs, our GPTConfig kwargs)
CASES = {
    "q_latent_yarn": (dict(q_lora_rank=20, rope_parameters=_YARN),
                      dict(q_lora_rank=20, rope_type="yarn", rotary_scaling_factor=4.0,
                           yarn_original_max_position_embeddings=16, mscale=0.9, mscale_all_dim=0.8)),
    "q_direct_rope": (dict(q_lora_rank=None, rope_parameters={"rope_type": "default", "rope_theta": 5000.0}),
                      dict(q_lora_rank=None, rope_type="rope", rotary_base=5000)),
}
_OURS = dict(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, ffn_hidden_size=FFN, vocab_size=VOCAB,
             max_position_embeddings=64, precision="fp32", position_embedding_type="rope", normalization="RMSNorm",
             layernorm_epsilon=1e-6, swiglu=True, add_bias_linear=False, untie_embeddings_and_output_weights=True,
             qk_layernorm=True, attention_backend="sdpa", multi_latent_attention=True, kv_lora_rank=KV_RANK,
             qk_head_dim=NOPE, qk_pos_emb_head_dim=ROPE, v_head_dim=V)

_ATTN = {"q_proj": "linear_q_proj", "q_a_proj": "linear_q_down_proj", "q_a_layernorm": "q_layernorm",
         "q_b_proj": "linear_q_up_proj", "kv_a_proj_with_mqa": "linear_kv_down_proj",
         "kv_a_layernorm": "kv_layernorm", "kv_b_proj": "linear_kv_up_proj", "o_proj": "linear_proj"}


def hf_to_ours(sd: dict) -> dict:
    out = {"gpt.embedding.word_embeddings.weight": sd["model.embed_tokens.weight"],
           "gpt.decoder.final_layernorm.weight": sd["model.norm.weight"],
           "gpt.output_layer.weight": sd["lm_head.weight"]}
    for i in range(LAYERS):
        hf, me = f"model.layers.{i}.", f"gpt.decoder.layers.{i}."
        for theirs, ours in _ATTN.items():
            if f"{hf}self_attn.{theirs}.weight" in sd:
                out[f"{me}self_attention.{ours}.weight"] = sd[f"{hf}self_attn.{theirs}.weight"]
        out[f"{me}input_layernorm.weight"] = sd[f"{hf}input_layernorm.weight"]
        out[f"{me}pre_mlp_layernorm.weight"] = sd[f"{hf}post_attention_layernorm.weight"]
        out[f"{me}mlp.linear_fc1.weight"] = torch.cat([sd[f"{hf}mlp.gate_proj.weight"], sd[f"{hf}mlp.up_proj.weight"]])
        out[f"{me}mlp.linear_fc2.weight"] = sd[f"{hf}mlp.down_proj.weight"]
    return out


def _hf_model(case: str, seed: int):
    config = transformers.DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=HEADS, kv_lora_rank=KV_RANK, qk_nope_head_dim=NOPE,
        qk_rope_head_dim=ROPE, v_head_dim=V, first_k_dense_replace=LAYERS, max_position_embeddings=64,
        rms_norm_eps=1e-6, tie_word_embeddings=False, attention_dropout=0.0, **CASES[case][0])
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.DeepseekV3ForCausalLM(config).float()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():      # every weight random, norms around 1
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1 + (1.0 if "norm" in name else 0.0))
    return model


def _world(rank, tp, sp, cases, batch_seed):
    from zo_megatron.model import GPTConfig, build_gpt_model
    from zo_megatron.model.sharding import gather_full, load_full_params, model_shard_infos
    from zo_megatron.parallel import init_parallel

    ps = init_parallel(tp, seed=batch_seed)
    gen = torch.Generator().manual_seed(batch_seed)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    results = {}
    for case, full in cases.items():
        cfg = GPTConfig(**_OURS, **CASES[case][1], sequence_parallel=sp)
        model = build_gpt_model(cfg, ps.tp_rank, ps.tp_size, seed=batch_seed)
        load_full_params(model, full, ps.tp_rank, ps.tp_size, VOCAB)
        infos = model_shard_infos(model, ps.tp_rank, ps.tp_size, VOCAB)
        logits = model(tokens)
        loss = model.loss(tokens, labels)
        loss.backward()
        if sp:   # what the engine does for parameters tagged sequence_parallel: sum their gradients over TP
            for p in model.parameters():
                if getattr(p, "sequence_parallel", False):
                    dist.all_reduce(p.grad, group=ps.tp_group)
        shards = [torch.empty_like(logits) for _ in range(tp)]
        dist.all_gather(shards, logits.detach().contiguous(), group=ps.tp_group)
        results[case] = dict(
            kernels={m.last_kernel for m in model.modules() if hasattr(m, "last_kernel")},
            logits=torch.cat(shards, dim=-1)[..., :VOCAB], loss=loss.item(),
            grads={n: gather_full(p.grad, infos[n], ps.tp_group, tp) for n, p in model.named_parameters()})
    return (results, tokens, labels) if rank == 0 else None


def _rel_err(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-30)).item()


@pytest.mark.parametrize("tp,sp", [(1, False), (2, False), (2, True)])
def test_mla_matches_transformers_deepseek_v3(tp, sp):
    seed = fresh_seed(f"MLA TP{tp}{' SP' if sp else ''}")
    hf_models = {case: _hf_model(case, seed + i) for i, case in enumerate(CASES)}
    cases = {case: hf_to_ours({k: v.detach().clone() for k, v in m.state_dict().items()})
             for case, m in hf_models.items()}
    results, tokens, labels = run_world(_world, tp, tp, sp, cases, seed, timeout=300)[0]
    for case, hf in hf_models.items():
        out = results[case]
        logits = hf(tokens).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))
        loss.backward()
        ref_grads = hf_to_ours({n: p.grad for n, p in hf.named_parameters()})
        # the value head dim (10) differs from the query/key's (20): padded, the CPU flash kernel runs it
        assert out["kernels"] == {"flash"}, (case, out["kernels"])
        assert _rel_err(out["logits"], logits.detach()) <= 1e-5, case
        assert abs(out["loss"] - loss.item()) <= 1e-5 * abs(loss.item()), case
        assert set(out["grads"]) == set(ref_grads), (case, set(out["grads"]) ^ set(ref_grads))
        for name, g in out["grads"].items():
            assert g.shape == ref_grads[name].shape, (case, name)
            assert _rel_err(g, ref_grads[name]) <= 1e-5, (case, name, _rel_err(g, ref_grads[name]))


def test_num_parameters_matches_transformers():
    from zo_megatron.model import GPTConfig

    for i, case in enumerate(CASES):
        hf = _hf_model(case, i)
        assert GPTConfig(**_OURS, **CASES[case][1]).num_parameters() == sum(p.numel() for p in hf.parameters()), case


def test_mla_rules_one_line_each():
    """What megatron-core's MLA would run silently or not at all is refused in one line; without a backend
    named, MLA gets torch SDPA (megatron-core 0.16's local attention cannot run it), anything else the local one."""
    from zo_megatron.errors import ConfigError
    from zo_megatron.model import GPTConfig

    base = {k: v for k, v in _OURS.items() if k != "attention_backend"}
    assert GPTConfig(**base).attention_backend == "sdpa"
    assert GPTConfig(**{**base, "multi_latent_attention": False, "kv_lora_rank": 32, "qk_head_dim": 128,
                        "qk_pos_emb_head_dim": 64, "v_head_dim": 128}).attention_backend == "local"
    assert GPTConfig(**base).rope_type == "yarn"                      # MLATransformerConfig's default
    refused = {"attention_backend": ("local", "--attention-backend local with --multi-latent-attention"),
               "num_query_groups": (2, "--num-query-groups 2 with --multi-latent-attention"),
               "position_embedding_type": ("yarn", "--position-embedding-type yarn with --multi-latent-attention"),
               "add_qkv_bias": (True, "--add-qkv-bias with --multi-latent-attention"),
               "use_rope_scaling": (True, "--use-rope-scaling with --multi-latent-attention"),
               "qk_pos_emb_head_dim": (7, "--qk-pos-emb-head-dim 7: rotary channels come in pairs")}
    for field, (value, words) in refused.items():
        with pytest.raises(ConfigError, match=words) as e:
            GPTConfig(**{**base, field: value})
        assert "\n" not in str(e.value)
    # YaRN's settings that MLA's plain RoPE never reads; its factor and mscale_all_dim scale the softmax
    with pytest.raises(ConfigError, match="--yarn-beta-fast, --mscale with --rope-type rope"):
        GPTConfig(**base, rope_type="rope", yarn_beta_fast=8.0, mscale=0.5)
    assert GPTConfig(**base, rope_type="rope", rotary_scaling_factor=40.0, mscale_all_dim=1.0).rope_type == "rope"
    with pytest.raises(ConfigError, match="add --multi-latent-attention"):
        GPTConfig(**{**base, "multi_latent_attention": False})        # the MLA sizes without MLA
    with pytest.raises(ConfigError, match="does not divide --q-lora-rank 18"):
        GPTConfig(**base, q_lora_rank=18).check_tensor_parallel(4)


def _latent_storage_world(rank, seed):
    from zo_megatron.model import GPTConfig, build_gpt_model
    from zo_megatron.parallel import init_parallel

    ps = init_parallel(2, seed=seed)
    cfg = GPTConfig(**{**_OURS, "qk_layernorm": False}, **CASES["q_latent_yarn"][1], sequence_parallel=True)
    model = build_gpt_model(cfg, ps.tp_rank, ps.tp_size, seed=seed)
    seen = []
    for layer in model.gpt.decoder.layers:
        layer.self_attention.linear_q_up_proj.register_forward_hook(
            lambda _m, args, _out: seen.append((args[0].shape, args[0].numel() * args[0].element_size(),
                                                args[0].untyped_storage().nbytes())))
    model(torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed)))
    return seen


def test_the_query_latent_under_sequence_parallelism_holds_this_ranks_tokens_only():
    """megatron-core scatters the gathered query latent back to this rank's tokens as a slice, a view of the
    whole sequence; what linear_q_up_proj keeps for backward (without latent norms, its input) must own just
    this rank's [s/TP, b, q_lora_rank] (model/mla.py copies it), not keep the gathered sequence alive."""
    seed = fresh_seed("MLA q latent storage under SP")
    for seen in run_world(_latent_storage_world, 2, seed):
        assert len(seen) == LAYERS
        for shape, nbytes, storage in seen:
            assert tuple(shape) == (SEQ // 2, BATCH, 20) and storage == nbytes, (shape, nbytes, storage)


def test_a_tp_size_that_splits_no_latent_is_one_line_exit_2(tmp_path):
    """--q-lora-rank 18 at TP 4 (the latent's column-parallel down projection cannot split): one line naming it,
    exit 2, before any process starts (the planner ran first and raised its own ValueError: a traceback)."""
    from tests.test_pretrain import _single

    r = _single(["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128", "--num-layers", "1",
                 "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32", "--lr", "1e-3",
                 "--train-iters", "1", "--multi-latent-attention", "--q-lora-rank", "18", "--kv-lora-rank", "16",
                 "--qk-head-dim", "8", "--qk-pos-emb-head-dim", "8", "--v-head-dim", "8",
                 "--tensor-model-parallel-size", "4"], tmp_path)
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert r.returncode == 2 and len(errors) == 1 and "does not divide --q-lora-rank 18" in errors[0], r.stderr[-2000:]
    assert "Traceback" not in r.stderr
