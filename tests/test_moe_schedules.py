"""The CPU step's schedules and state placements with experts (issue 39, the engine): bf16 optimizer
states, DPU (with and without weight prediction), --overlap-cpu-step, a partial offload and the NVMe
tier, at EP 2 (offload/expert_parallel.py: a dense engine over DP and an expert engine over expert
DP, one norm) and at EP 1 (the plain engine, experts replicated over DP).

A random Mixtral (transformers' weights through the from-hf mapping, as tests/test_moe_training.py)
on 2 gloo ranks, 2 micro-batches accumulated, a clip that clips. The references:

  - the same option at EP 1 (the plain engine, already held to torch: tests/test_moe_training.py,
    test_dpu.py): EP 2 gives its losses and norms within 1e-5 and its weights within fp32's
    reduction order (tests/fp32_bounds.py's fixed bounds): not bitwise, because at EP 2 an expert's
    gradient sums both ranks' tokens in one matmul after the all-to-all (at EP 1 each rank's, then
    averaged over DP), and the norm adds the engines' partitions in another grouping;
  - where an option changes no math, the same EP 2 run without it, bit for bit: --overlap-cpu-step
    against the synchronous step (tests/test_overlap.py's check), the NVMe tier against the states
    in memory (tests/test_nvme_engine.py's).
"""
import pytest
import torch
import torch.distributed as dist

from tests.fp32_bounds import MAX_RTOL, NORM_RTOL, rel_max, rel_norm
from tests.harness import next_port, run_world
from tests.seeds import fresh_seed
from tests.test_moe_model import SEQ, VOCAB, _configs, _ours, _random_hf
from tests.training_loops import random_batches

transformers = pytest.importorskip("transformers")

MICRO, ACCUM, DP = 2, 2, 2
WD, BETAS, EPS = 0.1, (0.9, 0.95), 1e-6
CLIP = 0.05                      # the grad norms here are ~0.3-3: every step clips
NO_CLIP = 1e9
VICTIM = "decoder.layers.0.mlp.experts.local_experts.3.linear_fc1.weight"   # global expert 3: EP rank 1's at EP 2


def _lr(step):
    return 3e-3 * (0.5 + 0.05 * step)


def _bits(t):
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _engines(engine):
    return (engine.dense, engine.experts) if hasattr(engine, "experts") else (engine,)


def _state(engine) -> dict:
    """Every optimizer state this rank owns, wherever it lives (host, device tail, disk): per engine,
    parameter and state, its fragments joined in order (the NVMe tier's views come in chunks)."""
    pieces = {}
    for e, part in zip(_engines(engine), ("dense", "experts")):
        for name, _p, start, _n, views in e.host_state_views():
            for key, view in views.items():
                pieces.setdefault((part, name, key), []).append((start, view.detach().cpu().clone()))
    return {k: torch.cat([t for _, t in sorted(v, key=lambda x: x[0])]) for k, v in pieces.items()}


def _train(ps, model, engine, batches, run):
    """The run's steps; per step the records the tests compare (flat: every engine's 16-bit
    parameters after the step, as bits)."""
    from zo_megatron.parallel import collectives

    rec = {k: [] for k in ("losses", "norms", "clips", "skipped", "spec", "rolled", "in_flight", "flat")}
    victim = next((p for n, p in model.named_parameters() if model.full_name(n).endswith(VICTIM)), None)
    for step, micro_batches in enumerate(batches):
        for e in _engines(engine):
            e.clip_grad = run.get("clip", lambda s: CLIP)(step)
        if step != run.get("silent_lr_step"):
            engine.expect_lr(_lr(step))
        total = torch.zeros((), device=ps.device)
        for i, (tokens, labels) in enumerate(micro_batches):
            rows = tokens.shape[0] // ps.dp_size
            mine = slice(ps.dp_rank * rows, (ps.dp_rank + 1) * rows)
            with engine.forward_context():
                loss = model.loss(tokens[mine].to(ps.device), labels[mine].to(ps.device))
            handle = None
            if step == run.get("bad_step") and i == ACCUM - 1 and dist.get_rank() == 1 and victim is not None:
                handle = victim.register_hook(lambda g: g.index_fill(0, torch.tensor([3]), float("nan")))
            engine.backward(loss / ACCUM, last_micro_batch=i == ACCUM - 1)
            if handle is not None:
                handle.remove()
            total += loss.detach().float() / ACCUM
        collectives.all_reduce(total, group=ps.dp_group)
        res = engine.step(lr=_lr(step))
        for key, v in (("norms", res.grad_norm), ("clips", res.clip_coef), ("skipped", res.skipped),
                       ("spec", res.speculated_buckets), ("rolled", res.rolled_back_buckets)):
            rec[key].append(v)
        rec["losses"].append(total.item() / ps.dp_size)
        rec["in_flight"].append([e.schedule.pending is not None for e in _engines(engine)])
        rec["flat"].append([_bits(e.flat.detach().cpu()).clone() for e in _engines(engine)])
        if step == run.get("flush_at"):
            assert engine.flush() is not None
    return rec


def _world(rank, directory, seed, plan, steps, nvme_dir=None):
    """plan: [(EP, {run name: engine options and test hooks})]; every run from the same initial model
    on the same batches. Returns {(EP, run name): records}."""
    from zo_megatron.parallel import collectives, destroy_parallel, init_parallel

    meta, init = _ours(directory)
    out = {}
    for ep, runs in plan:
        next_port()                                  # chosen now, not when the test started
        ps = init_parallel(1, seed=seed, expert_parallel=ep)
        for name, run in runs.items():
            out[(ep, name)] = _one_run(ps, meta, init, seed, ep, run, steps, f"{nvme_dir}/ep{ep}-{name}")
        collectives.barrier()
        destroy_parallel()
    return out


def _one_run(ps, meta, init, seed, ep, run, steps, nvme_dir):
    import os

    from zo_megatron.model import GPTConfig, build_gpt_model
    from zo_megatron.model.sharding import gather_full, load_full_params, model_shard_infos
    from zo_megatron.offload.engine import AdamConfig, ZeroOffloadEngine
    from zo_megatron.offload.expert_parallel import ExpertParallelEngine
    from zo_megatron.offload.loss_scaler import DynamicLossScaler
    from zo_megatron.offload.nvme_store import NvmeConfig

    batches = random_batches(seed, steps, ACCUM, MICRO * DP, SEQ, VOCAB)
    precision = run.get("precision", "fp32")
    cfg = GPTConfig(**{**meta, "moe_token_dispatcher_type": "alltoall"}, precision=precision)
    model = build_gpt_model(cfg, ps.tp_rank, ps.tp_size, seed)
    load_full_params(model, init, ps.tp_rank, ps.tp_size, VOCAB)
    kw = dict(run.get("engine", {}))
    if kw.pop("nvme", False):
        os.makedirs(nvme_dir, exist_ok=True)
        kw["nvme"] = NvmeConfig(nvme_dir, buffer_count=2, buffer_size=2048)
    if precision == "fp16":          # a live scale: grows every 3 clean steps, halves on an overflow
        kw["loss_scaler"] = DynamicLossScaler(initial_scale=2.0**12, growth_interval=3, hysteresis=1)
    adam = AdamConfig(lr=_lr(0), beta1=BETAS[0], beta2=BETAS[1], eps=EPS, weight_decay=WD,
                      state_dtype=run.get("states", "fp32"))
    common = dict(precision=precision, adam=adam, clip_grad=CLIP, bucket_size=3000, tp_rank=ps.tp_rank,
                  device=ps.device, tp_group=ps.tp_group, race_check=True, **kw)
    engine = ExpertParallelEngine(model, dp_group=ps.dp_group, edp_group=ps.edp_group, dp_size=ps.dp_size,
                                  **common) if ep > 1 else ZeroOffloadEngine(model, dp_group=ps.dp_group, **common)
    for e in _engines(engine):
        if hasattr(e.schedule, "max_backoff"):
            e.schedule.max_backoff = 0            # every step speculates: every transition is covered
    rec = _train(ps, model, engine, batches, run)
    engine.flush()
    rec["state"] = _state(engine)
    infos = model_shard_infos(model, ps.tp_rank, ps.tp_size, VOCAB)      # the full (unpadded) tensors
    rec["final"] = {model.full_name(n): gather_full(p.detach(), infos[n], ps.tp_group, ps.tp_size).float().cpu().clone()
                    for n, p in model.named_parameters()}
    engine.close()
    return rec


def _go(mixtral, plan, steps, **kw):
    """Run `plan` on 2 ranks: {(EP, run name): rank 0's records, with every rank's final weights (at
    EP 2 each rank holds half the experts)} and, under "ranks", every rank's records."""
    seed, directory = mixtral
    worlds = run_world(_world, 2, directory, seed, plan, steps, timeout=400, **kw)
    out = {key: dict(worlds[0][key], final={n: t for w in worlds for n, t in w[key]["final"].items()})
           for key in worlds[0]}
    out["ranks"] = worlds
    return out


def _assert_ep2_is_ep1(two, one, what):
    """Losses and norms within 1e-5, every weight within fp32's fixed bounds (module docstring)."""
    for key in ("losses", "norms"):
        for s, (a, b) in enumerate(zip(two[key], one[key])):
            assert (a != a and b != b) or abs(a - b) <= 1e-5 * abs(b), (what, key, s, two[key], one[key])
    assert two["skipped"] == one["skipped"], what
    assert set(two["final"]) == set(one["final"])
    for n, ref in one["final"].items():
        got = two["final"][n]
        assert rel_norm(got, ref) <= NORM_RTOL and rel_max(got, ref) <= MAX_RTOL, \
            (what, n, rel_norm(got, ref), rel_max(got, ref))


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    seed = fresh_seed("moe schedules")
    return seed, _random_hf(tmp_path_factory.mktemp("mixtral"), _configs()["mixtral"], seed)


# ------------------------------------------------------------------------------------------ DPU
DPU_STEPS, WARMUP = 8, 3


@pytest.mark.parametrize("predict", [False, pytest.param(True, marks=pytest.mark.slow)],
                         ids=["plain", "weight-prediction"])     # the second: an exhaustive variant
def test_dpu_at_ep2_equals_dpu_at_ep1(mixtral, predict):
    """--dpu (and --dpu-corrector weight-prediction) at EP 2: both engines delay their CPU step from
    the same W-th update on (one step count), the pending update is joined by both at the next step,
    and a flush mid-run (as evaluation and checkpoints flush) flushes both; a NaN in one expert's
    gradient on rank 1 (the expert engine's partition only) is one overflow decision: both engines
    skip it (the pending update still applied). Over warm-up and 5 delayed steps, clipping every
    step, the run equals the plain engine's DPU at EP 1 (module docstring: within fp32's reduction
    order). Both engines have an update in flight after exactly the steps the delay says (the test
    tells delayed from exact; the EP 1 run is the delayed torch reference's: test_dpu.py, and
    test_the_plain_engine_with_experts_at_ep1 below)."""
    dpu = {"engine": {"dpu_warmup_steps": WARMUP, "dpu_weight_prediction": predict}, "flush_at": 5, "bad_step": 6}
    runs = {"dpu": dpu}
    out = _go(mixtral, [(1, runs), (2, runs)], DPU_STEPS)
    one = {name: out[(1, name)] for name in runs}
    two = {name: out[(2, name)] for name in runs}
    # in flight in both engines after every update from the W-th on (recorded before the flush), but the skipped
    delayed = [s >= WARMUP - 1 and s != 6 for s in range(DPU_STEPS)]
    assert two["dpu"]["in_flight"] == [[d, d] for d in delayed], two["dpu"]["in_flight"]
    assert one["dpu"]["in_flight"] == [[d] for d in delayed], one["dpu"]["in_flight"]
    assert two["dpu"]["skipped"] == [s == 6 for s in range(DPU_STEPS)]
    assert max(two["dpu"]["clips"][s] for s in range(DPU_STEPS) if s != 6) < 1.0      # every step clips
    _assert_ep2_is_ep1(two["dpu"], one["dpu"], "dpu")


# --------------------------------------------------------------------------------- bit for bit
def _assert_bitwise(out, key, ref_key):
    """Every rank: losses, norms, clip coefficients, skips, each engine's 16-bit parameters after
    every step and every optimizer state fragment at the end, bit for bit."""
    for rank, w in enumerate(out["ranks"]):
        a, b = w[key], w[ref_key]
        for k in ("losses", "norms", "clips", "skipped"):
            assert all(x == y or (x != x and y != y) for x, y in zip(a[k], b[k])), (rank, key, k, a[k], b[k])
        for s, (x, y) in enumerate(zip(a["flat"], b["flat"])):
            assert all(torch.equal(u, v) for u, v in zip(x, y)), (rank, key, f"parameters after step {s}")
        assert a["state"].keys() == b["state"].keys()
        for k, t in b["state"].items():
            assert t.dtype == a["state"][k].dtype and torch.equal(_bits(a["state"][k]), _bits(t)), (rank, key, k)


OVERLAP_STEPS = 9


def _clip_every_third(step):
    return CLIP if step % 3 == 1 else NO_CLIP


@pytest.mark.parametrize("precision,engine,bad_step,silent_lr_step", [
    pytest.param("fp32", {}, 4, 6, marks=pytest.mark.slow), ("fp16", {"accumulate_on_host": True}, 5, None)],
    ids=["fp32-accum2-nan-lr", "fp16-hostacc2-overflow"])
def test_overlap_at_ep2_is_bit_identical_to_the_synchronous_step(mixtral, precision, engine, bad_step, silent_lr_step):
    """--overlap-cpu-step at EP 2: both engines speculate their buckets during backward and validate
    against the one global norm and overflow decision, so both commit (unclipped steps) or both roll
    back (a clipping step, the NaN in one expert's gradient on rank 1, a learning rate not announced)
    and the run is the synchronous EP 2 run bit for bit. fp16: the loss scale moves (grows every 3
    clean steps, halves at the overflow) and the expert engine speculates with the scale the dense
    engine's backward uses, so a clean step after a change commits in both; host accumulation: the
    norm reads the host accumulator only after both engines' workers are joined."""
    hooks = dict(precision=precision, clip=_clip_every_third, bad_step=bad_step, silent_lr_step=silent_lr_step)
    runs = {"sync": hooks, "overlap": {**hooks, "engine": {**engine, "overlap_cpu_step": True}}}
    runs["sync"] = {**hooks, "engine": engine}
    out = _go(mixtral, [(2, runs)], OVERLAP_STEPS)
    _assert_bitwise(out, (2, "overlap"), (2, "sync"))
    rec = out[(2, "overlap")]
    assert rec["skipped"] == [s == bad_step for s in range(OVERLAP_STEPS)]
    assert out[(2, "sync")]["spec"] == [0] * OVERLAP_STEPS and sum(rec["spec"]) > 0, rec["spec"]
    for s in range(OVERLAP_STEPS):
        clipped = _clip_every_third(s) == CLIP and s != bad_step
        assert (rec["clips"][s] < 1.0) == clipped or s == bad_step, (s, rec["clips"])
        must_roll = clipped or s in (bad_step, silent_lr_step)
        assert rec["rolled"][s] == (rec["spec"][s] if must_roll else 0), (s, rec["rolled"], rec["spec"])
    if precision == "fp16":
        assert len(set(rec["norms"][s] for s in range(OVERLAP_STEPS))) > 1
        scales = out["ranks"][0][(2, "overlap")]
        assert scales is not None


PLACEMENT_STEPS = 6


@pytest.mark.parametrize("dpu", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["sync", "dpu"])
def test_nvme_and_partial_offload_at_ep2(mixtral, tmp_path, dpu):
    """The NVMe tier at EP 2 (each engine its own state files, the expert engine's named by its
    rank), synchronous (and under DPU: -m slow), is the in-memory EP 2 run bit for bit. A partial offload
    (--optimizer-offload-fraction 0.5: the tail of each engine's partition on the device, updated by
    torch's fused Adam, not bitwise the CPU kernel) equals the plain engine's partial offload at EP 1
    within fp32's reduction order."""
    schedule = {"dpu_warmup_steps": 2} if dpu else {}
    runs = {"memory": {"engine": schedule}, "nvme": {"engine": {**schedule, "nvme": True}}}
    plan = [(2, runs)]
    if not dpu:                     # (DPU does not combine with a partial offload)
        partial = {"engine": {"optimizer_offload_fraction": 0.5}}
        runs["partial"] = partial
        plan.insert(0, (1, {"partial": partial}))
    out = _go(mixtral, plan, PLACEMENT_STEPS, nvme_dir=str(tmp_path))
    _assert_bitwise(out, (2, "nvme"), (2, "memory"))
    if not dpu:
        _assert_ep2_is_ep1(out[(2, "partial")], out[(1, "partial")], "partial offload")
    assert not any((tmp_path / "ep2-nvme").glob("*.bin"))          # the state files go at close


def test_bf16_states_at_ep2_track_ep1(mixtral):
    """--exp-avg-dtype/--exp-avg-sq-dtype bf16 at EP 2: both engines keep bf16 moments (every state
    fragment of both), and the run is the plain engine's bf16 run at EP 1 within fp32's reduction
    order as the bf16 moments' rounding carries it (_assert_within_bf16_rounding)."""
    runs = {"bf16": {"states": "bf16"}}
    out = _go(mixtral, [(1, runs), (2, {**runs, "fp32": {}})], PLACEMENT_STEPS)
    two, one, fp32 = out[(2, "bf16")], out[(1, "bf16")], out[(2, "fp32")]
    for w in out["ranks"]:
        parts = {k[0] for k in w[(2, "bf16")]["state"]}
        assert parts == {"dense", "experts"}
        for k, t in w[(2, "bf16")]["state"].items():
            assert t.dtype == (torch.float32 if k[2] == "master" else torch.bfloat16), k
    _assert_within_bf16_rounding(two, one, fp32)


def _assert_within_bf16_rounding(two, one, fp32):
    """bf16 moments round each update's m and v to 8 bits: where the two runs' fp32 values (equal
    within fp32's reduction order) straddle a rounding boundary, one element's update differs by up
    to ~2^-8 of it. So: losses and norms within 1e-5; per tensor, at most 2% of the elements (and 2
    in any tensor) farther apart than fp32's noise (1e-6 of the tensor's largest element; measured
    0-0.8%), and none farther than 2^-6 of the learning rates summed over the steps. The same run with
    fp32 moments differs beyond that noise in most elements of every tensor (measured 76-99%)."""
    for key in ("losses", "norms"):
        for a, b in zip(two[key], one[key]):
            assert abs(a - b) <= 1e-5 * abs(b), (key, two[key], one[key])
    assert set(two["final"]) == set(one["final"])
    bound = 2.0**-6 * sum(_lr(s) for s in range(len(one["losses"])))
    for n, ref in one["final"].items():
        noise = 1e-6 * ref.abs().max()
        diff = (two["final"][n] - ref).abs()
        apart = int((diff > noise).sum())
        assert apart <= max(2, 0.02 * ref.numel()) and diff.max() <= bound, (n, apart, ref.numel(), diff.max().item())
        assert ((fp32["final"][n] - ref).abs() > noise).float().mean() >= 0.5, n


# ----------------------------------------------------------------------- EP 1: the plain engine
def _delayed_torch_adamw(directory, tmp_path, seed, steps, warmup, flush_at, dtype=torch.float64):
    """tests/test_dpu.py's delayed reference on transformers' Mixtral in `dtype`, one process: updates
    before the W-th at once; from the W-th on the update of step t's (clipped) gradient is applied at
    step t+1, after step t+1's gradient was computed; a flush at `flush_at` and the end apply what is
    pending. Returns (losses, final weights in our names)."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(directory, local_files_only=True, dtype=torch.float32,
                                                           attn_implementation="eager",
                                                           experts_implementation="eager").to(dtype)
    params = list(hf.parameters())
    opt = torch.optim.AdamW([{"params": [p for p in params if p.dim() > 1], "weight_decay": WD},
                             {"params": [p for p in params if p.dim() <= 1], "weight_decay": 0.0}],
                            lr=_lr(0), betas=BETAS, eps=EPS)

    def apply(update):
        grads, lr = update
        for p, g in zip(params, grads):
            p.grad = g
        for group in opt.param_groups:
            group["lr"] = lr
        opt.step()

    losses, pending = [], None
    for step, micro_batches in enumerate(random_batches(seed, steps, ACCUM, MICRO * DP, SEQ, VOCAB)):
        opt.zero_grad()
        total = 0.0
        for tokens, labels in micro_batches:
            loss = torch.nn.functional.cross_entropy(hf(tokens).logits.reshape(-1, VOCAB), labels.reshape(-1))
            (loss / ACCUM).backward()
            total += loss.item() / ACCUM
        losses.append(total)
        torch.nn.utils.clip_grad_norm_(params, CLIP)
        update = ([p.grad.clone() for p in params], _lr(step))
        if pending is not None:
            apply(pending)
            pending = None
        if step + 1 >= warmup:          # the (step + 1)-th update: delayed from the W-th on
            pending = update
        else:
            apply(update)
        if step == flush_at and pending is not None:
            apply(pending)
            pending = None
    if pending is not None:
        apply(pending)
    out = tmp_path / f"delayed_{dtype}".replace("torch.", "")
    hf.float().save_pretrained(str(out))
    return losses, _ours(str(out))[1]


@pytest.mark.slow      # an exhaustive variant: the plain engine's schedules, held to their references on dense models
def test_the_plain_engine_with_experts_at_ep1(mixtral, tmp_path):
    """EP 1 (every expert on every rank, the plain engine): --overlap-cpu-step is the synchronous
    step bit for bit (a clip every third step: rollbacks and commits), the NVMe tier the in-memory
    states bit for bit, and DPU (warm-up 3, a flush at step 5) the delayed torch AdamW reference on
    transformers' Mixtral within fp32 (losses 1e-5, or twice torch's fp32 distance from float64 where that
    is more; weights within the fixed bounds of float64)."""
    seed, directory = mixtral
    clip = {"clip": _clip_every_third}
    runs = {"sync": clip, "overlap": {**clip, "engine": {"overlap_cpu_step": True}},
            "nvme": {**clip, "engine": {"nvme": True}},
            "dpu": {"engine": {"dpu_warmup_steps": WARMUP}, "flush_at": 5}}
    out = _go(mixtral, [(1, runs)], DPU_STEPS, nvme_dir=str(tmp_path))
    _assert_bitwise(out, (1, "overlap"), (1, "sync"))
    _assert_bitwise(out, (1, "nvme"), (1, "sync"))
    over = out[(1, "overlap")]
    assert sum(over["spec"]) > 0 and all(over["rolled"][s] == (over["spec"][s] if _clip_every_third(s) == CLIP else 0)
                                         for s in range(DPU_STEPS)), (over["spec"], over["rolled"])
    dpu = out[(1, "dpu")]
    assert dpu["in_flight"] == [[s >= WARMUP - 1] for s in range(DPU_STEPS)]
    losses, final = _delayed_torch_adamw(directory, tmp_path, seed, DPU_STEPS, WARMUP, 5)
    losses32 = _delayed_torch_adamw(directory, tmp_path, seed, DPU_STEPS, WARMUP, 5, torch.float32)[0]
    for a, b, b32 in zip(dpu["losses"], losses, losses32):      # the fp32 floor: see test_moe_training
        assert abs(a - b) <= max(1e-5 * abs(b), 2 * abs(b32 - b)), (dpu["losses"], losses, losses32)
    assert set(final) == set(dpu["final"])
    for n, ref in final.items():
        got = dpu["final"][n]
        assert rel_norm(got, ref) <= NORM_RTOL and rel_max(got, ref) <= MAX_RTOL, (n, rel_norm(got, ref), rel_max(got, ref))
