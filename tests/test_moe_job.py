"""The training job trains a mixture of experts (issue 39, docs/moe.md): pretrain_gpt.py with
--num-experts at EP 1 (the plain engine) and EP 2 (offload/expert_parallel.py's two engines) on 2
forked gloo ranks.

The reference is single-process torch: the same initial model (one seed gives the same full tensors
at every EP), both DP ranks' micro-batches of each global batch (the job's DPBatches over its mock
dataset), each micro-batch's backward of loss / 4 with megatron-core's aux-loss gradient scale set to
1 / 4 -- the objective sum over micro-batches and ranks of (LM loss + aux losses) / 4 that Megatron-LM
trains -- then torch's clip_grad_norm_ and torch.optim.AdamW at the job's LR schedule. The job runs 2
micro-batches per rank and must scale the aux losses' gradient by 1 / 2 itself (megatron-core's
default, 1, doubles it: the losses then leave the reference's tolerance, checked below).
"""
from __future__ import annotations

import json

import pytest
import torch

from tests.harness import run_world
from tests.seeds import fresh_seed
from tests.test_pretrain import _job, _rows

# a Mixtral-shaped model (RoPE, RMSNorm, SwiGLU experts, untied, no biases), 4 experts, top 2,
# load-balancing and z losses large enough that their gradient's scale shows in the losses
MOE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
       "--max-position-embeddings", "32", "--position-embedding-type", "rope", "--normalization", "RMSNorm",
       "--swiglu", "--disable-bias-linear", "--untie-embeddings-and-output-weights", "--ffn-hidden-size", "48",
       "--num-experts", "4", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "0.5", "--moe-z-loss-coeff", "0.05",
       "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "1e-2", "--lr-warmup-iters", "0",
       "--min-lr", "1e-3", "--lr-decay-style", "cosine", "--log-interval", "1", "--eval-interval", "100",
       "--eval-iters", "1", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128",
       "--no-progress-bar", "--zero-offload", "--fp32", "--hidden-dropout", "0", "--attention-dropout", "0",
       "--weight-decay", "0", "--clip-grad", "0.5"]
EP2 = ["--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall"]
ITERS = 4
RTOL = 2e-5          # fp32: the job's reductions (DP, EP all-to-all, the CPU Adam) against torch's order


def _argv(seed, iters=ITERS):
    return [*MOE, "--seed", str(seed), "--train-iters", str(iters)]


def _run(tmp_path, name, argv, nproc=2):
    log = tmp_path / f"{name}.jsonl"
    r = _job([*argv, "--log-jsonl", str(log)], tmp_path, nproc=nproc)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return {row["iteration"]: row for row in _rows(log, "train")}, r


def _reference_world(rank, argv, cache):
    """The torch reference (see the module docstring) on one process: the losses per iteration."""
    import os

    os.environ["ZO_MEGATRON_CACHE"] = cache
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    from zo_megatron.data import DPBatches, build_tokenizer
    from zo_megatron.model import build_gpt_model
    from zo_megatron.parallel import init_parallel
    from zo_megatron.training import components
    from zo_megatron.training.arguments import parse_args
    from zo_megatron.training.evaluation import loss_inputs
    from zo_megatron.training.prelaunch import model_vocab_size
    from zo_megatron.training.schedule import LRScheduler

    args = parse_args(argv)
    init_parallel(1, seed=args.seed)
    tok = build_tokenizer(tokenizer_type="NullTokenizer", vocab_size=args.vocab_size)
    args.model_vocab_size = model_vocab_size(args, tok)
    model = build_gpt_model(components.model_config(args), 0, 1, args.seed)
    train_ds, _ = components.build_datasets(args, tok, None, 2)
    dp, accum = 2, args.global_batch_size // (2 * args.micro_batch_size)
    ranks = [iter(DPBatches(train_ds, args.micro_batch_size, r, dp)) for r in range(dp)]
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_eps,
                            weight_decay=0.0)
    sched = LRScheduler.from_args(args)
    pieces = dp * accum
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0 / pieces))
    routed = []                                  # per iteration: [(token, expert) pairs of each expert] per layer
    for router in (m for m in model.modules() if type(m).__name__ == "TopKRouter"):
        router.register_forward_hook(lambda _m, _i, out: routed[-1].append(out[1].sum(0)))
    losses = []
    for _ in range(args.train_iters):
        routed.append([])
        total = 0.0
        micro = {r: [next(ranks[r]) for _ in range(accum)] for r in range(dp)}
        for r in range(dp):
            for batch in micro[r]:
                loss = model.loss(*loss_inputs(batch, torch.device("cpu")))
                (loss / pieces).backward()
                total += loss.item() / pieces
        torch.nn.utils.clip_grad_norm_(params, args.clip_grad)
        for g in opt.param_groups:
            g["lr"] = sched.get_lr()
        opt.step()
        opt.zero_grad()
        sched.step(args.global_batch_size)
        losses.append(total)
    tokens = []
    for it in routed:                            # hooks fire in layer order, micro-batch after micro-batch
        layers = torch.stack(it).view(pieces, -1, args.num_experts).sum(0).double()
        tokens.append((layers.min().item(), layers.mean().item(), layers.max().item()))
    return losses, tokens


def _reference(tmp_path, seed):
    return run_world(_reference_world, 1, _argv(seed), str(tmp_path / "cache"), timeout=120)[0]


def _close(a, b) -> bool:
    return abs(a - b) <= RTOL * abs(b)


TP2 = ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--moe-token-dispatcher-type", "allgather"]
LAYOUTS = {"EP1": ([], "EP 1 x expert TP 1 x expert DP 2"), "EP2": (EP2, "EP 2 x expert TP 1 x expert DP 1"),
           "TP2": (TP2, "EP 1 x expert TP 2 x expert DP 1"), "EP1-baseline": ([], "EP 1 x expert TP 1 x expert DP 2"),
           "TP2-ETP1": (TP2 + ["--expert-tensor-parallel-size", "1"],
                        "EP 1 x expert TP 1 x expert DP 2 (two engines")}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_job_trains_a_mixture_of_experts_as_torch_adamw(tmp_path, layout):
    """EP 1 (dense engine, DP 2), EP 2 (two engines, alltoall), TP 2 with sequence parallelism (DP 1,
    4 micro-batches: the same pairs of samples) and EP 1 without --zero-offload (the baseline) on 2 ranks: every iteration's logged LM loss equals
    the torch reference's; the aux and z losses are logged under megatron-core's names in the
    console line and the JSONL rows, the loss stays the LM loss."""
    seed = fresh_seed(f"moe job {layout}")
    flags, words = LAYOUTS[layout]
    argv = _argv(seed) + flags
    if layout == "EP1-baseline":               # DDP + torch AdamW on the device: experts replicated over DP
        argv.remove("--zero-offload")
    rows, r = _run(tmp_path, layout, argv)
    ref, ref_tokens = _reference(tmp_path, seed)
    got = [rows[i]["loss"] for i in range(1, ITERS + 1)]
    assert all(_close(g, w) for g, w in zip(got, ref)), (got, ref)
    for row in rows.values():
        assert row["load_balancing_loss"] > 0 and row["z_loss"] > 0, row
    # tokens per expert, summed over the ranks: the mean is exact (8 x 32 tokens x top 2 / 4 experts); min and
    # max those of the reference's routing (a near-tie may route a token or two elsewhere in fp32)
    for i, (lo, mean, hi) in enumerate(ref_tokens, start=1):
        row = rows[i]
        assert row["tokens_per_expert_mean"] == mean == 8 * 32 * 2 / 4, (row, mean)
        assert abs(row["tokens_per_expert_min"] - lo) <= 2 and abs(row["tokens_per_expert_max"] - hi) <= 2, \
            (i, row, lo, hi)
    assert words in r.stdout, r.stdout[:3000]
    assert r.stdout.count("load_balancing_loss ") == ITERS and r.stdout.count("| z_loss ") == ITERS, r.stdout[-3000:]


def _unscaled_reference_world(rank, argv, cache):
    """The reference with megatron-core's default aux-loss gradient scale (1) in place of 1 / 4."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    real = MoEAuxLossAutoScaler.set_loss_scale
    MoEAuxLossAutoScaler.set_loss_scale = staticmethod(lambda s: real(torch.ones_like(s)))
    try:
        return _reference_world(rank, argv, cache)
    finally:
        MoEAuxLossAutoScaler.set_loss_scale = staticmethod(real)


def test_the_reference_sees_a_wrong_aux_loss_gradient_scale(tmp_path):
    """The aux losses' gradient at megatron-core's default scale (1, what the job had without
    set_scale) leaves the reference's tolerance: the comparison above can see a missing scale."""
    seed = fresh_seed("moe reference, unscaled aux loss")
    ref = run_world(_reference_world, 1, _argv(seed, 3), str(tmp_path / "cache"), timeout=120)[0][0]
    wrong = run_world(_unscaled_reference_world, 1, _argv(seed, 3), str(tmp_path / "cache"), timeout=120)[0][0]
    assert wrong[0] == ref[0]                         # the first forward precedes any update
    assert not all(_close(a, b) for a, b in zip(wrong[1:], ref[1:])), (wrong, ref)


# the CPU step's schedules and state placements at EP 2 (tests/test_moe_schedules.py checks their math):
# DPU delayed from the 2nd update on (the save at iteration 2 flushes a pending update: mid-delay) with
# the weight prediction and bf16 moments; the speculated CPU step with half of each partition on the device
SCHEDULES = {"sync": [],
             "dpu-predicted-bf16": ["--dpu", "--dpu-warmup-steps", "2", "--dpu-corrector", "weight-prediction",
                                    "--exp-avg-dtype", "bf16", "--exp-avg-sq-dtype", "bf16"],
             "overlap-partial": ["--overlap-cpu-step", "full", "--optimizer-offload-fraction", "0.5",
                                 "--clip-grad", "100"]}


@pytest.mark.parametrize("schedule", ["sync", "dpu-predicted-bf16",
                                      pytest.param("overlap-partial", marks=pytest.mark.slow)])
def test_an_moe_job_resumes_bit_for_bit(tmp_path, schedule):
    """At EP 2, saved at iteration 2 and resumed there, iterations 3-4 log the uninterrupted run's
    losses, aux losses and grad norms bit for bit (the Adam step of both engines included); the
    checkpoint names every expert by its global index. With --dpu the save flushes both engines'
    pending update and the resumed run delays again; with --overlap-cpu-step (no clipping: every step
    commits) both engines speculate."""
    ep = 2
    seed = fresh_seed(f"moe resume EP{ep} {schedule}")
    ck = tmp_path / "ck"
    argv = _argv(seed) + EP2 + SCHEDULES[schedule]
    keys = ("loss", "grad_norm", "load_balancing_loss", "z_loss", "tokens_per_expert_min", "tokens_per_expert_max")
    whole, w = _run(tmp_path, "whole", [*argv, "--save", str(ck), "--save-interval", "2"])
    resumed, r = _run(tmp_path, "resumed", [*argv, "--load", str(ck), "--ckpt-step", "2"])
    assert sorted(resumed) == [3, 4], r.stdout[-2000:]
    assert {i: [whole[i][k] for k in keys] for i in resumed} == {i: [resumed[i][k] for k in keys] for i in resumed}
    if schedule.startswith("dpu"):
        assert "delayed parameter update starts at iteration 2" in w.stdout, w.stdout[-3000:]
        assert "delayed parameter update starts" not in r.stdout     # its step count is past the warm-up
    if schedule.startswith("overlap"):
        for rows in (whole, resumed):      # how many buckets a step speculates depends on timing; some do
            assert sum(row["speculated_buckets"] for row in rows.values()) > 0, rows
            assert all(row["rolled_back_buckets"] == 0 for row in rows.values()), rows
    manifest = json.loads((ck / "iter_0000002" / "checkpoint.json").read_text())
    assert manifest["layout"].get("expert_parallel", 1) == ep and manifest["optimizer"]["step"] == 2
    experts = {k for k in manifest["params"] if ".mlp.experts.local_experts." in k}
    assert {k.split(".local_experts.")[1].split(".")[0] for k in experts} == {"0", "1", "2", "3"}, experts


def test_an_moe_job_with_states_on_disk_at_ep2_is_the_in_memory_job(tmp_path):
    """--optimizer-nvme-path at EP 2 (each engine its own state files, tests/test_moe_schedules.py):
    the losses, aux losses and grad norms of the in-memory EP 2 job bit for bit; the banner and the
    rows' disk I/O count both engines' stores (every step reads and writes each state once: read ==
    written from the second row on), and DIR is left empty."""
    seed = fresh_seed("moe EP2 NVMe job")
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    keys = ("loss", "grad_norm", "load_balancing_loss", "z_loss")
    memory, _ = _run(tmp_path, "memory", _argv(seed) + EP2)
    disk, r = _run(tmp_path, "nvme", _argv(seed) + EP2 + ["--optimizer-nvme-path", str(nvme),
                                                          "--optimizer-nvme-buffer-size", "1024",
                                                          "--optimizer-nvme-buffer-count", "2"])
    assert {i: [memory[i][k] for k in keys] for i in memory} == {i: [disk[i][k] for k in keys] for i in disk}
    assert sorted(disk) == list(range(1, ITERS + 1))
    line = next(x for x in r.stdout.splitlines() if "optimizer states on disk" in x)
    assert f"exp_avg (fp32), exp_avg_sq (fp32) in {nvme}" in line and "I/O ring 4 x 1024" in line, line  # 2 rings of 2
    first, *rest = [(disk[i]["nvme_read_bytes_per_step"], disk[i]["nvme_written_bytes_per_step"]) for i in sorted(disk)]
    assert first[1] == 2 * first[0] > 0 and all(x == (first[0], first[0]) for x in rest), (first, rest)
    assert list(nvme.iterdir()) == []                      # the state files (and locks) go at a clean exit


def _one_line(r, needle):
    errors = [ln for ln in r.stderr.splitlines() if "error:" in ln]
    assert r.returncode == 2 and len(errors) == 1 and needle in errors[0] and "Traceback" not in r.stderr, \
        (r.returncode, r.stderr[-2000:])


ETP1 = TP2 + ["--expert-tensor-parallel-size", "1"]
RESHARDS = {1: (["--moe-token-dispatcher-type", "alltoall"], "EP1"), 2: (EP2, "EP2"),
            "tp2-etp1": (ETP1, "EP1 x expert TP1"), "tp2": (TP2, "EP1")}


@pytest.mark.parametrize("saved, resumed", [(2, 1), pytest.param(1, 2, marks=pytest.mark.slow),
                                            ("tp2-etp1", "tp2"), pytest.param("tp2", "tp2-etp1", marks=pytest.mark.slow)])
def test_an_moe_run_resumes_at_another_ep(tmp_path, saved, resumed):
    """Saved at one EP and resumed at another (experts are keyed by their global index, so DCP
    reshards them as it reshards DP), or at TP 2 with whole experts (expert TP 1) and resumed with the
    experts split over TP (and back): iterations 3-4 give the uninterrupted run's losses and grad norms
    (within fp32 reduction order: expert DP and the dispatcher change), and it says so."""
    seed = fresh_seed(f"moe {saved} -> {resumed}")
    ck = tmp_path / "ck"
    (saved_flags, saved_name), (resumed_flags, resumed_name) = RESHARDS[saved], RESHARDS[resumed]
    whole, _ = _run(tmp_path, "whole", [*_argv(seed), *saved_flags, "--save", str(ck), "--save-interval", "2"])
    res, r = _run(tmp_path, "resumed", [*_argv(seed), *resumed_flags, "--load", str(ck), "--ckpt-step", "2"])
    assert f"resharded the experts from {saved_name} to {resumed_name}" in r.stdout, r.stdout[-2000:]
    assert sorted(res) == [3, 4]
    for i in res:
        for k in ("loss", "grad_norm", "load_balancing_loss"):
            assert _close(res[i][k], whole[i][k]), (i, k, res[i][k], whole[i][k])


def test_an_overlap_memory_budget_at_ep2_is_planned_as_for_a_dense_model(tmp_path):
    """--overlap-cpu-step-memory at EP 2: the job resolves the budget through the planner as for a dense
    model (tools/estimate_memory.py's plan of the same command line: its share, a budget of 40% of
    what the whole of both engines' partitions would take), both engines speculate that share of
    their host partition (their rollback bytes, from the run's accounting, are the planner's
    `overlap_rollback` + `expert_overlap_rollback` lines per rank within the partitions' padding, and
    within the budget), and the
    losses, aux losses and grad norms are the synchronous EP 2 run's bit for bit."""
    from tests.test_estimate_memory_job import E

    seed = fresh_seed("moe EP2 overlap memory budget")
    # no clipping: the speculated steps commit; small buckets: a 40% prefix holds some of them
    argv = _argv(seed) + EP2 + ["--clip-grad", "100", "--bucket-size", "4096"]

    def planned(*extra):
        return E.job_plan(E.build_parser().parse_args([*argv, "--world-size", "2", "--preset", "cpu", *extra]))

    whole, _ = planned("--overlap-cpu-step", "full")
    full = sum(v for k, v in whole.host_items.items() if k.endswith("overlap_rollback")) // whole.ranks_per_node
    budget = full * 2 // 5
    est, info = planned("--overlap-cpu-step-memory", str(budget))
    share = info["overlap_speculated_fraction"]
    assert 0 < share < 1, info
    rollback = {k: v // est.ranks_per_node for k, v in est.host_items.items() if k.endswith("overlap_rollback")}
    assert set(rollback) == {"overlap_rollback", "expert_overlap_rollback"}, est.host_items
    keys = ("loss", "grad_norm", "load_balancing_loss", "z_loss")
    sync, _ = _run(tmp_path, "sync", argv)
    log = tmp_path / "overlap.jsonl"
    r = _job([*argv, "--overlap-cpu-step-memory", str(budget), "--log-jsonl", str(log)], tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    line = next(x for x in r.stdout.splitlines() if "CPU step overlapped with backward" in x)
    assert f"{share:.0%} of the partition speculated" in line, (share, line)
    acc = next(row for row in _rows(log, "setup_memory"))["accounting"]
    # the planner pads each engine's partition to N x 128 elements, the engine each bucket to N x 64
    # (as for a dense model): the bytes agree within that padding (here 25 elements), not exactly
    got = acc["host_overlap_bytes"]
    assert abs(got - sum(rollback.values())) <= 0.01 * got and got <= budget, (got, rollback, budget)
    overlap = {row["iteration"]: row for row in _rows(log, "train")}
    assert sorted(overlap) == list(range(1, ITERS + 1))
    assert {i: [sync[i][k] for k in keys] for i in sync} == {i: [overlap[i][k] for k in keys] for i in overlap}
    assert sum(row["speculated_buckets"] for row in overlap.values()) > 0, overlap


def test_expert_parallel_without_zero_offload_is_one_line(tmp_path):
    argv = [a for a in _argv(1) if a != "--zero-offload"]
    r = _job([*argv, *EP2], tmp_path, nproc=1)
    _one_line(r, "trains with the ZeRO-Offload engine only")


def test_fp16_loss_scaling_at_ep2_is_the_plain_engines(tmp_path):
    """--fp16 with a dynamic scale that grows every 2 steps until a step overflows: at EP 2 (two
    engines, one scaler: the expert engine unscales by the scale the backward used) the loss scale,
    the skipped steps and the grad norms are those of EP 1 (one engine). A scaler updated by both
    engines would grow twice as fast; an expert engine unscaling by the updated scale would report
    another norm."""
    seed = fresh_seed("moe fp16 EP1 vs EP2")
    fp16 = ["--fp16", "--initial-loss-scale", "65536", "--loss-scale-window", "2"]
    argv = [a for a in _argv(seed) if a != "--fp32"] + fp16
    one, _ = _run(tmp_path, "ep1", [*argv, "--moe-token-dispatcher-type", "alltoall"])
    two, _ = _run(tmp_path, "ep2", [*argv, *EP2])
    assert [one[i]["loss_scale"] for i in one] == [two[i]["loss_scale"] for i in two]
    assert [one[i]["skipped"] for i in one] == [two[i]["skipped"] for i in two]
    assert len({one[i]["loss_scale"] for i in one}) > 1, one          # the scale moved
    for i in one:
        a, b = one[i]["grad_norm"], two[i]["grad_norm"]
        assert (a != a and b != b) or abs(a - b) <= 1e-3 * abs(a), (i, a, b)


def test_per_layer_logging_names_each_layer_as_megatron_core(tmp_path):
    """--moe-per-layer-logging: every row also holds each layer's load-balancing and z loss under
    megatron-core's names (moe/<loss>_layer_<i>); with --moe-layer-freq 2 layer 1 is dense (0), and the
    logged total is the MoE layers' sum over their count, as without the flag."""
    seed = fresh_seed("moe per-layer logging")
    argv = [*_argv(seed, 2), "--moe-layer-freq", "2"]
    rows, _ = _run(tmp_path, "per_layer", [*argv, "--moe-per-layer-logging"])
    plain, _ = _run(tmp_path, "plain", argv)
    for i, row in rows.items():
        for name in ("load_balancing_loss", "z_loss"):
            layer0, layer1 = row[f"moe/{name}_layer_0"], row[f"moe/{name}_layer_1"]
            assert layer0 > 0 and layer1 == 0, (i, row)
            assert abs(row[name] - layer0) <= 1e-12 * abs(layer0), (i, row)        # one MoE layer
            assert row[name] == plain[i][name], (i, row[name], plain[i][name])     # the flag changes no value
        assert not any(k.startswith("moe/") for k in plain[i]), plain[i]
