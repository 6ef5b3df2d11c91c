"""--recompute-modules (megatron-core's selective recompute) and --moe-layer-recompute.

Recompute changes memory, never the math: each variant's loss, every gradient and (with experts) the
router's tracked aux and z losses equal, bit for bit, those of the same model run without recompute
from the same weights, batch and random streams (dropout on, so the recomputed forward must redraw
the same masks); and the modules named run forward twice (once more in backward), the others once.
The run without recompute is itself held to transformers' models (tests/test_model_tp.py,
tests/test_moe_model.py). What the planner says each variant keeps is measured in
tests/test_planner_validation.py; the flags' rules are checked here, one line each.
"""
from __future__ import annotations

import pytest
import torch

from tests.harness import run_world
from tests.seeds import fresh_seed

LAYERS, HIDDEN, HEADS, SEQ, VOCAB = 2, 64, 4, 16, 300


def _counted(model, names):
    """Forward calls per (module kind, layer) for the layer submodules named."""
    calls = {}
    for i, layer in enumerate(model.gpt.decoder.layers):
        mods = dict(core_attn=layer.self_attention.core_attention, input_layernorm=layer.input_layernorm,
                    pre_mlp_layernorm=layer.pre_mlp_layernorm, mlp=layer.mlp)
        if hasattr(layer.self_attention, "linear_kv_up_proj"):      # multi-latent attention's up projection
            mods["mla_up"] = layer.self_attention.linear_kv_up_proj
        if hasattr(layer.mlp, "router"):         # an MoE layer (recomputed inside, its module call is not)
            mods["router"] = layer.mlp.router
            if layer.mlp.shared_experts is not None:
                mods["shared_experts"] = layer.mlp.shared_experts
        for kind, m in mods.items():
            if kind in names:
                calls[(kind, i)] = 0
                m.register_forward_hook(lambda *_, k=(kind, i): calls.__setitem__(k, calls[k] + 1))
    return calls


def _variants_world(rank, seed, base, variants, tp, ep):
    """One forward/backward per variant (GPTConfig kwargs) from the same weights, batch and RNG states."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
    from megatron.core.transformer.moe.moe_utils import (clear_aux_losses_tracker,
                                                          get_moe_layer_wise_logging_tracker)

    from zo_megatron.model import GPTConfig, build_gpt_model
    from zo_megatron.parallel import init_parallel

    ps = init_parallel(tp, seed=seed, num_attention_heads=HEADS, hidden_size=HIDDEN, expert_parallel=ep)
    gen = torch.Generator().manual_seed(seed + 1)
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=gen)
    labels = torch.randint(0, VOCAB, (2, SEQ), generator=gen)
    cpu_state, tracker_states = torch.get_rng_state(), get_cuda_rng_tracker().get_states()
    out = {}
    for name, kw in variants:
        cfg = GPTConfig(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, vocab_size=VOCAB,
                        max_position_embeddings=SEQ, precision="fp32",
                        **{"hidden_dropout": 0.1, "attention_dropout": 0.1, **base, **kw})
        model = build_gpt_model(cfg, ps.tp_rank, ps.tp_size, seed)
        model.train()
        calls = _counted(model, ("core_attn", "input_layernorm", "pre_mlp_layernorm", "mlp", "router",
                                 "shared_experts", "mla_up"))
        torch.set_rng_state(cpu_state)
        get_cuda_rng_tracker().set_states(dict(tracker_states))   # the tracker keeps (and advances) the dict
        clear_aux_losses_tracker()
        loss = model.loss(tokens, labels)
        loss.backward()
        tracked = {k: v["values"].clone() for k, v in get_moe_layer_wise_logging_tracker().items()}
        out[name] = dict(loss=loss.item(), calls=calls, tracked=tracked,
                         grads={n: p.grad.clone() for n, p in model.named_parameters()})
    return out


def _check(out, twice, summed_again=()):
    """Every variant equals "none" bit for bit; `twice[name]` is the set of module kinds run twice.
    `summed_again`: variants whose gradients may differ in the last bits of fp32, because a gradient
    that has several parts is summed in another order: a recomputed norm (megatron-core's
    CheckpointWithoutOutput backpropagates it in its own autograd call, after the residual stream's
    other part) or the shared expert alone (its input gradient arrives at the checkpoint's
    backward, apart from the router's and the routed experts'). Their gradients must agree to 1e-6
    of each tensor's largest element (8 fp32 ulps), their losses and tracked losses bit for bit."""
    ref = out["none"]
    assert all(c == 1 for c in ref["calls"].values()), ref["calls"]
    for name, kinds in twice.items():
        got = out[name]
        for (kind, layer), c in got["calls"].items():
            assert c == (2 if kind in kinds else 1), (name, kind, layer, c)
        assert got["loss"] == ref["loss"], name
        assert set(got["tracked"]) == set(ref["tracked"]), name
        for k, v in ref["tracked"].items():
            assert torch.equal(got["tracked"][k], v), (name, k, got["tracked"][k], v)
        assert set(got["grads"]) == set(ref["grads"])
        for n, g in ref["grads"].items():
            err = (got["grads"][n] - g).abs().max().item()
            if name in summed_again:
                assert err <= 1e-6 * g.abs().max().item(), (name, n, err)
            else:
                assert torch.equal(got["grads"][n], g), (name, n, err)


def test_selective_modules_of_a_dense_model_change_nothing_at_tp2_with_sequence_parallel():
    """Llama-shaped (RMSNorm, SwiGLU, GQA, RoPE) at TP 2 with sequence parallelism and dropout: the
    attention core, the two norms (megatron-core's CheckpointWithoutOutput: the output freed after
    forward and recomputed into it) and the MLP, each alone and all together."""
    seed = fresh_seed("recompute modules, dense")
    base = dict(position_embedding_type="rope", normalization="RMSNorm", swiglu=True, num_query_groups=2,
                untie_embeddings_and_output_weights=True, add_bias_linear=False, sequence_parallel=True)
    sel = dict(recompute="selective")
    variants = [("none", {}), ("default", sel),
                ("layernorm", dict(sel, recompute_modules=("layernorm",))),
                ("mlp", dict(sel, recompute_modules=("mlp",))),
                ("all", dict(sel, recompute_modules=("core_attn", "layernorm", "mlp")))]
    out = run_world(_variants_world, 2, seed, base, variants, 2, 1, timeout=240)
    norms = {"input_layernorm", "pre_mlp_layernorm"}
    for o in out:
        _check(o, {"default": {"core_attn"}, "layernorm": norms, "mlp": {"mlp"},
                   "all": {"core_attn", "mlp"} | norms}, summed_again=("layernorm", "all"))


def test_moe_and_shared_expert_recompute_change_nothing_at_ep2_aux_and_z_losses_included():
    """A Qwen2-MoE-shaped model (shared expert with its gate, load-balancing and z losses) at EP 2 with
    the alltoall dispatcher: a whole MoE layer recomputed (its router runs again in backward: the
    tracked losses must still be counted once), the shared expert alone, and --moe-layer-recompute's
    meaning (the attention core and the MoE layer)."""
    seed = fresh_seed("recompute modules, moe")
    base = dict(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32, moe_shared_expert_intermediate_size=48,
                moe_shared_expert_gate=True, moe_aux_loss_coeff=0.01, moe_z_loss_coeff=0.001,
                moe_token_dispatcher_type="alltoall", add_bias_linear=False, swiglu=True, normalization="RMSNorm",
                position_embedding_type="rope")
    sel = dict(recompute="selective")
    variants = [("none", {}), ("moe", dict(sel, recompute_modules=("moe",))),
                ("shared", dict(sel, recompute_modules=("shared_experts",))),
                ("moe_layer_recompute", dict(sel, recompute_modules=("core_attn", "moe"))),
                # the norms' outputs freed and restored into what the MoE checkpoint saved
                ("norms_moe", dict(sel, recompute_modules=("layernorm", "moe")))]
    out = run_world(_variants_world, 2, seed, base, variants, 1, 2, timeout=240)
    for o in out:
        assert set(o["none"]["tracked"]) == {"load_balancing_loss", "z_loss"}
        assert all(v.abs().sum() > 0 for v in o["none"]["tracked"].values())
        # a whole MoE layer recomputed runs its router and shared expert again
        _check(o, {"moe": {"router", "shared_experts"}, "shared": {"shared_experts"},
                   "moe_layer_recompute": {"core_attn", "router", "shared_experts"},
                   "norms_moe": {"input_layernorm", "pre_mlp_layernorm", "router", "shared_experts"}},
               summed_again=("shared", "norms_moe"))


def test_mla_up_projection_recompute_changes_nothing_at_tp2_with_sequence_parallel():
    """Multi-latent attention (a query latent, latent norms, YaRN) at TP 2 with sequence parallelism and
    dropout: --recompute-modules mla_up_proj (megatron-core's CheckpointWithoutOutput: query, key and value
    freed after the core attention and recomputed from the latents before its backward) alone and with the
    core's checkpoint; the up projections run forward twice."""
    seed = fresh_seed("recompute modules, MLA up projections")
    base = dict(position_embedding_type="rope", normalization="RMSNorm", swiglu=True, add_bias_linear=False,
                untie_embeddings_and_output_weights=True, sequence_parallel=True, multi_latent_attention=True,
                q_lora_rank=24, kv_lora_rank=16, qk_head_dim=12, qk_pos_emb_head_dim=8, v_head_dim=10,
                qk_layernorm=True, rotary_scaling_factor=4.0, mscale_all_dim=1.0)
    sel = dict(recompute="selective")
    variants = [("none", {}), ("up", dict(sel, recompute_modules=("mla_up_proj",))),
                ("up_core", dict(sel, recompute_modules=("mla_up_proj", "core_attn")))]
    for o in run_world(_variants_world, 2, seed, base, variants, 2, 1, timeout=240):
        _check(o, {"up": {"mla_up"}, "up_core": {"mla_up", "core_attn"}})


@pytest.mark.parametrize("argv,says", [
    (["--recompute-modules", "mlp"], "--recompute-modules applies to --recompute-granularity selective"),
    (["--recompute-granularity", "selective", "--recompute-modules", "moe"], "the model has none"),
    (["--recompute-granularity", "selective", "--recompute-modules", "moe_act"], "use moe (the whole MoE layer)"),
    (["--recompute-granularity", "selective", "--recompute-modules", "mla_up_proj"],
     "the model has none (add --multi-latent-attention"),
    (["--recompute-granularity", "selective", "--recompute-modules", "attention"], "choose from core_attn"),
    (["--recompute-granularity", "full", "--moe-layer-recompute"], "full recompute covers the MoE layers"),
    # GPT-2's biases: megatron-core's MLP checkpoint returns the fc2 bias parameter, and backward recursed
    # into earlier iterations' checkpoints without end (found running the job: a hang)
    (["--recompute-granularity", "selective", "--recompute-modules", "mlp"], "add --disable-bias-linear"),
    (["--recompute-granularity", "selective", "--recompute-modules", "shared_experts", "--num-experts", "4",
      "--disable-bias-linear"], "the model has no shared expert"),
])
def test_bad_recompute_modules_are_one_line_exit_2(argv, says, tmp_path):
    from tests.test_pretrain import TINY, _single

    r = _single(["--mock-data", "--train-iters", "3", *TINY, *argv], tmp_path)
    lines = [ln for ln in r.stderr.strip().splitlines() if ln.startswith("error:")]
    assert r.returncode == 2 and len(lines) == 1 and says in lines[0], r.stderr[-2000:]
    assert "Traceback" not in r.stderr


def test_moe_layer_recompute_is_selective_with_moe_added():
    from zo_megatron.training.arguments import build_parser, finalize

    moe = ["--num-experts", "4", "--disable-bias-linear"]
    for extra, want in ((moe, ["core_attn", "moe"]), ([*moe, "--recompute-modules", "layernorm"], ["layernorm", "moe"]),
                        ([*moe, "--recompute-modules", "moe"], ["moe"]),
                        # a dense model: megatron-core's added moe does nothing there; here it is not added
                        ([], ["core_attn"]),
                        # Megatron-LM: --recompute-activations wins over --recompute-granularity full
                        (["--recompute-activations", "--recompute-granularity", "full"], None)):
        args = build_parser().parse_args(
            ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "16",
             "--lr", "1e-3",
             "--train-iters", "1", *(["--moe-layer-recompute"] if want else []), *extra])
        finalize(args)
        assert args.recompute_granularity == "selective" and args.recompute_modules == want, (extra, args)


def test_an_empty_module_list_and_modules_under_full_recompute(tmp_path):
    """`--recompute-modules` with no module is an argparse error (Megatron-LM's nargs="+"); under full
    recompute the list is moot, as in Megatron-LM (the job runs, recomputing whole layers)."""
    from tests.test_pretrain import TINY, _single

    r = _single(["--mock-data", "--train-iters", "3", *TINY, "--recompute-granularity", "selective",
                 "--recompute-modules"], tmp_path)
    assert r.returncode == 2 and "--recompute-modules: expected at least one argument" in r.stderr, r.stderr[-2000:]
    r = _single(["--mock-data", "--train-iters", "2", *TINY, "--recompute-granularity", "full", "--recompute-modules",
                 "mlp"], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]


def test_the_plain_baseline_recomputes_under_its_bf16_autocast(tmp_path):
    """The plain DDP baseline (no --zero-offload) runs bf16 under autocast; megatron-core's checkpoints
    recomputed without it: full recompute stopped with "expected scalar type Float but found BFloat16"
    (found here, 2026-12-07). Now full and selective recompute (dropout on: the masks redrawn) give the
    losses of the run that keeps its activations, bit for bit."""
    import json

    from tests.test_pretrain import TINY, _single

    losses = {}
    for name, extra in (("none", []), ("full", ["--recompute-granularity", "full"]),
                        ("modules", ["--recompute-granularity", "selective", "--recompute-modules", "core_attn",
                                     "layernorm"])):
        log = tmp_path / f"{name}.jsonl"
        r = _single(["--mock-data", "--train-iters", "3", *TINY, "--bf16", "--hidden-dropout", "0.1",
                     "--attention-dropout", "0.1", "--eval-interval", "100", "--log-jsonl", str(log), *extra], tmp_path)
        assert r.returncode == 0, name + r.stderr[-3000:]
        losses[name] = [row["loss"] for row in map(json.loads, log.read_text().splitlines()) if row["kind"] == "train"]
    assert len(losses["none"]) == 3
    assert losses["full"] == losses["none"] and losses["modules"] == losses["none"], losses


def test_the_planner_keeps_less_with_each_module_and_the_job_plans_the_flags():
    """The flags resolve as the job resolves them (one rule, planner/params.py, for the job's arguments
    and plan_input_from_flags), and each module lowers what a layer keeps (the measured amounts:
    tests/test_planner_validation.py)."""
    from zo_megatron.planner import PlanInput, plan
    from zo_megatron.planner.params import resolve_recompute

    def resolve(granularity, modules, activations=False, moe_layer=False, experts=False):
        return resolve_recompute(granularity, modules, recompute_activations=activations,
                                 moe_layer_recompute=moe_layer, experts=experts)

    assert resolve(None, None, moe_layer=True, experts=True) == ("selective", ["core_attn", "moe"])
    assert resolve(None, None, moe_layer=True) == ("selective", ["core_attn"])
    assert resolve("full", None, activations=True) == ("selective", None)
    with pytest.raises(ValueError, match="full recompute covers the MoE layers"):
        resolve("full", None, moe_layer=True, experts=True)
    # the job's rules, in the planner too: no plan for a run the job refuses
    with pytest.raises(ValueError, match="add --disable-bias-linear"):
        plan(PlanInput(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=1000, seq_length=64,
                       recompute="selective", recompute_modules=("mlp",)))
    with pytest.raises(ValueError, match="applies to --recompute-granularity selective"):
        plan(PlanInput(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=1000, seq_length=64,
                       recompute_modules=("core_attn",)))
    assert resolve("selective", ["mlp", "mlp"]) == ("selective", ["mlp"])
    shape = dict(num_layers=4, hidden_size=256, num_attention_heads=8, vocab_size=1000, seq_length=256,
                 max_position_embeddings=256, micro_batch_size=2, normalization="RMSNorm", swiglu=True,
                 add_bias_linear=False)
    kept = {}
    for mods in (None, ("core_attn",), ("core_attn", "mlp"), ("core_attn", "mlp", "layernorm")):
        p = plan(PlanInput(**shape, recompute="selective", recompute_modules=mods))
        kept[mods] = p.device_items["activations_layers"]
    none = plan(PlanInput(**shape)).device_items["activations_layers"]
    assert kept[None] == kept[("core_attn",)] < none
    assert kept[("core_attn", "mlp", "layernorm")] < kept[("core_attn", "mlp")] < kept[("core_attn",)]


def test_the_planner_suggests_the_modules_the_job_accepts_when_activations_do_not_fit():
    """An 8B Llama at 4k tokens on a 32 GiB device: the plan suggests selective recompute of every
    module this model can recompute (not mlp with GPT-2's biases, which the job refuses), re-planned."""
    from zo_megatron.planner import PlanInput, plan

    llama = dict(num_layers=32, hidden_size=4096, num_attention_heads=32, vocab_size=128256, seq_length=4096,
                 max_position_embeddings=4096, normalization="RMSNorm", swiglu=True, add_bias_linear=False,
                 position_embedding_type="rope", recompute="selective")
    p = plan(PlanInput(**llama))
    tip = next(s for s in p.suggestions if "--recompute-modules" in s)
    assert "`--recompute-granularity selective --recompute-modules core_attn layernorm mlp`" in tip
    want = plan(PlanInput(**llama, recompute_modules=("core_attn", "layernorm", "mlp")))
    assert f"device {want.device_bytes_per_gpu / 2**30:.2f} GiB/GPU" in tip, tip
    gpt2 = plan(PlanInput(**{**llama, "add_bias_linear": True}))
    tip = next(s for s in gpt2.suggestions if "--recompute-modules" in s)
    assert "--recompute-modules core_attn layernorm`" in tip, tip


def _kept_world(rank, cfg, variants):
    """Per variant: what MoE layer 0 and dense layer 1 keep at the end of forward (tests/test_planner_moe.py's
    measure: each storage at its size then, parameters and the cached s x s mask left out)."""
    from tests.test_planner_moe import SEQ, VOCAB, _saved_bytes
    from zo_megatron.model import GPTConfig, build_gpt_model
    from zo_megatron.parallel import init_parallel

    ps = init_parallel(1)
    out = {}
    for name, modules in variants:
        conf = GPTConfig(**cfg, vocab_size=VOCAB, max_position_embeddings=SEQ, precision="bf16",
                         recompute="selective", recompute_modules=modules)
        model = build_gpt_model(conf, ps.tp_rank, ps.tp_size, seed=1)
        model.to(torch.bfloat16)
        out[name] = _saved_bytes(model, rank)
    return out


def test_what_moe_layers_keep_under_selective_recompute_is_planned():
    """The planner's `_selective_layer` for an MoE layer (router, routed experts, a gated shared expert)
    and a dense one, measured: the whole MoE side, the shared expert alone, and either with the norms
    (their outputs, the router's and the shared expert's input, freed in forward)."""
    from tests.test_planner_moe import SWIGLU, _plan_input
    from zo_megatron.planner.layer_activations import _selective_layer

    variants = [("moe", ("moe",)), ("shared", ("shared_experts",)), ("norms_moe", ("layernorm", "moe")),
                ("attn_norms_shared", ("core_attn", "layernorm", "shared_experts"))]
    got = run_world(_kept_world, 1, SWIGLU, variants, timeout=240)[0]
    for name, modules in variants:
        inp = _plan_input(SWIGLU, 1, 1, "allgather", precision="bf16", recompute="selective",
                          recompute_modules=modules)
        for layer, moe in ((0, True), (1, False)):
            want = _selective_layer(inp, moe)[0]
            print(f"{name} layer {layer}: planned {want} measured {got[name][layer]}")
            assert abs(want - got[name][layer]) <= 0.02 * got[name][layer], (name, layer, want, got[name][layer])


def test_tflops_count_each_recomputed_module_once_more():
    """TFLOP/s count one more forward of what is recomputed: a hand count of the modules' GEMMs."""
    from zo_megatron.training.metrics import flops_per_token

    L, h, s, V, f, heads = 2, 64, 32, 128, 96, 4
    moe = dict(moe_layers=[True, False], moe_ffn_hidden_size=40, moe_router_topk=2,
               moe_shared_expert_intermediate_size=48)
    base = flops_per_token(L, h, s, V, None, f, num_attention_heads=heads, swiglu=True, **moe)
    core = 2 * h * s                                # QK^T and (QK^T)V, causal: 2·q·s per layer, q = h
    mlp, shared, moe_side = 2 * h * f * 3, 2 * h * 48 * 3, 2 * h * (2 * 40 + 48) * 3   # SwiGLU: three GEMMs
    for mods, extra in ((("core_attn",), L * core), (("mlp",), mlp), (("moe",), moe_side),
                        (("shared_experts",), shared),
                        (("core_attn", "layernorm", "mlp", "moe"), L * core + mlp + moe_side),
                        (("layernorm",), 0)):
        got = flops_per_token(L, h, s, V, "selective", f, num_attention_heads=heads, swiglu=True,
                              recompute_modules=mods, **moe)
        assert got - base == extra, (mods, got - base, extra)
    # the default modules (None): the attention core
    assert flops_per_token(L, h, s, V, "selective", f, num_attention_heads=heads, swiglu=True, **moe) == base + L * core
