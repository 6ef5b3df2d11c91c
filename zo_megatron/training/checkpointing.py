"""The trainer's checkpoint component: one job per --save directory (its lock), saving at
--save-interval / the end / an exit or stop, and --load (docs/checkpoints.md).

A save never loses the previous checkpoint: a failed write leaves it intact and latest, and the
job stops with one line saying so (faults.SaveFailed). A saved checkpoint holds no pending
(delayed or speculated) update, so a resume is exact.
"""
from __future__ import annotations

import os
import time

from zo_megatron.parallel import collectives
from zo_megatron.training import faults
from zo_megatron.training.metrics import proc_memory_bytes
from zo_megatron.training.user_report import extend_hint


def schedule_state(args, iteration: int) -> dict:
    """The LR schedule as Megatron's OptimizerParamScheduler saves it (checked on resume), with the
    decoupled group's peak and floor (None without --decoupled-lr, which --decoupled-min-lr needs)."""
    from zo_megatron.training.schedule import LRScheduler

    decoupled = getattr(args, "decoupled_lr", None)
    warmup, decay = args.lr_warmup_iters, args.lr_decay_iters
    if getattr(args, "rampup_batch_size", None) is not None:    # a ramp's iterations differ: in samples, as
        s = LRScheduler.from_args(args)                          # Megatron-LM's scheduler counts them
        warmup, decay = s.lr_warmup_steps, s.lr_decay_steps
    return {"max_lr": args.lr, "min_lr": args.min_lr, "lr_warmup_steps": warmup,
            "lr_decay_steps": decay, "lr_decay_style": args.lr_decay_style,
            "decoupled_lr": decoupled,
            "decoupled_min_lr": None if decoupled is None else getattr(args, "decoupled_min_lr", None),
            "num_steps": iteration}


class Checkpointer:
    """Built first (the --save lock is taken before anything is built), then `attach`ed to the model."""

    def __init__(self, args, ps, metrics, inject, stack):
        self.args, self.ps, self.metrics, self.inject = args, ps, metrics, inject
        self.saved_at: int | None = None         # the iteration this run last saved
        if args.save:                            # one job per save directory (checkpoint/lock.py)
            from zo_megatron.checkpoint.lock import SaveLock

            with collectives.all_ranks_agree():
                lock = SaveLock(args.save, args.force_save_lock) if ps.rank == 0 else None
            if lock is not None:
                stack.callback(lambda: lock.release(wrote_checkpoint=self.saved_at is not None))
            if getattr(args, "save_lock_note", None):
                metrics.print(f" {args.save_lock_note}")

    def attach(self, model, optimizer, vocab_size: int, model_meta: dict, tokenizer) -> None:
        self.model, self.optimizer, self.tokenizer = model, optimizer, tokenizer
        self.vocab_size, self.model_meta = vocab_size, model_meta

    def due(self, iteration: int) -> bool:
        """--save-interval or the last iteration (an exit or a stop saves through `save` directly)."""
        a = self.args
        return bool(a.save) and ((a.save_interval and iteration % a.save_interval == 0)
                                 or iteration == a.train_iters)

    def save(self, iteration: int, consumed: int, consumed_valid: int) -> None:
        from zo_megatron.checkpoint import save_checkpoint

        args = self.args
        with collectives.all_ranks_agree():   # (a disk error of one rank's optimizer states: every rank's)
            self.optimizer.flush()          # a checkpoint holds no pending update: resume is exact
        t_save = time.monotonic()
        mem_before_save = proc_memory_bytes()
        try:
            with self.inject.saving(iteration):
                path = save_checkpoint(
                    args.save, iteration, ps=self.ps, model=self.model, optimizer=self.optimizer,
                    vocab_size=self.vocab_size,
                    train_state=dict(consumed_samples=consumed, consumed_valid_samples=consumed_valid,
                                     opt_param_scheduler=schedule_state(args, iteration)),
                    model_meta=self.model_meta, args=vars(args), keep_last=args.keep_last, tokenizer=self.tokenizer)
        except (OSError, RuntimeError) as exc:
            if isinstance(exc, RuntimeError) and not str(exc).startswith("saving "):
                raise                          # not the save's own failure (e.g. a lost peer)
            prev = f"iteration {self.saved_at}" if self.saved_at is not None else "the one --load started from, if any"
            # DCP reports a failed write to every rank: then rank 0 alone says it
            everywhere = isinstance(exc, RuntimeError)
            raise faults.SaveFailed(everywhere,
                f"saving the checkpoint of iteration {iteration} to {args.save} failed "
                f"({str(exc).strip().splitlines()[0][:300]}); the previous checkpoint ({prev}) is intact "
                f"and stays latest: free space or fix the directory, then resume with --load {args.save}") \
                from None
        self.saved_at = iteration
        self.metrics.log_save(iteration, path, time.monotonic() - t_save, mem_before_save, proc_memory_bytes())

    def resume(self) -> tuple[int, int, int]:
        """--load: restore the checkpoint into the attached model and optimizer; returns (iteration,
        consumed training samples, consumed validation samples)."""
        from zo_megatron.checkpoint import LoadOptions, load_checkpoint
        from zo_megatron.training.arguments import build_parser, origin
        from zo_megatron.training.checkpoint_args import describe_diff

        args, ps, metrics = self.args, self.ps, self.metrics
        parser = build_parser()
        fix = ("launch with the model flags the checkpoint was trained with, or add --use-checkpoint-args to take "
               "them from it") if not args.use_checkpoint_args else "launch with the checkpoint's model flags"
        t0 = time.monotonic()
        res = load_checkpoint(
            args.load, ps=ps, model=self.model, optimizer=self.optimizer, vocab_size=self.vocab_size,
            model_meta=self.model_meta, tokenizer_vocab=self.tokenizer.vocab_size,
            describe_diff=lambda k, ck, here: describe_diff(parser, k, ck, here, origin(args, k)), model_fix=fix,
            schedule=schedule_state(args, 0), opts=LoadOptions(
                no_load_optim=args.no_load_optim, no_load_rng=args.no_load_rng, finetune=args.finetune,
                override_opt_param_scheduler=args.override_opt_param_scheduler,
                use_checkpoint_opt_param_scheduler=args.use_checkpoint_opt_param_scheduler,
                train_iters=args.train_iters, schedule_hint=extend_hint(args), step=args.ckpt_step),
            agree=collectives.all_ranks_agree)
        if res.opt_param_scheduler is not None:             # --use-checkpoint-opt_param-scheduler
            s = res.opt_param_scheduler
            args.lr, args.min_lr, args.lr_decay_style = s["max_lr"], s["min_lr"], s["lr_decay_style"]
            if getattr(args, "rampup_batch_size", None) is not None:       # saved in samples (schedule_state)
                args.lr_warmup_samples, args.lr_decay_samples = s["lr_warmup_steps"], s["lr_decay_steps"]
                args.lr_warmup_fraction = None
            else:
                args.lr_warmup_iters, args.lr_decay_iters = s["lr_warmup_steps"], s["lr_decay_steps"]
            args.decoupled_lr, args.decoupled_min_lr = s.get("decoupled_lr"), s.get("decoupled_min_lr")
        if res.resharded_from is not None:
            metrics.print(f" resharded from TP{res.resharded_from[0]} x DP{res.resharded_from[1]} to "
                          f"TP{ps.tp_size} x DP{ps.dp_size} (RNG: {res.rng_restored})")
        if res.resharded_ep is not None:
            metrics.print(f" resharded the experts from {res.resharded_ep[0]} to {res.resharded_ep[1]}")
        if res.converted_from is not None:
            metrics.print(f" loaded weights only from {res.path} (converted from {res.converted_from}): fresh "
                          f"optimizer state, iteration 0, in {time.monotonic() - t0:.2f}s")
        else:
            metrics.print(f" resumed from {res.path} at iteration {res.iteration} ({res.consumed_samples} samples "
                          f"consumed) in {time.monotonic() - t0:.2f}s")
            self._say_run_changes(res.path)
        return res.iteration, res.consumed_samples, res.consumed_valid_samples

    def _say_run_changes(self, path: str) -> None:
        """One line per setting this run changes against the run that saved (checkpoint_args.run_changes)."""
        from zo_megatron.checkpoint.layout import MANIFEST
        from zo_megatron.checkpoint.safe_load import read_json
        from zo_megatron.training.checkpoint_args import run_changes

        saved = read_json(os.path.join(path, MANIFEST), "checkpoint manifest").get("args") or {}
        for line in run_changes(saved, self.args):
            self.metrics.print(line)
