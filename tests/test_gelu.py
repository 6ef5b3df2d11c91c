"""The GELU of a non-gated MLP follows Megatron-LM's rule (docs/megatron_compat.md, docs/models.md).

megatron-core's GPT (core_v0.16.1 mlp.py) computes its fused bias-GELU -- the tanh approximation --
where the linears have biases and --bias-gelu-fusion is on (Megatron-LM's default), and torch's erf
F.gelu otherwise (--no-bias-gelu-fusion, --disable-bias-linear); --openai-gelu is read by Megatron-LM's
legacy models only. The references are independent of zo_megatron.model:
  - megatron-core's own GPTModel, built from Megatron-LM's args as core_transformer_config_from_args
    and validate_args build it (tests/megatron_reference.py), running its own fused kernel, with the
    same random weights as ours: every logit equal (fp32, 2e-6 of the largest); the other GELU is shown to
    be told apart by the same check;
  - transformers' GPT2LMHeadModel with activation_function 'gelu_new' (tanh) and 'gelu' (erf):
    from-hf gives our forward == HF's, to-hf writes the same activation, to-megatron's files give
    megatron-core's model the same logits, from-megatron gives the weights and the GELU back;
  - a checkpoint from before the GELU was recorded reads as the tanh GELU: resuming a bias-free GELU
    one is refused in one line naming both GELUs, and --use-checkpoint-args resumes it.
"""
import argparse
import json
import os

import pytest
import torch

from tests.harness import run_world
from tests.seeds import fresh_seed

LAYERS, HIDDEN, HEADS, FFN, POS, VOCAB, SEQ = 2, 32, 4, 72, 16, 96, 10
MODEL = ["--num-layers", str(LAYERS), "--hidden-size", str(HIDDEN), "--num-attention-heads", str(HEADS),
         "--ffn-hidden-size", str(FFN), "--seq-length", str(SEQ), "--max-position-embeddings", str(POS),
         "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB - 1), "--lr", "1e-3",
         "--lr-decay-iters", "6"]
SHAPE = [*MODEL, "--train-iters", "1"]
# launch lines (besides the shape) -> the GELU Megatron-LM's megatron-core GPT computes for them
LAUNCHES = {"gpt3 (biases, fused)": ([], "tanh"),
            "--no-bias-gelu-fusion": (["--no-bias-gelu-fusion"], "none"),
            "--disable-bias-linear": (["--disable-bias-linear"], "none"),
            "--openai-gelu": (["--openai-gelu"], "tanh"),
            "--openai-gelu --disable-bias-linear": (["--openai-gelu", "--disable-bias-linear"], "none")}


def megatron_lm_args(flags: list[str]) -> argparse.Namespace:
    """What Megatron-LM's parser and validate_args make of the launch's model flags (the ones that
    matter here; core_v0.16.1): add_bias_linear (and add_qkv_bias with it), bias_gelu_fusion off
    without biases, openai_gelu as typed."""
    bias = "--disable-bias-linear" not in flags
    return argparse.Namespace(
        num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, num_query_groups=HEADS, kv_channels=None,
        ffn_hidden_size=FFN, swiglu=False, normalization="LayerNorm", norm_epsilon=1e-5, add_bias_linear=bias,
        add_qkv_bias=bias, bias_gelu_fusion=bias and "--no-bias-gelu-fusion" not in flags,
        openai_gelu="--openai-gelu" in flags, tensor_model_parallel_size=1)


def _logits(model, tokens, megatron_core: bool, vocab: int = VOCAB):
    b, s = tokens.shape
    with torch.no_grad():
        if megatron_core:
            mask = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1)[None, None]
            return model(tokens, torch.arange(s).expand(b, s), mask)[..., :vocab].float()
        return model(tokens)[..., :vocab].float()


def megatron_core_and_ours(seed: int, launches: dict, field: str, values: tuple) -> dict:
    """For each launch (name -> (Megatron-LM's args, the job's flags)): megatron-core's GPTModel from the
    args (its own init, then every weight redrawn wide enough that the MLP's inputs reach where its
    activations differ) and our model from the job's flags with the same weights, once per value of the
    architecture `field`: {"arch": the flags' fields, "megatron_core": logits, "ours": {value: logits}}.
    Runs in a rank (a process group)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from tests.megatron_reference import megatron_core_config
    from zo_megatron.model import GPTConfig, build_gpt_model
    from zo_megatron.parallel import init_parallel
    from zo_megatron.training.arguments import parse_args
    from zo_megatron.training.model_flags import architecture_kwargs

    init_parallel(1, seed=seed, num_attention_heads=HEADS, hidden_size=HIDDEN)
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(seed))
    out = {}
    for name, (margs, flags) in launches.items():
        ref = GPTModel(config=megatron_core_config(margs, initialise=True), vocab_size=128,
                       transformer_layer_spec=get_gpt_layer_local_spec(normalization="LayerNorm"),
                       max_sequence_length=POS, position_embedding_type="learned_absolute",
                       share_embeddings_and_output_weights=True, parallel_output=True).eval()
        gen = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for p in ref.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.4)
        arch = architecture_kwargs(parse_args(SHAPE + flags))
        ours = {}
        for value in values:
            model = build_gpt_model(GPTConfig(**{**arch, field: value}, vocab_size=VOCAB, precision="fp32"),
                                    0, 1, seed).eval()
            model.gpt.load_state_dict(ref.state_dict(), strict=True)
            ours[value] = _logits(model, tokens, megatron_core=False)
        out[name] = {"arch": arch, "megatron_core": _logits(ref, tokens, megatron_core=True), "ours": ours}
    return out


def _launch_vs_megatron_core(rank, seed):
    """Each launch's megatron-core logits, ours with the tanh and with the erf GELU."""
    launches = {name: (megatron_lm_args(flags), flags) for name, (flags, _) in LAUNCHES.items()}
    return megatron_core_and_ours(seed, launches, "gelu_approximate", ("tanh", "none"))


def _relative(a, b) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def test_the_job_s_flags_compute_the_gelu_megatron_lm_computes_for_them():
    seed = fresh_seed("gelu launches")
    out = run_world(_launch_vs_megatron_core, 1, seed, timeout=400)[0]
    for name, (_, want) in LAUNCHES.items():
        o = out[name]
        assert o["arch"]["gelu_approximate"] == want, (name, o["arch"]["gelu_approximate"])
        other = "none" if want == "tanh" else "tanh"
        assert _relative(o["ours"][want], o["megatron_core"]) < 2e-6, (name, seed)
        # the check tells the two GELUs apart: the other one misses by 10x the tolerance and more
        # (measured 1.1e-4 to 2.1e-4 relative; the right one 2.7e-7 at most, the erf one bit for bit)
        assert _relative(o["ours"][other], o["megatron_core"]) > 2e-5, (name, seed)


# ---------------------------------------------------------------- Hugging Face GPT-2 and Megatron-LM's files

GPT2_VOCAB = 50257                      # GPT-2's own: to-hf then writes GPT-2's bundled tokenizer


def _hf_gpt2(directory, activation, seed):
    import transformers

    cfg = transformers.GPT2Config(vocab_size=GPT2_VOCAB, n_positions=POS, n_embd=HIDDEN, n_layer=LAYERS,
                                  n_head=HEADS,
                                  n_inner=FFN, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                  activation_function=activation, layer_norm_epsilon=1e-5)
    torch.manual_seed(seed)
    hf = transformers.GPT2LMHeadModel(cfg)
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0.0, 0.4)
    hf.save_pretrained(directory)
    return hf.eval()


def _converted_logits(rank, d, tokens):
    """Our model from each from-hf checkpoint, and megatron-core's GPTModel from each to-megatron file
    (built from its saved args: tests/megatron_reference.py)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from tests.megatron_reference import megatron_core_config
    from zo_megatron.checkpoint import megatron_lm
    from zo_megatron.checkpoint.reader import CheckpointReader
    from zo_megatron.model import GPTConfig, build_gpt_model
    from zo_megatron.model.sharding import load_full_params
    from zo_megatron.parallel import init_parallel

    init_parallel(1, num_attention_heads=HEADS, hidden_size=HIDDEN)
    out = {}
    for act in ("gelu_new", "gelu"):
        reader = CheckpointReader(os.path.join(d, act, "ck"))
        model = build_gpt_model(GPTConfig(**reader.model_meta, precision="fp32"), 0, 1, 1).eval()
        load_full_params(model, reader.read_weights(), 0, 1, GPT2_VOCAB)
        sd = megatron_lm.safe_load(os.path.join(d, act, "megatron", "release", "mp_rank_00", megatron_lm.FILE))
        args = sd["args"]
        ref = GPTModel(config=megatron_core_config(args), vocab_size=args.padded_vocab_size,
                       transformer_layer_spec=get_gpt_layer_local_spec(normalization="LayerNorm"),
                       max_sequence_length=POS, position_embedding_type="learned_absolute",
                       share_embeddings_and_output_weights=True, parallel_output=True).eval()
        ref.load_state_dict(sd["model"], strict=True)
        out[act] = {"ours": _logits(model, tokens, megatron_core=False, vocab=GPT2_VOCAB),
                    "megatron_core": _logits(ref, tokens, megatron_core=True, vocab=GPT2_VOCAB), "args": vars(args)}
    return out


@pytest.fixture(scope="module")
def gpt2_both_gelus(tmp_path_factory):
    from zo_megatron.checkpoint import convert

    d, seed, log = tmp_path_factory.mktemp("gelu"), fresh_seed("gelu gpt2"), []
    hf = {}
    for act in ("gelu_new", "gelu"):
        p = d / act
        hf[act] = _hf_gpt2(str(p / "hf"), act, seed)
        convert.from_hf(str(p / "hf"), str(p / "ck"), tensor_parallel=1, log=log.append)
        convert.to_hf(str(p / "ck"), str(p / "hf_back"), log=log.append)
        convert.to_megatron(str(p / "ck"), str(p / "megatron"), log=log.append)
        convert.from_megatron(str(p / "megatron"), str(p / "ck_from_megatron"), tensor_parallel=1, log=log.append)
    tokens = torch.randint(0, GPT2_VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(seed + 1))
    with torch.no_grad():
        ref = {act: hf[act](tokens).logits.float() for act in hf}
    return {"d": d, "seed": seed, "log": log, "hf": ref,
            "world": run_world(_converted_logits, 1, str(d), tokens, timeout=400)[0]}


def test_gpt2_s_two_gelus_convert_both_ways_with_transformers_and_megatron_core_logits(gpt2_both_gelus):
    from zo_megatron.checkpoint.reader import CheckpointReader

    g, d = gpt2_both_gelus, gpt2_both_gelus["d"]
    for act, gelu in (("gelu_new", "tanh"), ("gelu", "none")):
        meta = CheckpointReader(str(d / act / "ck")).model_meta
        assert meta["gelu_approximate"] == gelu, act
        o = g["world"][act]
        assert _relative(o["ours"], g["hf"][act]) < 2e-6, (act, g["seed"])
        assert _relative(o["megatron_core"], g["hf"][act]) < 2e-6, (act, g["seed"])
        # Megatron-LM's own defaults describe each: openai_gelu off, the bias-GELU fusion for the tanh one
        assert o["args"]["openai_gelu"] is False and o["args"]["bias_gelu_fusion"] == (gelu == "tanh"), act
        assert json.load(open(d / act / "hf_back" / "config.json"))["activation_function"] == \
            {"tanh": "gelu_new", "none": "gelu"}[gelu]
        back = CheckpointReader(str(d / act / "ck_from_megatron"))
        assert back.model_meta == meta, act
        wa, wb = CheckpointReader(str(d / act / "ck")).read_weights(), back.read_weights()
        assert set(wa) == set(wb) and all(torch.equal(wa[k], wb[k]) for k in wa), act
    # the two GELUs are told apart on these weights
    assert _relative(g["world"]["gelu"]["ours"], g["hf"]["gelu_new"]) > 2e-5
    flags = [line for line in g["log"] if "model flags:" in line]
    assert len(flags) == 4 and sum("--no-bias-gelu-fusion" in line for line in flags) == 2, flags
    # Megatron-LM's --use-checkpoint-args does not read bias_gelu_fusion: to-megatron says what to launch with
    notes = [line for line in g["log"] if "note: launch Megatron-LM with --no-bias-gelu-fusion" in line]
    assert len(notes) == 1, g["log"]


def test_from_megatron_reads_the_gelu_megatron_core_computed():
    """A Megatron-LM GPT-3 checkpoint's args (openai_gelu False, the defaults) convert: the tanh GELU
    with biases and the fusion, the erf GELU with the fusion off or without biases; to-megatron
    refuses a bias-free tanh GELU (megatron-core would compute the erf one) and writes nothing."""
    from zo_megatron.checkpoint.megatron_args import megatron_args, meta_from_args
    from zo_megatron.errors import UserError

    base = dict(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, ffn_hidden_size=FFN,
                max_position_embeddings=POS, vocab_size=VOCAB)
    for bias, fusion, want in ((True, True, "tanh"), (True, False, "none"), (False, False, "none")):
        args = megatron_args({**base, "add_bias_linear": bias, "gelu_approximate": want}, tp=1, iteration=0,
                             divisible_by=128, seq_length=SEQ, precision="fp32")
        assert args.bias_gelu_fusion == fusion and args.openai_gelu is False
        assert meta_from_args(args, VOCAB, "x")["gelu_approximate"] == want
        args.openai_gelu = True                 # read by the legacy models only: no effect
        assert meta_from_args(args, VOCAB, "x")["gelu_approximate"] == want
    with pytest.raises(UserError, match="tanh approximation without linear biases.*nothing is written"):
        megatron_args({**base, "add_bias_linear": False, "gelu_approximate": "tanh"}, tp=1, iteration=0,
                      divisible_by=128, seq_length=SEQ, precision="fp32")
    args = megatron_args(base, tp=1, iteration=0, divisible_by=128, seq_length=SEQ, precision="fp32")
    args.use_te_activation_func = True
    with pytest.raises(UserError, match="use_te_activation_func"):
        meta_from_args(args, VOCAB, "x")


# ---------------------------------------------------------------- resuming a checkpoint from before the field

def _job(rank, argv):
    from tests.test_pretrain import _rank_job

    return _rank_job(rank, argv, {})


def test_a_bias_free_gelu_checkpoint_from_before_the_field_is_the_tanh_gelu(tmp_path):
    """Before gelu_approximate was recorded every GELU MLP was the tanh one. Such a bias-free checkpoint
    read back is the tanh GELU: the same launch line (now the erf GELU, Megatron-LM's rule) is refused in
    one line naming both GELUs and the way out, and --use-checkpoint-args resumes it, at its own GELU."""
    from zo_megatron.checkpoint.reader import CheckpointReader
    from zo_megatron.checkpoint.verify import MANIFEST, read_manifest

    ck = str(tmp_path / "ck")
    run = [*MODEL, "--micro-batch-size", "2", "--eval-iters", "0", "--no-progress-bar", "--zero-offload", "--fp32",
           "--disable-bias-linear", "--save", ck]
    rc, out, err = run_world(_job, 1, [*run, "--train-iters", "2"], timeout=300)[0]
    assert rc == 0, err
    it_dir, manifest = read_manifest(ck)
    assert manifest["model"]["gelu_approximate"] == "none"
    del manifest["model"]["gelu_approximate"]              # as a checkpoint written before the field
    with open(os.path.join(it_dir, MANIFEST), "w") as f:
        json.dump(manifest, f)
    assert CheckpointReader(ck).model_meta["gelu_approximate"] == "tanh"
    again = [*run, "--train-iters", "4", "--load", ck]
    rc, out, err = run_world(_job, 1, again, timeout=300)[0]
    lines = [ln for ln in err.splitlines() if "error:" in ln]
    assert rc == 2 and len(lines) == 1, err
    assert "the MLP's GELU: the tanh GELU in the checkpoint, the erf GELU here" in lines[0], lines[0]
    assert "--use-checkpoint-args" in lines[0], lines[0]
    # with --use-checkpoint-args a typed flag that asks for another GELU is a clash, not overridden
    rc, out, err = run_world(_job, 1, [*again, "--use-checkpoint-args", "--no-bias-gelu-fusion"], timeout=300)[0]
    lines = [ln for ln in err.splitlines() if "error:" in ln]
    assert rc == 2 and len(lines) == 1, err
    assert "disagrees with the checkpoint" in lines[0] and "the tanh GELU in the checkpoint, the erf GELU here" \
        in lines[0], lines[0]
    rc, out, err = run_world(_job, 1, [*again, "--use-checkpoint-args"], timeout=300)[0]
    assert rc == 0 and "resumed from" in out, err
    model_line = next(ln for ln in out.splitlines() if ln.startswith(" model:"))
    assert "gelu_approximate" not in model_line, model_line          # no flag of that name to show
    assert read_manifest(ck)[1]["model"]["gelu_approximate"] == "tanh"     # the save at 4 keeps its GELU


def test_a_swiglu_mismatch_names_swiglu_not_a_gelu_the_checkpoint_never_had():
    """A SwiGLU model records gelu_approximate "none" (it has no GELU): a resume of a SwiGLU checkpoint
    with a GELU model's flags names --swiglu, not a GELU difference."""
    from zo_megatron.checkpoint.load import _check_model
    from zo_megatron.errors import UserError
    from zo_megatron.model import GPTConfig

    shape = dict(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, vocab_size=VOCAB,
                 precision="fp32")
    llama = GPTConfig(**shape, swiglu=True, add_bias_linear=False).arch_meta()
    gpt = GPTConfig(**shape).arch_meta()
    assert llama["gelu_approximate"] == "none" and gpt["gelu_approximate"] == "tanh"
    for saved, here in ((llama, gpt), (gpt, llama)):
        with pytest.raises(UserError) as e:
            _check_model({"model": saved}, here, "ck")
        assert "swiglu" in str(e.value) and "gelu" not in str(e.value).lower(), str(e.value)
