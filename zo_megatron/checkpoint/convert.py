"""Checkpoint conversion: the library behind tools/convert_checkpoint.py (docs/checkpoints.md).

    to-hf          zo_megatron checkpoint -> Hugging Face model directory (+ tokenizer)
    from-hf        Hugging Face model directory -> zo_megatron checkpoint (weights only) at TP=N
                   (GPT2LMHeadModel, LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM: checkpoint/hf/)
    to-megatron    zo_megatron checkpoint -> Megatron-LM `torch` checkpoint at TP x EP (megatron_lm.py)
    from-megatron  Megatron-LM `torch` checkpoint (any TP x EP) -> zo_megatron checkpoint (weights only) at TP=N
    to-fp32        zo_megatron checkpoint -> consolidated fp32 master weights (safetensors)
    reshard        zo_megatron checkpoint -> the same checkpoint laid out for TP=N x DP=M

Everything goes through FULL unpadded tensors (the checkpoint's own keys, content.py), read with
reader.py and written with writer.py, so there is one reader and one writer of our format. The
weights always come from the fp32 master copy. A checkpoint's Hugging Face tokenizer lives in
its iteration's `tokenizer/` folder, as the job's saves keep it (from-hf copies it there, to-hf
copies it out). Every output is written under a temporary name
and renamed when complete (writer.atomic_output).
"""
from __future__ import annotations

import json
import math
import os
import shutil
import sys
import tempfile
import time
from typing import Callable

import torch

from zo_megatron.checkpoint import hf, megatron_args, megatron_dist, megatron_lm
from zo_megatron.checkpoint.arch import (buffer_shapes, check_tensor_parallel, full_meta, job_flags,
                                         needs_no_bias_gelu_fusion, param_shapes, query_groups, recentred_gamma,
                                         window_flags)
from zo_megatron.checkpoint.boxes import Box
from zo_megatron.checkpoint.content import BUFFERS, EXP_AVG, EXP_AVG_SQ, MODEL
from zo_megatron.checkpoint.layout import rng_file
from zo_megatron.checkpoint.reader import CheckpointReader
from zo_megatron.checkpoint.tp_layout import gated_mlp, padded_vocab_size, tp_axis, tp_shard_boxes
from zo_megatron.checkpoint.writer import TensorSpec, atomic_output, copy_hf_tokenizer, tree_bytes, write_checkpoint
from zo_megatron.data.tokenizer import CHECKPOINT_TOKENIZER_DIR as TOKENIZER_DIR
from zo_megatron.data.tokenizer import HF_TOKENIZER_FILES, check_hf_tokenizer_dir
from zo_megatron.errors import UserError
from zo_megatron.planner.window import from_hf_window, hf_window

Log = Callable[[str], None]
DEFAULT_DIVISIBLE_BY = 128                      # Megatron's --make-vocab-size-divisible-by default
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_HF_DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
GENERATION_CONFIG = "generation_config.json"


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
    from zo_megatron.planner.units import parse_bytes

    try:
        return parse_bytes(text)
    except ValueError as e:
        raise UserError(f"--max-shard-size {e}") from None


def _wrote(log: Log, path: str) -> None:
    n, size = tree_bytes(path)
    log(f"wrote {path}: {n} file{'s' if n != 1 else ''}, {size:,} bytes ({size / 1e9:.2f} GB)")


def _divisible_by(args: dict) -> int:
    return int(args.get("make_vocab_size_divisible_by") or DEFAULT_DIVISIBLE_BY)


def _tp_specs(shapes: dict[str, tuple[int, ...]], prefixes: list[str], dtypes: dict[str, torch.dtype],
              tp: int, padded_vocab: int, swiglu: bool) -> list[TensorSpec]:
    """Each key stored as the boxes its TP shards hold at `tp` (two per rank for SwiGLU's fc1;
    vocab padding rows are not stored)."""
    out = []
    for prefix in prefixes:
        for name, shape in shapes.items():
            ranks = range(tp) if tp_axis(name) is not None else [0]
            boxes = [b for r in ranks for b in tp_shard_boxes(name, shape, r, tp, padded_vocab, swiglu)]
            out.append(TensorSpec(prefix + name, shape, dtypes[prefix], tuple(boxes)))
    return out


def _slice(t: torch.Tensor, box: Box) -> torch.Tensor:
    for axis, (o, n) in enumerate(zip(box.offsets, box.sizes)):
        t = t.narrow(axis, o, n)
    return t


def _write_weights_checkpoint(output: str, weights: dict[str, torch.Tensor], meta: dict, *, tp: int,
                              converted_from: str, args: dict, force: bool, log: Log, extra: dict | None = None,
                              tokenizer_from: str | None = None,
                              buffers: dict[str, torch.Tensor] | None = None) -> None:
    """A weights-only zo_megatron checkpoint (iteration 0) for `pretrain_gpt.py --load`; the
    Hugging Face tokenizer files found in `tokenizer_from` go to its iter_0000000/tokenizer/; the
    model's persistent buffers (arch.buffer_shapes: the router expert bias) under `buffers/`."""
    check_tensor_parallel(meta, tp)
    shapes = {n: tuple(t.shape) for n, t in weights.items()}
    expected = param_shapes(meta)
    if shapes != expected:                      # a mapping bug, never the user's input
        bad = sorted(set(shapes) ^ set(expected)) or sorted(k for k in shapes if shapes[k] != expected[k])
        raise RuntimeError(f"converted weights do not match the architecture (first: {bad[0]})")
    specs = _tp_specs(shapes, [MODEL], {MODEL: torch.float32}, tp,
                      padded_vocab_size(meta["vocab_size"], _divisible_by(args), tp), gated_mlp(meta))
    buffers = buffers or {}
    if {n: tuple(t.shape) for n, t in buffers.items()} != buffer_shapes(meta):   # a mapping bug, as above
        raise RuntimeError(f"converted buffers {sorted(buffers)} do not match the architecture's")
    specs += [TensorSpec(BUFFERS + n, tuple(t.shape), torch.float32, (Box((0,) * t.dim(), tuple(t.shape), 0),))
              for n, t in buffers.items()]
    has_tokenizer = tokenizer_from is not None and any(
        os.path.isfile(os.path.join(tokenizer_from, n)) for n in HF_TOKENIZER_FILES)
    manifest = {"weights_only": True, "converted_from": converted_from, "model": meta, "params": shapes,
                "layout": {"tensor_parallel": tp, "data_parallel": 1},
                "optimizer": {"kind": "none", "step": 0, "loss_scaler": {}}, "args": args,
                "consumed_samples": 0, "consumed_valid_samples": 0, **(extra or {}),
                **({"tokenizer_type": "HuggingFaceTokenizer"} if has_tokenizer else {})}
    with atomic_output(output, force=force) as tmp:
        d = write_checkpoint(tmp, iteration=0, specs=specs, manifest=manifest,
                             fetch=lambda key, box: _slice(weights[key.removeprefix(MODEL)] if key.startswith(MODEL)
                                                           else buffers[key.removeprefix(BUFFERS)], box).float(),
                             progress=Progress("writing tensors"), tokenizer_from=tokenizer_from)
        tok_dir = os.path.join(output, os.path.relpath(d, tmp), TOKENIZER_DIR)
    _wrote(log, output)
    if has_tokenizer:
        log(f"  tokenizer: --tokenizer-type HuggingFaceTokenizer --tokenizer-model {tok_dir}")
    elif tokenizer_from is not None:
        log(f"  no tokenizer files in {tokenizer_from}: give the job the model's tokenizer (--tokenizer-model DIR); "
            "to-hf will need --tokenizer-model DIR")
    log(f"  model flags: {job_flags(meta, hf_tokenizer=has_tokenizer)}")
    if meta.get("num_experts") is not None:
        log(f"  weights only at TP{tp}, a mixture of {meta['num_experts']} experts: `pretrain_gpt.py --load {output}` "
            "starts from them at iteration 0 with a fresh optimizer at any --expert-model-parallel-size that divides "
            f"{meta['num_experts']} (docs/moe.md)")
    else:
        log(f"  weights only at TP{tp}: `pretrain_gpt.py --load {output}` starts from them at iteration 0 with a "
            "fresh optimizer (any DP size)")


# ---------------------------------------------------------------- Hugging Face

def _gpt2_tokenizer(reader: CheckpointReader, vocab_file: str | None, merge_file: str | None):
    """The GPT-2 BPE tokenizer a checkpoint without a tokenizer/ folder was trained with."""
    from transformers import GPT2TokenizerFast

    from zo_megatron.data.tokenizer import BUNDLED_MERGE_FILE, BUNDLED_VOCAB_FILE

    vocab = reader.model_meta["vocab_size"]
    if bool(vocab_file) != bool(merge_file):
        raise UserError("give both --vocab-file and --merge-file (the tokenizer the checkpoint was trained with)")
    if not vocab_file:
        if reader.manifest.get("tokenizer_type") == "NullTokenizer":
            raise UserError(f"{reader.dir}: trained with --tokenizer-type NullTokenizer (ids, no text): a Hugging "
                            f"Face model needs the tokenizer that made those ids: pass --tokenizer-model DIR")
        if reader.args.get("allow_custom_vocab") or vocab != megatron_lm.GPT2_VOCAB:
            raise UserError(f"{reader.dir}: trained with a vocabulary that is not GPT-2's ({vocab} tokens) and no "
                            f"{TOKENIZER_DIR}/ folder: pass --tokenizer-model DIR (a Hugging Face tokenizer) or "
                            "its --vocab-file and --merge-file")
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


def _hf_tokenizer(tok_dir: str, vocab: int):
    """A Hugging Face tokenizer directory (never trust_remote_code); it must fit the vocabulary."""
    from transformers import AutoTokenizer

    check_hf_tokenizer_dir(tok_dir)             # the job's checks: tokenizer.json, no remote code
    try:
        tok = AutoTokenizer.from_pretrained(tok_dir, local_files_only=True, trust_remote_code=False)
    except Exception as exc:  # noqa: BLE001 - transformers/tokenizers raise many types on bad files
        raise UserError(f"{tok_dir}: not a Hugging Face tokenizer directory ({type(exc).__name__}: "
                        f"{str(exc).splitlines()[0][:160] if str(exc) else ''})") from None
    if len(tok) > vocab:
        raise UserError(f"{tok_dir}: the tokenizer has {len(tok)} tokens, more than the model's vocabulary "
                        f"({vocab}): it is not the tokenizer the model was trained with")
    return tok


def to_hf(load: str, output: str, *, iteration: int | None = None, dtype: str = "fp32", vocab_file: str | None = None,
          merge_file: str | None = None, tokenizer_model: str | None = None, architecture: str | None = None,
          max_shard_size: str = "5GB", force: bool = False, log: Log = print) -> None:
    from huggingface_hub import save_torch_state_dict
    from transformers import GenerationConfig

    reader = CheckpointReader(load, iteration)
    log(reader.describe())
    meta, args = full_meta(reader.model_meta), reader.args
    # (a family that cannot express the model's sliding window is refused: hf.why_not)
    family = hf.family_for_model({**meta, "layernorm_zero_centered_gamma": False},
                                 architecture or reader.manifest.get("hf_architecture"),
                                 reader.dir)       # a zero-centred gamma is folded into the weights below
    window = hf_window(meta["window_size"], meta["window_attn_skip_freq"], meta["num_layers"])
    shard = parse_size(max_shard_size)
    saved_tok = os.path.join(reader.dir, TOKENIZER_DIR)         # the tokenizer the run trained with
    if reader.manifest.get("tokenizer_type") == "Llama2Tokenizer" and tokenizer_model is None:
        raise UserError(f"{reader.dir}: trained with --tokenizer-type Llama2Tokenizer (the SentencePiece model in "
                        f"{TOKENIZER_DIR}/): pass --tokenizer-model DIR, a Hugging Face tokenizer directory of the "
                        "same model (e.g. the one its Hugging Face release ships), for the tokenizer to-hf writes")
    tok_dir = tokenizer_model or (saved_tok if os.path.isdir(saved_tok) else None)
    if tok_dir is not None:
        tok = _hf_tokenizer(tok_dir, meta["vocab_size"])
        special = dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    else:
        tok = _gpt2_tokenizer(reader, vocab_file, merge_file)
        special = dict(bos_token_id=None, eos_token_id=None)
    source = reader.manifest.get("hf_config") or {}
    generation = reader.manifest.get("hf_generation_config")
    if tokenizer_model is None:                 # the model's own ids (an eos list), not one tokenizer's
        special.update({k: v for k, v in source.items() if k in special})
    # HF's norms scale by the weight, or by 1 + weight in a family with zero-centred norms (Nemotron's)
    weights, meta = recentred_gamma(reader.read_weights(), meta, zero_centred=family.zero_centred_norms)
    # the model's persistent buffers (the router expert bias: DeepSeek-V3's e_score_correction_bias) by their names
    weights.update({k.removeprefix(BUFFERS): t.float() for k, t in
                    reader.read_full([BUFFERS + n for n in buffer_shapes(meta)]).items()})
    sd = family.to_hf_state(weights, meta)
    del weights
    sd = {k: v.to(torch.float32 if k.endswith(family.fp32_tensors) else _DTYPES[dtype]).contiguous()
          for k, v in sd.items()}
    config = family.hf_config(meta, dtype=_HF_DTYPE_NAMES[dtype], args=args, window=window, **special)
    with atomic_output(output, force=force) as tmp:
        save_torch_state_dict(sd, tmp, max_shard_size=shard)
        config.save_pretrained(tmp)
        extra = family.config_json_extra(meta)
        if extra:                               # the other transformers schema's keys too
            path = os.path.join(tmp, hf.CONFIG)
            with open(path) as f:
                written = json.load(f)
            with open(path, "w") as f:
                json.dump({**written, **extra}, f, indent=2, sort_keys=True)
                f.write("\n")
        if generation is not None and tokenizer_model is None:     # the source's, as it was
            with open(os.path.join(tmp, GENERATION_CONFIG), "w") as f:
                json.dump(generation, f, indent=2)
                f.write("\n")
        else:
            GenerationConfig.from_model_config(config).save_pretrained(tmp)
        if tok_dir is not None:                 # the tokenizer's own files, as they are
            copy_hf_tokenizer(tok_dir, tmp)
        else:
            tok.save_pretrained(tmp)
            # the slow-tokenizer files too: older transformers and other BPE readers use them
            shutil.copyfile(tok.source_files[0], os.path.join(tmp, "vocab.json"))
            shutil.copyfile(tok.source_files[1], os.path.join(tmp, "merges.txt"))
    _wrote(log, output)
    log(f"  {family.architecture}, {dtype}, from the fp32 master weights: "
        f"AutoModelForCausalLM.from_pretrained({output!r})")


def from_hf(input_dir: str, output: str, *, tensor_parallel: int, force: bool = False, log: Log = print) -> None:
    cfg_json = hf.read_config_json(input_dir)
    family = hf.family_for_config(cfg_json, input_dir)
    where = os.path.join(input_dir, hf.CONFIG)
    cfg = family.read_config(cfg_json, where)
    meta, run_args = family.meta_from_config(cfg, where)
    window = family.attention_window(cfg)       # the window transformers' model of this config applies
    if window is not None:
        try:
            size, freq = from_hf_window(window["tokens"], window["layers"], meta["num_layers"])
        except ValueError as exc:
            raise UserError(f"{where}: {exc}") from None
        meta = full_meta({**meta, "window_size": size, "window_attn_skip_freq": freq})
    check_tensor_parallel(meta, tensor_parallel)
    hf.weight_files(input_dir)                  # no weights: one line before anything is read
    weights = family.read_state(input_dir, cfg, meta)
    # the persistent buffers (arch.buffer_shapes: the router expert bias) the family read with the weights
    buffers = {name: weights.pop(name) for name in buffer_shapes(meta) if name in weights}
    n = sum(t.numel() for t in weights.values())
    groups = f", {query_groups(meta)} KV groups" if query_groups(meta) != meta["num_attention_heads"] else ""
    log(f"read {input_dir}: Hugging Face {family.architecture}, {meta['num_layers']} layers x {meta['hidden_size']} "
        f"hidden, {meta['num_attention_heads']} heads{groups}, vocab {meta['vocab_size']}, {n:,} parameters")
    left_out = family.left_out(input_dir, cfg)
    if left_out:
        log(f"  left out: {left_out}")
    args = {"make_vocab_size_divisible_by": meta["make_vocab_size_divisible_by"], **run_args}
    extra = {"hf_architecture": family.architecture, **_hf_source(input_dir, cfg_json)}
    _write_weights_checkpoint(output, weights, meta, tp=tensor_parallel, args=args, force=force, log=log,
                              converted_from=f"Hugging Face {family.architecture} {os.path.abspath(input_dir)}",
                              extra=extra, tokenizer_from=input_dir, buffers=buffers)
    if window is not None:
        log(f"  attention: a sliding window of {window['tokens']} tokens ({len(window['layers'])} of "
            f"{meta['num_layers']} layers): --window-size {meta['window_size'][0]},0"
            + (" and --window-attn-skip-freq" if meta["window_attn_skip_freq"] is not None else "")
            + " in the model (checkpoint and flags), trained exactly on torch SDPA (--use-flash-attn) at any "
            "--seq-length; to-hf writes it back")


def _hf_source(input_dir: str, cfg_json: dict) -> dict:
    """What to-hf writes back besides the architecture: config.json's special token ids as the
    model's config has them (Llama-3.x Instruct's eos_token_id is a list; a tokenizer has one eos),
    and generation_config.json as it is (sampling settings, eos lists)."""
    out = {"hf_config": {k: cfg_json[k] for k in ("bos_token_id", "eos_token_id") if cfg_json.get(k) is not None}}
    path = os.path.join(input_dir, GENERATION_CONFIG)
    if os.path.isfile(path):
        try:
            with open(path) as f:
                gen = json.load(f)
        except (OSError, ValueError) as exc:
            raise UserError(f"{path}: cannot be read as JSON ({str(exc).splitlines()[0][:160]}); fix or remove "
                            "it") from None
        if not isinstance(gen, dict):
            raise UserError(f"{path}: not a JSON object; fix or remove it")
        out["hf_generation_config"] = gen
    return out


# ---------------------------------------------------------------- Megatron-LM

def to_megatron(load: str, output: str, *, iteration: int | None = None, tensor_parallel: int | None = None,
                expert_parallel: int | None = None, expert_tensor_parallel: int | None = None,
                grouped_gemm: bool = False, ckpt_format: str = "torch", transformer_impl: str | None = None,
                force: bool = False, log: Log = print) -> None:
    """expert_parallel: EP ranks to write (default: the checkpoint's; 1 for a dense model);
    expert_tensor_parallel: the experts' TP (default: the checkpoint's at its TP, else TP);
    grouped_gemm: the experts as a --moe-grouped-gemm run holds them (the local spec's GroupedMLP,
    Transformer Engine's TEGroupedMLP);
    ckpt_format: Megatron-LM's torch format (rank files) or torch_dist (global tensors, any layout);
    transformer_impl: Megatron-LM's --transformer-impl whose layer names and layout are written, local or
    transformer_engine (default: transformer_engine for multi-latent attention, which Megatron-LM builds only
    with Transformer Engine, else local)."""
    if ckpt_format not in ("torch", "torch_dist"):
        raise UserError(f"--ckpt-format {ckpt_format}: Megatron-LM's formats written are torch and torch_dist")
    if transformer_impl not in (None, *megatron_lm.TRANSFORMER_IMPLS):
        raise UserError(f"--transformer-impl {transformer_impl}: the layer names written are Megatron-LM's "
                        f"{' and '.join(megatron_lm.TRANSFORMER_IMPLS)}")
    reader = CheckpointReader(load, iteration)
    log(reader.describe())
    meta, args = full_meta(reader.model_meta), reader.args
    impl = transformer_impl or ("transformer_engine" if meta["multi_latent_attention"] else "local")
    tp = tensor_parallel or reader.layout[0]
    check_tensor_parallel(meta, tp)
    if meta["num_experts"] is not None and (meta["moe_shared_expert_intermediate_size"] or 0) % tp:
        raise UserError(f"--tensor-parallel {tp} does not divide the shared expert's FFN size "
                        f"{meta['moe_shared_expert_intermediate_size']}: choose a TP size that divides it")
    saved_ep = int(reader.manifest.get("layout", {}).get("expert_parallel", 1))
    ep = expert_parallel or (saved_ep if meta["num_experts"] is not None else 1)
    etp = None
    if meta["num_experts"] is not None:
        saved_etp = reader.manifest.get("layout", {}).get("expert_tensor_parallel")
        etp = expert_tensor_parallel or (int(saved_etp) if saved_etp and tp == reader.layout[0] else tp)
    elif expert_tensor_parallel not in (None, tp):
        raise UserError(f"--expert-tensor-parallel-size {expert_tensor_parallel}: the model is dense (no experts); "
                        "drop it")
    saved_tok = os.path.join(reader.dir, TOKENIZER_DIR)
    has_tokenizer = os.path.isdir(saved_tok)
    tokenizer_type = (reader.manifest.get("tokenizer_type") or args.get("tokenizer_type")
                      or ("HuggingFaceTokenizer" if has_tokenizer else "GPT2BPETokenizer"))
    if has_tokenizer and tokenizer_type == "Llama2Tokenizer":         # Megatron-LM's: the model file itself
        saved_tok = os.path.join(reader.dir, reader.manifest["tokenizer_files"][0])
    ns = megatron_args.megatron_args(meta, tp=tp, iteration=reader.iteration, divisible_by=_divisible_by(args),
                                   seq_length=args.get("seq_length"), precision=args.get("precision"),
                                   tokenizer_type=tokenizer_type,
                                   tokenizer_model=os.path.abspath(saved_tok) if has_tokenizer else None,
                                   consumed_samples=int(reader.manifest.get("consumed_samples", 0)),
                                   consumed_valid_samples=int(reader.manifest.get("consumed_valid_samples", 0)),
                                   expert_parallel=ep, expert_tensor_parallel=etp, grouped_gemm=grouped_gemm,
                                   ckpt_format=ckpt_format, transformer_impl=impl)
    weights = reader.read_weights()             # after megatron_args: what it refuses is refused before any read
    # the router expert bias: a persistent buffer of megatron-core's router, in Megatron-LM's files under its name
    weights.update({k.removeprefix(BUFFERS): t.float() for k, t in
                    reader.read_full([BUFFERS + n for n in buffer_shapes(meta)]).items()})
    with atomic_output(output, force=force) as tmp:
        if ckpt_format == "torch_dist":
            megatron_dist.write(tmp, weights, ns, log=log)
        else:
            megatron_lm.write(tmp, weights, ns,
                              progress=Progress("writing TP ranks" if ep == 1 else "writing TP x EP ranks"))
    _wrote(log, output)
    if meta["position_embedding_type"] == "yarn":
        log("  note: YaRN's args have Megatron-LM core_v0.19's names (position_embedding_type 'yarn', yarn_*, "
            "rotary_scaling_factor, mscale, mscale_all_dim): core_v0.16.1's pretrain_gpt.py cannot build a YaRN GPT")
    # what Megatron-LM's --use-checkpoint-args does not take from the args (core_v0.16.1 load_args_from_checkpoint):
    # its launch line must say it, or its model computes another function
    needs = (["--no-bias-gelu-fusion"] if needs_no_bias_gelu_fusion(meta) else []) + \
        ([f"--moe-router-num-groups {meta['moe_router_num_groups']}",
          f"--moe-router-group-topk {meta['moe_router_group_topk']}"] if meta["moe_router_group_topk"] else []) + \
        megatron_args.mla_launch_flags(meta) + [f for f in window_flags(meta) if f != "--use-flash-attn"]
    if needs:
        log(f"  note: launch Megatron-LM with {' '.join(needs)}: its --use-checkpoint-args does not take them from "
            "the args, and without them its model computes another function (the tanh GELU, ungrouped routing, "
            "MLA's defaults, full attention) or does not load")
    if meta["use_rope_scaling"] and meta["rope_scaling_factor"] != 8.0:
        # Megatron-LM's GPTModel builders pass rope_scaling but not rope_scaling_factor (core_v0.16.1 to
        # its main branch), so megatron-core's default factor 8 applies there whatever the args say
        log(f"  warning: the model's Llama-3.1 RoPE scaling factor is {meta['rope_scaling_factor']:g}; Megatron-LM's "
            "pretrain_gpt.py passes --use-rope-scaling to its GPTModel but not --rope-scaling-factor, so it would "
            "build factor 8 (megatron-core's default): pass rope_scaling_factor to GPTModel in its model builder")
    moe = "" if meta["num_experts"] is None else (
        (f" x expert TP{etp}" if etp != tp else "")
        + f" x EP{ep} ({meta['num_experts'] // ep} experts per EP rank; --expert-model-parallel-size {ep}"
        + (f", --expert-tensor-parallel-size {etp}" if etp != tp else "")
        + (", --sequence-parallel" if tp > 1 else "") + (", --moe-grouped-gemm" if grouped_gemm else "") + ")")
    fmt = (f"torch_dist format (global tensors: its run loads them at any TP x EP x PP; the args say TP{tp}{moe})"
           if ckpt_format == "torch_dist" else f"torch format, TP{tp}{moe}")
    names = "megatron-core's local layers' names" if impl == "local" else \
        "Transformer Engine's layer names: norms fused into the linear layers, TE's extra states"
    log(f"  Megatron-LM {fmt}, iteration {reader.iteration}: load it in Megatron-LM with --ckpt-format {ckpt_format} "
        f"--transformer-impl {impl} ({names}) and --finetune (no optimizer or RNG state is included)"
        + (f"; its tokenizer: --tokenizer-model {saved_tok}" if has_tokenizer else ""))
    if meta["multi_latent_attention"] and impl == "local":
        log("  note: multi-latent attention with --transformer-impl local: these are megatron-core's local spec's "
            "MLA layers, but Megatron-LM core_v0.16.1 builds MLA only with --transformer-impl transformer_engine (its "
            "local DotProductAttention takes no separate key and value head dims), so no Megatron-LM run loads "
            "them; write them with --transformer-impl transformer_engine (the default for MLA)")


def from_megatron(input_dir: str, output: str, *, tensor_parallel: int, iteration: int | None = None,
                  vocab_size: int | None = None, tokenizer_model: str | None = None, force: bool = False,
                  log: Log = print) -> None:
    """vocab_size / tokenizer_model: the run's vocabulary / Hugging Face tokenizer when its args lack
    them (Megatron-LM saves no vocab_size without --vocab-size); iteration: default the tracker's."""
    if not os.path.isdir(input_dir):
        raise UserError(f"--input {input_dir}: no such directory; point it at a Megatron-LM checkpoint directory")
    if vocab_size is not None and vocab_size < 1:
        raise UserError(f"--vocab-size {vocab_size}: must be >= 1")
    dist = megatron_dist.is_torch_dist(megatron_lm.find_iteration_dir(input_dir, iteration)[0])
    read = megatron_dist.read if dist else megatron_lm.read
    weights, ns, it, vocab = read(input_dir, iteration=iteration,
                                  progress=Progress("reading the torch_dist tensors" if dist else "reading rank files"),
                                  vocab_size=vocab_size, tokenizer_model=tokenizer_model)
    meta = megatron_args.meta_from_args(ns, vocab, os.path.join(input_dir, megatron_lm.TRACKER))
    buffers = {n: weights.pop(n).float() for n in buffer_shapes(meta) if n in weights}
    missing = sorted(set(buffer_shapes(meta)) - set(buffers))
    if missing:
        raise UserError(f"{input_dir}: args.moe_router_enable_expert_bias is set but the files hold no "
                        f"{megatron_lm.ours_to_megatron(missing[0])}: not the run the args describe (point --input at "
                        "the run's own checkpoint directory)")
    expected = param_shapes(meta)
    got = {k: tuple(v.shape) for k, v in weights.items()}
    if got != expected:
        missing = sorted(set(expected) - set(got)) or sorted(set(got) - set(expected)) or \
            sorted(k for k in got if got[k] != expected.get(k))
        raise UserError(f"{input_dir}: the weights do not match the model its args describe (first: "
                        f"{missing[0]!r}): not a megatron-core GPT model zo_megatron builds")
    n = sum(t.numel() for t in weights.values())
    etp = getattr(ns, "expert_tensor_parallel_size", None) or ns.tensor_model_parallel_size
    moe = "" if meta["num_experts"] is None else \
        ((f" x expert TP{etp}" if etp != ns.tensor_model_parallel_size else "")
         + f" x EP{getattr(ns, 'expert_model_parallel_size', None) or 1}, {meta['num_experts']} experts")
    pp = getattr(ns, "pipeline_model_parallel_size", None) or 1
    moe += f" x PP{pp}" + ("" if dist else " (merged)") if pp > 1 else ""
    log(f"read {input_dir}: Megatron-LM {'torch_dist' if dist else 'torch'} format, iteration {it}, "
        f"{'saved at ' if dist else ''}TP{ns.tensor_model_parallel_size}{moe}, {meta['num_layers']} "
        f"layers x {meta['hidden_size']} hidden, vocab {vocab}, {n:,} parameters")
    args = {"make_vocab_size_divisible_by": meta["make_vocab_size_divisible_by"],
            "seq_length": getattr(ns, "seq_length", None)}
    # Megatron-LM keeps only the tokenizer's path: bring its files along when that directory is here
    tok = tokenizer_model or getattr(ns, "tokenizer_model", None)
    tok = tok if (tokenizer_model or getattr(ns, "tokenizer_type", None) == "HuggingFaceTokenizer") and tok \
        and os.path.isdir(tok) else None
    _write_weights_checkpoint(output, weights, meta, tp=tensor_parallel, args=args, force=force, log=log,
                              converted_from=f"Megatron-LM {os.path.abspath(input_dir)} iteration {it}",
                              tokenizer_from=tok, buffers=buffers)


# ---------------------------------------------------------------- consolidated fp32

def to_fp32(load: str, output: str, *, iteration: int | None = None, max_shard_size: str = "5GB",
            force: bool = False, log: Log = print) -> None:
    """The fp32 master weights under the model's parameter names as safetensors: OUTPUT.safetensors
    as one file, or a directory with model.safetensors or shards + model.safetensors.index.json; the
    model's persistent buffers (the router expert bias) too, under their names, in the first file."""
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
    # the model's persistent buffers (the router expert bias) go with the first file, under their names
    buffer_keys = [k for k in reader.metadata.state_dict_metadata if k.startswith(BUFFERS)]
    buffers = {k.removeprefix(BUFFERS): t.float() for k, t in reader.read_full(buffer_keys).items()} \
        if buffer_keys else {}
    progress = Progress("writing shards")
    with atomic_output(output, force=force, is_dir=not one_file) as tmp:
        if one_file:
            save_file({**reader.read_weights(names), **buffers}, tmp, metadata=meta)
        elif len(groups) == 1:
            save_file({**reader.read_weights(names), **buffers}, os.path.join(tmp, "model.safetensors"), metadata=meta)
        else:
            weight_map = {}
            for i, group in enumerate(groups, 1):
                fname = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
                extra = buffers if i == 1 else {}
                save_file({**reader.read_weights(group), **extra}, os.path.join(tmp, fname), metadata=meta)
                weight_map.update({n: fname for n in [*group, *extra]})
                progress(i, len(groups))
            index = {"metadata": {"total_size": sum(4 * math.prod(reader.shapes[n]) for n in names) +
                                  sum(4 * t.numel() for t in buffers.values())},
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
    meta, args = full_meta(reader.model_meta), reader.args
    check_tensor_parallel(meta, target_tp, "--target-tensor-parallel-size")
    prefixes = [MODEL] + ([EXP_AVG, EXP_AVG_SQ] if reader.has_optimizer_state else [])
    dtypes = {p: reader.dtype(p + next(iter(reader.shapes))) for p in prefixes}
    specs = _tp_specs(reader.shapes, prefixes, dtypes, target_tp,
                      padded_vocab_size(meta["vocab_size"], _divisible_by(args), target_tp), gated_mlp(meta))
    # the model's persistent buffers (content.py `buffers/`: whole tensors, the same at any layout)
    for key, entry in reader.metadata.state_dict_metadata.items():
        if key.startswith(BUFFERS):
            shape = tuple(entry.size)
            specs.append(TensorSpec(key, shape, entry.properties.dtype, (Box((0,) * len(shape), shape, 0),)))
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
                if k not in ("files", "checksums", "format", "format_version", "iteration", "tokenizer_files")}
    manifest["layout"] = {"tensor_parallel": target_tp, "data_parallel": dp}
    manifest["resharded_offline_from"] = {"tensor_parallel": src_tp, "data_parallel": src_dp}
    if not same_tp:
        # DP replicas share every stream; other TP ranks' dropout streams cannot be derived
        manifest["rng_model_parallel_streams"] = False
    with atomic_output(output, force=force) as tmp:
        write_checkpoint(tmp, iteration=reader.iteration, specs=specs, fetch=fetch, manifest=manifest,
                         rng_files=rng, progress=Progress("writing tensors"),
                         tokenizer_from=os.path.join(reader.dir, TOKENIZER_DIR))
    _wrote(log, output)
    log(f"  resharded TP{src_tp} x DP{src_dp} -> TP{target_tp} x DP{dp}: "
        f"{'weights and optimizer state' if len(prefixes) == 3 else 'weights'}, iteration {reader.iteration}"
        + ("" if same_tp else "; RNG: the streams shared by all TP ranks (dropout streams are re-seeded)"))
