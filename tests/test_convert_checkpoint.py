"""tools/convert_checkpoint.py against the libraries that read its outputs.

Gloo worlds (4 ranks: TP4 x DP1, TP2 x DP2, TP1 x DP4; 2 ranks: TP2 x DP1, TP1 x DP2; 1 rank) train an
odd-shaped GPT with the offload engine (GPT-2's real vocabulary, 50257 tokens, so the vocab is
padded differently at each TP), save a checkpoint, and keep what the live engine holds: its fp32
master fragments and the full logits on fixed tokens. Inside the world rank 0 converts; every rank
then loads its Megatron-LM file into a fresh megatron-core model strictly. The parent checks:
  - to-fp32 equals the live fp32 master bit for bit (assembled independently from the fragments);
  - to-hf loads in transformers and its logits equal ours (fp32, relative 1e-5, every element);
  - to-megatron -> from-megatron is bit-exact, and megatron-core loads the files strictly with the
    same logits;
  - from-hf of a model transformers built itself (random weights) gives our forward == HF's at
    TP 1, 2, 4, and HF -> ours -> HF is bit-exact;
  - reshard TP2 x DP2 -> TP1 x DP2 offline loads at the target as a same-layout resume, bit-exact.
"""
import json
import math
import os

import pytest
import torch

from tests.harness import built_once, next_port, run_world
from tests.seeds import fresh_seed
from tests.test_checkpoint_resume import _losses, _world

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

LAYERS, HIDDEN, HEADS, FFN, POS, VOCAB = 2, 48, 4, 176, 24, 50257
META = dict(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, ffn_hidden_size=FFN,
            max_position_embeddings=POS, vocab_size=VOCAB)
SEQ, MICRO, STEPS = 12, 2, 2


def _hf_config():
    return transformers.GPT2Config(vocab_size=VOCAB, n_positions=POS, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS,
                                   n_inner=FFN, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                   activation_function="gelu_new", layer_norm_epsilon=1e-5)


def _tokens(seed):
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(seed))


def _engine(tp, seed):
    from zo_megatron.model import GPTConfig, build_gpt_model
    from zo_megatron.offload.engine import AdamConfig, ZeroOffloadEngine
    from zo_megatron.parallel import init_parallel

    ps = init_parallel(tp, seed=seed, num_attention_heads=HEADS, hidden_size=HIDDEN)
    cfg = GPTConfig(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, vocab_size=VOCAB,
                    max_position_embeddings=POS, ffn_hidden_size=FFN, precision="fp32")
    model = build_gpt_model(cfg, ps.tp_rank, ps.tp_size, seed)
    engine = ZeroOffloadEngine(model, precision="fp32", adam=AdamConfig(lr=1e-2, weight_decay=0.1), clip_grad=1.0,
                               bucket_size=20000, dp_group=ps.dp_group, tp_rank=ps.tp_rank, device=ps.device)
    return ps, model, engine


def _full_logits(model, ps, tokens):
    from zo_megatron.parallel import collectives

    with torch.no_grad():
        local = model(tokens).float()
    full = torch.cat(collectives.all_gather_list(local.contiguous(), ps.tp_group), dim=-1) if ps.tp_size > 1 else local
    return full[..., :VOCAB].clone()


def _engine_state(model, engine, ps):
    """This rank's fp32 master and first-moment fragments as the live engine holds them."""
    from zo_megatron.model.sharding import model_shard_infos

    return {"tp_rank": ps.tp_rank,
            "fragments": [(n, start, views["master"].clone(), views["exp_avg"].clone())
                          for n, _, start, _, views in engine.host_state_views()],
            "infos": {n: (i.tp_axis, i.local_shape, i.full_shape)
                      for n, i in model_shard_infos(model, ps.tp_rank, ps.tp_size, VOCAB).items()}}


def _layout(rank, tp, seed, d):
    """Train, save, convert (rank 0), load the Megatron files back (every rank); what the live
    engine held comes back for the parent to compare."""
    from zo_megatron.checkpoint import LoadOptions, load_checkpoint, megatron_lm, save_checkpoint
    from zo_megatron.checkpoint import convert
    from zo_megatron.model import GPTConfig, build_gpt_model
    from zo_megatron.parallel import collectives, destroy_parallel

    ps, model, engine = _engine(tp, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    for _ in range(STEPS):
        tokens = torch.randint(0, VOCAB, (MICRO * ps.dp_size, SEQ), generator=gen)
        mine = tokens[ps.dp_rank * MICRO:(ps.dp_rank + 1) * MICRO]
        engine.backward(model.loss(mine, torch.roll(mine, -1, 1)))
        engine.step()
    name = f"tp{tp}dp{ps.dp_size}"
    ck, log = os.path.join(d, name, "ck"), []
    save_checkpoint(ck, STEPS, ps=ps, model=model, optimizer=engine, vocab_size=VOCAB,
                    train_state={"consumed_samples": 0, "consumed_valid_samples": 0, "opt_param_scheduler": None},
                    model_meta=META, args={"make_vocab_size_divisible_by": 128, "hidden_dropout": 0.0})
    tokens = _tokens(seed + 2)
    out = {"tp": tp, "dp": ps.dp_size, "logits": _full_logits(model, ps, tokens), **_engine_state(model, engine, ps)}
    hf_src, ck_hf = os.path.join(d, name, "hf_src"), os.path.join(d, name, "ck_from_hf")
    if rank == 0:
        p = os.path.join(d, name)
        convert.to_fp32(ck, os.path.join(p, "fp32"), log=log.append)
        convert.to_fp32(ck, os.path.join(p, "fp32_sharded"), max_shard_size="1MB", log=log.append)
        convert.to_hf(ck, os.path.join(p, "hf"), log=log.append)
        convert.to_megatron(ck, os.path.join(p, "megatron"), log=log.append)
        convert.from_megatron(os.path.join(p, "megatron"), os.path.join(p, "ck_from_megatron"), tensor_parallel=tp,
                              log=log.append)
        if (tp, ps.dp_size) == (2, 2):
            convert.reshard(ck, os.path.join(d, "resharded_t1d2"), target_tp=1, target_dp=2, log=log.append)
        # a model transformers builds itself, every weight random (LayerNorms and biases too)
        torch.manual_seed(seed + 3)
        hf = transformers.GPT2LMHeadModel(_hf_config())
        with torch.no_grad():
            for t in hf.parameters():
                t.normal_(0.0, 0.05)
        hf.save_pretrained(hf_src)
        convert.from_hf(hf_src, ck_hf, tensor_parallel=tp, log=log.append)
        convert.to_hf(ck_hf, os.path.join(p, "hf_back"), log=log.append)
        out["log"] = log
    collectives.barrier()
    # Megatron-LM's file for this TP rank, loaded strictly by megatron-core's GPTModel
    sd = megatron_lm.safe_load(os.path.join(d, name, "megatron", f"iter_{STEPS:07d}", f"mp_rank_{ps.tp_rank:02d}",
                                            megatron_lm.FILE))
    fresh = build_gpt_model(GPTConfig(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS,
                                      vocab_size=VOCAB, max_position_embeddings=POS, ffn_hidden_size=FFN,
                                      precision="fp32"), ps.tp_rank, ps.tp_size, seed + 9)
    fresh.gpt.load_state_dict(sd["model"], strict=True)
    out["megatron_args"] = vars(sd["args"])
    out["megatron_logits"] = _full_logits(fresh, ps, tokens)
    engine.close()
    # the from-hf checkpoint through the job's loader (weights only: a fresh optimizer, iteration 0)
    from zo_megatron.offload.engine import AdamConfig, ZeroOffloadEngine

    engine2 = ZeroOffloadEngine(fresh, precision="fp32", adam=AdamConfig(lr=1e-3), bucket_size=20000,
                                dp_group=ps.dp_group, tp_rank=ps.tp_rank, device=ps.device)
    res = load_checkpoint(ck_hf, ps=ps, model=fresh, optimizer=engine2, vocab_size=VOCAB, model_meta=META,
                          schedule={}, opts=LoadOptions())
    out["from_hf_logits"] = _full_logits(fresh, ps, tokens)
    out["from_hf_resumed"] = (res.iteration, res.converted_from is not None, engine2.step_count)
    engine2.close()
    destroy_parallel()
    return out


def _resharded_load(rank, seed, d):
    """The offline TP1 x DP2 reshard, loaded at TP1 x DP2 with its optimizer state."""
    from zo_megatron.checkpoint import LoadOptions, load_checkpoint

    ps, model, engine = _engine(1, seed + 5)
    res = load_checkpoint(os.path.join(d, "resharded_t1d2"), ps=ps, model=model, optimizer=engine, vocab_size=VOCAB,
                          model_meta=META, schedule={}, opts=LoadOptions(override_opt_param_scheduler=True))
    out = {"resharded_from": res.resharded_from, "rng": res.rng_restored, "step": engine.step_count,
           **_engine_state(model, engine, ps)}
    engine.close()
    return out


def _worker(rank, layouts, seed, d):
    out = []
    for tp in layouts:                          # each layout its own rendezvous
        next_port()
        out.append(_layout(rank, tp, seed, d))
    if layouts == [2, 1]:                       # the 2-rank world, after the 4-rank one wrote the reshard
        next_port()
        out.append(_resharded_load(rank, seed, d))
    return out


def _assemble(outs, which):
    """Full unpadded tensors from every rank's flat fragments (independent of the checkpoint code)."""
    locals_: dict[tuple[str, int], torch.Tensor] = {}
    infos = outs[0]["infos"]
    for o in outs:
        for name, start, master, exp_avg in o["fragments"]:
            axis, local_shape, _ = o["infos"][name]
            buf = locals_.setdefault((name, o["tp_rank"]), torch.full((math.prod(local_shape),), float("nan")))
            src = master if which == "master" else exp_avg
            buf[start:start + src.numel()] = src
    tps = 1 + max(o["tp_rank"] for o in outs)
    full = {}
    for name, (axis, local_shape, full_shape) in infos.items():
        parts = [locals_[(name, r)].view(local_shape) for r in range(tps)] if axis is not None else \
            [locals_[(name, 0)].view(local_shape)]
        t = torch.cat(parts, dim=axis) if axis is not None else parts[0]
        full[name] = t.narrow(axis, 0, full_shape[axis]) if axis is not None else t
        assert not torch.isnan(full[name]).any(), name
    return full


def _close(ours, ref):
    scale = ref.abs().max().item()
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5 * scale)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    return built_once(tmp_path_factory, "convert_checkpoint", _convert_all)[0]    # once for both xdist workers


def _convert_all(directory):
    seed = fresh_seed("convert_checkpoint")
    d = str(directory)
    worlds = [(4, [4, 2, 1]), (2, [2, 1]), (1, [1])]       # the 4-rank world writes the reshard first
    res, reshard_load = {}, None
    for n, layouts in worlds:
        world = run_world(_worker, n, layouts, seed, d, timeout=400)
        for i in range(len(layouts)):           # layouts: {name: per-rank results}
            o = [w[i] for w in world]
            res[f"tp{o[0]['tp']}dp{o[0]['dp']}"] = o
        if n == 2:
            reshard_load = [w[len(layouts)] for w in world]
    return dict(seed=seed, d=d, layouts=res, reshard_load=reshard_load)


def test_tp_table_of_the_offline_tools_is_the_model_s_own_split(converted):
    from zo_megatron.checkpoint.tp_layout import tp_axis

    for name, outs in converted["layouts"].items():
        for n, (axis, _, _) in outs[0]["infos"].items():
            assert tp_axis(n) == axis, (name, n)


def test_to_fp32_is_the_live_master_bit_for_bit_at_every_layout(converted):
    from safetensors import safe_open

    for name, outs in converted["layouts"].items():
        ref = _assemble(outs, "master")
        got = safetensors_torch.load_file(os.path.join(converted["d"], name, "fp32", "model.safetensors"))
        assert set(got) == set(ref), name
        for k in ref:
            assert got[k].dtype == torch.float32 and torch.equal(got[k], ref[k]), (name, k)
        index = json.load(open(os.path.join(converted["d"], name, "fp32_sharded", "model.safetensors.index.json")))
        files = sorted(set(index["weight_map"].values()))
        assert len(files) > 1 and set(index["weight_map"]) == set(ref)
        for f in files:
            with safe_open(os.path.join(converted["d"], name, "fp32_sharded", f), "pt") as sf:
                for k in sf.keys():
                    assert torch.equal(sf.get_tensor(k), ref[k]), (name, f, k)


def test_to_hf_loads_in_transformers_with_our_logits_and_tokenizer(converted):
    tokens = _tokens(converted["seed"] + 2)
    for name, outs in converted["layouts"].items():
        path = os.path.join(converted["d"], name, "hf")
        assert {"config.json", "generation_config.json", "vocab.json", "merges.txt", "tokenizer_config.json"} <= \
            set(os.listdir(path)), name
        hf = transformers.AutoModelForCausalLM.from_pretrained(path, local_files_only=True).eval()
        assert type(hf).__name__ == "GPT2LMHeadModel"
        with torch.no_grad():
            _close(hf(tokens).logits, outs[0]["logits"])
        tok = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
        assert len(tok) == VOCAB and tok("Hello world")["input_ids"] == [15496, 995]


def test_megatron_round_trip_is_bit_exact_and_megatron_core_loads_the_files_strictly(converted):
    from zo_megatron.checkpoint.reader import CheckpointReader

    for name, outs in converted["layouts"].items():
        ref = _assemble(outs, "master")
        back = CheckpointReader(os.path.join(converted["d"], name, "ck_from_megatron")).read_weights()
        assert set(back) == set(ref)
        for k in ref:
            assert torch.equal(back[k], ref[k]), (name, k)
        for o in outs:
            assert torch.equal(o["megatron_logits"], o["logits"]), name       # strict load, same forward
            args = o["megatron_args"]
            assert args["tensor_model_parallel_size"] == o["tp"] and args["num_layers"] == LAYERS
            assert args["padded_vocab_size"] == -(-VOCAB // (128 * o["tp"])) * 128 * o["tp"]
            for field in ("hidden_size", "num_attention_heads", "max_position_embeddings",
                          "make_vocab_size_divisible_by", "tokenizer_type", "pipeline_model_parallel_size"):
                assert field in args, field
        tracker = open(os.path.join(converted["d"], name, "megatron", "latest_checkpointed_iteration.txt")).read()
        assert tracker.strip() == str(STEPS)


def test_from_hf_forward_equals_hf_and_hf_ours_hf_is_bit_exact(converted):
    tokens = _tokens(converted["seed"] + 2)
    for name, outs in converted["layouts"].items():
        src = os.path.join(converted["d"], name, "hf_src")
        hf = transformers.GPT2LMHeadModel.from_pretrained(src, local_files_only=True).eval()
        with torch.no_grad():
            ref = hf(tokens).logits
        for o in outs:
            _close(o["from_hf_logits"], ref)
            assert o["from_hf_resumed"] == (0, True, 0), o["from_hf_resumed"]
        a = safetensors_torch.load_file(os.path.join(src, "model.safetensors"))
        b = safetensors_torch.load_file(os.path.join(converted["d"], name, "hf_back", "model.safetensors"))
        assert set(a) == set(b), set(a) ^ set(b)
        for k in a:
            assert torch.equal(a[k], b[k]), (name, k)


def test_offline_reshard_loads_at_the_target_as_a_same_layout_resume(converted):
    src = converted["layouts"]["tp2dp2"]
    for which in ("master", "exp_avg"):
        ref = _assemble(src, which)
        got = _assemble(converted["reshard_load"], which)
        for k in ref:
            assert torch.equal(got[k], ref[k]), (which, k)
    for o in converted["reshard_load"]:
        assert o["resharded_from"] is None and o["rng"] == "shared streams" and o["step"] == STEPS


def test_user_flow_hf_in_continue_pretraining_on_both_layouts_then_hf_out_generates(tmp_path):
    """from-hf at TP2, then the real job trains 5 iterations on the demo corpus at TP2 x DP1 and
    TP1 x DP2 (loss finite and falling); to-hf of the result generates in transformers and its
    logits equal our model's on the same tokens."""
    from zo_megatron.checkpoint import convert

    seed = fresh_seed("convert user flow")
    torch.manual_seed(seed)
    shape = dict(vocab_size=VOCAB, n_positions=64, n_embd=64, n_layer=2, n_head=4, resid_pdrop=0.0,
                 embd_pdrop=0.0, attn_pdrop=0.0)
    transformers.GPT2LMHeadModel(transformers.GPT2Config(**shape)).save_pretrained(tmp_path / "hf_in")
    convert.from_hf(str(tmp_path / "hf_in"), str(tmp_path / "ck_in"), tensor_parallel=2, log=lambda s: None)
    flags = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
             "--max-position-embeddings", "64", "--micro-batch-size", "2", "--global-batch-size", "4",
             "--lr", "3e-3", "--lr-warmup-iters", "0", "--train-iters", "5", "--log-interval", "1",
             "--no-progress-bar", "--skip-memory-check", "--zero-offload", "--fp32", "--eval-iters", "0",
             "--seed", str(seed), "--load", str(tmp_path / "ck_in")]
    out = _world(2, [[*flags, "--tensor-parallel", "2", "--save", str(tmp_path / "out_tp2"),
                      "--log-jsonl", str(tmp_path / "tp2.jsonl")],
                     [*flags, "--tensor-parallel", "1", "--save", str(tmp_path / "out_dp2"),
                      "--log-jsonl", str(tmp_path / "dp2.jsonl")]], tmp_path)
    for o, log in zip(out, ("tp2", "dp2")):
        assert o.get("rc") == 0, o
        assert "loaded weights only" in o["stdout"] and "fresh optimizer state, iteration 0" in o["stdout"]
        losses = _losses(str(tmp_path / f"{log}.jsonl"))
        assert sorted(losses) == [1, 2, 3, 4, 5] and all(math.isfinite(v) for v in losses.values()), losses
        assert losses[5] < losses[1], losses
    convert.to_hf(str(tmp_path / "out_tp2"), str(tmp_path / "hf_out"), log=lambda s: None)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf_out", local_files_only=True).eval()
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf_out", local_files_only=True)
    prompt = tok("The state of the union is", return_tensors="pt")
    gen = hf.generate(**prompt, max_new_tokens=8, do_sample=False, pad_token_id=tok.eos_token_id)
    assert gen.shape[1] == prompt["input_ids"].shape[1] + 8
    assert isinstance(tok.decode(gen[0]), str)
    ours = run_world(_our_logits, 1, str(tmp_path / "out_tp2"), gen, timeout=120)[0]
    with torch.no_grad():
        _close(hf(gen).logits, ours)


def _our_logits(rank, ck, tokens):
    from zo_megatron.checkpoint.reader import CheckpointReader
    from zo_megatron.model import GPTConfig, build_gpt_model
    from zo_megatron.model.sharding import load_full_params
    from zo_megatron.parallel import init_parallel

    ps = init_parallel(1, num_attention_heads=4, hidden_size=64)
    model = build_gpt_model(GPTConfig(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=VOCAB,
                                      max_position_embeddings=64, precision="fp32"), 0, 1, 1)
    load_full_params(model, CheckpointReader(ck).read_weights(), 0, 1, VOCAB)
    return _full_logits(model, ps, tokens)


class _Payload:
    """A pickled object whose unpickling would create a file: it must never run."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _bad_inputs(d, ck):
    """(case, argv, what the error line must say); `d` is a scratch directory, `ck` a good checkpoint."""
    import argparse
    import shutil

    def copy(name):
        dst = os.path.join(d, name)
        shutil.copytree(ck, dst)
        return dst, os.path.join(dst, f"iter_{STEPS:07d}")

    missing, it = copy("missing")
    os.remove(os.path.join(it, "__1_0.distcp"))
    truncated, it = copy("truncated")
    with open(os.path.join(it, "__0_0.distcp"), "r+b") as f:
        f.truncate(os.path.getsize(f.name) - 7)
    flipped, it = copy("flipped")
    with open(os.path.join(it, "__0_0.distcp"), "r+b") as f:
        f.seek(os.path.getsize(f.name) // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    hf_dirs = {}
    for name, change in (("relu", dict(activation_function="relu")), ("untied", dict(tie_word_embeddings=False))):
        cfg = _hf_config()
        for k, v in change.items():
            setattr(cfg, k, v)
        hf_dirs[name] = os.path.join(d, f"hf_{name}")
        transformers.GPT2LMHeadModel(cfg).save_pretrained(hf_dirs[name])
    neox = os.path.join(d, "hf_neox")
    os.makedirs(neox)
    json.dump({"model_type": "gpt_neox", "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2,
               "intermediate_size": 128, "vocab_size": 100}, open(os.path.join(neox, "config.json"), "w"))
    small_vocab_hf = os.path.join(d, "hf_small_vocab")
    cfg = _hf_config()
    cfg.vocab_size = 1000
    transformers.GPT2LMHeadModel(cfg).save_pretrained(small_vocab_hf)
    from zo_megatron.checkpoint import convert

    custom_vocab = os.path.join(d, "ck_custom_vocab")
    convert.from_hf(small_vocab_hf, custom_vocab, tensor_parallel=1, log=lambda s: None)
    planted = os.path.join(d, "megatron_planted")
    os.makedirs(os.path.join(planted, "iter_0000002", "mp_rank_00"))
    open(os.path.join(planted, "latest_checkpointed_iteration.txt"), "w").write("2")
    torch.save({"args": argparse.Namespace(num_layers=1), "model": {}, "x": _Payload(os.path.join(d, "PWNED"))},
               os.path.join(planted, "iter_0000002", "mp_rank_00", "model_optim_rng.pt"))
    nonempty = os.path.join(d, "nonempty")
    os.makedirs(nonempty)
    open(os.path.join(nonempty, "keep.txt"), "w").write("mine")
    out = os.path.join(d, "out")
    return [
        ("missing shard", ["to-fp32", "--load", missing, "--output", out], "is missing"),
        ("truncated shard", ["to-hf", "--load", truncated, "--output", out], "truncated"),
        ("checksum mismatch", ["reshard", "--load", flipped, "--output", out, "--target-tensor-parallel-size", "1"],
         "checksum mismatch"),
        ("no checkpoint", ["to-megatron", "--load", os.path.join(d, "nowhere"), "--output", out], "no such directory"),
        ("unknown implementation", ["to-megatron", "--load", ck, "--output", out, "--transformer-impl", "te"],
         "argument --transformer-impl: invalid choice: 'te'"),
        ("relu GPT-2", ["from-hf", "--input", hf_dirs["relu"], "--output", out, "--tensor-parallel", "1"],
         "activation_function='relu'"),
        ("untied GPT-2", ["from-hf", "--input", hf_dirs["untied"], "--output", out, "--tensor-parallel", "1"],
         "tie_word_embeddings"),
        ("GPT-NeoX", ["from-hf", "--input", neox, "--output", out, "--tensor-parallel", "1"],
         "model_type='gpt_neox' is not supported; supported architectures: GPT2LMHeadModel, LlamaForCausalLM"),
        ("TP not dividing heads", ["reshard", "--load", ck, "--output", out, "--target-tensor-parallel-size", "3"],
         "does not divide"),
        ("custom vocab, no tokenizer", ["to-hf", "--load", custom_vocab, "--output", out], "--vocab-file"),
        ("planted pickle", ["from-megatron", "--input", planted, "--output", out, "--tensor-parallel", "1"],
         ".open, which is not plain data"),
        ("output not empty", ["to-fp32", "--load", ck, "--output", nonempty], "--force"),
        ("bad shard size", ["to-fp32", "--load", ck, "--output", out, "--max-shard-size", "lots"], "--max-shard-size"),
        ("no subcommand", [], "required"),
        ("missing flag", ["from-hf", "--input", hf_dirs["relu"], "--output", out], "--tensor-parallel"),
    ]


def test_wrong_input_is_one_error_line_exit_2_and_nothing_written(converted, tmp_path, capsys):
    import importlib.util

    spec = importlib.util.spec_from_file_location("convert_checkpoint_cli", os.path.join(
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools", "convert_checkpoint.py"))
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    ck = os.path.join(converted["d"], "tp2dp1", "ck")
    cases = _bad_inputs(str(tmp_path), ck)
    capsys.readouterr()
    for case, argv, says in cases:
        before = sorted(os.listdir(tmp_path))
        rc = cli.main(argv)
        err = capsys.readouterr().err
        lines = [ln for ln in err.splitlines() if ln.strip() and "%" not in ln]
        assert rc == 2, (case, rc, err)
        assert len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0], (case, err)
        assert "Traceback" not in err, case
        assert sorted(os.listdir(tmp_path)) == before, (case, set(os.listdir(tmp_path)) ^ set(before))
    assert not os.path.exists(tmp_path / "PWNED")
    assert open(tmp_path / "nonempty" / "keep.txt").read() == "mine"
    # --force replaces it, atomically
    assert cli.main(["to-fp32", "--load", ck, "--output", str(tmp_path / "nonempty"), "--force"]) == 0
    assert os.listdir(tmp_path / "nonempty") == ["model.safetensors"]


def test_a_tensor_the_checkpoint_lacks_is_one_user_error_naming_it(converted):
    from zo_megatron.checkpoint.boxes import Box
    from zo_megatron.checkpoint.content import EXP_AVG, MODEL
    from zo_megatron.checkpoint.reader import CheckpointReader
    from zo_megatron.errors import UserError

    reader = CheckpointReader(os.path.join(converted["d"], "tp1dp1", "ck_from_hf"))   # weights only
    name = next(iter(reader.shapes))
    assert not reader.has_optimizer_state and reader.read_full([MODEL + name])[MODEL + name].shape == reader.shapes[name]
    for read in (lambda k: reader.read_full([MODEL + name, k]),
                 lambda k: reader.read_boxes([(k, Box((0,), (1,), 0))])):
        with pytest.raises(UserError, match=r"no tensor .*exp_avg.*weights-only checkpoints have no optimizer state"):
            read(EXP_AVG + name)


def test_an_interrupted_conversion_leaves_nothing(converted, tmp_path, monkeypatch):
    from zo_megatron.checkpoint import convert

    calls = []

    def dying_slice(t, box):
        calls.append(box)
        if len(calls) == 5:
            raise KeyboardInterrupt
        return convert_slice(t, box)

    convert_slice = convert._slice
    monkeypatch.setattr(convert, "_slice", dying_slice)
    with pytest.raises(KeyboardInterrupt):
        convert.reshard(os.path.join(converted["d"], "tp2dp1", "ck"), str(tmp_path / "out"), target_tp=1,
                        log=lambda s: None)
    assert len(calls) == 5 and os.listdir(tmp_path) == []
