"""What `--load DIR` finds, decided before anything reads it (Megatron-LM's semantics, issue 35).

Megatron-LM's launch scripts pass `--save X --load X` from the first launch on: with no
checkpoint under X, Megatron warns and starts from random weights, unless
`--exit-on-missing-checkpoint` is given. The job does the same. A DIR that holds something else
than a checkpoint root is not "missing" but a wrong target, answered with its fix (never "drop
--load", which would throw away the work DIR points to):

  DIR/latest_checkpointed_iteration.txt         a checkpoint root: resume (checkpoint/verify.py)
    ... naming a Megatron-LM iteration            (mp_rank_XX/ or torch_dist's metadata.json, no
                                                 checkpoint.json): convert it first
  DIR = ROOT/iter_0000070 (checkpoint.json)     one iteration: pass ROOT
  DIR/config.json with model_type/architectures a Hugging Face model: convert it first
  nothing, or DIR does not exist                 no checkpoint yet: start fresh, with a warning

`--pretrained-checkpoint P` (Megatron-LM's fine-tuning pair `--pretrained-checkpoint P --load X --save X`):
where --load holds no checkpoint yet (or is not given), the job loads P's instead, as --finetune (its
weights; iteration 0, a fresh optimizer), and says so; once X holds one, the job resumes X and P is not
read. P must be a checkpoint root (the same fixes as for --load where it is something else).
"""
from __future__ import annotations

import argparse
import json
import os
import re

from zo_megatron.checkpoint.layout import LATEST, MANIFEST, iter_dir
from zo_megatron.errors import UserError

_ITER_DIR = re.compile(r"iter_\d{7}")


def check_load_target(args) -> str | None:
    """Apply the rules above to args.load. Returns the banner's line when the job will start from
    random weights (args.load is then None) or fine-tune from --pretrained-checkpoint (args.load is then
    that directory, args.finetune True); raises UserError for a wrong target, or for a missing
    checkpoint with --exit-on-missing-checkpoint or --use-checkpoint-args."""
    pretrained = getattr(args, "pretrained_checkpoint", None)
    if pretrained and not (args.load and os.path.isfile(os.path.join(args.load, LATEST))):
        return _fine_tune_from(args, pretrained)
    d = args.load
    step = getattr(args, "ckpt_step", None)
    if step is not None and not d:
        raise UserError("--ckpt-step picks an iteration of --load's checkpoint: add --load DIR")
    if step is not None and step < 0:
        raise UserError(f"--ckpt-step {step}: an iteration number is >= 0")
    if d and os.path.isfile(os.path.join(d, LATEST)):
        _refuse_megatron_lm(d, step)
    if not d or os.path.isfile(os.path.join(d, LATEST)) or (step is not None and os.path.isdir(iter_dir(d, step))):
        return None
    norm = os.path.normpath(d)
    parent = os.path.dirname(norm) or "."
    if _ITER_DIR.fullmatch(os.path.basename(norm)) and (
            os.path.isfile(os.path.join(norm, MANIFEST)) or os.path.isfile(os.path.join(parent, LATEST))):
        raise UserError(f"--load {d}: that is one iteration of a checkpoint; pass its parent directory "
                        f"(--load {parent}), which resumes from the iteration its {LATEST} names")
    hf = _hf_model_type(d)
    if hf is not None:
        raise UserError(f"--load {d}: a Hugging Face model ({hf}), not a zo_megatron checkpoint; convert it: "
                        f"python tools/convert_checkpoint.py from-hf --input {d} --output CKPT --tensor-parallel N, "
                        f"then launch with --load CKPT --finetune and the flags it prints")
    why = "no such directory" if not os.path.exists(d) else f"no {LATEST} in it"
    if getattr(args, "exit_on_missing_checkpoint", False):
        raise UserError(f"--load {d}: no checkpoint there ({why}) and --exit-on-missing-checkpoint is given: "
                        "point --load at a checkpoint directory, or drop --exit-on-missing-checkpoint to start "
                        "from random weights")
    if getattr(args, "use_checkpoint_args", False):
        raise UserError(f"--use-checkpoint-args takes the model from --load's checkpoint, but --load {d} holds none "
                        f"({why}): give the model flags instead, or point --load at a checkpoint")
    args.load = None
    return (f"warning: --load {d}: no checkpoint there yet ({why}); starting from randomly initialised weights, "
            "as Megatron-LM does (--exit-on-missing-checkpoint stops instead)")


def _fine_tune_from(args, pretrained: str) -> str:
    """--load holds no checkpoint: load --pretrained-checkpoint's as --finetune (Megatron-LM's
    load_checkpoint); the line the banner prints. A pretrained directory that is no checkpoint root is
    refused with --load's fixes, or in one line of its own where it holds nothing."""
    given_load = args.load
    args.load = pretrained
    try:
        if check_load_target(argparse.Namespace(load=pretrained, ckpt_step=getattr(args, "ckpt_step", None))) is not None:
            raise UserError(f"--pretrained-checkpoint {pretrained}: no checkpoint there (no {LATEST}); point it at "
                            "the checkpoint to fine-tune from (tools/convert_checkpoint.py from-hf / from-megatron "
                            "writes one)")
    except UserError as exc:
        raise UserError(str(exc).replace(f"--load {pretrained}", f"--pretrained-checkpoint {pretrained}")) from None
    args.finetune = True
    where = f"--load {given_load} holds no checkpoint yet" if given_load else "no --load is given"
    return (f"{where}: fine-tuning from --pretrained-checkpoint {pretrained} (its weights; iteration 0, a fresh "
            "optimizer), as Megatron-LM; a later launch resumes --load's own checkpoint")


def _refuse_megatron_lm(d: str, step: int | None) -> None:
    """A Megatron-LM checkpoint root has the same tracker file as ours: name it and its conversion
    instead of reading it as an incomplete checkpoint of ours."""
    from zo_megatron.checkpoint import megatron_dist, megatron_lm

    try:
        it, _ = megatron_lm.find_iteration_dir(d, step)
        names = os.listdir(it)
    except (UserError, OSError):              # no such iteration, or unreadable: the load's own line says so
        return
    if MANIFEST in names:                     # ours
        return
    fmt = "torch_dist" if megatron_dist.is_torch_dist(it) else \
        "torch" if any(n.startswith("mp_rank_") for n in names) else None
    if fmt is not None:
        raise UserError(f"--load {d}: a Megatron-LM checkpoint ({fmt} format, {os.path.basename(it)}), not a "
                        f"zo_megatron one; convert it once: python tools/convert_checkpoint.py from-megatron --input "
                        f"{d} --output CKPT --tensor-parallel N, then launch with --load CKPT --finetune and the "
                        "model flags it prints")


def _hf_model_type(d: str) -> str | None:
    """The model_type (or architecture) of a Hugging Face model directory, None if d is not one."""
    path = os.path.join(d, "config.json")
    if not os.path.isfile(path):
        return None
    try:
        with open(path, "rb") as f:
            cfg = json.loads(f.read(1 << 20))
    except (OSError, ValueError):
        return None
    if not isinstance(cfg, dict):
        return None
    arch = cfg.get("architectures")
    if isinstance(arch, list) and arch and isinstance(arch[0], str):
        return arch[0]
    return cfg["model_type"] if isinstance(cfg.get("model_type"), str) else None


def resumed_precision(args) -> str | None:
    """The precision the checkpoint --load resumes from was trained in (its saved args), or None:
    no checkpoint, a --finetune (a new run), a checkpoint that does not record it (a conversion),
    or one that cannot be read here (the load itself then says what is wrong)."""
    if not args.load or getattr(args, "finetune", False):
        return None
    from zo_megatron.checkpoint.verify import read_manifest

    try:
        _, manifest = read_manifest(args.load, getattr(args, "ckpt_step", None))
    except (UserError, OSError, ValueError):
        return None
    saved = manifest.get("args") if isinstance(manifest, dict) else None
    precision = saved.get("precision") if isinstance(saved, dict) else None
    return precision if isinstance(precision, str) else None
