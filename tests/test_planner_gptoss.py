"""The memory planner on GPT-OSS's parts, against the built model (GPTConfig, megatron-core 0.16.1).

- Parameters: the planner's counts of GPT-OSS-20B and -120B are transformers' GptOssForCausalLM's (built on the
  meta device); its list (names, order, sizes, TP split) is the built model's: quick GeGLU's fc1 [gate; up],
  the attention sinks' softmax_offset (local and SDPA core attention, split over TP 2), the biases of the
  router and of every expert's fc1 / fc2 (EP 2).
- What one layer keeps for backward (saved-tensor hooks, each storage once, parameters left out), to the byte:
  the MLP (GELU, ReLU^2, SwiGLU with and without clamp and offset, quick GeGLU, GPT-OSS's clamped quick GeGLU
  with and without biases: mlp_activations.mlp_saved_widths) and the whole layer (RMSNorm: nothing the planner
  leaves out), with vanilla, off-by-one and learnable softmaxes on the local attention and on SDPA (one and
  three offset channels, a document mask and a sliding window in the sink layout, the CPU math path, the core
  attention checkpointed, multi-latent attention); bf16 and fp32.
- The MoE layer at EP 2 with biases (both dispatchers): each routed slot's bytes on the experts to the byte, the
  layer summed over the EP ranks (balanced in sum), the activation peak over forward + backward through the two
  engines within 10% (tests/test_planner_moe.py's measure), and at TP 2 with sequence parallelism a dense
  GPT-OSS layer on SDPA's sink path to the byte.
- The job's flags reach the plan: estimate_memory with GPT-OSS-20B's command line names the activation and
  the sinks, counts its parameters, and plans as the job's pre-launch check does.
"""
from __future__ import annotations

import json

import pytest

from tests.harness import run_world
from zo_megatron import planner as P

SEQ, MICRO, VOCAB = 32, 2, 128
# GPT-OSS in small: quick GeGLU clamped at 7 with offset 1, biases everywhere, RMSNorm, rope, GQA, untied
OSS = dict(hidden_size=64, num_attention_heads=4, num_query_groups=2, quick_geglu=True, glu_linear_offset=1.0,
           activation_func_clamp_value=7.0, normalization="RMSNorm", position_embedding_type="rope",
           untie_embeddings_and_output_weights=True, ffn_hidden_size=96)
RMS = dict(hidden_size=64, num_attention_heads=4, normalization="RMSNorm", ffn_hidden_size=96)
SINKS = dict(OSS, softmax_type="learnable", attention_backend="sdpa")
MLA = dict(RMS, multi_latent_attention=True, attention_backend="sdpa", q_lora_rank=None, kv_lora_rank=32,
           qk_head_dim=16, qk_pos_emb_head_dim=16, v_head_dim=32, rope_type="rope", position_embedding_type="rope",
           quick_geglu=True, activation_func_clamp_value=7.0, softmax_type="learnable")
# (name, the model's fields, precision, selective recompute modules or None)
DENSE = [
    ("gelu", RMS, "bf16", None),
    ("relu2", dict(RMS, squared_relu=True), "bf16", None),
    ("swiglu", dict(RMS, swiglu=True, add_bias_linear=False), "bf16", None),
    ("swiglu-clamp-offset", dict(RMS, swiglu=True, activation_func_clamp_value=7.0, glu_linear_offset=1.0), "fp32",
     None),
    ("quick-geglu", dict(RMS, quick_geglu=True), "bf16", None),
    ("oss", OSS, "bf16", None),
    ("oss", OSS, "fp32", None),
    ("oss-nobias", dict(OSS, add_bias_linear=False), "bf16", None),
    ("oss-local-sinks", dict(OSS, softmax_type="learnable"), "bf16", None),
    ("oss-local-sinks", dict(OSS, softmax_type="learnable"), "fp32", None),
    ("oss-local-offbyone-docmask", dict(OSS, softmax_type="off-by-one"), "bf16", None),
    ("oss-sdpa", dict(OSS, attention_backend="sdpa"), "bf16", None),
    ("oss-sdpa-sinks", SINKS, "bf16", None),                  # head dim 16: scale 1/4, one offset channel
    ("oss-sdpa-sinks", SINKS, "fp32", None),
    ("oss-sdpa-sinks-d32", dict(SINKS, hidden_size=128), "bf16", None),     # 1/sqrt(32): three channels
    ("oss-sdpa-offbyone", dict(SINKS, softmax_type="off-by-one"), "bf16", None),
    ("oss-sdpa-sinks-docmask", SINKS, "bf16", None),
    ("oss-sdpa-sinks-window-docmask", dict(SINKS, window_size=(7, 0), window_attn_skip_freq=2), "bf16", None),
    ("oss-sdpa-sinks-attndrop", dict(SINKS, attention_dropout=0.1), "bf16", None),     # the CPU math path
    ("oss-sdpa-sinks-rccore", SINKS, "bf16", ("core_attn",)),
    ("mla-sinks", MLA, "bf16", None),
]
PLAN_ONLY = ("attention_dropout",)      # GPTConfig's dropout probability; PlanInput's is whether there is one


def _plan_input(fields: dict, precision: str, modules=None, **kw) -> P.PlanInput:
    arch = {k: v for k, v in fields.items() if k in P.PlanInput.__dataclass_fields__ and k not in PLAN_ONLY}
    rc = dict(recompute="selective", recompute_modules=modules) if modules else {}
    return P.PlanInput(num_layers=2, vocab_size=VOCAB, seq_length=SEQ, max_position_embeddings=SEQ,
                       micro_batch_size=MICRO, precision=precision, dropout=False, fused_softmax=False,
                       attention_dropout=bool(fields.get("attention_dropout")), device_is_host=True, **arch, **rc,
                       **kw)


def _model_config(fields: dict, precision: str, modules=None, **kw):
    from zo_megatron.model import GPTConfig

    rc = dict(recompute="selective", recompute_modules=modules) if modules else {}
    return GPTConfig(num_layers=2, vocab_size=VOCAB, max_position_embeddings=SEQ, precision=precision, **fields,
                     **rc, **kw)


def _batch(seed: int, docs: bool):
    import torch

    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (MICRO, SEQ), generator=gen)
    if not docs:
        return tokens, None
    cuts = torch.sort(torch.randint(1, SEQ, (MICRO, 3), generator=gen), dim=1).values
    return tokens, (torch.arange(SEQ)[None, :, None] >= cuts[:, None, :]).sum(-1)


class _Kept:
    """The storages each region's packed tensors live in (module hooks set the regions; nested regions all
    count a tensor), parameters left out; read at the end of forward, at their size then."""

    def __init__(self, model):
        import torch

        self.params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.active: list[str] = []
        self.seen: dict[str, dict[int, torch.UntypedStorage]] = {}
        self.slots = 0

    def watch(self, name: str, module, count_rows: bool = False) -> None:
        def pre(m, args):
            self.active.append(name)
            if count_rows:
                self.slots += args[0].shape[0]
        module.register_forward_pre_hook(pre)
        module.register_forward_hook(lambda m, a, o: self.active.remove(name))

    def pack(self, t):
        st = t.untyped_storage()
        if st.data_ptr() not in self.params:
            for name in self.active:
                self.seen.setdefault(name, {})[st.data_ptr()] = st
        return t

    def bytes(self, name: str, without: str | None = None) -> int:
        other = self.seen.get(without, {}) if without else {}
        return sum(st.nbytes() for ptr, st in self.seen.get(name, {}).items() if ptr not in other)

    def shared(self, a: str, b: str) -> int:
        """Storages both regions keep (the layers: the one attention mask of the forward)."""
        sa, sb = self.seen.get(a, {}), self.seen.get(b, {})
        return sum(st.nbytes() for ptr, st in sa.items() if ptr in sb)


def _measure_dense(rank, cases):
    """Per case: what layer 1 keeps (beside what layer 0 keeps too: the mask), its MLP, and the storage the
    two layers share."""
    import torch

    from zo_megatron.model import build_gpt_model
    from zo_megatron.parallel import init_parallel

    init_parallel(1, seed=1)
    out = []
    for i, (name, fields, precision, modules) in enumerate(cases):
        cfg = _model_config(fields, precision, modules)
        model = build_gpt_model(cfg, 0, 1, seed=1).to(cfg.dtype)
        kept = _Kept(model)
        layers = model.gpt.decoder.layers
        kept.watch("layer0", layers[0])
        kept.watch("layer1", layers[1])
        kept.watch("mlp", layers[1].mlp)
        tokens, segments = _batch(100 + i, "-docmask" in name)
        with torch.autograd.graph.saved_tensors_hooks(kept.pack, lambda t: t):
            loss = model.loss(tokens, tokens, segment_ids=segments)
        out.append(dict(layer=kept.bytes("layer1", without="layer0"), mlp=kept.bytes("mlp"),
                        shared=kept.shared("layer0", "layer1"),
                        rows=[(n.removeprefix("gpt."), p.numel(), bool(getattr(p, "tensor_model_parallel", False)))
                              for n, p in model.named_parameters()], num_parameters=cfg.num_parameters()))
        del loss
    return out


@pytest.fixture(scope="module")
def dense():
    return run_world(_measure_dense, 1, DENSE, timeout=300)[0]


@pytest.mark.parametrize("c", range(len(DENSE)), ids=[f"{n}-{p}" for n, _, p, _ in DENSE])
def test_what_a_dense_layer_keeps_is_planned_to_the_byte(dense, c):
    from zo_megatron.planner.layer_activations import _layer_saved, _selective_layer, attention_mask_bytes
    from zo_megatron.planner.mlp_activations import mlp_saved_widths

    name, fields, precision, modules = DENSE[c]
    got = dense[c]
    inp = _plan_input(fields, precision, modules, document_attention_mask="-docmask" in name)
    w = 4 if precision == "fp32" else 2
    # the MLP: fc1's input (h) and mlp_saved_widths f-wide tensors per token
    mlp = w * SEQ * MICRO * (inp.hidden_size + mlp_saved_widths(inp) * inp.ffn())
    layer = _selective_layer(inp, False)[0] if modules else sum(_layer_saved(inp))
    print(f"{name} {precision}: layer planned {layer} measured {got['layer']}, mlp planned {mlp} measured "
          f"{got['mlp']}, shared by the layers {got['shared']}")
    assert got["mlp"] == mlp
    assert got["layer"] == layer
    mask, kept = attention_mask_bytes(inp)
    if mask:            # the one mask every layer keeps (none kept on the math path)
        assert got["shared"] == (mask if kept else 0)
    # the parameters: names, order, sizes (the sinks' offset first in the attention), and the count
    rows = P.model_parameters(2, inp.hidden_size, inp.ffn(), inp.num_attention_heads, VOCAB, SEQ, inp.arch())
    assert rows == got["rows"]
    assert P.plan(inp).params_total == got["num_parameters"]


def test_the_offset_channels_are_the_models():
    """attention_sinks.offset_channels is model/sinks.offset_channels for the engine's 16-bit parameters."""
    import math

    import torch

    from zo_megatron.model.sinks import offset_channels as model_rule
    from zo_megatron.planner.attention_sinks import offset_channels

    for d in (16, 32, 64, 128, 256):
        for precision, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16), ("fp32", torch.float32)):
            for softmax in ("vanilla", "off-by-one", "learnable"):
                inp = P.PlanInput(num_layers=1, hidden_size=4 * d, num_attention_heads=4, precision=precision,
                                  softmax_type=softmax)
                assert offset_channels(inp) == model_rule(softmax, dtype, dtype, 1 / math.sqrt(d)), (d, precision)


# ------------------------------------------------------------------------------------------------
# the MoE layer with biases at EP 2, and a dense layer at TP 2 with sequence parallelism (two ranks)

OSS_MOE = dict(OSS, num_layers=2, softmax_type="learnable", num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=48,
               moe_layer_freq=[1, 0])
WORLD2 = [("moe-alltoall", OSS_MOE, dict(ep=2, dispatcher="alltoall")),
          ("moe-allgather", OSS_MOE, dict(ep=2, dispatcher="allgather")),
          ("dense-tp2-sp", dict(SINKS, num_layers=2), dict(tp=2))]


def _world2_input(fields: dict, layout: dict, **kw) -> P.PlanInput:
    tp, ep = layout.get("tp", 1), layout.get("ep", 1)
    moe = dict(expert_parallel=ep, moe_token_dispatcher_type=layout["dispatcher"]) if "dispatcher" in layout else {}
    return P.PlanInput(**{k: v for k, v in fields.items() if k in P.PlanInput.__dataclass_fields__},
                       vocab_size=VOCAB, seq_length=SEQ, max_position_embeddings=SEQ, micro_batch_size=MICRO,
                       tensor_parallel=tp, data_parallel=2 // tp, sequence_parallel=tp > 1, precision="bf16",
                       dropout=False, fused_softmax=False, device_is_host=True, **moe, **kw)


def _measure_world2(rank, cases):
    """Per case, on this rank: the parameter rows, what layers 0 and 1 keep (layer 0's routed experts apart,
    with the slots they computed) and the activation peak over forward + backward through the engines."""
    import torch

    from tests.harness import next_port
    from tests.test_planner_moe import _activation_peak
    from zo_megatron.model import GPTConfig, build_gpt_model
    from zo_megatron.offload.engine import AdamConfig, ZeroOffloadEngine
    from zo_megatron.offload.expert_parallel import ExpertParallelEngine
    from zo_megatron.param_names import is_routed_expert
    from zo_megatron.parallel import collectives, destroy_parallel, init_parallel

    out = []
    for i, (name, fields, layout) in enumerate(cases):
        tp, ep = layout.get("tp", 1), layout.get("ep", 1)
        next_port()
        ps = init_parallel(tp, expert_parallel=ep)
        extra = dict(moe_token_dispatcher_type=layout["dispatcher"]) if "dispatcher" in layout else {}
        cfg = GPTConfig(**fields, vocab_size=VOCAB, max_position_embeddings=SEQ, precision="bf16",
                        sequence_parallel=tp > 1, **extra)
        model = build_gpt_model(cfg, ps.tp_rank, ps.tp_size, seed=1)
        res = dict(rows=[(n.removeprefix("gpt."), p.numel(), bool(getattr(p, "tensor_model_parallel", False)))
                         for n, p in model.named_parameters()], num_parameters=cfg.num_parameters(),
                   expert_params=sum(p.numel() for n, p in model.named_parameters() if is_routed_expert(n)))
        common = dict(precision="bf16", adam=AdamConfig(lr=1e-3), clip_grad=1.0, bucket_size=1 << 30,
                      tp_rank=ps.tp_rank, device=ps.device, tp_group=ps.tp_group)
        if ps.experts_apart:
            engine = ExpertParallelEngine(model, dp_group=ps.dp_group, edp_group=ps.edp_group, dp_size=ps.dp_size,
                                          expert_tp=(ps.etp_rank, ps.etp_group), **common)
        else:
            engine = ZeroOffloadEngine(model, dp_group=ps.dp_group, **common)
        kept = _Kept(model)
        layers = model.gpt.decoder.layers
        kept.watch("layer0", layers[0])
        kept.watch("layer1", layers[1])
        if hasattr(layers[0].mlp, "experts"):
            kept.watch("experts", layers[0].mlp.experts, count_rows=True)
        gen = torch.Generator().manual_seed(200 + 7 * i + ps.dp_rank)
        tokens = torch.randint(0, VOCAB, (MICRO, SEQ), generator=gen)
        with torch.autograd.graph.saved_tensors_hooks(kept.pack, lambda t: t):
            loss = model.loss(tokens, tokens)
        res.update(layer0=kept.bytes("layer0", without="layer1"), layer1=kept.bytes("layer1", without="layer0"),
                   experts=kept.bytes("experts"), slots=kept.slots)
        del loss
        res["peak"], res["gemm_workspace"] = _activation_peak(model, engine, rank)
        out.append(res)
        engine.close()
        collectives.barrier()
        destroy_parallel()
    return out


@pytest.fixture(scope="module")
def world2():
    return run_world(_measure_world2, 2, WORLD2, timeout=300)


@pytest.mark.parametrize("c", range(len(WORLD2)), ids=[n for n, _, _ in WORLD2])
def test_two_ranks_keep_what_is_planned(world2, c):
    from zo_megatron.planner.layer_activations import _layer_saved
    from zo_megatron.planner.mlp_activations import expert_saved_widths

    name, fields, layout = WORLD2[c]
    ranks = [r[c] for r in world2]
    inp = _world2_input(fields, layout)
    moe = inp.moe()
    # the parameters: every rank's list, and the total
    t = inp.tensor_parallel
    rows = P.model_parameters(2, inp.hidden_size, inp.ffn(), inp.num_attention_heads, P.pad_vocab_size(VOCAB, t), SEQ,
                              inp.arch(), moe)
    for r in ranks:
        local = [(n, k // t if split and not (moe and ".mlp.experts." in n) else k, split) for n, k, split in rows]
        assert local == r["rows"], name
        if t == 1:          # (at TP 2 the vocabulary pads to 256: the plan counts the padded rows)
            assert P.plan(inp).params_total == r["num_parameters"]
    if moe is None:     # the dense layers at TP 2 + SP, to the byte on each rank
        for r in ranks:
            assert r["layer0"] == r["layer1"] == sum(_layer_saved(inp)), (name, r["layer0"], r["layer1"])
    else:
        # each routed slot on the experts: its input row, expert_saved_widths f_e-wide tensors, its routing weight
        w, f_e, h = 2, inp.moe_ffn(), inp.hidden_size
        for r in ranks:
            per_slot = w * h + w * expert_saved_widths(inp) * f_e + w
            print(f"{name}: {r['slots']} slots, experts keep {r['experts']} (planned {r['slots'] * per_slot})")
            assert r["experts"] == r["slots"] * per_slot
        got = sum(r["layer0"] for r in ranks)
        want = len(ranks) * sum(_layer_saved(inp, True))
        print(f"{name}: MoE layer planned {want} measured {got} ({want / got - 1:+.2%}); dense layer planned "
              f"{sum(_layer_saved(inp, False))} measured {[r['layer1'] for r in ranks]}")
        assert abs(want - got) <= 0.02 * got
        assert all(r["layer1"] == sum(_layer_saved(inp, False)) for r in ranks)
    p = P.plan(_world2_input(fields, layout, bucket_size=1 << 30, gpu_memory_bytes=64 * P.GiB,
                             host_memory_bytes_per_node=64 * P.GiB))
    planned = sum(v for k, v in p.device_items.items() if k.startswith(("activations", "logits", "moe_")))
    peak = max(r["peak"] for r in ranks)
    print(f"{name}: planned activations {planned}, measured peak {peak} ({planned / peak - 1:+.1%})")
    assert abs(planned - peak) <= 0.10 * peak


# ------------------------------------------------------------------------------------------------
# GPT-OSS-20B / -120B: transformers' counts, and the job's command line

def _oss_input(layers: int, experts: int, **kw) -> P.PlanInput:
    return P.PlanInput(num_layers=layers, hidden_size=2880, num_attention_heads=64, num_query_groups=8, kv_channels=64,
                       ffn_hidden_size=2880, vocab_size=201088, normalization="RMSNorm", position_embedding_type="rope",
                       untie_embeddings_and_output_weights=True, quick_geglu=True, glu_linear_offset=1.0,
                       activation_func_clamp_value=7.0, softmax_type="learnable", num_experts=experts,
                       moe_router_topk=4, attention_backend="sdpa", seq_length=4096, **kw)


@pytest.mark.parametrize("layers, experts", [(24, 32), (36, 128)], ids=["20b", "120b"])
def test_gpt_oss_counts_are_transformers(layers, experts):
    pytest.importorskip("transformers")
    import torch
    import transformers

    if not hasattr(transformers, "GptOssConfig"):
        pytest.skip("transformers without GPT-OSS")
    with torch.device("meta"):
        hf = transformers.GptOssForCausalLM(transformers.GptOssConfig(num_hidden_layers=layers,
                                                                      num_local_experts=experts))
    p = P.plan(_oss_input(layers, experts))
    assert p.params_total == sum(t.numel() for t in hf.parameters())
    per_expert = 3 * 2880 * 2880 + 2 * 2880 + 2880        # fc1 [gate; up] and fc2, their biases
    assert p.params_active == p.params_total - layers * (experts - 4) * per_expert


GPT_OSS_20B = ["--num-layers", "24", "--hidden-size", "2880", "--num-attention-heads", "64", "--group-query-attention",
               "--num-query-groups", "8", "--kv-channels", "64", "--ffn-hidden-size", "2880", "--vocab-size", "201088",
               "--normalization", "RMSNorm", "--position-embedding-type", "rope",
               "--untie-embeddings-and-output-weights", "--num-experts", "32", "--moe-router-topk", "4",
               "--quick-geglu", "--glu-linear-offset", "1.0", "--activation-func-clamp-value", "7.0",
               "--softmax-type", "learnable", "--seq-length", "4096", "--bf16", "--zero-offload", "--use-flash-attn",
               "--recompute-granularity", "full", "--expert-model-parallel-size", "8"]


def test_the_jobs_flags_reach_the_plan():
    from tests.cli import run_tool
    from tests.test_estimate_memory_job import E, job_reference

    r = run_tool("estimate_memory", "--preset", "h100-80gb", "--world-size", "8", *GPT_OSS_20B, "--json")
    assert r.returncode in (0, 1), r.stderr
    d = json.loads(r.stdout)
    i = d["input"]
    assert (i["quick_geglu"], i["glu_linear_offset"], i["activation_func_clamp_value"], i["softmax_type"]) == \
        (True, 1.0, 7.0, "learnable")
    assert d["architecture"].startswith("Llama-family (rope, RMSNorm, QuickGeGLU(clamp 7, +1), sinks, GQA 8")
    assert d["params_total"] == P.plan(_oss_input(24, 32)).params_total
    # the job's own pre-launch plan of the same command line
    argv = [*GPT_OSS_20B, "--train-iters", "10", "--lr", "1e-4"]
    job, _ = job_reference(argv, world=8, per_node=8, host_bytes=2048 * P.GiB, gpu_bytes=int(79.1 * P.GiB),
                           vocab=201088)
    est, _ = E.job_plan(E.build_parser().parse_args([*argv, "--world-size", "8", "--gpus-per-node", "8",
                                                      "--host-memory-gb", "2048", "--gpu-memory-gb", "79.1"]))
    assert est.input == job.input and est.input.quick_geglu and est.input.softmax_type == "learnable"
    # squared ReLU is named as such (it was "GELU")
    relu2 = json.loads(run_tool("estimate_memory", "--num-layers", "2", "--hidden-size", "256",
                                "--num-attention-heads", "4", "--squared-relu", "--json").stdout)
    assert "ReLU^2" in relu2["architecture"] and "GELU" not in relu2["architecture"]


def test_architecture_rules_are_the_jobs():
    base = dict(num_layers=2, hidden_size=64, num_attention_heads=4)
    for bad, match in ((dict(swiglu=True, quick_geglu=True), "three MLP activations"),
                       (dict(activation_func_clamp_value=7.0), "gated MLP"),
                       (dict(glu_linear_offset=1.0), "gated MLP"),
                       (dict(quick_geglu=True, activation_func_clamp_value=0.0), "must be > 0"),
                       (dict(softmax_type="sink"), "softmax_type")):
        with pytest.raises(ValueError, match=match):
            P.plan(P.PlanInput(**base, **bad))
    # quick GeGLU's FFN default is 4h (Megatron-LM's 2/3 rule is --swiglu's)
    assert P.PlanInput(**base, quick_geglu=True).ffn() == 256
