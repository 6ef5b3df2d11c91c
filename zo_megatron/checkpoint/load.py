"""Loading a checkpoint into any TP x DP layout, after checking everything that can be wrong.

Order: (1) read `latest`, checkpoint.json and the DCP `.metadata` (allow-list unpickler) and
refuse, with one line naming the file, anything that does not fit this run -- another
architecture or vocabulary, the other optimizer engine, a missing or truncated file, a changed LR
schedule, --train-iters below the checkpoint's iteration -- before any tensor is touched;
(2) let DCP read this rank's boxes straight into the model / optimizer buffers (resharding is
DCP intersecting this layout's boxes with the saved ones); (3) restore counters and RNG streams.
Every rank runs the same checks on the same files, so all ranks refuse together.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
from dataclasses import dataclass

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from zo_megatron.checkpoint import content
from zo_megatron.checkpoint.layout import CARRIED_KEYS, MANIFEST, rng_file
from zo_megatron.checkpoint.planner import BoxLoadPlanner
from zo_megatron.checkpoint.safe_load import SafeFileSystemReader, first_line, read_dcp_metadata, read_json
from zo_megatron.checkpoint.verify import check_files, check_tensors, read_manifest
from zo_megatron.errors import UserError
from zo_megatron.model.config import complete_arch_meta
from zo_megatron.parallel.rng_state import restore_rng_state

# Megatron's OptimizerParamScheduler keys that must agree on resume (its _check_and_set), and the
# decoupled param group's max_lr/min_lr (Megatron keeps those in the optimizer's param groups;
# absent from checkpoints written before --decoupled-lr: None, no decoupled group).
SCHEDULER_KEYS = ("max_lr", "min_lr", "lr_warmup_steps", "lr_decay_steps", "lr_decay_style",
                  "decoupled_lr", "decoupled_min_lr")
_SCHEDULER_FLAGS = {"max_lr": "--lr", "min_lr": "--min-lr",
                    "lr_warmup_steps": "--lr-warmup-iters; in samples with --rampup-batch-size: --lr-warmup-samples",
                    "lr_decay_steps": "--lr-decay-iters (default: --train-iters); in samples with --rampup-batch-size: "
                                      "--lr-decay-samples (default: --train-samples)",
                    "lr_decay_style": "--lr-decay-style", "decoupled_lr": "--decoupled-lr",
                    "decoupled_min_lr": "--decoupled-min-lr"}


@dataclass
class LoadOptions:
    """Megatron's flags: what to take from the checkpoint."""

    no_load_optim: bool = False
    no_load_rng: bool = False
    finetune: bool = False                     # weights only, iteration 0
    override_opt_param_scheduler: bool = False
    use_checkpoint_opt_param_scheduler: bool = False
    train_iters: int | None = None
    step: int | None = None                    # --ckpt-step: this iteration instead of the latest
    # (saved schedule, this run's, checkpoint iteration) -> the fix to print, or None: the job's words
    # for the common case of a schedule mismatch (extending a finished run)
    schedule_hint: object = None
    iteration: int = 0                         # set by the loader: the checkpoint's iteration

    @property
    def weights_only(self) -> bool:
        return self.no_load_optim or self.finetune


@dataclass
class Resumed:
    path: str
    iteration: int
    consumed_samples: int
    consumed_valid_samples: int
    opt_param_scheduler: dict | None           # the schedule to train with (None: keep this run's)
    resharded_from: tuple[int, int] | None     # (TP, DP) of the checkpoint when it differs
    rng_restored: str                          # "exact", "shared streams" or "no"
    converted_from: str | None = None          # weights-only checkpoint from tools/convert_checkpoint.py
    resharded_ep: tuple[str, str] | None = None  # (the checkpoint's expert layout, this run's) when they differ


def _plain_diff(field: str, in_checkpoint, here) -> str:
    return f"{field}: {in_checkpoint!r} in the checkpoint, {here!r} here"


def _check_model(manifest: dict, model_meta: dict, where: str, tokenizer_vocab: int | None = None,
                 describe_diff=_plain_diff,
                 fix: str = "launch with the model flags the checkpoint was trained with") -> None:
    """One line naming every architecture field that differs, each as `describe_diff` words it
    (the job: '--num-layers: 2 in the checkpoint, 4 here'); a checkpoint from before the
    architecture fields reads as GPT-2's. The vocabulary has its own refusal (_refuse_vocabulary)."""
    saved = complete_arch_meta(manifest.get("model", {}), manifest.get("args", {}))   # older: GPT-2's fields
    if saved.get("vocab_size") != model_meta.get("vocab_size"):
        _refuse_vocabulary(manifest, int(saved["vocab_size"]), int(model_meta["vocab_size"]),
                           model_meta["vocab_size"] if tokenizer_vocab is None else tokenizer_vocab, where)
    # RoPE has no position table: such a model may continue at another context length (Megatron-LM
    # and HF extend Llama's context the same way; YaRN's frequencies depend on its original context,
    # not on this one); a learned table's size must match
    rope = saved.get("position_embedding_type") in ("rope", "yarn") and \
        saved.get("position_embedding_type") == model_meta.get("position_embedding_type")
    # a SwiGLU, quick-GeGLU or squared-ReLU model has no GELU: its recorded one says nothing when a side has none
    # (the activation's own field differs)
    no_gelu = any(m.get(k) for m in (saved, model_meta) for k in ("swiglu", "squared_relu", "quick_geglu"))
    diffs = [describe_diff(k, saved.get(k), v) for k, v in model_meta.items()
             if k != "vocab_size" and saved.get(k) != v and not (rope and k == "max_position_embeddings")
             and not (no_gelu and k == "gelu_approximate")]
    if diffs:
        raise UserError(f"{where}: this run's model differs from the checkpoint's ({'; '.join(diffs)}): {fix}")


def _refuse_vocabulary(manifest: dict, saved: int, model: int, tokenizer: int, where: str) -> None:
    """The checkpoint's vocabulary is not this run's model's. Its rows hold every id this run's
    tokenizer makes: the model needs --vocab-size (Megatron-LM's flag; a Qwen2 checkpoint has more
    rows than its tokenizer has tokens). Fewer rows: another tokenizer, named by the flags that
    choose the one the checkpoint was trained with."""
    if saved >= tokenizer:
        raise UserError(f"{where}: the checkpoint's vocabulary has {saved} tokens, this run's model {model} "
                        f"(its tokenizer has {tokenizer}): launch with --vocab-size {saved}")
    if manifest.get("tokenizer_files"):
        tok_dir = os.path.join(os.path.dirname(where), os.path.dirname(manifest["tokenizer_files"][0]))
        flags = f"--tokenizer-type HuggingFaceTokenizer --tokenizer-model {tok_dir}"
    elif manifest.get("tokenizer_type") == "HuggingFaceTokenizer":
        flags = "--tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR"
    else:
        flags = "--tokenizer-type GPT2BPETokenizer and its --vocab-file/--merge-file"
    raise UserError(f"{where}: the checkpoint's vocabulary has {saved} tokens, this run's tokenizer {tokenizer}: "
                    f"use the tokenizer it was trained with ({flags})")


def _check_scheduler(saved: dict | None, current: dict, opts: LoadOptions, where: str) -> dict | None:
    if opts.override_opt_param_scheduler or saved is None:
        return None
    if opts.use_checkpoint_opt_param_scheduler:
        return {k: saved.get(k) for k in SCHEDULER_KEYS}
    diffs = [f"{k} {saved.get(k)!r} in the checkpoint, {current[k]!r} here ({_SCHEDULER_FLAGS[k]})"
             for k in SCHEDULER_KEYS if saved.get(k) != current.get(k)]
    hint = opts.schedule_hint(saved, current, opts.iteration) if diffs and opts.schedule_hint else None
    if hint:
        raise UserError(f"{where}: {hint}")
    if diffs:
        raise UserError(f"{where}: the learning-rate schedule differs from the checkpoint's ({'; '.join(diffs)}): "
                        "pass --override-opt_param-scheduler to use this run's, or "
                        "--use-checkpoint-opt_param-scheduler to keep the checkpoint's")
    return None


def load_checkpoint(root: str, *, ps, model, optimizer, vocab_size: int, model_meta: dict, schedule: dict,
                    opts: LoadOptions, agree=contextlib.nullcontext, tokenizer_vocab: int | None = None,
                    describe_diff=_plain_diff,
                    model_fix: str = "launch with the model flags the checkpoint was trained with") -> Resumed:
    """Validate, then restore model (+ optimizer, RNG, counters) from root's latest checkpoint.
    vocab_size: the model's vocabulary before padding; tokenizer_vocab: this run's tokenizer's
    size (default: vocab_size), which chooses the fix a vocabulary mismatch names."""
    # The checks read only files (no collectives): under `agree` (collectives.all_ranks_agree in
    # the job) a problem one rank finds is reported, with its rank, by every rank.
    with agree():
        d, manifest = read_manifest(root, opts.step)
        where = os.path.join(d, MANIFEST)
        _check_model(manifest, model_meta, where, tokenizer_vocab, describe_diff, model_fix)
        converted_from = manifest.get("converted_from") if manifest.get("weights_only") else None
        if converted_from is not None:          # from-hf / from-megatron: weights and nothing else
            opts = dataclasses.replace(opts, finetune=True, no_load_rng=True)
        saved_kind = manifest.get("optimizer", {}).get("kind")
        here_kind = content.optimizer_kind(optimizer)
        if not opts.weights_only and saved_kind != here_kind:
            flag = "--zero-offload" if saved_kind == "zero_offload" else "no --zero-offload"
            raise UserError(f"{where}: written by the {saved_kind} optimizer, this run uses {here_kind}: launch with "
                            f"{flag}, or take the weights only with --no-load-optim")
        iteration = 0 if opts.finetune else int(manifest["iteration"])
        if opts.train_iters is not None and iteration > opts.train_iters:
            raise UserError(f"--train-iters {opts.train_iters} is below the checkpoint's iteration {iteration} ({d}): "
                            f"raise --train-iters above {iteration}, or use --finetune to start counting from 0")
        use_schedule = None
        if not opts.weights_only:
            use_schedule = _check_scheduler(manifest.get("opt_param_scheduler"), schedule,
                                            dataclasses.replace(opts, iteration=iteration), where)
        check_files(d, manifest, checksum_share=(ps.rank, ps.world_size))
        saved_layout = manifest["layout"]
        saved_tp, saved_dp = int(saved_layout["tensor_parallel"]), int(saved_layout["data_parallel"])
        # experts are keyed by their global index: another EP is a reshard as another DP (docs/moe.md)
        saved_ep, ep = int(saved_layout.get("expert_parallel", 1)), getattr(ps, "ep_size", 1)
        # and another expert TP as another TP ("EP2", "EP1 x expert TP1": an expert TP other than TP named)
        saved_experts = _experts_layout(saved_ep, saved_layout.get("expert_tensor_parallel"))
        experts = _experts_layout(ep, ps.etp_size if getattr(ps, "experts_apart", False)
                                  and ps.etp_size != ps.tp_size else None)
        same_layout = (saved_tp, saved_dp) == (ps.tp_size, ps.dp_size)
        load_rng = not (opts.no_load_rng or opts.finetune)
        rng_src = rng_file(ps.tp_rank, ps.dp_rank) if same_layout else \
            rng_file(ps.tp_rank if saved_tp == ps.tp_size else 0, 0)
        if load_rng and rng_src not in manifest["files"]:
            raise UserError(f"{os.path.join(d, rng_src)} is not part of the checkpoint: it is incomplete")
        rng_state = read_json(os.path.join(d, rng_src), "RNG state") if load_rng else None
        # An offline reshard to another TP size keeps only the streams shared by all TP ranks.
        tp_streams_valid = saved_tp == ps.tp_size and manifest.get("rng_model_parallel_streams", True)
        md = read_dcp_metadata(d)
        with_optim = not opts.weights_only
        pcs = content.pieces(model, optimizer, ps, vocab_size, saving=False, with_optimizer=with_optim)
        check_tensors(d, md, {p.key: p.shape for p in pcs})

    # -------- nothing was modified above this line; from here on, state is overwritten
    try:
        dcp.load({}, storage_reader=SafeFileSystemReader(d), planner=BoxLoadPlanner(pcs))
    except CheckpointException as exc:          # a BaseException, not an Exception
        failures = list(getattr(exc, "failures", {}).values())
        first = failures[0] if failures else exc
        raise UserError(f"{d}: reading the tensors failed ({type(first).__name__}: {first_line(first)}); "
                        "a data file is corrupt or was tampered with") from None
    opt_state = manifest["optimizer"]
    if with_optim:
        optimizer.step_count = int(opt_state["step"])
        if set(opt_state["loss_scaler"]) == set(optimizer.loss_scaler.state_dict()):
            optimizer.loss_scaler.load_state_dict(opt_state["loss_scaler"])
        if not optimizer.holds_master_weights:
            content.set_baseline_step(optimizer, optimizer.step_count)
    if optimizer.holds_master_weights:
        optimizer.reload_params_from_master()
    # what from-hf recorded goes on with the model: its saves keep it
    model.checkpoint_carried = {k: manifest[k] for k in CARRIED_KEYS if k in manifest}
    restored = "no"
    if rng_state is not None:
        try:
            restore_rng_state(rng_state, keep_model_parallel_stream=not tp_streams_valid)
        except (KeyError, TypeError, ValueError) as exc:
            raise UserError(f"{os.path.join(d, rng_src)}: not a valid RNG state ({first_line(exc)})") from None
        restored = "exact" if tp_streams_valid else "shared streams"
    return Resumed(
        path=d, iteration=iteration,
        consumed_samples=0 if opts.finetune else int(manifest.get("consumed_samples", 0)),
        consumed_valid_samples=0 if opts.finetune else int(manifest.get("consumed_valid_samples", 0)),
        opt_param_scheduler=use_schedule,
        resharded_from=None if same_layout or converted_from else (saved_tp, saved_dp), rng_restored=restored,
        converted_from=converted_from,
        resharded_ep=None if saved_experts == experts or converted_from else (saved_experts, experts))


def _experts_layout(ep: int, etp: int | None) -> str:
    """The experts' layout as the log names it: EP, and expert TP where it is not TP."""
    return f"EP{ep}" + (f" x expert TP{etp}" if etp is not None else "")
