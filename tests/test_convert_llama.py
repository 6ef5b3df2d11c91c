"""tools/convert_checkpoint.py for Llama, Mistral and Qwen2, against transformers and megatron-core.

Small random models that transformers builds itself (odd sizes: hidden 96, 8 heads, 4 KV groups,
FFN 200, rope theta 500000; every weight random, RMSNorm gains and biases included), each with a
byte-level BPE tokenizer trained offline (tests/hf_tokenizer.py) and a config vocabulary larger than
the tokenizer's (as Qwen2's):
  - HF -> ours (TP 1, 2, 4) -> HF is bit-exact: every tensor, the architecture's config fields, the
    tokenizer files; both config schemas (transformers 4.x rope_theta/rope_scaling, 5.x
    rope_parameters) give the same checkpoint;
  - to-megatron files load strictly into megatron-core's own GPTModel, built here from a
    TransformerConfig (not through zo_megatron's model), on every TP rank, and its logits equal
    transformers' (fp32, 1e-5 relative, every element); from-megatron gives the weights back bit
    for bit;
  - wrong input is one `error:` line, exit 2, nothing written.
"""
import json
import os

import pytest
import torch

from tests.harness import next_port, run_world
from tests.hf_tokenizer import HF_VOCAB_SIZE, make_hf_tokenizer
from tests.seeds import fresh_seed

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

HIDDEN, HEADS, GROUPS, FFN, LAYERS, POS = 96, 8, 4, 200, 2, 64
VOCAB = HF_VOCAB_SIZE + 37              # the config's vocabulary exceeds the tokenizer's, as Qwen2's does
SEQ = 11
TPS = (1, 2, 4)
# the architectures' fields that must survive HF -> ours -> HF
CONFIG_FIELDS = ("architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                 "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings",
                 "rms_norm_eps", "tie_word_embeddings", "rope_parameters", "attention_bias", "mlp_bias",
                 "bos_token_id", "eos_token_id", "use_sliding_window", "sliding_window")


def hf_configs():
    """name -> transformers config: untied Llama with Llama-3.1 rope scaling, tied Qwen2 (QKV
    biases), untied Mistral (full attention), all GQA with odd sizes."""
    common = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                  num_attention_heads=HEADS, num_key_value_heads=GROUPS, max_position_embeddings=POS,
                  rms_norm_eps=1e-5, bos_token_id=0, eos_token_id=1, attention_dropout=0.0)
    return {
        "llama": transformers.LlamaConfig(**{**common, "max_position_embeddings": 16384}, tie_word_embeddings=False,
                                          rope_parameters=dict(
            rope_type="llama3", rope_theta=500000.0, factor=4.0, low_freq_factor=1.0, high_freq_factor=4.0,
            original_max_position_embeddings=8192)),
        "qwen2": transformers.Qwen2Config(**common, tie_word_embeddings=True, use_sliding_window=False,
                                          rope_parameters=dict(rope_type="default", rope_theta=500000.0)),
        "mistral": transformers.MistralConfig(**common, tie_word_embeddings=False, sliding_window=None,
                                              rope_parameters=dict(rope_type="default", rope_theta=500000.0)),
    }


def make_hf_model(directory, cfg, seed: int, tokenizer: bool = True) -> str:
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.05)
    model.save_pretrained(str(directory))
    if tokenizer:
        make_hf_tokenizer(directory)
    return str(directory)


def hf_logits(directory, tokens) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, local_files_only=True, dtype=torch.float32,
                                                              attn_implementation="eager").eval()
    with torch.no_grad():
        return model(tokens).logits


def close(ours, ref):
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


def quiet(_line):
    pass


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Every model through from-hf at TP 1, 2, 4 and back through to-hf and to-megatron."""
    from zo_megatron.checkpoint import convert

    seed = fresh_seed("convert llama")
    d = tmp_path_factory.mktemp("convert_llama")
    out = {"seed": seed, "d": str(d), "names": list(hf_configs())}
    for i, (name, cfg) in enumerate(hf_configs().items()):
        src = make_hf_model(d / name, cfg, seed + i)
        for tp in TPS:
            ck = str(d / f"{name}_ck_tp{tp}")
            convert.from_hf(src, ck, tensor_parallel=tp, log=quiet)
            convert.to_hf(ck, str(d / f"{name}_back_tp{tp}"), log=quiet)
            convert.to_megatron(ck, str(d / f"{name}_megatron_tp{tp}"), log=quiet)
            convert.from_megatron(str(d / f"{name}_megatron_tp{tp}"), str(d / f"{name}_from_megatron_tp{tp}"),
                                  tensor_parallel=tp, log=quiet)
    return out


def test_hf_ours_hf_is_bit_exact_at_every_tp(models):
    for name in models["names"]:
        src = os.path.join(models["d"], name)
        a = safetensors_torch.load_file(os.path.join(src, "model.safetensors"))
        cfg_a = json.load(open(os.path.join(src, "config.json")))
        for tp in TPS:
            back = os.path.join(models["d"], f"{name}_back_tp{tp}")
            b = safetensors_torch.load_file(os.path.join(back, "model.safetensors"))
            assert set(a) == set(b), (name, tp, set(a) ^ set(b))
            for k in a:
                assert a[k].dtype == b[k].dtype == torch.float32 and torch.equal(a[k], b[k]), (name, tp, k)
            cfg_b = json.load(open(os.path.join(back, "config.json")))
            for field in CONFIG_FIELDS:
                assert cfg_a.get(field) == cfg_b.get(field), (name, tp, field, cfg_a.get(field), cfg_b.get(field))
            for f in ("tokenizer.json", "tokenizer_config.json"):      # the tokenizer, through ck/tokenizer/
                ck_tok = os.path.join(models["d"], f"{name}_ck_tp{tp}", "iter_0000000", "tokenizer", f)
                for copy in (ck_tok, os.path.join(back, f)):
                    assert open(copy, "rb").read() == open(os.path.join(src, f), "rb").read(), (name, tp, copy)
            assert type(transformers.AutoModelForCausalLM.from_pretrained(back, local_files_only=True)).__name__ == \
                cfg_a["architectures"][0]


def test_the_checkpoint_records_the_architecture_as_the_job_s_flags(models):
    from zo_megatron.checkpoint.reader import CheckpointReader

    expect = {"llama": dict(position_embedding_type="rope", rotary_base=500000, use_rope_scaling=True,
                            rope_scaling_factor=4.0, normalization="RMSNorm", swiglu=True, num_query_groups=GROUPS,
                            untie_embeddings_and_output_weights=True, add_bias_linear=False, add_qkv_bias=False,
                            ffn_hidden_size=FFN, vocab_size=VOCAB, layernorm_epsilon=1e-5),
              "qwen2": dict(use_rope_scaling=False, untie_embeddings_and_output_weights=False, add_bias_linear=False,
                            add_qkv_bias=True, num_query_groups=GROUPS),
              "mistral": dict(untie_embeddings_and_output_weights=True, add_bias_linear=False, add_qkv_bias=False)}
    for name, fields in expect.items():
        for tp in TPS:
            reader = CheckpointReader(os.path.join(models["d"], f"{name}_ck_tp{tp}"))
            meta = reader.model_meta
            for k, v in fields.items():
                assert meta[k] == v, (name, tp, k, meta[k], v)
            assert reader.layout == (tp, 1) and not reader.has_optimizer_state
            assert ("gpt.output_layer.weight" in reader.shapes) == meta["untie_embeddings_and_output_weights"]
            assert reader.shapes["gpt.decoder.layers.0.mlp.linear_fc1.weight"] == (2 * FFN, HIDDEN)
            assert reader.shapes["gpt.decoder.layers.0.self_attention.linear_qkv.weight"] == \
                ((HEADS + 2 * GROUPS) * HIDDEN // HEADS, HIDDEN)


def test_both_config_schemas_give_the_same_checkpoint(models, tmp_path):
    """transformers 4.x wrote rope_theta + rope_scaling, 5.x writes rope_parameters: both are read."""
    from zo_megatron.checkpoint import convert
    from zo_megatron.checkpoint.reader import CheckpointReader

    src = os.path.join(models["d"], "llama")
    old = tmp_path / "llama_4x"
    os.makedirs(old)
    cfg = json.load(open(os.path.join(src, "config.json")))
    rope = cfg.pop("rope_parameters")
    cfg["rope_theta"] = rope.pop("rope_theta")
    cfg["rope_scaling"] = {("type" if k == "rope_type" else k): v for k, v in rope.items()}
    cfg["transformers_version"] = "4.45.0"
    json.dump(cfg, open(old / "config.json", "w"))
    for f in os.listdir(src):
        if f != "config.json":
            os.symlink(os.path.join(src, f), old / f)
    convert.from_hf(str(old), str(tmp_path / "ck"), tensor_parallel=2, log=quiet)
    a = CheckpointReader(str(tmp_path / "ck"))
    b = CheckpointReader(os.path.join(models["d"], "llama_ck_tp2"))
    assert a.model_meta == b.model_meta
    wa, wb = a.read_weights(), b.read_weights()
    assert set(wa) == set(wb) and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_megatron_round_trip_is_bit_exact(models):
    from zo_megatron.checkpoint.reader import CheckpointReader

    for name in models["names"]:
        for tp in TPS:
            ref = CheckpointReader(os.path.join(models["d"], f"{name}_ck_tp{tp}"))
            back = CheckpointReader(os.path.join(models["d"], f"{name}_from_megatron_tp{tp}"))
            assert back.model_meta == {**ref.model_meta}, (name, tp)
            wa, wb = ref.read_weights(), back.read_weights()
            assert set(wa) == set(wb), (name, tp, set(wa) ^ set(wb))
            assert back.manifest["tokenizer_files"] == ref.manifest["tokenizer_files"]   # via args.tokenizer_model
            for k in wa:
                assert torch.equal(wa[k], wb[k]), (name, tp, k)


# ---------------------------------------------------------------- megatron-core loads the files

def _megatron_core_config(args, tp):
    """megatron-core's TransformerConfig from Megatron-LM's saved args, at TP `tp`."""
    from tests.megatron_reference import megatron_core_config

    return megatron_core_config(args, tensor_model_parallel_size=tp)


def _megatron_core_gpt(args, tp):
    """megatron-core's GPTModel from Megatron-LM's saved args, as Megatron-LM's own loader would build it."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return GPTModel(config=_megatron_core_config(args, tp),
                    transformer_layer_spec=get_gpt_layer_local_spec(
                        normalization=args.normalization, qk_layernorm=getattr(args, "qk_layernorm", False)),
                    vocab_size=args.padded_vocab_size, max_sequence_length=args.max_position_embeddings,
                    share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                    position_embedding_type=args.position_embedding_type, rotary_base=args.rotary_base,
                    rotary_percent=args.rotary_percent, rope_scaling=args.use_rope_scaling,
                    rope_scaling_factor=args.rope_scaling_factor, parallel_output=True)


def _load_megatron_files(rank, d, names, tokens):
    from zo_megatron.checkpoint import megatron_lm
    from zo_megatron.parallel import collectives, destroy_parallel, init_parallel

    out = {}
    for tp in TPS[::-1]:
        next_port()
        ps = init_parallel(tp, num_attention_heads=HEADS, hidden_size=HIDDEN)
        for name in names:
            sd = megatron_lm.safe_load(os.path.join(d, f"{name}_megatron_tp{tp}", "release",
                                                    f"mp_rank_{ps.tp_rank:02d}", megatron_lm.FILE))
            model = _megatron_core_gpt(sd["args"], tp)
            model.load_state_dict(sd["model"], strict=True)
            model.eval()
            b, s = tokens.shape
            mask = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1)[None, None]
            with torch.no_grad():
                local = model(tokens, torch.arange(s).expand(b, s), mask)
            full = torch.cat(collectives.all_gather_list(local.contiguous(), ps.tp_group), -1) if tp > 1 else local
            out[(name, tp)] = (full[..., :VOCAB].clone(), vars(sd["args"]))
        collectives.barrier()
        destroy_parallel()
    return out


def test_megatron_core_loads_the_files_strictly_on_every_tp_rank_with_transformers_logits(models):
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(models["seed"] + 7))
    world = run_world(_load_megatron_files, 4, models["d"], models["names"], tokens, timeout=400)
    for name in models["names"]:
        ref = hf_logits(os.path.join(models["d"], name), tokens)
        for tp in TPS:
            for rank_out in world:
                logits, args = rank_out[(name, tp)]
                close(logits, ref)
                assert args["tensor_model_parallel_size"] == tp and args["swiglu"] and args["normalization"] == "RMSNorm"
                assert args["group_query_attention"] and args["num_query_groups"] == GROUPS
                assert args["position_embedding_type"] == "rope" and args["rotary_base"] == 500000
                assert args["padded_vocab_size"] == -(-VOCAB // (128 * tp)) * 128 * tp
                assert args["tokenizer_type"] == "HuggingFaceTokenizer" and args["tokenizer_model"].endswith(
                    os.path.join(f"{name}_ck_tp{tp}", "iter_0000000", "tokenizer"))


def _built_shapes(rank, metas):
    from zo_megatron.checkpoint.content import full_shapes
    from zo_megatron.model import build_gpt_model
    from zo_megatron.parallel import init_parallel

    init_parallel(1)
    return [full_shapes(build_gpt_model(_our_config(m), 0, 1, 1), 0, 1, m["vocab_size"]) for m in metas]


def test_the_tools_shapes_of_an_architecture_are_the_built_model_s():
    """arch.param_shapes (what from-megatron / from-hf check against) equals the model the job builds,
    for GPT-2 and for every architecture field switched on (q/k norms, kv-channels, qkv bias)."""
    from zo_megatron.checkpoint.arch import full_meta, param_shapes

    base = dict(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=1000, max_position_embeddings=32)
    metas = [full_meta(base),
             full_meta({**base, "position_embedding_type": "rope", "normalization": "RMSNorm", "swiglu": True,
                        "num_query_groups": 2, "kv_channels": 24, "untie_embeddings_and_output_weights": True,
                        "add_bias_linear": False, "add_qkv_bias": True, "qk_layernorm": True}),
             full_meta({**base, "qk_layernorm": True, "ffn_hidden_size": 72})]
    for meta, built in zip(metas, run_world(_built_shapes, 1, metas, timeout=120)[0]):
        assert param_shapes(meta) == built, set(param_shapes(meta).items()) ^ set(built.items())


# ---------------------------------------------------------------- wrong input

def _cli():
    import importlib.util

    spec = importlib.util.spec_from_file_location("convert_checkpoint_cli", os.path.join(
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools", "convert_checkpoint.py"))
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    return cli


def _edited_copy(src, dst, **changes):
    """A copy of the HF directory `src` whose config.json has `changes` (None deletes a key)."""
    os.makedirs(dst)
    for f in os.listdir(src):
        if f != "config.json":
            os.symlink(os.path.join(src, f), os.path.join(dst, f))
    cfg = json.load(open(os.path.join(src, "config.json")))
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    json.dump(cfg, open(os.path.join(dst, "config.json"), "w"))
    return str(dst)


def test_wrong_input_is_one_error_line_exit_2_and_nothing_written(models, tmp_path, capsys):
    cli = _cli()
    llama = os.path.join(models["d"], "llama")
    scratch = tmp_path / "inputs"
    os.makedirs(scratch)
    no_weights = scratch / "no_weights"
    os.makedirs(no_weights)
    json.dump(json.load(open(os.path.join(llama, "config.json"))), open(no_weights / "config.json", "w"))
    rope = json.load(open(os.path.join(llama, "config.json")))["rope_parameters"]
    cases = [
        ("unknown architecture", _edited_copy(llama, scratch / "phi", architectures=["PhiForCausalLM"]),
         "PhiForCausalLM is not supported; supported architectures: GPT2LMHeadModel, LlamaForCausalLM, "
         "MistralForCausalLM, Qwen2ForCausalLM"),
        ("a hub id", "meta-llama/Llama-3.2-1B", "no such directory"),
        ("config without weights", str(no_weights), "no weights (model.safetensors"),
        ("llama3 rope with other fixed values", _edited_copy(llama, scratch / "rope", rope_parameters={
            **rope, "high_freq_factor": 2.0}), "high_freq_factor=2.0"),
        ("dynamic rope", _edited_copy(llama, scratch / "dynamic", rope_parameters={
            "rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}), "rope_type='dynamic'"),
        ("GELU Llama", _edited_copy(llama, scratch / "gelu", hidden_act="gelu"), "hidden_act='gelu'"),
        ("attention bias without MLP bias", _edited_copy(llama, scratch / "bias", attention_bias=True),
         "attention_bias=True, mlp_bias=False"),
    ]
    out = str(tmp_path / "out")
    capsys.readouterr()
    for case, src, says in cases:
        before = sorted(os.listdir(tmp_path))
        rc = cli.main(["from-hf", "--input", src, "--output", out, "--tensor-parallel", "1"])
        err = capsys.readouterr().err
        lines = [ln for ln in err.splitlines() if ln.strip() and "%" not in ln]
        assert rc == 2, (case, rc, err)
        assert len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0], (case, err)
        assert sorted(os.listdir(tmp_path)) == before, case
    # TP that does not divide the KV groups; a Qwen2 config (QKV biases only) written as Llama
    for argv, says in (
            (["from-hf", "--input", llama, "--output", out, "--tensor-parallel", "8"], "query groups 4"),
            (["to-hf", "--load", os.path.join(models["d"], "qwen2_ck_tp1"), "--output", out,
              "--architecture", "LlamaForCausalLM"], "cannot be written as LlamaForCausalLM")):
        rc = cli.main(argv)
        err = capsys.readouterr().err
        assert rc == 2 and err.count("\n") == 1 and says in err, (argv, err)
        assert not os.path.exists(out)


# ---------------------------------------------------------------- our model, the engine, reshard

STEPS, MICRO = 2, 2


def _our_config(meta):
    from zo_megatron.model import GPTConfig
    from zo_megatron.model.config import ARCH_FIELDS

    return GPTConfig(**{k: meta[k] for k in ARCH_FIELDS}, precision="fp32")


def _gathered_logits(model, ps, tokens):
    from zo_megatron.parallel import collectives

    with torch.no_grad():
        local = model(tokens).float()
    full = torch.cat(collectives.all_gather_list(local.contiguous(), ps.tp_group), -1) if ps.tp_size > 1 else local
    return full[..., :VOCAB].clone()


def _live_state(model, engine, ps):
    """This rank's fp32 master / first-moment fragments as the live engine holds them, with the
    model's own shard layout (pieces), for an assembly independent of the checkpoint code."""
    from zo_megatron.model.sharding import model_shard_infos

    return {"tp_rank": ps.tp_rank,
            "fragments": [(n, start, views["master"].clone(), views["exp_avg"].clone())
                          for n, _, start, _, views in engine.host_state_views()],
            "infos": {n: (i.tp_axis, i.local_shape, i.full_shape, i.pieces)
                      for n, i in model_shard_infos(model, ps.tp_rank, ps.tp_size, VOCAB).items()}}


def assemble(outs, which):
    """Full tensors from every rank's flat fragments (DP ranks each own a part of their TP
    shard), each shard placed by its pieces."""
    locals_, layout = {}, {}
    for o in outs:
        for name, start, master, exp_avg in o["fragments"]:
            axis, local_shape, full_shape, pieces = o["infos"][name]
            local = locals_.setdefault((name, o["tp_rank"]), torch.full(local_shape, float("nan")))
            src = master if which == "master" else exp_avg
            local.view(-1)[start:start + src.numel()] = src
            layout[(name, o["tp_rank"])] = (axis, full_shape, pieces)
    full = {}
    for (name, _), local in locals_.items():
        axis, full_shape, pieces = layout[(name, _)]
        t = full.setdefault(name, torch.full(full_shape, float("nan")))
        if axis is None:
            t.copy_(local)
        for f, lo, n in (pieces if axis is not None else ()):
            t.narrow(axis, f, n).copy_(local.narrow(axis, lo, n))
    for name, t in full.items():
        assert not torch.isnan(t).any(), (name, which)
    return full


def _engine_world(rank, d, tokens, seed):
    """Per layout: our model loads the from-hf checkpoint through the job's loader (its logits come
    back); at TP4 it trains and saves; rank 0 converts; each reshard loads as a same-layout resume."""
    from zo_megatron.checkpoint import LoadOptions, load_checkpoint, save_checkpoint
    from zo_megatron.checkpoint import convert
    from zo_megatron.checkpoint.arch import param_shapes
    from zo_megatron.checkpoint.content import full_shapes
    from zo_megatron.checkpoint.reader import CheckpointReader
    from zo_megatron.model import build_gpt_model
    from zo_megatron.offload.engine import AdamConfig, ZeroOffloadEngine
    from zo_megatron.parallel import collectives, destroy_parallel, init_parallel

    out = {}

    def world(tp, name, ck, train=False, resume=False):
        next_port()
        meta = CheckpointReader(ck).model_meta
        cfg = _our_config(meta)
        ps = init_parallel(tp, seed=seed, num_attention_heads=HEADS, hidden_size=HIDDEN)
        model = build_gpt_model(cfg, ps.tp_rank, ps.tp_size, seed + 11)
        engine = ZeroOffloadEngine(model, precision="fp32", adam=AdamConfig(lr=1e-2, weight_decay=0.1), clip_grad=1.0,
                                   bucket_size=20000, dp_group=ps.dp_group, tp_rank=ps.tp_rank, device=ps.device)
        res = load_checkpoint(ck, ps=ps, model=model, optimizer=engine, vocab_size=VOCAB, model_meta=cfg.arch_meta(),
                              schedule={}, opts=LoadOptions(override_opt_param_scheduler=True))
        o = {"tp": tp, "logits": _gathered_logits(model, ps, tokens), "resharded_from": res.resharded_from,
             "step": engine.step_count, "shapes_ok": full_shapes(model, ps.tp_rank, tp, VOCAB) == param_shapes(meta)}
        if train:
            gen = torch.Generator().manual_seed(seed + 1)
            for _ in range(STEPS):
                batch = torch.randint(0, VOCAB, (MICRO * ps.dp_size, SEQ), generator=gen)
                mine = batch[ps.dp_rank * MICRO:(ps.dp_rank + 1) * MICRO]
                engine.backward(model.loss(mine, torch.roll(mine, -1, 1)))
                engine.step()
            o["logits"] = _gathered_logits(model, ps, tokens)        # the trained model's
            save_checkpoint(os.path.join(d, "trained"), STEPS, ps=ps, model=model, optimizer=engine, vocab_size=VOCAB,
                            train_state={"consumed_samples": 0, "consumed_valid_samples": 0,
                                         "opt_param_scheduler": None},
                            model_meta=cfg.arch_meta(), args={"make_vocab_size_divisible_by": 128})
        if train or resume:
            o.update(_live_state(model, engine, ps))
        engine.close()
        collectives.barrier()
        destroy_parallel()
        out[name] = o

    for tp in TPS[::-1]:                        # the from-hf checkpoints, at TP x DP = 4 x 1, 2 x 2, 1 x 4
        world(tp, f"from_hf_tp{tp}", os.path.join(d, f"llama_ck_tp{tp}"))
    world(4, "trained", os.path.join(d, "llama_ck_tp4"), train=True)
    if rank == 0:
        convert.to_fp32(os.path.join(d, "trained"), os.path.join(d, "trained_fp32.safetensors"), log=quiet)
        convert.reshard(os.path.join(d, "trained"), os.path.join(d, "tp2"), target_tp=2, target_dp=2, log=quiet)
        convert.reshard(os.path.join(d, "tp2"), os.path.join(d, "tp1"), target_tp=1, target_dp=4, log=quiet)
    next_port()
    init_parallel(1)
    collectives.barrier()
    destroy_parallel()
    world(2, "tp2", os.path.join(d, "tp2"), resume=True)
    world(1, "tp1", os.path.join(d, "tp1"), resume=True)
    return out


@pytest.fixture(scope="module")
def engine_runs(models):
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(models["seed"] + 5))
    world = run_world(_engine_world, 4, models["d"], tokens, models["seed"], timeout=500)
    return {"tokens": tokens, "world": world}


def test_our_model_from_a_from_hf_checkpoint_equals_transformers(models, engine_runs):
    ref = hf_logits(os.path.join(models["d"], "llama"), engine_runs["tokens"])
    for rank_out in engine_runs["world"]:
        for tp in TPS:
            o = rank_out[f"from_hf_tp{tp}"]
            close(o["logits"], ref)
            assert o["shapes_ok"] and o["step"] == 0, tp


def test_to_fp32_and_reshard_tp4_tp2_tp1_are_exact_for_swiglu(models, engine_runs):
    world = engine_runs["world"]
    trained = [w["trained"] for w in world]
    ref = {which: assemble(trained, which) for which in ("master", "exp_avg")}
    got = safetensors_torch.load_file(os.path.join(models["d"], "trained_fp32.safetensors"))
    assert set(got) == set(ref["master"])
    for k, t in ref["master"].items():
        assert torch.equal(got[k], t), k
    for name in ("tp2", "tp1"):
        outs = [w[name] for w in world]
        for which in ("master", "exp_avg"):
            back = assemble(outs, which)
            for k, t in ref[which].items():
                assert torch.equal(back[k], t), (name, which, k)
        for o in outs:
            assert o["resharded_from"] is None and o["step"] == STEPS, (name, o["resharded_from"], o["step"])
            torch.testing.assert_close(o["logits"], trained[0]["logits"], rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- the user flow

def _our_logits(rank, ck, tokens):
    from zo_megatron.checkpoint.reader import CheckpointReader
    from zo_megatron.model import build_gpt_model
    from zo_megatron.model.sharding import load_full_params
    from zo_megatron.parallel import init_parallel

    reader = CheckpointReader(ck)
    cfg = _our_config(reader.model_meta)
    ps = init_parallel(1)
    model = build_gpt_model(cfg, 0, 1, 1)
    load_full_params(model, reader.read_weights(), 0, 1, cfg.vocab_size)
    with torch.no_grad():
        return model(tokens).float()[..., :cfg.vocab_size].clone(), ps.tp_size


@pytest.mark.slow
def test_user_flow_llama_from_hf_trains_under_torchrun_at_tp2_then_to_hf_generates(tmp_path):
    """from-hf a tiny Llama with its HF tokenizer; pretrain_gpt.py continues it for 5 iterations under
    torchrun at TP2 with --zero-offload, --tokenizer-type HuggingFaceTokenizer and the flags from-hf
    printed; to-hf of the result generates in transformers, and its logits equal our model's."""
    import subprocess

    from tests.test_pretrain import _clean_env, _rows, SCRIPT, TORCHRUN
    from zo_megatron.checkpoint import convert
    from zo_megatron.checkpoint.arch import job_flags
    from zo_megatron.checkpoint.reader import CheckpointReader
    from zo_megatron.data import extract_corpus
    from zo_megatron.data.preprocess import preprocess
    from zo_megatron.data.tokenizer import build_tokenizer

    seed = fresh_seed("convert llama user flow")
    cfg = transformers.LlamaConfig(vocab_size=HF_VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=0, eos_token_id=1,
                                   rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
    torch.manual_seed(seed)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "hf_in")
    make_hf_tokenizer(tmp_path / "hf_in")
    lines = []
    convert.from_hf(str(tmp_path / "hf_in"), str(tmp_path / "ck_in"), tensor_parallel=2, log=lines.append)
    (flag_line,) = [ln for ln in lines if ln.startswith("  model flags: ")]
    meta = CheckpointReader(str(tmp_path / "ck_in")).model_meta
    assert flag_line.removeprefix("  model flags: ") == job_flags(meta, hf_tokenizer=True)
    assert flag_line.endswith(f" --vocab-size {HF_VOCAB_SIZE}")
    tok_dir = str(tmp_path / "ck_in" / "iter_0000000" / "tokenizer")
    hf_tok = build_tokenizer(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=tok_dir)
    prefix = preprocess(extract_corpus(str(tmp_path / "txt"), limit=4), str(tmp_path / "data"), progress=False,
                        tokenizer=hf_tok).prefixes["text"]
    argv = [*flag_line.removeprefix("  model flags: ").split(), "--seq-length", "64", "--micro-batch-size", "2",
            "--global-batch-size", "2", "--lr", "3e-3", "--lr-warmup-iters", "0", "--train-iters", "5",
            "--log-interval", "1", "--eval-iters", "0", "--no-progress-bar", "--split", "100,0,0", "--fp32",
            "--skip-memory-check", "--zero-offload", "--tensor-model-parallel-size", "2", "--seed", str(seed),
            "--data-path", prefix, "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", tok_dir,
            "--load", str(tmp_path / "ck_in"), "--save", str(tmp_path / "out"),
            "--log-jsonl", str(tmp_path / "log.jsonl")]
    r = subprocess.run([TORCHRUN, "--standalone", "--nproc-per-node=2", SCRIPT, *argv], env=_clean_env(tmp_path),
                       capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "loaded weights only" in r.stdout and "fresh optimizer state, iteration 0" in r.stdout
    losses = {row["iteration"]: row["loss"] for row in _rows(tmp_path / "log.jsonl", "train")}
    assert sorted(losses) == [1, 2, 3, 4, 5] and all(torch.isfinite(torch.tensor(v)) for v in losses.values())
    assert losses[5] < losses[1], losses
    convert.to_hf(str(tmp_path / "out"), str(tmp_path / "hf_out"), log=quiet)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf_out", local_files_only=True,
                                                           attn_implementation="eager").eval()
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf_out", local_files_only=True)
    assert type(hf).__name__ == "LlamaForCausalLM" and len(tok) == HF_VOCAB_SIZE
    prompt = tok("The state of the union is", return_tensors="pt")
    gen = hf.generate(**prompt, max_new_tokens=8, do_sample=False, pad_token_id=tok.eos_token_id)
    assert gen.shape[1] == prompt["input_ids"].shape[1] + 8 and isinstance(tok.decode(gen[0]), str)
    ours, _ = run_world(_our_logits, 1, str(tmp_path / "out"), gen, timeout=120)[0]
    with torch.no_grad():
        close(ours, hf(gen).logits)


def test_to_megatron_warns_that_megatron_lm_drops_the_rope_scaling_factor(models, tmp_path):
    """Megatron-LM's model builders pass --use-rope-scaling to GPTModel but not --rope-scaling-factor (so
    megatron-core's default 8 applies there): a model with another factor (the llama config's 4) says so."""
    from zo_megatron.checkpoint import convert

    lines = []
    convert.to_megatron(os.path.join(models["d"], "llama_ck_tp1"), str(tmp_path / "m"), log=lines.append)
    warned = [ln for ln in lines if "rope_scaling_factor" in ln or "--rope-scaling-factor" in ln]
    assert len(warned) == 1 and "factor is 4;" in warned[0] and "would build factor 8" in warned[0], lines
    lines.clear()
    convert.to_megatron(os.path.join(models["d"], "qwen2_ck_tp1"), str(tmp_path / "q"), log=lines.append)
    assert not [ln for ln in lines if "--rope-scaling-factor" in ln], lines      # no scaling: no warning
