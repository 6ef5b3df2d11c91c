"""from-megatron of Megatron-LM's `torch_dist` checkpoints (its default --ckpt-format), saved by
megatron-core's own dist_checkpointing from its own models.

On 4 gloo ranks megatron-core 0.16.1 builds each rank's GPTModel (local spec; a pipeline stage's
chunk where the layout has stages), loads it strictly from the torch-format files of the same model
(to-megatron's, tested against transformers in test_convert_megatron_moe / _pipeline), and saves it
as Megatron-LM's save_checkpoint does at --ckpt-format torch_dist: `dist_checkpointing.save` of
{args, checkpoint_version, iteration, model: model.sharded_state_dict(metadata), rng_state} with
Megatron-LM's metadata (singleton_local_shards False; True in one case, the form megatron-core also
writes), the default torch_dist save strategy, and the tracker file. from-megatron of that directory
gives every tensor of from-megatron of the torch files bit for bit, and the same architecture:
  - a tied Llama (4 layers) at TP2 x PP2: layers stacked on one axis, the tied copy not saved; and at
    TP1 x PP2 x virtual 2 (model0 / model1 per stage, chunks interleaved) saved in bf16;
  - a Mixtral at TP2 x EP2: layers and experts stacked ([L, E, ...]);
  - the same Mixtral with singleton_local_shards: one key per layer and expert, SwiGLU's halves apart;
  - a Qwen2-MoE at TP1 x EP2 (layer 1 dense: one key per layer; a gated shared expert, QKV biases);
  - a GPT-2 at TP2 (learned positions, LayerNorm weights and biases, biased GELU MLP, tied embeddings).
Reading in batches of one tensor gives the one-read result; --iteration N picks an older iteration.
Bad input, one line each, exit 2, nothing written: a pickled payload planted in .metadata or common.pt
(never run), another sharded backend, a missing .distcp file, no common.pt, args whose layer count is
not the checkpoint's, a tracker that holds no iteration, an iteration the root does not hold.

to-megatron --ckpt-format torch_dist, the other way: megatron-core's own loader
(`dist_checkpointing.load` of its model's `sharded_state_dict`, Megatron-LM's metadata and default
strictness) reads the written directory into models at the written layout and at others -- the
Mixtral written at TP2 x EP2 into TP2 x EP2 and TP1 x EP1, the Qwen2-MoE written at TP1 x EP2 into
TP2 x EP2 and TP1 x EP2, the tied Llama written at TP2 into TP2 x PP2 stages and TP1, the GPT-2 written
at TP2 into TP1 and TP2, a Llama of 2100 tokens written at TP2 (2304 rows) into TP1 (2176 rows: megatron-
core's embedding allows the shape mismatch) -- and every tensor equals the strict load of to-megatron's
torch files at that layout (tested against transformers' logits elsewhere); from-megatron reads the written directory back
bit for bit.
"""
import copy
import os
import shutil

import pytest
import torch

from tests.harness import run_world
from tests.seeds import fresh_seed
from tests.test_convert_llama import _cli, make_hf_model, quiet

transformers = pytest.importorskip("transformers")

# name: (model, TP, PP, virtual pipeline chunks, EP, singleton_local_shards, the saved model's dtype)
JOBS = {
    "llama_tp2_pp2": ("llama", 2, 2, None, 1, False, torch.float32),
    "llama_tp1_pp2_vp2_bf16": ("llama", 1, 2, 2, 1, False, torch.bfloat16),
    "mixtral_tp2_ep2": ("mixtral", 2, 1, None, 2, False, torch.float32),
    "mixtral_tp2_ep2_singleton": ("mixtral", 2, 1, None, 2, True, torch.float32),
    "qwen2_moe_tp1_ep2": ("qwen2_moe", 1, 1, None, 2, False, torch.float32),
    "gpt2_tp2": ("gpt2", 2, 1, None, 1, False, torch.float32),
}
ITERATION = 7
# to-megatron --ckpt-format torch_dist: name: (model, TP and EP written, [(TP, PP, EP) megatron-core loads it at])
WRITES = {
    "mixtral_w": ("mixtral", 2, 2, [(2, 1, 2), (1, 1, 1)]),
    "qwen2_moe_w": ("qwen2_moe", 1, 2, [(2, 1, 2), (1, 1, 2)]),
    "llama_w": ("llama", 2, 1, [(2, 2, 1), (1, 1, 1)]),
    "gpt2_w": ("gpt2", 2, 1, [(1, 1, 1), (2, 1, 1)]),
    # 2100 tokens pad to 2304 rows at TP 2 and to 2176 at TP 1 (128 x TP): megatron-core's embedding and
    # output layer allow that shape mismatch on load
    "llama_v2100_w": ("llama_v2100", 2, 1, [(1, 1, 1)]),
}


def _in_process_writes():
    """megatron-core's FileSystemWriterAsync forks one writer process per bucket; these ranks are
    daemonic processes of the test harness, which may not have children. The same writes
    (FileSystemWriterAsync.write_preloaded_data, bucket by bucket) run in the rank instead."""
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async as fa

    fa._get_write_results_queue = lambda: queue.Queue()

    def write(transform_list, use_msc, rank, write_buckets, global_results_queue):
        local, count, results = queue.Queue(), queue.Queue(), {}
        for i, bucket in enumerate(write_buckets):
            count.put(i)
            fa.FileSystemWriterAsync.write_preloaded_data(transform_list, i, bucket, local, count, True)
            idx, res = local.get()
            if isinstance(res, Exception):
                raise res
            results[idx] = res
        global_results_queue.put(results)

    fa.FileSystemWriterAsync.write_preloaded_data_multiproc = staticmethod(write)


def _save_world(rank, jobs):
    """Per job: megatron-core's model of this rank, loaded from the torch files, saved as torch_dist."""
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as mpu
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy

    from tests.test_convert_megatron_moe import _megatron_core_moe_gpt
    from tests.test_convert_megatron_pipeline import _stage_args, _stage_models, fill_stage, start_megatron_core_world
    from zo_megatron.checkpoint import megatron_lm
    from zo_megatron.parallel import collectives

    torch.cuda.synchronize = lambda *a, **k: None      # the save strategy's D2H sync; nothing is on a GPU here
    _in_process_writes()
    start_megatron_core_world()
    try:
        for name, (src, out_dir) in jobs.items():
            _, tp, pp, vp, ep, singleton, dtype = JOBS[name]
            mpu.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                          virtual_pipeline_model_parallel_size=vp, expert_model_parallel_size=ep)
            t, p, e = (mpu.get_tensor_model_parallel_rank(), mpu.get_pipeline_model_parallel_rank(),
                       mpu.get_expert_model_parallel_rank())
            one = megatron_lm.safe_load(os.path.join(src, "release", megatron_lm.rank_dir(t, e, ep),
                                                     megatron_lm.FILE))
            if pp > 1:
                args = _stage_args(one["args"], tp, pp, vp, None)
                chunks = _stage_models(args, p, pp, vp)
                for chunk in chunks:
                    fill_stage(chunk, one["model"], args)
            else:
                args = copy.copy(one["args"])
                chunks = [_megatron_core_moe_gpt(args)]
                chunks[0].load_state_dict(one["model"], strict=True)
            args.ckpt_format, args.bf16 = "torch_dist", dtype == torch.bfloat16
            metadata = {"singleton_local_shards": singleton, "chained_optim_avoid_prefix": True,
                        "dp_cp_group": mpu.get_data_parallel_group(with_context_parallel=True)}
            rng = ShardedObject("rng_state", [{"random_rng_state": torch.get_rng_state()}], (pp, tp), (p, t),
                                replica_id=mpu.get_data_parallel_rank(with_context_parallel=True))
            state = {"args": args, "checkpoint_version": 3.0, "iteration": ITERATION, "rng_state": rng,
                     "num_floating_point_operations_so_far": 0}
            for v, chunk in enumerate(chunks):       # Megatron-LM's generate_state_dict: model, or model0, model1, ...
                state["model" if len(chunks) == 1 else f"model{v}"] = chunk.to(dtype).sharded_state_dict(metadata=metadata)
            d = os.path.join(out_dir, f"iter_{ITERATION:07d}")
            if rank == 0:
                os.makedirs(d)
            collectives.barrier()
            dist_checkpointing.save(state, d, get_default_save_sharded_strategy("torch_dist"),
                                    content_metadata={k: v for k, v in metadata.items() if k != "dp_cp_group"})
            if rank == 0:
                with open(os.path.join(out_dir, megatron_lm.TRACKER), "w") as f:
                    f.write(str(ITERATION))
            collectives.barrier()
            mpu.destroy_model_parallel()
    finally:
        torch.distributed.destroy_process_group()
    return True


def _build(d):
    from zo_megatron.checkpoint import convert

    from tests.test_convert_megatron_moe import moe_configs
    from tests.test_convert_megatron_pipeline import VOCAB

    seed = fresh_seed("convert megatron torch_dist")
    configs = {**moe_configs(), "llama": transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True),
        "llama_v2100": transformers.LlamaConfig(
            vocab_size=2100, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False),
        "gpt2": transformers.GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=2, n_head=4, n_inner=64,
                                        activation_function="gelu_new")}
    sources = {m: make_hf_model(d / m, configs[m], seed + i, tokenizer=False)
               for i, m in enumerate(sorted({job[0] for job in (*JOBS.values(), *WRITES.values())}))}
    jobs = {}
    for name, (model, tp, _, _, ep, _, _) in JOBS.items():
        ck, torch_dir = str(d / f"{name}_ck"), str(d / f"{name}_torch")
        if not os.path.isdir(torch_dir):
            convert.from_hf(sources[model], ck, tensor_parallel=tp, log=quiet)
            convert.to_megatron(ck, torch_dir, tensor_parallel=tp, expert_parallel=ep, log=quiet)
        jobs[name] = (torch_dir, str(d / f"{name}_dist"))
    run_world(_save_world, 4, jobs, timeout=400)
    loads = {}
    for name, (model, tp, ep, layouts) in WRITES.items():
        ck = str(d / f"{name}_ck")
        convert.from_hf(sources[model], ck, tensor_parallel=tp, log=quiet)
        written = str(d / f"{name}_dist")
        convert.to_megatron(ck, written, tensor_parallel=tp, expert_parallel=ep, ckpt_format="torch_dist", log=quiet)
        refs = {}
        for ltp, _, lep in layouts:
            refs[(ltp, lep)] = str(d / f"{name}_torch_tp{ltp}_ep{lep}")
            convert.to_megatron(ck, refs[(ltp, lep)], tensor_parallel=ltp, expert_parallel=lep, log=quiet)
        loads[name] = (written, refs)
    compared = run_world(_load_world, 4, loads, timeout=400)
    return {"saved": {name: [str(p) for p in paths] for name, paths in jobs.items()},
            "written": {name: paths[0] for name, paths in loads.items()}, "compared": compared}


def _load_world(rank, loads):
    """Per written checkpoint and layout: megatron-core's model of this rank loaded by its own
    dist_checkpointing from to-megatron's torch_dist directory, against the strict load of the torch
    files at that layout; returns {(name, TP, PP, EP): the tensors compared} (none may differ)."""
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as mpu
    from megatron.core.dist_checkpointing import ShardedObject
    from megatron.core.dist_checkpointing.validation import StrictHandling

    from tests.test_convert_megatron_moe import _megatron_core_moe_gpt
    from tests.test_convert_megatron_pipeline import _stage_args, _stage_models, fill_stage, start_megatron_core_world
    from zo_megatron.checkpoint import megatron_lm

    start_megatron_core_world()
    out = {}
    try:
        for name, (written, refs) in loads.items():
            for tp, pp, ep in WRITES[name][3]:
                mpu.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                              expert_model_parallel_size=ep)
                t, p, e = (mpu.get_tensor_model_parallel_rank(), mpu.get_pipeline_model_parallel_rank(),
                           mpu.get_expert_model_parallel_rank())
                one = megatron_lm.safe_load(os.path.join(refs[(tp, ep)], "release", megatron_lm.rank_dir(t, e, ep),
                                                         megatron_lm.FILE))
                models = []
                for _ in range(2):                     # the reference, and the one loaded from torch_dist
                    if pp > 1:
                        args = _stage_args(one["args"], tp, pp, None, None)
                        (model,) = _stage_models(args, p, pp, None)
                    else:
                        model = _megatron_core_moe_gpt(one["args"])
                    models.append(model)
                ref, model = models
                if pp > 1:
                    fill_stage(ref, one["model"], args)
                else:
                    ref.load_state_dict(one["model"], strict=True)
                metadata = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True,
                            "dp_cp_group": mpu.get_data_parallel_group(with_context_parallel=True)}
                # and what a local run on a machine with Transformer Engine asks for besides: its block's final
                # norm is a TENorm there (megatron-core's LayerNormImpl), whose extra state the files must hold
                te_final_norm = ShardedObject("decoder.final_layernorm._extra_state", None, (1,), (0,),
                                              replica_id=torch.distributed.get_rank())
                loaded = dist_checkpointing.load({"model": model.sharded_state_dict(metadata=metadata),
                                                  "te_final_norm": te_final_norm},
                                                 os.path.join(written, "release"),
                                                 strict=StrictHandling.ASSUME_OK_UNEXPECTED)
                extra = loaded["te_final_norm"]
                assert torch.is_tensor(extra) and extra.dtype == torch.uint8 and extra.numel() == 0, (name, extra)
                model.load_state_dict(loaded["model"], strict=True)
                got, want = model.state_dict(), ref.state_dict()
                tensors = [k for k, v in want.items() if torch.is_tensor(v)]
                bad = [k for k in tensors if not torch.equal(got[k], want[k])]
                assert not bad, (name, tp, pp, ep, bad)
                emb = want.get("embedding.word_embeddings.weight")
                out[(name, tp, pp, ep)] = (len(tensors), None if emb is None else emb.shape[0])
                mpu.destroy_model_parallel()
    finally:
        torch.distributed.destroy_process_group()
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    from tests.harness import built_once

    return built_once(tmp_path_factory, "megatron_torch_dist", _build)[0]   # once for both xdist workers


def test_megatron_core_loads_to_megatron_s_torch_dist_at_other_layouts_bit_for_bit(saved, tmp_path):
    from zo_megatron.checkpoint import convert, megatron_lm
    from zo_megatron.checkpoint.reader import CheckpointReader

    for rank_out in saved["compared"]:         # every rank of every layout compared its tensors (the world asserts)
        assert sorted(rank_out) == sorted((n, *lay) for n, w in WRITES.items() for lay in w[3]), rank_out
        assert all(n > 0 for n, _ in rank_out.values()), rank_out
    for name, written in saved["written"].items():
        written_rows = megatron_lm.safe_load(os.path.join(written, "release", "common.pt"), model=False)[
            "args"].padded_vocab_size
        loaded_rows = {rows for rank_out in saved["compared"] for key, (_, rows) in rank_out.items()
                       if key[0] == name and rows is not None}
        if name == "llama_v2100_w":      # the case of a TP that pads the vocabulary to other rows than written
            assert written_rows == 2304 and loaded_rows == {2176}, (written_rows, loaded_rows)
        files = sorted(os.listdir(os.path.join(written, "release")))
        assert "metadata.json" in files and "common.pt" in files and any(f.endswith(".distcp") for f in files)
        back = str(tmp_path / name)
        convert.from_megatron(written, back, tensor_parallel=1, log=quiet)
        src = os.path.join(os.path.dirname(written), f"{name}_ck")
        wa, wb = CheckpointReader(src).read_weights(), CheckpointReader(back).read_weights()
        assert set(wa) == set(wb), (name, set(wa) ^ set(wb))
        for k in wa:
            assert wa[k].dtype == wb[k].dtype and torch.equal(wa[k], wb[k]), (name, k)


def test_torch_dist_checkpoints_read_back_bit_for_bit_as_the_torch_format(saved, tmp_path):
    from zo_megatron.checkpoint import convert
    from zo_megatron.checkpoint.reader import CheckpointReader
    from zo_megatron.checkpoint.safe_load import read_dcp_metadata

    for name, (torch_dir, dist_dir) in saved["saved"].items():
        _, tp, pp, vp, ep, singleton, dtype = JOBS[name]
        md = read_dcp_metadata(os.path.join(dist_dir, f"iter_{ITERATION:07d}")).state_dict_metadata
        keys = set(md)
        # the forms the reader must take apart are what megatron-core wrote
        stacked = any(k.startswith("decoder.layers.self_attention.") for k in keys)
        # stacked unless singleton_local_shards or Qwen2-MoE's moe_layer_freq (dense layer 1) make one key per layer
        assert stacked == (not singleton and not name.startswith("qwen2_moe")), (name, sorted(keys)[:8])
        assert md["decoder.final_layernorm.weight"].properties.dtype == dtype, name
        assert any(k.endswith("linear_fc1.weight_w") for k in keys) == singleton, name
        assert "rng_state" in {k.split("/")[0] for k in keys}, name
        a, b = str(tmp_path / f"{name}_torch"), str(tmp_path / f"{name}_dist")
        convert.from_megatron(torch_dir, a, tensor_parallel=1, log=quiet)
        lines = []
        convert.from_megatron(dist_dir, b, tensor_parallel=tp, log=lines.append)
        wa, wb = CheckpointReader(a).read_weights(), CheckpointReader(b).read_weights()
        assert set(wa) == set(wb), (name, set(wa) ^ set(wb))
        for k in wa:        # a bf16 save holds the fp32 weights rounded to bf16, read back as they are
            assert wa[k].dtype == wb[k].dtype and torch.equal(wa[k].to(dtype).to(wa[k].dtype), wb[k]), (name, k)
        assert CheckpointReader(a).model_meta == CheckpointReader(b).model_meta, name
        (read_line,) = [ln for ln in lines if ln.startswith("read ")]
        assert f"iteration {ITERATION}" in read_line and "torch_dist" in read_line, read_line


def test_tensors_read_in_batches_are_the_tensors_read_at_once_and_progress_moves(saved):
    """_load reads about 1 GiB per DCP read so a large model shows progress; batches of one tensor
    give every tensor of the one-read result, and progress counts up to every tensor."""
    from zo_megatron.checkpoint import megatron_dist
    from zo_megatron.checkpoint.safe_load import read_dcp_metadata

    d = os.path.join(saved["saved"]["mixtral_tp2_ep2"][1], f"iter_{ITERATION:07d}")
    keys = megatron_dist._model_keys(read_dcp_metadata(d), d)
    seen = []
    whole, one_by_one = megatron_dist._load(d, keys), megatron_dist._load(d, keys, lambda *a: seen.append(a),
                                                                          batch_bytes=1)
    assert set(whole) == set(one_by_one) == set(keys) and len(keys) > 3
    assert all(torch.equal(whole[k], one_by_one[k]) for k in keys)
    assert seen == [(i, len(keys)) for i in range(1, len(keys) + 1)], seen


def test_iteration_picks_an_older_checkpoint_of_the_root(saved, tmp_path, capsys):
    """--iteration N (Megatron-LM's --ckpt-step): a root holding the Qwen2-MoE as iteration 3 and the
    Mixtral as iteration 7 (the tracker's) gives each; an iteration it does not hold is one line."""
    from zo_megatron.checkpoint import convert
    from zo_megatron.checkpoint.reader import CheckpointReader

    root = tmp_path / "root"
    shutil.copytree(saved["saved"]["mixtral_tp2_ep2"][1], root)
    shutil.copytree(os.path.join(saved["saved"]["qwen2_moe_tp1_ep2"][1], f"iter_{ITERATION:07d}"),
                    root / "iter_0000003")
    metas = {}
    for it, name in ((None, "mixtral"), (3, "qwen2_moe"), (7, "mixtral")):
        out = tmp_path / f"out_{it}"
        lines = []
        convert.from_megatron(str(root), str(out), tensor_parallel=1, iteration=it, log=lines.append)
        (read_line,) = [ln for ln in lines if ln.startswith("read ")]
        assert f"iteration {it or ITERATION}," in read_line, read_line
        metas.setdefault(name, []).append(CheckpointReader(str(out)).model_meta)
    assert metas["mixtral"][0] == metas["mixtral"][1] != metas["qwen2_moe"][0]
    assert metas["qwen2_moe"][0]["moe_shared_expert_intermediate_size"] and \
        not metas["mixtral"][0]["moe_shared_expert_intermediate_size"]
    capsys.readouterr()
    assert _cli().main(["from-megatron", "--input", str(root), "--output", str(tmp_path / "o5"),
                        "--tensor-parallel", "1", "--ckpt-step", "5"]) == 2
    (line,) = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip() and "%" not in ln]
    assert line.startswith("error: --iteration 5: ") and "(it holds 3, 7)" in line, line
    assert not os.path.exists(tmp_path / "o5")


@pytest.mark.parametrize("tracker", ["\u00b2".encode(), b"\x80\xff", b"7 8"], ids=["superscript-two", "not-utf8", "two-words"])
def test_a_tracker_that_is_not_an_iteration_is_one_line(saved, tmp_path, capsys, tracker):
    """Megatron-LM's latest_checkpointed_iteration.txt holding no iteration: one line naming it (a
    Unicode digit such as '\u00b2' passes str.isdigit but not int(); bytes that are not UTF-8 raised
    UnicodeDecodeError)."""
    from tests.test_convert_megatron_pipeline import assert_from_megatron_refuses
    from zo_megatron.checkpoint import megatron_lm

    root = tmp_path / "root"
    shutil.copytree(saved["saved"]["gpt2_tp2"][1], root)
    (root / megatron_lm.TRACKER).write_bytes(tracker)
    assert_from_megatron_refuses([(str(root), ["expected an iteration number or 'release'"])], tmp_path, capsys)


def test_bad_torch_dist_checkpoints_are_one_line_exit_2(saved, tmp_path, capsys):
    import json

    from tests.test_convert_megatron_pipeline import assert_from_megatron_refuses
    from zo_megatron.checkpoint import megatron_lm

    src = saved["saved"]["mixtral_tp2_ep2"][1]
    it_dir = f"iter_{ITERATION:07d}"

    def variant(tag, edit):
        dst = str(tmp_path / tag)
        shutil.copytree(src, dst)
        edit(os.path.join(dst, it_dir))
        return dst

    def backend(d):
        with open(os.path.join(d, "metadata.json"), "w") as f:
            json.dump({"sharded_backend": "zarr", "sharded_backend_version": 1}, f)

    def no_data(d):
        os.remove(os.path.join(d, sorted(n for n in os.listdir(d) if n.endswith(".distcp"))[0]))

    def layers(d):
        path = os.path.join(d, "common.pt")
        common = megatron_lm.safe_load(path, model=False)
        common["args"].num_layers = 3
        torch.save(common, path)

    marker = tmp_path / "payload_ran"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    def planted_metadata(d):
        import pickle

        with open(os.path.join(d, ".metadata"), "wb") as f:
            pickle.dump(Payload(), f)

    def planted_common(d):
        path = os.path.join(d, "common.pt")
        common = megatron_lm.safe_load(path, model=False)
        common["args"].exit_signal = Payload()
        torch.save(common, path)

    cases = [
        (variant("planted_metadata", planted_metadata), [".metadata cannot be read safely", "refusing to load"]),
        (variant("planted_common", planted_common), ["common.pt: refusing to load", "system"]),
        (variant("backend", backend), ["sharded_backend 'zarr'", "--ckpt-format torch_dist"]),
        (variant("no_data", no_data), ["cannot be read", ".distcp"]),
        (variant("no_common", lambda d: os.remove(os.path.join(d, "common.pt"))), ["common.pt is missing"]),
        (variant("layers", layers), ["not 3 layers stacked", "the args are not the run's"]),
    ]
    assert_from_megatron_refuses(cases, tmp_path, capsys)
    assert not marker.exists()                          # no pickled code ran
