"""tools/convert_checkpoint.py for Hugging Face GPT-OSS (`GptOssForCausalLM`; checkpoint/hf/gpt_oss.py, mxfp4.py),
against transformers.

A random GPT-OSS that transformers builds and saves (hidden 64, 4 heads, 2 KV groups, head_dim 24, 4 experts of FFN
32, top 2, 2 layers: a sliding window of 6 tokens on layer 0, full attention on layer 1; YaRN with truncate false;
swiglu_limit 0.6, so that the clamp binds on ~half the experts' inputs; attention sinks ~ N(0, 1); every weight
random) with a tokenizer and a config vocabulary larger than it. Each draw is a fresh seed, printed (tests/seeds.py);
every element is compared.

  - from-hf (TP 2 checkpoint), then our model (torch SDPA: the window and the sinks) == transformers' eager forward
    and backward at 20 tokens: logits, loss and every gradient mapped through the same mapping, fp32, to 1e-5, in one
    2-rank world: TP 1 (DP 2), TP 1 x EP 2 (alltoall: 2 of the 4 experts on each rank) and TP 2 with sequence
    parallelism and expert TP 1 (whole experts beside split attention); a control without the window differs;
  - MXFP4: our dequantization == transformers' convert_moe_packed_tensors on every byte and scale value, in bf16 and
    fp32; a checkpoint in OpenAI's format (layer 0 both expert weights MXFP4, layer 1 only down_proj: transformers'
    loader takes either form per tensor) converts to exactly the tensors transformers' dequantizing loader gives, and
    to-hf writes them back in bf16, bit for bit, with a config transformers loads without quantization;
  - HF -> ours -> HF is bit-exact (every tensor, the config's fields); transformers loads the to-hf output and gives
    our model's logits; the printed flags give the checkpoint's architecture; a model without a window writes a
    config transformers runs;
  - what cannot be converted is one line, exit 2, nothing written.
"""
import json
import os

import pytest
import torch

from tests.harness import next_port, run_world
from tests.hf_tokenizer import HF_VOCAB_SIZE, make_hf_tokenizer
from tests.seeds import fresh_seed
from tests.test_convert_llama import CONFIG_FIELDS, _cli, _edited_copy, quiet

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

HIDDEN, HEADS, GROUPS, HEAD_DIM, FFN, LAYERS, EXPERTS, TOPK = 64, 4, 2, 24, 32, 2, 4, 2
VOCAB, POS, WINDOW, SEQ, BATCH, LIMIT = HF_VOCAB_SIZE + 37, 64, 6, 20, 2, 0.6
ROPE = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
        "truncate": False, "original_max_position_embeddings": 16}
GPT_OSS_FIELDS = ("num_local_experts", "num_experts_per_tok", "swiglu_limit", "swiglu_alpha", "layer_types",
                  "output_router_logits", "quantization_config")
LAYOUTS = [(1, 1, "allgather"), (1, 2, "alltoall"), (2, 1, "allgather", 1)]    # (TP, EP, dispatcher[, expert TP])


def _config(**over):
    return transformers.GptOssConfig(**{**dict(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=GROUPS, head_dim=HEAD_DIM, num_local_experts=EXPERTS,
        num_experts_per_tok=TOPK,
        sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"], max_position_embeddings=POS,
        rms_norm_eps=1e-5, swiglu_limit=LIMIT, tie_word_embeddings=False, bos_token_id=0, eos_token_id=1,
        attention_dropout=0.0, rope_parameters=dict(ROPE)), **over})


def _random_hf(directory, cfg, seed) -> str:
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():       # norms around 1, sinks that matter, router logits spread (no near ties in the top k)
        for name, p in model.named_parameters():
            std = 1.0 if name.endswith("sinks") else 0.3 if ".router." in name else 0.1
            p.copy_(torch.randn(p.shape, generator=gen) * std + (1.0 if "norm" in name else 0.0))
    model.save_pretrained(str(directory))
    make_hf_tokenizer(directory)
    return str(directory)


def _hf(directory, **kw):
    return transformers.AutoModelForCausalLM.from_pretrained(directory, local_files_only=True, dtype=torch.float32,
                                                             attn_implementation="eager", **kw)


def _rel(a, b) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-30)).item()


# ------------------------------------------------------------------ our model == transformers at every layout
def _world(rank, ck, tokens, labels, layouts):
    from zo_megatron.checkpoint.reader import CheckpointReader
    from zo_megatron.parallel import collectives, destroy_parallel, init_parallel

    reader = CheckpointReader(ck)
    meta, full = reader.model_meta, reader.read_weights()
    out = {}
    for layout in layouts:
        tp, ep, dispatcher, *etp = layout
        next_port()                                # chosen now, not when the test started
        ps = init_parallel(tp, expert_parallel=ep, expert_tensor_parallel=etp[0] if etp else None)
        out[layout] = _one(ps, meta, full, tokens, labels, dispatcher)
        if tp == ep == 1:                          # the control: the same model without its window
            out["no-window"] = _one(ps, {**meta, "window_size": None, "window_attn_skip_freq": None}, full, tokens,
                                    labels, dispatcher, backward=False)
        collectives.barrier()
        destroy_parallel()
    return out


def _one(ps, meta, full, tokens, labels, dispatcher, backward=True):
    """One forward/backward of our model at the layout `ps`, the batch split over DP; the gradients as the job reduces
    them (everything / DP, summed over DP or expert DP by the caller)."""
    from zo_megatron.checkpoint.arch import param_shapes
    from zo_megatron.model import GPTConfig, build_gpt_model
    from zo_megatron.model.config import ARCH_FIELDS
    from zo_megatron.model.sharding import gather_full, load_full_params, model_shard_infos
    from zo_megatron.parallel import collectives

    tp = ps.tp_size
    cfg = GPTConfig(**{**{k: meta[k] for k in ARCH_FIELDS}, "moe_token_dispatcher_type": dispatcher}, precision="fp32",
                    sequence_parallel=tp > 1, attention_backend="sdpa")
    model = build_gpt_model(cfg, ps.tp_rank, tp, seed=1)
    infos = model_shard_infos(model, ps.tp_rank, tp, VOCAB)
    load_full_params(model, full, ps.tp_rank, tp, VOCAB)
    rows = slice(ps.dp_rank * BATCH // ps.dp_size, (ps.dp_rank + 1) * BATCH // ps.dp_size)
    with torch.no_grad():
        logits = model(tokens[rows])
    full_logits = torch.cat(collectives.all_gather_list(logits.detach().contiguous(), ps.tp_group), -1)
    out = dict(rows=(rows.start, rows.stop), logits=full_logits[..., :VOCAB].clone())
    if not backward:
        return out
    loss = model.loss(tokens[rows], labels[rows])
    loss.backward()
    grads = {}
    for n, p in model.named_parameters():
        g = p.grad
        # sequence-parallel gradients (norms, row-parallel biases) summed over the group that splits the tokens, as
        # the engine sums them (offload/sequence_parallel_grads.py): an expert's over expert TP (experts at expert
        # TP 1 see distinct tokens per TP rank, and the caller's expert-DP sum counts each once), the rest over TP
        group = ps.etp_group if ".mlp.experts." in model.full_name(n) else ps.tp_group
        if getattr(p, "sequence_parallel", False) and collectives.group_size(group) > 1:
            g = collectives.all_reduce(g.clone(), "sum", group)
        grads[model.full_name(n)] = gather_full(g, infos[n], ps.tp_group, tp, ps.etp_group) / ps.dp_size
    shapes = {n: tuple(t.shape) for n, t in grads.items()}
    return dict(out, tp_rank=ps.tp_rank, etp_rank=ps.etp_rank, dp_rank=ps.dp_rank, loss=loss.item(), grads=grads,
                shapes_ok=param_shapes(cfg.arch_meta()) == shapes if ps.ep_size == 1 else None)


def _reference(directory, tokens, labels, meta):
    """transformers' logits, loss and gradients, the gradients as our full tensors (from-hf's mapping on them)."""
    from zo_megatron.checkpoint.hf import gpt_oss

    hf = _hf(directory)
    logits = hf(tokens).logits
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))
    loss.backward()
    return logits.detach(), loss.item(), gpt_oss.from_hf({n: p.grad for n, p in hf.named_parameters()}, meta)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """The source model, its from-hf checkpoint at TP 2 (log lines kept), its to-hf output, the 2-rank world's
    results and transformers' reference."""
    from zo_megatron.checkpoint import convert
    from zo_megatron.checkpoint.reader import CheckpointReader

    seed = fresh_seed("convert gpt-oss")
    d = tmp_path_factory.mktemp("gpt_oss")
    src = _random_hf(d / "src", _config(), seed)
    ck, back, lines = str(d / "ck_tp2"), str(d / "back"), []
    convert.from_hf(src, ck, tensor_parallel=2, log=lines.append)
    convert.to_hf(ck, back, log=quiet)
    gen = torch.Generator().manual_seed(seed + 1)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    meta = CheckpointReader(ck).model_meta
    world = run_world(_world, 2, ck, tokens, labels, LAYOUTS, timeout=300)
    return dict(d=d, src=src, ck=ck, back=back, lines=lines, tokens=tokens, meta=meta, world=world,
                ref=_reference(src, tokens, labels, meta))


def test_logits_loss_and_every_gradient_equal_transformers_at_tp1_ep2_and_tp2(converted):
    meta, world = converted["meta"], converted["world"]
    assert (meta["window_size"], meta["window_attn_skip_freq"]) == ([WINDOW - 1, 0], [1, 0])
    assert meta["quick_geglu"] and (meta["glu_linear_offset"], meta["activation_func_clamp_value"]) == (1.0, LIMIT)
    assert meta["softmax_type"] == "learnable" and meta["add_bias_linear"] and meta["kv_channels"] == HEAD_DIM
    assert (meta["num_experts"], meta["moe_router_topk"], meta["moe_ffn_hidden_size"]) == (EXPERTS, TOPK, FFN)
    assert meta["position_embedding_type"] == "yarn" and not meta["yarn_correction_range_round_to_int"]
    ref_logits, ref_loss, ref_grads = converted["ref"]
    control = world[0]["no-window"]
    assert _rel(control["logits"], ref_logits[slice(*control["rows"])]) > 1e-3      # the window matters here
    for layout in LAYOUTS:
        outs = [o[layout] for o in world]
        for o in outs:
            assert _rel(o["logits"], ref_logits[slice(*o["rows"])]) <= 1e-5, (layout, _rel(o["logits"], ref_logits))
        dp = {o["dp_rank"]: o["loss"] for o in outs}
        assert abs(sum(dp.values()) / len(dp) - ref_loss) <= 1e-5 * ref_loss, (layout, dp, ref_loss)
        got = {}
        for o in outs:      # dense: each DP rank once (TP rank 0); an expert: once per expert-DP rank (expert TP
            for n, g in o["grads"].items():     # rank 0), which at expert TP 1 < TP is every TP rank of a DP rank
                if o["etp_rank" if ".mlp.experts." in n else "tp_rank"] == 0:
                    got[n] = got[n] + g if n in got else g
        assert set(got) == set(ref_grads), (layout, set(got) ^ set(ref_grads))
        for n, g in got.items():
            assert g.shape == ref_grads[n].shape and _rel(g, ref_grads[n]) <= 1e-5, (layout, n, _rel(g, ref_grads[n]))
        assert all(o["shapes_ok"] in (True, None) for o in outs), layout    # arch.param_shapes == the built model's


def test_hf_ours_hf_is_bit_exact_and_transformers_gives_our_logits(converted):
    from zo_megatron.checkpoint.reader import CheckpointReader
    from zo_megatron.model import GPTConfig
    from zo_megatron.training.arguments import build_parser
    from zo_megatron.training.model_flags import architecture_kwargs, moe_kwargs

    src, back = converted["src"], converted["back"]
    a = safetensors_torch.load_file(os.path.join(src, "model.safetensors"))
    b = safetensors_torch.load_file(os.path.join(back, "model.safetensors"))
    assert "model.layers.1.mlp.experts.gate_up_proj" in a and "model.layers.0.self_attn.sinks" in a
    assert set(a) == set(b), set(a) ^ set(b)
    for k in a:
        assert b[k].dtype == torch.float32 and torch.equal(a[k], b[k]), k
    cfg_a, cfg_b = (json.load(open(os.path.join(x, "config.json"))) for x in (src, back))
    for f in CONFIG_FIELDS + GPT_OSS_FIELDS:
        assert cfg_a.get(f) == cfg_b.get(f), (f, cfg_a.get(f), cfg_b.get(f))
    model, info = _hf(back, output_loading_info=True)
    assert not any(info.values()), info
    with torch.no_grad():
        logits = model.eval()(converted["tokens"]).logits
    ours = converted["world"]                  # TP 1: each DP rank's rows of our model's logits
    for o in (w[LAYOUTS[0]] for w in ours):
        assert _rel(o["logits"], logits[slice(*o["rows"])]) <= 1e-5
    (flags,) = [ln.removeprefix("  model flags: ") for ln in converted["lines"] if ln.startswith("  model flags: ")]
    args = build_parser().parse_args(flags.split())
    built = GPTConfig(**architecture_kwargs(args), **moe_kwargs(args), vocab_size=args.vocab_size, precision="fp32")
    assert built.arch_meta() == CheckpointReader(converted["ck"]).model_meta, flags


def test_a_model_without_a_window_writes_a_config_transformers_runs(converted, tmp_path):
    """transformers' GPT-OSS builds its sliding mask in every forward (sliding_window null raises): to-hf of a
    model without a window writes every layer full_attention and sliding_window = max_position_embeddings."""
    from zo_megatron.checkpoint import convert
    from zo_megatron.checkpoint.reader import CheckpointReader

    src = _edited_copy(converted["src"], tmp_path / "full", layer_types=["full_attention"] * LAYERS)
    convert.from_hf(src, str(tmp_path / "ck"), tensor_parallel=1, log=quiet)
    meta = CheckpointReader(str(tmp_path / "ck")).model_meta
    assert meta["window_size"] is None and meta["window_attn_skip_freq"] is None
    convert.to_hf(str(tmp_path / "ck"), str(tmp_path / "back"), log=quiet)
    cfg = json.load(open(tmp_path / "back" / "config.json"))
    assert cfg["layer_types"] == ["full_attention"] * LAYERS and cfg["sliding_window"] == POS
    with torch.no_grad():
        ref, got = (_hf(x).eval()(converted["tokens"]).logits for x in (src, str(tmp_path / "back")))
    assert torch.equal(ref, got)


# ------------------------------------------------------------------------------------------------------ MXFP4
def test_mxfp4_dequantization_is_transformers(converted, tmp_path, capsys):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from zo_megatron.checkpoint import convert
    from zo_megatron.checkpoint.hf import gpt_oss, mxfp4
    from zo_megatron.checkpoint.reader import CheckpointReader

    seed = fresh_seed("gpt-oss mxfp4")
    gen = torch.Generator().manual_seed(seed)
    # every byte and every scale (255: E8M0's NaN, inf x element in both), [E, rows, G, 16]
    blocks = torch.randint(0, 256, (3, 7, 5, 16), dtype=torch.uint8, generator=gen)
    scales = torch.arange(3 * 7 * 5, dtype=torch.int64).reshape(3, 7, 5).mul(97).remainder(256).to(torch.uint8)
    for dtype in (torch.bfloat16, torch.float32):
        ours = mxfp4.dequantize(blocks, scales, dtype)
        torch.testing.assert_close(ours.transpose(1, 2), convert_moe_packed_tensors(blocks, scales, dtype=dtype),
                                   rtol=0, atol=0, equal_nan=True)
    finite = scales.clamp(max=253)              # bf16 holds every finite value exactly
    assert torch.equal(mxfp4.dequantize(blocks, finite).float(), mxfp4.dequantize(blocks, finite, torch.float32))

    # OpenAI's format: layer 0's expert weights as MXFP4, layer 1's down_proj only (either form per tensor)
    src, q = converted["src"], tmp_path / "mxfp4"
    sd = safetensors_torch.load_file(os.path.join(src, "model.safetensors"))
    for i, projs in ((0, ("gate_up_proj", "down_proj")), (1, ("down_proj",))):
        for p in projs:
            rows, cols = (2 * FFN, HIDDEN) if p == "gate_up_proj" else (HIDDEN, FFN)
            key = f"model.layers.{i}.mlp.experts.{p}"
            del sd[key]
            sd[key + "_blocks"] = torch.randint(0, 256, (EXPERTS, rows, cols // 32, 16), dtype=torch.uint8,
                                                generator=gen)
            sd[key + "_scales"] = torch.randint(118, 128, (EXPERTS, rows, cols // 32), dtype=torch.uint8, generator=gen)
    quantization = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    _edited_copy(src, q, quantization_config=quantization)
    os.remove(q / "model.safetensors")
    safetensors_torch.save_file(sd, str(q / "model.safetensors"), metadata={"format": "pt"})
    convert.from_hf(str(q), str(tmp_path / "ck"), tensor_parallel=2, log=quiet)
    ours = CheckpointReader(str(tmp_path / "ck")).read_weights()
    # transformers' dequantization, loaded as its Mxfp4Config(dequantize=True) loads it, is the reference
    hf = _hf(str(q), quantization_config=transformers.Mxfp4Config(dequantize=True))
    plain = {n: p.detach() for n, p in hf.named_parameters()}
    for key in [k for k in sd if k.endswith("_blocks")]:
        name = key.removesuffix("_blocks")
        want = convert_moe_packed_tensors(sd[key], sd[name + "_scales"], dtype=torch.bfloat16)
        assert torch.equal(plain[name], want.float()), name
    meta = CheckpointReader(str(tmp_path / "ck")).model_meta
    ref = gpt_oss.from_hf(plain, meta)
    assert set(ours) == set(ref)
    for k in ref:
        assert torch.equal(ours[k], ref[k]), k
    # to-hf in bf16: the experts are transformers' bf16 dequantization bit for bit, a config without quantization
    convert.to_hf(str(tmp_path / "ck"), str(tmp_path / "back"), dtype="bf16", log=quiet)
    b = safetensors_torch.load_file(str(tmp_path / "back" / "model.safetensors"))
    for key in [k for k in sd if k.endswith("_blocks")]:
        name = key.removesuffix("_blocks")
        assert torch.equal(b[name], convert_moe_packed_tensors(sd[key], sd[name + "_scales"])), name
    assert "quantization_config" not in json.load(open(tmp_path / "back" / "config.json"))
    assert not any(_hf(str(tmp_path / "back"), output_loading_info=True)[1].values())

    # MXFP4 that is not: scales of another dtype; blocks without quantization_config (transformers would not read them)
    bad = dict(sd, **{"model.layers.0.mlp.experts.down_proj_scales": sd["model.layers.0.mlp.experts.down_proj_scales"]
                      .to(torch.int32)})
    _edited_copy(src, tmp_path / "bad", quantization_config=quantization)
    os.remove(tmp_path / "bad" / "model.safetensors")
    safetensors_torch.save_file(bad, str(tmp_path / "bad" / "model.safetensors"), metadata={"format": "pt"})
    cases = ((str(tmp_path / "bad"), ["down_proj_blocks / _scales are not MXFP4", "uint8"]),
             (_edited_copy(q, tmp_path / "unquantized", quantization_config=None),
              ["down_proj_blocks", "no quantization_config"]))
    _expect_refusals(capsys, tmp_path, [(["from-hf", "--input", d, "--output", str(tmp_path / "out"),
                                          "--tensor-parallel", "1"], says) for d, says in cases])


# -------------------------------------------------------------------------------------------------- refusals
NULL = "null"          # an edit to JSON null (_edited_copy deletes a key given None)


def _edited(src, dst, **changes) -> str:
    out = _edited_copy(src, dst, **{k: v for k, v in changes.items() if v != NULL})
    path = os.path.join(out, "config.json")
    cfg = json.load(open(path))
    json.dump({**cfg, **{k: None for k, v in changes.items() if v == NULL}}, open(path, "w"))
    return out


def _expect_refusals(capsys, tmp_path, cases):
    cli = _cli()
    out = str(tmp_path / "out")
    capsys.readouterr()
    for argv, says in cases:
        rc = cli.main(argv)
        lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip() and "%" not in ln]
        assert rc == 2 and len(lines) == 1 and lines[0].startswith("error: "), (argv, lines)
        assert all(s in lines[0] for s in says), (says, lines)
        assert not os.path.exists(out)


def test_what_gpt_oss_conversion_refuses_is_one_line(converted, tmp_path, capsys):
    from zo_megatron.checkpoint import hf
    from zo_megatron.checkpoint.arch import full_meta
    from zo_megatron.checkpoint.hf import gpt_oss
    from zo_megatron.model.config import MOE_FIELDS

    src, out = converted["src"], str(tmp_path / "out")
    edits = [(dict(swiglu_alpha=1.5), ["swiglu_alpha=1.5", "1.702"]),
             (dict(num_experts_per_tok=1), ["num_experts_per_tok=1", "no exact mapping"]),
             (dict(attention_bias=False), ["attention_bias=false", "--add-bias-linear"]),
             (dict(quantization_config={"quant_method": "fp8"}), ["quant_method 'fp8'", "MXFP4"]),
             (dict(sliding_window=NULL), ["sliding_window=null"]),
             (dict(swiglu_limit=NULL), ["not a valid GptOssConfig", "swiglu_limit"]),
             (dict(layer_types=["chunked_attention", "full_attention"]), ["layer_types=", "'full_attention'"]),
             (dict(rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}),
              ["rope_type='dynamic'"])]
    cases = [(["from-hf", "--input", _edited(src, tmp_path / f"edit{i}", **edit), "--output", out,
               "--tensor-parallel", "1"], says) for i, (edit, says) in enumerate(edits)]
    cases.append((["to-hf", "--load", converted["ck"], "--output", out, "--architecture", "MixtralForCausalLM"],
                  ["cannot be written as MixtralForCausalLM", "no attention sinks"]))
    _expect_refusals(capsys, tmp_path, cases)
    # no other family writes sinks or the clamped quick GeGLU; GPT-OSS writes no SwiGLU, dense or top-1 model
    meta = converted["meta"]
    dense = {**meta, **MOE_FIELDS}
    assert "no attention sinks" in hf.why_not(hf.FAMILIES["LlamaForCausalLM"], dense)
    clamp = {**meta, "softmax_type": "vanilla", "quick_geglu": False, "swiglu": True}
    assert "no quick GeGLU, offset or clamp" in hf.why_not(hf.FAMILIES["MixtralForCausalLM"], clamp)
    for change, says in ((dict(quick_geglu=False, swiglu=True, glu_linear_offset=0.0, activation_func_clamp_value=None),
                          "quick-GeGLU experts"), (MOE_FIELDS, "experts in every layer"),
                         (dict(moe_router_topk=1, moe_router_pre_softmax=True), "a softmax over the top-k logits"),
                         (dict(moe_layer_freq=[1, 0]), "experts in every layer")):
        assert says in hf.why_not(gpt_oss.FAMILY, full_meta({**meta, **change})), change
    assert hf.family_for_model(meta, None, "ck") is gpt_oss.FAMILY
