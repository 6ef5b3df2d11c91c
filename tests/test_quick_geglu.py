"""GPT-OSS's MLP and attention softmax as Megatron-LM's flags give them: --quick-geglu (a gated MLP with
megatron-core's quick_gelu, x * sigmoid(1.702 x)), --glu-linear-offset, --activation-func-clamp-value and
--softmax-type (off-by-one, learnable: attention sinks).

The reference is megatron-core's own GPTModel built from Megatron-LM's args as its core_transformer_config_from_args
does (tests/megatron_reference.py), with the same random weights as ours from the job's flags: every logit equal
(fp32), and the model without the clamp on the same weights told apart (the weights are drawn wide enough that the
clamp binds). The architecture is recorded, carried by the Megatron-LM conversions and printed as job flags; what
makes no sense is one line. (Hugging Face GPT-OSS against transformers: tests/test_convert_gpt_oss.py.)
"""
import argparse
import math
import re

import pytest

from tests.harness import run_world
from tests.seeds import fresh_seed
from tests.test_gelu import FFN, HEADS, HIDDEN, LAYERS, POS, SEQ, SHAPE, VOCAB, _relative, megatron_core_and_ours

CLAMP = 1.5         # binds on a good share of the MLP's inputs at the test's weights (std 0.4)
GPT_OSS_MLP = ["--quick-geglu", "--glu-linear-offset", "1.0", "--activation-func-clamp-value", str(CLAMP)]
LAUNCHES = {"GPT-OSS (biases, sinks)": [*GPT_OSS_MLP, "--softmax-type", "learnable"],
            "bias-free, off-by-one softmax": [*GPT_OSS_MLP, "--disable-bias-linear", "--softmax-type", "off-by-one"]}


def _megatron_lm_args(flags: list[str]) -> argparse.Namespace:
    """Megatron-LM's args for the launch: --quick-geglu with its offset, clamp and softmax type as parsed."""
    bias = "--disable-bias-linear" not in flags
    return argparse.Namespace(
        num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, num_query_groups=HEADS, kv_channels=None,
        ffn_hidden_size=FFN, swiglu=False, quick_geglu=True, glu_linear_offset=1.0, activation_func_clamp_value=CLAMP,
        softmax_type=flags[flags.index("--softmax-type") + 1], normalization="LayerNorm", norm_epsilon=1e-5,
        add_bias_linear=bias, add_qkv_bias=bias, bias_gelu_fusion=False, tensor_model_parallel_size=1)


def _launch_vs_megatron_core(rank, seed):
    """Each launch's megatron-core logits, ours with and without the clamp."""
    launches = {name: (_megatron_lm_args(flags), flags) for name, flags in LAUNCHES.items()}
    return megatron_core_and_ours(seed, launches, "activation_func_clamp_value", (CLAMP, None))


def test_the_job_s_gpt_oss_mlp_and_softmax_are_megatron_core_s():
    seed = fresh_seed("quick geglu vs megatron-core")
    out = run_world(_launch_vs_megatron_core, 1, seed, timeout=400)[0]
    for name, o in out.items():
        arch = o["arch"]
        assert arch["quick_geglu"] and arch["glu_linear_offset"] == 1.0, name
        assert arch["softmax_type"] == _megatron_lm_args(LAUNCHES[name]).softmax_type, name
        assert _relative(o["ours"][CLAMP], o["megatron_core"]) < 2e-6, (name, seed)
        assert _relative(o["ours"][None], o["megatron_core"]) > 1e-3, (name, seed)     # the clamp binds


def test_the_conversions_and_the_job_flags_carry_it():
    from zo_megatron.checkpoint.arch import job_flags, param_shapes
    from zo_megatron.checkpoint.megatron_args import megatron_args, meta_from_args
    from zo_megatron.model import GPTConfig
    from zo_megatron.training.arguments import parse_args
    from zo_megatron.training.model_flags import architecture_kwargs

    for softmax in ("learnable", "off-by-one"):
        cfg = GPTConfig(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, ffn_hidden_size=FFN,
                        vocab_size=VOCAB, max_position_embeddings=POS, quick_geglu=True, glu_linear_offset=1.0,
                        activation_func_clamp_value=7.0, softmax_type=softmax, precision="fp32")
        meta = cfg.arch_meta()
        assert meta["gelu_approximate"] == "none"                # no GELU: one recorded value
        args = megatron_args(meta, tp=2, iteration=0, divisible_by=128, seq_length=SEQ, precision="fp32")
        assert (args.quick_geglu, args.glu_linear_offset, args.activation_func_clamp_value, args.softmax_type) == \
            (True, 1.0, 7.0, softmax) and not args.swiglu
        assert meta_from_args(args, VOCAB, "x") == meta
        flags = job_flags(meta).split()
        parsed = GPTConfig(**architecture_kwargs(parse_args([*flags, "--lr", "1e-3", "--train-iters", "1", "--seq-length", str(SEQ)])),
                           vocab_size=VOCAB, precision="fp32").arch_meta()
        assert parsed == meta, flags
        shapes = param_shapes(meta)
        sinks = [k for k in shapes if k.endswith("core_attention.softmax_offset")]
        assert len(sinks) == (LAYERS if softmax == "learnable" else 0)
        assert all(shapes[k] == (HEADS,) for k in sinks)
        assert shapes["gpt.decoder.layers.0.mlp.linear_fc1.weight"] == (2 * FFN, HIDDEN)      # [gate; up]
        assert cfg.num_parameters() == sum(math.prod(s) for s in shapes.values())


@pytest.mark.parametrize("flags,message", [
    (["--quick-geglu", "--swiglu"], "--swiglu, --squared-relu and --quick-geglu are three MLP activations"),
    (["--glu-linear-offset", "1.0"], "--glu-linear-offset / --activation-func-clamp-value shape a gated MLP"),
    (["--activation-func-clamp-value", "7"], "--glu-linear-offset / --activation-func-clamp-value shape a gated MLP"),
    (["--quick-geglu", "--activation-func-clamp-value", "0"], "--activation-func-clamp-value 0.0: must be > 0"),
    # Megatron-LM's post-training switch sets YaRN's original context to 131072, OpenAI's config 4096
    (["--enable-gpt-oss"], "--enable-gpt-oss (Megatron-LM's post-training switch) sets YaRN with an original context "
                           "of 131072, not the 4096 of OpenAI's GPT-OSS config"),
])
def test_what_makes_no_sense_is_one_line(flags, message):
    from zo_megatron.errors import ConfigError
    from zo_megatron.model import GPTConfig
    from zo_megatron.training.arguments import parse_args
    from zo_megatron.training.model_flags import architecture_kwargs

    with pytest.raises(ConfigError, match=re.escape(message)):
        GPTConfig(**architecture_kwargs(parse_args([*SHAPE, *flags])), vocab_size=VOCAB)
