"""tools/convert_checkpoint.py to-megatron / from-megatron for multi-latent attention (MLA, DeepSeek-V2/V3),
both Megatron-LM formats, against megatron-core 0.16.1's own MLA.

Three random models of ours (every weight random, norms around 1; written as a weights-only checkpoint):
a query latent with YaRN (factor, mscale, mscale_all_dim), queries projected directly with plain RoPE, and a
mixture of experts under MLA (DeepSeek-V3's router: sigmoid scores, an expert bias, 2 groups of which 1 is
picked, a scaling factor, a shared expert; layer 0 dense). Tiny sizes (hidden 32, 4 heads, KV latent 16, q
latent 10, head dims 8 + 4 rotated, values 6), fp32, seeds printed:
  - to-megatron --transformer-impl local at TP 1 and 2 (the MoE at TP1 x EP2 and TP2 x EP1): on 2 gloo ranks
    megatron-core's own GPTModel, built from the files' args alone (its local MLA spec; its core attention a
    plain softmax attention that takes MLA's key and value head dims, which megatron-core's local
    DotProductAttention does not), loads each rank's file with load_state_dict(strict=True) and gives our
    model's logits (every element); the down projections are split by rows per rank (the local spec's
    ColumnParallelLinear);
  - from-megatron of those files, of the same files as a Transformer Engine run writes them (the latents'
    norms fused into the up projections, a dense MLP's norm into linear_fc1, the down projections whole on
    every TP rank, TE's extra states), of megatron-core's own torch_dist save of its loaded model, of
    to-megatron's torch_dist and of that torch_dist under Transformer Engine's names gives our weights and
    expert biases back bit for bit and the same architecture;
  - megatron-core's dist_checkpointing.load reads to-megatron's torch_dist into its models at both layouts,
    every tensor equal to the strict load of the torch files; Megatron-LM -> ours -> Megatron-LM gives the
    torch files back tensor for tensor;
  - the printed flags and --use-checkpoint-args give the architecture; the MLA defaults from-megatron
    applies are megatron-core's MLATransformerConfig's;
  - to-megatron's default for MLA, Transformer Engine's names (--transformer-impl transformer_engine), at the
    same layouts: every rank file holds exactly the keys megatron-core's TE spec gives its rank
    (megatron_reference.transformer_engine_state_keys), the down projections whole, the tensors of the local
    files renamed by this test's own _as_transformer_engine_torch; renamed back to the local spec's names
    (test_convert_megatron_dist.te_to_local) megatron-core's local MLA model loads each strictly and gives our
    logits; from-megatron of them and of their torch_dist (keys: te_dist_keys) gives our weights back bit for
    bit;
  - bad input is one line, exit 2, nothing written.
"""
import copy
import io
import os
import shutil

import pytest
import torch

from tests.harness import next_port, run_world
from tests.seeds import fresh_seed
from tests.test_convert_llama import _cli, close, quiet

LAYERS, HIDDEN, HEADS, FFN, VOCAB, SEQ, POS = 2, 32, 4, 40, 203, 10, 64
ITERATION = 5
BASE = dict(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, ffn_hidden_size=FFN, vocab_size=VOCAB,
            max_position_embeddings=POS, position_embedding_type="rope", normalization="RMSNorm",
            layernorm_epsilon=1e-6, swiglu=True, add_bias_linear=False, untie_embeddings_and_output_weights=True,
            qk_layernorm=True, multi_latent_attention=True, kv_lora_rank=16, qk_head_dim=8, qk_pos_emb_head_dim=4,
            v_head_dim=6)
MOE = dict(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=12, moe_router_score_function="sigmoid",
           moe_router_enable_expert_bias=True, moe_router_num_groups=2, moe_router_group_topk=1,
           moe_router_topk_scaling_factor=2.5, moe_shared_expert_intermediate_size=12, moe_layer_freq=[0, 1])
# name: (our architecture, the (TP, EP) layouts to-megatron writes; the torch_dist files are written at the last)
CASES = {
    "q_latent_yarn": ({**BASE, "q_lora_rank": 10, "rope_type": "yarn", "rotary_scaling_factor": 4.0, "mscale": 0.9,
                       "mscale_all_dim": 0.8}, ((1, 1), (2, 1))),
    "q_direct_rope": ({**BASE, "q_lora_rank": None, "rope_type": "rope", "rotary_base": 5000}, ((1, 1), (2, 1))),
    "moe": ({**BASE, **MOE, "q_lora_rank": 10, "rope_type": "yarn", "rotary_scaling_factor": 2.0,
             "mscale_all_dim": 0.5}, ((2, 1), (1, 2))),
}
# Transformer Engine's MLA spec (get_gpt_layer_with_transformer_engine_spec): the latents' norms in the up projections
TE_MLA = {"self_attention.q_layernorm.": "self_attention.linear_q_up_proj.layer_norm_",
          "self_attention.kv_layernorm.": "self_attention.linear_kv_up_proj.layer_norm_"}
DENSE_PRE_MLP = ("pre_mlp_layernorm.", "mlp.linear_fc1.layer_norm_")
DOWN = ("self_attention.linear_q_down_proj.weight", "self_attention.linear_kv_down_proj.weight")


def _tag(tp, ep):
    return f"tp{tp}_ep{ep}"


def _random_model(meta, seed):
    from zo_megatron.checkpoint.arch import buffer_shapes, param_shapes

    g = torch.Generator().manual_seed(seed)
    weights = {k: torch.randn(s, generator=g) * 0.1 + (1.0 if "layernorm" in k else 0.0)
               for k, s in param_shapes(meta).items()}
    return weights, {k: torch.randn(s, generator=g) * 0.1 for k, s in buffer_shapes(meta).items()}


def _te_name(key: str, dense_layers: set) -> str:
    """A local-spec key under Transformer Engine's MLA spec's name (`decoder.layers.<i>.` or stacked
    `decoder.layers.`; dense_layers: the layer prefixes whose MLP is dense, whose norm TE fuses into fc1)."""
    for local, te in TE_MLA.items():
        if local in key:
            return key.replace(local, te)
    prefix, sep, rest = key.partition(DENSE_PRE_MLP[0])
    if sep and prefix in dense_layers:
        return prefix + DENSE_PRE_MLP[1] + rest
    return key


def _as_transformer_engine_torch(src, dst):
    """The torch-format files of `src` as a Transformer Engine run saves them: TE's names, the down
    projections whole on every TP rank (a duplicated TELinear), TE's extra states (BytesIO)."""
    from zo_megatron.checkpoint import megatron_lm

    rel = os.path.join(src, "release")
    files = {n: megatron_lm.safe_load(os.path.join(rel, n, megatron_lm.FILE)) for n in sorted(os.listdir(rel))}
    by_tp = {}
    for n, sd in files.items():
        by_tp.setdefault(int(n[8:10]), sd["model"])
    whole = {k: torch.cat([by_tp[t][k] for t in sorted(by_tp)]) for k in by_tp[0] if k.endswith(DOWN)}
    for n, sd in files.items():
        model = sd["model"]
        dense = {k.partition("mlp.")[0] for k in model if k.endswith("mlp.linear_fc1.weight")}
        renamed = {_te_name(k, dense): whole.get(k, v) for k, v in model.items()}
        sd["model"] = {k: io.BytesIO(b"te") if k.endswith("_extra_state") else v for k, v in renamed.items()}
        os.makedirs(os.path.join(dst, "release", n))
        torch.save(sd, os.path.join(dst, "release", n, megatron_lm.FILE))
    shutil.copy(os.path.join(src, megatron_lm.TRACKER), dst)
    return dst


def _as_transformer_engine_dist(src, dst, it_dir, num_experts):
    """A torch_dist checkpoint's model tensors under Transformer Engine's MLA names (the rest dropped)."""
    import torch.distributed.checkpoint as dcp

    from zo_megatron.checkpoint import megatron_dist, megatron_lm
    from zo_megatron.checkpoint.safe_load import read_dcp_metadata

    d = os.path.join(src, it_dir)
    tensors = megatron_dist._load(d, megatron_dist._model_keys(read_dcp_metadata(d), d))
    # stacked layers are all dense without experts; with moe_layer_freq [0, 1] layer 0 is
    dense = {"decoder.layers."} if not num_experts else {"decoder.layers.0."}
    renamed = {_te_name(k, dense): t for k, t in tensors.items()}
    assert set(renamed) != set(tensors)
    out = os.path.join(dst, it_dir)
    os.makedirs(out)
    dcp.save(renamed, storage_writer=dcp.FileSystemWriter(out), no_dist=True)
    for f in ("common.pt", "metadata.json"):
        shutil.copy(os.path.join(d, f), out)
    shutil.copy(os.path.join(src, megatron_lm.TRACKER), dst)
    return dst


def _megatron_core_mla_gpt(args):
    """megatron-core's GPTModel from Megatron-LM's saved args alone: its local spec with MLA (its decoder
    block spec with experts), the core attention megatron_reference's (see the module doc)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec

    from tests.megatron_reference import megatron_core_config, mla_core_attention

    cfg = megatron_core_config(args)
    assert type(cfg).__name__ == "MLATransformerConfig"
    if getattr(args, "num_experts", None):
        spec = get_gpt_decoder_block_spec(cfg, use_transformer_engine=False, normalization=args.normalization)
        layers = spec.layer_specs
    else:
        spec = get_gpt_layer_local_spec(normalization=args.normalization, qk_layernorm=args.qk_layernorm,
                                        multi_latent_attention=True)
        layers = [spec]
    for layer in layers:
        assert layer.submodules.self_attention.module.__name__ == "MLASelfAttention"
        layer.submodules.self_attention.submodules.core_attention = mla_core_attention()
    return GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=args.padded_vocab_size,
                    max_sequence_length=args.max_position_embeddings,
                    share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                    position_embedding_type=args.position_embedding_type, rotary_base=args.rotary_base,
                    rotary_percent=args.rotary_percent, parallel_output=True)


def _world(rank, d, tokens, seed):
    """Per case: our model's logits (TP 1); per layout megatron-core's model loads its rank's file strictly
    (logits gathered over TP), megatron-core's dist_checkpointing loads to-megatron's torch_dist into a
    second model (compared with the first, every tensor), and at the case's last layout megatron-core saves
    its loaded model as Megatron-LM's torch_dist save does."""
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as mpu
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
    from megatron.core.dist_checkpointing.validation import StrictHandling

    from tests.test_convert_megatron_dist import _in_process_writes
    from tests.test_convert_megatron_te import te_rank_check
    from zo_megatron.checkpoint import megatron_lm
    from zo_megatron.checkpoint.content import persistent_buffers
    from zo_megatron.checkpoint.reader import CheckpointReader
    from zo_megatron.model import GPTConfig, build_gpt_model
    from zo_megatron.model.sharding import load_full_params
    from zo_megatron.parallel import collectives, destroy_parallel, init_parallel

    torch.cuda.synchronize = lambda *a, **k: None      # the save strategy's D2H sync; nothing is on a GPU here
    _in_process_writes()
    b, s = tokens.shape
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1)[None, None]
    out = {}
    next_port()
    init_parallel(1)
    for name in CASES:
        reader = CheckpointReader(os.path.join(d, f"{name}_ck"))
        cfg = GPTConfig(**reader.model_meta, precision="fp32", attention_backend="sdpa")
        model = build_gpt_model(cfg, 0, 1, seed).eval()
        load_full_params(model, reader.read_weights(), 0, 1, VOCAB)
        buffers = _weights(os.path.join(d, f"{name}_ck"))[2]
        full_name = getattr(model, "full_name", lambda n: n)
        held = persistent_buffers(model)
        assert len(held) == len(buffers), (name, sorted(held), sorted(buffers))
        for n, t in held.items():
            t.data.copy_(buffers[f"buffers/{full_name(n)}"])
        with torch.no_grad():
            out[("ours", name)] = model(tokens)[..., :VOCAB].clone()
    destroy_parallel()
    for name, (_, layouts) in CASES.items():
        for tp, ep in layouts:
            next_port()
            ps = init_parallel(tp, expert_parallel=ep)
            e = mpu.get_expert_model_parallel_rank()
            rank_dir = megatron_lm.rank_dir(ps.tp_rank, e, ep)
            sd = megatron_lm.safe_load(os.path.join(d, f"{name}_megatron_{_tag(tp, ep)}", "release", rank_dir,
                                                    megatron_lm.FILE))
            ref = _megatron_core_mla_gpt(sd["args"])
            ref.load_state_dict(sd["model"], strict=True)
            ref.eval()
            with torch.no_grad():
                local = ref(tokens, torch.arange(s).expand(b, s), mask)
            full = torch.cat(collectives.all_gather_list(local.contiguous(), ps.tp_group), -1) if tp > 1 else local
            out[("megatron-core", name, tp, ep)] = (full[..., :VOCAB].clone(), rank_dir)
            # to-megatron's Transformer Engine files of this rank: their keys against megatron-core's TE spec, and
            # renamed to the local spec's, megatron-core's local MLA model loading them strictly
            te = te_rank_check(os.path.join(d, f"{name}_te_{_tag(tp, ep)}", "release", rank_dir, megatron_lm.FILE),
                               ps.tp_rank, tp, _megatron_core_mla_gpt, tokens, ps.tp_group)
            out[("te", name, tp, ep)] = {**te, "logits": te["logits"][..., :VOCAB].clone(), "rank_dir": rank_dir}
            metadata = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True,
                        "dp_cp_group": mpu.get_data_parallel_group(with_context_parallel=True)}
            # megatron-core's own load of to-megatron's torch_dist at this layout
            other = _megatron_core_mla_gpt(sd["args"])
            loaded = dist_checkpointing.load({"model": other.sharded_state_dict(metadata=metadata)},
                                             os.path.join(d, f"{name}_dist", "release"),
                                             strict=StrictHandling.ASSUME_OK_UNEXPECTED)
            other.load_state_dict(loaded["model"], strict=True)
            got, want = other.state_dict(), ref.state_dict()
            tensors = [k for k, v in want.items() if torch.is_tensor(v)]
            bad = [k for k in tensors if not torch.equal(got[k], want[k])]
            assert not bad, (name, tp, ep, bad)
            out[("dist load", name, tp, ep)] = len(tensors)
            if (tp, ep) == layouts[-1]:          # Megatron-LM's save_checkpoint at --ckpt-format torch_dist
                args = copy.copy(sd["args"])
                args.ckpt_format, args.iteration = "torch_dist", ITERATION
                rng = ShardedObject("rng_state", [{"random_rng_state": torch.get_rng_state()}], (1, tp),
                                    (0, ps.tp_rank), replica_id=mpu.get_data_parallel_rank(with_context_parallel=True))
                state = {"args": args, "checkpoint_version": 3.0, "iteration": ITERATION, "rng_state": rng,
                         "num_floating_point_operations_so_far": 0,
                         "model": ref.sharded_state_dict(metadata=metadata)}
                root = os.path.join(d, f"{name}_saved_dist")
                it_dir = os.path.join(root, f"iter_{ITERATION:07d}")
                if rank == 0:
                    os.makedirs(it_dir)
                collectives.barrier()
                dist_checkpointing.save(state, it_dir, get_default_save_sharded_strategy("torch_dist"),
                                        content_metadata={k: v for k, v in metadata.items() if k != "dp_cp_group"})
                if rank == 0:
                    with open(os.path.join(root, megatron_lm.TRACKER), "w") as f:
                        f.write(str(ITERATION))
            collectives.barrier()
            destroy_parallel()
    return out


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    from zo_megatron.checkpoint import convert
    from zo_megatron.checkpoint.arch import full_meta

    seed = fresh_seed("convert megatron mla")
    d = tmp_path_factory.mktemp("megatron_mla")
    lines = {}
    for i, (name, (arch, layouts)) in enumerate(CASES.items()):
        meta = full_meta(arch)
        weights, buffers = _random_model(meta, seed + i)
        ck = str(d / f"{name}_ck")
        convert._write_weights_checkpoint(ck, weights, meta, tp=1, converted_from="a random MLA model (test)",
                                          args={"make_vocab_size_divisible_by": 128}, force=False, log=quiet,
                                          buffers=buffers)
        for tp, ep in layouts:
            meg = str(d / f"{name}_megatron_{_tag(tp, ep)}")
            lines[("to", name, tp, ep)] = []
            convert.to_megatron(ck, meg, tensor_parallel=tp, expert_parallel=ep, transformer_impl="local",
                                log=lines[("to", name, tp, ep)].append)
            lines[("te", name, tp, ep)] = []          # the default for MLA: Transformer Engine's names
            convert.to_megatron(ck, str(d / f"{name}_te_{_tag(tp, ep)}"), tensor_parallel=tp, expert_parallel=ep,
                                log=lines[("te", name, tp, ep)].append)
        tp, ep = layouts[-1]
        convert.to_megatron(ck, str(d / f"{name}_dist"), tensor_parallel=tp, expert_parallel=ep,
                            ckpt_format="torch_dist", transformer_impl="local", log=quiet)
        convert.to_megatron(ck, str(d / f"{name}_te_dist"), tensor_parallel=tp, expert_parallel=ep,
                            ckpt_format="torch_dist", log=quiet)
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(seed + 17))
    world = run_world(_world, 2, str(d), tokens, seed, timeout=400)
    return {"d": str(d), "seed": seed, "world": world, "lines": lines}


def _weights(ck):
    from zo_megatron.checkpoint.reader import CheckpointReader

    from zo_megatron.checkpoint.arch import buffer_shapes

    r = CheckpointReader(ck)
    names = [f"buffers/{n}" for n in buffer_shapes(r.model_meta)]
    return r.model_meta, r.read_weights(), r.read_full(names) if names else {}


def _assert_same_model(a, b, what):
    meta_a, wa, ba = _weights(a)
    meta_b, wb, bb = _weights(b)
    assert meta_a == meta_b, (what, {k: (v, meta_b.get(k)) for k, v in meta_a.items() if meta_b.get(k) != v})
    assert set(wa) == set(wb), (what, set(wa) ^ set(wb))
    for k in wa:
        assert wb[k].dtype == torch.float32 and torch.equal(wa[k], wb[k]), (what, k)
    assert set(ba) == set(bb) and all(torch.equal(ba[k], bb[k]) for k in ba), (what, sorted(ba), sorted(bb))


def test_megatron_core_loads_every_rank_s_file_strictly_with_our_logits(built):
    """megatron-core's own MLA GPTModel, built from the args alone, loads each rank's file strictly at TP 1
    and 2 (the MoE at TP2 x EP1 and TP1 x EP2) and its logits are our model's, every element."""
    for name, (_, layouts) in CASES.items():
        ours = built["world"][0][("ours", name)]
        assert ours.shape == (2, SEQ, VOCAB)
        for tp, ep in layouts:
            dirs = set()
            for rank_out in built["world"]:
                logits, rank_dir = rank_out[("megatron-core", name, tp, ep)]
                close(logits, ours)
                dirs.add(rank_dir)
            assert len(dirs) == tp * ep, (name, tp, ep, dirs)       # every rank's file was loaded


def test_the_files_are_the_local_spec_s_with_megatron_lm_s_mla_args(built):
    from zo_megatron.checkpoint import megatron_lm

    d = built["d"]
    for name, (arch, layouts) in CASES.items():
        _, ours, buffers = _weights(os.path.join(d, f"{name}_ck"))
        for tp, ep in layouts:
            rel = os.path.join(d, f"{name}_megatron_{_tag(tp, ep)}", "release")
            assert sorted(os.listdir(rel)) == sorted(megatron_lm.rank_dir(t, e, ep) for t in range(tp)
                                                     for e in range(ep))
            for rank_dir in os.listdir(rel):
                t = int(rank_dir[8:10])
                sd = megatron_lm.safe_load(os.path.join(rel, rank_dir, megatron_lm.FILE))
                args, model = sd["args"], sd["model"]
                assert args.multi_latent_attention and not args.group_query_attention
                for k in ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim",
                          "rope_type"):
                    assert getattr(args, k) == arch[k], (name, k)
                for k in ("rotary_scaling_factor", "mscale", "mscale_all_dim"):
                    assert getattr(args, k) == arch.get(k, {"rotary_scaling_factor": 1.0, "mscale": 1.0,
                                                            "mscale_all_dim": 0.0}[k]), (name, k)
                for i in range(LAYERS):
                    a = f"decoder.layers.{i}.self_attention."
                    down = ["linear_kv_down_proj"] + (["linear_q_down_proj"] if arch["q_lora_rank"] else [])
                    for proj in down:          # the local spec's ColumnParallelLinear: this rank's rows
                        assert torch.equal(model[f"{a}{proj}.weight"], ours[f"gpt.{a}{proj}.weight"].chunk(tp)[t])
                        assert model[f"{a}{proj}._extra_state"] is None
                    assert (f"{a}linear_q_proj.weight" in model) == (arch["q_lora_rank"] is None)
                    assert torch.equal(model[f"{a}kv_layernorm.weight"], ours[f"gpt.{a}kv_layernorm.weight"])
                    assert not any(k.startswith(a + "linear_qkv") for k in model)
                if name == "moe":
                    assert torch.equal(model["decoder.layers.1.mlp.router.expert_bias"],
                                       buffers["buffers/gpt.decoder.layers.1.mlp.router.expert_bias"])
                    assert (args.moe_router_num_groups, args.moe_router_group_topk) == (2, 1)
        note = [ln for ln in built["lines"][("to", name, *layouts[0])] if "note: launch Megatron-LM with" in ln]
        assert len(note) == 1 and "--multi-latent-attention" in note[0], note
        assert f"--rope-type {arch['rope_type']}" in note[0], note
        (warning,) = [ln for ln in built["lines"][("to", name, *layouts[0])] if "--transformer-impl local:" in ln]
        assert "no Megatron-LM run loads them" in warning and "--transformer-impl transformer_engine" in warning


def test_from_megatron_gives_our_weights_back_bit_for_bit_from_every_form(built, tmp_path):
    """The torch files (local and Transformer Engine names), megatron-core's own torch_dist save, to-megatron's
    torch_dist and that under Transformer Engine's names: each back to our weights, expert biases and
    architecture, bit for bit."""
    from zo_megatron.checkpoint import convert, megatron_lm

    d = built["d"]
    for name, (arch, layouts) in CASES.items():
        ck = os.path.join(d, f"{name}_ck")
        sources = {f"torch {_tag(*lay)}": os.path.join(d, f"{name}_megatron_{_tag(*lay)}") for lay in layouts}
        last = os.path.join(d, f"{name}_megatron_{_tag(*layouts[-1])}")
        sources["torch, Transformer Engine's"] = _as_transformer_engine_torch(last, str(tmp_path / f"{name}_te"))
        sources["torch_dist, megatron-core's save"] = os.path.join(d, f"{name}_saved_dist")
        sources["torch_dist, to-megatron's"] = os.path.join(d, f"{name}_dist")
        sources["torch_dist, Transformer Engine's"] = _as_transformer_engine_dist(
            os.path.join(d, f"{name}_saved_dist"), str(tmp_path / f"{name}_te_dist"), f"iter_{ITERATION:07d}",
            arch.get("num_experts"))
        for i, (what, src) in enumerate(sources.items()):
            back = str(tmp_path / f"{name}_back_{i}")
            convert.from_megatron(src, back, tensor_parallel=2, log=quiet)
            _assert_same_model(ck, back, (name, what))
        te = os.path.join(sources["torch, Transformer Engine's"], "release")
        model = megatron_lm.safe_load(os.path.join(te, sorted(os.listdir(te))[-1], megatron_lm.FILE))["model"]
        assert "decoder.layers.0.self_attention.linear_kv_up_proj.layer_norm_weight" in model
        assert model["decoder.layers.0.self_attention.linear_kv_down_proj.weight"].shape[0] == 16 + 4


def test_transformer_engine_files_by_default_hold_the_te_spec_s_keys_and_load_as_the_local_spec(built, tmp_path):
    """MLA's default, --transformer-impl transformer_engine: (c) every rank file holds exactly the keys megatron-
    core's TE MLA spec gives its rank (tests/megatron_reference.transformer_engine_state_keys: input_layernorm a
    TENorm, the latents' norms fused into the up projections, a dense layer's pre-MLP norm into linear_fc1, an
    MoE layer's a TENorm, every TE module's extra state, TE's empty one), the down projections whole on every TP
    rank, and tensor for tensor what the test's own renaming of the local files (_as_transformer_engine_torch)
    gives; (b) renamed to the local spec's names (te_to_local: the down projections cut by rows), megatron-core's
    local MLA model loads each strictly and computes our logits, every element; the launch line names the
    implementation."""
    from zo_megatron.checkpoint import megatron_lm

    d = built["d"]
    for name, (arch, layouts) in CASES.items():
        ours_logits = built["world"][0][("ours", name)]
        _, ours, _ = _weights(os.path.join(d, f"{name}_ck"))
        for tp, ep in layouts:
            dirs = set()
            for rank_out in built["world"]:
                got = rank_out[("te", name, tp, ep)]
                keys, spec = set(got["keys"]), set(got["spec"])
                assert keys == spec, (name, tp, ep, got["rank_dir"], sorted(keys - spec), sorted(spec - keys))
                assert got["states"].pop("output_layer._extra_state") is None
                assert set(got["states"].values()) == {("torch.uint8", (0,))}, (name, got["states"])
                close(got["logits"], ours_logits)
                dirs.add(got["rank_dir"])
            assert len(dirs) == tp * ep, (name, tp, ep, dirs)
            (line,) = [ln for ln in built["lines"][("te", name, tp, ep)] if "load it in Megatron-LM with" in ln]
            assert "--transformer-impl transformer_engine (Transformer Engine's layer names" in line, line
            assert not any("--transformer-impl local:" in ln for ln in built["lines"][("te", name, tp, ep)])
            rel = os.path.join(d, f"{name}_te_{_tag(tp, ep)}", "release")
            for rank_dir in os.listdir(rel):
                sd = megatron_lm.safe_load(os.path.join(rel, rank_dir, megatron_lm.FILE))
                assert sd["args"].transformer_impl == "transformer_engine"
                for i in range(LAYERS):
                    a = f"decoder.layers.{i}.self_attention."
                    for proj in ["linear_kv_down_proj"] + (["linear_q_down_proj"] if arch["q_lora_rank"] else []):
                        assert torch.equal(sd["model"][f"{a}{proj}.weight"], ours[f"gpt.{a}{proj}.weight"]), \
                            (name, proj)
        # the test's own renaming of the local files as a Transformer Engine run saves them: the same tensors
        last = _tag(*layouts[-1])
        simulated = _as_transformer_engine_torch(os.path.join(d, f"{name}_megatron_{last}"), str(tmp_path / name))
        for rank_dir in os.listdir(os.path.join(simulated, "release")):
            a, b = (megatron_lm.safe_load(os.path.join(root, "release", rank_dir, megatron_lm.FILE))["model"]
                    for root in (simulated, os.path.join(d, f"{name}_te_{last}")))
            ta, tb = ({k for k, v in m.items() if torch.is_tensor(v) and not k.endswith("_extra_state")}
                      for m in (a, b))
            assert ta == tb, (name, rank_dir, sorted(ta ^ tb))
            assert all(torch.equal(a[k], b[k]) for k in ta), name


def test_transformer_engine_files_read_back_bit_for_bit_in_both_formats(built, tmp_path):
    """(a) from-megatron of to-megatron's Transformer Engine files at every layout and of its Transformer Engine
    torch_dist: our weights, expert biases and architecture bit for bit; the torch_dist's keys are the TE rank
    files' as megatron-core's sharded_state_dict stacks them (te_dist_keys): input_layernorm, the fused latent
    norms, an MoE layer's pre_mlp_layernorm under TE's names (the local MLA spec's torch_dist keeps the local
    ones), every TE norm's extra state."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from tests.test_convert_megatron_te import te_dist_keys
    from zo_megatron.checkpoint import convert, megatron_lm
    from zo_megatron.checkpoint.safe_load import read_dcp_metadata

    d = built["d"]
    for name, (arch, layouts) in CASES.items():
        ck = os.path.join(d, f"{name}_ck")
        sources = [os.path.join(d, f"{name}_te_{_tag(*lay)}") for lay in layouts] + [os.path.join(d, f"{name}_te_dist")]
        for i, src in enumerate(sources):
            back = str(tmp_path / f"{name}_{i}")
            convert.from_megatron(src, back, tensor_parallel=2, log=quiet)
            _assert_same_model(ck, back, (name, src))
        ep1 = next(lay for lay in layouts if lay[1] == 1)             # a rank file with every expert
        rank0 = built["world"][0][("te", name, *ep1)]
        rel = os.path.join(d, f"{name}_te_dist", "release")
        md = read_dcp_metadata(rel).state_dict_metadata
        tensors = {k for k, v in md.items() if isinstance(v, TensorStorageMetadata)}
        args = megatron_lm.safe_load(os.path.join(rel, "common.pt"), model=False)["args"]
        want_tensors, want_objects = te_dist_keys(rank0["keys"], args)
        assert tensors == want_tensors, (name, sorted(tensors ^ want_tensors))
        assert set(md) - tensors == want_objects, (name, sorted((set(md) - tensors) ^ want_objects))
        layer = "decoder.layers." if "num_experts" not in arch else "decoder.layers.0."
        assert f"{layer}self_attention.linear_kv_up_proj.layer_norm_weight" in tensors
        assert f"{layer}input_layernorm.weight" in tensors and f"{layer}mlp.linear_fc1.layer_norm_weight" in tensors
        assert args.transformer_impl == "transformer_engine"


def test_torch_dist_is_megatron_core_s_and_loads_at_both_layouts(built):
    """to-megatron's torch_dist holds the keys and global shapes megatron-core's local MLA saves (its norms
    under their own names: the local MLA spec maps none to Transformer Engine's; the down projections whole),
    and megatron-core's dist_checkpointing.load reads it at every layout equal to the strict load (asserted
    in the world)."""
    from zo_megatron.checkpoint.safe_load import read_dcp_metadata

    d = built["d"]
    for name, (arch, layouts) in CASES.items():
        for rank_out in built["world"]:
            for tp, ep in layouts:
                assert rank_out[("dist load", name, tp, ep)] > 10
        ours = read_dcp_metadata(os.path.join(d, f"{name}_dist", "release")).state_dict_metadata
        theirs = read_dcp_metadata(os.path.join(d, f"{name}_saved_dist",
                                                f"iter_{ITERATION:07d}")).state_dict_metadata
        model = {k: tuple(v.size) for k, v in theirs.items()
                 if k.startswith(("embedding.", "decoder.", "output_layer.")) and "_extra_state" not in k}
        assert model == {k: tuple(ours[k].size) for k in model}, name
        layer = "decoder.layers." if "num_experts" not in arch else "decoder.layers.0."
        stack = (LAYERS,) if "num_experts" not in arch else ()
        assert model[f"{layer}self_attention.linear_kv_down_proj.weight"] == (*stack, 16 + 4, HIDDEN)
        assert f"{layer}input_layernorm.weight" in model and f"{layer}pre_mlp_layernorm.weight" in model
        assert f"{layer}self_attention.kv_layernorm.weight" in model
        assert not any("layer_norm_weight" in k for k in ours), name


def test_megatron_to_ours_to_megatron_gives_the_files_back(built, tmp_path):
    """megatron-core's torch_dist save -> from-megatron -> to-megatron torch at its layout: every rank file's
    tensors are to-megatron's original files'."""
    from zo_megatron.checkpoint import convert, megatron_lm

    d = built["d"]
    for name, (_, layouts) in CASES.items():
        tp, ep = layouts[-1]
        ours, again = str(tmp_path / f"{name}_ours"), str(tmp_path / f"{name}_again")
        convert.from_megatron(os.path.join(d, f"{name}_saved_dist"), ours, tensor_parallel=1, log=quiet)
        convert.to_megatron(ours, again, tensor_parallel=tp, expert_parallel=ep, transformer_impl="local", log=quiet)
        rel = os.path.join(d, f"{name}_megatron_{_tag(tp, ep)}", "release")
        for rank_dir in os.listdir(rel):
            a = megatron_lm.safe_load(os.path.join(rel, rank_dir, megatron_lm.FILE))["model"]
            b = megatron_lm.safe_load(os.path.join(again, "release", rank_dir, megatron_lm.FILE))["model"]
            assert set(a) == set(b), (name, set(a) ^ set(b))
            assert all((a[k] is None and b[k] is None) or torch.equal(a[k], b[k]) for k in a), name


def test_the_printed_flags_and_use_checkpoint_args_give_the_architecture(built, tmp_path):
    from zo_megatron.checkpoint import convert
    from zo_megatron.model import GPTConfig
    from zo_megatron.training.arguments import build_parser, parse_args
    from zo_megatron.training.model_flags import architecture_kwargs, moe_kwargs

    d = built["d"]
    for name in CASES:
        meta = _weights(os.path.join(d, f"{name}_ck"))[0]
        lines, back = [], str(tmp_path / name)
        convert.from_megatron(os.path.join(d, f"{name}_saved_dist"), back, tensor_parallel=1, log=lines.append)
        (flags,) = [ln.removeprefix("  model flags: ") for ln in lines if ln.startswith("  model flags: ")]
        assert "--multi-latent-attention" in flags, flags
        args = build_parser().parse_args(flags.split())
        cfg = GPTConfig(**architecture_kwargs(args), **moe_kwargs(args), vocab_size=VOCAB, precision="fp32",
                        attention_backend="sdpa")
        assert cfg.arch_meta() == meta, (name, flags)
        args = parse_args(["--use-checkpoint-args", "--load", back, "--micro-batch-size", "1", "--train-iters", "1",
                           "--lr", "1e-4"])
        cfg = GPTConfig(**architecture_kwargs(args), **moe_kwargs(args), vocab_size=VOCAB, precision="fp32",
                        attention_backend=args.core_attention)
        assert cfg.arch_meta() == meta, name


def test_mla_defaults_from_megatron_applies_are_megatron_core_s():
    """A Megatron-LM MLA run's field its args lack is MLATransformerConfig's default (Megatron-LM's
    core_transformer_config_from_args), YaRN's original context and betas always (no arg gives them)."""
    import argparse
    import dataclasses

    from megatron.core.transformer.transformer_config import MLATransformerConfig

    from zo_megatron.checkpoint import megatron_args

    defaults = {f.name: f.default for f in dataclasses.fields(MLATransformerConfig)}
    ours = {{"yarn_original_max_position_embeddings": "original_max_position_embeddings", "yarn_beta_fast": "beta_fast",
             "yarn_beta_slow": "beta_slow"}.get(k, k): v for k, v in megatron_args.MLA_CONFIG_DEFAULTS.items()}
    assert ours == {k: defaults[k] for k in ours}
    args = argparse.Namespace(num_layers=1, hidden_size=32, num_attention_heads=4, ffn_hidden_size=40,
                              max_position_embeddings=64, position_embedding_type="none", multi_latent_attention=True,
                              q_lora_rank=None, kv_lora_rank=16, qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=6,
                              rope_type=None, rotary_percent=0.5, use_rope_scaling=True, normalization="RMSNorm")
    meta = megatron_args.meta_from_args(args, VOCAB, "x")
    # megatron-core's MLA: YaRN (ignores the rotary percent), its factor 40 where the args have none, no
    # position table (GPTModel's 'none' = 'rope' under MLA), no Llama-3.1 scaling (GPTModel builds no RoPE)
    assert (meta["rope_type"], meta["rotary_scaling_factor"], meta["rotary_percent"]) == ("yarn", 40.0, 1.0)
    assert meta["position_embedding_type"] == "rope" and not meta["use_rope_scaling"]
    yarn = ("yarn_original_max_position_embeddings", "yarn_beta_fast", "yarn_beta_slow")
    assert tuple(meta[k] for k in yarn) == (4096, 32, 1)


def _rewrite_args(path, **changes):
    from zo_megatron.checkpoint import megatron_lm

    sd = megatron_lm.safe_load(path)
    for k, v in changes.items():
        setattr(sd["args"], k, v)
    torch.save(sd, path)


def test_bad_input_is_one_error_line_exit_2_and_nothing_written(built, tmp_path, capsys):
    from zo_megatron.checkpoint import convert, megatron_lm
    from zo_megatron.checkpoint.arch import full_meta

    d = built["d"]
    one = os.path.join(d, "q_latent_yarn_megatron_tp1_ep1")

    def variant(tag, **args):
        dst = str(tmp_path / tag)
        shutil.copytree(one, dst)
        _rewrite_args(os.path.join(dst, "release", "mp_rank_00", megatron_lm.FILE), **args)
        return dst

    te = _as_transformer_engine_torch(os.path.join(d, "q_latent_yarn_megatron_tp2_ep1"), str(tmp_path / "te"))
    path = os.path.join(te, "release", "mp_rank_01", megatron_lm.FILE)
    sd = megatron_lm.safe_load(path)
    sd["model"]["decoder.layers.1.self_attention.linear_kv_down_proj.weight"][0, 0] += 1.0
    torch.save(sd, path)
    yarn16 = str(tmp_path / "yarn16_ck")
    meta = full_meta({**CASES["q_latent_yarn"][0], "yarn_original_max_position_embeddings": 16})
    convert._write_weights_checkpoint(yarn16, _random_model(meta, built["seed"])[0], meta, tp=1, converted_from="test",
                                      args={}, force=False, log=quiet)
    out = str(tmp_path / "out")
    from_meg = ["from-megatron", "--output", out, "--tensor-parallel", "1", "--input"]
    cases = [
        (["to-megatron", "--load", yarn16, "--output", out],
         ["yarn_original_max_position_embeddings=16", "Megatron-LM's MLA takes no arg for them"]),
        (["to-megatron", "--load", os.path.join(d, "q_latent_yarn_ck"), "--output", out, "--tensor-parallel", "4"],
         ["--tensor-parallel 4 does not divide the model's q_lora_rank 10"]),
        (from_meg + [te], ["linear_kv_down_proj.weight differs from mp_rank_00's", "duplicated"]),
        (from_meg + [variant("mrope", rope_type="mrope")], ["args.rope_type='mrope' with multi_latent_attention"]),
        (from_meg + [variant("yarn_no_mla", multi_latent_attention=False)],
         ["args.rope_type='yarn' without multi_latent_attention"]),
        (from_meg + [variant("gqa", group_query_attention=True, num_query_groups=2)],
         ["--num-query-groups 2 with --multi-latent-attention"]),
        (from_meg + [variant("yarn_positions", position_embedding_type="yarn",
                                     use_rotary_position_embeddings=False)],
         ["--position-embedding-type yarn with --multi-latent-attention"]),
        (from_meg + [variant("l2", qk_l2_norm=True)], ["args.qk_l2_norm=True"]),
        (from_meg + [variant("dsa", experimental_attention_variant="dsa")],
         ["args.experimental_attention_variant='dsa'"]),
        (from_meg + [variant("kv_rank", kv_lora_rank=8)], ["the weights do not match the model its args describe"]),
        (from_meg + [variant("no_kv_rank", kv_lora_rank=None)], ["args.kv_lora_rank=None with multi_latent_attention"]),
    ]
    cli = _cli()
    for argv, says in cases:
        capsys.readouterr()
        rc = cli.main(argv)
        lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip() and "%" not in ln]
        assert rc == 2 and len(lines) == 1 and lines[0].startswith("error: "), (argv[-1], lines)
        assert all(s in lines[0] for s in says), (says, lines[0])
        assert not os.path.exists(out), argv
