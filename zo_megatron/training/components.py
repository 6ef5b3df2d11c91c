"""The trainer's components, each built by one function from the job's arguments: threads,
metrics, the model's config, the datasets, the optimizer engine, the timeline.

A new feature plugs in here (a component, or an engine schedule chosen in `build_optimizer`),
not as a branch in the trainer's loop.
"""
from __future__ import annotations

import contextlib

import torch

from zo_megatron.parallel import collectives
from zo_megatron.training.model_flags import architecture_kwargs, moe_kwargs
from zo_megatron.training.metrics import Metrics


def set_threads(args, ps, adam_threads: int) -> None:
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


def build_metrics(args, ps) -> Metrics:
    """Console (rank 0), --log-jsonl, --tensorboard-dir, W&B; the run's header record first."""
    from zo_megatron.training.user_report import run_header

    metrics = Metrics(enabled=ps.rank == 0, total_iters=args.train_iters, jsonl_path=args.log_jsonl,
                      tensorboard_dir=args.tensorboard_dir, progress_bar=not args.no_progress_bar,
                      wandb=dict(project=args.wandb_project, name=args.wandb_exp_name, dir=args.wandb_save_dir,
                                 entity=args.wandb_entity,
                                 config=vars(args)) if args.wandb_project else None)
    metrics.header(run_header(args, ps))
    return metrics


def model_config(args):
    """The model's GPTConfig from the job's flags (the vocabulary as the pre-launch check resolved it)."""
    from zo_megatron.model import GPTConfig

    return GPTConfig(**architecture_kwargs(args), **moe_kwargs(args), vocab_size=args.model_vocab_size,
                     precision=args.precision,
                     hidden_dropout=args.hidden_dropout, attention_dropout=args.attention_dropout,
                     init_method_std=args.init_method_std, recompute=args.recompute_granularity,
                     recompute_modules=getattr(args, "recompute_modules", None),
                     recompute_method=args.recompute_method or "uniform",
                     recompute_num_layers=args.recompute_num_layers or 1,
                     attention_backend=args.core_attention, sequence_parallel=args.sequence_parallel,
                     moe_router_dtype=getattr(args, "moe_router_dtype", None),
                     moe_input_jitter_eps=getattr(args, "moe_input_jitter_eps", None),
                     moe_router_force_load_balancing=bool(getattr(args, "moe_router_force_load_balancing", False)),
                     calculate_per_token_loss=bool(getattr(args, "calculate_per_token_loss", False)),
                     moe_router_bias_update_rate=getattr(args, "moe_router_bias_update_rate", 1e-3))


def build_datasets(args, tokenizer, data_path, dp_size: int):
    """(train, validation) datasets sized for the whole run (a collective: megatron's index-cache barrier)."""
    from zo_megatron.data import build_gpt_datasets, build_mock_gpt_datasets
    from zo_megatron.training.batch_schedule import BatchSchedule

    check_index_cache_is_shared(args.data_cache_path)
    gb = args.global_batch_size
    n_evals = args.train_iters // args.eval_interval + 1
    # Megatron-LM's count (--train-samples, else iterations x global batch: megatron-core's GPTDataset draws
    # its epochs and shuffle from it), or more where a ramp's last iteration runs past it
    train_samples = max(args.train_samples or args.train_iters * gb,
                        BatchSchedule.from_args(args, dp_size).consumed_after(args.train_iters))
    valid_samples = n_evals * args.eval_iters * gb
    if args.sft:                                # .jsonl conversations (Megatron-LM's SFTDataset)
        from zo_megatron.data.sft import build_sft_datasets

        return build_sft_datasets(data_path, args.split, args.seq_length, args.seed, tokenizer,
                                  args.sft_tokenizer_prompt_format, train_samples, valid_samples, 0,
                                  cache_dir=args.data_cache_path, pack_lines=args.sft_pack_lines)[:2]
    if data_path is None:                       # --mock-data (args.split: Megatron-LM's default)
        train_ds, valid_ds, _ = build_mock_gpt_datasets(
            args.split, args.seq_length, args.seed, tokenizer, train_samples=train_samples,
            valid_samples=valid_samples, cache_dir=args.data_cache_path, **_document_flags(args))
        return train_ds, valid_ds
    train_ds, valid_ds, _ = build_gpt_datasets(
        data_path, args.split, args.seq_length, args.seed, tokenizer,
        train_samples=train_samples, valid_samples=valid_samples,
        test_samples=0, cache_dir=args.data_cache_path,
        other_tokenizer="accept" if args.allow_other_tokenizer_data else "error",   # checked before launch
        **_document_flags(args))
    return train_ds, valid_ds


def _document_flags(args) -> dict:
    """The GPT datasets' Megatron-LM document flags, as the job gives them."""
    return dict(eod_mask_loss=args.eod_mask_loss, reset_position_ids=args.reset_position_ids,
                reset_attention_mask=args.reset_attention_mask)


def build_test_dataset(args, tokenizer, data_path):
    """The test data of a run given data per split (--test-data-path): --eval-iters global batches, which
    the run evaluates once at its end (Megatron-LM's "on test set"); None otherwise (a --split blend's test
    share is not evaluated). A collective, as build_datasets."""
    from zo_megatron.data import build_gpt_datasets

    if not isinstance(data_path, dict) or not data_path.get("test") or args.eval_iters < 1:
        return None
    only_test = {"train": None, "valid": None, "test": data_path["test"]}
    if args.sft:
        from zo_megatron.data.sft import build_sft_datasets

        return build_sft_datasets(only_test, None, args.seq_length, args.seed, tokenizer,
                                  args.sft_tokenizer_prompt_format, 0, 0, args.eval_iters * args.global_batch_size,
                                  cache_dir=args.data_cache_path, pack_lines=args.sft_pack_lines)[2]
    return build_gpt_datasets(
        only_test, None, args.seq_length, args.seed, tokenizer,
        train_samples=0, valid_samples=0, test_samples=args.eval_iters * args.global_batch_size,
        cache_dir=args.data_cache_path, other_tokenizer="accept" if args.allow_other_tokenizer_data else "error",
        **_document_flags(args))[2]


def check_index_cache_is_shared(cache_dir: str | None) -> None:
    """megatron-core builds the datasets' indices on global rank 0 into the index cache and every other
    rank reads them from there after its barrier. A directory that is not the same for every rank (a
    node-local path in a multi-node job) made the ranks that miss the files fail inside megatron-core
    ("MockGPTDataset failed to build", a traceback) and the others lose them. Rank 0 writes a probe
    file there, every rank looks for it: the ranks that neither see it nor hold index files of their
    own (a copy made beforehand, which megatron-core reads as a cache hit) are named in one line. A
    cache rank 0 cannot write to (a read-only mount of a built cache) is not probed."""
    import glob
    import os
    import secrets

    from zo_megatron.data.datasets import index_cache_dir
    from zo_megatron.data.errors import DataError

    if collectives.group_size() == 1:
        return
    rank, token = collectives.group_rank(), torch.zeros(1, dtype=torch.int64)
    with collectives.all_ranks_agree():             # a directory that cannot be made fails on its rank: every rank's
        try:
            cache = index_cache_dir(cache_dir)
        except OSError as exc:
            raise DataError(f"the dataset index cache {cache_dir or '($ZO_MEGATRON_CACHE/gpt_indices)'} cannot be "
                            f"created ({exc.strerror or exc}): use a writable --data-cache-path") from None
    if rank == 0:
        with contextlib.suppress(OSError):          # read-only: token 0, nothing to look for
            name = secrets.randbits(62) + 1
            open(os.path.join(cache, f".shared-probe-{name}"), "w").close()
            token[0] = name
    collectives.all_reduce(token)                   # rank 0's token, once its probe is written
    if not token.item():
        return
    probe = os.path.join(cache, f".shared-probe-{int(token[0])}")
    own_copy = glob.glob(os.path.join(cache, "*Dataset-*-document_index.npy"))
    status = 1 if os.path.exists(probe) else 2 if own_copy else 0
    seen = collectives.all_gather_list(torch.tensor([status], dtype=torch.uint8), None)
    if rank == 0:                                   # every rank has looked
        with contextlib.suppress(OSError):
            os.remove(probe)
    missing = [r for r, s in enumerate(seen) if s.item() == 0]
    if missing:
        where = f"--data-cache-path {cache}" if cache_dir else \
            f"the index cache {cache} (default: $ZO_MEGATRON_CACHE/gpt_indices; --data-cache-path sets it)"
        ranks = ", ".join(map(str, missing[:8])) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise DataError(f"{where} is not one directory for every rank: rank{'s' if len(missing) > 1 else ''} "
                        f"{ranks} do{'es' if len(missing) == 1 else ''} not see the file rank 0 wrote there (a "
                        f"node-local disk?). megatron-core builds the dataset indices on rank 0 and every rank reads "
                        f"them there, as in Megatron-LM: use a directory on a file system every node mounts (or copy "
                        f"a built cache to every node first)")


def build_optimizer(args, model, ps):
    """The optimizer engine: ZeRO-Offload (with the CPU step's schedule its flags choose) or the plain
    DDP + AdamW baseline; both implement optimizer_api.TrainingOptimizer."""
    from zo_megatron.offload.engine import AdamConfig, ZeroOffloadEngine
    from zo_megatron.offload.loss_scaler import ConstantLossScaler, DynamicLossScaler
    from zo_megatron.training.nvme_flags import nvme_config
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
    if not args.zero_offload:
        return PlainDDPOptimizer(model.to(ps.device), **common)
    engine = dict(bucket_size=args.bucket_size, pin_memory=not args.no_pin_memory,
                  device=ps.device, grad_reduce_in_fp32=args.accumulate_allreduce_grads_in_fp32,
                  host_grad_dtype=args.main_grads_dtype,
                  accumulate_on_host=args.accumulate_grads_on_host and args.grad_accum_steps > 1,
                  dpu_warmup_steps=args.dpu_warmup_steps if args.dpu else None,
                  dpu_weight_prediction=args.dpu_weight_prediction,
                  optimizer_offload_fraction=args.optimizer_offload_fraction,
                  overlap_cpu_step=args.overlap_cpu_step,
                  overlap_speculated_fraction=args.overlap_speculated_fraction,
                  nvme=nvme_config(args), **common)
    if ps.experts_apart:        # experts replicated over expert DP, not DP: two engines (docs/moe.md)
        from zo_megatron.offload.expert_parallel import ExpertParallelEngine

        return ExpertParallelEngine(model, edp_group=ps.edp_group, dp_size=ps.dp_size,
                                    expert_tp=(ps.etp_rank, ps.etp_group), **engine)
    return ZeroOffloadEngine(model, **engine)   # at EP 1 experts are replicated over DP as dense parameters


def build_moe_losses(args, cfg, ps, model):
    """A mixture of experts' aux losses and tokens per expert: the losses' gradient scale and their log
    (training/moe_losses.py); None for a dense model."""
    from zo_megatron.training.moe_losses import MoELosses

    return MoELosses(cfg, ps, model, per_layer=getattr(args, "moe_per_layer_logging", False)) \
        if cfg.num_experts is not None else None


def build_expert_bias(cfg, model):
    """--moe-router-enable-expert-bias's per-iteration bias update (training/expert_bias.py), or None."""
    from zo_megatron.training.expert_bias import ExpertBias

    return ExpertBias(model, cfg.moe_router_bias_update_rate) if cfg.moe_router_enable_expert_bias else None


def build_timeline(args, ps):
    """--timeline's per-phase trace (training/timeline.py), or None."""
    from zo_megatron.training.timeline import Timeline

    return Timeline(args.timeline, ps.rank, ps.world_size, ps.device) if args.timeline else None


def flops_per_token(args, cfg, ps) -> float:
    """The model's FLOPs per token for the log's TFLOP/s (recomputed layers counted twice)."""
    from zo_megatron.training.metrics import model_flops_per_token

    recomputed = 0
    if cfg.recompute == "full":             # block N: only the first N layers run forward twice
        recomputed = (min(cfg.recompute_num_layers, cfg.num_layers) if cfg.recompute_method == "block"
                      else cfg.num_layers)
    return model_flops_per_token(cfg, args.seq_length, cfg.padded_vocab_size(ps.tp_size),
                                 args.recompute_granularity, recomputed_layers=recomputed)
