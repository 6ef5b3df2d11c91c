"""Megatron-LM's batch-size ramp-up (--rampup-batch-size START INCREMENT SAMPLES, training/batch_schedule.py).

- The schedule against Megatron-LM's definition, transcribed here from its source (megatron-core
  core_v0.16.1's RampupBatchsizeNumMicroBatchesCalculator.update and Megatron-LM's
  update_train_iters before its step-schedule rewrite): every iteration's batch, the iteration
  count, the micro-batches per rank, --decrease-batch-size-if-needed's rounding, on ramps drawn from
  a printed seed; every bad combination refused in one line at launch.
- The job on 2 forked gloo ranks: a mixture of experts with ZeRO-Offload ramps 4 -> 12 samples
  (1, 1, 2, 3, 3, 3 micro-batches per rank) and equals single-process torch fed the very samples
  Megatron-LM's sampler gives each iteration (indices counted here, not the job's DPBatches), with
  each iteration's 1 / micro-batches on the LM and the aux losses, clip_grad_norm_ and AdamW at
  Megatron-LM's sample-based rate; the logged aux loss is each iteration's mean over its own
  micro-batches. Saved at iteration 2, inside the ramp, the resumed run is the straight run bit for bit.
"""
from __future__ import annotations

import random

import pytest
import torch

from tests.harness import run_world
from tests.megatron_reference import megatron_get_lr
from tests.seeds import fresh_seed
from tests.test_moe_job import MOE, _run
from tests.test_pretrain import _job
from zo_megatron.errors import ConfigError
from zo_megatron.training.arguments import check_batch_sizes, parse_args


def megatron_batch(consumed, start, inc, ramp_samples, global_batch):
    """megatron-core's ramp: the full batch past the ramp-up samples, else start + whole increments."""
    if consumed > ramp_samples:
        return global_batch
    per_increment = ramp_samples / ((global_batch - start) // inc)
    return start + int(consumed / per_increment) * inc


def megatron_train_iters(train_samples, start, inc, ramp_samples, global_batch):
    """Megatron-LM's update_train_iters for a ramp: iterations while consumed <= the ramp-up samples
    (and <= the run's), then whole global batches."""
    iterations = consumed = 0
    while consumed <= ramp_samples and consumed <= train_samples:
        consumed += megatron_batch(consumed, start, inc, ramp_samples, global_batch)
        iterations += 1
    if train_samples > consumed:
        iterations += (train_samples - consumed) // global_batch
    return iterations


SHAPE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64", "--lr", "1e-3"]


def _args(*flags, dp=2):
    args = parse_args([*SHAPE, *flags])
    check_batch_sizes(args, dp)
    return args


def test_every_iteration_takes_megatron_lm_s_batch():
    """Random ramps (micro 1-3, DP 1-4): the job's iterations, each batch and its micro-batches per
    rank, and the samples consumed are Megatron-LM's; with --decrease-batch-size-if-needed each
    batch is rounded down to micro x DP as megatron-core rounds it."""
    from zo_megatron.training.batch_schedule import BatchSchedule

    seed = fresh_seed("ramp schedule")
    rng = random.Random(seed)
    for _ in range(40):
        micro, dp = rng.randint(1, 3), rng.randint(1, 4)
        unit = micro * dp
        decrease = rng.random() < 0.3
        step = rng.randint(1, 3) if decrease else unit * rng.randint(1, 3)
        start = (rng.randint(1, 4) * step) if decrease else unit * rng.randint(1, 3)
        start = max(start, unit)
        global_batch = start + step * rng.randint(1, 6)
        if decrease and global_batch % unit == 0:
            global_batch += step          # a full batch to round down too, now and then
        ramp = rng.randint(1, 8 * global_batch)
        train = rng.randint(1, 30) * global_batch + rng.randint(0, global_batch - 1)
        flags = ["--micro-batch-size", str(micro), "--global-batch-size", str(global_batch), "--train-samples",
                 str(train), "--rampup-batch-size", str(start), str(step), str(ramp)]
        case = (seed, flags, dp)
        args = _args(*flags, *(["--decrease-batch-size-if-needed"] if decrease else []), dp=dp)
        assert args.train_iters == megatron_train_iters(train, start, step, ramp, global_batch), case
        schedule, consumed = BatchSchedule.from_args(args, dp), 0
        for _ in range(args.train_iters):
            want = megatron_batch(consumed, start, step, ramp, global_batch)
            want -= want % unit if decrease else 0
            assert schedule.at(consumed) == (want, want // unit), (case, consumed)
            consumed += want
        assert schedule.consumed_after(args.train_iters) == consumed, case
        assert args.grad_accum_steps == (global_batch - global_batch % unit) // unit, case


def test_a_constant_batch_rounds_down_only_when_asked():
    from zo_megatron.training.batch_schedule import BatchSchedule

    args = _args("--micro-batch-size", "2", "--global-batch-size", "10", "--train-samples", "100",
                 "--decrease-batch-size-if-needed")
    assert BatchSchedule.from_args(args, 2).at(0) == (8, 2) and args.grad_accum_steps == 2
    assert args.train_iters == 10                        # Megatron-LM: train samples // --global-batch-size
    with pytest.raises(ConfigError, match="--global-batch-size 10 is not a multiple of --micro-batch-size 2 x DP 2 "
                                          "= 4: use a multiple of 4, or add --decrease-batch-size-if-needed"):
        _args("--micro-batch-size", "2", "--global-batch-size", "10", "--train-samples", "100")


def test_the_memory_plan_takes_the_rounded_batch():
    """The job's plan (prelaunch and tools/estimate_memory.py share plan_input_from_flags) accumulates
    the running batch's micro-batches; before, a batch the job rounds down was a ValueError there."""
    from zo_megatron.planner.inputs import plan_input_from_flags

    args = _args("--micro-batch-size", "2", "--global-batch-size", "10", "--train-samples", "100",
                 "--decrease-batch-size-if-needed")
    assert plan_input_from_flags(args, data_parallel=2, vocab_size=1000).grad_accum_steps == 2
    ramp = _args("--micro-batch-size", "2", "--global-batch-size", "14", "--train-samples", "100",
                 "--rampup-batch-size", "6", "4", "20", "--decrease-batch-size-if-needed")
    assert plan_input_from_flags(ramp, data_parallel=2, vocab_size=1000).grad_accum_steps == 3   # 14 -> 12


def test_a_ramp_counts_its_schedule_in_samples_also_in_the_demo_and_with_wsd():
    from zo_megatron.training.schedule import LRScheduler

    demo = parse_args(["--train-samples", "4000", "--rampup-batch-size", "8", "8", "800", "--global-batch-size", "16",
                       "--micro-batch-size", "8"])
    check_batch_sizes(demo, 1)
    assert demo.demo and LRScheduler.from_args(demo).lr_warmup_steps == 30 * 16   # the demo's 30 iterations
    with pytest.raises(ConfigError, match="--lr-decay-style WSD with --rampup-batch-size needs the final anneal in "
                                          "samples: add --lr-wsd-decay-samples N"):
        _args("--micro-batch-size", "2", "--global-batch-size", "12", "--rampup-batch-size", "4", "4", "16",
              "--train-samples", "96", "--lr-decay-style", "WSD")
    wsd = _args("--micro-batch-size", "2", "--global-batch-size", "12", "--rampup-batch-size", "4", "4", "16",
                "--train-samples", "96", "--lr-decay-style", "WSD", "--lr-wsd-decay-samples", "30")
    s = LRScheduler.from_args(wsd)
    assert (s.wsd_decay_steps, s.lr_decay_steps) == (30, 96)


@pytest.mark.parametrize("flags, message", [
    (["--train-iters", "10"], "--rampup-batch-size needs sample-based training, as in Megatron-LM: use --train-samples"),
    (["--train-samples", "96", "--lr-decay-iters", "5"], "use --lr-decay-samples instead of --lr-decay-iters"),
    (["--train-samples", "96", "--lr-warmup-iters", "2"], "use --lr-warmup-samples instead of --lr-warmup-iters"),
    (["--train-samples", "96", "--rampup-batch-size", "6", "4", "16"],
     "--rampup-batch-size 6 4 16: --global-batch-size 12 - start 6 = 6 is not a multiple of the increment 4"),
    (["--train-samples", "96", "--rampup-batch-size", "6", "2", "16"],
     "--rampup-batch-size 6 2 16: the ramp's batch 6 is not a multiple of --micro-batch-size 2 x DP 2 = 4"),
    (["--train-samples", "96", "--rampup-batch-size", "12", "4", "16"], "nothing to ramp"),
    (["--train-samples", "96", "--rampup-batch-size", "4", "0", "16"], "the increment and the ramp-up samples must be >= 1"),
    (["--train-samples", "96", "--rampup-batch-size", "4", "4", "0"], "the ramp-up samples must be >= 1"),
])
def test_a_bad_ramp_is_one_line(flags, message):
    ramp = [] if "--rampup-batch-size" in flags else ["--rampup-batch-size", "4", "4", "16"]
    with pytest.raises(ConfigError, match=message.replace("+", r"\+")) as e:
        _args("--micro-batch-size", "2", "--global-batch-size", "12", *ramp, *flags)
    assert "\n" not in str(e.value)


# the job: 2 ranks x micro 2; the batch ramps 4 -> 8 -> 12 over 16 samples (increments every 8)
RAMP = ["--global-batch-size", "12", "--rampup-batch-size", "4", "4", "16", "--train-samples", "60",
        "--lr-warmup-samples", "8", "--lr-decay-samples", "48"]
BATCHES = [4, 4, 8, 12, 12, 12]          # megatron_batch at consumed 0, 4, 8, 16, 28, 40; 6 iterations
RTOL = 2e-5                              # tests/test_moe_job.py's: fp32 reductions in another order


def _ramp_argv(seed):
    argv = [a for a in MOE]
    i = argv.index("--global-batch-size")
    del argv[i:i + 2]
    i = argv.index("--lr-warmup-iters")
    del argv[i:i + 2]
    return [*argv, *RAMP, "--seed", str(seed)]


def _reference_world(rank, argv, cache):
    """Single-process torch: iteration t takes samples [c_t, c_t + b_t) of the job's training split, in
    Megatron-LM's order (global micro-batch m of the iteration is samples c_t + 4m .. c_t + 4m + 3, rank r
    the pair c_t + 4m + 2r, +1); each micro-batch's loss / (2 n_t) backward with the aux-loss gradient
    scale 1 / (2 n_t); clip; AdamW at megatron_get_lr(c_t). Returns per iteration the loss and the
    load-balancing loss as Megatron-LM logs it (mean per micro-batch and MoE layer)."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler, clear_aux_losses_tracker, \
        get_moe_layer_wise_logging_tracker

    from tests.job_reference import job_model_and_data
    from zo_megatron.data.datasets import _collate
    from zo_megatron.training.evaluation import loss_inputs

    args, _, model, train_ds, _ = job_model_and_data(argv, cache, 2)
    assert args.train_iters == len(BATCHES)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_eps, weight_decay=0.0)
    consumed, losses, aux = 0, [], []
    for b in BATCHES:
        pieces = b // 2                                  # micro-batches of 2 samples, both ranks'
        MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0 / pieces))
        total = 0.0
        for m in range(b // 4):
            for r in range(2):
                first = consumed + 4 * m + 2 * r
                batch = _collate([train_ds[i] for i in (first, first + 1)])
                loss = model.loss(*loss_inputs(batch, torch.device("cpu")))
                (loss / pieces).backward()
                total += loss.item() / pieces
        torch.nn.utils.clip_grad_norm_(params, args.clip_grad)
        for g in opt.param_groups:
            g["lr"] = megatron_get_lr(consumed, init_lr=0.0, max_lr=args.lr, min_lr=args.min_lr, lr_warmup_steps=8,
                                      lr_decay_steps=48, lr_decay_style="cosine")
        opt.step()
        opt.zero_grad()
        tracked = get_moe_layer_wise_logging_tracker()["load_balancing_loss"]["values"]
        aux.append(tracked.double().sum().item() / pieces / 2)      # 2 MoE layers
        clear_aux_losses_tracker()
        losses.append(total)
        consumed += b
    return losses, aux


def test_a_ramped_moe_job_trains_as_torch_and_resumes_inside_the_ramp(tmp_path):
    seed = fresh_seed("ramped MoE job")
    argv = _ramp_argv(seed)
    ck = tmp_path / "ck"
    straight, r = _run(tmp_path, "straight", [*argv, "--save", str(ck), "--save-interval", "2"])
    ref_loss, ref_aux = run_world(_reference_world, 1, argv, str(tmp_path / "cache"), timeout=120)[0]
    assert sorted(straight) == list(range(1, 7)), r.stdout[-3000:]
    consumed = 0
    for i, b in enumerate(BATCHES, start=1):
        row = straight[i]
        consumed += b
        assert (row["global_batch_size"], row["consumed_samples"]) == (b, consumed), row
        assert abs(row["loss"] - ref_loss[i - 1]) <= RTOL * abs(ref_loss[i - 1]), (seed, i, row["loss"], ref_loss)
        assert abs(row["load_balancing_loss"] - ref_aux[i - 1]) <= RTOL * abs(ref_aux[i - 1]), \
            (seed, i, row["load_balancing_loss"], ref_aux)
        assert row["tokens_per_s"] > 0
    assert "ramps 4 -> 12 by 4 over 16 samples (2 increments of 8 samples; --rampup-batch-size)" in r.stdout, \
        r.stdout[:3000]
    assert "global batch size 8 |" in r.stdout
    # resumed at iteration 2 (8 samples consumed: the next batch is 8) -> iterations 3-6 bit for bit
    resumed, r2 = _run(tmp_path, "resumed", [*argv, "--load", str(ck), "--ckpt-step", "2"])
    assert sorted(resumed) == [3, 4, 5, 6], r2.stdout[-3000:]
    keys = ("loss", "grad_norm", "lr", "global_batch_size", "consumed_samples", "load_balancing_loss", "z_loss")
    assert {i: [resumed[i][k] for k in keys] for i in resumed} == {i: [straight[i][k] for k in keys] for i in resumed}
    # the checkpoint's schedule is in samples (Megatron's): another --lr-decay-samples is refused naming them,
    # and --use-checkpoint-opt_param-scheduler takes the checkpoint's back (the same run again)
    other = [*argv[:argv.index("--lr-decay-samples") + 1], "40", *argv[argv.index("--lr-decay-samples") + 2:]]
    refused = _job([*other, "--load", str(ck), "--ckpt-step", "2"], tmp_path)
    assert refused.returncode == 2 and "lr_decay_steps 48 in the checkpoint, 40 here" in refused.stderr, \
        refused.stderr[-2000:]
    taken, _ = _run(tmp_path, "taken", [*other, "--load", str(ck), "--ckpt-step", "2",
                                        "--use-checkpoint-opt_param-scheduler"])
    assert {i: [taken[i][k] for k in keys] for i in taken} == {i: [straight[i][k] for k in keys] for i in taken}
