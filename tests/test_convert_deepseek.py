"""tools/convert_checkpoint.py for DeepSeek-V3 and DeepSeek-V2 (checkpoint/hf/deepseek.py), against transformers.

Two small random models transformers builds and saves (every weight random, the latent norms' gains and V3's
e_score_correction_bias included), each with a tokenizer and a config vocabulary larger than it:
  V3: a query latent, YaRN (factor, mscale, mscale_all_dim: the softmax is scaled too), 3 layers of which the
      first is dense (first_k_dense_replace 1), 8 experts in 4 groups (topk_group 2, top 4: megatron-core's sum of
      the top 4 // 2 = 2 scores), the sigmoid router with its bias, 2 shared experts, routed_scaling_factor 2.5;
  V2: queries projected directly (V2-Lite's shape), plain RoPE, tied embeddings, the softmax router without
      renormalisation (--moe-router-pre-softmax), routed_scaling_factor 1.5, a dense first layer; and V2 with a
      query latent and group_limited_greedy routing (4 groups, 3 picked, top 4: a group's max is megatron-core's
      sum of its top 4 // 3 = 1 scores).
  - from-hf (TP 2) -> to-hf is bit for bit: every tensor (the expert bias through the checkpoint's buffers/) and
    the config's fields; the printed job flags rebuild the checkpoint's architecture; --dtype bf16 keeps the router
    in fp32, as transformers does;
  - our model built from the from-hf checkpoint gives transformers' logits, loss and every gradient (fp32, every
    element) at TP1 (DP 2), TP2 with sequence parallelism and TP1 x EP2 (alltoall), on 2 forked ranks;
  - to-hf of a checkpoint that records no architecture picks DeepseekV3 for the sigmoid router and DeepseekV2 for
    the softmax one, and no other family claims multi-latent attention;
  - V3's rope_interleave false (rotate-half rotary rows, permuted on the way in) with a YaRN whose mscale is
    solved for: transformers' logits at TP 1, and to-hf's interleaved model computes the same;
  - multi-token-prediction layers in the files are left out with one line; what has no exact mapping is one
    `error:` line, exit 2, nothing written.
"""
import json
import os

import pytest
import torch

from tests.harness import next_port, run_world
from tests.hf_tokenizer import HF_VOCAB_SIZE, make_hf_tokenizer
from tests.seeds import fresh_seed
from tests.test_convert_llama import _cli, _edited_copy, close, hf_logits, quiet

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

HIDDEN, HEADS, Q_RANK, KV_RANK, NOPE, ROPE, V_DIM = 64, 4, 24, 20, 12, 8, 10
FFN, MOE_FFN, EXPERTS, TOPK, POS = 72, 16, 8, 4, 64
VOCAB = HF_VOCAB_SIZE + 37              # the config's vocabulary exceeds the tokenizer's
SEQ, BATCH = 12, 4
_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
         "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.9, "mscale_all_dim": 0.8}
FIELDS = ("architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
          "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "hidden_act", "max_position_embeddings",
          "rms_norm_eps", "tie_word_embeddings", "rope_parameters", "attention_bias", "attention_dropout",
          "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "qk_head_dim", "head_dim",
          "v_head_dim", "n_routed_experts", "num_experts_per_tok", "n_shared_experts", "routed_scaling_factor",
          "n_group", "topk_group", "topk_method", "norm_topk_prob", "first_k_dense_replace", "rope_interleave",
          "mlp_bias", "bos_token_id", "eos_token_id")


def _common(layers):
    return dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, moe_intermediate_size=MOE_FFN,
                num_hidden_layers=layers, num_attention_heads=HEADS, num_key_value_heads=HEADS, kv_lora_rank=KV_RANK,
                qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE, v_head_dim=V_DIM, n_routed_experts=EXPERTS,
                num_experts_per_tok=TOPK, first_k_dense_replace=1, max_position_embeddings=POS, rms_norm_eps=1e-6,
                attention_dropout=0.0, bos_token_id=0, eos_token_id=1)


def configs():
    return {"v3": transformers.DeepseekV3Config(**_common(3), q_lora_rank=Q_RANK, rope_parameters=_YARN, n_group=4,
                                                topk_group=2, norm_topk_prob=True, n_shared_experts=2,
                                                routed_scaling_factor=2.5, tie_word_embeddings=False),
            "v2": transformers.DeepseekV2Config(**_common(2), q_lora_rank=None, topk_method="greedy",
                                                norm_topk_prob=False, n_shared_experts=1, routed_scaling_factor=1.5,
                                                rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
                                                tie_word_embeddings=True),
            "v2_groups": transformers.DeepseekV2Config(**_common(2), q_lora_rank=Q_RANK, n_group=4, topk_group=3,
                                                       topk_method="group_limited_greedy", norm_topk_prob=False,
                                                       n_shared_experts=1, tie_word_embeddings=False)}


def random_hf(directory, cfg, seed: int, tokenizer: bool = True) -> str:
    """transformers' model of cfg with every weight random (norm gains around 1) and a random expert bias."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1 + (1.0 if "norm" in name else 0.0))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):        # it moves the choice of experts
                b.copy_(torch.randn(b.shape, generator=gen) * 0.1)
    model.save_pretrained(str(directory))
    if tokenizer:
        make_hf_tokenizer(directory)
    return str(directory)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Each model from-hf at TP 2 (its log kept) and back through to-hf."""
    from zo_megatron.checkpoint import convert

    seed = fresh_seed("convert deepseek")
    d = tmp_path_factory.mktemp("convert_deepseek")
    out = {"seed": seed, "d": d, "logs": {}}
    for i, (name, cfg) in enumerate(configs().items()):
        random_hf(d / name, cfg, seed + i)
        lines = []
        convert.from_hf(str(d / name), str(d / f"{name}_ck"), tensor_parallel=2, log=lines.append)
        out["logs"][name] = lines
        convert.to_hf(str(d / f"{name}_ck"), str(d / f"{name}_back"), log=quiet)
    return out


def test_hf_ours_hf_is_bit_exact_and_the_printed_flags_rebuild_the_model(models, tmp_path):
    from zo_megatron.checkpoint import convert
    from zo_megatron.checkpoint.reader import CheckpointReader
    from zo_megatron.model import GPTConfig
    from zo_megatron.training.arguments import build_parser
    from zo_megatron.training.model_flags import architecture_kwargs, moe_kwargs

    d = models["d"]
    want = {"v3": dict(q_lora_rank=Q_RANK, rope_type="yarn", rotary_scaling_factor=4.0, mscale=0.9, mscale_all_dim=0.8,
                       moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                       moe_router_num_groups=4, moe_router_group_topk=2, moe_router_topk_scaling_factor=2.5,
                       moe_shared_expert_intermediate_size=2 * MOE_FFN, moe_layer_freq=[0, 1, 1],
                       untie_embeddings_and_output_weights=True),
            "v2": dict(q_lora_rank=None, rope_type="rope", rotary_base=5000, moe_router_score_function="softmax",
                       moe_router_pre_softmax=True, moe_router_enable_expert_bias=False, moe_router_num_groups=None,
                       moe_router_topk_scaling_factor=1.5, moe_shared_expert_intermediate_size=MOE_FFN,
                       moe_layer_freq=[0, 1], untie_embeddings_and_output_weights=False),
            "v2_groups": dict(q_lora_rank=Q_RANK, moe_router_score_function="softmax", moe_router_pre_softmax=True,
                              moe_router_num_groups=4, moe_router_group_topk=3, moe_router_topk_scaling_factor=None)}
    for name in configs():
        reader = CheckpointReader(str(d / f"{name}_ck"))
        meta = reader.model_meta
        assert meta["multi_latent_attention"] and meta["qk_layernorm"] and meta["num_experts"] == EXPERTS
        assert (meta["kv_lora_rank"], meta["qk_head_dim"], meta["qk_pos_emb_head_dim"], meta["v_head_dim"]) == \
            (KV_RANK, NOPE, ROPE, V_DIM)
        assert (meta["ffn_hidden_size"], meta["moe_ffn_hidden_size"], meta["moe_aux_loss_coeff"]) == (FFN, MOE_FFN, 0.0)
        for k, v in want[name].items():
            assert meta[k] == v, (name, k, meta[k], v)
        buffers = [k for k in reader.metadata.state_dict_metadata if k.startswith("buffers/")]
        assert len(buffers) == (2 if name == "v3" else 0), buffers
        a = safetensors_torch.load_file(str(d / name / "model.safetensors"))
        b = safetensors_torch.load_file(str(d / f"{name}_back" / "model.safetensors"))
        # what real releases and transformers' save_pretrained hold: one tensor per expert and projection
        assert f"model.layers.1.mlp.experts.{EXPERTS - 1}.up_proj.weight" in a
        assert ("model.layers.1.mlp.gate.e_score_correction_bias" in a) == (name == "v3")
        assert set(a) == set(b), (name, set(a) ^ set(b))
        for k in a:
            assert b[k].dtype == torch.float32 and torch.equal(a[k], b[k]), (name, k)
        cfg_a, cfg_b = (json.load(open(d / n / "config.json")) for n in (name, f"{name}_back"))
        for f in FIELDS:
            assert cfg_a.get(f) == cfg_b.get(f), (name, f, cfg_a.get(f), cfg_b.get(f))
        if name == "v3":       # no multi-token-prediction layers are written (transformers' model builds none)
            assert cfg_b["num_nextn_predict_layers"] == 0 and cfg_b["rope_scaling"]["mscale_all_dim"] == 0.8
        (flags,) = [ln.removeprefix("  model flags: ") for ln in models["logs"][name]
                    if ln.startswith("  model flags: ")]
        assert not any(ln.startswith("  left out:") for ln in models["logs"][name])
        args = build_parser().parse_args(flags.split())
        ours = GPTConfig(**architecture_kwargs(args), **moe_kwargs(args), vocab_size=args.vocab_size,
                         precision="fp32", attention_backend="sdpa")
        assert ours.arch_meta() == meta, (name, flags)
    # --dtype bf16: the router stays fp32, as transformers keeps and saves it (its bias decides the experts)
    convert.to_hf(str(d / "v3_ck"), str(tmp_path / "bf16"), dtype="bf16", log=quiet)
    b = safetensors_torch.load_file(str(tmp_path / "bf16" / "model.safetensors"))
    fp32 = {k for k, t in b.items() if t.dtype == torch.float32}
    assert fp32 == {f"model.layers.{i}.mlp.gate.{w}" for i in (1, 2) for w in ("weight", "e_score_correction_bias")}
    assert all(t.dtype == torch.bfloat16 for k, t in b.items() if k not in fp32)


def _world(rank, cks, tokens, labels, layouts):
    from zo_megatron.checkpoint.reader import CheckpointReader
    from zo_megatron.parallel import collectives, destroy_parallel, init_parallel

    models = {}
    for name, ck in cks.items():
        reader = CheckpointReader(ck)
        keys = [k for k in reader.metadata.state_dict_metadata if k.startswith("buffers/")]
        models[name] = (reader.model_meta, reader.read_weights(),
                        {k.removeprefix("buffers/"): t for k, t in reader.read_full(keys).items()})
    out = {}
    for tp, ep, dispatcher in layouts:
        next_port()                                  # chosen now, not when the test started
        ps = init_parallel(tp, expert_parallel=ep)
        for name, (meta, full, buffers) in models.items():
            out[(name, tp, ep, dispatcher)] = _one(ps, meta, full, buffers, tokens, labels, dispatcher)
        collectives.barrier()
        destroy_parallel()
    return out


def _one(ps, meta, full, buffers, tokens, labels, dispatcher):
    """One forward/backward of the checkpoint's model at the layout `ps` (tests/test_moe_model.py's _one, with the
    checkpoint's buffers: the router expert bias)."""
    from zo_megatron.model import GPTConfig, build_gpt_model
    from zo_megatron.model.sharding import gather_full, load_full_params, model_shard_infos
    from zo_megatron.parallel import collectives

    tp = ps.tp_size
    cfg = GPTConfig(**{**meta, "moe_token_dispatcher_type": dispatcher}, precision="fp32", sequence_parallel=tp > 1,
                    attention_backend="sdpa")
    model = build_gpt_model(cfg, ps.tp_rank, ps.tp_size, seed=1)
    infos = model_shard_infos(model, ps.tp_rank, ps.tp_size, VOCAB)
    load_full_params(model, full, ps.tp_rank, ps.tp_size, VOCAB)
    own = {model.full_name(n): b for n, b in model.named_buffers()}
    assert set(buffers) <= set(own), sorted(set(buffers) - set(own))
    with torch.no_grad():
        for n, t in buffers.items():
            own[n].copy_(t)
    rows = slice(ps.dp_rank * BATCH // ps.dp_size, (ps.dp_rank + 1) * BATCH // ps.dp_size)
    with torch.no_grad():
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
    return dict(tp_rank=ps.tp_rank, etp_rank=ps.etp_rank, dp_rank=ps.dp_rank, rows=(rows.start, rows.stop),
                logits=full_logits[..., :VOCAB].clone(), loss=loss.item(), grads=grads)


def _reference(directory, tmp_path, tokens, labels):
    """transformers' logits, loss and gradients; the gradients as our full tensors (written as the model's
    weights by save_pretrained and read back through the family's mapping; the buffers set aside)."""
    from zo_megatron.checkpoint import hf as hf_families
    from zo_megatron.checkpoint.arch import buffer_shapes

    model = transformers.AutoModelForCausalLM.from_pretrained(directory, local_files_only=True, dtype=torch.float32,
                                                              attn_implementation="eager")
    logits = model(tokens).logits
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.grad)
    grads_dir = str(tmp_path / (os.path.basename(directory) + "_grads"))
    model.save_pretrained(grads_dir)
    cfg_json = hf_families.read_config_json(grads_dir)
    family = hf_families.family_for_config(cfg_json, grads_dir)
    cfg = family.read_config(cfg_json, grads_dir)
    meta, _ = family.meta_from_config(cfg, grads_dir)
    grads = {k: v for k, v in family.read_state(grads_dir, cfg, meta).items() if k not in buffer_shapes(meta)}
    return logits.detach(), loss.item(), grads


def test_logits_loss_and_every_gradient_equal_transformers_at_tp1_tp2_sp_and_ep2(models, tmp_path):
    from tests.test_moe_model import _check

    d, seed = models["d"], models["seed"]
    gen = torch.Generator().manual_seed(seed + 100)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    layouts = [(1, 1, "allgather"), (2, 1, "allgather"), (1, 2, "alltoall")]
    names = tuple(configs())
    world = run_world(_world, 2, {n: str(d / f"{n}_ck") for n in names}, tokens, labels, layouts, timeout=300)
    for name in names:
        ref_logits, ref_loss, ref_grads = _reference(str(d / name), tmp_path, tokens, labels)
        for layout in layouts:
            _check(world, (name, *layout), ref_logits, ref_loss, ref_grads)


def _job_checkpoint(directory, reader, tokenizer):
    """The checkpoint's weights and buffers as a job's checkpoint: no recorded Hugging Face architecture."""
    from zo_megatron.checkpoint.convert import _write_weights_checkpoint

    keys = [k for k in reader.metadata.state_dict_metadata if k.startswith("buffers/")]
    buffers = {k.removeprefix("buffers/"): t for k, t in reader.read_full(keys).items()}
    _write_weights_checkpoint(str(directory), reader.read_weights(), reader.model_meta, tp=1, converted_from="test",
                              args=reader.args, force=False, log=quiet, tokenizer_from=tokenizer, buffers=buffers)
    return str(directory)


def test_to_hf_picks_deepseek_by_its_router_and_no_other_family_claims_mla(models, tmp_path):
    """A job's checkpoint with MLA (no recorded architecture): the sigmoid router is written as DeepseekV3, the
    softmax one as DeepseekV2, each bit for bit; every other family refuses multi-latent attention, and each
    DeepSeek variant the other's router."""
    from zo_megatron.checkpoint import convert
    from zo_megatron.checkpoint import hf as hf_families
    from zo_megatron.checkpoint.reader import CheckpointReader
    from zo_megatron.model.config import MOE_FIELDS

    d = models["d"]
    for name, arch in (("v3", "DeepseekV3ForCausalLM"), ("v2", "DeepseekV2ForCausalLM")):
        reader = CheckpointReader(str(d / f"{name}_ck"))
        ck = _job_checkpoint(tmp_path / f"{name}_job", reader, str(d / name))
        assert "hf_architecture" not in CheckpointReader(ck).manifest
        back = str(tmp_path / f"{name}_back")
        convert.to_hf(ck, back, log=quiet)
        assert json.load(open(os.path.join(back, "config.json")))["architectures"] == [arch]
        a = safetensors_torch.load_file(str(d / name / "model.safetensors"))
        b = safetensors_torch.load_file(os.path.join(back, "model.safetensors"))
        assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a), name
        meta = reader.model_meta
        for other, family in hf_families.FAMILIES.items():
            why = hf_families.why_not(family, meta)
            if other == arch:
                assert why is None, (name, why)
            elif other.startswith("Deepseek"):
                assert "router" in why, (name, other, why)
            else:
                assert why is not None and "multi-latent attention" in why, (name, other, why)
        # the dense layers alone: an MLA model without experts is a DeepseekV3 (no router to tell)
        dense = {**meta, **MOE_FIELDS}
        assert hf_families.family_for_model(dense, None, "x").architecture == "DeepseekV3ForCausalLM"


def test_rope_interleave_false_converts_exactly_and_comes_back_interleaved(tmp_path):
    """V3 with rotate-half rotary rows (rope_interleave false) and a YaRN with mscale_all_dim alone (the softmax
    scaled by get_mscale(4, 0.7)^2, the rotary factor get_mscale(4): mscale solved for): our logits at TP 1 are
    transformers'; to-hf writes rope_interleave true with the rows interleaved, and transformers' logits of it
    are the source's; the rows that do not rotate are unchanged."""
    from zo_megatron.checkpoint import convert
    from zo_megatron.checkpoint.reader import CheckpointReader

    seed = fresh_seed("deepseek rope_interleave false")
    yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
            "mscale_all_dim": 0.7}
    cfg = transformers.DeepseekV3Config(**{**_common(2), "first_k_dense_replace": 2}, q_lora_rank=Q_RANK,
                                        rope_parameters=yarn, rope_interleave=False, tie_word_embeddings=False)
    src = random_hf(tmp_path / "hf", cfg, seed)
    ck = str(tmp_path / "ck")
    convert.from_hf(src, ck, tensor_parallel=1, log=quiet)
    meta = CheckpointReader(ck).model_meta
    assert meta["num_experts"] is None and meta["mscale_all_dim"] == 0.7 and meta["mscale"] != 1.0
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(seed + 1))
    ref = hf_logits(src, tokens)
    close(run_world(_logits, 1, ck, tokens, timeout=180)[0], ref)
    back = str(tmp_path / "back")
    convert.to_hf(ck, back, log=quiet)
    assert json.load(open(os.path.join(back, "config.json")))["rope_interleave"] is True
    close(hf_logits(back, tokens), ref)
    a = safetensors_torch.load_file(os.path.join(src, "model.safetensors"))
    b = safetensors_torch.load_file(os.path.join(back, "model.safetensors"))
    q = "model.layers.0.self_attn.q_b_proj.weight"
    assert torch.equal(a[q].view(HEADS, -1, Q_RANK)[:, :NOPE], b[q].view(HEADS, -1, Q_RANK)[:, :NOPE])
    assert not torch.equal(a[q], b[q])


def _logits(rank, ck, tokens):
    from zo_megatron.checkpoint.reader import CheckpointReader
    from zo_megatron.model import GPTConfig, build_gpt_model
    from zo_megatron.model.sharding import load_full_params
    from zo_megatron.parallel import init_parallel

    init_parallel(1)
    reader = CheckpointReader(ck)
    model = build_gpt_model(GPTConfig(**reader.model_meta, precision="fp32", attention_backend="sdpa"), 0, 1, 1).eval()
    load_full_params(model, reader.read_weights(), 0, 1, VOCAB)
    with torch.no_grad():
        return model(tokens)[..., :VOCAB].float()


def test_multi_token_prediction_layers_are_left_out_in_one_line(models, tmp_path):
    """DeepSeek-V3's files hold its MTP layer after the decoder's (model.layers.61.* of 61): from-hf leaves
    num_nextn_predict_layers of them out and says so in one line; a layer beyond them is refused."""
    from zo_megatron.checkpoint import convert
    from zo_megatron.errors import UserError

    d = models["d"]
    src = str(d / "v3")
    sd = safetensors_torch.load_file(os.path.join(src, "model.safetensors"))
    mtp = {f"model.layers.3.{k}": torch.ones(2, 2) for k in ("eh_proj.weight", "enorm.weight", "hnorm.weight",
                                                               "shared_head.norm.weight")}
    for extra, layers in ((mtp, 1), ({**mtp, "model.layers.4.eh_proj.weight": torch.ones(2)}, 1)):
        case = tmp_path / f"mtp{len(extra)}"
        os.makedirs(case)
        for f in os.listdir(src):
            if f != "model.safetensors":
                os.symlink(os.path.join(src, f), case / f)
        safetensors_torch.save_file({**sd, **extra}, str(case / "model.safetensors"), metadata={"format": "pt"})
        lines = []
        if len(extra) == len(mtp):
            convert.from_hf(str(case), str(tmp_path / "ck"), tensor_parallel=1, log=lines.append)
            notes = [ln for ln in lines if ln.startswith("  left out:")]
            assert len(notes) == 1 and "4 tensors model.layers.3.*" in notes[0] and \
                "num_nextn_predict_layers=1" in notes[0], lines
        else:
            with pytest.raises(UserError, match="model.layers.4.eh_proj.weight"):
                convert.from_hf(str(case), str(tmp_path / "ck2"), tensor_parallel=1, log=quiet)
            assert not (tmp_path / "ck2").exists()


def test_what_has_no_exact_mapping_is_one_line_exit_2(models, tmp_path, capsys):
    d = models["d"]
    v3, v2 = str(d / "v3"), str(d / "v2")
    yarn = dict(_YARN)
    cases = [
        (v3, dict(quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]}),
         ["quantization_config", "'fp8'", "dequantize"]),
        (v3, dict(attention_bias=True), ["attention_bias=true"]),
        (v3, dict(num_key_value_heads=2), ["num_key_value_heads=2", "no key/value groups"]),
        (v3, dict(rms_norm_eps=1e-5), ["rms_norm_eps=1e-05", "latent norms"]),
        (v3, dict(norm_topk_prob=False), ["norm_topk_prob=false", "always divides"]),
        (v3, dict(topk_group=1), ["n_group=4, topk_group=1", "more experts than the 1 groups hold"]),
        (v3, dict(n_group=2, topk_group=1), ["n_group=2, topk_group=1", "top 2", "= 4"]),
        (v3, dict(moe_layer_freq=2), ["moe_layer_freq=2", "ambiguous"]),
        (v3, dict(scoring_func="softmax"), ["scoring_func='softmax'"]),
        (v3, dict(rope_parameters={**yarn, "truncate": False}), ["truncate=false"]),
        (v3, dict(rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}),
         ["rope_type='linear'"]),
        (v2, dict(norm_topk_prob=True), ["norm_topk_prob=true", "does not read"]),
        (v2, dict(topk_method="group_limited_greedy", n_group=4, topk_group=2), ["largest score", "= 2"]),
        (v2, dict(mlp_bias=True), ["mlp_bias=true"]),
        (v2, dict(hidden_act="gelu"), ["hidden_act='gelu'"]),
        (v2, dict(topk_method="noaux_tc"), ["topk_method='noaux_tc'", "greedy or group_limited_greedy"])]
    cli = _cli()
    out = str(tmp_path / "out")
    capsys.readouterr()
    argvs = [(["from-hf", "--input", _edited_copy(src, tmp_path / f"case{i}", **change), "--output", out,
               "--tensor-parallel", "1"], says) for i, (src, change, says) in enumerate(cases)]
    argvs += [(["to-hf", "--load", str(d / "v3_ck"), "--output", out, "--architecture", "Qwen3MoeForCausalLM"],
               ["cannot be written as Qwen3MoeForCausalLM", "no multi-latent attention"]),
              (["to-hf", "--load", str(d / "v3_ck"), "--output", out, "--architecture", "DeepseekV2ForCausalLM"],
               ["cannot be written as DeepseekV2ForCausalLM", "softmax router", "DeepseekV3ForCausalLM"])]
    for argv, says in argvs:
        rc = cli.main(argv)
        lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip() and "%" not in ln]
        assert rc == 2 and len(lines) == 1 and lines[0].startswith("error: "), (argv, lines)
        assert all(s in lines[0] for s in says), (says, lines[0])
        assert not os.path.exists(out)
