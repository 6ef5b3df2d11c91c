"""The mixture-of-experts GPT (megatron-core's MoELayer, local spec) equals Hugging Face's Mixtral,
Qwen2-MoE and Qwen3-MoE.

The parent builds each transformers model (eager attention, fp32, every weight random, the router's
and the shared expert gate's too) with odd sizes and saves it; our model loads the saved files
through zo_megatron.checkpoint.hf's mapping of that family (mixtral.py, qwen_moe.py). Each layout runs
one forward/backward on 2 forked ranks (gloo): TP1 x EP1 (DP 2), TP1 x EP2 with the alltoall
dispatcher (DP 2, each EP rank holding 2 of the 4 experts), TP2 with sequence parallelism and the
allgather dispatcher (DP 1). The batch is split over DP; the gradients are reduced as Megatron-LM's
DDP reduces them (dense ones averaged over DP, experts' scaled by 1/DP and summed over their
expert-DP group; sequence-parallel ones summed over TP first), and the parent compares the logits,
the loss (aux loss off: transformers adds none without output_router_logits) and every gradient with
transformers' own on the whole batch, every element, the gradients mapped through the same mapping
(transformers writes them as a model's weights). TP2 x EP2 (allgather), EP4 and EP2 x DP2
(alltoall) on 4 ranks: -m slow. (The alltoall dispatcher at TP > 1 is refused on CPUs: it
all-gathers uneven token counts over expert TP, which gloo cannot.)
"""
import os

import pytest
import torch

from tests.harness import next_port, run_world
from tests.seeds import fresh_seed

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

LAYERS, HIDDEN, HEADS, GROUPS, FFN, EXPERTS, TOPK, SEQ, BATCH, VOCAB = 2, 64, 4, 2, 40, 4, 2, 12, 4, 97


def _configs():
    """name -> transformers config: Mixtral; Qwen2-MoE with its gated shared expert, QKV biases, no
    renormalisation of the top k (norm_topk_prob false: --moe-router-pre-softmax) and a dense layer 1
    (mlp_only_layers: --moe-layer-freq [1,0]); Qwen3-MoE with q/k norms and head_dim 24 (not 64 / 4)."""
    common = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                  num_key_value_heads=GROUPS, max_position_embeddings=64, rms_norm_eps=1e-5, num_experts_per_tok=TOPK,
                  tie_word_embeddings=False, attention_dropout=0.0,
                  rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    return {"mixtral": transformers.MixtralConfig(**common, intermediate_size=FFN, num_local_experts=EXPERTS,
                                                  sliding_window=None),
            "qwen2_moe": transformers.Qwen2MoeConfig(**common, intermediate_size=56, moe_intermediate_size=FFN,
                                                     shared_expert_intermediate_size=48, num_experts=EXPERTS,
                                                     norm_topk_prob=False, mlp_only_layers=[1], qkv_bias=True),
            "qwen3_moe": transformers.Qwen3MoeConfig(**common, intermediate_size=56, moe_intermediate_size=FFN,
                                                     num_experts=EXPERTS, norm_topk_prob=True, head_dim=24)}


def _random_hf(directory, cfg, seed):
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():      # every weight random, norms around 1
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1 + (1.0 if "norm" in name else 0.0))
    model.save_pretrained(str(directory))
    return str(directory)


def _hf(directory):
    return transformers.AutoModelForCausalLM.from_pretrained(directory, local_files_only=True, dtype=torch.float32,
                                                             attn_implementation="eager")


def _ours(directory):
    """(meta, our full tensors) of a saved HF model, read by its family's from-hf mapping."""
    from zo_megatron.checkpoint import hf

    family = hf.family_for_config(hf.read_config_json(directory), directory)
    cfg = family.read_config(hf.read_config_json(directory), directory)
    meta, _ = family.meta_from_config(cfg, directory)
    return meta, family.read_state(directory, cfg, meta)


def _world(rank, dirs, tokens, labels, layouts):
    from zo_megatron.parallel import collectives, destroy_parallel, init_parallel

    models = {name: _ours(d) for name, d in dirs.items()}
    out = {}
    for layout in layouts:
        tp, ep, dispatcher, *etp = layout          # (TP, EP, dispatcher[, expert TP: default TP])
        next_port()                                # chosen now, not when the test started
        ps = init_parallel(tp, expert_parallel=ep, expert_tensor_parallel=etp[0] if etp else None)
        for name, (meta, full) in models.items():
            out[(name, *layout)] = _one(ps, meta, full, tokens, labels, dispatcher)
        collectives.barrier()
        destroy_parallel()
    return out


def _one(ps, meta, full, tokens, labels, dispatcher):
    """One forward/backward of our model of `meta` with the full weights `full` at the layout `ps`."""
    from zo_megatron.checkpoint.arch import param_shapes
    from zo_megatron.model import GPTConfig, build_gpt_model
    from zo_megatron.model.sharding import gather_full, load_full_params, model_shard_infos
    from zo_megatron.parallel import collectives

    tp = ps.tp_size
    cfg = GPTConfig(**{**meta, "moe_token_dispatcher_type": dispatcher}, precision="fp32", sequence_parallel=tp > 1)
    model = build_gpt_model(cfg, ps.tp_rank, ps.tp_size, seed=1)
    infos = model_shard_infos(model, ps.tp_rank, ps.tp_size, VOCAB)
    init = {model.full_name(n): gather_full(p.detach().clone(), infos[n], ps.tp_group, tp, ps.etp_group)
            for n, p in model.named_parameters()}
    load_full_params(model, full, ps.tp_rank, ps.tp_size, VOCAB)
    rows = slice(ps.dp_rank * BATCH // ps.dp_size, (ps.dp_rank + 1) * BATCH // ps.dp_size)
    with torch.no_grad():               # (no aux loss is applied or logged without gradients)
        logits = model(tokens[rows])
    loss = model.loss(tokens[rows], labels[rows])
    loss.backward()
    grads = {}
    for n, p in model.named_parameters():
        g = p.grad
        if getattr(p, "sequence_parallel", False) and tp > 1:     # megatron's finalize_model_grads
            g = collectives.all_reduce(g.clone(), "sum", ps.tp_group)
        grads[model.full_name(n)] = gather_full(g, infos[n], ps.tp_group, tp, ps.etp_group) / ps.dp_size
    full_logits = torch.cat(collectives.all_gather_list(logits.detach().contiguous(), ps.tp_group), -1)
    return dict(tp_rank=ps.tp_rank, etp_rank=ps.etp_rank, dp_rank=ps.dp_rank, rows=(rows.start, rows.stop), ep=(ps.ep_rank, ps.ep_size),
                edp=(ps.edp_rank, ps.edp_size), logits=full_logits[..., :VOCAB].clone(), loss=loss.item(), grads=grads,
                init=init,
                # the offline tools' shapes (checkpoint/arch.py) are the built model's
                shapes_ok=param_shapes(cfg.arch_meta()) == {n: tuple(t.shape) for n, t in init.items()}
                if ps.ep_size == 1 else None,
                experts=sorted({n.split("local_experts.")[1].split(".")[0] for n in grads if "local_experts" in n}))


def _rel_err(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-30)).item()


def _check(world, key, ref_logits, ref_loss, ref_grads):
    outs = [o[key] for o in world]
    for o in outs:
        assert _rel_err(o["logits"], ref_logits[slice(*o["rows"])]) <= 1e-5, key
    dp = {o["dp_rank"]: o["loss"] for o in outs}
    assert abs(sum(dp.values()) / len(dp) - ref_loss) <= 1e-5 * ref_loss, (key, dp, ref_loss)
    got = {}
    for o in outs:          # dense: each DP rank once (TP rank 0); an expert: once per expert-DP rank (expert TP
        for n, g in o["grads"].items():     # rank 0), which at expert TP 1 < TP is every TP rank of a DP rank
            if o["etp_rank" if ".mlp.experts." in n else "tp_rank"] == 0:
                got[n] = got[n] + g if n in got else g
    assert set(got) == set(ref_grads), (key, set(got) ^ set(ref_grads))
    for n, g in got.items():
        assert g.shape == ref_grads[n].shape, (key, n)
        assert _rel_err(g, ref_grads[n]) <= 1e-5, (key, n, _rel_err(g, ref_grads[n]))


def _reference(directory, tmp_path, tokens, labels):
    """transformers' logits, loss and gradients; the gradients as our full tensors: written as the
    model's weights by save_pretrained (its on-disk names) and read back through the same mapping."""
    hf = _hf(directory)
    logits = hf(tokens).logits
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))
    loss.backward()
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(p.grad)
    grads_dir = tmp_path / (os.path.basename(directory) + "_grads")
    hf.save_pretrained(str(grads_dir))
    return logits.detach(), loss.item(), _ours(str(grads_dir))[1]


def _compare(tmp_path, seed, world_size, layouts, names=None):
    configs = _configs()
    dirs = {name: _random_hf(tmp_path / name, configs[name], seed + i) for i, name in enumerate(names or configs)}
    gen = torch.Generator().manual_seed(seed + 100)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    world = run_world(_world, world_size, dirs, tokens, labels, layouts, timeout=300)
    for name, directory in dirs.items():
        ref_logits, ref_loss, ref_grads = _reference(directory, tmp_path, tokens, labels)
        first = {}
        for layout in layouts:
            _check(world, (name, *layout), ref_logits, ref_loss, ref_grads)
            # one seed, one model: the initial weights (experts by global index) are the same at every layout
            for o in world:
                for n, t in o[(name, *layout)]["init"].items():
                    assert torch.equal(first.setdefault(n, t), t), (name, layout, n)
        assert set(first) == set(ref_grads)
        assert all(o[(name, *layout)]["shapes_ok"] for o in world for layout in layouts if layout[1] == 1)
    return world


def test_moe_logits_loss_and_every_gradient_equal_transformers_at_tp1_ep1_ep2_and_tp2(tmp_path):
    seed = fresh_seed("moe families")
    layouts = [(1, 1, "allgather"), (1, 2, "alltoall"), (2, 1, "allgather")]
    world = _compare(tmp_path, seed, 2, layouts)
    # the expert layout megatron-core built: EP2 -> experts 0-1 on EP rank 0, 2-3 on EP rank 1, expert DP 1
    for rank, o in enumerate(world):
        ep2, ep1 = o[("mixtral", 1, 2, "alltoall")], o[("mixtral", 1, 1, "allgather")]
        assert ep2["ep"] == (rank, 2) and ep2["edp"] == (0, 1) and ep2["experts"] == [str(2 * rank), str(2 * rank + 1)]
        assert ep1["experts"] == ["0", "1", "2", "3"] and ep1["edp"] == (rank, 2)


def test_experts_whole_beside_attention_at_tp2_expert_tp_1(tmp_path):
    """--expert-tensor-parallel-size 1 at TP 2 (Megatron-LM's MoE recipes): attention and the dense MLP
    split over TP, each expert whole on its rank. EP 1: expert DP 2 (both TP ranks hold every expert,
    each sees its own sequence-parallel tokens); EP 2 with either dispatcher: each rank holds 2 whole
    experts, expert DP 1. Logits, loss and every gradient equal transformers'."""
    seed = fresh_seed("moe expert tp 1 at tp 2")
    layouts = [(2, 1, "allgather", 1), (2, 2, "alltoall", 1), (2, 2, "allgather", 1)]
    world = _compare(tmp_path, seed, 2, layouts)
    for rank, o in enumerate(world):
        ep1, ep2 = o[("mixtral", 2, 1, "allgather", 1)], o[("mixtral", 2, 2, "alltoall", 1)]
        assert ep1["experts"] == ["0", "1", "2", "3"] and ep1["edp"] == (rank, 2) and ep1["tp_rank"] == rank
        assert ep2["experts"] == [str(2 * rank), str(2 * rank + 1)] and ep2["ep"] == (rank, 2) and ep2["edp"] == (0, 1)
        assert ep1["etp_rank"] == ep2["etp_rank"] == 0


def _aux_world(rank, directory, tokens, labels, coeff):
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    from zo_megatron.parallel import init_parallel

    meta, full = _ours(directory)
    out = _one(init_parallel(1), {**meta, "moe_aux_loss_coeff": coeff}, full, tokens, labels, "allgather")
    out["aux"] = get_moe_layer_wise_logging_tracker()["load_balancing_loss"]["values"].clone()
    return out


def test_the_load_balancing_loss_of_one_moe_layer_is_transformers_over_k(tmp_path):
    """transformers' load-balancing loss (output_router_logits, router_aux_loss_coef c) pools every
    layer's tokens and does not divide by k; megatron-core's aux_loss is per layer and divides by k
    (docs/moe.md). With one MoE layer (the Qwen2-MoE here: layer 1 is dense) they agree up to k:
    megatron-core's logged value x k is transformers' aux_loss, and with --moe-aux-loss-coeff k x c every
    gradient of our LM loss (the aux loss's gradient rides on the router's output) equals transformers'
    gradient of CE + c x aux_loss; our `loss` stays the LM loss."""
    seed = fresh_seed("moe aux loss")
    c = 0.05
    directory = _random_hf(tmp_path / "qwen2_moe", _configs()["qwen2_moe"], seed)
    gen = torch.Generator().manual_seed(seed + 1)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    ours = run_world(_aux_world, 1, directory, tokens, labels, TOPK * c, timeout=120)[0]
    hf = _hf(directory)
    hf.config.router_aux_loss_coef = c
    out = hf(tokens, output_router_logits=True)
    ce = torch.nn.functional.cross_entropy(out.logits.reshape(-1, VOCAB), labels.reshape(-1))
    (ce + c * out.aux_loss).backward()
    assert ours["aux"][1] == 0 and abs(TOPK * ours["aux"][0].item() - out.aux_loss.item()) <= 1e-5 * out.aux_loss.item()
    assert abs(ours["loss"] - ce.item()) <= 1e-5 * ce.item()
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(p.grad)
    hf.save_pretrained(str(tmp_path / "grads"))
    ref = _ours(str(tmp_path / "grads"))[1]
    assert set(ref) == set(ours["grads"])
    for n, g in ours["grads"].items():
        assert _rel_err(g, ref[n]) <= 1e-5, (n, _rel_err(g, ref[n]))


def test_expert_layout_rules_and_the_parameter_count():
    """The expert layout's one-line refusals (EP x expert TP not dividing the world, EP not dividing the
    experts, an expert TP not dividing the experts' FFN, MoE at TP > 1 without sequence parallelism, top-k above the
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
                       ((2, 1, 3, True), r"expert TP 3 \(--expert-tensor-parallel-size, default TP\) does not divide "
                                         r"the experts' FFN size"),
                       ((2, 2, None, False), "need --sequence-parallel")):
        with pytest.raises(ConfigError, match=says):
            cfg.check_expert_parallel(*args)
    cfg.check_expert_parallel(2, 3, None, True)
    cfg.check_expert_parallel(2, 2, 1, True)          # whole experts beside TP 2 attention (expert TP 1)
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
def test_moe_families_at_tp2_ep2_and_ep4_on_4_ranks(tmp_path):
    seed = fresh_seed("moe mixtral tp2 ep2")
    _compare(tmp_path, seed, 4, [(2, 2, "allgather"), (1, 4, "alltoall"), (1, 2, "alltoall")])


def _routed_expert_world(rank):
    from megatron.core.transformer.moe.experts import SequentialMLP

    from zo_megatron.model import GPTConfig, build_gpt_model
    from zo_megatron.parallel import destroy_parallel, init_parallel

    init_parallel(1)
    try:
        cfg = GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=97, max_position_embeddings=16,
                        swiglu=True, add_bias_linear=False, num_experts=4, ffn_hidden_size=40, moe_ffn_hidden_size=24,
                        moe_shared_expert_intermediate_size=56, moe_shared_expert_gate=True, moe_layer_freq=[1, 0],
                        position_embedding_type="rope", normalization="RMSNorm", precision="fp32")
        model = build_gpt_model(cfg, 0, 1, seed=1)
        owned = {f"{prefix}.{n}" if prefix else n
                 for prefix, m in model.named_modules() if isinstance(m, SequentialMLP)
                 for n, _ in m.named_parameters()}
        return sorted(owned), [n for n, _ in model.named_parameters()]
    finally:
        destroy_parallel()


def test_one_routed_expert_rule_is_megatron_cores_expert_modules_and_the_planners_rows(tmp_path):
    """zo_megatron/param_names.is_routed_expert (the rule the sharding, the two engines and the planner
    share) against megatron-core's own module tree: a parameter is a routed expert's exactly when a
    SequentialMLP owns it — not the router, not Qwen2-MoE's shared expert or its gate, not a dense MLP
    layer (--moe-layer-freq [1, 0]); and the planner's parameter rows of the same model mark the same
    names (the model wraps megatron-core's GPTModel as `gpt.`)."""
    from zo_megatron.param_names import is_routed_expert
    from zo_megatron.planner import params as P

    owned, names = run_world(_routed_expert_world, 1)[0]
    marked = [n for n in names if is_routed_expert(n)]
    assert marked and any("shared_experts" in n for n in names) and any("router" in n for n in names)
    assert sorted(marked) == [n for n in owned if n in names] == sorted(set(owned)), (marked, owned)
    moe = P.MoEShape(num_experts=4, topk=2, ffn=24, shared=56, shared_gate=True, layers=(True, False))
    arch = P.Architecture(position_embedding_type="rope", normalization="RMSNorm", swiglu=True, add_bias_linear=False,
                          untie_embeddings_and_output_weights=False)
    rows = [n for n, _, _ in P.model_parameters(2, 32, 40, 4, 128, 16, arch, moe)]
    planned = [n for n in rows if is_routed_expert(n)]
    assert planned == [n.removeprefix("gpt.") for n in marked], (planned, marked)
