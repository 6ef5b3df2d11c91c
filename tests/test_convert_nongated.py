"""tools/convert_checkpoint.py for the LayerNorm decoders with a non-gated MLP (checkpoint/hf/nongated.py),
against transformers: NemotronForCausalLM (Nemotron-4, Minitron: --squared-relu, --apply-layernorm-1p,
--rotary-percent 0.5, GQA, untied) and Starcoder2ForCausalLM (the tanh GELU, biases, a sliding window).

A small random model transformers builds itself (every weight random: the LayerNorm1P gains and
biases, the linear biases where on): from-hf gives our forward == transformers' (fp32, 1e-5, every
element) at TP 1 and 2; HF -> ours -> HF is bit for bit (tensors and the config's fields); the
checkpoint's printed job flags are Megatron-LM's for it; to-hf writes a plain-LayerNorm squared-ReLU
model of ours (zero-centred on the way) that transformers computes as ours. Refused in one line: a
Nemotron config whose MLP is not relu2, biases on the attention only.
"""
import json
import os

import pytest
import torch

from tests.harness import run_world
from tests.hf_tokenizer import HF_VOCAB_SIZE
from tests.seeds import fresh_seed
from tests.test_convert_llama import close, hf_logits, make_hf_model, quiet

transformers = pytest.importorskip("transformers")

HIDDEN, HEADS, GROUPS, FFN, LAYERS, POS, SEQ = 96, 8, 4, 200, 2, 64, 11
VOCAB = HF_VOCAB_SIZE + 37              # the config's vocabulary exceeds the tokenizer's
FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
          "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings", "norm_eps",
          "tie_word_embeddings", "rope_parameters", "attention_bias", "mlp_bias")


def nemotron_config(bias: bool, tied: bool = False):
    return transformers.NemotronConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=GROUPS, max_position_embeddings=POS, norm_eps=1e-5,
        tie_word_embeddings=tied, attention_bias=bias, mlp_bias=bias, bos_token_id=0, eos_token_id=1,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})


def _our_logits(rank, ck, tokens, tp):
    from zo_megatron.checkpoint.reader import CheckpointReader
    from zo_megatron.model import GPTConfig, build_gpt_model
    from zo_megatron.model.sharding import load_full_params
    from zo_megatron.parallel import collectives, init_parallel

    ps = init_parallel(tp, num_attention_heads=HEADS, hidden_size=HIDDEN)
    reader = CheckpointReader(ck)
    model = build_gpt_model(GPTConfig(**reader.model_meta, precision="fp32"), ps.tp_rank, tp, 1).eval()
    load_full_params(model, reader.read_weights(), ps.tp_rank, tp, VOCAB)
    with torch.no_grad():
        local = model(tokens).float()
    full = torch.cat(collectives.all_gather_list(local.contiguous(), ps.tp_group), -1) if tp > 1 else local
    return full[..., :VOCAB]


def _from_hf_at_tp1_and_tp2(src: str, tmp_path, tokens) -> None:
    """from-hf at TP 1 and 2 (tmp_path/ck_tp1, ck_tp2): our forward of each == transformers'."""
    from zo_megatron.checkpoint import convert

    ref = hf_logits(src, tokens)
    for tp in (1, 2):
        ck = str(tmp_path / f"ck_tp{tp}")
        convert.from_hf(src, ck, tensor_parallel=tp, log=quiet)
        close(run_world(_our_logits, tp, ck, tokens, tp, timeout=180)[0], ref)


@pytest.mark.parametrize("bias, tied", [(False, False), (True, True)], ids=["no-bias-untied", "biases-tied"])
def test_nemotron_converts_both_ways_with_transformers_logits(tmp_path, bias, tied):
    from zo_megatron.checkpoint import convert
    from zo_megatron.checkpoint.arch import job_flags
    from zo_megatron.checkpoint.reader import CheckpointReader

    seed = fresh_seed(f"nemotron {bias}")
    src = make_hf_model(tmp_path / "hf", nemotron_config(bias, tied), seed)
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(seed + 1))
    _from_hf_at_tp1_and_tp2(src, tmp_path, tokens)
    meta = CheckpointReader(str(tmp_path / "ck_tp1")).model_meta
    assert meta["squared_relu"] and meta["layernorm_zero_centered_gamma"] and meta["rotary_percent"] == 0.5
    flags = job_flags(meta).split()
    for flag in ("--squared-relu", "--apply-layernorm-1p"):
        assert flag in flags, flags
    assert flags[flags.index("--rotary-percent") + 1] == "0.5" and ("--disable-bias-linear" in flags) != bias
    assert ("--untie-embeddings-and-output-weights" in flags) != tied
    assert ("--no-bias-gelu-fusion" in flags) == bias              # Megatron-LM refuses a fused squared ReLU
    # the printed flags build this very model (Megatron-LM's names, the job's parser)
    from zo_megatron.model import GPTConfig
    from zo_megatron.training.arguments import parse_args
    from zo_megatron.training.model_flags import architecture_kwargs

    args = parse_args([*flags, "--seq-length", str(SEQ), "--lr", "1e-3", "--train-iters", "1", "--vocab-size",
                       str(VOCAB)])
    rebuilt = GPTConfig(**architecture_kwargs(args), vocab_size=VOCAB, precision="fp32").arch_meta()
    assert rebuilt == meta, {k: (rebuilt[k], meta[k]) for k in meta if rebuilt.get(k) != meta[k]}
    back = str(tmp_path / "hf_back")
    convert.to_hf(str(tmp_path / "ck_tp2"), back, tokenizer_model=src, log=quiet)
    got = json.load(open(os.path.join(back, "config.json")))
    want = json.load(open(os.path.join(src, "config.json")))
    assert got["architectures"] == ["NemotronForCausalLM"]
    assert {k: got.get(k) for k in FIELDS} == {k: want.get(k) for k in FIELDS}
    from safetensors.torch import load_file

    a, b = load_file(os.path.join(src, "model.safetensors")), load_file(os.path.join(back, "model.safetensors"))
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a), sorted(set(a) ^ set(b))


def test_a_plain_layernorm_squared_relu_model_writes_as_nemotron(tmp_path):
    """Ours with ordinary LayerNorms (no --apply-layernorm-1p): to-hf subtracts 1 from every norm
    weight for LayerNorm1P, and transformers computes our logits."""
    from zo_megatron.checkpoint import convert
    from zo_megatron.checkpoint.reader import CheckpointReader

    seed = fresh_seed("nemotron plain layernorm")
    src = make_hf_model(tmp_path / "hf", nemotron_config(False), seed)
    ck = str(tmp_path / "ck")
    convert.from_hf(src, ck, tensor_parallel=1, log=quiet)
    # the same model with ordinary norms: unit-centred weights, written as a plain checkpoint
    plain = str(tmp_path / "plain")
    reader = CheckpointReader(ck)
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(seed + 1))
    ours = run_world(_our_logits, 1, ck, tokens, 1, timeout=180)[0]
    from zo_megatron.checkpoint.arch import recentred_gamma
    from zo_megatron.checkpoint.convert import _write_weights_checkpoint

    weights, meta = recentred_gamma(reader.read_weights(), reader.model_meta, zero_centred=False)
    _write_weights_checkpoint(plain, weights, meta, tp=1, converted_from="test", args=reader.args, force=False,
                              log=quiet, tokenizer_from=src)
    assert not CheckpointReader(plain).model_meta["layernorm_zero_centered_gamma"]
    close(run_world(_our_logits, 1, plain, tokens, 1, timeout=180)[0], ours)
    out = str(tmp_path / "hf_out")
    convert.to_hf(plain, out, log=quiet)            # no --architecture: the one family that expresses it
    close(hf_logits(out, tokens), ours)


@pytest.mark.parametrize("change, words", [
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"attention_bias": True}, "attention_bias=True, mlp_bias=False"),
    ({"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0, "partial_rotary_factor": 0.5}},
     "rope_type='linear'")])
def test_what_megatron_core_cannot_build_is_one_line(tmp_path, change, words):
    from zo_megatron.checkpoint import convert
    from zo_megatron.errors import UserError

    cfg = nemotron_config(False)
    for k, v in change.items():
        setattr(cfg, k, v)
    src = make_hf_model(tmp_path / "hf", cfg, fresh_seed("nemotron refusal"), tokenizer=False)
    with pytest.raises(UserError, match=words):
        convert.from_hf(src, str(tmp_path / "ck"), tensor_parallel=1, log=quiet)
    assert not (tmp_path / "ck").exists()


def starcoder2_config(window, bias=True, tied=True, act="gelu_pytorch_tanh", dropout=0.0, theta=100000.0, **more):
    return transformers.Starcoder2Config(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=GROUPS, max_position_embeddings=POS, norm_epsilon=1e-5,
        tie_word_embeddings=tied, use_bias=bias, sliding_window=window, bos_token_id=0, eos_token_id=1,
        hidden_act=act, residual_dropout=dropout, embedding_dropout=dropout,
        rope_parameters={"rope_type": "default", "rope_theta": theta}, **more)


STARCODER2 = {"tanh-biases-tied-3b-base": dict(window=None, theta=999999.4420358813),   # StarCoder2-3B's rope_theta
              "erf-window-untied-headdim": dict(window=32, bias=False, tied=False, act="gelu", dropout=0.1,
                                                head_dim=16)}


@pytest.mark.parametrize("case", list(STARCODER2))
def test_starcoder2_converts_both_ways_with_transformers_logits(tmp_path, case):
    """StarCoder2 is Megatron-LM's default GPT MLP (the tanh GELU with biases) on RoPE and GQA; also
    without biases, untied, with the erf GELU, a head_dim of its own and a window of 32 tokens (the model's
    --window-size 31,0, which changes nothing at 11): our forward == transformers' at TP 1 and 2, the job flags
    rebuild the model, HF -> ours -> HF is bit for bit with the window and the dropouts written back."""
    from safetensors.torch import load_file

    from zo_megatron.checkpoint import convert
    from zo_megatron.checkpoint.arch import job_flags
    from zo_megatron.checkpoint.reader import CheckpointReader
    from zo_megatron.model import GPTConfig
    from zo_megatron.training.arguments import parse_args
    from zo_megatron.training.model_flags import architecture_kwargs

    seed = fresh_seed(f"starcoder2 {case}")
    kw = STARCODER2[case]
    window = kw["window"]
    src = make_hf_model(tmp_path / "hf", starcoder2_config(**kw), seed)
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(seed + 1))
    _from_hf_at_tp1_and_tp2(src, tmp_path, tokens)
    reader = CheckpointReader(str(tmp_path / "ck_tp1"))
    meta = reader.model_meta
    assert meta["gelu_approximate"] == ("none" if kw.get("act") == "gelu" else "tanh") and not meta["squared_relu"]
    assert meta["add_bias_linear"] == kw.get("bias", True)
    assert meta["kv_channels"] == kw.get("head_dim", HIDDEN // HEADS)
    assert meta["rotary_base"] == kw.get("theta", 100000)
    assert type(meta["rotary_base"]) is (float if "theta" in kw else int)      # an int where whole, as Megatron-LM
    from zo_megatron.checkpoint.megatron_args import megatron_args, meta_from_args     # Megatron-LM's args carry it

    assert meta_from_args(megatron_args(meta, tp=1, iteration=0, divisible_by=128, seq_length=SEQ, precision="fp32"),
                          VOCAB, "x") == meta
    assert meta["window_size"] == (None if window is None else [window - 1, 0])       # every layer: no skip freq
    assert meta["window_attn_skip_freq"] is None
    flags = job_flags(meta).split()
    args = parse_args([*flags, "--seq-length", str(SEQ), "--lr", "1e-3", "--train-iters", "1", "--vocab-size",
                       str(VOCAB)])
    assert GPTConfig(**architecture_kwargs(args), vocab_size=VOCAB, precision="fp32").arch_meta() == meta, flags
    back = str(tmp_path / "hf_back")
    convert.to_hf(str(tmp_path / "ck_tp2"), back, tokenizer_model=src, log=quiet)
    got = json.load(open(os.path.join(back, "config.json")))
    want = json.load(open(os.path.join(src, "config.json")))
    fields = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "hidden_act", "max_position_embeddings", "norm_epsilon", "tie_word_embeddings",
              "rope_parameters", "use_bias", "sliding_window", "head_dim", "residual_dropout", "embedding_dropout")
    assert got["architectures"] == ["Starcoder2ForCausalLM"]
    assert {k: got.get(k) for k in fields} == {k: want.get(k) for k in fields}
    a, b = load_file(os.path.join(src, "model.safetensors")), load_file(os.path.join(back, "model.safetensors"))
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a), sorted(set(a) ^ set(b))


@pytest.mark.parametrize("change, words", [
    ({"act": "relu"}, "hidden_act='relu'"),
    ({"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}}, "rope_type='linear'")])
def test_what_starcoder2_maps_to_nothing_is_one_line(tmp_path, change, words):
    from zo_megatron.checkpoint import convert
    from zo_megatron.errors import UserError

    cfg = starcoder2_config(None, act=change.get("act", "gelu_pytorch_tanh"))
    if "rope_parameters" in change:
        cfg.rope_parameters = change["rope_parameters"]
    src = make_hf_model(tmp_path / "hf", cfg, fresh_seed("starcoder2 refusal"), tokenizer=False)
    with pytest.raises(UserError, match=words):
        convert.from_hf(src, str(tmp_path / "ck"), tensor_parallel=1, log=quiet)
    assert not (tmp_path / "ck").exists()
