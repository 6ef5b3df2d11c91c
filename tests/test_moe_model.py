"""The mixture-of-experts GPT (megatron-core's MoELayer, local spec) equals Hugging Face's Mixtral.

The parent builds a transformers MixtralForCausalLM (eager attention, fp32, every weight random,
the router's too) with odd sizes, saves it, and our model loads the saved files through
zo_megatron.checkpoint.hf.mixtral's mapping (experts w1/w3 -> [gate; up], the router -> mlp.router).
Each layout runs one forward/backward on 2 forked ranks (gloo): TP1 x EP1 (DP 2), TP1 x EP2 with the
alltoall dispatcher (DP 2, each EP rank holding 2 of the 4 experts), TP2 with sequence parallelism
and the allgather dispatcher (DP 1). The batch is split over DP; the gradients are reduced as
Megatron-LM's DDP reduces them (dense ones averaged over DP, experts' scaled by 1/DP and summed over
their expert-DP group; sequence-parallel ones summed over TP first), and the parent compares the
logits, the loss (aux loss off: transformers adds none without output_router_logits) and every
gradient with transformers' own on the whole batch, every element, mapped back through the same
mapping. TP2 x EP2 (allgather), EP4 and EP2 x DP2 (alltoall) on 4 ranks: -m slow. (The alltoall
dispatcher at TP > 1 is refused on CPUs: it all-gathers uneven token counts over expert TP, which gloo
cannot.)
"""
import os

import pytest
import torch

from tests.harness import free_port, run_world
from tests.seeds import fresh_seed

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

LAYERS, HIDDEN, HEADS, GROUPS, FFN, EXPERTS, TOPK, SEQ, BATCH, VOCAB = 2, 64, 4, 2, 40, 4, 2, 12, 4, 97


def _mixtral_dir(directory, seed):
    cfg = transformers.MixtralConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                                     num_attention_heads=HEADS, num_key_value_heads=GROUPS, max_position_embeddings=64,
                                     rms_norm_eps=1e-5, num_local_experts=EXPERTS, num_experts_per_tok=TOPK,
                                     tie_word_embeddings=False, sliding_window=None, attention_dropout=0.0,
                                     rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    torch.manual_seed(seed)
    model = transformers.MixtralForCausalLM(cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():      # every weight random, norms around 1
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1 + (1.0 if "norm" in name else 0.0))
    model.save_pretrained(str(directory))
    return str(directory)


def _hf(directory):
    return transformers.AutoModelForCausalLM.from_pretrained(directory, local_files_only=True, dtype=torch.float32,
                                                             attn_implementation="eager")


def _world(rank, directory, tokens, labels, layouts, ports):
    from zo_megatron.checkpoint.hf import mixtral
    from zo_megatron.model import GPTConfig, build_gpt_model
    from zo_megatron.model.sharding import gather_full, load_full_params, model_shard_infos
    from zo_megatron.parallel import collectives, destroy_parallel, init_parallel

    meta = mixtral.meta_from_config(transformers.AutoConfig.from_pretrained(directory), directory)
    full = mixtral.from_hf(safetensors_torch.load_file(os.path.join(directory, "model.safetensors")), meta)
    out = {}
    for (tp, ep, dispatcher), port in zip(layouts, ports):
        os.environ["MASTER_PORT"] = str(port)
        ps = init_parallel(tp, expert_parallel=ep)
        cfg = GPTConfig(**{**meta, "moe_token_dispatcher_type": dispatcher}, precision="fp32", sequence_parallel=tp > 1)
        model = build_gpt_model(cfg, ps.tp_rank, ps.tp_size, seed=1)
        infos = model_shard_infos(model, ps.tp_rank, ps.tp_size, VOCAB)
        init = {model.full_name(n): gather_full(p.detach().clone(), infos[n], ps.tp_group, tp)
                for n, p in model.named_parameters()}
        load_full_params(model, full, ps.tp_rank, ps.tp_size, VOCAB)
        rows = slice(ps.dp_rank * BATCH // ps.dp_size, (ps.dp_rank + 1) * BATCH // ps.dp_size)
        logits = model(tokens[rows])
        loss = model.loss(tokens[rows], labels[rows])
        loss.backward()
        grads = {}
        for n, p in model.named_parameters():
            g = p.grad
            if getattr(p, "sequence_parallel", False) and tp > 1:     # megatron's finalize_model_grads
                g = collectives.all_reduce(g.clone(), "sum", ps.tp_group)
            grads[model.full_name(n)] = gather_full(g, infos[n], ps.tp_group, tp) / ps.dp_size
        full_logits = torch.cat(collectives.all_gather_list(logits.detach().contiguous(), ps.tp_group), -1)
        out[(tp, ep, dispatcher)] = dict(tp_rank=ps.tp_rank, dp_rank=ps.dp_rank, rows=(rows.start, rows.stop), ep=(ps.ep_rank, ps.ep_size),
                                         edp=(ps.edp_rank, ps.edp_size), logits=full_logits[..., :VOCAB].clone(),
                                         loss=loss.item(), grads=grads, init=init,
                                         experts=sorted({n.split("local_experts.")[1].split(".")[0]
                                                         for n in grads if "local_experts" in n}))
        collectives.barrier()
        destroy_parallel()
    return out


def _rel_err(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-30)).item()


def _check(world, layout, ref_logits, ref_loss, ref_grads):
    outs = [o[layout] for o in world]
    for o in outs:
        assert _rel_err(o["logits"], ref_logits[slice(*o["rows"])]) <= 1e-5, layout
    dp = {o["dp_rank"]: o["loss"] for o in outs}
    assert abs(sum(dp.values()) / len(dp) - ref_loss) <= 1e-5 * ref_loss, (layout, dp, ref_loss)
    got = {}
    for o in outs:
        if o["tp_rank"] == 0:                 # each DP rank once; each expert once per expert-DP rank
            for n, g in o["grads"].items():
                got[n] = got[n] + g if n in got else g
    assert set(got) == set(ref_grads), (layout, set(got) ^ set(ref_grads))
    for n, g in got.items():
        assert g.shape == ref_grads[n].shape, (layout, n)
        assert _rel_err(g, ref_grads[n]) <= 1e-5, (layout, n, _rel_err(g, ref_grads[n]))


def _compare(tmp_path, seed, world_size, layouts):
    from zo_megatron.checkpoint.hf import mixtral

    directory = _mixtral_dir(tmp_path / "mixtral", seed)
    gen = torch.Generator().manual_seed(seed + 1)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    world = run_world(_world, world_size, directory, tokens, labels, layouts, [free_port() for _ in layouts],
                      timeout=300)
    hf = _hf(directory)
    logits = hf(tokens).logits
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))
    loss.backward()
    meta = mixtral.meta_from_config(hf.config, directory)
    # transformers' in-memory names -> the on-disk ones the mapping reads (gate_up_proj is [E, 2f, h], [gate; up])
    sd = {}
    for n, p in hf.named_parameters():
        if n.endswith("mlp.experts.gate_up_proj"):
            i = n.split(".")[2]
            for e in range(EXPERTS):
                sd[f"model.layers.{i}.block_sparse_moe.experts.{e}.w1.weight"], \
                    sd[f"model.layers.{i}.block_sparse_moe.experts.{e}.w3.weight"] = p.grad[e].split([FFN, FFN])
        elif n.endswith("mlp.experts.down_proj"):
            i = n.split(".")[2]
            for e in range(EXPERTS):
                sd[f"model.layers.{i}.block_sparse_moe.experts.{e}.w2.weight"] = p.grad[e]
        else:
            sd[n.replace(".mlp.gate.", ".block_sparse_moe.gate.")] = p.grad
    ref_grads = mixtral.from_hf(sd, meta)
    for layout in layouts:
        _check(world, layout, logits.detach(), loss.item(), ref_grads)
    # one seed, one model: the initial weights (experts by global index) are the same at every layout
    first = {}
    for o in world:
        for layout in layouts:
            for n, t in o[layout]["init"].items():
                assert torch.equal(first.setdefault(n, t), t), (layout, n)
    assert set(first) == set(ref_grads)
    return world


def test_mixtral_logits_loss_and_every_gradient_at_tp1_ep1_ep2_and_tp2(tmp_path):
    seed = fresh_seed("moe mixtral")
    layouts = [(1, 1, "allgather"), (1, 2, "alltoall"), (2, 1, "allgather")]
    world = _compare(tmp_path, seed, 2, layouts)
    # the expert layout megatron-core built: EP2 -> experts 0-1 on EP rank 0, 2-3 on EP rank 1, expert DP 1
    for rank, o in enumerate(world):
        assert o[(1, 2, "alltoall")]["ep"] == (rank, 2) and o[(1, 2, "alltoall")]["edp"] == (0, 1)
        assert o[(1, 2, "alltoall")]["experts"] == [str(2 * rank), str(2 * rank + 1)]
        assert o[(1, 1, "allgather")]["experts"] == ["0", "1", "2", "3"] and o[(1, 1, "allgather")]["edp"] == (rank, 2)


def test_expert_layout_rules_and_the_parameter_count():
    """The expert layout's one-line refusals (EP x expert TP not dividing the world, EP not dividing the
    experts, an expert TP other than TP, MoE at TP > 1 without sequence parallelism, top-k above the
    experts) and the MoE parameter count against transformers' Mixtral and Qwen2-MoE (shared expert, gate)."""
    from zo_megatron.errors import ConfigError
    from zo_megatron.model import GPTConfig
    from zo_megatron.parallel import validate_parallel_config

    with pytest.raises(ConfigError, match=r"--expert-model-parallel-size 4 x --expert-tensor-parallel-size 1 = 4 "
                                          r"does not divide the world size 6"):
        validate_parallel_config(6, 1, expert_parallel=4)
    with pytest.raises(ConfigError, match=r"= 4 does not divide the world size 2"):
        validate_parallel_config(2, 2, expert_parallel=2)             # expert TP defaults to TP
    validate_parallel_config(8, 2, expert_parallel=4)
    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=97, max_position_embeddings=16,
                swiglu=True, add_bias_linear=False, num_experts=6)
    cfg = GPTConfig(**base)
    for args, says in (((1, 4, None, False), "--expert-model-parallel-size 4 does not divide --num-experts 6"),
                       ((2, 1, 1, True), "--expert-tensor-parallel-size 1 differs"),
                       ((2, 2, None, False), "need --sequence-parallel")):
        with pytest.raises(ConfigError, match=says):
            cfg.check_expert_parallel(*args)
    cfg.check_expert_parallel(2, 3, None, True)
    with pytest.raises(ConfigError, match="--moe-router-topk 7 with --num-experts 6"):
        GPTConfig(**base, moe_router_topk=7)
    with pytest.raises(ConfigError, match="add --moe-router-pre-softmax"):
        GPTConfig(**base, moe_router_topk=1)
    with pytest.raises(ConfigError, match="one 0 .dense. or 1 .MoE. per layer, 2 entries"):
        GPTConfig(**base, moe_layer_freq=[1, 0, 1])
    assert GPTConfig(**{**base, "num_layers": 4}, moe_layer_freq=2).moe_layers() == [True, False, True, False]

    mixtral = transformers.MixtralConfig(vocab_size=97, hidden_size=32, intermediate_size=24, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, num_local_experts=6,
                                         num_experts_per_tok=2, tie_word_embeddings=False)
    ours = GPTConfig(**{**base, "num_query_groups": 2, "ffn_hidden_size": 24, "position_embedding_type": "rope",
                        "normalization": "RMSNorm", "untie_embeddings_and_output_weights": True})
    assert ours.num_parameters() == sum(p.numel() for p in transformers.MixtralForCausalLM(mixtral).parameters())
    qwen = transformers.Qwen2MoeConfig(vocab_size=97, hidden_size=32, intermediate_size=40, moe_intermediate_size=24,
                                       shared_expert_intermediate_size=56, num_hidden_layers=2, num_attention_heads=4,
                                       num_key_value_heads=2, num_experts=6, num_experts_per_tok=2,
                                       tie_word_embeddings=False, qkv_bias=False)
    ours = GPTConfig(**{**base, "num_query_groups": 2, "ffn_hidden_size": 40, "moe_ffn_hidden_size": 24,
                        "moe_shared_expert_intermediate_size": 56, "moe_shared_expert_gate": True,
                        "position_embedding_type": "rope", "normalization": "RMSNorm",
                        "untie_embeddings_and_output_weights": True})
    assert ours.num_parameters() == sum(p.numel() for p in transformers.Qwen2MoeForCausalLM(qwen).parameters())


@pytest.mark.slow
def test_mixtral_at_tp2_ep2_on_4_ranks(tmp_path):
    seed = fresh_seed("moe mixtral tp2 ep2")
    _compare(tmp_path, seed, 4, [(2, 2, "allgather"), (1, 4, "alltoall"), (1, 2, "alltoall")])
