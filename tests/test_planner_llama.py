"""The planner on Llama-family shapes (issue 24): parameter counts against Hugging Face models built
on the meta device (the public counts of Llama-3-8B/70B and Qwen2-7B exactly, and random small
configs), what one layer keeps for backward against megatron-core's own layers (measured with
saved_tensors_hooks), refusals, and the architecture the CLI prints."""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from tests.harness import run_world
from tests.seeds import fresh_seed
from zo_megatron import planner as P
from zo_megatron.planner import PlanInput, plan

REPO = Path(__file__).resolve().parents[1]
CLI = REPO / "tools" / "estimate_memory.py"

PUBLIC_COUNTS = {"llama3-8b": 8_030_261_248, "llama3-70b": 70_553_706_496, "qwen2-7b": 7_615_616_512}


def _hf_count(family: str, **cfg) -> int:
    """Parameters of a transformers model built on the meta device (no memory, no weights)."""
    import torch
    import transformers

    config_cls, model_cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
                             "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
                             "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM)}[family]
    with torch.device("meta"):
        model = model_cls(config_cls(**cfg))
    return sum(p.numel() for p in model.parameters())


def _hf_config(inp: PlanInput) -> tuple[str, dict]:
    """The HF config of a PlanInput's shape (RMSNorm, SwiGLU, rope: the Llama family)."""
    family = "qwen3" if inp.qk_layernorm else "qwen2" if inp.add_qkv_bias and not inp.add_bias_linear else "llama"
    cfg = dict(num_hidden_layers=inp.num_layers, hidden_size=inp.hidden_size,
               num_attention_heads=inp.num_attention_heads, num_key_value_heads=inp.query_groups(),
               intermediate_size=inp.ffn(), vocab_size=inp.vocab_size, head_dim=inp.head_dim(),
               tie_word_embeddings=not inp.untie_embeddings_and_output_weights)
    if family == "llama":
        cfg.update(attention_bias=inp.add_bias_linear, mlp_bias=inp.add_bias_linear)
    if family == "qwen3":
        cfg.update(attention_bias=False)
    return family, cfg


@pytest.mark.parametrize("name", sorted(PUBLIC_COUNTS))
def test_preset_params_are_the_public_counts_and_transformers(name):
    pytest.importorskip("transformers")
    inp = PlanInput(**P.model_preset(name))
    p = plan(inp)
    assert p.vocab_size_padded == inp.vocab_size          # 128256 and 152064 are multiples of 128
    assert p.params_total == PUBLIC_COUNTS[name]
    family, cfg = _hf_config(inp)
    assert _hf_count(family, **cfg) == PUBLIC_COUNTS[name]


def test_random_llama_qwen_configs_count_like_transformers():
    pytest.importorskip("transformers")
    rng = random.Random(fresh_seed("llama params"))
    for _ in range(12):
        heads = rng.choice([2, 4, 6, 8])
        groups = rng.choice([g for g in range(1, heads + 1) if heads % g == 0])
        d = rng.choice([8, 16, 24])
        # a hidden size other than heads * head_dim (transformers requires a multiple of the heads)
        h = heads * d if rng.random() < 0.7 else heads * rng.choice([k for k in (4, 6, 12, 20) if k != d])
        kind = rng.choice(["llama", "llama-bias", "qwen2", "qwen3"])
        inp = PlanInput(num_layers=rng.randint(1, 4), hidden_size=h, num_attention_heads=heads,
                        num_query_groups=groups, kv_channels=d, ffn_hidden_size=rng.randint(1, 8) * 16,
                        vocab_size=rng.randint(50, 500), make_vocab_size_divisible_by=1,
                        position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
                        untie_embeddings_and_output_weights=rng.random() < 0.5,
                        add_bias_linear=kind == "llama-bias", add_qkv_bias=kind == "qwen2",
                        qk_layernorm=kind == "qwen3")   # (Qwen3's attention_bias also biases o_proj)
        family, cfg = _hf_config(inp)
        assert plan(inp).params_total == _hf_count(family, **cfg), (inp, cfg)


@pytest.mark.parametrize("t", [1, 2, 4, 8])
def test_llama_params_per_tp_rank_and_buckets(t):
    inp = PlanInput(**P.model_preset("llama3-8b"), tensor_parallel=t, zero_offload=True, seq_length=2048)
    p = plan(inp)
    assert t * p.params_per_tp_rank == p.params_total + (t - 1) * p.replicated_params_per_tp_rank
    # replicated: the RMSNorm weights only (no biases, no position table)
    assert p.replicated_params_per_tp_rank == (2 * 32 + 1) * 4096
    # untied: the output layer is its own parameter, first in backward order: the first bucket
    # closes on it alone, the word embedding closes the last one
    assert P._bucket_layout(inp, p.vocab_size_padded, inp.seq_length, 128)[1] >= 128256 * 4096 // t


def test_gqa_must_divide_tp_and_heads():
    base = dict(P.model_preset("llama3-70b"))
    with pytest.raises(ValueError, match="num_query_groups 8 is not divisible by tensor_parallel 16.*use TP 8"):
        plan(PlanInput(**base, tensor_parallel=16))
    with pytest.raises(ValueError, match="not divisible by num_query_groups"):
        plan(PlanInput(**dict(base, num_query_groups=7)))
    with pytest.raises(ValueError, match="normalization"):
        plan(PlanInput(**dict(base, normalization="rmsnorm")))


def test_architecture_changes_the_activations_as_modelled():
    """Each architecture choice moves the per-layer bytes by exactly what it keeps."""
    from zo_megatron.planner.layer_activations import _layer_saved

    s, b, h, a, f = 128, 2, 256, 8, 512
    base = PlanInput(num_layers=2, hidden_size=h, num_attention_heads=a, seq_length=s, micro_batch_size=b,
                     ffn_hidden_size=f, precision="bf16", dropout=False)
    rep, split, scores = _layer_saved(base)
    sb = s * b
    # SwiGLU: fc1 [gate; up] 2f, silu f, up+0 f, product f (5f) instead of GELU's 2f
    assert _layer_saved(base.replace(swiglu=True))[1] - split == 2 * sb * 3 * f
    # RMSNorm: per norm an fp32 input copy + fp32 normalized (8 bytes) + fp32 1/rms per row, where
    # LayerNorm keeps its 16-bit input (2 bytes)
    assert _layer_saved(base.replace(normalization="RMSNorm"))[0] - rep == 2 * ((8 - 2) * sb * h + 4 * sb)
    # rope (MHA): new rotated q and k (the fused qkv output stays alive through v) + cos/sin tables
    r = _layer_saved(base.replace(position_embedding_type="rope"))
    assert r[1] - split == 2 * sb * 2 * h and r[0] - rep == 4 * 2 * s * (h // a)
    # GQA (with rope): q, k, v at full head count, the fused tensor no longer kept
    g = _layer_saved(base.replace(position_embedding_type="rope", num_query_groups=2))
    assert g[1] - split == 0
    assert g[2] == scores


# ------------------------------------------------------------------------------------------------
# one layer's saved bytes against megatron-core's layers (one process)

def _saved_per_layer(rank, cases):
    import dataclasses
    import functools

    import torch
    import torch.nn.functional as F
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from zo_megatron.model import gpt as G
    from zo_megatron.model.config import GPTConfig
    from zo_megatron.parallel import init_parallel

    init_parallel(1, seed=1)
    out = []
    for c in cases:
        cfg = GPTConfig(num_layers=2, hidden_size=c["hidden"], num_attention_heads=c["heads"], vocab_size=256,
                        max_position_embeddings=c["seq"], precision=c["precision"])
        tc = dataclasses.replace(
            G.transformer_config(cfg, 1), num_query_groups=c["groups"], kv_channels=c["d"],
            gated_linear_unit=c["swiglu"],
            activation_func=F.silu if c["swiglu"] else functools.partial(F.gelu, approximate="tanh"),
            add_bias_linear=c["bias"], add_qkv_bias=c["qkv_bias"], normalization=c["norm"],
            ffn_hidden_size=c["ffn"], qk_layernorm=c["qk_norm"])
        model = GPTModel(config=tc, transformer_layer_spec=get_gpt_layer_local_spec(normalization=c["norm"],
                                                                                    qk_layernorm=c["qk_norm"]),
                         vocab_size=256, max_sequence_length=c["seq"], position_embedding_type=c["pos"],
                         share_embeddings_and_output_weights=True, parallel_output=True)
        model = model.to(cfg.dtype)
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        seen: dict[int, int] = {}
        region = [None]

        def pack(t):
            st = t.untyped_storage()
            if region[0] == 1 and st.data_ptr() not in params and t.dtype != torch.bool:
                seen[st.data_ptr()] = st.nbytes()      # one layer, each storage once; no params, no mask
            return t

        layer = model.decoder.layers[1]
        layer.register_forward_pre_hook(lambda m, a: region.__setitem__(0, 1))
        layer.register_forward_hook(lambda m, a, o: region.__setitem__(0, None))
        b, s = c["micro"], c["seq"]
        tokens = torch.randint(0, 256, (b, s))
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(tokens, torch.arange(s)[None].expand(b, s), G.causal_attention_mask(s, "cpu"))
        out.append(sum(seen.values()))
    return out


def _random_cases(rng, n):
    cases = []
    for _ in range(n):
        heads = rng.choice([2, 4, 8])
        groups = rng.choice([g for g in range(1, heads + 1) if heads % g == 0])
        d = rng.choice([16, 32])
        norm = rng.choice(["RMSNorm", "LayerNorm"])
        cases.append(dict(heads=heads, groups=groups, d=d, hidden=heads * d if rng.random() < 0.7 else 96,
                          seq=rng.choice([32, 64]), micro=rng.choice([1, 2]), ffn=rng.choice([96, 160, 256]),
                          swiglu=rng.random() < 0.7, norm=norm, pos=rng.choice(["rope", "learned_absolute"]),
                          bias=rng.random() < 0.3, qkv_bias=rng.random() < 0.5,
                          qk_norm=rng.random() < 0.4, precision=rng.choice(["fp32", "bf16"])))
    return cases


def _case_input(c) -> PlanInput:
    return PlanInput(num_layers=2, hidden_size=c["hidden"], num_attention_heads=c["heads"], vocab_size=256,
                     seq_length=c["seq"], micro_batch_size=c["micro"], ffn_hidden_size=c["ffn"],
                     num_query_groups=c["groups"], kv_channels=c["d"], swiglu=c["swiglu"],
                     normalization=c["norm"], position_embedding_type=c["pos"], add_bias_linear=c["bias"],
                     add_qkv_bias=c["qkv_bias"], qk_layernorm=c["qk_norm"], precision=c["precision"],
                     dropout=False, fused_softmax=False)


def test_layer_saved_bytes_match_megatron_core():
    """What one megatron-core layer (local spec, unfused CPU paths) saves for backward equals the
    planner's per-layer item within 2% (the s x s bool mask, cached once, is left out of both; the
    planner ignores the per-token statistics of the two main LayerNorms, as Korthikanti's count does)."""
    from zo_megatron.planner.layer_activations import _layer_saved

    rng = random.Random(fresh_seed("layer saved"))
    cases = _random_cases(rng, 8)
    cases[0].update(groups=cases[0]["heads"], pos="rope", qk_norm=False)          # MHA + rope (v keeps qkv)
    cases[1].update(heads=4, groups=2, pos="rope", qk_norm=True, norm="RMSNorm")  # GQA + qk norm
    measured = run_world(_saved_per_layer, 1, cases, timeout=240)[0]
    bad = []
    for c, got in zip(cases, measured):
        want = sum(_layer_saved(_case_input(c)))
        if abs(want - got) > 0.02 * got:
            bad.append(f"{c}: planned {want} vs measured {got} ({want / got - 1:+.2%})")
    assert not bad, "\n".join(bad)


# ------------------------------------------------------------------------------------------------
# the CLI

def _cli(*args):
    """tools/estimate_memory.py's command line, in this process (tests/cli.py)."""
    from tests.cli import run_tool

    return run_tool("estimate_memory", *args)


def test_cli_llama_presets_and_architecture_line():
    r = _cli("--model", "llama3-70b", "--json")
    assert r.returncode in (0, 1), r.stderr
    d = json.loads(r.stdout)
    assert d["params_total"] == PUBLIC_COUNTS["llama3-70b"]
    r = _cli("--model", "llama3-8b", "--seq-length", "8192", "--preset", "h100-80gb", "--zero-offload")
    assert "architecture: Llama-family (rope, RMSNorm, SwiGLU, GQA 8, untied, no biases)" in r.stdout, r.stdout
    assert "8.03B" in r.stdout


LLAMA3_70B_SHAPE = ["--num-layers", "80", "--hidden-size", "8192", "--num-attention-heads", "64",
                    "--ffn-hidden-size", "28672", "--vocab-size", "128256", "--json"]
LLAMA_FLAGS = ["--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
               "--group-query-attention", "--num-query-groups", "8", "--untie-embeddings-and-output-weights",
               "--disable-bias-linear"]


def test_cli_architecture_flags_change_the_answer():
    """Issue 24: the Llama-3-70B shape without its architecture flags is a GPT-2 (60.1B) and says
    so; with them it is 70.55B, the public count."""
    gpt2 = json.loads(_cli(*LLAMA3_70B_SHAPE).stdout)
    llama = json.loads(_cli(*LLAMA3_70B_SHAPE, *LLAMA_FLAGS).stdout)
    assert gpt2["architecture"] == "GPT-2 (learned positions, LayerNorm, GELU, tied)"
    assert llama["architecture"] == "Llama-family (rope, RMSNorm, SwiGLU, GQA 8, untied, no biases)"
    L, h, f, V, S = 80, 8192, 28672, 128256, 1024
    gpt2_count = V * h + S * h + L * ((3 * h * h + 3 * h) + (h * h + h) + (f * h + f) + (h * f + h) + 4 * h) + 2 * h
    assert gpt2["params_total"] == gpt2_count
    assert llama["params_total"] == PUBLIC_COUNTS["llama3-70b"]
    assert llama["device_bytes_per_gpu"] != gpt2["device_bytes_per_gpu"]
    # the preset equals the flags
    assert json.loads(_cli("--model", "llama3-70b", "--json").stdout)["device_bytes_per_gpu"] == \
        llama["device_bytes_per_gpu"]


# the job's own refusals (arguments.finalize), which the tool runs on its command line
@pytest.mark.parametrize("args, message", [
    (["--model", "llama3-70b", "--window-size", "4095,0", "--attention-backend", "local"], "local attention, which builds its window mask on CUDA"),
    (["--model", "llama3-70b", "--tensor-model-parallel-size", "16"], "use --tensor-model-parallel-size <= 8"),
    (["--model", "llama3-8b", "--num-query-groups", "5"], "--num-query-groups 5 must divide --num-attention-heads 32"),
    (["--model", "llama3-8b", "--normalization", "ScaleNorm"], "invalid choice"),
])
def test_cli_refuses_what_it_cannot_model_in_one_line(args, message):
    r = _cli(*args)
    assert r.returncode == 2 and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in r.stderr, r.stderr
