"""--use-checkpoint-args (Megatron-LM's flag): the model comes from --load's checkpoint.

Megatron's `load_args_from_checkpoint` copies the architecture (forced) and the tokenizer, sequence
length and vocabulary padding (when not given) from the checkpoint's saved arguments before its
arguments are validated. Here the architecture is the checkpoint manifest's "model" dict (the
GPTConfig fields the model was built with, whatever fields it holds), the rest its "args". One
difference, on purpose: a flag given on the command line that disagrees with the checkpoint is an
error naming every such flag with both values (Megatron silently overrides some and keeps others),
and the tensor-parallel size stays the command line's (checkpoints here reshard on load).

The field -> flag mapping is read off the parser (the action whose dest is the field), so new
architecture fields work without a table here: `add_bias_linear` is shown as
`--disable-bias-linear` (a store_false flag, value inverted), `layernorm_epsilon` as
`--norm-epsilon`.
"""
from __future__ import annotations

import argparse
import os

from zo_megatron.data.tokenizer import CHECKPOINT_TOKENIZER_DIR
from zo_megatron.errors import ConfigError
from zo_megatron.model.config import complete_arch_meta, megatron_gelu

# Taken from the checkpoint's saved arguments when the command line does not give them
# (Megatron's non-forced _set_arg: tokenizer, sequence length, vocabulary padding).
TOKENIZER_FLAGS = {"tokenizer_type", "tokenizer_model", "vocab_file", "merge_file"}
FROM_SAVED_ARGS = ("seq_length", "tokenizer_type", "tokenizer_model", "vocab_file", "merge_file",
                   "allow_custom_vocab", "make_vocab_size_divisible_by")
# Megatron's OptimizerParamScheduler state -> this parser's dests (--use-checkpoint-opt_param-scheduler).
SCHEDULER_FIELDS = {"max_lr": "lr", "min_lr": "min_lr", "lr_warmup_steps": "lr_warmup_iters",
                    "lr_decay_steps": "lr_decay_iters", "lr_decay_style": "lr_decay_style",
                    "decoupled_lr": "decoupled_lr", "decoupled_min_lr": "decoupled_min_lr"}
# Fields of the "model" dict that are not flags. None: even the vocabulary is one (--vocab-size,
# which a checkpoint whose vocabulary is larger than its tokenizer's, as Qwen2's, needs).
NOT_FLAGS: tuple[str, ...] = ()


def given_dests(parser: argparse.ArgumentParser, argv: list[str]) -> set[str]:
    """The dests of the flags that appear on the command line (abbreviations are refused, so an
    exact option string, or `--flag=value`, is the only way to give one)."""
    by_option = {o: a.dest for a in parser._actions for o in a.option_strings}
    return {by_option[t.split("=", 1)[0]] for t in argv if t.startswith("--") and t.split("=", 1)[0] in by_option}


# GPTConfig fields whose flag has a dest of another name (Megatron-LM's flag name kept)
DEST_OF_FIELD = {"layernorm_zero_centered_gamma": "apply_layernorm_1p"}


def _action(parser: argparse.ArgumentParser, field: str):
    field = DEST_OF_FIELD.get(field, field)
    long_first = sorted((a for a in parser._actions if a.dest == field and a.option_strings),
                        key=lambda a: isinstance(a, argparse._StoreFalseAction))   # prefer a positive flag
    return long_first[0] if long_first else None


def show(parser: argparse.ArgumentParser, field: str, value) -> tuple[str, object]:
    """(flag, value as that flag expresses it) for a config field / parser dest."""
    a = _action(parser, field)
    if a is None:
        return field, value
    flag = max(a.option_strings, key=len)      # the long form (e.g. --tensor-model-parallel-size)
    if isinstance(a, argparse._StoreFalseAction) and isinstance(value, bool):
        return flag, not value
    return flag, value


def describe_diff(parser: argparse.ArgumentParser, field: str, in_checkpoint, here, origin: str = "") -> str:
    """'--num-layers: 2 in the checkpoint, 4 here' (origin: ' (demo default)' and the like)."""
    if field == "gelu_approximate":             # no flag of its own: the flags that choose it
        gelu = {"tanh": "the tanh GELU", "none": "the erf GELU"}
        return (f"the MLP's GELU: {gelu.get(in_checkpoint, in_checkpoint)} in the checkpoint, "
                f"{gelu.get(here, here)} here (Megatron-LM's rule: tanh with linear biases and the bias-GELU "
                "fusion, erf with --no-bias-gelu-fusion or --disable-bias-linear; --use-checkpoint-args takes "
                "the checkpoint's)")
    flag, ck = show(parser, field, in_checkpoint)
    _, now = show(parser, field, here)
    return f"{flag}: {ck} in the checkpoint, {now} here{origin}"


def _vocab_flag(rows: int, args: argparse.Namespace, given: set[str], saved: dict) -> int:
    """The --vocab-size that builds a model of `rows` rows: NullTokenizer's N has N + 1 (its ids and the
    EOD id), every other tokenizer's N has N. The tokenizer is the typed one, else the checkpoint's run's."""
    tokenizer = args.tokenizer_type if "tokenizer_type" in given else saved.get("tokenizer_type", args.tokenizer_type)
    return rows - 1 if tokenizer == "NullTokenizer" else rows


def apply_checkpoint_args(parser: argparse.ArgumentParser, args: argparse.Namespace, given: set[str]) -> None:
    """Set args from --load's latest checkpoint (before finalize); refuse given flags that disagree."""
    from zo_megatron.checkpoint.verify import read_manifest

    if not args.load:
        raise ConfigError("--use-checkpoint-args reads the model from the checkpoint given by --load: add --load DIR")
    d, manifest = read_manifest(args.load, getattr(args, "ckpt_step", None))
    model = dict(manifest.get("model") or {})
    saved = manifest.get("args") or {}
    if not model:
        raise ConfigError(f"--use-checkpoint-args: {d} records no model arguments: give the model flags instead")
    # the GELU has no flag of its own (model_flags.gelu_approximate reads it): the checkpoint's (older: tanh)
    gelu = complete_arch_meta(model, saved)["gelu_approximate"]
    model.pop("gelu_approximate", None)
    taken, clashes = [], []
    for field, value in model.items():
        if field in NOT_FLAGS:
            continue
        dest = DEST_OF_FIELD.get(field, field)
        if dest in given:                       # typed: it must agree, and stays as typed
            if field == "rope_type" and not model.get("multi_latent_attention") and args.rope_type in (None, "rope"):
                continue                        # without MLA --rope-type rope changes nothing (recorded: None)
            flag_value = _vocab_flag(value, args, given, saved) if field == "vocab_size" else value
            if getattr(args, dest, None) != flag_value:
                clashes.append(describe_diff(parser, field, flag_value, getattr(args, dest, None)))
            continue
        setattr(args, dest, value)
        taken.append(dest)
    typed_gelu = megatron_gelu(args.add_bias_linear, args.bias_gelu_fusion)
    if "bias_gelu_fusion" in given and not (args.swiglu or args.squared_relu or args.quick_geglu) and typed_gelu != gelu:
        clashes.append(describe_diff(parser, "gelu_approximate", gelu, typed_gelu))   # it asks for another GELU
    args.gelu_approximate = gelu
    if "num_query_groups" in model and hasattr(args, "group_query_attention") and "group_query_attention" not in given:
        # Megatron's pair: --group-query-attention --num-query-groups G; G = heads is plain attention
        args.group_query_attention = model["num_query_groups"] not in (None, model.get("num_attention_heads"))
    for field in FROM_SAVED_ARGS:
        if field in saved and field not in given and field not in taken and hasattr(args, field):
            setattr(args, field, saved[field])
            taken.append(field)
    # The tokenizer: the checkpoint's own fingerprinted copy (a save keeps the run's Hugging Face
    # tokenizer files in tokenizer/; from-hf puts the model's there), not the path typed at the first
    # launch, which need not exist where this run resumes (issue 35, item 3)
    tok_dir = os.path.join(d, CHECKPOINT_TOKENIZER_DIR)
    if manifest.get("tokenizer_files") and os.path.isdir(tok_dir) and not given & TOKENIZER_FLAGS:
        if manifest.get("tokenizer_type") == "Llama2Tokenizer":        # one SentencePiece model file
            args.tokenizer_type = "Llama2Tokenizer"
            args.tokenizer_model = os.path.join(d, manifest["tokenizer_files"][0])
        else:
            args.tokenizer_type, args.tokenizer_model = "HuggingFaceTokenizer", tok_dir
        taken.extend(f for f in ("tokenizer_type", "tokenizer_model") if f not in taken)
    if args.tokenizer_type == "NullTokenizer" and "vocab_size" in taken and "vocab_size" not in given:
        # the model's rows are NullTokenizer's N + 1 (its ids and the EOD id); its flag is N, as typed
        args.vocab_size = saved.get("vocab_size") or model["vocab_size"] - 1
    sched = manifest.get("opt_param_scheduler") or {}
    if args.use_checkpoint_opt_param_scheduler and sched:
        # the loader trains with the checkpoint's schedule: no need to repeat --lr and company here
        for key, field in SCHEDULER_FIELDS.items():
            if key in sched and field not in given:
                setattr(args, field, sched[key])
                taken.append(field)
    if clashes:
        raise ConfigError(f"--use-checkpoint-args: the command line disagrees with the checkpoint {d}: "
                          f"{'; '.join(clashes)}: drop those flags (the checkpoint's values apply)")
    args.from_checkpoint = set(taken)
    args.from_checkpoint_flags = [show(parser, f, getattr(args, f))[0] for f in taken]
    args.checkpoint_demo = bool(saved.get("demo", False))   # the defaults its run was trained with


# What a resume may change that changes the run (Megatron-LM does not warn; the checkpoint records
# its args, so we can): (field, flag, what it means for the run)
RUN_CHANGES = (("precision", "--bf16/--fp16/--fp32", "the 16-bit weights are re-derived from the fp32 master"),
               ("global_batch_size", "--global-batch-size", "samples per step change: consumed samples and the "
                "schedule keep counting, tokens per step do not match the earlier steps"),
               ("rampup_batch_size", "--rampup-batch-size", "the remaining iterations take the new ramp's batches "
                "(the consumed samples keep counting)"),
               ("seq_length", "--seq-length", "tokens per sample change"),
               ("moe_router_bias_update_rate", "--moe-router-bias-update-rate", "the router expert bias moves by "
                "the new rate from now on (what it holds is kept)"))


def run_changes(saved: dict, args) -> list[str]:
    """One ' warning: ...' line per setting of RUN_CHANGES that differs between the checkpoint's
    saved args and this run, naming both values."""
    out = []
    for field, flag, meaning in RUN_CHANGES:
        if field in saved and saved[field] is not None and getattr(args, field, None) != saved[field]:
            out.append(f" warning: this resume changes {flag.split('/')[0] if field != 'precision' else 'the precision'}: "
                       f"{saved[field]} in the checkpoint, {getattr(args, field, None)} now ({meaning})")
    return out

