"""The job's data flags (Megatron-LM's names) and where the training data comes from.

One source per run, as in Megatron-LM (megatron/training/utils.py get_blend_and_blend_per_split):

    --data-path PREFIX | W PREFIX ...      one blend, cut into train/valid/test by --split
    --data-args-path FILE                  the same list, read from a text file (whitespace-separated)
    --train-data-path / --valid-data-path / --test-data-path
                                           a blend per split, each used whole (no --split)
    --per-split-data-args-path FILE.json   {"train": [...] or "w p ...", "valid": ..., "test": ...}
    --mock-data                            megatron-core's MockGPTDataset
    (none)                                 the embedded corpus (zo_megatron's own default)

`data_source(args)` gives what the datasets are built from: a list (one blend, split by --split) or a
dict {"train", "valid", "test": list or None} (a blend per split). Files named by the *-args-path flags
are read as text or JSON only.
"""
from __future__ import annotations

import argparse
import json

from zo_megatron.errors import ConfigError

SPLITS = ("train", "valid", "test")
# Megatron-LM's legacy default of --split where a --data-path blend is given without one
DEFAULT_SPLIT = "969, 30, 1"


def add_data_flags(g) -> None:
    g.add_argument("--data-path", nargs="*", default=None,
                   help="PREFIX, or WEIGHT PREFIX WEIGHT PREFIX ... (default: the embedded SOTU corpus)")
    g.add_argument("--data-args-path", default=None, metavar="FILE",
                   help="a text file holding --data-path's list (Megatron-LM's; for blends too long for a command line)")
    for split, what in (("train", "training"), ("valid", "validation"), ("test", "test")):
        g.add_argument(f"--{split}-data-path", nargs="*", default=None,
                       help=f"the {what} data alone, whole (no --split): PREFIX or WEIGHT PREFIX ... as --data-path"
                            + ("; --eval-iters global batches of it are evaluated once, at the end of the run" if
                               split == "test" else ""))
    g.add_argument("--per-split-data-args-path", default=None, metavar="FILE",
                   help='a JSON file {"train": ..., "valid": ..., "test": ...}, each a --data-path list or one string')
    g.add_argument("--reset-position-ids", action="store_true",
                   help="each document's positions start again at 0 after its end-of-document token (megatron-core's "
                        "GPTDataset): what learned absolute positions read; megatron-core's rotary embeddings take "
                        "positions 0..s-1 whatever the ids, so with RoPE it changes nothing, as in Megatron-LM")
    g.add_argument("--reset-attention-mask", action="store_true",
                   help="each document attends only to itself: a token after an end-of-document token cannot see "
                        "the documents before it (megatron-core's GPTDataset rule; the model builds the mask)")
    g.add_argument("--sft", action="store_true",
                   help="supervised fine-tuning (Megatron-LM's): the data are .jsonl files of {\"messages\": [...]} "
                        "conversations, one packed sample per line, the loss on the assistant's turns only, each "
                        "conversation attending to itself (docs/data.md)")
    g.add_argument("--sft-tokenizer-prompt-format", default="nemotron-h-aligned",
                   choices=("nemotron-h-aligned", "nemotron-nano-v2", "chat-template"),
                   help="how --sft renders a conversation: Megatron-LM's two Nemotron formats, or chat-template: "
                        "the tokenizer's own chat template (Llama, Qwen, Mistral ...)")
    g.add_argument("--sft-pack-lines", action="store_true",
                   help="ours, for --sft: a sample packs consecutive .jsonl lines (as many as fit in --seq-length) "
                        "instead of one line, for files of one conversation per line (Hugging Face's layout); every "
                        "line is tokenized once before training to count it (cached with the indices; docs/data.md)")
    g.add_argument("--split", default=None,
                   help=f"train, valid, test proportions of a --data-path blend (default {DEFAULT_SPLIT!r}, "
                        "Megatron-LM's)")


def _read_text_list(path: str, flag: str) -> list[str]:
    try:
        with open(path) as f:
            items = f.read().split()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{flag} {path}: cannot be read ({type(exc).__name__}: {exc})") from None
    if not items:
        raise ConfigError(f"{flag} {path}: the file is empty; it should hold PREFIX or WEIGHT PREFIX ...")
    return items


def _read_per_split(path: str) -> dict:
    flag = "--per-split-data-args-path"
    try:
        with open(path) as f:
            spec = json.load(f)
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ConfigError(f"{flag} {path}: not a readable JSON file ({type(exc).__name__}: "
                          f"{str(exc).splitlines()[0][:160]})") from None
    if not isinstance(spec, dict) or not set(spec) <= set(SPLITS):
        raise ConfigError(f"{flag} {path}: expected a JSON object with the keys {', '.join(SPLITS)} (got "
                          f"{sorted(spec) if isinstance(spec, dict) else type(spec).__name__})")
    out = {}
    for split in SPLITS:
        value = spec.get(split)
        if isinstance(value, str):
            value = value.split()
        if value is not None and not (isinstance(value, list) and value and all(isinstance(x, (str, int, float))
                                                                                 for x in value)):
            raise ConfigError(f"{flag} {path}: {split!r} must be a list like [\"PREFIX\"] or [\"0.3\", \"A\", "
                              "\"0.7\", \"B\"], or one string")
        out[split] = None if value is None else [str(x) for x in value]
    return out


def check_data_flags(args: argparse.Namespace) -> None:
    """One source of data (one line naming the flags that contradict each other), the files read, and
    --split resolved: Megatron-LM's default for a blend, refused for data given per split. Sets
    args.data_path (from --data-args-path) and args.data_per_split (a dict, or None)."""
    per_split_flags = [f"--{s}-data-path" for s in SPLITS if getattr(args, f"{s}_data_path") is not None]
    if args.per_split_data_args_path:
        per_split_flags.append("--per-split-data-args-path")
    sources = [f for f, on in (("--data-path", args.data_path is not None), ("--data-args-path", args.data_args_path),
                               ("--mock-data", args.mock_data), ("--embedded-corpus", args.embedded_corpus)) if on]
    if per_split_flags:
        sources.append(" / ".join(per_split_flags))
    if len(sources) > 1:
        raise ConfigError(f"{' and '.join(sources)} contradict each other: give one source of data")
    if args.per_split_data_args_path and len(per_split_flags) > 1:
        raise ConfigError(f"{', '.join(per_split_flags)}: give the per-split paths in the JSON file or as flags, "
                          "not both")
    if args.data_args_path:
        args.data_path = _read_text_list(args.data_args_path, "--data-args-path")
    args.data_per_split = None
    if per_split_flags:
        args.data_per_split = _read_per_split(args.per_split_data_args_path) if args.per_split_data_args_path else \
            {s: getattr(args, f"{s}_data_path") for s in SPLITS}
        empty = [s for s, v in args.data_per_split.items() if v is not None and not v]
        if empty:
            raise ConfigError(f"--{empty[0]}-data-path is given without a prefix: add PREFIX or WEIGHT PREFIX ...")
        missing = (lambda split: f'--per-split-data-args-path {args.per_split_data_args_path} has no "{split}"') \
            if args.per_split_data_args_path else (lambda split: f"{per_split_flags[0]} without --{split}-data-path")
        if args.data_per_split["train"] is None:
            raise ConfigError(f"{missing('train')}: there is nothing to train on; add it")
        if args.split is not None:
            raise ConfigError(f"--split {args.split} with {per_split_flags[0]}: data given per split is used whole "
                              "(megatron-core refuses both); drop --split")
        if args.data_per_split["valid"] is None and args.eval_iters > 0:
            raise ConfigError(f"{missing('valid')} but --eval-iters {args.eval_iters}: no validation data is given; "
                              "add it, or --eval-iters 0 (no evaluation)")
    elif args.split is None:
        args.split = DEFAULT_SPLIT
    check_sft_flags(args, sources)


def check_sft_flags(args: argparse.Namespace, sources: list[str]) -> None:
    """--sft's data and tokenizer (Megatron-LM's SFTDataset and SFTTokenizer): .jsonl files and a Hugging Face
    tokenizer; its own packing restarts positions and attention per conversation. Megatron-LM's
    `--tokenizer-type SFTTokenizer` becomes HuggingFaceTokenizer (the conversation rules are data/sft.py's)."""
    if args.tokenizer_type == "SFTTokenizer":
        if not args.sft:
            raise ConfigError("--tokenizer-type SFTTokenizer is Megatron-LM's tokenizer for --sft: add --sft, or use "
                              "--tokenizer-type HuggingFaceTokenizer")
        args.tokenizer_type = "HuggingFaceTokenizer"
    if not args.sft:
        if "sft_tokenizer_prompt_format" in getattr(args, "given", ()):
            raise ConfigError("--sft-tokenizer-prompt-format applies to --sft: add --sft, or drop it")
        if getattr(args, "sft_pack_lines", False):
            raise ConfigError("--sft-pack-lines packs the .jsonl lines of --sft: add --sft, or drop it")
        return
    if not sources or sources[0] in ("--mock-data", "--embedded-corpus"):
        raise ConfigError(f"--sft trains on conversations in .jsonl files{' (not ' + sources[0] + ')' if sources else ''}"
                          ": add --data-path FILE.jsonl (docs/data.md, Supervised fine-tuning)")
    if args.tokenizer_type != "HuggingFaceTokenizer":
        raise ConfigError(f"--sft renders conversations with a Hugging Face tokenizer (--tokenizer-type "
                          f"{args.tokenizer_type} has no chat templates): add --tokenizer-type HuggingFaceTokenizer "
                          "--tokenizer-model DIR")
    clash = [f for f, on in (("--reset-position-ids", args.reset_position_ids),
                             ("--reset-attention-mask", args.reset_attention_mask), ("--eod-mask-loss", args.eod_mask_loss))
             if on]
    if clash:
        raise ConfigError(f"--sft restarts positions and attention per conversation and masks the loss to the "
                          f"assistant's turns itself (Megatron-LM asserts the same): drop {' and '.join(clash)}")


def data_source(args: argparse.Namespace):
    """What the datasets are built from (see the module docstring); None: not from files."""
    return args.data_per_split or args.data_path


def data_prefixes(source) -> list[str]:
    """Every prefix a source names (to validate before launch)."""
    from zo_megatron.data import parse_data_path

    blends = source.values() if isinstance(source, dict) else [source]
    return [p for blend in blends if blend for p in parse_data_path(blend)[0]]


def describe(source) -> str:
    """The data's words in the banner."""
    if isinstance(source, dict):
        return "; ".join(f"{s}: {' '.join(v)}" for s, v in source.items() if v)
    return " ".join(source)
