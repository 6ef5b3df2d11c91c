"""from-megatron of Megatron-LM checkpoints saved with pipeline parallelism (mp_rank_TT_PPP[_EEE]),
against megatron-core's own pipeline stages.

On 4 gloo ranks megatron-core 0.16.1 is initialised with pipeline parallelism and builds each rank's
stage of a GPTModel (local spec; pre_process on the first stage, post_process on the last, a
virtual pipeline's chunks with their vp_stage): which layers a stage holds is megatron-core's
(`TransformerLayer.layer_number`), also checked against the split written out by hand. Each stage
is filled from the one-stage (PP 1) files of the same model by those layer numbers, the tied
output-layer copy on the last stage from the embedding (as Megatron-LM keeps it), loaded with
`load_state_dict(strict=True)`, and saved as Megatron-LM's save does (the ranks of expert-DP rank
0, `model` or `model0`, `model1`, ... per chunk). from-megatron of those stage files gives every
tensor of the one-stage conversion bit for bit:
  - a tied Llama (4 layers) at TP2 x PP2 (even split), TP1 x PP2 x virtual 2 (chunks interleaved:
    stage 0 holds layers 0 and 2), TP1 x PP2 with --decoder-first-pipeline-num-layers 1;
  - the Mixtral of tests/test_convert_megatron_moe.py at TP1 x PP2 x EP2 (mp_rank_00_PPP_EEE).
Bad input, one line each: a stage missing, a tied copy out of sync, a hand-written
pipeline_model_parallel_layout, a virtual pipeline whose chunks the file lacks.
"""
import os
import shutil

import pytest
import torch

from tests.harness import run_world
from tests.hf_tokenizer import HF_VOCAB_SIZE
from tests.seeds import fresh_seed
from tests.test_convert_llama import _cli, make_hf_model, quiet

transformers = pytest.importorskip("transformers")

VOCAB = HF_VOCAB_SIZE + 37
# (name, TP, PP, virtual chunks, first-stage layers, EP) and the global layers of each (stage, chunk)
LAYOUTS = {
    "tp2_pp2": (2, 2, None, None, 1, {(0, 0): [0, 1], (1, 0): [2, 3]}),
    "tp1_pp2_vp2": (1, 2, 2, None, 1, {(0, 0): [0], (1, 0): [1], (0, 1): [2], (1, 1): [3]}),
    "tp1_pp2_first1": (1, 2, None, 1, 1, {(0, 0): [0], (1, 0): [1, 2, 3]}),
    "moe_tp1_pp2_ep2": (1, 2, None, None, 2, {(0, 0): [0], (1, 0): [1]}),
}


def _stage_args(args, tp, pp, vp, first):
    import copy

    a = copy.copy(args)
    a.pipeline_model_parallel_size, a.virtual_pipeline_model_parallel_size = pp, vp
    a.decoder_first_pipeline_num_layers, a.decoder_last_pipeline_num_layers = first, None
    a.transformer_pipeline_model_parallel_size = pp
    return a


def _stage_models(args, pp_rank, pp, vp):
    """megatron-core's GPTModel chunks of pipeline stage `pp_rank`, from the args (local spec)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    from tests.megatron_reference import megatron_core_config

    cfg = megatron_core_config(args, pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vp,
                               num_layers_in_first_pipeline_stage=args.decoder_first_pipeline_num_layers,
                               pipeline_dtype=torch.float32)
    chunks = []
    for v in range(vp or 1):
        first = pp_rank == 0 and v == 0
        last = pp_rank == pp - 1 and v == (vp or 1) - 1
        spec = get_gpt_decoder_block_spec(cfg, use_transformer_engine=False, normalization=args.normalization,
                                          vp_stage=v if vp else None, pp_rank=pp_rank)
        chunks.append(GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=args.padded_vocab_size,
                               max_sequence_length=args.max_position_embeddings, pre_process=first, post_process=last,
                               share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                               position_embedding_type=args.position_embedding_type, rotary_base=args.rotary_base,
                               vp_stage=v if vp else None))
    return chunks


def start_megatron_core_world() -> None:
    """This forked rank's gloo world, for megatron-core's parallel_state to be initialised on directly
    (pipeline stages: zo_megatron's init_parallel has one stage)."""
    import torch.distributed as dist

    from tests.harness import next_port
    from zo_megatron.parallel import megatron_cpu
    from zo_megatron.parallel.launch_env import discover_launch_env, export_torch_env

    megatron_cpu.apply()
    # megatron-core's tied-embedding set-up moves the last stage's copy to CUDA before its all-reduce
    # (language_module.setup_embeddings_and_output_layer); on this CPU-only rank it stays on the host
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    os.environ["MASTER_PORT"] = str(next_port())
    env = discover_launch_env()
    export_torch_env(env)
    dist.init_process_group("gloo", init_method="env://", rank=env.rank, world_size=env.world_size)


def fill_stage(model, one_stage: dict, args) -> list[int]:
    """Load a stage chunk of megatron-core's GPTModel strictly from a one-stage (PP 1) file's model by
    megatron-core's own layer numbers (`TransformerLayer.layer_number`), the tied output-layer copy of
    the last stage from the embedding (as Megatron-LM keeps it); returns the chunk's global layers."""
    numbers = [layer.layer_number - 1 for layer in model.decoder.layers]
    sd = {}
    for k in model.state_dict():
        parts = k.split(".")
        if k.startswith("decoder.layers."):
            parts[2] = str(numbers[int(parts[2])])
        src_key = ".".join(parts)
        if k == "output_layer.weight" and not args.untie_embeddings_and_output_weights:
            src_key = "embedding.word_embeddings.weight"     # the last stage's tied copy
        sd[k] = one_stage[src_key]
    model.load_state_dict(sd, strict=True)
    return numbers


def _pipeline_world(rank, jobs):
    """Per layout: initialise megatron-core with pipeline parallelism, build this rank's stage, fill it
    from the one-stage files by megatron-core's layer numbers, save it as Megatron-LM does."""
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    from zo_megatron.checkpoint import megatron_lm

    start_megatron_core_world()
    layers = {}
    try:
        for name, (src, out_dir) in jobs.items():
            tp, pp, vp, first, ep, _ = LAYOUTS[name]
            mpu.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                          virtual_pipeline_model_parallel_size=vp, expert_model_parallel_size=ep)
            t, p = mpu.get_tensor_model_parallel_rank(), mpu.get_pipeline_model_parallel_rank()
            e = mpu.get_expert_model_parallel_rank()
            one = megatron_lm.safe_load(os.path.join(src, "release", megatron_lm.rank_dir(t, e, ep), megatron_lm.FILE))
            args = _stage_args(one["args"], tp, pp, vp, first)
            chunks = _stage_models(args, p, pp, vp)
            saved = {}
            for v, model in enumerate(chunks):
                layers[(name, p, v)] = fill_stage(model, one["model"], args)
                saved["model" if vp is None else f"model{v}"] = model.state_dict()
            if mpu.get_expert_data_parallel_rank() == 0:            # Megatron-LM's legacy save
                path = os.path.join(out_dir, "release", megatron_lm.rank_dir(t, e, ep, p, pp), megatron_lm.FILE)
                os.makedirs(os.path.dirname(path))
                torch.save({"args": args, "checkpoint_version": 3.0, "iteration": 0, **saved}, path)
                if rank == 0:
                    with open(os.path.join(out_dir, megatron_lm.TRACKER), "w") as f:
                        f.write("release")
            dist.barrier()
            mpu.destroy_model_parallel()
    finally:
        dist.destroy_process_group()
    return layers


@pytest.fixture(scope="module")
def stages(tmp_path_factory):
    from zo_megatron.checkpoint import convert

    from tests.test_convert_megatron_moe import moe_configs

    d = tmp_path_factory.mktemp("megatron_pipeline")
    seed = fresh_seed("convert megatron pipeline")
    llama = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                     tie_word_embeddings=True)
    sources = {"llama": make_hf_model(d / "llama", llama, seed, tokenizer=False),
               "mixtral": make_hf_model(d / "mixtral", moe_configs()["mixtral"], seed + 1, tokenizer=False)}
    jobs, out = {}, {"d": str(d)}
    for name, (tp, pp, vp, first, ep, _) in LAYOUTS.items():
        model = "mixtral" if name.startswith("moe") else "llama"
        ck, one = str(d / f"{name}_ck"), str(d / f"{name}_pp1")
        convert.from_hf(sources[model], ck, tensor_parallel=tp, log=quiet)
        convert.to_megatron(ck, one, tensor_parallel=tp, expert_parallel=ep, log=quiet)
        jobs[name] = (one, str(d / f"{name}_stages"))
    out["layers"] = run_world(_pipeline_world, 4, jobs, timeout=400)
    out["jobs"] = jobs
    return out


def test_pipeline_stages_read_back_bit_for_bit_as_megatron_core_splits_them(stages, tmp_path):
    from zo_megatron.checkpoint import convert
    from zo_megatron.checkpoint.reader import CheckpointReader

    for rank_layers in stages["layers"]:                       # megatron-core's split = the hand-written one
        for (name, p, v), numbers in rank_layers.items():
            assert numbers == LAYOUTS[name][5][(p, v)], (name, p, v, numbers)
    for name, (one, staged) in stages["jobs"].items():
        tp, pp, vp, _, ep, _ = LAYOUTS[name]
        dirs = sorted(os.listdir(os.path.join(staged, "release")))
        assert len(dirs) == tp * pp * ep and all(d.count("_") == 2 + (pp > 1) + (ep > 1) for d in dirs), dirs
        a, b = str(tmp_path / f"{name}_from_pp1"), str(tmp_path / f"{name}_from_stages")
        convert.from_megatron(one, a, tensor_parallel=1, log=quiet)
        lines = []
        convert.from_megatron(staged, b, tensor_parallel=1, log=lines.append)
        wa, wb = CheckpointReader(a).read_weights(), CheckpointReader(b).read_weights()
        assert set(wa) == set(wb), (name, set(wa) ^ set(wb))
        for k in wa:
            assert torch.equal(wa[k], wb[k]), (name, k)
        assert CheckpointReader(a).model_meta == CheckpointReader(b).model_meta, name
        assert any(f"PP{pp}" in ln for ln in lines), lines


def test_bad_pipeline_checkpoints_are_one_line_exit_2(stages, tmp_path, capsys):
    from zo_megatron.checkpoint import megatron_lm

    staged = stages["jobs"]["tp2_pp2"][1]
    vp_staged = stages["jobs"]["tp1_pp2_vp2"][1]

    def variant(tag, src=staged, remove=None, edit=None, **args):
        dst = str(tmp_path / tag)
        shutil.copytree(src, dst)
        if remove:
            shutil.rmtree(os.path.join(dst, "release", remove))
        for rank in sorted(os.listdir(os.path.join(dst, "release"))):
            path = os.path.join(dst, "release", rank, megatron_lm.FILE)
            sd = megatron_lm.safe_load(path)
            for k, v in args.items():
                setattr(sd["args"], k, v)
            if edit:
                edit(rank, sd)
            torch.save(sd, path)
        return dst

    def desync(rank, sd):
        if rank.endswith("_001"):
            sd["model"]["output_layer.weight"] = sd["model"]["output_layer.weight"] + 1.0

    def drop_chunk(rank, sd):
        sd.pop("model1")

    cases = [
        (variant("missing_stage", remove="mp_rank_01_001"), ["mp_rank_01_001 is missing", "TP2 x PP2", "incomplete"]),
        (variant("desync", edit=desync), ["output_layer.weight differs from the first stage's", "tied"]),
        (variant("layout", pipeline_model_parallel_layout="Et|tL"),
         ["args.pipeline_model_parallel_layout='Et|tL'", "--target-pipeline-parallel-size 1"]),
        (variant("no_chunk", src=vp_staged, edit=drop_chunk), ["virtual_pipeline_model_parallel_size=2", "['model0']"]),
    ]
    assert_from_megatron_refuses(cases, tmp_path, capsys)


def assert_from_megatron_refuses(cases, tmp_path, capsys) -> None:
    """Each (input directory, words) case: from-megatron through the CLI prints one `error:` line
    holding every word, exits 2 and writes nothing."""
    cli = _cli()
    for src, says in cases:
        capsys.readouterr()
        rc = cli.main(["from-megatron", "--input", src, "--output", str(tmp_path / "out"), "--tensor-parallel", "1"])
        lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip() and "%" not in ln]
        assert rc == 2 and len(lines) == 1 and lines[0].startswith("error: "), (src, lines)
        assert all(s in lines[0] for s in says), (says, lines[0])
        assert not os.path.exists(tmp_path / "out"), src
