"""The training job: validate everything, build the components, run one loop that composes them.

Order matters for users: every check that can fail on bad input (flags, tokenizer files, data
files, memory plan) runs BEFORE any model or checkpoint directory is created, so a mistake costs
seconds and leaves nothing behind. The checks that read files run on every rank (a file can differ
between nodes) inside `collectives.all_ranks_agree`: the ranks agree on "ok or which rank failed
why" before going on, so a failure on rank 3 is printed once, by rank 0, naming rank 3.
"""
from __future__ import annotations

import contextlib
import math
import os
import signal
import sys
import time

import torch

from zo_megatron.errors import UserError, report_error
from zo_megatron.offload.device import batch_to_device, host_value
from zo_megatron.parallel import collectives
from zo_megatron.parallel.megatron_notices import SUMMARY as NOTICES
from zo_megatron.parallel.megatron_notices import hide_known_megatron_notices
from zo_megatron.training.arguments import architecture_kwargs, check_batch_sizes, parse_args
from zo_megatron.training.cuda_connections import set_cuda_device_max_connections, set_nccl_memory_defaults
from zo_megatron.training.metrics import Metrics, host_rss_bytes, human_bytes, model_flops_per_token, proc_memory_bytes
from zo_megatron.training.schedule import LRScheduler
from zo_megatron.training.user_report import (auto_fraction_reason, engine_words, extend_hint, run_header,
                                              value_sources)


def job_plan_input(args, env, dp: int, vocab_size: int, host_bytes: int | None = None):
    """This run's PlanInput: its flags through the planner's one builder, and this machine
    (`host_bytes`: the host memory to plan for; None: what this node allows, memory_limit_bytes)."""
    from zo_megatron.parallel.launch_env import memory_limit_bytes
    from zo_megatron.planner import GiB, plan_input_from_flags
    from zo_megatron.planner.presets import CPU_PROCESS_OVERHEAD_BYTES

    cuda = torch.cuda.is_available()
    host = memory_limit_bytes() if host_bytes is None else host_bytes
    return plan_input_from_flags(
        args, data_parallel=dp, vocab_size=vocab_size,
        gpu_memory_bytes=torch.cuda.get_device_properties(0).total_memory if cuda else host,
        host_memory_bytes_per_node=host, gpus_per_node=env.local_world_size, device_is_host=not cuda,
        device_overhead_bytes=GiB if cuda else 0, host_reserve_bytes=min(32 * GiB, host // 10),
        host_overhead_bytes_per_rank=3 * GiB if cuda else CPU_PROCESS_OVERHEAD_BYTES)


def job_plan(args, env, dp: int, vocab_size: int, host_bytes: int | None = None):
    """The planner's verdict on this run exactly as the pre-launch check computes it (the CPU-step
    overlap default and --optimizer-offload-fraction auto resolved; `args` gets the fraction).
    tools/find_max_model.py searches with this very function."""
    from zo_megatron.planner import plan

    from zo_megatron.planner import resolve_overlap

    inp = job_plan_input(args, env, dp, vocab_size, host_bytes)
    # --overlap-cpu-step as typed (None, auto, full, memory, off), kept apart from its resolution
    mode = getattr(args, "overlap_cpu_step_mode", args.overlap_cpu_step)
    args.overlap_cpu_step_mode = mode
    inp = inp.replace(dpu=args.dpu, dpu_weight_prediction=args.dpu_weight_prediction,
                      overlap_cpu_step=mode in ("full", "memory"),
                      overlap_speculated_fraction=1.0 if mode == "full" else 0.0,
                      optimizer_offload_fraction=1.0 if args.optimizer_offload_fraction == "auto"
                      else args.optimizer_offload_fraction)
    if mode == "memory":
        f, _ = resolve_overlap(inp, mode, args.overlap_cpu_step_memory)
        inp = inp.replace(overlap_speculated_fraction=f)
    if args.optimizer_offload_fraction == "auto":
        from zo_megatron.planner import solve_offload_fraction

        f = solve_offload_fraction(inp)
        args.optimizer_offload_fraction = 1.0 if f is None else f     # None: let the check below explain
        inp = inp.replace(optimizer_offload_fraction=args.optimizer_offload_fraction)
        args.offload_fraction_reason = auto_fraction_reason(inp, f)
    # auto speculates what the memory left by everything else holds: resolved last
    f, args.overlap_reason = resolve_overlap(inp, mode, args.overlap_cpu_step_memory)
    args.overlap_speculated_fraction = f
    args.overlap_cpu_step = f > 0
    return plan(inp.replace(overlap_cpu_step=f > 0, overlap_speculated_fraction=f))


def memory_check(args, env, dp: int, vocab_size: int) -> None:
    """Refuse a run the planner says cannot fit the device or host memory this machine has."""
    p = job_plan(args, env, dp, vocab_size)
    args.memory_plan = p
    if not p.fits and not args.skip_memory_check:
        why = "; ".join(r for r in p.reasons if "OK" not in r) or "; ".join(p.reasons)
        tips = "; ".join(p.suggestions[:3]) or "raise TP, enable recompute, lower --micro-batch-size"
        raise UserError(f"the memory planner predicts this run does not fit: {why}. Try: {tips} "
                        "(or --skip-memory-check)")


def check_save_dir(path: str) -> None:
    """--save must be a directory we can create or write, found now and not after training."""
    if os.path.exists(path):
        if not os.path.isdir(path):
            raise UserError(f"--save {path} exists and is not a directory: point --save at a directory")
        if not os.access(path, os.W_OK | os.X_OK):
            raise UserError(f"--save {path} is not writable: fix its permissions or choose another directory")
        return
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
        raise UserError(f"--save {path} cannot be created ({parent} is not a writable directory): "
                        f"choose a directory you can write")


def checkpoint_bytes(params_total: int, zero_offload: bool, bf16_states: bool) -> int:
    """About what one checkpoint of the model takes on disk: fp32 weights + fp32 master (offload)
    + both Adam moments."""
    state = 2 if bf16_states and zero_offload else 4
    return params_total * (4 + (4 if zero_offload else 0) + 2 * state)


def check_free_space(path: str, need_bytes: int) -> None:
    """--save must have room for one more checkpoint (the previous one stays until the new one is
    complete), found now and not at the first save."""
    import shutil

    probe = os.path.abspath(path)
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    free = shutil.disk_usage(probe).free
    if free < need_bytes:
        raise UserError(f"--save {path}: {human_bytes(free)} free on its filesystem, but one checkpoint of this "
                        f"model takes about {human_bytes(need_bytes)}: free space or choose another directory")


def pretrain(argv=None) -> int:
    # CUDA_DEVICE_MAX_CONNECTIONS=1 at TP > 1 (training/cuda_connections.py): pretrain_gpt.py's main()
    # sets it first thing; here again, before parsing (which may start CUDA), for callers of pretrain().
    set_cuda_device_max_connections(argv)
    set_nccl_memory_defaults()                   # NVLS off unless asked: its buffers are not planned
    hide_known_megatron_notices()                # before megatron-core is first imported
    args = parse_args(argv)
    from zo_megatron.parallel import validate_parallel_config
    from zo_megatron.parallel.launch_env import default_cpu_adam_threads, discover_launch_env

    try:
        env = discover_launch_env()
    except ValueError as exc:           # an inconsistent launcher environment (RANK, WORLD_SIZE, ...)
        if isinstance(exc, UserError):
            raise
        err = UserError(f"the launcher's environment is inconsistent: {exc}; launch with torchrun, mpirun or "
                        "srun, or fix those variables")
        err.every_rank = True           # which process is rank 0 is exactly what is unknown here
        raise err from None
    # with --kv-channels the hidden size need not be heads x head_dim (Megatron-LM's rule)
    hidden_check = args.hidden_size if args.kv_channels is None else None
    validate_parallel_config(env.world_size, args.tensor_parallel, args.num_attention_heads, hidden_check)
    dp = env.world_size // args.tensor_parallel
    check_batch_sizes(args, dp)
    LRScheduler.from_args(args)                  # its one-line errors now, before any process group
    from zo_megatron.training.megatron_compat import check_backend

    check_backend(args, torch.cuda.is_available())
    from zo_megatron.parallel import destroy_parallel, init_parallel

    ps = init_parallel(args.tensor_parallel, seed=args.seed, num_attention_heads=args.num_attention_heads,
                       hidden_size=hidden_check, timeout_s=args.distributed_timeout_minutes * 60)
    try:
        with collectives.all_ranks_agree():
            tokenizer, data_path = _check_inputs(args, env, dp)
    except BaseException:
        destroy_parallel()
        raise
    return _train(args, env, ps, tokenizer, data_path, default_cpu_adam_threads(env.local_world_size))


def _check_inputs(args, env, dp):
    """Every check that reads files or this node's memory; returns (tokenizer, data path)."""
    from zo_megatron.data import build_tokenizer, validate_data_prefix

    tokenizer = build_tokenizer(args.vocab_file, args.merge_file, allow_custom_vocab=args.allow_custom_vocab,
                                tokenizer_type=args.tokenizer_type, tokenizer_model=args.tokenizer_model)
    args.model_vocab_size = model_vocab_size(args, tokenizer)
    if args.data_path:
        from zo_megatron.data import parse_data_path

        for prefix in parse_data_path(args.data_path)[0]:
            validate_data_prefix(prefix, tokenizer)
        data_path = args.data_path
    else:
        from zo_megatron.data import default_data_prefix

        data_path = [default_data_prefix(tokenizer=tokenizer)]
    if args.tensorboard_dir:
        try:
            import torch.utils.tensorboard  # noqa: F401
        except ImportError:
            raise UserError("--tensorboard-dir needs the tensorboard package: pip install tensorboard") from None
    if args.wandb_project:
        try:
            import wandb  # noqa: F401
        except ImportError:
            raise UserError("--wandb-project needs the wandb package: pip install wandb "
                            "(WANDB_MODE=offline logs without an account)") from None
    if args.save:
        check_save_dir(args.save)
        if env.rank == 0:
            from zo_megatron.checkpoint.lock import check_save_lock

            args.save_lock_note = check_save_lock(args.save, args.force_save_lock)
    memory_check(args, env, dp, args.model_vocab_size)
    if args.save:
        check_free_space(args.save, checkpoint_bytes(args.memory_plan.params_total, args.zero_offload,
                                                     args.exp_avg_dtype == "bf16"))
    return tokenizer, data_path


def model_vocab_size(args, tokenizer) -> int:
    """The model's vocabulary before padding: --vocab-size when given (Megatron-LM's flag; a
    checkpoint whose vocabulary is larger than its tokenizer, as Qwen2's is), else the tokenizer's.
    Every id the tokenizer makes must have a row, so a smaller --vocab-size is refused."""
    if args.vocab_size is None:
        return int(tokenizer.vocab_size)
    if args.vocab_size < tokenizer.vocab_size:
        raise UserError(f"--vocab-size {args.vocab_size} is smaller than the tokenizer's {tokenizer.vocab_size} "
                        f"tokens: use --vocab-size >= {tokenizer.vocab_size} (or drop it to use the tokenizer's size)")
    return int(args.vocab_size)


def _build_optimizer(args, model, ps):
    from zo_megatron.offload.engine import AdamConfig, ZeroOffloadEngine
    from zo_megatron.offload.loss_scaler import ConstantLossScaler, DynamicLossScaler
    from zo_megatron.training.plain_optimizer import PlainDDPOptimizer

    adam = AdamConfig(lr=args.lr, beta1=args.adam_beta1, beta2=args.adam_beta2, eps=args.adam_eps,
                      weight_decay=args.weight_decay, state_dtype=args.exp_avg_dtype)
    if args.precision == "fp16":
        scaler = ConstantLossScaler(args.loss_scale) if args.loss_scale else DynamicLossScaler(
            initial_scale=args.initial_loss_scale, min_scale=args.min_loss_scale,
            growth_interval=args.loss_scale_window, hysteresis=args.hysteresis)
    else:
        scaler = ConstantLossScaler(1.0)
    common = dict(precision=args.precision, adam=adam, clip_grad=args.clip_grad, dp_group=ps.dp_group,
                  tp_rank=ps.tp_rank, loss_scaler=scaler, no_decay_embeddings=args.no_weight_decay_embeddings,
                  tp_group=ps.tp_group)
    if args.zero_offload:
        return ZeroOffloadEngine(model, bucket_size=args.bucket_size, pin_memory=not args.no_pin_memory,
                                 device=ps.device, grad_reduce_in_fp32=args.accumulate_allreduce_grads_in_fp32,
                                 host_grad_dtype=args.main_grads_dtype,
                                 accumulate_on_host=args.accumulate_grads_on_host and args.grad_accum_steps > 1,
                                 dpu_warmup_steps=args.dpu_warmup_steps if args.dpu else None,
                                 dpu_weight_prediction=args.dpu_weight_prediction,
                                 optimizer_offload_fraction=args.optimizer_offload_fraction,
                                 overlap_cpu_step=args.overlap_cpu_step,
                                 overlap_speculated_fraction=args.overlap_speculated_fraction, **common)
    return PlainDDPOptimizer(model.to(ps.device), **common)


def _agreed_exit(args, iteration: int, elapsed_s: float) -> str | None:
    """Megatron's --exit-interval / --exit-duration-in-mins; the clock-based one is agreed (max over
    ranks) so every rank stops after the same iteration."""
    from zo_megatron.training.megatron_compat import should_exit

    reason = should_exit(args, iteration, elapsed_s)
    if args.exit_duration_in_mins is not None:
        flag = collectives.all_reduce(torch.tensor([1.0 if reason else 0.0]), "max")
        if flag.item() and reason is None:
            reason = f"--exit-duration-in-mins {args.exit_duration_in_mins:g} (on another rank)"
    return reason


BATCH_KEYS = ("tokens", "labels", "loss_mask", "position_ids")   # model.loss's arguments, in order


def _evaluate(model, optimizer, batches, eval_iters: int, ps, device) -> tuple[float, int]:
    """Mean loss over `eval_iters` micro-batches per rank, and the samples that covered (all DP ranks)."""
    optimizer.flush()                       # evaluate the parameters with every update applied
    model.eval()
    total, count = torch.zeros((), dtype=torch.float64, device=device), 0
    with torch.no_grad(), optimizer.forward_context():
        for _ in range(eval_iters):
            b = next(batches)
            d = batch_to_device({k: b[k] for k in BATCH_KEYS}, device)
            loss = model.loss(*(d[k] for k in BATCH_KEYS))
            total += loss.detach().double()
            count += 1
            samples = b["tokens"].shape[0]
    model.train()
    collectives.all_reduce(total, group=ps.dp_group)
    return host_value(total).item() / (count * ps.dp_size), count * samples * ps.dp_size


def _schedule_state(args, iteration: int) -> dict:
    """The LR schedule as Megatron's OptimizerParamScheduler saves it (checked on resume)."""
    return {"max_lr": args.lr, "min_lr": args.min_lr, "lr_warmup_steps": args.lr_warmup_iters,
            "lr_decay_steps": args.lr_decay_iters, "lr_decay_style": args.lr_decay_style, "num_steps": iteration}


def _resume(args, ps, model, optimizer, vocab_size: int, tokenizer_vocab: int, model_meta: dict,
            metrics) -> tuple[int, int, int]:
    """--load: restore the checkpoint (docs/checkpoints.md); returns (iteration, consumed
    training samples, consumed validation samples)."""
    from zo_megatron.checkpoint import LoadOptions, load_checkpoint
    from zo_megatron.training.arguments import build_parser, origin
    from zo_megatron.training.checkpoint_args import describe_diff

    parser = build_parser()
    fix = ("launch with the model flags the checkpoint was trained with, or add --use-checkpoint-args to take "
           "them from it") if not args.use_checkpoint_args else "launch with the checkpoint's model flags"
    t0 = time.monotonic()
    res = load_checkpoint(
        args.load, ps=ps, model=model, optimizer=optimizer, vocab_size=vocab_size, model_meta=model_meta,
        tokenizer_vocab=tokenizer_vocab,
        describe_diff=lambda k, ck, here: describe_diff(parser, k, ck, here, origin(args, k)), model_fix=fix,
        schedule=_schedule_state(args, 0), opts=LoadOptions(
            no_load_optim=args.no_load_optim, no_load_rng=args.no_load_rng, finetune=args.finetune,
            override_opt_param_scheduler=args.override_opt_param_scheduler,
            use_checkpoint_opt_param_scheduler=args.use_checkpoint_opt_param_scheduler,
            train_iters=args.train_iters, schedule_hint=extend_hint(args), step=args.ckpt_step),
        agree=collectives.all_ranks_agree)
    model.check_window(args.seq_length)     # a loaded sliding window that binds: refused before training
    if res.opt_param_scheduler is not None:             # --use-checkpoint-opt_param-scheduler
        s = res.opt_param_scheduler
        args.lr, args.min_lr, args.lr_warmup_iters = s["max_lr"], s["min_lr"], s["lr_warmup_steps"]
        args.lr_decay_iters, args.lr_decay_style = s["lr_decay_steps"], s["lr_decay_style"]
    if res.resharded_from is not None:
        metrics.print(f" resharded from TP{res.resharded_from[0]} x DP{res.resharded_from[1]} to "
                      f"TP{ps.tp_size} x DP{ps.dp_size} (RNG: {res.rng_restored})")
    if res.converted_from is not None:
        metrics.print(f" loaded weights only from {res.path} (converted from {res.converted_from}): fresh optimizer "
                      f"state, iteration 0, in {time.monotonic() - t0:.2f}s")
    else:
        metrics.print(f" resumed from {res.path} at iteration {res.iteration} ({res.consumed_samples} samples "
                      f"consumed) in {time.monotonic() - t0:.2f}s")
        from zo_megatron.checkpoint.layout import MANIFEST
        from zo_megatron.checkpoint.safe_load import read_json
        from zo_megatron.training.checkpoint_args import run_changes

        saved = read_json(os.path.join(res.path, MANIFEST), "checkpoint manifest").get("args") or {}
        for line in run_changes(saved, args):
            metrics.print(line)
    return res.iteration, res.consumed_samples, res.consumed_valid_samples


def _cycle(make, consumed: int = 0):
    """Endless micro-batches from `make(start)` (a fresh DP iterator per pass over a split),
    continuing after `consumed` samples (all ranks together) as a resumed run must."""
    first = make(0)
    per_pass = (len(first.dataset) // first.global_micro_batch) * first.global_micro_batch
    start = consumed % per_pass if per_pass else 0
    while True:
        produced = False
        for b in make(start):
            produced = True
            yield b
        start = 0
        if not produced:
            raise UserError("the validation split holds fewer samples than one micro-batch per DP rank: "
                            "lower --micro-batch-size or give the split more documents")


def _set_threads(args, ps, adam_threads: int) -> None:
    """CPU Adam threads; with --dpu or --overlap-cpu-step the CPU Adam overlaps forward/backward,
    so on a CPU-only run the rank's threads are split between it and torch's intra-op pool
    (docs/dpu.md)."""
    from zo_megatron.offload import cpu_adam

    if ps.device.type == "cuda":
        # The host's torch passes (host accumulation, --dpu-weight-prediction's extrapolation, the
        # fp32 parameter copies, the reload from the master) get the cores the CPU Adam gets:
        # torchrun exports OMP_NUM_THREADS=1, which left them on one core (issue 34, 2.4). Torch's
        # GPU work does not use this pool; the main thread only launches kernels.
        torch.set_num_threads(max(1, adam_threads))
    if args.dpu or args.overlap_cpu_step:     # resolved by job_plan (the pre-launch memory check)
        if ps.device.type == "cuda":        # the device computes; one core keeps launching its kernels
            adam_threads = args.dpu_adam_threads or max(1, adam_threads - 1)
        else:
            total = adam_threads
            adam_threads = args.dpu_adam_threads or max(1, total // 2)
            torch.set_num_threads(max(1, total - adam_threads))
    cpu_adam.set_num_threads(adam_threads)
    args.threads_line = f"CPU Adam {adam_threads} threads, torch {torch.get_num_threads()}"


def _train(args, env, ps, tokenizer, data_path, cpu_adam_threads: int) -> int:
    from zo_megatron.checkpoint import save_checkpoint
    from zo_megatron.data import DPBatches, build_gpt_datasets
    from zo_megatron.model import GPTConfig, build_gpt_model
    from zo_megatron.parallel import destroy_parallel
    from zo_megatron.offload.loss_scaler import DynamicLossScaler
    from zo_megatron.training import faults
    from zo_megatron.training.timeline import Timeline

    t_start = time.monotonic()
    _set_threads(args, ps, args.cpu_adam_threads or cpu_adam_threads)
    metrics = Metrics(enabled=ps.rank == 0, total_iters=args.train_iters, jsonl_path=args.log_jsonl,
                      tensorboard_dir=args.tensorboard_dir, progress_bar=not args.no_progress_bar,
                      wandb=dict(project=args.wandb_project, name=args.wandb_exp_name, dir=args.wandb_save_dir,
                                 config=vars(args)) if args.wandb_project else None)
    metrics.header(run_header(args, ps))
    stack = contextlib.ExitStack()
    stop = faults.StopSignal(enabled=args.exit_signal_handler or bool(args.save))
    stack.callback(stop.restore)
    inject = faults.FaultInjection.from_env(ps.rank)
    iteration = 0
    setup_memory = {"start": proc_memory_bytes()}
    try:
        if args.save:                       # one job per save directory (checkpoint/lock.py)
            from zo_megatron.checkpoint.lock import SaveLock

            with collectives.all_ranks_agree():
                lock = SaveLock(args.save, args.force_save_lock) if ps.rank == 0 else None
            if lock is not None:
                stack.callback(lambda: lock.release(wrote_checkpoint=saved_at is not None))
            if getattr(args, "save_lock_note", None):
                metrics.print(f" {args.save_lock_note}")
        saved_at = None
        cfg = GPTConfig(**architecture_kwargs(args), vocab_size=args.model_vocab_size, precision=args.precision,
                        hidden_dropout=args.hidden_dropout, attention_dropout=args.attention_dropout,
                        init_method_std=args.init_method_std, recompute=args.recompute_granularity,
                        recompute_method=args.recompute_method or "uniform",
                        recompute_num_layers=args.recompute_num_layers or 1,
                        attention_backend=args.core_attention, sequence_parallel=args.sequence_parallel)
        gb = args.global_batch_size
        n_evals = args.train_iters // args.eval_interval + 1
        train_ds, valid_ds, _ = build_gpt_datasets(   # collective (megatron's index-cache barrier)
            data_path, args.split, args.seq_length, args.seed, tokenizer,
            train_samples=args.train_iters * gb, valid_samples=n_evals * args.eval_iters * gb,
            test_samples=0, cache_dir=args.data_cache_path)
        # Built on the host in fp32: the offload engine moves it to the device as its flat 16-bit
        # buffer (the device never holds the fp32 copy); the baseline moves it whole.
        setup_memory["data"] = proc_memory_bytes()
        model = build_gpt_model(cfg, ps.tp_rank, ps.tp_size, args.seed)
        setup_memory["model"] = proc_memory_bytes()
        optimizer = _build_optimizer(args, model, ps)
        stack.callback(optimizer.close)
        setup_memory["optimizer"] = proc_memory_bytes()
        acc = getattr(optimizer, "accounting", None)
        timeline = Timeline(args.timeline, ps.rank, ps.world_size, ps.device) if args.timeline else None
        if timeline is not None:
            stack.callback(timeline.close)
        start_iter, consumed, consumed_valid = 0, 0, 0
        model_meta = cfg.arch_meta()          # every ARCH_FIELDS field: a resume must match them all
        if args.load:
            start_iter, consumed, consumed_valid = _resume(args, ps, model, optimizer, cfg.vocab_size,
                                                           tokenizer.vocab_size, model_meta, metrics)
            setup_memory["load"] = proc_memory_bytes()      # its hwm: what reading the checkpoint peaked at
        metrics.log_setup_memory(setup_memory, acc.as_dict() if acc is not None else None)
        _banner(metrics, args, ps, cfg, optimizer, data_path, time.monotonic() - t_start)
        if args.dpu:
            first_delayed = start_iter + max(1, args.dpu_warmup_steps - optimizer.step_count)
            if first_delayed > args.train_iters:
                metrics.print(f" warning: --dpu given, but the delayed parameter update would start at iteration "
                              f"{first_delayed} (after --dpu-warmup-steps {args.dpu_warmup_steps} exact updates; "
                              f"{optimizer.step_count} done) and the run ends at --train-iters {args.train_iters}: "
                              f"every update of this run is exact; use --dpu-warmup-steps at most "
                              f"{args.train_iters - start_iter + optimizer.step_count} to delay any")

        train_iter = iter(DPBatches(train_ds, args.micro_batch_size, ps.dp_rank, ps.dp_size,
                                    consumed_samples=consumed))
        valid_iter = _cycle(lambda start: DPBatches(valid_ds, args.micro_batch_size, ps.dp_rank, ps.dp_size,
                                                    consumed_samples=start), consumed_valid) \
            if valid_ds is not None else None
        fpt = model_flops_per_token(cfg, args.seq_length, cfg.padded_vocab_size(ps.tp_size),
                                    args.recompute_granularity, recomputed_layers=_recomputed_layers(cfg))
        window = dict(loss=0.0, n=0, skipped=0, nan=0, t=time.monotonic(), norm=0.0, speculated=0, rolled_back=0)
        iteration = start_iter
        last_val = None
        saved_at, skips_in_a_row, stop_reason = None, 0, None

        def save() -> None:
            nonlocal saved_at
            optimizer.flush()              # a checkpoint holds no pending update: resume is exact
            t_save = paused = time.monotonic()   # as Megatron: saving stays out of the interval timer
            mem_before_save = proc_memory_bytes()
            try:
                with inject.saving(iteration):
                    path = save_checkpoint(
                        args.save, iteration, ps=ps, model=model, optimizer=optimizer,
                        vocab_size=cfg.vocab_size,
                        train_state=dict(consumed_samples=consumed, consumed_valid_samples=consumed_valid,
                                         opt_param_scheduler=_schedule_state(args, iteration)),
                        model_meta=model_meta, args=vars(args), keep_last=args.keep_last, tokenizer=tokenizer)
            except (OSError, RuntimeError) as exc:
                if isinstance(exc, RuntimeError) and not str(exc).startswith("saving "):
                    raise                          # not the save's own failure (e.g. a lost peer)
                prev = f"iteration {saved_at}" if saved_at is not None else "the one --load started from, if any"
                # DCP reports a failed write to every rank: then rank 0 alone says it
                everywhere = isinstance(exc, RuntimeError)
                raise faults.SaveFailed(everywhere,
                    f"saving the checkpoint of iteration {iteration} to {args.save} failed "
                    f"({str(exc).strip().splitlines()[0][:300]}); the previous checkpoint ({prev}) is intact "
                    f"and stays latest: free space or fix the directory, then resume with --load {args.save}") \
                    from None
            saved_at = iteration
            metrics.log_save(iteration, path, time.monotonic() - t_save, mem_before_save, proc_memory_bytes())
            window["t"] += time.monotonic() - paused

        scheduler = LRScheduler.from_args(args)
        scheduler.step(consumed)            # exact on resume unless fp16 skipped steps before the save
        while iteration < args.train_iters:
            inject.at_iteration_start(iteration + 1)
            lr = scheduler.get_lr()
            if hasattr(optimizer, "expect_lr"):    # a speculated CPU step (--overlap-cpu-step) uses it
                optimizer.expect_lr(lr)
            step_loss = torch.zeros((), device=ps.device)
            phase = timeline.phase if timeline is not None else _no_phase
            for m in range(args.grad_accum_steps):
                b = next(train_iter)
                d = batch_to_device({k: b[k] for k in BATCH_KEYS}, ps.device)
                with phase("forward", iteration + 1, m), optimizer.forward_context():
                    loss = model.loss(*(d[k] for k in BATCH_KEYS))
                    loss = inject.loss(iteration + 1, loss)
                with phase("backward", iteration + 1, m):
                    optimizer.backward(loss / args.grad_accum_steps,
                                       last_micro_batch=m == args.grad_accum_steps - 1)
                step_loss += loss.detach().float() / args.grad_accum_steps
            res = optimizer.step(lr)
            phases = optimizer.drain_phases()
            if timeline is not None:
                timeline.record_all(iteration + 1, phases)
            if not res.skipped:             # as Megatron: a skipped (fp16 overflow) update does not advance it
                scheduler.step(gb)
            # the engine delays every update from its W-th on (offload/engine.py)
            window["delayed"] = bool(args.dpu and not res.skipped and optimizer.step_count >= args.dpu_warmup_steps)
            if window["delayed"] and optimizer.step_count == args.dpu_warmup_steps:
                metrics.print(f" delayed parameter update starts at iteration {iteration + 1}: from now on the CPU "
                              f"Adam of each step overlaps the next step's forward/backward (--dpu-warmup-steps "
                              f"{args.dpu_warmup_steps})")
            iteration += 1
            consumed += gb
            metrics.advance()
            step_loss = host_value(step_loss).item()     # a timed wait first (a dead peer: one line)
            if math.isfinite(step_loss):
                window["loss"] += step_loss
            else:
                window["nan"] += 1
            window["n"] += 1
            window["skipped"] += int(res.skipped)
            window["speculated"] += res.speculated_buckets
            window["rolled_back"] += res.rolled_back_buckets
            scaler = optimizer.loss_scaler          # fp16: skips while the scale searches do not count
            at_floor = not isinstance(scaler, DynamicLossScaler) or res.loss_scale <= scaler.min_scale
            skips_in_a_row = skips_in_a_row + 1 if res.skipped and at_floor else 0
            window["norm"] = res.grad_norm
            if iteration % args.log_interval == 0 or iteration == args.train_iters:
                _log(metrics, window, iteration, lr, res, optimizer, ps, args, fpt, iteration - start_iter)
            if valid_iter is not None and args.eval_iters > 0 and (
                    iteration % args.eval_interval == 0 or iteration == args.train_iters):
                paused = time.monotonic()   # as Megatron: evaluation stays out of the interval timer
                # --eval-iters counts global batches, as Megatron's: accumulation x micro-batches per rank.
                last_val, n_samples = _evaluate(model, optimizer, valid_iter, args.eval_iters * args.grad_accum_steps,
                                                ps, ps.device)
                consumed_valid += n_samples
                metrics.log_eval(iteration, last_val, eval_samples=n_samples)
                window["t"] += time.monotonic() - paused
            exit_reason = _agreed_exit(args, iteration, time.monotonic() - t_start)
            if args.save and ((args.save_interval and iteration % args.save_interval == 0)
                              or iteration == args.train_iters or exit_reason):
                save()
            if exit_reason:
                metrics.print(f" exiting after iteration {iteration}: {exit_reason}")
                break
            if args.max_skipped_iters and skips_in_a_row >= args.max_skipped_iters:
                stop_reason = "skipped"
                break
            if stop.enabled and iteration < args.train_iters and (signum := stop.agreed()):
                stop_reason = signal.Signals(signum).name
                break
        if stop_reason is not None:
            if args.save and saved_at != iteration:
                save()
            where = f"; resume with --load {args.save}" if args.save else " (no --save: nothing was saved)"
            if stop_reason == "skipped":
                _rank0_error(ps, f"{skips_in_a_row} consecutive iterations (up to {iteration}) were skipped for "
                              f"a NaN/inf loss or gradient; stopping (--max-skipped-iters "
                              f"{args.max_skipped_iters}). The weights and optimizer state are those of the last "
                              f"good step{where}; lower --lr or check the data")
                return 1
            metrics.print(f" stopped by {stop_reason} after iteration {iteration}{where}")
            return 0
        optimizer.flush()                  # the last delayed update belongs to the trained model
        if timeline is not None:
            timeline.record_all(iteration, optimizer.drain_phases())
        elapsed = time.monotonic() - t_start
        if last_val is not None:
            metrics.print(f" done: {iteration} iterations in {elapsed / 60:.1f} min; final validation loss "
                          f"{last_val:.4f} nats, perplexity {math.exp(min(last_val, 50)):.2f}")
    except faults.SaveFailed as exc:
        report_error(f"{'' if exc.everywhere else f'rank {ps.rank}: '}{exc.message}",
                     print_it=ps.rank == 0 or not exc.everywhere)
        return 1
    except Exception as exc:  # noqa: BLE001 - only a lost peer is handled here; the rest re-raises
        if faults.is_lost_peer(exc):
            faults.exit_lost_peer(exc, ps.rank, iteration, args.distributed_timeout_minutes)
        raise
    finally:
        stack.close()                       # the optimizer first: pinned host memory is unregistered
        metrics.close()
        destroy_parallel()
    return 0


def _recomputed_layers(cfg) -> int:
    """How many layers full recompute runs forward twice (block N: only the first N)."""
    if cfg.recompute != "full":
        return 0
    return min(cfg.recompute_num_layers, cfg.num_layers) if cfg.recompute_method == "block" else cfg.num_layers


def _rank0_error(ps, msg: str) -> None:
    report_error(msg, print_it=ps.rank == 0)


@contextlib.contextmanager
def _no_phase(*_):
    yield


def _log(metrics, window, iteration, lr, res, optimizer, ps, args, fpt, done) -> None:
    # Mean over the window's finite losses of every DP rank.
    stats = torch.tensor([window["loss"], window["n"] - window["nan"]], dtype=torch.float64)
    collectives.all_reduce(stats, group=ps.dp_group)
    dt = time.monotonic() - window["t"]
    tokens = window["n"] * args.global_batch_size * args.seq_length
    acc = optimizer.accounting
    metrics.log_train({
        "iteration": iteration, "loss": stats[0].item() / max(stats[1].item(), 1.0), "lr": lr,
        "grad_norm": window["norm"], "loss_scale": res.loss_scale, "skipped": window["skipped"],
        "nan_iterations": window["nan"], "tokens_per_s": tokens / dt, "step_time_s": dt / max(window["n"], 1),
        "tflops_per_rank": fpt * tokens / dt / ps.world_size / 1e12,
        "device_model_state_bytes": acc.device_model_state_bytes, "host_model_state_bytes": acc.host_bytes,
        "host_rss_bytes": host_rss_bytes(), "comm_bytes_per_step": acc.sent_bytes,
        # --overlap-cpu-step: buckets whose CPU Adam ran during backward / were undone and redone
        "speculated_buckets": window["speculated"], "rolled_back_buckets": window["rolled_back"],
        "overlap_cpu_step": bool(getattr(args, "overlap_cpu_step", False)),
        "device_peak_bytes": torch.cuda.max_memory_allocated(ps.device) if ps.device.type == "cuda" else None,
        "delayed_update": window.get("delayed", False),
        "_iters_done_this_run": done,
    })
    window.update(loss=0.0, n=0, skipped=0, nan=0, t=time.monotonic(), speculated=0, rolled_back=0)


def _attention_line(cfg, ps) -> str:
    """Which core attention runs (for SDPA: which kernel) and whether sequence parallelism is on."""
    if cfg.attention_backend == "sdpa":
        from zo_megatron.model.attention import describe_kernel

        heads = cfg.num_attention_heads
        groups = getattr(cfg, "query_groups", heads)
        head_dim = getattr(cfg, "head_dim", cfg.hidden_size // heads)
        text = describe_kernel(heads, groups, head_dim, ps.tp_size, cfg.dtype, ps.device, cfg.attention_dropout)
    else:
        text = "megatron-core local DotProductAttention (s x s scores stored)"
    sp = cfg.sequence_parallel and ps.tp_size > 1
    return text + ("; sequence parallel over TP " + str(ps.tp_size) if sp else "; no sequence parallelism")


def _pin_memory_warnings(args, ps) -> list[str]:
    """The banner's warning for --no-pin-memory where it costs time: ZeRO-Offload (the only path that
    copies to the host) on a CUDA device, where a copy from pageable memory blocks the host."""
    if args.no_pin_memory and args.zero_offload and ps.device.type == "cuda":
        return [" warning: --no-pin-memory on a CUDA device: host copies then block, so backward serialises "
                "behind every copy home (drop the flag unless pinning host memory fails)"]
    return []


def _banner(metrics, args, ps, cfg, optimizer, data_path, setup_s) -> None:
    total = cfg.num_parameters()
    local = sum(p.numel() for p in optimizer.model.parameters())
    acc = optimizer.accounting
    src = "embedded State of the Union corpus (233 addresses, public domain)" if not args.data_path else " ".join(data_path)
    if args.mock_data:
        src = "bundled demo corpus (--mock-data)"
    elif not args.data_path and not args.demo:   # a model shape was given but no data: say it loudly
        src = ("!!! NO --data-path GIVEN: training on the bundled demo corpus (233 State of the Union "
               "addresses), not your data; pass --data-path PREFIX !!!")
    plan = getattr(args, "memory_plan", None)
    lines = [
        f"zo_megatron pretrain_gpt: {'DEMO defaults, ' if args.demo else ''}world {ps.world_size} = TP {ps.tp_size} x DP {ps.dp_size}, "
        f"device {ps.device.type}, {args.precision}, {engine_words(args)}",
        f" precision: {args.precision} ({args.precision_reason}); gradients reduced in "
        f"{'fp32' if args.accumulate_allreduce_grads_in_fp32 or args.precision == 'fp32' else args.precision}"
        + (f", copied home as {args.main_grads_dtype or args.precision}" if args.zero_offload else "")
        + (", accumulated on the host in fp32" if args.accumulate_grads_on_host else "")
        + (f"; optimizer {args.optimizer_offload_fraction:.0%} on the host, the rest on the device"
           if args.zero_offload and args.optimizer_offload_fraction < 1 else "")
        + (f"; {args.offload_fraction_reason}" if getattr(args, "offload_fraction_reason", None) else "")
        + (f"; delayed parameter update after {args.dpu_warmup_steps} exact updates"
           + (", device copy extrapolated by the last update (--dpu-weight-prediction)"
              if args.dpu_weight_prediction else "")
           + f" ({args.threads_line} per rank)" if args.dpu else "")
        + ((f"; CPU step overlapped with backward (speculated per bucket, exact; {args.overlap_reason}; "
            f"{args.threads_line} per rank)" if args.overlap_cpu_step else f"; {args.overlap_reason}")
           if args.zero_offload and not args.dpu else ""),
        f" model: {cfg.architecture_name()} {cfg.num_layers} layers x {cfg.hidden_size} hidden x {cfg.num_attention_heads} heads, "
        f"seq {args.seq_length}, vocab {cfg.vocab_size} (padded {cfg.padded_vocab_size(ps.tp_size)}), "
        f"{total / 1e6:.1f}M params ({local / 1e6:.1f}M on this TP rank)"
        + value_sources(args, ("num_layers", "hidden_size", "num_attention_heads", "seq_length"),
                        getattr(args, "from_checkpoint_flags", ())),
        f" attention: {_attention_line(cfg, ps)}",
        f" batch: global {args.global_batch_size} = micro {args.micro_batch_size} x DP {ps.dp_size} x accumulation "
        f"{args.grad_accum_steps}; {args.train_iters} iterations, lr {args.lr:g} {args.lr_decay_style} "
        f"(warmup {args.lr_warmup_iters}, min {args.min_lr:g})"
        + value_sources(args, ("micro_batch_size", "train_iters", "lr", "lr_decay_style", "lr_warmup_iters",
                               "min_lr")),
        f" data: {src}" + (f"; tokenizer: HuggingFaceTokenizer {args.tokenizer_model}"
                           if args.tokenizer_type == "HuggingFaceTokenizer" else ""),
        f" model states per rank: device {human_bytes(acc.device_model_state_bytes)}, host {human_bytes(acc.host_bytes)}"
        + (f"; planner: device {human_bytes(plan.device_bytes_per_gpu)}/rank, host {human_bytes(plan.host_bytes_per_node)}/node"
           if plan is not None else ""),
        *_pin_memory_warnings(args, ps),
        *([f" {args.load_note}"] if getattr(args, "load_note", None) else []),
        f" set-up took {setup_s:.1f}s; {NOTICES}",
    ]
    for line in lines:
        metrics.print(line)
