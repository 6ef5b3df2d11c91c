"""tools/convert_checkpoint.py to-megatron / from-megatron for GPT-OSS, against transformers and megatron-core.

A random Hugging Face GPT-OSS (tests/test_convert_gpt_oss.py's: q/k/v/o biases, attention sinks, a sliding window
on layer 0, YaRN, experts with biases and the clamped quick GeGLU, a router with a bias; every weight random, from a
printed seed):
  - HF -> from-hf -> to-megatron at TP1 x EP1 and at TP2 x expert TP1 x EP2 (experts with biases need expert TP 1:
    megatron-core's rule) -> from-megatron -> to-hf gives every tensor bit for bit; the files carry Megatron-LM's
    GPT-OSS args (--quick-geglu, --glu-linear-offset, --activation-func-clamp-value, --softmax-type learnable,
    --window-size, --window-attn-skip-freq) and the sinks under megatron-core's name, split over TP with the heads;
  - on 2 gloo ranks megatron-core's own GPTModel (local modules, built from the files' args alone: its
    DotProductAttention computes the sinks and the window, its MLP the clamped GLU) loads each rank's file with
    load_state_dict(strict=True) and gives transformers' logits (fp32, every element).
"""
import os

import pytest
import torch

from tests.harness import next_port, run_world
from tests.seeds import fresh_seed
from tests.test_convert_gpt_oss import HEADS, LAYERS, VOCAB, _config, _random_hf
from tests.test_convert_llama import close, hf_logits, quiet

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

SEQ = 16            # the window (6 tokens on layer 0) binds
LAYOUTS = ((1, 1, 1), (2, 2, 1))        # (TP, EP, expert TP)


def _tag(tp, ep, etp):
    return f"tp{tp}_ep{ep}_etp{etp}"


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    from zo_megatron.checkpoint import convert

    d = tmp_path_factory.mktemp("megatron_gpt_oss")
    seed = fresh_seed("convert megatron gpt-oss")
    src = _random_hf(d / "hf", _config(), seed)
    ck = str(d / "ck")
    convert.from_hf(src, ck, tensor_parallel=1, log=quiet)
    for tp, ep, etp in LAYOUTS:
        meg = str(d / f"megatron_{_tag(tp, ep, etp)}")
        convert.to_megatron(ck, meg, tensor_parallel=tp, expert_parallel=ep, expert_tensor_parallel=etp, log=quiet)
        back = str(d / f"back_{_tag(tp, ep, etp)}")
        convert.from_megatron(meg, back, tensor_parallel=tp, log=quiet)
        convert.to_hf(back, str(d / f"hf_{_tag(tp, ep, etp)}"), log=quiet)
    return {"d": str(d), "seed": seed}


def test_hf_megatron_hf_is_bit_exact_with_megatron_lm_s_gpt_oss_args(converted):
    from zo_megatron.checkpoint import megatron_lm
    from zo_megatron.checkpoint.reader import CheckpointReader

    d = converted["d"]
    ref = CheckpointReader(os.path.join(d, "ck"))
    meta, want = ref.model_meta, ref.read_weights()
    assert meta["softmax_type"] == "learnable" and meta["quick_geglu"] and meta["window_size"] is not None
    a = safetensors_torch.load_file(os.path.join(d, "hf", "model.safetensors"))
    for tp, ep, etp in LAYOUTS:
        back = CheckpointReader(os.path.join(d, f"back_{_tag(tp, ep, etp)}"))
        assert back.model_meta == meta, (tp, ep)
        got = back.read_weights()
        assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want), (tp, ep)
        b = safetensors_torch.load_file(os.path.join(d, f"hf_{_tag(tp, ep, etp)}", "model.safetensors"))
        assert set(a) == set(b) and all(torch.equal(a[k], b[k].to(a[k].dtype)) for k in a), (tp, ep)
        rel = os.path.join(d, f"megatron_{_tag(tp, ep, etp)}", "release")
        for rank_dir in sorted(os.listdir(rel)):
            sd = megatron_lm.safe_load(os.path.join(rel, rank_dir, megatron_lm.FILE))
            args, model = sd["args"], sd["model"]
            assert (args.quick_geglu, args.glu_linear_offset, args.softmax_type) == (True, 1.0, "learnable")
            assert args.activation_func_clamp_value == meta["activation_func_clamp_value"]
            assert tuple(args.window_size) == tuple(meta["window_size"]) and not args.swiglu
            t = int(rank_dir.split("_")[2])
            for i in range(LAYERS):
                sinks = model[f"decoder.layers.{i}.self_attention.core_attention.softmax_offset"]
                full = want[f"gpt.decoder.layers.{i}.self_attention.core_attention.softmax_offset"]
                assert torch.equal(sinks, full.chunk(tp)[t]) and sinks.shape == (HEADS // tp,), (tp, rank_dir)


def _megatron_core_gpt(args):
    """megatron-core's GPTModel from Megatron-LM's saved args alone (tests/megatron_reference.py), with the window
    its local DotProductAttention applies from the args (megatron-core's field names)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    from tests.megatron_reference import megatron_core_config

    cfg = megatron_core_config(args, window_size=tuple(args.window_size),
                               window_attn_skip_freq=args.window_attn_skip_freq)
    if args.position_embedding_type == "yarn":
        # megatron-core 0.16's GPTModel and attention read YaRN's settings as config attributes yarn_<name>, which
        # Megatron-LM (core_v0.19's _apply_yarn_config_from_args) sets from its args of these names
        for arg in ("rotary_scaling_factor", "yarn_original_max_position_embeddings", "yarn_beta_fast",
                    "yarn_beta_slow", "yarn_correction_range_round_to_int", "mscale", "mscale_all_dim"):
            setattr(cfg, arg if arg.startswith("yarn_") else f"yarn_{arg}", getattr(args, arg))
    spec = get_gpt_decoder_block_spec(cfg, use_transformer_engine=False, normalization=args.normalization)
    return GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=args.padded_vocab_size,
                    max_sequence_length=args.max_position_embeddings,
                    share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                    position_embedding_type=args.position_embedding_type, rotary_base=args.rotary_base,
                    rotary_percent=args.rotary_percent, parallel_output=True)


def _megatron_core_ranks(rank, d, tokens):
    from megatron.core import parallel_state as mpu
    from megatron.core.transformer import utils

    from zo_megatron.checkpoint import megatron_lm
    from zo_megatron.parallel import collectives, destroy_parallel, init_parallel

    ones = torch.ones
    utils.torch.ones = lambda *a, device=None, **k: ones(*a, **k)     # its window mask asks for device="cuda"
    out = {}
    try:
        for tp, ep, etp in LAYOUTS:
            next_port()
            ps = init_parallel(tp, expert_parallel=ep, expert_tensor_parallel=etp)
            e_rank = mpu.get_expert_model_parallel_rank()
            rank_dir = f"mp_rank_{ps.tp_rank:02d}" + (f"_{e_rank:03d}" if ep > 1 else "")
            sd = megatron_lm.safe_load(os.path.join(d, f"megatron_{_tag(tp, ep, etp)}", "release", rank_dir,
                                                    megatron_lm.FILE))
            model = _megatron_core_gpt(sd["args"])
            model.load_state_dict(sd["model"], strict=True)
            model.eval()
            b, s = tokens.shape
            with torch.no_grad():
                local = model(tokens, torch.arange(s).expand(b, s), None)
            full = torch.cat(collectives.all_gather_list(local.contiguous(), ps.tp_group), -1) if tp > 1 else local
            out[(tp, ep, etp)] = full[..., :VOCAB].float().clone()
            collectives.barrier()
            destroy_parallel()
    finally:
        utils.torch.ones = ones
    return out


def test_megatron_core_loads_every_rank_s_file_strictly_with_transformers_logits(converted):
    d = converted["d"]
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(converted["seed"] + 7))
    ref = hf_logits(os.path.join(d, "hf"), tokens)
    world = run_world(_megatron_core_ranks, 2, d, tokens, timeout=400)
    for layout in LAYOUTS:
        for rank_out in world:
            close(rank_out[layout], ref)
