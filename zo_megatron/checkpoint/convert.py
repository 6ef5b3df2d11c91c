"""Checkpoint conversion: the library behind tools/convert_checkpoint.py (docs/checkpoints.md).

    to-hf          zo_megatron checkpoint -> Hugging Face GPT2LMHeadModel directory (+ tokenizer)
    from-hf        Hugging Face GPT-2 directory -> zo_megatron checkpoint (weights only) at TP=N
    to-megatron    zo_megatron checkpoint -> Megatron-LM `torch` checkpoint (megatron_lm.py)
    from-megatron  Megatron-LM `torch` checkpoint -> zo_megatron checkpoint (weights only) at TP=N
    to-fp32        zo_megatron checkpoint -> consolidated fp32 master weights (safetensors)
    reshard        zo_megatron checkpoint -> the same checkpoint laid out for TP=N x DP=M

Everything goes through FULL unpadded tensors (the checkpoint's own keys, content.py), read with
reader.py and written with writer.py, so there is one reader and one writer of our format. The
weights always come from the fp32 master copy. Every output is written under a temporary name
and renamed when complete (writer.atomic_output).
"""
from __future__ import annotations

import math
import os
import shutil
import sys
import tempfile
import time
from typing import Callable

import torch

from zo_megatron.checkpoint import hf_gpt2, megatron_lm
from zo_megatron.checkpoint.boxes import Box
from zo_megatron.checkpoint.content import EXP_AVG, EXP_AVG_SQ, MODEL
from zo_megatron.checkpoint.layout import rng_file
from zo_megatron.checkpoint.reader import CheckpointReader
from zo_megatron.checkpoint.tp_layout import padded_vocab_size, tp_axis, tp_shard_box
from zo_megatron.checkpoint.writer import TensorSpec, atomic_output, tree_bytes, write_checkpoint
from zo_megatron.errors import UserError

Log = Callable[[str], None]
DEFAULT_DIVISIBLE_BY = 128                      # Megatron's --make-vocab-size-divisible-by default
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_HF_DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


class Progress:
    """`what: done/total` on stderr, at most every few seconds, and once at the end."""

    def __init__(self, what: str, every_s: float = 3.0):
        self.what, self.every_s, self._last = what, every_s, time.monotonic()

    def __call__(self, done: int, total: int) -> None:
        now = time.monotonic()
        if done == total or now - self._last >= self.every_s:
            self._last = now
            print(f"  {self.what}: {done}/{total} ({100 * done // max(total, 1)}%)", file=sys.stderr, flush=True)


def parse_size(text: str) -> int:
    """'5GB', '500MB', '1GiB', '123' (bytes) -> bytes."""
    t = text.strip().upper()
    for suffix, mult in (("GIB", 1 << 30), ("MIB", 1 << 20), ("KIB", 1 << 10), ("GB", 10**9), ("MB", 10**6),
                         ("KB", 10**3), ("B", 1)):
        if t.endswith(suffix):
            num = t[: -len(suffix)].strip()
            break
    else:
        num, mult = t, 1
    try:
        value = float(num)
    except ValueError:
        raise UserError(f"--max-shard-size {text!r}: expected a size such as 5GB, 500MB or 1GiB") from None
    if value <= 0:
        raise UserError(f"--max-shard-size {text!r}: must be positive")
    return int(value * mult)


def _wrote(log: Log, path: str) -> None:
    n, size = tree_bytes(path)
    log(f"wrote {path}: {n} file{'s' if n != 1 else ''}, {size:,} bytes ({size / 1e9:.2f} GB)")


def check_tensor_parallel(meta: dict, tp: int, flag: str = "--tensor-parallel") -> None:
    if tp < 1:
        raise UserError(f"{flag} {tp}: must be >= 1")
    for what, n in (("num_attention_heads", meta["num_attention_heads"]), ("ffn_hidden_size", meta["ffn_hidden_size"])):
        if n % tp:
            raise UserError(f"{flag} {tp} does not divide the model's {what} {n}: TP splits whole heads and MLP "
                            f"columns; choose a TP size that divides {n}")


def _divisible_by(args: dict) -> int:
    return int(args.get("make_vocab_size_divisible_by") or DEFAULT_DIVISIBLE_BY)


def _tp_specs(shapes: dict[str, tuple[int, ...]], prefixes: list[str], dtypes: dict[str, torch.dtype],
              tp: int, padded_vocab: int) -> list[TensorSpec]:
    """Each key stored as the boxes its TP shards hold at `tp` (vocab padding rows are not stored)."""
    out = []
    for prefix in prefixes:
        for name, shape in shapes.items():
            boxes = [tp_shard_box(name, shape, r, tp, padded_vocab) for r in (range(tp) if tp_axis(name) is not None else [0])]
            out.append(TensorSpec(prefix + name, shape, dtypes[prefix], tuple(b for b in boxes if b is not None)))
    return out


def _slice(t: torch.Tensor, box: Box) -> torch.Tensor:
    for axis, (o, n) in enumerate(zip(box.offsets, box.sizes)):
        t = t.narrow(axis, o, n)
    return t


def _write_weights_checkpoint(output: str, weights: dict[str, torch.Tensor], meta: dict, *, tp: int,
                              converted_from: str, args: dict, force: bool, log: Log) -> None:
    """A weights-only zo_megatron checkpoint (iteration 0) for `pretrain_gpt.py --load`."""
    check_tensor_parallel(meta, tp)
    shapes = {n: tuple(t.shape) for n, t in weights.items()}
    specs = _tp_specs(shapes, [MODEL], {MODEL: torch.float32}, tp,
                      padded_vocab_size(meta["vocab_size"], _divisible_by(args), tp))
    manifest = {"weights_only": True, "converted_from": converted_from, "model": meta, "params": shapes,
                "layout": {"tensor_parallel": tp, "data_parallel": 1},
                "optimizer": {"kind": "none", "step": 0, "loss_scaler": {}}, "args": args,
                "consumed_samples": 0, "consumed_valid_samples": 0}
    with atomic_output(output, force=force) as tmp:
        write_checkpoint(tmp, iteration=0, specs=specs, manifest=manifest,
                         fetch=lambda key, box: _slice(weights[key.removeprefix(MODEL)], box).float(),
                         progress=Progress("writing tensors"))
    _wrote(log, output)
    log(f"  weights only at TP{tp}: `pretrain_gpt.py --load {output}` starts from them at iteration 0 with a fresh "
        "optimizer (any DP size)")


# ---------------------------------------------------------------- Hugging Face

def _tokenizer(reader: CheckpointReader, vocab_file: str | None, merge_file: str | None):
    from transformers import GPT2TokenizerFast

    from zo_megatron.data.tokenizer import BUNDLED_MERGE_FILE, BUNDLED_VOCAB_FILE

    vocab = reader.model_meta["vocab_size"]
    if bool(vocab_file) != bool(merge_file):
        raise UserError("give both --vocab-file and --merge-file (the tokenizer the checkpoint was trained with)")
    if not vocab_file:
        if reader.args.get("allow_custom_vocab") or vocab != megatron_lm.GPT2_VOCAB:
            raise UserError(f"{reader.dir}: trained with a vocabulary that is not GPT-2's ({vocab} tokens, "
                            "--allow-custom-vocab): pass its --vocab-file and --merge-file")
        vocab_file, merge_file = BUNDLED_VOCAB_FILE, BUNDLED_MERGE_FILE
    for f in (vocab_file, merge_file):
        if not os.path.isfile(f):
            raise UserError(f"{f}: no such file")
    try:
        with tempfile.TemporaryDirectory() as d:   # from_pretrained reads files by their standard names
            shutil.copyfile(vocab_file, os.path.join(d, "vocab.json"))
            shutil.copyfile(merge_file, os.path.join(d, "merges.txt"))
            tok = GPT2TokenizerFast.from_pretrained(d, local_files_only=True)
            tok.source_files = (vocab_file, merge_file)
    except Exception as exc:  # noqa: BLE001 - the tokenizers library raises several types on bad files
        raise UserError(f"{vocab_file} / {merge_file}: not a GPT-2 BPE tokenizer ({type(exc).__name__}: "
                        f"{str(exc).splitlines()[0][:120] if str(exc) else ''})") from None
    if len(tok) != vocab:
        raise UserError(f"{vocab_file}: {len(tok)} tokens, the checkpoint's vocabulary has {vocab}: give the "
                        "tokenizer files it was trained with")
    return tok


def to_hf(load: str, output: str, *, iteration: int | None = None, dtype: str = "fp32", vocab_file: str | None = None,
          merge_file: str | None = None, max_shard_size: str = "5GB", force: bool = False, log: Log = print) -> None:
    from huggingface_hub import save_torch_state_dict
    from transformers import GenerationConfig

    reader = CheckpointReader(load, iteration)
    log(reader.describe())
    meta, args = reader.model_meta, reader.args
    tok = _tokenizer(reader, vocab_file, merge_file)
    shard = parse_size(max_shard_size)
    weights = reader.read_weights()
    sd = hf_gpt2.to_hf(weights, meta["num_layers"], meta["num_attention_heads"])
    del weights
    sd.pop("lm_head.weight")                    # tied to transformer.wte.weight: HF re-ties it on load
    sd = {k: v.to(_DTYPES[dtype]).contiguous() for k, v in sd.items()}
    config = hf_config_for(meta, args, dtype)
    with atomic_output(output, force=force) as tmp:
        save_torch_state_dict(sd, tmp, max_shard_size=shard)
        config.save_pretrained(tmp)
        GenerationConfig.from_model_config(config).save_pretrained(tmp)
        tok.save_pretrained(tmp)
        # the slow-tokenizer files too: older transformers and other BPE readers use them
        shutil.copyfile(tok.source_files[0], os.path.join(tmp, "vocab.json"))
        shutil.copyfile(tok.source_files[1], os.path.join(tmp, "merges.txt"))
    _wrote(log, output)
    log(f"  GPT2LMHeadModel, {dtype}, from the fp32 master weights: AutoModelForCausalLM.from_pretrained({output!r})")


def hf_config_for(meta: dict, args: dict, dtype: str = "fp32"):
    return hf_gpt2.hf_config(meta, dtype=_HF_DTYPE_NAMES[dtype], hidden_dropout=float(args.get("hidden_dropout") or 0.0),
                             attention_dropout=float(args.get("attention_dropout") or 0.0))


def from_hf(input_dir: str, output: str, *, tensor_parallel: int, force: bool = False, log: Log = print) -> None:
    from transformers import AutoConfig, GPT2LMHeadModel

    if not os.path.isdir(input_dir):
        hub_id = not os.path.isabs(input_dir) and not input_dir.startswith(".") and input_dir.count("/") <= 1 \
            and not os.path.exists(input_dir)
        if hub_id:                     # e.g. "gpt2", "openai-community/gpt2": a name on the Hub
            local = input_dir.rstrip("/").split("/")[-1]
            raise UserError(f"--input {input_dir}: no such directory; conversion reads a local model directory (it "
                            f"downloads nothing): if {input_dir!r} is a Hugging Face Hub id, fetch it first with "
                            f"`huggingface-cli download {input_dir} --local-dir {local}` and pass --input {local}")
        raise UserError(f"--input {input_dir}: no such directory; point it at a Hugging Face model directory")
    if not os.path.isfile(os.path.join(input_dir, "config.json")):
        raise UserError(f"{input_dir}: no config.json: not a Hugging Face model directory")
    try:
        cfg = AutoConfig.from_pretrained(input_dir, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise UserError(f"{input_dir}/config.json: cannot be read ({str(exc).splitlines()[0][:160]})") from None
    meta = hf_gpt2.meta_from_hf_config(cfg, os.path.join(input_dir, "config.json"))
    check_tensor_parallel(meta, tensor_parallel)
    try:
        model = GPT2LMHeadModel.from_pretrained(input_dir, local_files_only=True, dtype=torch.float32,
                                                use_safetensors=None)
    except (OSError, ValueError, RuntimeError) as exc:
        raise UserError(f"{input_dir}: the weights cannot be loaded ({type(exc).__name__}: "
                        f"{str(exc).splitlines()[0][:200] if str(exc) else ''})") from None
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    weights = hf_gpt2.from_hf(sd, meta["num_layers"], meta["num_attention_heads"])
    n = sum(t.numel() for t in weights.values())
    log(f"read {input_dir}: Hugging Face GPT2LMHeadModel, {meta['num_layers']} layers x {meta['hidden_size']} "
        f"hidden, {meta['num_attention_heads']} heads, vocab {meta['vocab_size']}, {n:,} parameters")
    args = {"make_vocab_size_divisible_by": DEFAULT_DIVISIBLE_BY,
            "hidden_dropout": cfg.resid_pdrop, "attention_dropout": cfg.attn_pdrop}
    _write_weights_checkpoint(output, weights, meta, tp=tensor_parallel, args=args, force=force, log=log,
                              converted_from=f"Hugging Face GPT2LMHeadModel {os.path.abspath(input_dir)}")


# ---------------------------------------------------------------- Megatron-LM

def to_megatron(load: str, output: str, *, iteration: int | None = None, tensor_parallel: int | None = None,
                force: bool = False, log: Log = print) -> None:
    reader = CheckpointReader(load, iteration)
    log(reader.describe())
    meta, args = reader.model_meta, reader.args
    tp = tensor_parallel or reader.layout[0]
    check_tensor_parallel(meta, tp)
    weights = reader.read_weights()
    ns = megatron_lm.megatron_args(meta, tp=tp, iteration=reader.iteration, divisible_by=_divisible_by(args),
                                   seq_length=args.get("seq_length"), precision=args.get("precision"),
                                   consumed_samples=int(reader.manifest.get("consumed_samples", 0)),
                                   consumed_valid_samples=int(reader.manifest.get("consumed_valid_samples", 0)))
    with atomic_output(output, force=force) as tmp:
        megatron_lm.write(tmp, weights, ns, progress=Progress("writing TP ranks"))
    _wrote(log, output)
    log(f"  Megatron-LM torch format, TP{tp}, iteration {reader.iteration}: load it in Megatron-LM with "
        "--finetune (no optimizer or RNG state is included)")


def from_megatron(input_dir: str, output: str, *, tensor_parallel: int, force: bool = False, log: Log = print) -> None:
    if not os.path.isdir(input_dir):
        raise UserError(f"--input {input_dir}: no such directory; point it at a Megatron-LM checkpoint directory")
    weights, ns, it, vocab = megatron_lm.read(input_dir, progress=Progress("reading TP ranks"))
    meta = dict(num_layers=ns.num_layers, hidden_size=ns.hidden_size, num_attention_heads=ns.num_attention_heads,
                ffn_hidden_size=getattr(ns, "ffn_hidden_size", None) or 4 * ns.hidden_size,
                max_position_embeddings=ns.max_position_embeddings, vocab_size=vocab)
    expected = _expected_shapes(meta)
    got = {k: tuple(v.shape) for k, v in weights.items()}
    if got != expected:
        missing = sorted(set(expected) - set(got)) or sorted(k for k in got if got[k] != expected.get(k))
        raise UserError(f"{input_dir}: the weights do not match the model its args describe (first: "
                        f"{missing[0]!r}): not a GPT-2-architecture megatron-core model")
    n = sum(t.numel() for t in weights.values())
    log(f"read {input_dir}: Megatron-LM iteration {it}, TP{ns.tensor_model_parallel_size}, {meta['num_layers']} "
        f"layers x {meta['hidden_size']} hidden, vocab {vocab}, {n:,} parameters")
    args = {"make_vocab_size_divisible_by": int(getattr(ns, "make_vocab_size_divisible_by", DEFAULT_DIVISIBLE_BY)),
            "seq_length": getattr(ns, "seq_length", None)}
    _write_weights_checkpoint(output, weights, meta, tp=tensor_parallel, args=args, force=force, log=log,
                              converted_from=f"Megatron-LM {os.path.abspath(input_dir)} iteration {it}")


def _expected_shapes(meta: dict) -> dict[str, tuple[int, ...]]:
    """Full unpadded shapes of every parameter of the GPT described by meta (our names)."""
    h, f, v, p = meta["hidden_size"], meta["ffn_hidden_size"], meta["vocab_size"], meta["max_position_embeddings"]
    out = {"gpt.embedding.word_embeddings.weight": (v, h), "gpt.embedding.position_embeddings.weight": (p, h),
           "gpt.decoder.final_layernorm.weight": (h,), "gpt.decoder.final_layernorm.bias": (h,)}
    for i in range(meta["num_layers"]):
        m = f"gpt.decoder.layers.{i}."
        out.update({m + "input_layernorm.weight": (h,), m + "input_layernorm.bias": (h,),
                    m + "self_attention.linear_qkv.weight": (3 * h, h), m + "self_attention.linear_qkv.bias": (3 * h,),
                    m + "self_attention.linear_proj.weight": (h, h), m + "self_attention.linear_proj.bias": (h,),
                    m + "pre_mlp_layernorm.weight": (h,), m + "pre_mlp_layernorm.bias": (h,),
                    m + "mlp.linear_fc1.weight": (f, h), m + "mlp.linear_fc1.bias": (f,),
                    m + "mlp.linear_fc2.weight": (h, f), m + "mlp.linear_fc2.bias": (h,)})
    return out


# ---------------------------------------------------------------- consolidated fp32

def to_fp32(load: str, output: str, *, iteration: int | None = None, max_shard_size: str = "5GB",
            force: bool = False, log: Log = print) -> None:
    """The fp32 master weights under the model's parameter names as safetensors: OUTPUT.safetensors
    as one file, or a directory with model.safetensors or shards + model.safetensors.index.json."""
    import json

    from safetensors.torch import save_file

    reader = CheckpointReader(load, iteration)
    log(reader.describe())
    limit = parse_size(max_shard_size)
    names = list(reader.shapes)
    one_file = output.endswith(".safetensors")
    groups: list[list[str]] = [[]]
    size = 0
    for n in names:
        b = 4 * math.prod(reader.shapes[n])
        if groups[-1] and size + b > limit and not one_file:
            groups.append([])
            size = 0
        groups[-1].append(n)
        size += b
    meta = {"format": "pt", "source": os.path.abspath(reader.dir), "iteration": str(reader.iteration)}
    progress = Progress("writing shards")
    with atomic_output(output, force=force, is_dir=not one_file) as tmp:
        if one_file:
            save_file(reader.read_weights(names), tmp, metadata=meta)
        elif len(groups) == 1:
            save_file(reader.read_weights(names), os.path.join(tmp, "model.safetensors"), metadata=meta)
        else:
            weight_map = {}
            for i, group in enumerate(groups, 1):
                fname = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
                save_file(reader.read_weights(group), os.path.join(tmp, fname), metadata=meta)
                weight_map.update({n: fname for n in group})
                progress(i, len(groups))
            index = {"metadata": {"total_size": sum(4 * math.prod(reader.shapes[n]) for n in names)},
                     "weight_map": weight_map}
            with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
                json.dump(index, f, indent=2)
    _wrote(log, output)
    log(f"  {len(names)} fp32 tensors, {reader.num_parameters():,} parameters, full (TP-merged, no vocab padding)")


# ---------------------------------------------------------------- reshard

def reshard(load: str, output: str, *, target_tp: int, target_dp: int | None = None, iteration: int | None = None,
            force: bool = False, log: Log = print) -> None:
    """Rewrite a checkpoint (weights, optimizer state, counters, RNG) laid out for TP x DP."""
    reader = CheckpointReader(load, iteration)
    log(reader.describe())
    src_tp, src_dp = reader.layout
    dp = target_dp or src_dp
    if dp < 1:
        raise UserError(f"--target-data-parallel-size {dp}: must be >= 1")
    meta, args = reader.model_meta, reader.args
    check_tensor_parallel(meta, target_tp, "--target-tensor-parallel-size")
    prefixes = [MODEL] + ([EXP_AVG, EXP_AVG_SQ] if reader.has_optimizer_state else [])
    dtypes = {p: reader.dtype(p + next(iter(reader.shapes))) for p in prefixes}
    specs = _tp_specs(reader.shapes, prefixes, dtypes, target_tp,
                      padded_vocab_size(meta["vocab_size"], _divisible_by(args), target_tp))
    cache: dict[str, torch.Tensor] = {}

    def fetch(key: str, box: Box) -> torch.Tensor:
        if key not in cache:                    # one full tensor at a time: memory stays ~ the largest one
            cache.clear()
            cache[key] = reader.read_full([key])[key]
        return _slice(cache[key], box)

    rng, same_tp = {}, src_tp == target_tp
    for t in range(target_tp):
        for d in range(dp):
            state = reader.rng_file(rng_file(t if same_tp else 0, 0))
            if state is not None:
                rng[rng_file(t, d)] = state
    manifest = {k: v for k, v in reader.manifest.items()
                if k not in ("files", "checksums", "format", "format_version", "iteration")}
    manifest["layout"] = {"tensor_parallel": target_tp, "data_parallel": dp}
    manifest["resharded_offline_from"] = {"tensor_parallel": src_tp, "data_parallel": src_dp}
    if not same_tp:
        # DP replicas share every stream; other TP ranks' dropout streams cannot be derived
        manifest["rng_model_parallel_streams"] = False
    with atomic_output(output, force=force) as tmp:
        write_checkpoint(tmp, iteration=reader.iteration, specs=specs, fetch=fetch, manifest=manifest,
                         rng_files=rng, progress=Progress("writing tensors"))
    _wrote(log, output)
    log(f"  resharded TP{src_tp} x DP{src_dp} -> TP{target_tp} x DP{dp}: "
        f"{'weights and optimizer state' if len(prefixes) == 3 else 'weights'}, iteration {reader.iteration}"
        + ("" if same_tp else "; RNG: the streams shared by all TP ranks (dropout streams are re-seeded)"))
