"""What the job tells the user about its own choices: where a banner value came from (demo
default, checkpoint), which optimizer engine runs where, why `--optimizer-offload-fraction auto`
chose its share, the fix for extending a finished run, and the header record of a run's log."""
from __future__ import annotations

import os
import time

import torch

from zo_megatron.training.schedule import LRScheduler


def auto_fraction_reason(inp, f) -> str:
    """Why `--optimizer-offload-fraction auto` chose f: the budgets, and what the next smaller host
    share would have needed."""
    from zo_megatron.planner import format_bytes, plan

    budget = (f"budget: device {format_bytes(inp.gpu_memory_bytes)}/rank, host "
              f"{format_bytes(inp.host_memory_bytes_per_node)}/node")
    if f is None:
        return f"auto: no share fits ({budget})"
    p = plan(inp)
    got = f"needs device {format_bytes(p.device_bytes_per_gpu)}/rank, host {format_bytes(p.host_bytes_per_node)}/node"
    if f == 0:
        return f"auto: 0% on the host: the whole optimizer fits on the device ({got}; {budget})"
    less = plan(inp.replace(optimizer_offload_fraction=max(0.0, f - 0.05)))
    return (f"auto: {f:.0%} on the host, the smallest share that fits ({got}; {budget}); "
            f"{max(0.0, f - 0.05):.0%} would need device {format_bytes(less.device_bytes_per_gpu)}/rank")


def extend_hint(args):
    """The fix for extending a finished run: --train-iters grew, so the default --lr-decay-iters did
    and the schedule no longer matches the checkpoint's. Megatron refuses it the same way (its
    OptimizerParamScheduler._check_and_set); this says which flag works and what it changes."""
    import copy
    import shlex

    def hint(saved: dict, current: dict, iteration: int) -> str | None:
        differing = [k for k in ("max_lr", "min_lr", "lr_warmup_steps", "lr_decay_steps", "lr_decay_style")
                     if saved.get(k) != current[k]]
        if differing != ["lr_decay_steps"] or "lr_decay_iters" in getattr(args, "given", ()):
            return None
        old, new = saved["lr_decay_steps"], current["lr_decay_steps"]

        def next_lr(decay_iters: int) -> float:
            a = copy.copy(args)
            a.lr_decay_iters = decay_iters
            s = LRScheduler.from_args(a)
            s.step(iteration * args.global_batch_size)
            return s.get_lr()

        command = shlex.join(["pretrain_gpt.py", *getattr(args, "argv", []), "--override-opt_param-scheduler"])
        return (f"--train-iters {args.train_iters} extends a run whose learning rate decayed over {old} iterations "
                f"(--lr-decay-iters defaults to --train-iters, {new} here), and as in Megatron the schedule must match "
                f"the checkpoint's. Relaunch with --override-opt_param-scheduler: `{command}` (this run's schedule "
                f"replaces the checkpoint's: the rate of iteration {iteration + 1} becomes {next_lr(new):.4g} instead of "
                f"{next_lr(old):.4g} and decays to --min-lr {args.min_lr:g} at iteration {new}); or add --lr-decay-iters "
                f"{old} to keep the finished schedule (--min-lr {args.min_lr:g} for the added iterations)")
    return hint


def run_header(args, ps) -> dict:
    """What tells one run from another in an appended JSONL: its flags, versions, commit, layout."""
    import platform
    import subprocess
    from importlib.metadata import PackageNotFoundError, version

    from zo_megatron.checkpoint.save import json_safe

    def ver(pkg: str) -> str | None:
        try:
            return version(pkg)
        except PackageNotFoundError:
            return None

    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=os.path.dirname(os.path.abspath(__file__)),
                                capture_output=True, text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    return {"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "git_commit": commit,
            "versions": {"python": platform.python_version(), "torch": torch.__version__,
                         "megatron-core": ver("megatron-core"), "zo_megatron": ver("zo_megatron")},
            "world": {"world_size": ps.world_size, "tensor_parallel": ps.tp_size, "data_parallel": ps.dp_size,
                      "device": ps.device.type},
            "args": json_safe({k: v for k, v in vars(args).items() if k not in ("memory_plan",)})}


def engine_words(args) -> str:
    """The optimizer engine as the banner names it: never "CPU Adam" when nothing runs on the host."""
    if not args.zero_offload:
        return "plain DDP + AdamW baseline"
    if args.optimizer_offload_fraction == 0:
        return "ZeRO over DP, optimizer all on the device (0% offloaded: no CPU Adam)"
    if args.optimizer_offload_fraction < 1:
        return f"ZeRO-Offload ({args.optimizer_offload_fraction:.0%} CPU Adam, the rest device Adam)"
    return "ZeRO-Offload (CPU Adam)"


def value_sources(args, dests, checkpoint_flags=()) -> str:
    """' (demo default: --num-layers, ...)' or ' (from the checkpoint: ...)' for the values of one
    banner line that the command line did not give."""
    parts = []
    demo = [f"--{k.replace('_', '-')}" for k in dests if k in getattr(args, "demo_filled", ())]
    if demo:
        parts.append(f"demo default: {', '.join(demo)}")
    if checkpoint_flags:
        parts.append(f"from the checkpoint (--use-checkpoint-args): {', '.join(checkpoint_flags)}")
    return f" ({'; '.join(parts)})" if parts else ""
