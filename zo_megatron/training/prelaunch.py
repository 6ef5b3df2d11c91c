"""The pre-launch checks: everything that can fail on bad input, before any model or checkpoint
directory exists.

Order matters for users: the flags against the launcher (world size, TP, batch sizes, the LR
schedule, the backend) are checked before any process group starts; the checks that read files
(tokenizer, data, --save and its lock, free disk) or this node's memory (the planner's verdict)
run on every rank (a file can differ between nodes) inside `collectives.all_ranks_agree`, so a
failure on rank 3 is printed once, by rank 0, naming rank 3. A mistake costs seconds and leaves
nothing behind.

The memory plan here (`job_plan`) is the one `tools/estimate_memory.py`, `tools/find_max_model.py`
and `tools/gpu_proof.py` compute: the job's own flags through the planner's one builder.
"""
from __future__ import annotations

import os

import torch

from zo_megatron.errors import UserError
from zo_megatron.training.arguments import check_batch_sizes
from zo_megatron.training.metrics import human_bytes
from zo_megatron.training.nvme_flags import check_nvme_space
from zo_megatron.training.schedule import LRScheduler
from zo_megatron.training.user_report import auto_fraction_reason


def check_launch(args):
    """The flags against the launcher's world, before any process group: returns the launch
    environment (parallel.launch_env.LaunchEnv)."""
    from zo_megatron.parallel import validate_parallel_config
    from zo_megatron.parallel.launch_env import discover_launch_env
    from zo_megatron.training.megatron_compat import check_backend
    from zo_megatron.training.profiling import check_profile_args

    try:
        env = discover_launch_env()
    except ValueError as exc:           # an inconsistent launcher environment (RANK, WORLD_SIZE, ...)
        if isinstance(exc, UserError):
            raise
        err = UserError(f"the launcher's environment is inconsistent: {exc}; launch with torchrun, mpirun or "
                        "srun, or fix those variables")
        err.every_rank = True           # which process is rank 0 is exactly what is unknown here
        raise err from None
    validate_parallel_config(env.world_size, args.tensor_parallel, args.num_attention_heads, hidden_check(args),
                             args.expert_parallel, args.expert_tensor_parallel)
    check_batch_sizes(args, env.world_size // args.tensor_parallel)
    LRScheduler.from_args(args)                  # its one-line errors now, before any process group
    check_backend(args, torch.cuda.is_available())
    check_profile_args(args, env.world_size)
    return env


def hidden_check(args) -> int | None:
    """The hidden size the TP split is checked against: with --kv-channels the hidden size need not
    be heads x head_dim (Megatron-LM's rule), so none."""
    return args.hidden_size if args.kv_channels is None else None


def job_plan_input(args, env, dp: int, vocab_size: int, host_bytes: int | None = None,
                   device_bytes: int | None = None):
    """This run's PlanInput: its flags through the planner's one builder, and this machine
    (`host_bytes`: the host memory to plan for; None: what this node allows, memory_limit_bytes;
    `device_bytes`: plan for a GPU of that memory, as the job on CUDA would, without asking CUDA:
    tools/find_max_model.py --skip-run --device-memory on a CPU-only host; None: this machine's)."""
    from zo_megatron.parallel.launch_env import memory_limit_bytes
    from zo_megatron.planner import GiB, os_reserve_bytes, plan_input_from_flags
    from zo_megatron.planner.presets import CPU_LAUNCHER_OVERHEAD_BYTES, CPU_PROCESS_OVERHEAD_BYTES

    cuda = device_bytes is not None or torch.cuda.is_available()
    if cuda and device_bytes is None:
        device_bytes = torch.cuda.get_device_properties(0).total_memory
    host = memory_limit_bytes() if host_bytes is None else host_bytes
    return plan_input_from_flags(
        args, data_parallel=dp, vocab_size=vocab_size, gpu_memory_bytes=device_bytes if cuda else host,
        host_memory_bytes_per_node=host, gpus_per_node=env.local_world_size, device_is_host=not cuda,
        device_overhead_bytes=GiB if cuda else 0, host_reserve_bytes=os_reserve_bytes(host),
        host_overhead_bytes_per_rank=3 * GiB if cuda else CPU_PROCESS_OVERHEAD_BYTES,
        host_overhead_bytes_per_node=0 if cuda else CPU_LAUNCHER_OVERHEAD_BYTES)


def job_plan(args, env, dp: int, vocab_size: int, host_bytes: int | None = None, device_bytes: int | None = None):
    """The planner's verdict on this run exactly as the pre-launch check computes it (the CPU-step
    overlap default and --optimizer-offload-fraction auto resolved; `args` gets the fraction).
    tools/find_max_model.py searches with this very function (`device_bytes`: job_plan_input's)."""
    from zo_megatron.planner import plan, resolve_overlap

    inp = job_plan_input(args, env, dp, vocab_size, host_bytes, device_bytes)
    path = getattr(args, "optimizer_nvme_path", None)
    if path is not None and os.path.isdir(path):        # the overlap's auto share also fits the disk
        st = os.statvfs(path)
        inp = inp.replace(nvme_disk_free_bytes=st.f_bavail * st.f_frsize)
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
    """Refuse a run the planner says cannot fit the device or host memory this machine has (a mixture of
    experts too: the planner's MoE lines, docs/memory_planner.md, both engines' at EP > 1, whose
    defaults resolve as for a dense model)."""
    p = job_plan(args, env, dp, vocab_size)
    args.params_total = p.params_total
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


def check_inputs(args, env, dp):
    """Every check that reads files or this node's memory; returns (tokenizer, data path)."""
    from zo_megatron.data import build_tokenizer, validate_data_prefix
    from zo_megatron.training.data_flags import data_prefixes, data_source

    tokenizer = build_tokenizer(args.vocab_file, args.merge_file, allow_custom_vocab=args.allow_custom_vocab,
                                tokenizer_type=args.tokenizer_type, tokenizer_model=args.tokenizer_model,
                                vocab_size=args.vocab_size)
    args.model_vocab_size = model_vocab_size(args, tokenizer)
    data_path = data_source(args)
    if data_path and args.sft:
        from zo_megatron.data.sft import check_sft_source

        check_sft_source(data_path, tokenizer, args.sft_tokenizer_prompt_format)
    elif data_path:
        for prefix in data_prefixes(data_path):
            validate_data_prefix(prefix, tokenizer, "warn" if args.allow_other_tokenizer_data else "error")
    elif args.mock_data:
        data_path = None                        # megatron-core's MockGPTDataset (components.build_datasets)
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
    from zo_megatron.training.components import model_config

    model_config(args)          # the model's own rules (model/config.py), one line each, before the plan reads them
    memory_check(args, env, dp, args.model_vocab_size)
    check_nvme_space(args)
    if args.save:
        check_free_space(args.save, checkpoint_bytes(args.params_total, args.zero_offload,
                                                     args.exp_avg_dtype == "bf16"))
    return tokenizer, data_path


def model_vocab_size(args, tokenizer) -> int:
    """The model's vocabulary before padding: --vocab-size when given (Megatron-LM's flag; a
    checkpoint whose vocabulary is larger than its tokenizer, as Qwen2's is), else the tokenizer's.
    Every id the tokenizer makes must have a row, so a smaller --vocab-size is refused."""
    if args.vocab_size is None or tokenizer.tokenizer_type == "NullTokenizer":   # its --vocab-size N: N + 1
        return int(tokenizer.vocab_size)
    if args.vocab_size < tokenizer.vocab_size:
        raise UserError(f"--vocab-size {args.vocab_size} is smaller than the tokenizer's {tokenizer.vocab_size} "
                        f"tokens: use --vocab-size >= {tokenizer.vocab_size} (or drop it to use the tokenizer's size)")
    return int(args.vocab_size)


