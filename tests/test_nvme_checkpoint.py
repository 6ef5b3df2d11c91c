"""DCP checkpoints with --optimizer-nvme-path (issue 38, 4): the states on disk are saved and loaded
through views over the mapped state files (no copy of them in process memory). A checkpoint saved
at TP1xDP2 with the moments and the master on disk loads, at TP2xDP1, into an in-memory engine and
an NVMe engine bit for bit as the in-memory engine's own checkpoint does, and vice versa; one more
step after the load (which reads the loaded files back through their new checksums) is bitwise the
same on all four."""
import os

import torch

from tests.harness import run_world
from tests.seeds import fresh_seed
from tests.test_nvme_engine import HEADS, HIDDEN, LAYERS, SEQ, VOCAB, _bits, _train

STEPS_BEFORE = 3


def _engine(ps, seed, nvme_dir, precision="bf16"):
    from zo_megatron.model import GPTConfig, build_gpt_model
    from zo_megatron.offload.engine import AdamConfig, ZeroOffloadEngine
    from zo_megatron.offload.nvme_store import NvmeConfig

    cfg = GPTConfig(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, vocab_size=VOCAB,
                    max_position_embeddings=SEQ, precision=precision)
    model = build_gpt_model(cfg, ps.tp_rank, ps.tp_size, seed)
    adam = AdamConfig(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-6, weight_decay=0.1, state_dtype="bf16")
    nvme = None if nvme_dir is None else NvmeConfig(nvme_dir, master=True, buffer_count=2, buffer_size=1024)
    engine = ZeroOffloadEngine(model, precision=precision, adam=adam, clip_grad=1.0, bucket_size=2500,
                               dp_group=ps.dp_group, tp_rank=ps.tp_rank, device=ps.device, nvme=nvme)
    return cfg, model, engine


def _local_state(engine):
    """{name: {state: the TP-local flat tensor of this DP rank's fragments}} from host_state_views."""
    out = {}
    for name, param, start, n, views in engine.host_state_views():
        for what, v in views.items():
            flat = out.setdefault(name, {}).setdefault(what, torch.zeros(param.numel(), dtype=v.dtype))
            flat[start:start + n] = v.reshape(-1)
    return out


def _save_world(rank, seed, root):
    from zo_megatron.checkpoint import save_checkpoint
    from zo_megatron.parallel import init_parallel

    ps = init_parallel(1, seed=seed, num_attention_heads=HEADS, hidden_size=HIDDEN)
    for name, nvme_dir in (("memory", None), ("nvme", os.path.join(root, "nvme-save"))):
        if nvme_dir is not None:
            os.makedirs(nvme_dir, exist_ok=True)
        cfg, model, engine = _engine(ps, seed, nvme_dir)
        _train_steps(engine, model, ps, seed, STEPS_BEFORE)
        save_checkpoint(os.path.join(root, name), STEPS_BEFORE, ps=ps, model=model, optimizer=engine,
                        vocab_size=VOCAB, train_state=dict(consumed_samples=0, consumed_valid_samples=0,
                                                           opt_param_scheduler=None),
                        model_meta=cfg.arch_meta(), args={})
        engine.close()


def _train_steps(engine, model, ps, seed, steps):
    return _train(engine, model, ps, seed, 1, None, steps)


def _load_world(rank, seed, root):
    from zo_megatron.checkpoint.load import LoadOptions, load_checkpoint
    from zo_megatron.parallel import init_parallel

    ps = init_parallel(2, seed=seed, num_attention_heads=HEADS, hidden_size=HIDDEN)
    out = {}
    for kind in ("memory", "nvme"):
        for saved in ("memory", "nvme"):
            nvme_dir = None if kind == "memory" else os.path.join(root, f"nvme-load-{saved}")
            if nvme_dir is not None:
                os.makedirs(nvme_dir, exist_ok=True)
            cfg, model, engine = _engine(ps, seed + 1, nvme_dir)            # another init: the load overwrites it
            fresh = {k: v.clone() for k, v in next(iter(_local_state(engine).values())).items()}
            load_checkpoint(os.path.join(root, saved), ps=ps, model=model, optimizer=engine, vocab_size=VOCAB,
                            model_meta=cfg.arch_meta(), schedule={}, opts=LoadOptions())
            loaded, flat = _local_state(engine), engine.flat.clone()
            steps = _train_steps(engine, model, ps, seed + 2, 1)             # reads the loaded files back
            out[kind, saved] = dict(loaded=loaded, flat=flat, after=_local_state(engine), flat_after=engine.flat.clone(),
                                    steps=steps, step_count=engine.step_count, fresh=fresh)
            engine.close()
            if nvme_dir is not None:
                mine = f"zo_optimizer.tp{ps.tp_rank}.dp{ps.dp_rank}."
                out[kind, saved]["left"] = [f for f in os.listdir(nvme_dir) if f.startswith(mine)]
    return out


def _same(a, b):
    return a.dtype == b.dtype and torch.equal(_bits(a), _bits(b))


def test_nvme_checkpoints_load_with_and_without_nvme_at_another_layout_bitwise(tmp_path):
    seed = fresh_seed("nvme checkpoint")
    run_world(_save_world, 2, seed, str(tmp_path), timeout=300)
    results = run_world(_load_world, 2, seed, str(tmp_path), timeout=300)
    for rank, res in enumerate(results):
        ref = res["memory", "memory"]
        first = next(iter(ref["loaded"]))
        assert ref["step_count"] == STEPS_BEFORE + 1
        assert not _same(ref["loaded"][first]["master"], ref["fresh"]["master"])    # the load replaced the init
        for key, got in res.items():
            what = f"rank {rank} {key}"
            assert set(got["loaded"]) == set(ref["loaded"]), what
            for name, states in ref["loaded"].items():
                for state, t in states.items():
                    assert _same(got["loaded"][name][state], t), (what, name, state)
                    assert _same(got["after"][name][state], ref["after"][name][state]), (what, name, state, "after")
            assert _same(got["flat"], ref["flat"]) and _same(got["flat_after"], ref["flat_after"]), what
            assert got["steps"] == ref["steps"], what
            assert got.get("left", []) == [], what
