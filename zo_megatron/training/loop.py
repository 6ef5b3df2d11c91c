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
import time

import torch

from zo_megatron.errors import UserError
from zo_megatron.parallel import collectives
from zo_megatron.parallel.megatron_notices import SUMMARY as NOTICES
from zo_megatron.parallel.megatron_notices import hide_known_megatron_notices
from zo_megatron.training.arguments import check_batch_sizes, parse_args
from zo_megatron.training.metrics import Metrics, flops_per_token, host_rss_bytes, human_bytes
from zo_megatron.training.schedule import LRScheduler


def job_plan_input(args, env, dp: int, vocab_size: int):
    """This run's PlanInput: its flags through the planner's one builder, and this machine."""
    from zo_megatron.parallel.launch_env import memory_limit_bytes
    from zo_megatron.planner import GiB, plan_input_from_flags

    cuda = torch.cuda.is_available()
    host = memory_limit_bytes()
    return plan_input_from_flags(
        args, data_parallel=dp, vocab_size=vocab_size,
        gpu_memory_bytes=torch.cuda.get_device_properties(0).total_memory if cuda else host,
        host_memory_bytes_per_node=host, gpus_per_node=env.local_world_size, device_is_host=not cuda,
        device_overhead_bytes=GiB if cuda else 0, host_reserve_bytes=min(32 * GiB, host // 10),
        host_overhead_bytes_per_rank=(3 if cuda else 1) * GiB)


def memory_check(args, env, dp: int, vocab_size: int) -> None:
    """Refuse a run the planner says cannot fit the device or host memory this machine has."""
    from zo_megatron.planner import plan

    inp = job_plan_input(args, env, dp, vocab_size)
    p = plan(inp)
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


def pretrain(argv=None) -> int:
    hide_known_megatron_notices()                # before megatron-core is first imported
    args = parse_args(argv)
    if args.tensor_parallel > 1:
        # As Megatron-LM's launch scripts do: one hardware queue, so each TP layer's async
        # all-reduce is scheduled before the weight-gradient GEMM it overlaps (set before CUDA starts).
        os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    from zo_megatron.parallel import validate_parallel_config
    from zo_megatron.parallel.launch_env import default_cpu_adam_threads, discover_launch_env

    env = discover_launch_env()
    validate_parallel_config(env.world_size, args.tensor_parallel, args.num_attention_heads, args.hidden_size)
    dp = env.world_size // args.tensor_parallel
    check_batch_sizes(args, dp)
    LRScheduler.from_args(args)                  # its one-line errors now, before any process group
    from zo_megatron.training.megatron_compat import check_backend

    check_backend(args, torch.cuda.is_available())
    from zo_megatron.parallel import destroy_parallel, init_parallel

    ps = init_parallel(args.tensor_parallel, seed=args.seed, num_attention_heads=args.num_attention_heads,
                       hidden_size=args.hidden_size)
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

    tokenizer = build_tokenizer(args.vocab_file, args.merge_file, allow_custom_vocab=args.allow_custom_vocab)
    if args.data_path:
        from zo_megatron.data import parse_data_path

        for prefix in parse_data_path(args.data_path)[0]:
            validate_data_prefix(prefix, tokenizer)
        data_path = args.data_path
    else:
        from zo_megatron.data import default_data_prefix

        data_path = [default_data_prefix()]
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
    if args.load and not os.path.isdir(args.load):
        raise UserError(f"--load {args.load}: no such directory")
    if args.save:
        check_save_dir(args.save)
    memory_check(args, env, dp, tokenizer.vocab_size)
    return tokenizer, data_path


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
                  tp_rank=ps.tp_rank, loss_scaler=scaler, no_decay_embeddings=args.no_weight_decay_embeddings)
    if args.zero_offload:
        return ZeroOffloadEngine(model, bucket_size=args.bucket_size, pin_memory=not args.no_pin_memory,
                                 device=ps.device, grad_reduce_in_fp32=args.accumulate_allreduce_grads_in_fp32,
                                 host_grad_dtype=args.main_grads_dtype,
                                 accumulate_on_host=args.accumulate_grads_on_host, **common)
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


def _probe_checkpoint(root: str, ps, expected: dict) -> None:
    """Read this rank's checkpoint file (memory-mapped, nothing applied) so that every rank can
    agree it is readable BEFORE load_checkpoint, whose restore issues collectives a failed rank
    would never join. TODO(checkpoint): move into load_checkpoint's read phase."""
    from zo_megatron.checkpoint import sharded

    iteration = sharded.find_latest(root)
    if iteration is None:
        return                                   # load_checkpoint says so, identically on every rank
    d = sharded._iter_dir(root, iteration)
    sharded.check_compatible(sharded.read_metadata(root, iteration),
                             {"tensor_parallel": ps.tp_size, "data_parallel": ps.dp_size, **expected}, d)
    path = sharded._rank_file(d, ps.tp_rank, ps.dp_rank)
    try:
        torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except FileNotFoundError:
        raise UserError(f"{path} is missing: the checkpoint is incomplete") from None
    except Exception as exc:  # noqa: BLE001 - torch raises many types for a damaged file
        raise UserError(f"{path} cannot be read ({type(exc).__name__}: {str(exc).splitlines()[0][:200]}); "
                        "the file is corrupt or not a zo_megatron checkpoint") from None


def _evaluate(model, optimizer, batches, eval_iters: int, ps, device) -> tuple[float, int]:
    """Mean loss over `eval_iters` micro-batches per rank, and the samples that covered (all DP ranks)."""
    model.eval()
    total, count = torch.zeros((), dtype=torch.float64, device=device), 0
    with torch.no_grad(), optimizer.forward_context():
        for _ in range(eval_iters):
            b = next(batches)
            loss = model.loss(b["tokens"].to(device), b["labels"].to(device), b["loss_mask"].to(device),
                              b["position_ids"].to(device))
            total += loss.detach().double()
            count += 1
            samples = b["tokens"].shape[0]
    model.train()
    collectives.all_reduce(total, group=ps.dp_group)
    return total.item() / (count * ps.dp_size), count * samples * ps.dp_size


def _cycle(make):
    """Endless micro-batches from `make()` (a fresh DP iterator per pass over a split)."""
    while True:
        produced = False
        for b in make():
            produced = True
            yield b
        if not produced:
            raise UserError("the validation split holds fewer samples than one micro-batch per DP rank: "
                            "lower --micro-batch-size or give the split more documents")


def _train(args, env, ps, tokenizer, data_path, cpu_adam_threads: int) -> int:
    from zo_megatron.checkpoint.sharded import load_checkpoint, save_checkpoint
    from zo_megatron.data import DPBatches, build_gpt_datasets
    from zo_megatron.model import GPTConfig, build_gpt_model
    from zo_megatron.offload import cpu_adam
    from zo_megatron.parallel import destroy_parallel

    t_start = time.monotonic()
    cpu_adam.set_num_threads(args.cpu_adam_threads or cpu_adam_threads)
    metrics = Metrics(enabled=ps.rank == 0, total_iters=args.train_iters, jsonl_path=args.log_jsonl,
                      tensorboard_dir=args.tensorboard_dir, progress_bar=not args.no_progress_bar,
                      wandb=dict(project=args.wandb_project, name=args.wandb_exp_name, dir=args.wandb_save_dir,
                                 config=vars(args)) if args.wandb_project else None)
    stack = contextlib.ExitStack()
    try:
        cfg = GPTConfig(num_layers=args.num_layers, hidden_size=args.hidden_size,
                        num_attention_heads=args.num_attention_heads, vocab_size=tokenizer.vocab_size,
                        max_position_embeddings=args.max_position_embeddings, ffn_hidden_size=args.ffn_hidden_size,
                        make_vocab_size_divisible_by=args.make_vocab_size_divisible_by, precision=args.precision,
                        hidden_dropout=args.hidden_dropout, attention_dropout=args.attention_dropout,
                        init_method_std=args.init_method_std, recompute=args.recompute_granularity)
        gb = args.global_batch_size
        n_evals = args.train_iters // args.eval_interval + 1
        train_ds, valid_ds, _ = build_gpt_datasets(   # collective (megatron's index-cache barrier)
            data_path, args.split, args.seq_length, args.seed, tokenizer,
            train_samples=args.train_iters * gb, valid_samples=n_evals * args.eval_iters * gb,
            test_samples=0, cache_dir=args.data_cache_path)
        # Built on the host in fp32: the offload engine moves it to the device as its flat 16-bit
        # buffer (the device never holds the fp32 copy); the baseline moves it whole.
        model = build_gpt_model(cfg, ps.tp_rank, ps.tp_size, args.seed)
        optimizer = _build_optimizer(args, model, ps)
        stack.callback(optimizer.close)
        start_iter, consumed = 0, 0
        expected = {k: getattr(args, k) for k in ("num_layers", "hidden_size", "num_attention_heads",
                                                  "seq_length", "precision", "zero_offload")}
        expected["vocab_size"] = tokenizer.vocab_size
        if args.load:
            with collectives.all_ranks_agree():      # a damaged file on rank 3 is reported, by rank
                _probe_checkpoint(args.load, ps, expected)
            start_iter, consumed = load_checkpoint(args.load, ps=ps, model=model, optimizer=optimizer,
                                                   expected=expected)
            metrics.print(f" resumed from {args.load} at iteration {start_iter} ({consumed} samples consumed)")
        _banner(metrics, args, ps, cfg, optimizer, data_path, time.monotonic() - t_start)

        train_iter = iter(DPBatches(train_ds, args.micro_batch_size, ps.dp_rank, ps.dp_size,
                                    consumed_samples=consumed))
        valid_iter = _cycle(lambda: DPBatches(valid_ds, args.micro_batch_size, ps.dp_rank, ps.dp_size)) \
            if valid_ds is not None else None
        fpt = flops_per_token(cfg.num_layers, cfg.hidden_size, args.seq_length,
                              cfg.padded_vocab_size(ps.tp_size), args.recompute_granularity, cfg.ffn_size)
        window = dict(loss=0.0, n=0, skipped=0, nan=0, t=time.monotonic(), norm=0.0)
        iteration = start_iter
        last_val = None
        scheduler = LRScheduler.from_args(args)
        scheduler.step(consumed)            # TODO(checkpoint): load scheduler.state_dict() from the checkpoint
        while iteration < args.train_iters:
            lr = scheduler.get_lr()
            step_loss = torch.zeros((), device=ps.device)
            for m in range(args.grad_accum_steps):
                b = next(train_iter)
                with optimizer.forward_context():
                    loss = model.loss(b["tokens"].to(ps.device), b["labels"].to(ps.device),
                                      b["loss_mask"].to(ps.device), b["position_ids"].to(ps.device))
                optimizer.backward(loss / args.grad_accum_steps, last_micro_batch=m == args.grad_accum_steps - 1)
                step_loss += loss.detach().float() / args.grad_accum_steps
            res = optimizer.step(lr)
            if not res.skipped:             # as Megatron: a skipped (fp16 overflow) update does not advance it
                scheduler.step(gb)
            iteration += 1
            consumed += gb
            metrics.advance()
            if math.isfinite(step_loss.item()):
                window["loss"] += step_loss.item()
            else:
                window["nan"] += 1
            window["n"] += 1
            window["skipped"] += int(res.skipped)
            window["norm"] = res.grad_norm
            if iteration % args.log_interval == 0 or iteration == args.train_iters:
                _log(metrics, window, iteration, lr, res, optimizer, ps, args, fpt, iteration - start_iter)
            if valid_iter is not None and args.eval_iters > 0 and (
                    iteration % args.eval_interval == 0 or iteration == args.train_iters):
                paused = time.monotonic()   # as Megatron: evaluation stays out of the interval timer
                # --eval-iters counts global batches, as Megatron's: accumulation x micro-batches per rank.
                last_val, n_samples = _evaluate(model, optimizer, valid_iter, args.eval_iters * args.grad_accum_steps,
                                                ps, ps.device)
                metrics.log_eval(iteration, last_val, eval_samples=n_samples)
                window["t"] += time.monotonic() - paused
            stop = _agreed_exit(args, iteration, time.monotonic() - t_start)
            if args.save and ((args.save_interval and iteration % args.save_interval == 0)
                              or iteration == args.train_iters or stop):
                paused = time.monotonic()   # as Megatron: saving stays out of the interval timer
                path = save_checkpoint(args.save, iteration, ps=ps, model=model, optimizer=optimizer,
                                       metadata=expected, consumed_samples=consumed)
                metrics.print(f" saved checkpoint {path}")
                window["t"] += time.monotonic() - paused
            if stop:
                metrics.print(f" exiting after iteration {iteration}: {stop}")
                break
        elapsed = time.monotonic() - t_start
        if last_val is not None:
            metrics.print(f" done: {iteration} iterations in {elapsed / 60:.1f} min; final validation loss "
                          f"{last_val:.4f} nats, perplexity {math.exp(min(last_val, 50)):.2f}")
    finally:
        stack.close()                       # the optimizer first: pinned host memory is unregistered
        metrics.close()
        destroy_parallel()
    return 0


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
        "device_peak_bytes": torch.cuda.max_memory_allocated(ps.device) if ps.device.type == "cuda" else None,
        "_iters_done_this_run": done,
    })
    window.update(loss=0.0, n=0, skipped=0, nan=0, t=time.monotonic())


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
        f"device {ps.device.type}, {args.precision}, {'ZeRO-Offload (CPU Adam)' if args.zero_offload else 'plain DDP + AdamW baseline'}",
        f" precision: {args.precision} ({args.precision_reason}); gradients reduced in "
        f"{'fp32' if args.accumulate_allreduce_grads_in_fp32 or args.precision == 'fp32' else args.precision}"
        + (f", copied home as {args.main_grads_dtype or args.precision}" if args.zero_offload else "")
        + (", accumulated on the host in fp32" if args.accumulate_grads_on_host else ""),
        f" model: GPT-2 {cfg.num_layers} layers x {cfg.hidden_size} hidden x {cfg.num_attention_heads} heads, "
        f"seq {args.seq_length}, vocab {cfg.vocab_size} (padded {cfg.padded_vocab_size(ps.tp_size)}), "
        f"{total / 1e6:.1f}M params ({local / 1e6:.1f}M on this TP rank)",
        f" batch: global {args.global_batch_size} = micro {args.micro_batch_size} x DP {ps.dp_size} x accumulation "
        f"{args.grad_accum_steps}; {args.train_iters} iterations, lr {args.lr:g} {args.lr_decay_style} "
        f"(warmup {args.lr_warmup_iters}, min {args.min_lr:g})",
        f" data: {src}",
        f" model states per rank: device {human_bytes(acc.device_model_state_bytes)}, host {human_bytes(acc.host_bytes)}"
        + (f"; planner: device {human_bytes(plan.device_bytes_per_gpu)}/rank, host {human_bytes(plan.host_bytes_per_node)}/node"
           if plan is not None else ""),
        f" set-up took {setup_s:.1f}s; {NOTICES}",
    ]
    for line in lines:
        metrics.print(line)
