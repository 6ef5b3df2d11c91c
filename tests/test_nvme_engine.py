"""--optimizer-nvme-path (issue 38): the engine with its Adam moments (and the fp32 master) in files,
streamed through a ring of a few small buffers, against the in-memory engine on the same model and
batches: losses, grad norms, clip coefficients, skips, the fp32 master, both moments (read back from
disk) and the 16-bit parameters are BITWISE equal, every element, at TP1xDP2 and TP2xDP1, with
accumulation, a clip that clips, bf16 and fp32 states, fp16 with an overflow skip, host accumulation,
--dpu and a partial offload (the device tail's states compared too). Ring depth, buffer size and I/O block come from the printed seed, so chunk cuts fall
inside segments (checked). The state files are gone after close()."""
import math
import os
import random

import pytest
import torch
import torch.distributed as dist

from tests.harness import run_world
from tests.seeds import fresh_seed

LAYERS, HIDDEN, HEADS, SEQ, VOCAB = 2, 64, 4, 16, 500
MICRO, STEPS = 2, 6
_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


def _bits(t):
    return t.contiguous().view(_INT[t.element_size()])


def _train(engine, model, ps, seed, accum, overflow_step, steps=STEPS):
    from zo_megatron.parallel import collectives

    victim = model.gpt.decoder.layers[0].mlp.linear_fc1.weight
    gen = torch.Generator().manual_seed(seed)
    out, speculated = [], []
    for step in range(steps):
        total = torch.zeros((), device=ps.device)
        engine.expect_lr(1e-3 * (1 + step / STEPS))         # (--overlap-cpu-step speculates with it)
        for i in range(accum):
            n = MICRO * ps.dp_size
            tokens, labels = (torch.randint(0, VOCAB, (n, SEQ), generator=gen) for _ in range(2))
            mine = slice(ps.dp_rank * MICRO, (ps.dp_rank + 1) * MICRO)
            with engine.forward_context():
                loss = model.loss(tokens[mine].to(ps.device), labels[mine].to(ps.device))
            handle = None
            if step == overflow_step and i == accum - 1 and dist.get_rank() == dist.get_world_size() - 1:
                handle = victim.register_hook(lambda g: g.index_fill(0, torch.tensor([3], device=g.device), float("inf")))
            engine.backward(loss / accum, last_micro_batch=i == accum - 1)
            if handle is not None:
                handle.remove()
            total += loss.detach().float() / accum
        collectives.all_reduce(total, group=ps.dp_group)
        res = engine.step(lr=1e-3 * (1 + step / STEPS))
        out.append((total.item(), res.grad_norm, res.clip_coef, res.skipped, res.loss_scale,
                    engine.schedule.pending is not None))
        speculated.append((res.speculated_buckets, res.rolled_back_buckets))
    engine.flush()
    return out, speculated


def _states(engine):
    """fp32 master, exp_avg, exp_avg_sq of the partition (read from disk where they live there)."""
    parts = {k: [] for k in ("master", "exp_avg", "exp_avg_sq")}
    if engine._nvme is None:
        for k in parts:
            parts[k].append(getattr(engine, k).clone())
    else:
        for lo, hi, st in engine._nvme.stream(write=False):
            for k in parts:
                parts[k].append(st[k].clone() if k in st else getattr(engine, k)[lo:hi].clone())
    if engine._tail is not None:                       # --optimizer-offload-fraction < 1: the device part
        for k in parts:
            parts[k].append(getattr(engine._tail, k).cpu().clone())
    return {k: torch.cat(v) for k, v in parts.items()}


def _pair_world(rank, tp, seed, runs, nvme_dir):
    """For each run: the in-memory engine, then the NVMe one, from the same model and batches."""
    from zo_megatron.model import GPTConfig, build_gpt_model
    from zo_megatron.offload.engine import AdamConfig, ZeroOffloadEngine
    from zo_megatron.offload.loss_scaler import DynamicLossScaler
    from zo_megatron.offload.nvme_store import NvmeConfig
    from zo_megatron.parallel import init_parallel

    ps = init_parallel(tp, seed=seed, num_attention_heads=HEADS, hidden_size=HIDDEN)
    rng = random.Random(seed)
    results = []
    for run in runs:
        precision, accum, overflow, kw = run["precision"], run["accum"], run.get("overflow"), run["engine"]
        cfg = GPTConfig(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, vocab_size=VOCAB,
                        max_position_embeddings=SEQ, precision=precision)
        nvme = NvmeConfig(nvme_dir, master=run["master"], buffer_count=rng.randint(1, 4),
                          buffer_size=64 * rng.randint(4, 40), io_threads=rng.randint(1, 4),
                          block_bytes=4096 * rng.randint(1, 3))
        got, mine = {}, "-"
        for name, extra in (("memory", {}), ("nvme", {"nvme": nvme})):
            model = build_gpt_model(cfg, ps.tp_rank, ps.tp_size, seed)     # the same init both times (checked)
            init = torch.cat([p.detach().reshape(-1).float() for p in model.parameters()])
            adam = AdamConfig(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-6, weight_decay=0.1, state_dtype=run["states"])
            scaler = DynamicLossScaler(initial_scale=2.0 ** 12) if precision == "fp16" else None
            if kw.get("overlap_cpu_step"):        # a share from the seed: chunks cut inside the prefix too
                kw = {**kw, "overlap_speculated_fraction": kw.get("overlap_speculated_fraction", rng.uniform(0.4, 1.0))}
            engine = ZeroOffloadEngine(model, precision=precision, adam=adam, clip_grad=run["clip"], bucket_size=2500,
                                       dp_group=ps.dp_group, tp_rank=ps.tp_rank, device=ps.device,
                                       loss_scaler=scaler, **kw, **extra)
            if kw.get("overlap_cpu_step"):
                engine.schedule.max_backoff = 0    # speculate every step, rolled back or not
            steps, speculated = _train(engine, model, ps, seed + 1, accum, overflow)
            cuts_inside = prefetched = None
            if engine._nvme is not None:
                prefetched = engine._nvme.prefetched_chunks
                segs = engine._host_segments
                cuts_inside = sum(any(s < b < e for s, e, *_ in segs) for _, b in engine._nvme.chunks)
                mine = f"zo_optimizer.tp{ps.tp_rank}.dp{ps.dp_rank}."
                files = sorted(f for f in os.listdir(nvme_dir) if f.startswith(mine) and f.endswith(".bin"))
            got[name] = dict(init=init, steps=steps, flat=engine.flat.cpu().clone(), states=_states(engine),
                             cuts_inside=cuts_inside, files=files if engine._nvme is not None else None,
                             prefetched=prefetched, speculated=speculated,
                             shadow=None if engine._nvme is None else engine._nvme.shadow_chunks,
                             disk=engine.accounting.nvme_disk_bytes, overlap_bytes=engine.accounting.host_overlap_bytes,
                             chunks=None if engine._nvme is None else len(engine._nvme.chunks),
                             slot=None if engine._nvme is None else sum(engine._nvme.slot_bytes.values()),
                             budget=getattr(engine.schedule, "budget", None))
            engine.close()
            got[name]["left"] = [f for f in os.listdir(nvme_dir) if f.startswith(mine)]
        results.append(got)
    return results


def _check(results, runs):
    for rank, per_rank in enumerate(results):
        for run, got in zip(runs, per_rank):
            mem, nv = got["memory"], got["nvme"]
            what = f"rank {rank} {run}"
            assert len(nv["files"]) == 3 if run["master"] else len(nv["files"]) == 2, (what, nv["files"])
            assert nv["left"] == [], (what, nv["left"])                     # removed at close
            assert nv["cuts_inside"] > 0, what                              # chunks cut inside segments
            # each step's first reads start early: when backward starts, or (--dpu) right after the last pass
            assert nv["prefetched"] > 0, (what, nv["prefetched"])
            for a, b in zip(mem["steps"], nv["steps"]):                     # loss, norm, clip, skip, scale
                assert all(x == y or (isinstance(x, float) and math.isnan(x) and math.isnan(y))
                           for x, y in zip(a, b)), (what, a, b)
            assert torch.equal(mem["init"], nv["init"]), what
            assert torch.equal(_bits(mem["flat"]), _bits(nv["flat"])), what
            for k in ("master", "exp_avg", "exp_avg_sq"):
                m, n = mem["states"][k], nv["states"][k]
                assert m.dtype == n.dtype and m.shape == n.shape, (what, k)
                bad = (_bits(m) != _bits(n)).nonzero()
                assert bad.numel() == 0, f"{what}: {k} differs at {bad[:5].flatten().tolist()}"
        steps = per_rank[0]["memory"]["steps"]
        for run, got in zip(runs, per_rank):                                # the cases happened
            s = got["memory"]["steps"]
            if run["clip"] < 1:
                assert min(c for _, _, c, skip, _, _ in s if not skip) < 1.0, "the clip must clip"
            if run.get("overflow") is not None:
                assert [x[3] for x in s] == [i == run["overflow"] for i in range(STEPS)]
            if run["engine"].get("dpu_warmup_steps"):
                assert any(x[5] for x in s), "an update must have been delayed"
            if run["engine"].get("overlap_cpu_step"):
                _check_speculation(run, got)
        assert steps


def _check_speculation(run, got):
    """--overlap-cpu-step with the tier: it speculated (committed where nothing clips, overflows or
    rolls back, rolled back where the clip clips), the chunks it may speculate have their second
    place on disk (the files grew by exactly those), and the rollback backup in memory holds only
    what is not on disk: the in-memory engine's less both moments (and the master with it on disk)."""
    nv, mem = got["nvme"], got["memory"]
    spec = [s for s, _ in nv["speculated"]]
    assert sum(spec) > 0, (run, nv["speculated"])
    if run["clip"] < 1:
        assert all(r == s for s, r in nv["speculated"]), nv["speculated"]          # every one rolled back
    else:
        assert any(s > 0 and r == 0 for s, r in nv["speculated"]), nv["speculated"]  # committed
    assert 0 < nv["shadow"] <= nv["chunks"], (nv["shadow"], nv["chunks"])
    assert nv["disk"] == (nv["chunks"] + nv["shadow"]) * nv["slot"], (nv["disk"], nv["chunks"], nv["shadow"])
    state_bytes = 2 if run["states"] == "bf16" else 4
    on_disk = nv["budget"] * (2 * state_bytes + (4 if run["master"] else 0))
    assert mem["overlap_bytes"] - nv["overlap_bytes"] == on_disk > 0, (mem["overlap_bytes"], nv["overlap_bytes"])


RUNS = {
    "tp1dp2": [
        dict(precision="bf16", accum=2, clip=0.05, states="fp32", master=True, engine={}),
        dict(precision="fp32", accum=1, clip=1.0, states="fp32", master=False, engine={"dpu_warmup_steps": 3}),
        # partial offload: the host part's states on disk, the tail's on the device
        dict(precision="bf16", accum=2, clip=0.05, states="fp32", master=True, engine={"optimizer_offload_fraction": 0.6}),
        # the overlap with the master on disk and a device tail: speculated chunks committed
        dict(precision="bf16", accum=2, clip=1e3, states="fp32", master=True,
             engine={"overlap_cpu_step": True, "optimizer_offload_fraction": 0.8}),
        # weight prediction with the master on disk: a flush reads the exact master back
        dict(precision="fp32", accum=1, clip=1.0, states="fp32", master=True,
             engine={"dpu_warmup_steps": 3, "dpu_weight_prediction": True}),
    ],
    "tp2dp1": [
        dict(precision="fp16", accum=2, clip=0.05, states="bf16", master=True, overflow=2, engine={}),
        dict(precision="bf16", accum=2, clip=1.0, states="bf16", master=False, engine={"accumulate_on_host": True}),
        # the overlap rolled back every step (the clip clips; an overflow), the master in memory
        dict(precision="fp16", accum=2, clip=0.05, states="bf16", master=False, overflow=2,
             engine={"overlap_cpu_step": True}),
        # the overlap committing, gradients accumulated on the host (the worker adds each shard)
        dict(precision="bf16", accum=2, clip=1e3, states="fp32", master=False,
             engine={"overlap_cpu_step": True, "accumulate_on_host": True}),
    ],
}


@pytest.mark.parametrize("layout", list(RUNS))
def test_nvme_engine_is_bitwise_the_in_memory_engine(tmp_path, layout):
    seed = fresh_seed(f"nvme engine {layout}")
    runs = RUNS[layout]
    tp = 1 if layout == "tp1dp2" else 2
    results = run_world(_pair_world, 2, tp, seed, runs, str(tmp_path), timeout=300)
    _check(results, runs)


def _refusals_world(rank, root):
    from zo_megatron.errors import ConfigError, UserError
    from zo_megatron.model import GPTConfig, build_gpt_model
    from zo_megatron.offload.engine import ZeroOffloadEngine
    from zo_megatron.offload.nvme_store import NvmeConfig, NvmeStateStore
    from zo_megatron.parallel import init_parallel

    init_parallel(1, seed=1, num_attention_heads=4, hidden_size=64)
    cfg = GPTConfig(num_layers=1, hidden_size=64, num_attention_heads=4, vocab_size=100, max_position_embeddings=8,
                    precision="fp32")
    model = build_gpt_model(cfg, 0, 1, 1)
    path = os.path.join(root, f"rank{rank}")
    os.makedirs(path)
    nv = NvmeConfig(path)
    cases = [({}, NvmeConfig(**{**nv.__dict__, **bad}))
              for bad in (dict(buffer_count=0), dict(buffer_size=100), dict(path=path + "/nope"))]
    messages = []
    for kw, config in cases:
        try:
            ZeroOffloadEngine(model, precision="fp32", nvme=config, **kw)
            messages.append(None)
        except ConfigError as e:
            messages.append(str(e))
    left = os.listdir(path)
    with ZeroOffloadEngine(model, precision="fp32", nvme=nv) as engine:
        try:
            engine.state_dict()
            messages.append(None)
        except ConfigError as e:
            messages.append(str(e))
    accounts = []                                      # (ring, disk, partition, chunks) for the planner's check
    for config in (nv, NvmeConfig(path, master=True, buffer_count=3, buffer_size=1024)):
        with ZeroOffloadEngine(model, precision="fp32", nvme=config) as engine:
            a = engine.accounting
            accounts.append((config.master, config.buffer_count, config.buffer_size, a.host_nvme_buffer_bytes,
                             a.nvme_disk_bytes, engine._cut, len(engine._nvme.chunks), a.host_master_bytes,
                             a.host_optimizer_bytes))
    # another job holds rank 1's files in a shared directory: every rank refuses, none hangs
    shared = NvmeConfig(root)
    other = NvmeStateStore(shared, "zo_optimizer.tp0.dp1", [(0, 64)], 64, {"exp_avg": torch.float32}) \
        if rank == 1 else None
    try:
        ZeroOffloadEngine(model, precision="fp32", nvme=shared)
        messages.append(None)
    except UserError as e:
        messages.append(str(e))
    finally:
        if other is not None:
            other.close()
    # rank 1's lock file cannot be opened (here: a directory in its place; a file of another user is
    # an EACCES): an OSError, not only the store's own refusals, is every rank's line
    locked = os.path.join(root, "locked")
    os.makedirs(os.path.join(locked, "zo_optimizer.tp0.dp1.lock") if rank == 1 else locked, exist_ok=True)
    try:
        ZeroOffloadEngine(model, precision="fp32", nvme=NvmeConfig(locked))
        messages.append(None)
    except UserError as e:
        messages.append(str(e))
    return messages, left, accounts


def test_nvme_refusals_are_one_line_and_every_rank_refuses_together(tmp_path):
    results = run_world(_refusals_world, 2, str(tmp_path))
    needles = ["--optimizer-nvme-buffer-count must be >= 1", "--optimizer-nvme-buffer-size must be a positive multiple",
               "is not a directory", "state_dict() of optimizer states on disk would copy them all"]
    for rank, (messages, left, accounts) in enumerate(results):
        _planner_equals_the_engine(accounts)
        # (every rank: rank 1's line, which rank 0 prints; before, rank 0's said "another rank refused")
        lock = f"rank 1: --optimizer-nvme-path {tmp_path}/locked: setting up this rank's state files failed (IsADirectoryError"
        shared = f"rank 1: --optimizer-nvme-path {tmp_path} is in use by another job"
        for m, needle in zip(messages, [*needles, shared, lock], strict=True):
            assert m is not None and needle in m and "\n" not in m, (rank, needle, m)
        assert left == []                              # a refused engine leaves no file behind
    assert sorted(os.listdir(tmp_path)) == ["locked", "rank0", "rank1"]
    assert os.listdir(tmp_path / "locked") == ["zo_optimizer.tp0.dp1.lock"]     # rank 0 removed all its files


def _planner_equals_the_engine(accounts):
    """The planner's nvme_bytes against the engine's accounting for the same partition: the ring
    exactly (one chunk; 1024-element chunks), the disk within the few chunks the store cuts short."""
    from zo_megatron.planner import PlanInput
    from zo_megatron.planner.memory import nvme_bytes

    for master, count, size, ring, disk, part, chunks, host_master, host_moments in accounts:
        inp = PlanInput(num_layers=1, hidden_size=64, num_attention_heads=4, vocab_size=100, seq_length=8,
                        nvme_states=True, nvme_master=master, nvme_buffer_count=count, nvme_buffer_size=size)
        planned_ring, planned_disk = nvme_bytes(inp, part, 4)
        assert planned_ring == ring > 0, (master, size, planned_ring, ring)
        assert planned_disk <= disk <= planned_disk * chunks / -(-part // min(size, part)), (planned_disk, disk)
        assert host_moments == 0 and host_master == (0 if master else 4 * part)
