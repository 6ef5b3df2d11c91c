"""What the job tells the user about its own choices: where a banner value came from (demo
default, checkpoint), which optimizer engine runs where, why `--optimizer-offload-fraction auto`
chose its share, the fix for extending a finished run, the header record of a run's log, and the
banner a run opens with."""
from __future__ import annotations

import os
import time

import torch

from zo_megatron.parallel.megatron_notices import SUMMARY as NOTICES
from zo_megatron.training.data_flags import describe
from zo_megatron.training.metrics import human_bytes
from zo_megatron.training.nvme_flags import nvme_banner_lines
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


def batch_ramp_words(args, ps) -> str:
    """The banner's words for --rampup-batch-size / --decrease-batch-size-if-needed ('' for neither)."""
    from zo_megatron.training.batch_schedule import BatchSchedule

    batches = BatchSchedule.from_args(args, ps.dp_size)
    if batches.ramped:
        return f", after a ramp: {batches.describe()}"
    running = batches.at(0)[0]
    return (f" (rounded down from {args.global_batch_size} to {running}: --decrease-batch-size-if-needed)"
            if running != args.global_batch_size else "")


def decoupled_words(args) -> str:
    """The banner's words for --decoupled-lr (Megatron's decoupled param group), or for a
    --decoupled-min-lr that has no effect without it (as in Megatron-LM)."""
    peak, floor = getattr(args, "decoupled_lr", None), getattr(args, "decoupled_min_lr", None)
    if peak is not None:
        return (f"; word embedding and output layer: lr {peak:g}, min "
                f"{args.min_lr if floor is None else floor:g} (--decoupled-lr)")
    return "; --decoupled-min-lr has no effect without --decoupled-lr (as in Megatron-LM)" if floor is not None else ""


def extend_hint(args):
    """The fix for extending a finished run: --train-iters grew, so the default --lr-decay-iters did
    and the schedule no longer matches the checkpoint's. Megatron refuses it the same way (its
    OptimizerParamScheduler._check_and_set); this says which flag works and what it changes."""
    import copy
    import shlex

    def hint(saved: dict, current: dict, iteration: int) -> str | None:
        differing = [k for k in ("max_lr", "min_lr", "lr_warmup_steps", "lr_decay_steps", "lr_decay_style")
                     if saved.get(k) != current[k]]
        if differing != ["lr_decay_steps"] or "lr_decay_iters" in getattr(args, "given", ()) or \
                getattr(args, "rampup_batch_size", None) is not None:      # a ramp's schedule is in samples
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


def attention_line(cfg, ps, document_mask: bool = False, seq_length: int | None = None) -> str:
    """Which core attention runs (for SDPA: which kernel), whether each document attends only to itself
    (--reset-attention-mask, --sft), the sliding window (--window-size: which layers, whether it binds at
    `seq_length`) and whether sequence parallelism is on."""
    from zo_megatron.planner.window import describe_window, window_binds

    size, freq = getattr(cfg, "window_size", None), getattr(cfg, "window_attn_skip_freq", None)
    window = describe_window(size, freq, cfg.num_layers) if size is not None and any(cfg.window_layers()) else ""
    if window and seq_length is not None and not window_binds(size, seq_length):
        window, note = "", f", {describe_window(size, freq, cfg.num_layers)}: no mask, it does not bind at " \
                           f"--seq-length {seq_length} (full attention)"
    else:
        note = ""
    if cfg.attention_backend == "sdpa":
        from zo_megatron.model.attention import describe_kernel

        heads = cfg.num_attention_heads
        groups = getattr(cfg, "query_groups", heads)
        head_dim = getattr(cfg, "head_dim", cfg.hidden_size // heads)
        v_dim = None
        if getattr(cfg, "multi_latent_attention", False):     # MLA: its query/key and value head dims
            head_dim, v_dim = cfg.qk_head_dim + cfg.qk_pos_emb_head_dim, cfg.v_head_dim
        text = describe_kernel(heads, groups, head_dim, ps.tp_size, cfg.dtype, ps.device, cfg.attention_dropout,
                               v_head_dim=v_dim, document_mask=document_mask, window=window,
                               unmasked_layers=not document_mask and not all(cfg.window_layers()),
                               softmax_type=getattr(cfg, "softmax_type", "vanilla")) + note
    else:
        text = "megatron-core local DotProductAttention (s x s scores stored)" + \
            (", per-document mask" if document_mask else "") + \
            {"learnable": ", attention sinks", "off-by-one": ", off-by-one softmax"}.get(
                getattr(cfg, "softmax_type", "vanilla"), "")
    sp = cfg.sequence_parallel and ps.tp_size > 1
    return text + ("; sequence parallel over TP " + str(ps.tp_size) if sp else "; no sequence parallelism")


def pin_memory_warnings(args, ps) -> list[str]:
    """The banner's warning for --no-pin-memory where it costs time: ZeRO-Offload (the only path that
    copies to the host) on a CUDA device, where a copy from pageable memory blocks the host."""
    if args.no_pin_memory and args.zero_offload and ps.device.type == "cuda":
        return [" warning: --no-pin-memory on a CUDA device: host copies then block, so backward serialises "
                "behind every copy home (drop the flag unless pinning host memory fails)"]
    return []


def plan_warnings(args) -> list[str]:
    """The banner's warning when the pre-launch plan fits with less headroom than the planner's
    measured error (planner.PLAN_ERROR_MARGIN): the run may still not fit."""
    plan = getattr(args, "memory_plan", None)
    return [f" warning: memory plan {w}" for w in (plan.warnings if plan is not None else ())
            if w.startswith("near the edge")]


def moe_lines(args, cfg, ps) -> list[str]:
    """A mixture of experts: its experts, router, layout and engine (docs/moe.md; its memory is in the
    plan's lines, docs/memory_planner.md)."""
    if cfg.num_experts is None:
        return []
    engine = ("two engines: dense parameters over DP, experts over expert DP" if ps.experts_apart
              else "experts replicated over DP as dense parameters")
    aux = f"aux loss {cfg.moe_router_load_balancing_type} x {cfg.moe_aux_loss_coeff:g}" \
        + (f", z-loss x {cfg.moe_z_loss_coeff:g}" if cfg.moe_z_loss_coeff is not None else "")
    return [f" experts: {cfg.num_experts} per MoE layer ({sum(cfg.moe_layers())} of {cfg.num_layers} layers), top "
            f"{cfg.moe_router_topk}, {aux}, {cfg.moe_token_dispatcher_type} dispatcher; EP {ps.ep_size} x expert TP "
            f"{ps.etp_size} x expert DP {ps.edp_size} ({engine})"]


def noop_lines(args) -> list[str]:
    """The banner's line naming the Megatron-LM flags given that do nothing here (issue 35, item 9)."""
    from zo_megatron.training.megatron_flags import noops_given

    flags = noops_given(args)
    return [f" accepted as no-ops (nothing to do in this job; docs/megatron_compat.md says why for each): "
            f"{' '.join(flags)}"] if flags else []


def document_words(args) -> str:
    """How the samples' documents are kept apart, for the banner's data line."""
    if args.sft:
        per = ("consecutive .jsonl lines packed into each sample (--sft-pack-lines)" if args.sft_pack_lines else
               "one packed sample per .jsonl line")
        return (f"; supervised fine-tuning (--sft, prompt format {args.sft_tokenizer_prompt_format}): {per}, "
                "loss on the assistant's turns, each conversation attending to itself")
    words = [w for w, on in (("attention per document (--reset-attention-mask)", args.reset_attention_mask),
                             ("positions per document (--reset-position-ids)", args.reset_position_ids),
                             ("no loss after end-of-document tokens (--eod-mask-loss)", args.eod_mask_loss)) if on]
    return "; " + ", ".join(words) if words else ""


def banner(metrics, args, ps, cfg, optimizer, data_path, setup_s) -> None:
    """The run's opening lines: layout, precision and engine, model, attention, batch, data, memory."""
    total = cfg.num_parameters()
    local = sum(p.numel() for p in optimizer.model.parameters())
    acc = optimizer.accounting
    from_files = bool(args.data_path or getattr(args, "data_per_split", None))
    src = describe(data_path) if from_files else "embedded State of the Union corpus (233 addresses, public domain)"
    if args.mock_data:
        src = ("mock data (--mock-data: megatron-core's MockGPTDataset, documents of counting ids; "
               "for speed and memory, nothing to learn)")
    elif args.embedded_corpus:
        src += " (--embedded-corpus)"
    elif not from_files and not args.demo:   # a model shape was given but no data: say it loudly
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
           + (", device copy extrapolated by the last update (--dpu-corrector weight-prediction)"
              if args.dpu_weight_prediction else ", no corrector (--dpu-corrector none: the paper's schedule)")
           + f" ({args.threads_line} per rank)" if args.dpu else "")
        + ((f"; CPU step overlapped with backward (speculated per bucket, exact; {args.overlap_reason}; "
            f"{args.threads_line} per rank)" if args.overlap_cpu_step else f"; {args.overlap_reason}")
           if args.zero_offload and not args.dpu else ""),
        f" model: {cfg.architecture_name()} {cfg.num_layers} layers x {cfg.hidden_size} hidden x {cfg.num_attention_heads} heads, "
        f"seq {args.seq_length}, vocab {cfg.vocab_size} (padded {cfg.padded_vocab_size(ps.tp_size)}), "
        f"{total / 1e6:.1f}M params ({local / 1e6:.1f}M on this TP rank)"
        + value_sources(args, ("num_layers", "hidden_size", "num_attention_heads", "seq_length"),
                        getattr(args, "from_checkpoint_flags", ())),
        f" attention: {attention_line(cfg, ps, args.reset_attention_mask or args.sft, seq_length=args.seq_length)}",
        *moe_lines(args, cfg, ps),
        f" batch: global {args.global_batch_size} = micro {args.micro_batch_size} x DP {ps.dp_size} x accumulation "
        f"{args.grad_accum_steps}{batch_ramp_words(args, ps)}; {args.train_iters} iterations, lr {args.lr:g} {args.lr_decay_style} "
        f"(warmup {args.lr_warmup_iters}, min {args.min_lr:g})" + decoupled_words(args)
        + value_sources(args, ("micro_batch_size", "train_iters", "lr", "lr_decay_style", "lr_warmup_iters",
                               "min_lr")),
        f" data: {src}" + (f"; tokenizer: {args.tokenizer_type} {args.tokenizer_model}"
                           if args.tokenizer_type in ("HuggingFaceTokenizer", "Llama2Tokenizer") else "")
        + document_words(args),
        f" model states per rank: device {human_bytes(acc.device_model_state_bytes)}, host {human_bytes(acc.host_bytes)}"
        + (f"; planner: device {human_bytes(plan.device_bytes_per_gpu)}/rank, host {human_bytes(plan.host_bytes_per_node)}/node"
           if plan is not None else ""),
        *nvme_banner_lines(args, optimizer, ps.world_size),
        *pin_memory_warnings(args, ps),
        *plan_warnings(args),
        *noop_lines(args),
        *([f" {args.load_note}"] if getattr(args, "load_note", None) else []),
        f" set-up took {setup_s:.1f}s; {NOTICES}",
    ]
    for line in lines:
        metrics.print(line)
