"""--squared-relu (Megatron-LM's; Nemotron-4's MLP): relu(x)^2 as the non-gated MLP's activation.

The reference is megatron-core's own GPTModel built from Megatron-LM's args as its
core_transformer_config_from_args does (tests/megatron_reference.py: activation_func megatron-core's
squared_relu), with the same random weights as ours from the job's flags: every logit equal (fp32);
the GELU model on the same weights is told apart. The architecture is recorded, carried by the
Megatron-LM conversions and printed as a job flag; --squared-relu with --swiglu is one line.
"""
import argparse

import pytest

from tests.harness import run_world
from tests.seeds import fresh_seed
from tests.test_gelu import FFN, HEADS, HIDDEN, LAYERS, POS, SEQ, SHAPE, VOCAB, _relative, megatron_core_and_ours

LAUNCHES = {"bias-free (Nemotron-4)": ["--squared-relu", "--disable-bias-linear"],
            "biases, unfused": ["--squared-relu", "--no-bias-gelu-fusion"]}


def _megatron_lm_args(flags: list[str]) -> argparse.Namespace:
    """Megatron-LM's args for the launch (its validate_args: the bias-GELU fusion off without biases;
    with biases megatron-core refuses a fused squared ReLU, so the launch turns the fusion off)."""
    bias = "--disable-bias-linear" not in flags
    return argparse.Namespace(
        num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, num_query_groups=HEADS, kv_channels=None,
        ffn_hidden_size=FFN, swiglu=False, squared_relu=True, normalization="LayerNorm", norm_epsilon=1e-5,
        add_bias_linear=bias, add_qkv_bias=bias, bias_gelu_fusion=False, tensor_model_parallel_size=1)


def _launch_vs_megatron_core(rank, seed):
    """Each launch's megatron-core logits, ours with and without the squared ReLU (the GELU)."""
    launches = {name: (_megatron_lm_args(flags), flags) for name, flags in LAUNCHES.items()}
    return megatron_core_and_ours(seed, launches, "squared_relu", (True, False))


def test_the_job_s_squared_relu_is_megatron_core_s():
    seed = fresh_seed("squared relu vs megatron-core")
    out = run_world(_launch_vs_megatron_core, 1, seed, timeout=400)[0]
    for name, o in out.items():
        assert o["arch"]["squared_relu"], name
        assert _relative(o["ours"][True], o["megatron_core"]) < 2e-6, (name, seed)
        assert _relative(o["ours"][False], o["megatron_core"]) > 1e-2, (name, seed)     # a GELU is told apart


def test_the_conversions_and_the_job_flags_carry_it():
    from zo_megatron.checkpoint.arch import job_flags
    from zo_megatron.checkpoint.megatron_args import megatron_args, meta_from_args
    from zo_megatron.model import GPTConfig

    for bias in (False, True):
        meta = GPTConfig(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, ffn_hidden_size=FFN,
                         vocab_size=VOCAB, max_position_embeddings=POS, squared_relu=True, add_bias_linear=bias,
                         precision="fp32").arch_meta()
        assert meta["gelu_approximate"] == "none"                # no GELU: one recorded value
        args = megatron_args(meta, tp=1, iteration=0, divisible_by=128, seq_length=SEQ, precision="fp32")
        assert args.squared_relu and not args.swiglu and args.bias_gelu_fusion is False
        assert meta_from_args(args, VOCAB, "x") == meta
        flags = job_flags(meta).split()
        # with biases Megatron-LM needs --no-bias-gelu-fusion (megatron-core refuses a fused squared ReLU)
        assert "--squared-relu" in flags and ("--no-bias-gelu-fusion" in flags) == bias, flags


def test_squared_relu_with_swiglu_is_one_line():
    from zo_megatron.errors import ConfigError
    from zo_megatron.training.arguments import parse_args

    with pytest.raises(ConfigError, match="--swiglu, --squared-relu and --quick-geglu are three MLP activations: choose one"):
        parse_args([*SHAPE, "--squared-relu", "--swiglu"])
