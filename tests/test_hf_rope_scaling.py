"""Issue 35, item 5: Hugging Face's rope scaling types that megatron-core 0.16 computes convert exactly
(YaRN, besides Llama-3.1's llama3 in tests/test_convert_llama.py); the others are refused in one line.

Tiny random models that transformers builds from configs made here, at a sequence (40) longer than
their original context (16 or 12), so that YaRN's blend of interpolated and extrapolated
frequencies is exercised. The reference is transformers' own forward (fp32, eager); ours is the
model the job builds from the converted checkpoint; megatron-core's GPTModel is also built from
to-megatron's args alone, as Megatron-LM core_v0.19 builds a YaRN GPT (its
_apply_yarn_config_from_args), independently of zo_megatron's model.
"""
import json
import math
import os
import shlex

import pytest
import torch

from tests.harness import run_world
from tests.seeds import fresh_seed
from tests.test_hf_fidelity import SEQ, close, common, hf_logits, make_hf, models_logits, quiet, tokens_for

transformers = pytest.importorskip("transformers")

# name -> (transformers config class, its rope in transformers 5's rope_parameters, the yarn flags
# from-hf must print); each with a ramp that rounds or not, default or own betas and mscale pair
YARN = {
    "llama": ("LlamaConfig", dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=16),
              "--position-embedding-type yarn --rotary-base 10000 --rotary-scaling-factor 4 "
              "--yarn-original-max-position-embeddings 16"),
    "qwen2": ("Qwen2Config", dict(rope_type="yarn", rope_theta=1000000.0, factor=4.0, original_max_position_embeddings=16,
                                  beta_fast=8.0, beta_slow=2.0, truncate=False, mscale=0.8, mscale_all_dim=0.5),
              "--rotary-scaling-factor 4 --yarn-original-max-position-embeddings 16 --yarn-beta-fast 8 "
              "--yarn-beta-slow 2 --mscale 0.8 --mscale-all-dim 0.5 --no-yarn-correction-range-round-to-int"),
    # an explicit attention_factor that a (mscale, mscale_all_dim) pair gives (what to-hf writes for one
    # HF alone would read as another factor): 0.1 * 1.2 * ln 4 + 1
    "mistral": ("MistralConfig", dict(rope_type="yarn", rope_theta=500000.0, factor=4.0,
                                      original_max_position_embeddings=16, attention_factor=0.1 * 1.2 * math.log(4.0) + 1.0,
                                      mscale=1.2, mscale_all_dim=0.0),
                "--rotary-scaling-factor 4 --yarn-original-max-position-embeddings 16 --mscale 1.2"),
}


def _logits(rank, cks, megatron_file, tokens):
    """Our model's logits from each checkpoint `cks` names, and megatron-core's own GPTModel's from
    to-megatron's `megatron_file` (TP 1, one process)."""
    from zo_megatron.parallel import init_parallel

    init_parallel(1)
    out = models_logits(cks, tokens)
    out["megatron-core"] = _megatron_core_logits(megatron_file, tokens)
    return out


def _megatron_core_logits(megatron_file, tokens):
    """megatron-core's own GPTModel from Megatron-LM's saved args (TP 1), the yarn_* config attributes
    set from them as Megatron-LM core_v0.19 sets them; strict load of to-megatron's file."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from tests.test_convert_llama import _megatron_core_config
    from zo_megatron.checkpoint import megatron_lm

    sd = megatron_lm.safe_load(megatron_file)
    args = sd["args"]
    config = _megatron_core_config(args, 1)
    for arg in ("rotary_scaling_factor", "mscale", "mscale_all_dim"):
        setattr(config, f"yarn_{arg}", getattr(args, arg))
    for arg in ("original_max_position_embeddings", "beta_fast", "beta_slow", "correction_range_round_to_int"):
        setattr(config, f"yarn_{arg}", getattr(args, f"yarn_{arg}"))
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(normalization=args.normalization),
                     vocab_size=args.padded_vocab_size, max_sequence_length=args.max_position_embeddings,
                     share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                     position_embedding_type=args.position_embedding_type, rotary_base=args.rotary_base,
                     rotary_percent=args.rotary_percent, parallel_output=True)
    model.load_state_dict(sd["model"], strict=True)
    model.eval()
    b, s = tokens.shape
    with torch.no_grad():
        logits = model(tokens, torch.arange(s).expand(b, s), torch.triu(torch.ones(s, s, dtype=torch.bool), 1)[None, None])
    return logits[..., :args.vocab_size].clone()


def test_yarn_converts_exactly_from_hf_to_the_job_megatron_and_back(tmp_path):
    """from-hf of a YaRN Llama, Qwen2 (transformers 4.x's rope_scaling schema) and Mistral prints the
    job's yarn flags, which the job parses into the checkpoint's architecture; our model's logits
    equal transformers' (every element, 1e-5) at 40 tokens, beyond the original context;
    megatron-core's GPTModel built from to-megatron's args gives them too, and from-megatron gives
    the architecture back; to-hf writes a rope transformers reads as the source's (logits equal)."""
    from tests.hf_tokenizer import HF_VOCAB_SIZE, make_hf_tokenizer
    from zo_megatron.checkpoint import convert
    from zo_megatron.checkpoint.reader import CheckpointReader
    from zo_megatron.model.config import YARN_FIELDS
    from zo_megatron.training.arguments import parse_args
    from zo_megatron.training.model_flags import architecture_kwargs

    seed = fresh_seed("yarn rope")
    tokens = tokens_for(seed, SEQ)
    srcs, cks, refs = {}, {}, {}
    for i, (name, (config_class, rope, flags)) in enumerate(YARN.items()):
        extra = dict(use_sliding_window=False) if name == "qwen2" else dict(sliding_window=None) if name == "mistral" \
            else {}
        cfg = getattr(transformers, config_class)(**common(vocab_size=HF_VOCAB_SIZE, rope_parameters=rope, **extra))
        srcs[name] = src = make_hf(tmp_path / name, cfg, seed + i)
        make_hf_tokenizer(src)                  # for to-hf
        if name == "qwen2":                     # as transformers 4.x wrote it
            written = json.load(open(os.path.join(src, "config.json")))
            p = written.pop("rope_parameters")
            written.update(rope_theta=p.pop("rope_theta"), transformers_version="4.45.0",
                           rope_scaling={"type" if k == "rope_type" else k: v for k, v in p.items()})
            json.dump(written, open(os.path.join(src, "config.json"), "w"))
        refs[name] = hf_logits(src, tokens)
        lines = []
        cks[name] = ck = str(tmp_path / f"{name}_ck")
        convert.from_hf(src, ck, tensor_parallel=1, log=lines.append)
        printed = next(ln for ln in lines if "model flags:" in ln).split("model flags:")[1]
        assert flags in printed, (name, printed)
        meta = CheckpointReader(ck).model_meta
        job = architecture_kwargs(parse_args(shlex.split(printed) + ["--seq-length", "40", "--train-iters", "1", "--lr", "1e-4",
                                                                  "--tokenizer-type", "HuggingFaceTokenizer",
                                                                  "--tokenizer-model", src]))
        assert {k: job[k] for k in ("position_embedding_type", *YARN_FIELDS)} == \
            {k: meta[k] for k in ("position_embedding_type", *YARN_FIELDS)}, name
    convert.to_megatron(cks["llama"], str(tmp_path / "megatron"), log=quiet)
    megatron_file = os.path.join(tmp_path, "megatron", "release", "mp_rank_00", "model_optim_rng.pt")
    ours = run_world(_logits, 1, cks, megatron_file, tokens, timeout=120)[0]
    for name in YARN:
        close(ours[name], refs[name])
    close(ours["megatron-core"], refs["llama"])
    convert.from_megatron(str(tmp_path / "megatron"), str(tmp_path / "from_megatron"), tensor_parallel=1, log=quiet)
    assert CheckpointReader(str(tmp_path / "from_megatron")).model_meta == CheckpointReader(cks["llama"]).model_meta

    for name, src in srcs.items():
        back = str(tmp_path / f"{name}_back")
        convert.to_hf(cks[name], back, log=quiet)
        rope = [{k: v for k, v in transformers.AutoConfig.from_pretrained(d).rope_parameters.items() if k != "type"}
                for d in (back, src)]           # ("type": transformers 5 keeps 4.x's key as it read it)
        assert rope[0] == rope[1], name
        assert torch.equal(hf_logits(back, tokens), refs[name]), name


@pytest.mark.parametrize("rope,says", [
    (dict(rope_type="linear", factor=2.0), "Megatron-LM's --rotary-seq-len-interpolation-factor"),
    (dict(rope_type="dynamic", factor=2.0), "dynamic NTK"),
    (dict(rope_type="longrope", short_factor=[1.0] * 4, long_factor=[2.0] * 4, original_max_position_embeddings=16),
     "LongRoPE"),
    (dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=16, attention_factor=1.0), "attention_factor=1.0"),
])
def test_rope_types_megatron_core_cannot_compute_are_refused_in_one_line(tmp_path, capsys, rope, says):
    """Each refusal is one `error:` line, exit 2, nothing written; a type megatron-core lacks names
    the supported ones (old code: yarn was refused too)."""
    from tests.test_convert_llama import _cli

    seed = fresh_seed(f"refused rope {rope['rope_type']}")
    src = make_hf(tmp_path / "llama", transformers.LlamaConfig(**common(
        rope_parameters={"rope_theta": 10000.0, **rope})), seed)
    capsys.readouterr()
    rc = _cli().main(["from-hf", "--input", src, "--output", str(tmp_path / "out"), "--tensor-parallel", "1"])
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip() and "%" not in ln]
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0], lines
    if rope["rope_type"] != "yarn":
        assert f"rope_type={rope['rope_type']!r}" in lines[0] and "'default', 'llama3', 'yarn'" in lines[0], lines
    assert not os.path.exists(tmp_path / "out")


def test_yarn_flags_without_yarn_are_refused():
    from zo_megatron.errors import ConfigError
    from zo_megatron.model import GPTConfig

    with pytest.raises(ConfigError, match="--rotary-scaling-factor sets YaRN: add --position-embedding-type yarn"):
        GPTConfig(position_embedding_type="rope", rotary_scaling_factor=2.0)
    with pytest.raises(ConfigError, match="rotates the whole head"):
        GPTConfig(position_embedding_type="yarn", rotary_scaling_factor=2.0, rotary_percent=0.5)
