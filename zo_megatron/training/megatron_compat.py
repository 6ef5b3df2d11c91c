"""Megatron-LM flags users bring in their scripts: implemented, accepted where they already describe
what this job does, or refused with one line that says why and what to use instead.

docs/megatron_compat.md has the table; tests/test_megatron_compat.py parses that table and checks
every row against this module, so the two cannot drift apart.
"""
from __future__ import annotations

import argparse

from zo_megatron.errors import ConfigError
from zo_megatron.training.megatron_flags import refused_given

# Refused outright: flag -> (why, what to use instead). The message is "<flag>: <why>; <instead>".
REFUSED = {
}


def add_megatron_compat_flags(p: argparse.ArgumentParser) -> None:
    S = argparse.SUPPRESS
    g = p.add_argument_group("Megatron-LM compatibility (docs/megatron_compat.md)")
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1,
                   help="only 1: pipeline parallelism is not supported (use --tensor-model-parallel-size)")
    g.add_argument("--train-samples", type=int, default=None,
                   help="train for this many samples: --train-iters = samples // global batch (Megatron's)")
    g.add_argument("--exit-interval", type=int, default=None,
                   help="stop (saving a checkpoint if --save) after an iteration that is a multiple of this")
    g.add_argument("--exit-duration-in-mins", type=float, default=None,
                   help="stop (saving a checkpoint if --save) once the job has run this many minutes")
    g.add_argument("--pretrained-checkpoint", default=None, metavar="DIR",
                   help="where --load holds no checkpoint yet, fine-tune from DIR's (--finetune); once it holds one, resume it")
    g.add_argument("--skip-train", action="store_true",
                   help="train nothing: evaluate --load's model on --eval-iters global batches of the validation data "
                        "(and of --test-data-path's) and exit, without loading the optimizer (Megatron-LM's)")
    g.add_argument("--mock-data", action="store_true",
                   help="Megatron-LM's mock data: megatron-core's MockGPTDataset (documents of counting ids, "
                        "random lengths; for speed and memory runs, nothing to learn), no --data-path")
    g.add_argument("--embedded-corpus", action="store_true",
                   help="train on the embedded State of the Union corpus, tokenized with the run's tokenizer "
                        "(what a run without --data-path does; this flag says it is intended: no banner warning)")
    g.add_argument("--log-throughput", action="store_true", help="no-op: tokens/s and TFLOP/s are always logged")
    g.add_argument("--distributed-backend", choices=["nccl", "gloo"], default=None,
                   help="nccl on GPUs, gloo on CPUs (the only pairs supported; default: by device)")
    g.add_argument("--use-distributed-optimizer", action="store_true",
                   help="no-op: with --zero-offload the optimizer state is partitioned over DP already; without "
                        "it the plain optimizer keeps whole replicas (same updates)")
    g.add_argument("--transformer-impl", choices=["local", "transformer_engine"], default="local",
                   help="only local (megatron-core's own layers)")
    g.add_argument("--ckpt-format", choices=["torch", "torch_dist", "zarr"], default="torch_dist",
                   help="only torch_dist: checkpoints are torch.distributed.checkpoint directories (docs/checkpoints.md)")
    g.add_argument("--recompute-method", choices=["uniform", "block"], default=None,
                   help="with --recompute-granularity full: uniform (checkpoints of --recompute-num-layers layers "
                   "each; default) or block (only the first --recompute-num-layers layers are recomputed)")
    g.add_argument("--recompute-num-layers", type=int, default=None,
                   help="with --recompute-granularity full: layers per checkpoint (uniform) or layers recomputed "
                   "(block); default 1")
    g.add_argument("--profile", action="store_true",
                   help="record iterations --profile-step-start+1 .. --profile-step-end with torch.profiler, one "
                        "Chrome trace per rank of --profile-ranks, into --tensorboard-dir (else --save/profile, "
                        "else ./profile) (training/profiling.py)")
    g.add_argument("--profile-step-start", type=int, default=10, help="with --profile: completed iterations "
                   "before the trace starts (Megatron's default 10)")
    g.add_argument("--profile-step-end", type=int, default=12, help="with --profile: completed iterations when "
                   "it stops (Megatron's default 12)")
    g.add_argument("--profile-ranks", type=int, nargs="+", default=[0], help="with --profile: the global ranks "
                   "that record (Megatron's default: 0)")
    g.add_argument("--wandb-project", default=None,
                   help="log to Weights & Biases (needs wandb; WANDB_MODE=offline is honoured)")
    g.add_argument("--wandb-exp-name", default=None, help="W&B run name")
    g.add_argument("--wandb-entity", default=None, help="W&B team or user the run is logged under (default: wandb's)")
    g.add_argument("--wandb-save-dir", default=None, help="W&B local directory")
    for flag in REFUSED:
        g.add_argument(flag, action="store_true", help=S)


def check_megatron_compat(args: argparse.Namespace, also: list[str] = ()) -> None:
    """Every refused flag or value of the command line in ONE line, with `also` (the values out of
    range: arguments.range_problems), so a launch script learns all it must change at once; then
    the consistency checks one line each; called from arguments.finalize."""
    refused = [f"{flag}: {why}; {instead}" for flag, (why, instead) in REFUSED.items()
               if getattr(args, flag[2:].replace("-", "_"))]
    if getattr(args, "context_parallel_size", 1) != 1:       # 1 (Megatron's default) is accepted
        refused.append(f"--context-parallel-size {args.context_parallel_size}: context parallelism is not "
                       "supported; for long sequences use --recompute-granularity full, --use-flash-attn and "
                       "--sequence-parallel")
    if args.pipeline_model_parallel_size != 1:
        refused.append(f"--pipeline-model-parallel-size {args.pipeline_model_parallel_size}: pipeline parallelism "
                       "is not supported; use --tensor-model-parallel-size (and ZeRO-Offload for memory)")
    if args.transformer_impl != "local":
        refused.append("--transformer-impl transformer_engine: Transformer Engine is not used; "
                       "use --transformer-impl local (the default)")
    if args.ckpt_format != "torch_dist":
        refused.append(f"--ckpt-format {args.ckpt_format}: checkpoints are torch.distributed.checkpoint "
                       "directories (Megatron's torch_dist); use --ckpt-format torch_dist (the default)")
    refused += [f"{r}; drop it" for r in refused_given(args)]
    if refused or also:
        counts = [f"{len(refused)} flag{'s' * (len(refused) != 1)} refused"] if len(refused) > 1 or (refused and also) \
            else []
        counts += [f"{len(also)} value{'s' * (len(also) != 1)} out of range"] if len(also) > 1 or (also and refused) \
            else []
        raise ConfigError(" | ".join([*refused, *also]) + (f" ({', '.join(counts)})" if counts else ""))
    if args.recompute_method is not None or args.recompute_num_layers is not None:
        if args.recompute_granularity != "full":
            flag = "--recompute-method" if args.recompute_method is not None else "--recompute-num-layers"
            raise ConfigError(f"{flag} applies to --recompute-granularity full (megatron's rule): add it")
        if args.recompute_num_layers is not None and args.num_layers is not None and \
                args.recompute_num_layers > args.num_layers:
            raise ConfigError(f"--recompute-num-layers {args.recompute_num_layers} exceeds --num-layers "
                              f"{args.num_layers}: use at most {args.num_layers}")
        if (args.recompute_method or "uniform") == "uniform" and args.recompute_num_layers and \
                args.num_layers is not None and args.num_layers % args.recompute_num_layers:
            raise ConfigError(f"--recompute-num-layers {args.recompute_num_layers} does not divide --num-layers "
                              f"{args.num_layers} (megatron-core's uniform method checkpoints whole groups): "
                              "use a divisor, or --recompute-method block")
    if args.skip_train:
        if args.eval_iters < 1:
            raise ConfigError(f"--skip-train only evaluates, and --eval-iters {args.eval_iters} evaluates nothing: "
                              "give --eval-iters N (global batches)")
        args.no_load_optim = True           # Megatron-LM's: an evaluation needs no optimizer state
    for name in ("exit_interval", "recompute_num_layers", "train_samples"):
        v = getattr(args, name)
        if v is not None and v < 1:
            raise ConfigError(f"--{name.replace('_', '-')} {v} is out of range: it must be >= 1")
    if args.exit_duration_in_mins is not None and not args.exit_duration_in_mins > 0:
        raise ConfigError(f"--exit-duration-in-mins {args.exit_duration_in_mins} is out of range: it must be > 0")
    files = args.data_path or args.data_args_path or args.per_split_data_args_path or \
        any(getattr(args, f"{s}_data_path") is not None for s in ("train", "valid", "test"))
    if args.tokenizer_type == "NullTokenizer" and not (files or args.mock_data):
        raise ConfigError("--tokenizer-type NullTokenizer reads ids, not text, so it cannot tokenize the embedded "
                          "corpus: add --mock-data, or --data-path PREFIX of data that is ids already")


def check_backend(args: argparse.Namespace, cuda: bool) -> None:
    """--distributed-backend must match the device: the process groups carry nccl for CUDA tensors
    and gloo for CPU tensors (parallel/collectives.py)."""
    want = "nccl" if cuda else "gloo"
    if args.distributed_backend not in (None, want):
        raise ConfigError(f"--distributed-backend {args.distributed_backend} on a {'GPU' if cuda else 'CPU'} "
                          f"machine: use --distributed-backend {want} (or leave it out)")


def should_exit(args: argparse.Namespace, iteration: int, elapsed_s: float) -> str | None:
    """Megatron's early exits: the reason to stop after `iteration`, or None."""
    if args.exit_interval and iteration % args.exit_interval == 0:
        return f"--exit-interval {args.exit_interval}"
    if args.exit_duration_in_mins is not None and elapsed_s / 60 > args.exit_duration_in_mins:
        return f"--exit-duration-in-mins {args.exit_duration_in_mins:g}"
    return None
