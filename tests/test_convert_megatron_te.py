"""to-megatron --transformer-impl transformer_engine: Megatron-LM's default layer implementation's names, extra
states and layouts, for dense and mixture-of-experts models (multi-latent attention: tests/test_convert_megatron_mla.py,
through te_rank_check and te_dist_keys). The case list and what is checked are in the comment below."""
import copy
import os
import re

import pytest
import torch

from tests.harness import run_world
from tests.seeds import fresh_seed
from tests.test_convert_llama import _cli, quiet

# ---------------------------------------------------------------------------------------------------------------
# to-megatron --transformer-impl transformer_engine (Megatron-LM's default implementation): dense and MoE models
# here, multi-latent attention in test_convert_megatron_mla.py (through te_rank_check, te_dist_keys).
#
# Random models of ours (every weight random; fp32; seeds printed), each written at two layouts in the torch
# format and once in torch_dist under Transformer Engine's names:
#   - GPT-2's shape (learned positions, LayerNorm weights and biases, biased tanh-GELU MLP, tied embeddings);
#   - Llama's (RoPE, RMSNorm, SwiGLU, GQA, untied, no biases) with q/k norms (TENorm in TE's spec);
#   - a mixture of experts of that shape: layer 0 dense (its norm fused into linear_fc1), layer 1 4 experts top
#     2 with a gated shared expert and an expert bias (its pre-MLP norm a TENorm), SequentialMLP experts;
#   - the same with every layer MoE and --moe-grouped-gemm (TEGroupedMLP's linear_fc1.weight{J}; stacked
#     layers in torch_dist).
# On 2 gloo ranks, each rank file: (c) holds exactly the keys megatron-core's TE spec gives that rank
# (tests/megatron_reference.transformer_engine_state_keys: its ModuleSpec tree built on megatron-core's own
# stand-ins for the TE classes, walked over megatron-core's local model of the same args and rank), TE's
# extra states as TE saves them (an empty uint8 tensor; the output layer's None); (b) renamed to the local
# spec's names by te_to_local below loads strictly into megatron-core's local-spec GPTModel built from the
# file's args and gives our model's logits, every element; (a) from-megatron of every layout and of the
# torch_dist gives our weights and expert biases back bit for bit; the torch_dist's keys are the TE rank files'
# stacked as megatron-core's sharded_state_dict stacks them (te_dist_keys); the launch line names the
# implementation; the default stays local.
TE_BASE = dict(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=40, vocab_size=203,
               max_position_embeddings=64)
TE_LLAMA = {**TE_BASE, "position_embedding_type": "rope", "normalization": "RMSNorm", "layernorm_epsilon": 1e-6,
            "swiglu": True, "add_bias_linear": False, "untie_embeddings_and_output_weights": True,
            "num_query_groups": 2, "qk_layernorm": True}
TE_MOE = {**TE_LLAMA, "num_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 12,
          "moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True,
          "moe_shared_expert_intermediate_size": 12, "moe_shared_expert_gate": True}
# name: (our architecture, the (TP, EP) layouts written -- the torch_dist at the first --, --moe-grouped-gemm)
TE_CASES = {
    "gpt2": (TE_BASE, ((1, 1), (2, 1)), False),
    "llama": (TE_LLAMA, ((1, 1), (2, 1)), False),
    "moe": ({**TE_MOE, "moe_layer_freq": [0, 1]}, ((2, 1), (1, 2)), False),
    "moe_grouped": ({**TE_MOE, "moe_layer_freq": 1}, ((2, 1), (1, 2)), True),
}
TE_SEQ = 10
# the norms Transformer Engine's spec fuses into a linear layer (get_gpt_layer_with_transformer_engine_spec's
# TELayerNormColumnParallelLinear), and where the local spec (get_gpt_layer_local_spec) keeps them
_TE_FUSED_TO_LOCAL = (("self_attention.linear_qkv.layer_norm_", "input_layernorm."),
                      ("mlp.linear_fc1.layer_norm_", "pre_mlp_layernorm."),
                      ("self_attention.linear_q_up_proj.layer_norm_", "self_attention.q_layernorm."),
                      ("self_attention.linear_kv_up_proj.layer_norm_", "self_attention.kv_layernorm."))
_TE_GROUPED_PARAM = re.compile(r"^(.*\.mlp\.experts\.)(linear_fc[12])\.(weight|bias)(\d+)$")
_TE_GROUPED_STATE = re.compile(r"^(.*\.mlp\.experts\.)(linear_fc[12])\._extra_state$")
_MLA_DOWN = ("self_attention.linear_q_down_proj.weight", "self_attention.linear_kv_down_proj.weight")


def te_to_local(model: dict, tp_rank: int, tp: int) -> dict:
    """A Transformer Engine run's torch-format rank file under the local spec's names, as megatron-core 0.16.1's
    two specs hold the same tensors: the fused norms under their own modules (_TE_FUSED_TO_LOCAL), the extra
    states of TE's own modules (its norms', each core attention's) dropped and the linear layers' kept as the
    local ones' None, TEGroupedMLP's weight{J} as SequentialMLP's local expert J (megatron-core's experts.py
    keeps the two interchangeable in its checkpoints), and MLA's down projections -- a duplicated TELinear,
    whole on every TP rank -- cut to this rank's rows, as the local spec's ColumnParallelLinear holds them."""
    out, grouped_states, gemms = {}, [], {}
    for k, v in model.items():
        if k.endswith(("core_attention._extra_state", "layernorm._extra_state")):
            continue
        m = _TE_GROUPED_PARAM.match(k)
        if m:
            out[f"{m[1]}local_experts.{m[4]}.{m[2]}.{m[3]}"] = v
            gemms[m[1] + m[2]] = max(gemms.get(m[1] + m[2], 0), int(m[4]) + 1)
            continue
        if _TE_GROUPED_STATE.match(k):
            grouped_states.append(_TE_GROUPED_STATE.match(k))
            continue
        for te, local in _TE_FUSED_TO_LOCAL:
            k = k.replace(te, local)
        if k.endswith("._extra_state"):
            v = None
        elif k.endswith(_MLA_DOWN) and tp > 1:
            v = v.chunk(tp)[tp_rank]
        out[k] = v
    for m in grouped_states:
        out.update({f"{m[1]}local_experts.{j}.{m[2]}._extra_state": None for j in range(gemms[m[1] + m[2]])})
    return out


def te_rank_check(path: str, tp_rank: int, tp: int, build, tokens, tp_group) -> dict:
    """One rank of a megatron-core world on to-megatron's Transformer Engine file `path` of that rank: its keys,
    the keys megatron-core's TE spec gives the rank, its extra states, and the logits (gathered over TP) of
    megatron-core's local-spec GPTModel `build(args)` of the file's args (moe_grouped_gemm off: SequentialMLP)
    after a strict load of the file renamed by te_to_local."""
    from tests.megatron_reference import megatron_core_config, transformer_engine_state_keys
    from zo_megatron.checkpoint import megatron_lm
    from zo_megatron.parallel import collectives

    sd = megatron_lm.safe_load(path)
    args = sd["args"]
    local_args = copy.copy(args)
    local_args.moe_grouped_gemm = False
    ref = build(local_args)
    want = transformer_engine_state_keys(args, megatron_core_config(args), ref)
    ref.load_state_dict(te_to_local(sd["model"], tp_rank, tp), strict=True)
    ref.eval()
    b, s = tokens.shape
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1)[None, None]
    with torch.no_grad():
        local = ref(tokens, torch.arange(s).expand(b, s), mask)
    full = torch.cat(collectives.all_gather_list(local.contiguous(), tp_group), -1) if tp > 1 else local
    states = {k: None if v is None else (str(v.dtype), tuple(v.shape))
              for k, v in sd["model"].items() if k.endswith("_extra_state")}
    return {"keys": sorted(sd["model"]), "spec": sorted(want), "states": states, "logits": full.clone(),
            "impl": args.transformer_impl}


def te_dist_keys(rank_keys, args) -> tuple[set, set]:
    """(tensor keys, ShardedObject keys) that megatron-core 0.16.1's sharded_state_dict gives a model whose
    rank file (with every expert: EP 1) holds `rank_keys`, as its torch_dist save stores them, transcribed from
    megatron-core: TransformerBlock stacks the layers on a leading axis unless moe_layer_freq mixes dense and
    MoE layers (one key per layer), SequentialMLP and TEGroupedMLP save the experts as `mlp.experts.experts.<...>`
    on an expert axis (experts.py: TEGroupedLinear one `_extra_state` per GEMM), every `_extra_state` is a
    ShardedObject `<key>/shard_<offsets>_<shape>` (utils._get_extra_state_offsets: (0,) of (1,) unstacked),
    none for a TEDotProductAttention with the vanilla softmax (its sharded_state_dict) or the output layer
    (GPTModel.sharded_state_dict pops it)."""
    layers, experts = args.num_layers, getattr(args, "num_experts", None) or 0
    freq = getattr(args, "moe_layer_freq", 1) if experts else 1
    stacked = not isinstance(freq, (list, tuple)) and int(freq) <= 1
    tensors, objects = set(), set()
    for k in rank_keys:
        if k.endswith("core_attention._extra_state") or k == "output_layer._extra_state":
            continue
        key, offsets, shape, per_expert = k, (), (), [None]
        m = re.match(r"^decoder\.layers\.(\d+)\.(.+)$", k)
        if m:
            key = f"decoder.layers.{m[2]}" if stacked else k
            offsets, shape = ((int(m[1]),), (layers,)) if stacked else ((), ())
            seq, grouped, state = (re.match(r"^(.*\.mlp\.experts\.)local_experts\.(\d+)\.(.+)$", key),
                                   _TE_GROUPED_PARAM.match(key), _TE_GROUPED_STATE.match(key))
            if seq:
                key, per_expert = f"{seq[1]}experts.{seq[3]}", [int(seq[2])]
            elif grouped:
                key, per_expert = f"{grouped[1]}experts.{grouped[2]}.{grouped[3]}", [int(grouped[4])]
            elif state:
                key, per_expert = f"{state[1]}experts.{state[2]}._extra_state", list(range(experts))
        if not k.endswith("._extra_state"):
            tensors.add(key)
            continue
        for e in per_expert:
            off, shp = (offsets, shape) if e is None else ((*offsets, e), (*shape, experts))
            objects.add(f"{key}/shard_{'.'.join(map(str, off or (0,)))}_{'.'.join(map(str, shp or (1,)))}")
    return tensors, objects


def our_logits(ck: str, tokens, seed: int, **config):
    """Our model's logits (TP 1; the calling rank's world at TP 1) from our checkpoint `ck`, its persistent
    buffers (expert biases) from the checkpoint."""
    from zo_megatron.checkpoint.arch import buffer_shapes
    from zo_megatron.checkpoint.content import persistent_buffers
    from zo_megatron.checkpoint.reader import CheckpointReader
    from zo_megatron.model import GPTConfig, build_gpt_model
    from zo_megatron.model.sharding import load_full_params

    reader = CheckpointReader(ck)
    cfg = GPTConfig(**reader.model_meta, precision="fp32", **config)
    model = build_gpt_model(cfg, 0, 1, seed).eval()
    load_full_params(model, reader.read_weights(), 0, 1, reader.model_meta["vocab_size"])
    buffers = reader.read_full([f"buffers/{n}" for n in buffer_shapes(reader.model_meta)])
    full_name = getattr(model, "full_name", lambda n: n)
    held = persistent_buffers(model)
    assert len(held) == len(buffers), (sorted(held), sorted(buffers))
    for n, t in held.items():
        t.data.copy_(buffers[f"buffers/{full_name(n)}"])
    with torch.no_grad():
        return model(tokens)[..., :reader.model_meta["vocab_size"]].clone()


def _te_world(rank, d, tokens, seed):
    from megatron.core import parallel_state as mpu

    from tests.harness import next_port
    from tests.test_convert_megatron_moe import _megatron_core_moe_gpt
    from zo_megatron.checkpoint import megatron_lm
    from zo_megatron.parallel import destroy_parallel, init_parallel

    out = {}
    next_port()
    init_parallel(1)
    for name in TE_CASES:
        out[("ours", name)] = our_logits(os.path.join(d, f"te_{name}_ck"), tokens, seed)
    destroy_parallel()
    for name, (_, layouts, _) in TE_CASES.items():
        for tp, ep in layouts:
            next_port()
            ps = init_parallel(tp, expert_parallel=ep)
            rank_dir = megatron_lm.rank_dir(ps.tp_rank, mpu.get_expert_model_parallel_rank(), ep)
            got = te_rank_check(os.path.join(d, f"te_{name}_tp{tp}_ep{ep}", "release", rank_dir, megatron_lm.FILE),
                                ps.tp_rank, tp, _megatron_core_moe_gpt, tokens, ps.tp_group)
            out[("te", name, tp, ep)] = {**got, "rank_dir": rank_dir}
            destroy_parallel()
    return out


@pytest.fixture(scope="module")
def te_built(tmp_path_factory):
    from tests.test_convert_megatron_mla import _random_model
    from zo_megatron.checkpoint import convert
    from zo_megatron.checkpoint.arch import full_meta

    seed = fresh_seed("convert megatron transformer engine")
    d = tmp_path_factory.mktemp("megatron_te")
    lines = {}
    for i, (name, (arch, layouts, grouped)) in enumerate(TE_CASES.items()):
        meta = full_meta(arch)
        weights, buffers = _random_model(meta, seed + i)
        ck = str(d / f"te_{name}_ck")
        convert._write_weights_checkpoint(ck, weights, meta, tp=1, converted_from="a random model (test)",
                                          args={"make_vocab_size_divisible_by": 128}, force=False, log=quiet,
                                          buffers=buffers)
        for tp, ep in layouts:
            lines[(name, tp, ep)] = []
            convert.to_megatron(ck, str(d / f"te_{name}_tp{tp}_ep{ep}"), tensor_parallel=tp, expert_parallel=ep,
                                grouped_gemm=grouped, transformer_impl="transformer_engine",
                                log=lines[(name, tp, ep)].append)
        tp, ep = layouts[0]
        convert.to_megatron(ck, str(d / f"te_{name}_dist"), tensor_parallel=tp, expert_parallel=ep,
                            grouped_gemm=grouped, ckpt_format="torch_dist", transformer_impl="transformer_engine",
                            log=quiet)
        lines[(name, "local")] = []
        convert.to_megatron(ck, str(d / f"te_{name}_local"), tensor_parallel=tp, expert_parallel=ep,
                            grouped_gemm=grouped, log=lines[(name, "local")].append)
    tokens = torch.randint(0, TE_BASE["vocab_size"], (2, TE_SEQ), generator=torch.Generator().manual_seed(seed + 17))
    world = run_world(_te_world, 2, str(d), tokens, seed, timeout=400)
    return {"d": str(d), "world": world, "lines": lines}


def test_transformer_engine_files_hold_the_te_spec_s_keys_and_load_as_the_local_spec_with_our_logits(te_built):
    """(c) every rank file's keys are those megatron-core's TE spec gives its rank, TE's extra states an empty
    uint8 tensor (the output layer's None); (b) renamed to the local spec's names, megatron-core's local
    GPTModel loads it strictly and computes our logits, every element."""
    from tests.test_convert_llama import close

    world = te_built["world"]
    for name, (arch, layouts, grouped) in TE_CASES.items():
        ours = world[0][("ours", name)]
        assert ours.shape == (2, TE_SEQ, TE_BASE["vocab_size"])
        for tp, ep in layouts:
            dirs = set()
            for rank_out in world:
                got = rank_out[("te", name, tp, ep)]
                assert got["impl"] == "transformer_engine"
                keys, spec = set(got["keys"]), set(got["spec"])
                assert keys == spec, (name, tp, ep, got["rank_dir"], sorted(keys - spec), sorted(spec - keys))
                assert got["states"].pop("output_layer._extra_state") is None
                assert set(got["states"].values()) == {("torch.uint8", (0,))}, (name, got["states"])
                close(got["logits"][..., :TE_BASE["vocab_size"]], ours)
                dirs.add(got["rank_dir"])
            assert len(dirs) == tp * ep, (name, tp, ep, dirs)      # every rank's file was checked
        layer0 = set(world[0][("te", name, *layouts[0])]["keys"])
        # the names that differ from the local spec's, as megatron-core's TE spec has them
        assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in layer0
        assert "decoder.layers.0.self_attention.core_attention._extra_state" in layer0
        assert "decoder.final_layernorm._extra_state" in layer0
        assert not any(".input_layernorm." in k for k in layer0), name
        assert ("decoder.layers.0.self_attention.linear_qkv.layer_norm_bias" in layer0) == (name == "gpt2")
        assert ("decoder.layers.0.self_attention.q_layernorm._extra_state" in layer0) == (name != "gpt2")
        if name in ("gpt2", "llama", "moe"):
            assert "decoder.layers.0.mlp.linear_fc1.layer_norm_weight" in layer0           # a dense layer
        if name.startswith("moe"):
            assert "decoder.layers.1.pre_mlp_layernorm._extra_state" in layer0               # an MoE layer
            assert "decoder.layers.1.mlp.router.expert_bias" in layer0
        if grouped:
            assert "decoder.layers.1.mlp.experts.linear_fc1.weight1" in layer0
            assert not any("local_experts" in k for k in layer0)


def test_transformer_engine_files_read_back_bit_for_bit_in_both_formats(te_built, tmp_path):
    """(a) from-megatron of every layout's torch files and of the torch_dist: our weights, expert biases and
    architecture bit for bit; the torch_dist's tensor and extra-state keys are the TE rank files' as megatron-
    core's sharded_state_dict stacks them (layers stacked unless mixed, experts stacked, extra states one
    ShardedObject per stacked position)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from tests.test_convert_megatron_mla import _assert_same_model
    from zo_megatron.checkpoint import convert, megatron_lm
    from zo_megatron.checkpoint.safe_load import read_dcp_metadata

    d = te_built["d"]
    for name, (arch, layouts, grouped) in TE_CASES.items():
        ck = os.path.join(d, f"te_{name}_ck")
        sources = [os.path.join(d, f"te_{name}_tp{tp}_ep{ep}") for tp, ep in layouts] + \
            [os.path.join(d, f"te_{name}_dist")]
        for i, src in enumerate(sources):
            back = str(tmp_path / f"{name}_{i}")
            convert.from_megatron(src, back, tensor_parallel=2, log=quiet)
            _assert_same_model(ck, back, (name, src))
        ep1 = next((tp, ep) for tp, ep in layouts if ep == 1)            # a file with every expert
        rank0 = te_built["world"][0][("te", name, *ep1)]
        md = read_dcp_metadata(os.path.join(d, f"te_{name}_dist", "release")).state_dict_metadata
        tensors = {k for k, v in md.items() if isinstance(v, TensorStorageMetadata)}
        objects = set(md) - tensors
        args = megatron_lm.safe_load(os.path.join(d, f"te_{name}_dist", "release", "common.pt"), model=False)["args"]
        want_tensors, want_objects = te_dist_keys(rank0["keys"], args)
        assert tensors == want_tensors, (name, sorted(tensors ^ want_tensors))
        assert objects == want_objects, (name, sorted(objects ^ want_objects))
        assert args.transformer_impl == "transformer_engine" and args.ckpt_format == "torch_dist"
        assert any(k.startswith("decoder.layers.self_attention.") for k in tensors) == (name != "moe")


def test_the_launch_line_names_the_implementation_and_local_stays_the_default(te_built, tmp_path, capsys):
    """The launch line names the implementation the files are for; without --transformer-impl a model without
    MLA is written as before (local); the CLI's flag reaches the files."""
    from zo_megatron.checkpoint import megatron_lm

    d = te_built["d"]
    out = str(tmp_path / "cli")
    assert _cli().main(["to-megatron", "--load", os.path.join(d, "te_llama_ck"), "--output", out,
                        "--transformer-impl", "transformer_engine", "--ckpt-format", "torch_dist"]) == 0
    assert "--transformer-impl transformer_engine" in capsys.readouterr().out
    args = megatron_lm.safe_load(os.path.join(out, "release", "common.pt"), model=False)["args"]
    assert args.transformer_impl == "transformer_engine"
    for name, (_, layouts, _) in TE_CASES.items():
        for tp, ep in layouts:
            (line,) = [ln for ln in te_built["lines"][(name, tp, ep)] if "load it in Megatron-LM with" in ln]
            assert "--transformer-impl transformer_engine (Transformer Engine's layer names" in line, line
        (line,) = [ln for ln in te_built["lines"][(name, "local")] if "load it in Megatron-LM with" in ln]
        assert "--transformer-impl local (megatron-core's local layers' names)" in line, line
        rel = os.path.join(d, f"te_{name}_local", "release")
        sd = megatron_lm.safe_load(os.path.join(rel, sorted(os.listdir(rel))[0], megatron_lm.FILE))
        assert sd["args"].transformer_impl == "local"
        assert "decoder.layers.0.input_layernorm.weight" in sd["model"]
        assert not any("core_attention" in k or k.endswith("layernorm._extra_state") for k in sd["model"])
