"""Megatron-LM's `torch` checkpoint format for its megatron-core GPT model, both ways.

    DIR/latest_checkpointed_iteration.txt            "N", or "release" for iteration 0
    DIR/iter_000000N/mp_rank_XX/model_optim_rng.pt   one file per TP rank (no pipeline parallelism)
        {"args": argparse.Namespace, "checkpoint_version": 3.0, "iteration": N,
         "model": {megatron-core parameter name: this TP rank's shard, "<linear>._extra_state": None}}

Megatron-LM's loader (`megatron/training/checkpointing.py`) reads `checkpoint_version`,
`iteration`, `model` (load_state_dict, strict) and `args` (check_checkpoint_args: num_layers,
hidden_size, num_attention_heads, max_position_embeddings, make_vocab_size_divisible_by,
padded_vocab_size, tokenizer_type, tensor/pipeline_model_parallel_size; with
--use-checkpoint-args the model-shape fields). Its 'release' convention is used for iteration 0
because its tracker parser refuses "0". Files written here hold no optimizer or RNG state: load
them in Megatron-LM with `--finetune` (or `--no-load-optim --no-load-rng`).

Reading never runs pickled code: `torch.load(weights_only=True)` with only plain-data classes
allowed (argparse.Namespace, NumPy arrays for Megatron's saved RNG states, io.BytesIO for
Transformer Engine's extra state, megatron-core's own Enum types and
signal.Signals for args.exit_signal); anything else is refused
with the class named. Both the local layer names and Transformer Engine's fused-LayerNorm names
(`linear_qkv.layer_norm_weight`, ...) are read.
"""
from __future__ import annotations

import argparse
import enum
import importlib
import os
import pickle
import re

import torch

from zo_megatron.checkpoint.arch import full_meta, head_dim, query_groups
from zo_megatron.checkpoint.megatron_allow import non_neutral
from zo_megatron.checkpoint.tp_layout import (EXTRA_STATE_LAYERS, OUTPUT_LAYER, WORD_EMBEDDING, local_rows,
                                              padded_vocab_size, partition_stride, tp_axis)
from zo_megatron.model.config import YARN_FIELDS
from zo_megatron.model.sharding import split_pieces
from zo_megatron.errors import UserError

TRACKER = "latest_checkpointed_iteration.txt"
FILE = "model_optim_rng.pt"
CHECKPOINT_VERSION = 3.0
GPT2_VOCAB = 50257
_OURS = "gpt."                                  # our module wraps megatron-core's GPTModel as .gpt
_PLAIN_GLOBALS = {"argparse.Namespace", "_io.BytesIO", "numpy.ndarray", "numpy.dtype",
                  "numpy.core.multiarray._reconstruct", "numpy._core.multiarray._reconstruct",
                  "numpy.core.multiarray.scalar", "numpy._core.multiarray.scalar",
                  "signal.Signals"}                # args.exit_signal (core_v0.16.1: signal.SIGTERM)
_TE_NAMES = {"self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
             "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias",
             "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
             "mlp.linear_fc1.layer_norm_bias": "pre_mlp_layernorm.bias"}
_MP_DIR = re.compile(r"^mp_rank_(\d{2})(_\d{3})?$")


def megatron_args(meta: dict, *, tp: int, iteration: int, divisible_by: int, seq_length: int | None,
                  precision: str | None, tokenizer_type: str = "GPT2BPETokenizer", tokenizer_model: str | None = None,
                  consumed_samples: int = 0, consumed_valid_samples: int = 0) -> argparse.Namespace:
    """The args Megatron-LM reads from a checkpoint (its argument names), for the model `meta`."""
    meta = full_meta(meta)
    h, heads, groups = meta["hidden_size"], meta["num_attention_heads"], query_groups(meta)
    rope = meta["position_embedding_type"] == "rope"
    return argparse.Namespace(
        num_layers=meta["num_layers"], hidden_size=h, ffn_hidden_size=meta["ffn_hidden_size"],
        num_attention_heads=heads, kv_channels=head_dim(meta), group_query_attention=groups != heads,
        num_query_groups=groups, max_position_embeddings=meta["max_position_embeddings"],
        seq_length=seq_length or meta["max_position_embeddings"],
        position_embedding_type=meta["position_embedding_type"], add_position_embedding=True,
        use_rotary_position_embeddings=rope, rotary_base=meta["rotary_base"], rotary_percent=meta["rotary_percent"],
        rotary_interleaved=False, rotary_seq_len_interpolation_factor=None, use_rope_scaling=meta["use_rope_scaling"],
        rope_scaling_factor=meta["rope_scaling_factor"], **_yarn_args(meta),
        make_vocab_size_divisible_by=divisible_by, vocab_size=meta["vocab_size"],
        padded_vocab_size=padded_vocab_size(meta["vocab_size"], divisible_by, tp), tokenizer_type=tokenizer_type,
        tokenizer_model=tokenizer_model,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=1,
        untie_embeddings_and_output_weights=meta["untie_embeddings_and_output_weights"],
        # Megatron-LM before 2026-01 names the epsilon norm_epsilon, later layernorm_epsilon (TransformerConfig's)
        normalization=meta["normalization"], norm_epsilon=meta["layernorm_epsilon"],
        layernorm_epsilon=meta["layernorm_epsilon"], apply_layernorm_1p=meta["layernorm_zero_centered_gamma"],
        qk_layernorm=meta["qk_layernorm"],
        # Megatron-LM keeps add_qkv_bias True whenever add_bias_linear is
        add_bias_linear=meta["add_bias_linear"], add_qkv_bias=meta["add_bias_linear"] or meta["add_qkv_bias"],
        swiglu=meta["swiglu"], squared_relu=False, openai_gelu=not meta["swiglu"], transformer_impl="local",
        ckpt_format="torch", bf16=precision == "bf16", fp16=precision == "fp16", iteration=iteration,
        consumed_train_samples=consumed_samples, consumed_valid_samples=consumed_valid_samples)


def _yarn_args(meta: dict) -> dict:
    """YaRN's args under Megatron-LM's names (core_v0.19 on: --position-embedding-type yarn, its
    --yarn-* flags, the MLA group's --rotary-scaling-factor, --mscale, --mscale-all-dim); none for
    another position embedding (the args then are what they were before YaRN)."""
    return {k: meta[k] for k in YARN_FIELDS} if meta["position_embedding_type"] == "yarn" else {}


def _yarn_meta(args: argparse.Namespace, pos: str) -> dict:
    """YaRN's fields from Megatron-LM's args, unset ones at the values Megatron-LM gives them
    (core_v0.19's _apply_yarn_config_from_args: megatron-core's YarnRotaryEmbedding defaults)."""
    if pos != "yarn":
        return {}
    return {k: type(default)(default if getattr(args, k, None) is None else getattr(args, k))
            for k, default in YARN_FIELDS.items()}


def meta_from_args(args: argparse.Namespace, vocab: int, where: str) -> dict:
    """The model's architecture (GPTConfig fields) from Megatron-LM's saved args; one line for
    what zo_megatron does not build."""
    def refuse(what):
        raise UserError(f"{where}: {what}: zo_megatron's GPT does not build it")

    if getattr(args, "pipeline_model_parallel_size", 1) not in (None, 1):
        raise UserError(f"{where}: pipeline_model_parallel_size={args.pipeline_model_parallel_size}: "
                        "merge the pipeline stages first (Megatron-LM's tools/checkpoint/convert.py --target-pipeline-parallel-size 1)")
    bad = non_neutral(args)                     # an allow-list: every arg is read, inert or at its neutral value
    if bad:
        them = "it" if len(bad) == 1 else "them"
        raise UserError(f"{where}: {'; '.join(bad)}: zo_megatron's GPT does not build {them}, so the weights would "
                        f"compute another function; only checkpoints trained without {them} convert "
                        "(zo_megatron/checkpoint/megatron_allow.py lists what converts)")
    swiglu = bool(getattr(args, "swiglu", False))
    if not swiglu and not getattr(args, "openai_gelu", False):
        refuse("args.openai_gelu=False with a GELU MLP (the erf GELU; zo_megatron's GPT-2 MLP is the tanh GELU, "
               "Megatron-LM's --openai-gelu)")
    pos = "rope" if getattr(args, "use_rotary_position_embeddings", False) else \
        getattr(args, "position_embedding_type", "learned_absolute")
    if pos not in ("learned_absolute", "rope", "yarn"):
        refuse(f"args.position_embedding_type={pos!r}")
    norm = getattr(args, "normalization", "LayerNorm")
    if norm not in ("LayerNorm", "RMSNorm"):
        refuse(f"args.normalization={norm!r}")
    h, heads = args.hidden_size, args.num_attention_heads
    eps = getattr(args, "norm_epsilon", None) or getattr(args, "layernorm_epsilon", None) or 1e-5
    bias = bool(getattr(args, "add_bias_linear", True))
    ffn = getattr(args, "ffn_hidden_size", None) or (int(4 * h * 2 / 3 / 64) * 64 if swiglu else 4 * h)
    return full_meta(dict(
        num_layers=args.num_layers, hidden_size=h, num_attention_heads=heads, ffn_hidden_size=ffn, vocab_size=vocab,
        max_position_embeddings=args.max_position_embeddings,
        make_vocab_size_divisible_by=int(getattr(args, "make_vocab_size_divisible_by", None) or 128),
        position_embedding_type=pos, rotary_base=int(getattr(args, "rotary_base", 10000)), **_yarn_meta(args, pos),
        rotary_percent=float(getattr(args, "rotary_percent", 1.0)),
        use_rope_scaling=bool(getattr(args, "use_rope_scaling", False)),
        rope_scaling_factor=float(getattr(args, "rope_scaling_factor", 8.0)), normalization=norm,
        layernorm_epsilon=float(eps), swiglu=swiglu,
        num_query_groups=args.num_query_groups if getattr(args, "group_query_attention", False) else None,
        kv_channels=getattr(args, "kv_channels", None),
        untie_embeddings_and_output_weights=bool(getattr(args, "untie_embeddings_and_output_weights", False)),
        add_bias_linear=bias, add_qkv_bias=not bias and bool(getattr(args, "add_qkv_bias", False)),
        qk_layernorm=bool(getattr(args, "qk_layernorm", False)),
        # Megatron-LM's --apply-layernorm-1p (its TransformerConfig field in newer saves): the same raw weights
        layernorm_zero_centered_gamma=bool(getattr(args, "apply_layernorm_1p", False)
                                           or getattr(args, "layernorm_zero_centered_gamma", False))))


def _local_name(key: str) -> str:
    """Transformer Engine's fused-LayerNorm parameter names -> the local spec's (ours)."""
    for te, local in _TE_NAMES.items():
        if key.endswith("." + te):
            return key[: -len(te)] + local
    return key


def _ours_to_megatron(name: str) -> str:
    return name.removeprefix(_OURS)


def rank_layout(name: str, full_shape: tuple[int, ...], rank: int, tp: int, padded_vocab: int, swiglu: bool):
    """(axis, local rows, [(full offset, local offset, rows)]) of TP rank `rank`'s shard along the
    split axis (the layout of checkpoint/tp_layout.py); None for a replicated parameter. Vocab
    rows past the full tensor are padding (zero in the files); SwiGLU's fc1 rank holds
    [gate_r; up_r] (two pieces)."""
    axis = tp_axis(name)
    if axis is None:
        return None
    local = local_rows(name, full_shape, tp, padded_vocab)
    return axis, local, split_pieces(full_shape[axis], local, rank, tp, partition_stride(name, swiglu))


def write(out_dir: str, weights: dict[str, torch.Tensor], args: argparse.Namespace, *, progress=None) -> list[str]:
    """One model_optim_rng.pt per TP rank from full unpadded weights (our names); returns the files."""
    tp, it = args.tensor_model_parallel_size, args.iteration
    sub = "release" if it == 0 else f"iter_{it:07d}"
    files = []
    for r in range(tp):
        model = {}
        for name, full in weights.items():
            layout = rank_layout(name, tuple(full.shape), r, tp, args.padded_vocab_size, args.swiglu)
            if layout is None:
                shard = full.clone()
            else:
                axis, local, pieces = layout
                shape = list(full.shape)
                shape[axis] = local
                shard = full.new_zeros(shape)                # vocab padding rows stay zero
                for full_off, local_off, n in pieces:
                    shard.narrow(axis, local_off, n).copy_(full.narrow(axis, full_off, n))
            model[_ours_to_megatron(name)] = shard
        for i in range(args.num_layers):
            for layer in EXTRA_STATE_LAYERS:
                model[f"decoder.layers.{i}.{layer}._extra_state"] = None
        model["output_layer._extra_state"] = None
        path = os.path.join(out_dir, sub, f"mp_rank_{r:02d}", FILE)
        os.makedirs(os.path.dirname(path))
        torch.save({"args": args, "checkpoint_version": CHECKPOINT_VERSION, "iteration": it, "model": model}, path)
        files.append(path)
        if progress is not None:
            progress(r + 1, tp)
    with open(os.path.join(out_dir, TRACKER), "w") as f:
        f.write("release" if it == 0 else str(it))
    return files


def _allowed_global(name: str):
    """The object for a pickled global that is plain data, or None."""
    module, _, attr = name.rpartition(".")
    if name in _PLAIN_GLOBALS or module.startswith(("numpy.dtypes", "megatron.core.")):
        try:
            obj = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError):
            return None
        if name in _PLAIN_GLOBALS or module.startswith("numpy.dtypes"):
            return obj
        if isinstance(obj, type) and issubclass(obj, enum.Enum):   # megatron-core enums in args
            return obj
    return None


def safe_load(path: str) -> dict:
    """torch.load(weights_only=True) with the plain-data allow-list; one-line refusal otherwise."""
    try:
        names = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except Exception as exc:  # noqa: BLE001 - a damaged archive raises many types
        raise UserError(f"{path}: not a readable torch checkpoint ({type(exc).__name__}: "
                        f"{str(exc).splitlines()[0][:160] if str(exc) else ''}); the file is damaged or not a Megatron-LM checkpoint") from None
    allowed = []
    for name in names:
        obj = _allowed_global(name)
        if obj is None:
            raise UserError(f"{path}: refusing to load: it references {name}, which is not plain data (loading it "
                            "could run code); only tensors, argparse.Namespace and NumPy arrays are read")
        allowed.append(obj)
    try:
        with torch.serialization.safe_globals(allowed):
            sd = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError) as exc:
        raise UserError(f"{path}: cannot be read safely ({type(exc).__name__}: "
                        f"{str(exc).splitlines()[0][:160] if str(exc) else ''}); the file is damaged or was tampered with") from None
    if not isinstance(sd, dict) or not isinstance(sd.get("model"), dict):
        raise UserError(f"{path}: no 'model' state dict: not a Megatron-LM checkpoint of one model (no virtual pipeline)")
    return sd


def find_iteration_dir(in_dir: str) -> tuple[str, int]:
    tracker = os.path.join(in_dir, TRACKER)
    if not os.path.isfile(tracker):
        raise UserError(f"{in_dir}: no {TRACKER}; point --input at a Megatron-LM checkpoint directory (--save of a run)")
    text = open(tracker).read(64).strip()
    if text == "release":
        d, it = os.path.join(in_dir, "release"), 0
    elif text.isdigit():
        d, it = os.path.join(in_dir, f"iter_{int(text):07d}"), int(text)
    else:
        raise UserError(f"{tracker}: expected an iteration number or 'release', found {text[:40]!r}")
    if not os.path.isdir(d):
        raise UserError(f"{tracker} names {os.path.basename(d)}, which does not exist under {in_dir}")
    return d, it


def _vocab_size(args: argparse.Namespace, where: str, vocab_size: int | None, tokenizer_model: str | None) -> int:
    """The model's real (unpadded) vocabulary: args.vocab_size (Megatron's --vocab-size), else what
    the run's tokenizer gives Megatron-LM: GPT-2's 50257, or len(tokenizer) for a HuggingFaceTokenizer
    (its _HuggingFaceTokenizer.vocab_size), read from --tokenizer-model or the args' path when that
    is a local directory. vocab_size / tokenizer_model: from-megatron's flags."""
    saved = getattr(args, "vocab_size", None)
    if saved is not None:
        if vocab_size is not None and vocab_size != saved:
            raise UserError(f"{where}: args.vocab_size={saved}, --vocab-size {vocab_size} here: drop --vocab-size "
                            "(the checkpoint records its vocabulary)")
        return int(saved)
    if vocab_size is not None:
        return vocab_size
    kind = getattr(args, "tokenizer_type", None)
    if kind == "GPT2BPETokenizer":
        return GPT2_VOCAB
    fixes = "pass --vocab-size N (the vocabulary the run's tokenizer gave Megatron-LM)"
    if kind != "HuggingFaceTokenizer":
        raise UserError(f"{where}: tokenizer_type={kind!r} and no vocab_size: the model's real vocabulary size is "
                        f"not in the checkpoint; {fixes}")
    from zo_megatron.data.errors import DataError
    from zo_megatron.data.tokenizer import HuggingFaceTokenizer

    path = tokenizer_model or getattr(args, "tokenizer_model", None)
    source = f"--tokenizer-model {path}" if tokenizer_model else f"args.tokenizer_model={path!r}"
    fixes = "pass --tokenizer-model DIR (the run's Hugging Face tokenizer) or --vocab-size N (len(tokenizer))"
    if not path or not os.path.isdir(path):
        raise UserError(f"{where}: a HuggingFaceTokenizer run with no vocab_size, and {source} is not a directory "
                        f"here, so the model's real vocabulary size is unknown: {fixes}")
    try:
        return HuggingFaceTokenizer(path).vocab_size
    except DataError as exc:
        raise UserError(f"{where}: {source} cannot be read as the run's tokenizer ({exc}); {fixes}") from None


def read(in_dir: str, *, progress=None, vocab_size: int | None = None,
         tokenizer_model: str | None = None) -> tuple[dict[str, torch.Tensor], argparse.Namespace, int, int]:
    """(full unpadded weights by our names, in the files' dtype, args, iteration, vocab size) of a
    Megatron-LM checkpoint; vocab_size / tokenizer_model give the vocabulary when the args do not
    (_vocab_size)."""
    d, it = find_iteration_dir(in_dir)
    ranks = sorted(n for n in os.listdir(d) if _MP_DIR.match(n))
    if not ranks:
        raise UserError(f"{d}: no mp_rank_XX directories: not a Megatron-LM 'torch' checkpoint "
                        "(a torch_dist one must be converted with Megatron-LM's tools first)")
    if any(_MP_DIR.match(n).group(2) for n in ranks):
        raise UserError(f"{d}: pipeline-parallel ranks (mp_rank_XX_YYY): merge the pipeline stages first "
                        "(Megatron-LM's tools/checkpoint/convert.py --target-pipeline-parallel-size 1)")
    tp = len(ranks)
    if ranks != [f"mp_rank_{r:02d}" for r in range(tp)]:
        raise UserError(f"{d}: TP rank directories {ranks} are not mp_rank_00..mp_rank_{tp - 1:02d}: some are missing")
    shards, args = [], None
    for r, name in enumerate(ranks):
        path = os.path.join(d, name, FILE)
        if not os.path.isfile(path):
            raise UserError(f"{path} is missing: the checkpoint is incomplete")
        sd = safe_load(path)
        args = sd.get("args") if args is None else args
        shards.append({_local_name(k): v for k, v in sd["model"].items() if not k.endswith("_extra_state")})
        if progress is not None:
            progress(r + 1, tp)
    if not isinstance(args, argparse.Namespace):
        raise UserError(f"{d}: the checkpoint has no 'args' (argparse.Namespace): its model shape is unknown")
    where = os.path.join(d, ranks[0], FILE)
    if getattr(args, "pipeline_model_parallel_size", 1) not in (None, 1):
        raise UserError(f"{where}: pipeline_model_parallel_size={args.pipeline_model_parallel_size}: "
                        "merge the pipeline stages first (Megatron-LM's tools/checkpoint/convert.py --target-pipeline-parallel-size 1)")
    saved_tp = getattr(args, "tensor_model_parallel_size", tp)
    if saved_tp != tp:
        raise UserError(f"{d}: args say tensor_model_parallel_size={saved_tp} but there are {tp} mp_rank directories")
    vocab = _vocab_size(args, where, vocab_size, tokenizer_model)
    keys = set(shards[0])
    for r, sh in enumerate(shards[1:], 1):
        if set(sh) != keys:
            raise UserError(f"{os.path.join(d, ranks[r], FILE)}: holds other parameters than {ranks[0]}: "
                            "the TP ranks come from different models")
    swiglu = bool(getattr(args, "swiglu", False))
    full = {}
    for k in sorted(keys):
        if k.startswith("output_layer.") and not getattr(args, "untie_embeddings_and_output_weights", False):
            raise UserError(f"{where}: holds {k} but args.untie_embeddings_and_output_weights is not set")
        t0 = shards[0][k]
        for r, sh in enumerate(shards):
            if sh[k].shape != t0.shape:
                raise UserError(f"{os.path.join(d, ranks[r], FILE)}: {k} has shape {tuple(sh[k].shape)}, "
                                f"{ranks[0]}'s has {tuple(t0.shape)}: the TP ranks come from different models")
        vocab_rows = k.endswith((WORD_EMBEDDING, OUTPUT_LAYER))
        axis = tp_axis(k)
        t = t0
        if axis is not None:
            shape = list(t0.shape)
            shape[axis] *= tp                   # the full tensor (vocab padding rows included)
            t = t0.new_empty(shape)
            for r, sh in enumerate(shards):
                for full_off, local_off, n in rank_layout(k, tuple(shape), r, tp, shape[0], swiglu)[2]:
                    t.narrow(axis, full_off, n).copy_(sh[k].narrow(axis, local_off, n))
        if vocab_rows:
            if t.shape[0] < vocab:
                raise UserError(f"{where}: {k} has {t.shape[0]} rows for a vocabulary of {vocab}: not the run's "
                                "vocabulary (give the run's --vocab-size or --tokenizer-model)")
            t = t[:vocab]
        full[_OURS + k] = t.contiguous()          # the files' dtype: the writer converts box by box
    return full, args, it, vocab
