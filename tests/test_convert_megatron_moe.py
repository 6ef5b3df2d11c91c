"""tools/convert_checkpoint.py to-megatron / from-megatron for mixtures of experts, against transformers
and megatron-core.

A random Mixtral and a random Qwen2-MoE (a shared expert with its sigmoid gate, QKV biases,
norm_topk_prob false = --moe-router-pre-softmax, layer 1 dense) that transformers builds and saves
(hidden 64, 4 heads, 2 KV groups, 4 experts of FFN 40, top 2; every weight random, from a printed seed):
  - HF -> from-hf (TP 2) -> to-megatron at TP2 x EP2 and TP1 x EP1 -> from-megatron -> to-hf gives every
    tensor bit for bit and the config's fields; the from-megatron checkpoint's architecture is the
    from-hf one's, and its printed flags, parsed by the job's parser, give that architecture;
  - at TP2 x EP2, TP1 x EP1 and TP2 x expert TP1 x EP2 (Megatron-LM's MoE recipes' whole experts beside TP
    attention: only global ranks 0 and 1 have expert-DP rank 0, so two files, megatron-core's RankGenerator
    says which);
  - the files are Megatron-LM's layout (get_checkpoint_name: mp_rank_TT_EEE at EP > 1), each EP rank's
    file holds its experts by local index (EP rank e's local j = expert e x E/EP + j, checked against
    the HF tensors), the dense parameters on every EP rank, and the MoE args under Megatron-LM's names;
  - on 4 gloo ranks megatron-core's own GPTModel (get_gpt_decoder_block_spec, local modules, built from
    the files' args alone) loads each (TP, EP) rank's file with load_state_dict(strict=True) and gives
    transformers' logits (fp32, every element), at TP2 x EP2 and at TP1 x EP1;
  - bad input is one line, exit 2, nothing written: EP not dividing the experts, a file set missing an
    EP rank, an MoE file set whose args say dense (no num_experts), an MoE arg that changes the model
    (a capacity factor), grouped-GEMM experts, a layout Megatron-LM's torch format cannot hold (two ranks
    on one file, a TP rank never written), EP or expert TP for a dense model.
`-m slow`: Qwen3-MoE (q/k norms, head_dim 24) HF -> TP2 x EP2 -> HF bit for bit.
"""
import json
import math
import os
import shutil

import pytest
import torch

from tests.harness import next_port, run_world
from tests.hf_tokenizer import HF_VOCAB_SIZE
from tests.seeds import fresh_seed
from tests.test_convert_llama import CONFIG_FIELDS, _cli, close, hf_logits, make_hf_model, quiet

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

HIDDEN, HEADS, GROUPS, FFN, LAYERS, EXPERTS, TOPK, SHARED = 64, 4, 2, 40, 2, 4, 2, 48
VOCAB = HF_VOCAB_SIZE + 37
SEQ = 12
# (TP, EP, expert TP) that to-megatron writes; TP2 x expert TP1 x EP2 is Megatron-LM's MoE recipes' layout
# (whole experts beside TP attention), whose torch-format files are those of global ranks 0 and 1 only
LAYOUTS = ((2, 2, 2), (1, 1, 1), (2, 2, 1))


def _tag(tp, ep, etp):
    return f"tp{tp}_ep{ep}" + (f"_etp{etp}" if etp != tp else "")


def _files(tp, ep, etp, scale=1):
    """Megatron-LM's file of each rank with expert-data-parallel rank 0 (megatron-core's RankGenerator)
    in a world of `scale` x the smallest that holds the layout."""
    from megatron.core.parallel_state import RankGenerator

    world = math.lcm(tp, etp * ep) * scale
    dense = RankGenerator(tp=tp, ep=1, dp=world // tp, pp=1, cp=1, order="tp-cp-ep-dp-pp")
    moe = RankGenerator(tp=etp, ep=ep, dp=world // (etp * ep), pp=1, cp=1, order="tp-cp-ep-dp-pp")

    def rank_in(gen, token, r):
        (group,) = [g for g in gen.get_ranks(token) if r in g]
        return group.index(r)

    return {r: (rank_in(dense, "tp", r), rank_in(moe, "ep", r), rank_in(moe, "tp", r))
            for r in range(world) if rank_in(moe, "dp", r) == 0}
MOE_CONFIG_FIELDS = ("num_local_experts", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
                     "shared_expert_intermediate_size", "norm_topk_prob", "mlp_only_layers", "decoder_sparse_step",
                     "router_jitter_noise", "qkv_bias")


def moe_configs():
    common = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                  num_key_value_heads=GROUPS, max_position_embeddings=64, num_experts_per_tok=TOPK,
                  tie_word_embeddings=False, bos_token_id=0, eos_token_id=1,
                  rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    return {"mixtral": transformers.MixtralConfig(**common, intermediate_size=FFN, num_local_experts=EXPERTS,
                                                  rms_norm_eps=1e-5, sliding_window=None),
            "qwen2_moe": transformers.Qwen2MoeConfig(**common, intermediate_size=56, moe_intermediate_size=FFN,
                                                     num_experts=EXPERTS, shared_expert_intermediate_size=SHARED,
                                                     norm_topk_prob=False, mlp_only_layers=[1], rms_norm_eps=1e-6)}


def _flags(lines):
    (flags,) = [ln.removeprefix("  model flags: ") for ln in lines if ln.startswith("  model flags: ")]
    return flags


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    from zo_megatron.checkpoint import convert

    d = tmp_path_factory.mktemp("megatron_moe")
    seed = fresh_seed("convert megatron moe")
    out = {"d": str(d), "seed": seed, "names": list(moe_configs()), "from_megatron_lines": {}}
    for i, (name, cfg) in enumerate(moe_configs().items()):
        src = make_hf_model(d / name, cfg, seed + i)
        ck = str(d / f"{name}_ck")
        convert.from_hf(src, ck, tensor_parallel=2, log=quiet)
        for layout in LAYOUTS:
            tp, ep, etp = layout
            meg = str(d / f"{name}_megatron_{_tag(*layout)}")
            convert.to_megatron(ck, meg, tensor_parallel=tp, expert_parallel=ep, expert_tensor_parallel=etp, log=quiet)
            lines = out["from_megatron_lines"][(name, *layout)] = []
            back = str(d / f"{name}_from_megatron_{_tag(*layout)}")
            convert.from_megatron(meg, back, tensor_parallel=tp, log=lines.append)
            convert.to_hf(back, str(d / f"{name}_hf_{_tag(*layout)}"), log=quiet)
    return out


def test_hf_megatron_hf_is_bit_exact_and_the_printed_flags_give_the_model(converted):
    from zo_megatron.checkpoint.reader import CheckpointReader
    from zo_megatron.model import GPTConfig
    from zo_megatron.training.arguments import build_parser
    from zo_megatron.training.model_flags import architecture_kwargs, moe_kwargs

    d = converted["d"]
    for name in converted["names"]:
        a = safetensors_torch.load_file(os.path.join(d, name, "model.safetensors"))
        cfg_a = json.load(open(os.path.join(d, name, "config.json")))
        ref = CheckpointReader(os.path.join(d, f"{name}_ck"))
        assert ref.model_meta["num_experts"] == EXPERTS
        for tp, ep, etp in LAYOUTS:
            back = CheckpointReader(os.path.join(d, f"{name}_from_megatron_{_tag(tp, ep, etp)}"))
            assert back.model_meta == ref.model_meta, (name, tp, ep)
            wa, wb = ref.read_weights(), back.read_weights()
            assert set(wa) == set(wb), (name, tp, ep, set(wa) ^ set(wb))
            for k in wa:
                assert torch.equal(wa[k], wb[k]), (name, tp, ep, k)
            hf_dir = os.path.join(d, f"{name}_hf_{_tag(tp, ep, etp)}")
            b = safetensors_torch.load_file(os.path.join(hf_dir, "model.safetensors"))
            assert set(a) == set(b), (name, tp, ep, set(a) ^ set(b))
            for k in a:
                assert b[k].dtype == torch.float32 and torch.equal(a[k], b[k]), (name, tp, ep, k)
            cfg_b = json.load(open(os.path.join(hf_dir, "config.json")))
            for f in CONFIG_FIELDS + MOE_CONFIG_FIELDS:
                assert cfg_a.get(f) == cfg_b.get(f), (name, tp, ep, f, cfg_a.get(f), cfg_b.get(f))
            flags = _flags(converted["from_megatron_lines"][(name, tp, ep, etp)])
            assert f"--num-experts {EXPERTS}" in flags, flags
            args = build_parser().parse_args(flags.split())
            ours = GPTConfig(**architecture_kwargs(args), **moe_kwargs(args), vocab_size=args.vocab_size,
                             precision="fp32")
            assert ours.arch_meta() == ref.model_meta, (name, tp, ep, flags)


def test_the_files_are_megatron_lm_s_layout_with_experts_by_local_index(converted):
    from zo_megatron.checkpoint import megatron_lm
    from zo_megatron.checkpoint.reader import CheckpointReader

    d = converted["d"]
    for name in converted["names"]:
        ours = CheckpointReader(os.path.join(d, f"{name}_ck")).read_weights()
        for tp, ep, etp in LAYOUTS:
            rel = os.path.join(d, f"{name}_megatron_{_tag(tp, ep, etp)}", "release")
            files = _files(tp, ep, etp)         # global rank -> (TP rank, EP rank, expert TP rank), megatron-core's
            want = {f"mp_rank_{t:02d}" + (f"_{e:03d}" if ep > 1 else ""): (t, e, k) for t, e, k in files.values()}
            assert len(want) == len(files) and sorted(os.listdir(rel)) == sorted(want), (name, tp, ep, etp, files)
            if etp == tp:
                assert len(want) == tp * ep
            dense = {}
            for rank_dir, (t, e, k) in sorted(want.items()):
                sd = megatron_lm.safe_load(os.path.join(rel, rank_dir, megatron_lm.FILE))
                args, model = sd["args"], sd["model"]
                assert (args.num_experts, args.moe_router_topk, args.moe_ffn_hidden_size) == (EXPERTS, TOPK, FFN)
                assert (args.expert_model_parallel_size, args.expert_tensor_parallel_size) == (ep, etp)
                assert args.tensor_model_parallel_size == tp and args.sequence_parallel == (tp > 1)
                assert args.moe_router_pre_softmax == (name == "qwen2_moe")
                assert args.moe_shared_expert_intermediate_size == (SHARED if name == "qwen2_moe" else None)
                assert args.moe_shared_expert_gate == (name == "qwen2_moe")
                assert args.moe_layer_freq == ([1, 0] if name == "qwen2_moe" else 1)
                local = sorted({int(k.split(".")[6]) for k in model if ".mlp.experts.local_experts." in k})
                assert local == list(range(EXPERTS // ep)), (name, tp, ep, local)
                for j in local:
                    g = e * EXPERTS // ep + j                   # the global expert this file holds as local j
                    fc2 = model[f"decoder.layers.0.mlp.experts.local_experts.{j}.linear_fc2.weight"]
                    full = ours[f"gpt.decoder.layers.0.mlp.experts.local_experts.{g}.linear_fc2.weight"]
                    assert torch.equal(fc2, full.chunk(etp, dim=1)[k]), (name, tp, ep, etp, e, j)
                    assert model[f"decoder.layers.0.mlp.experts.local_experts.{j}.linear_fc1._extra_state"] is None
                others = {key: v for key, v in model.items() if ".mlp.experts." not in key}
                proj = ours["gpt.decoder.layers.0.self_attention.linear_proj.weight"]
                assert torch.equal(others["decoder.layers.0.self_attention.linear_proj.weight"],
                                   proj.chunk(tp, dim=1)[t]), (name, tp, ep, etp, rank_dir)
                ref = dense.setdefault(t, others)
                assert set(others) == set(ref) and all(
                    (v is None and ref[key] is None) or torch.equal(v, ref[key]) for key, v in others.items())
                assert model["decoder.layers.0.mlp.router.weight"].shape == (EXPERTS, HIDDEN)
                if name == "qwen2_moe":
                    assert model["decoder.layers.0.mlp.shared_experts.gate_weight"].shape == (1, HIDDEN)
                    assert model["decoder.layers.0.mlp.shared_experts.linear_fc1.weight"].shape == \
                        (2 * SHARED // tp, HIDDEN)
                    assert "decoder.layers.1.mlp.linear_fc1.weight" in model       # the dense layer
                    assert "decoder.layers.1.mlp.router.weight" not in model


def _megatron_core_moe_gpt(args, initialise=False):
    """megatron-core's GPTModel from Megatron-LM's saved args alone (its own decoder block spec with
    the local modules: the dense and MoE layers moe_layer_freq names), as Megatron-LM would build it;
    `initialise`: megatron-core's own random initialisation (on the host, torch's default generator)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    from tests.megatron_reference import megatron_core_config

    cfg = megatron_core_config(args, initialise=initialise)
    spec = get_gpt_decoder_block_spec(cfg, use_transformer_engine=False, normalization=args.normalization)
    return GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=args.padded_vocab_size,
                    max_sequence_length=args.max_position_embeddings,
                    share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                    position_embedding_type=args.position_embedding_type, rotary_base=args.rotary_base,
                    rotary_percent=args.rotary_percent, parallel_output=True)


def _megatron_core_ranks(rank, d, names, tokens):
    from megatron.core import parallel_state as mpu

    from zo_megatron.checkpoint import megatron_lm
    from zo_megatron.parallel import collectives, destroy_parallel, init_parallel

    out = {}
    for tp, ep, etp in LAYOUTS:
        next_port()
        ps = init_parallel(tp, expert_parallel=ep, expert_tensor_parallel=etp)
        e_rank = mpu.get_expert_model_parallel_rank()
        # what this rank's Megatron-LM save would write: (TP, EP, expert TP rank) if its expert DP rank is 0
        out[("saves", tp, ep, etp)] = (mpu.get_tensor_model_parallel_rank(), e_rank,
                                       mpu.get_expert_tensor_parallel_rank()) \
            if mpu.get_expert_data_parallel_rank() == 0 else None
        for name in names:
            rank_dir = f"mp_rank_{ps.tp_rank:02d}" + (f"_{e_rank:03d}" if ep > 1 else "")
            sd = megatron_lm.safe_load(os.path.join(d, f"{name}_megatron_{_tag(tp, ep, etp)}", "release", rank_dir,
                                                    megatron_lm.FILE))
            model = _megatron_core_moe_gpt(sd["args"])
            model.load_state_dict(sd["model"], strict=True)
            model.eval()
            b, s = tokens.shape
            mask = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1)[None, None]
            with torch.no_grad():
                local = model(tokens, torch.arange(s).expand(b, s), mask)
            full = torch.cat(collectives.all_gather_list(local.contiguous(), ps.tp_group), -1) if tp > 1 else local
            out[(name, tp, ep, etp)] = (full[..., :VOCAB].float().clone(), rank_dir)
        collectives.barrier()
        destroy_parallel()
    return out


def test_megatron_core_loads_every_rank_s_file_strictly_with_transformers_logits(converted):
    """Every rank of a live megatron-core world (4 gloo ranks) at each layout loads the file its own TP
    and EP rank name (mp_rank_TT[_EEE]) strictly and gives transformers' logits; the ranks whose expert
    data-parallel rank is 0 -- the ones Megatron-LM's save writes from -- are exactly the files
    to-megatron wrote (megatron_lm.legacy_rank_files), at TP2 x expert TP1 x EP2 global ranks 0 and 1."""
    from zo_megatron.checkpoint import megatron_lm

    d = converted["d"]
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(converted["seed"] + 7))
    world = run_world(_megatron_core_ranks, 4, d, converted["names"], tokens, timeout=400)
    for tp, ep, etp in LAYOUTS:
        saving = [rank_out[("saves", tp, ep, etp)] for rank_out in world]
        assert [s for s in saving if s is not None] == megatron_lm.legacy_rank_files(tp, etp, ep), (tp, ep, etp, saving)
    for name in converted["names"]:
        ref = hf_logits(os.path.join(d, name), tokens)
        for tp, ep, etp in LAYOUTS:
            dirs = set()
            for rank_out in world:
                logits, rank_dir = rank_out[(name, tp, ep, etp)]
                close(logits, ref)
                dirs.add(rank_dir)
            # every file was loaded (at expert TP = TP one per (TP, EP) rank)
            assert len(dirs) == len(megatron_lm.legacy_rank_files(tp, etp, ep)), (name, tp, ep, etp, dirs)
            if etp == tp:
                assert len(dirs) == tp * ep


def test_legacy_rank_files_are_megatron_cores_expert_dp_rank_0_and_unholdable_layouts_refused():
    """megatron_lm.legacy_rank_files (TP, EP, expert TP rank of each file) against megatron-core's own
    RankGenerator for every TP, expert TP, EP in 1..8 and worlds up to 4x the smallest; the layouts the
    torch format cannot hold are refused in one line (two ranks on one file; a TP rank never written)."""
    from zo_megatron.checkpoint import megatron_lm
    from zo_megatron.errors import UserError

    held = refused = 0
    for tp in (1, 2, 4, 8):
        for etp in (1, 2, 4, 8):
            for ep in (1, 2, 4, 8):
                ref = sorted(_files(tp, ep, etp).items())
                ranks = [v for _, v in ref]
                for scale in (2, 4):
                    assert sorted(_files(tp, ep, etp, scale).items()) == ref, (tp, etp, ep, scale)
                names = [(t, e) for t, e, _ in ranks]
                holdable = len(set(names)) == len(names) and {t for t, _ in names} == set(range(tp))
                if holdable:
                    assert megatron_lm.legacy_rank_files(tp, etp, ep) == ranks, (tp, etp, ep)
                    held += 1
                else:
                    with pytest.raises(UserError, match="Megatron-LM's torch checkpoint format cannot hold "
                                                        f"TP{tp} x expert TP{etp} x EP{ep}"):
                        megatron_lm.legacy_rank_files(tp, etp, ep)
                    refused += 1
    assert held and refused, (held, refused)
    assert megatron_lm.legacy_rank_files(2, 1, 2) == [(0, 0, 0), (1, 1, 0)]


def _rewrite_args(path, **changes):
    from zo_megatron.checkpoint import megatron_lm

    sd = megatron_lm.safe_load(path)
    for k, v in changes.items():
        setattr(sd["args"], k, v)
    torch.save(sd, path)


def test_bad_input_is_one_error_line_exit_2_and_nothing_written(converted, tmp_path, capsys):
    from zo_megatron.checkpoint import convert, megatron_lm

    d = converted["d"]
    ck = os.path.join(d, "mixtral_ck")
    meg = os.path.join(d, "mixtral_megatron_tp2_ep2")

    def variant(tag, remove=None, **args):
        dst = str(tmp_path / tag)
        shutil.copytree(meg, dst)
        if remove:
            shutil.rmtree(os.path.join(dst, "release", remove))
        for rank in sorted(os.listdir(os.path.join(dst, "release"))):
            if args:
                _rewrite_args(os.path.join(dst, "release", rank, megatron_lm.FILE), **args)
        return dst

    from_meg = ["from-megatron", "--output", str(tmp_path / "out"), "--tensor-parallel", "1", "--input"]
    dense_ck = str(tmp_path / "dense_ck")
    llama = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                     num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    convert.from_hf(make_hf_model(tmp_path / "llama", llama, converted["seed"] + 11), dense_ck, tensor_parallel=1,
                    log=quiet)
    tp2_ep1_as_etp1 = str(tmp_path / "tp2_ep1_as_etp1")       # TP2 x EP1's files, args saying expert TP 1
    convert.to_megatron(ck, tp2_ep1_as_etp1, tensor_parallel=2, expert_parallel=1, log=quiet)
    for rank in os.listdir(os.path.join(tp2_ep1_as_etp1, "release")):
        _rewrite_args(os.path.join(tp2_ep1_as_etp1, "release", rank, megatron_lm.FILE), expert_tensor_parallel_size=1)
    cases = [
        (["to-megatron", "--load", ck, "--output", str(tmp_path / "out"), "--expert-model-parallel-size", "3"],
         ["--expert-model-parallel-size 3 does not divide the model's 4 experts"]),
        (from_meg + [variant("missing_ep", remove="mp_rank_01_001")],
         ["mp_rank_01_001 is missing", "TP2 x EP2", "incomplete"]),
        (from_meg + [variant("dense_args", num_experts=None)],
         ["args.expert_model_parallel_size=2 but args.num_experts=None", "dense model"]),
        (from_meg + [variant("pad_alltoall", moe_expert_capacity_factor=3.0, moe_pad_expert_input_to_capacity=True,
                             moe_token_dispatcher_type="alltoall")],
         ["--moe-pad-expert-input-to-capacity", "megatron-core's alltoall dispatcher cannot pad"]),
        (from_meg + [variant("drop_policy", moe_expert_capacity_factor=1.0, moe_token_drop_policy="random")],
         ["--moe-token-drop-policy random"]),
        # TP2 x EP2's four files read with args of expert TP 1: its files are mp_rank_00_000 and mp_rank_01_001
        (from_meg + [variant("etp1", expert_tensor_parallel_size=1)],
         ["holds mp_rank_00_001", "TP2 x expert TP1 x EP2", "expert_tensor_parallel_size=1", "different runs"]),
        (from_meg + [tp2_ep1_as_etp1],
         ["args.expert_tensor_parallel_size=1", "cannot hold TP2 x expert TP1 x EP1", "TP rank 1"]),
        (["to-megatron", "--load", ck, "--output", str(tmp_path / "out"), "--tensor-parallel", "1",
          "--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "2"],
         ["cannot hold TP1 x expert TP2 x EP2", "global ranks 0 and 1", "both write mp_rank_00_000"]),
        (["to-megatron", "--load", ck, "--output", str(tmp_path / "out"), "--tensor-parallel", "2",
          "--expert-model-parallel-size", "1", "--expert-tensor-parallel-size", "1"],
         ["cannot hold TP2 x expert TP1 x EP1", "TP rank 1's dense shard is never written"]),
        (["to-megatron", "--load", ck, "--output", str(tmp_path / "out"), "--expert-tensor-parallel-size", "3"],
         ["--expert-tensor-parallel-size 3 does not divide the experts' FFN size 40"]),
        (["to-megatron", "--load", dense_ck, "--output", str(tmp_path / "out"), "--expert-tensor-parallel-size", "2"],
         ["--expert-tensor-parallel-size 2: the model is dense"]),
        (["to-megatron", "--load", dense_ck, "--output", str(tmp_path / "out"), "--expert-model-parallel-size", "2"],
         ["--expert-model-parallel-size 2: the model is dense"]),
        (["to-megatron", "--load", dense_ck, "--output", str(tmp_path / "out"), "--moe-grouped-gemm"],
         ["--moe-grouped-gemm: the model is dense"]),
    ]
    cli = _cli()
    for argv, says in cases:
        capsys.readouterr()
        rc = cli.main(argv)
        lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip() and "%" not in ln]
        assert rc == 2 and len(lines) == 1 and lines[0].startswith("error: "), (argv, lines)
        assert all(s in lines[0] for s in says), (says, lines[0])
        assert not os.path.exists(tmp_path / "out"), argv


def test_capacity_args_convert_both_ways_and_to_hf_refuses_them(converted, tmp_path, capsys):
    """A Megatron-LM MoE checkpoint trained with a capacity factor, padding and the position policy:
    from-megatron records them as the model's (the printed flags give them), to-megatron writes them
    back under Megatron-LM's names, the weights bit for bit; a negative factor reads as no dropping
    (megatron-core's meaning); to-hf refuses in one line (transformers' MoE drops no tokens)."""
    from zo_megatron.checkpoint import convert, megatron_lm
    from zo_megatron.checkpoint.reader import CheckpointReader

    d = converted["d"]
    meg = str(tmp_path / "megatron_capacity")
    shutil.copytree(os.path.join(d, "mixtral_megatron_tp2_ep2"), meg)
    capacity = dict(moe_expert_capacity_factor=1.5, moe_pad_expert_input_to_capacity=True,
                    moe_token_drop_policy="position")
    for rank in os.listdir(os.path.join(meg, "release")):
        _rewrite_args(os.path.join(meg, "release", rank, megatron_lm.FILE), **capacity)
    lines = []
    ours = str(tmp_path / "ours")
    convert.from_megatron(meg, ours, tensor_parallel=1, log=lines.append)
    back, ref = CheckpointReader(ours), CheckpointReader(os.path.join(d, "mixtral_ck"))
    assert back.model_meta == {**ref.model_meta, **capacity}
    wa, wb = ref.read_weights(), back.read_weights()
    assert set(wa) == set(wb) and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert "--moe-expert-capacity-factor 1.5 --moe-pad-expert-input-to-capacity --moe-token-drop-policy position" \
        in _flags(lines), _flags(lines)
    again = str(tmp_path / "megatron_again")
    convert.to_megatron(ours, again, tensor_parallel=2, expert_parallel=2, log=quiet)
    for rank in os.listdir(os.path.join(again, "release")):
        args = megatron_lm.safe_load(os.path.join(again, "release", rank, megatron_lm.FILE))["args"]
        assert {k: getattr(args, k) for k in capacity} == capacity, rank
    for rank in os.listdir(os.path.join(meg, "release")):
        _rewrite_args(os.path.join(meg, "release", rank, megatron_lm.FILE), moe_expert_capacity_factor=-1.0,
                      moe_pad_expert_input_to_capacity=False)
    convert.from_megatron(meg, str(tmp_path / "no_dropping"), tensor_parallel=1, log=quiet)
    meta = CheckpointReader(str(tmp_path / "no_dropping")).model_meta
    assert meta["moe_expert_capacity_factor"] is None and meta["moe_token_drop_policy"] == "position"
    capsys.readouterr()
    rc = _cli().main(["to-hf", "--load", ours, "--output", str(tmp_path / "hf")])
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip() and "%" not in ln]
    assert rc == 2 and len(lines) == 1 and "moe_expert_capacity_factor=1.5" in lines[0], lines
    assert not os.path.exists(tmp_path / "hf")


def test_an_ep1_file_set_read_with_dense_args_is_one_line(converted, tmp_path, capsys):
    """At EP 1 the directories look dense (mp_rank_TT): args without num_experts over files holding experts
    are refused naming both."""
    from zo_megatron.checkpoint import megatron_lm

    dst = str(tmp_path / "ep1_dense_args")
    shutil.copytree(os.path.join(converted["d"], "mixtral_megatron_tp1_ep1"), dst)
    _rewrite_args(os.path.join(dst, "release", "mp_rank_00", megatron_lm.FILE), num_experts=None)
    capsys.readouterr()
    rc = _cli().main(["from-megatron", "--input", dst, "--output", str(tmp_path / "out"), "--tensor-parallel", "1"])
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip() and "%" not in ln]
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("error: "), lines
    assert "args.num_experts=None" in lines[0] and "a dense model" in lines[0], lines[0]
    assert not os.path.exists(tmp_path / "out")


@pytest.mark.slow
def test_qwen3_moe_round_trips_through_megatron_at_tp2_ep2_bit_exact(tmp_path):
    """Qwen3-MoE (q/k norms, head_dim 24 with hidden 64 and 4 heads, norm_topk_prob true): HF -> from-hf ->
    to-megatron TP2 x EP2 -> from-megatron -> to-hf gives every tensor bit for bit, the config's fields and the
    from-hf checkpoint's architecture."""
    from zo_megatron.checkpoint import convert, megatron_lm
    from zo_megatron.checkpoint.reader import CheckpointReader

    seed = fresh_seed("convert megatron qwen3 moe")
    cfg = transformers.Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
                                      num_attention_heads=HEADS, num_key_value_heads=GROUPS, max_position_embeddings=64,
                                      num_experts_per_tok=TOPK, tie_word_embeddings=False, bos_token_id=0,
                                      eos_token_id=1, intermediate_size=56, moe_intermediate_size=FFN,
                                      num_experts=EXPERTS, norm_topk_prob=True, head_dim=24, rms_norm_eps=1e-6,
                                      rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    src = make_hf_model(tmp_path / "src", cfg, seed)
    ck, meg, back, hf_dir = (str(tmp_path / n) for n in ("ck", "meg", "back", "hf"))
    convert.from_hf(src, ck, tensor_parallel=1, log=quiet)
    convert.to_megatron(ck, meg, tensor_parallel=2, expert_parallel=2, log=quiet)
    sd = megatron_lm.safe_load(os.path.join(meg, "release", "mp_rank_01_001", megatron_lm.FILE))
    assert sd["args"].qk_layernorm and sd["args"].kv_channels == 24
    assert sd["model"]["decoder.layers.0.self_attention.q_layernorm.weight"].shape == (24,)
    convert.from_megatron(meg, back, tensor_parallel=2, log=quiet)
    assert CheckpointReader(back).model_meta == CheckpointReader(ck).model_meta
    convert.to_hf(back, hf_dir, log=quiet)
    a = safetensors_torch.load_file(os.path.join(src, "model.safetensors"))
    b = safetensors_torch.load_file(os.path.join(hf_dir, "model.safetensors"))
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a), set(a) ^ set(b)
    cfg_a, cfg_b = (json.load(open(os.path.join(x, "config.json"))) for x in (src, hf_dir))
    for f in CONFIG_FIELDS + MOE_CONFIG_FIELDS:
        assert cfg_a.get(f) == cfg_b.get(f), (f, cfg_a.get(f), cfg_b.get(f))


def _gmm(a, b, batch_sizes, trans_b=False):
    """grouped_gemm.ops.gmm's definition (fanshiqing/grouped_gemm): rows of expert i (batch_sizes[i]
    consecutive rows of a) times b[i] (transposed with trans_b)."""
    out, start = [], 0
    for i, n in enumerate(batch_sizes.tolist()):
        out.append(a[start:start + n] @ (b[i].t() if trans_b else b[i]))
        start += n
    return torch.cat(out) if out else a.new_zeros(0, b.shape[-2 if trans_b else -1])


def _grouped_gemm_world(rank, out_dir, args, tokens, seed, ours_dir):
    """megatron-core's GroupedMLP GPT (--moe-grouped-gemm --moe-use-legacy-grouped-gemm) at TP2 x EP2,
    initialised by megatron-core; the ranks Megatron-LM's save writes from save its state_dict in the
    torch format; then the same ranks build the model from the args of to-megatron --moe-grouped-gemm's
    files (ours_dir) alone and load their rank's file strictly. Every rank returns both models'
    TP-gathered logits."""
    import copy
    import types

    from megatron.core import parallel_state as mpu
    from megatron.core.transformer.moe import grouped_gemm_util as gg

    from zo_megatron.checkpoint import megatron_lm
    from zo_megatron.parallel import collectives, destroy_parallel, init_parallel

    gg.assert_grouped_gemm_is_available = lambda: None          # the grouped_gemm package is CUDA-only
    gg.ops = types.SimpleNamespace(gmm=_gmm)
    ps = init_parallel(2, expert_parallel=2)
    try:
        torch.manual_seed(seed)
        model = _megatron_core_moe_gpt(args, initialise=True)
        for layer in model.decoder.layers:
            experts = layer.mlp.experts
            assert type(experts).__name__ == "GroupedMLP"
            # its forward asserts the bf16 flag (it is written for bf16 runs); the rest of the model stays fp32
            experts.config = copy.copy(experts.config)
            experts.config.bf16 = True
        model.eval()
        if mpu.get_expert_data_parallel_rank() == 0:
            e = mpu.get_expert_model_parallel_rank()
            path = os.path.join(out_dir, "release", f"mp_rank_{ps.tp_rank:02d}_{e:03d}", megatron_lm.FILE)
            os.makedirs(os.path.dirname(path))
            torch.save({"args": args, "checkpoint_version": 3.0, "iteration": 0,
                        "model": model.state_dict_for_save_checkpoint()}, path)
            if rank == 0:
                with open(os.path.join(out_dir, megatron_lm.TRACKER), "w") as f:
                    f.write("release")
        b, s = tokens.shape
        mask = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1)[None, None]

        def logits(m):
            with torch.no_grad():
                local = m(tokens, torch.arange(s).expand(b, s), mask)
            return torch.cat(collectives.all_gather_list(local.contiguous(), ps.tp_group), -1)[..., :VOCAB].float().clone()

        e = mpu.get_expert_model_parallel_rank()
        sd = megatron_lm.safe_load(os.path.join(ours_dir, "release", f"mp_rank_{ps.tp_rank:02d}_{e:03d}", megatron_lm.FILE))
        ours = _megatron_core_moe_gpt(sd["args"])
        for layer in ours.decoder.layers:
            assert type(layer.mlp.experts).__name__ == "GroupedMLP"
            layer.mlp.experts.config = copy.copy(layer.mlp.experts.config)
            layer.mlp.experts.config.bf16 = True
        ours.load_state_dict(sd["model"], strict=True)
        ours.eval()
        return logits(model), logits(ours)
    finally:
        collectives.barrier()
        destroy_parallel()


def test_grouped_gemm_experts_read_as_sequential_ones_with_megatron_cores_logits(converted, tmp_path):
    """A --moe-grouped-gemm run's checkpoint: megatron-core's legacy GroupedMLP (weight1 / weight2, every
    local expert in one tensor), initialised and run by megatron-core itself on 4 gloo ranks (TP2 x EP2;
    grouped_gemm's gmm as its definition, the package being CUDA-only), saved as Megatron-LM does:
    from-megatron -> to-hf gives transformers' logits equal to megatron-core's (fp32, every element).
    The other way: to-megatron --moe-grouped-gemm's files load strictly into the GroupedMLP model
    megatron-core builds from their args alone, with transformers' logits, and read back bit for bit.
    TEGroupedMLP's keys (`linear_fc1.weight{J}`, megatron-core's documented equivalent of SequentialMLP's
    local expert J) read back to the same weights as the SequentialMLP files they rename."""
    from zo_megatron.checkpoint import convert, megatron_lm
    from zo_megatron.checkpoint.reader import CheckpointReader

    d = converted["d"]
    meg = os.path.join(d, "mixtral_megatron_tp2_ep2")
    args = megatron_lm.safe_load(os.path.join(meg, "release", "mp_rank_00_000", megatron_lm.FILE))["args"]
    args.moe_grouped_gemm, args.moe_use_legacy_grouped_gemm = True, True
    seed = converted["seed"] + 21
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(seed))
    grouped, ours_grouped = str(tmp_path / "grouped"), str(tmp_path / "ours_grouped")
    convert.to_megatron(os.path.join(d, "mixtral_ck"), ours_grouped, tensor_parallel=2, expert_parallel=2,
                        grouped_gemm=True, log=quiet)
    ours_sd = megatron_lm.safe_load(os.path.join(ours_grouped, "release", "mp_rank_01_001", megatron_lm.FILE))
    assert ours_sd["args"].moe_grouped_gemm and not any("local_experts" in k for k in ours_sd["model"])
    world = run_world(_grouped_gemm_world, 4, grouped, args, tokens, seed, ours_grouped, timeout=400)
    logits = [init for init, _ in world]
    mixtral_ref = hf_logits(os.path.join(d, "mixtral"), tokens)
    for _, got in world:
        close(got, mixtral_ref)
    convert.from_megatron(ours_grouped, str(tmp_path / "ours_back"), tensor_parallel=2, log=quiet)
    wa = CheckpointReader(os.path.join(d, "mixtral_ck")).read_weights()
    wb = CheckpointReader(str(tmp_path / "ours_back")).read_weights()
    assert set(wa) == set(wb) and all(torch.equal(wa[k], wb[k]) for k in wa)
    saved = megatron_lm.safe_load(os.path.join(grouped, "release", "mp_rank_01_001", megatron_lm.FILE))["model"]
    assert saved["decoder.layers.0.mlp.experts.weight1"].shape == (HIDDEN, EXPERTS // 2 * 2 * FFN // 2)
    assert not any("local_experts" in k for k in saved)
    ours, hf_dir = str(tmp_path / "ours"), str(tmp_path / "hf")
    convert.from_megatron(grouped, ours, tensor_parallel=1, log=quiet)
    convert.to_hf(ours, hf_dir, log=quiet)
    ref = hf_logits(hf_dir, tokens)
    for got in logits:
        close(got, ref)

    te = str(tmp_path / "te_grouped")                   # TEGroupedMLP's names for the SequentialMLP files
    shutil.copytree(meg, te)
    for rank in os.listdir(os.path.join(te, "release")):
        path = os.path.join(te, "release", rank, megatron_lm.FILE)
        sd = megatron_lm.safe_load(path)
        sd["args"].moe_grouped_gemm = True
        renamed = {}
        for k, v in sd["model"].items():
            parts = k.split(".")
            if "local_experts" in parts:
                i = parts.index("local_experts")
                j, layer, rest = parts[i + 1], parts[i + 2], parts[i + 3:]
                if rest == ["_extra_state"]:
                    renamed[".".join(parts[:i] + [layer, "_extra_state"])] = None
                    continue
                k = ".".join(parts[:i] + [layer, rest[0] + j])
            renamed[k] = v
        assert any(k.endswith("mlp.experts.linear_fc1.weight1") for k in renamed)
        torch.save({**sd, "model": renamed}, path)
    convert.from_megatron(te, str(tmp_path / "te_ours"), tensor_parallel=2, log=quiet)
    wa = CheckpointReader(os.path.join(d, "mixtral_ck")).read_weights()
    wb = CheckpointReader(str(tmp_path / "te_ours")).read_weights()
    assert set(wa) == set(wb) and all(torch.equal(wa[k], wb[k]) for k in wa)
