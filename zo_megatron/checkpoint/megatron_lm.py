"""Megatron-LM's `torch` checkpoint format for its megatron-core GPT model, both ways.

    DIR/latest_checkpointed_iteration.txt            "N", or "release" for iteration 0
    DIR/iter_000000N/mp_rank_XX/model_optim_rng.pt   one file per TP rank (no pipeline parallelism)
    DIR/iter_000000N/mp_rank_XX_EEE/model_optim_rng.pt   with expert parallelism: one per (TP, EP) rank
    DIR/iter_000000N/mp_rank_XX_PPP[_EEE]/...            read only: one per pipeline stage too
        {"args": argparse.Namespace, "checkpoint_version": 3.0, "iteration": N,
         "model": {megatron-core parameter name: this TP rank's shard, "<linear>._extra_state": None}}
        (--transformer-impl transformer_engine: Transformer Engine's names and extra states, below)
        (a virtual pipeline: "model0", "model1", ... one per model chunk of the stage)

Pipeline stages are read back into one model (megatron_stages.py); to-megatron writes one stage.
The args <-> the architecture: megatron_args.py.

A mixture of experts (megatron-core's local spec, SequentialMLP): the router
(`mlp.router.weight`, replicated), the shared expert (`mlp.shared_experts.*`, split over TP as the
dense MLP, its gate replicated) and the experts by their LOCAL index: EP rank e's file holds
`mlp.experts.local_experts.J.*`, J < E/EP, which is expert e x E/EP + J (megatron-core's
SequentialMLP; Megatron-LM's get_checkpoint_name appends `_{ep_rank:03d}` when EP > 1, and an EP
rank's file holds every dense parameter too). Experts split over expert TP as the MLP over TP
(expert TP = TP by default). With another --expert-tensor-parallel-size the files are those
Megatron-LM's save writes: one per rank of expert-data-parallel rank 0 (legacy_rank_files), each
holding its TP rank's dense shard and its EP rank's experts at its expert TP rank's shard.

Megatron-LM's loader (`megatron/training/checkpointing.py`) reads `checkpoint_version`,
`iteration`, `model` (load_state_dict, strict) and `args` (check_checkpoint_args: num_layers,
hidden_size, num_attention_heads, max_position_embeddings, make_vocab_size_divisible_by,
padded_vocab_size, tokenizer_type, tensor/pipeline_model_parallel_size; with
--use-checkpoint-args the model-shape fields). Its 'release' convention is used for iteration 0
because its tracker parser refuses "0". Files written here hold no optimizer or RNG state: load
them in Megatron-LM with `--finetune` (or `--no-load-optim --no-load-rng`).

Multi-latent attention (MLA): the local spec's names (`self_attention.linear_q_proj`, `linear_q_down_proj`,
`linear_q_up_proj`, `linear_kv_down_proj`, `linear_kv_up_proj`, `q_layernorm`, `kv_layernorm`), every
linear with its `_extra_state`; its ColumnParallelLinear down projections split their rows over TP (our
model keeps linear_kv_down_proj whole, model/mla.py: the full tensor is the same). Transformer Engine's
MLA spec (Megatron-LM's default, and the only one core_v0.16.1 can build MLA with) keeps the two down
projections whole on every TP rank ("duplicated" TELinear), fuses the latents' norms into the up
projections (`linear_q_up_proj.layer_norm_weight`, `linear_kv_up_proj.layer_norm_weight`) and keeps
`input_layernorm` apart; both are read (_whole_on_every_rank, local_name).

Reading never runs pickled code: `torch.load(weights_only=True)` with only plain-data classes
allowed (argparse.Namespace, NumPy arrays for Megatron's saved RNG states, io.BytesIO for
Transformer Engine's extra state, megatron-core's own Enum types and
signal.Signals for args.exit_signal); anything else is refused
with the class named. Both the local layer names and Transformer Engine's fused-LayerNorm names
(`linear_qkv.layer_norm_weight`, ...) are read, and a --moe-grouped-gemm run's experts
(TEGroupedMLP's `linear_fc1.weight{J}`, the legacy GroupedMLP's `weight1` / `weight2`) as
SequentialMLP's (_sequential_experts); to-megatron writes SequentialMLP's, or with --moe-grouped-gemm
the legacy GroupedMLP's that the local spec builds for that flag (_grouped_experts), or TEGroupedMLP's.

to-megatron writes the layer names of the implementation args.transformer_impl names (Megatron-LM's
--transformer-impl): `local` (megatron-core's local spec, above) or `transformer_engine`, what Megatron-LM
core_v0.16.1's get_gpt_layer_with_transformer_engine_spec (and get_gpt_decoder_block_spec with it) builds
and saves (transformer_engine_names, _te_extra_states):

    local spec                                    Transformer Engine spec
    input_layernorm.*                             self_attention.linear_qkv.layer_norm_*
                                                  (TELayerNormColumnParallelLinear)
                                                  MLA: input_layernorm.* (TENorm) + ._extra_state
    pre_mlp_layernorm.* (a dense MLP)             mlp.linear_fc1.layer_norm_* (TELayerNormColumnParallelLinear)
    pre_mlp_layernorm.* (an MoE layer)            pre_mlp_layernorm.* (TENorm) + ._extra_state
    self_attention.q_layernorm.* / k_layernorm.*  the same (TENorm) + ._extra_state
    MLA self_attention.q_layernorm.*              self_attention.linear_q_up_proj.layer_norm_*
    MLA self_attention.kv_layernorm.*             self_attention.linear_kv_up_proj.layer_norm_*
    MLA linear_q_down_proj / linear_kv_down_proj  the same names, WHOLE on every TP rank (TELinear, duplicated)
    decoder.final_layernorm.*                     the same (TENorm) + ._extra_state
    <linear>._extra_state None                    <linear>._extra_state: TE's (every linear of the decoder)
    (none)                                        self_attention.core_attention._extra_state (TEDotProductAttention)
    mlp.experts.weight1 / weight2 (grouped GEMM)  mlp.experts.linear_fc1.weight{J} / linear_fc2.weight{J}
                                                  + their ._extra_state (TEGroupedMLP)
    output_layer._extra_state None                the same (GPTModel's output layer is megatron-core's own)

A TE module's extra state is what it saves without FP8 (Transformer Engine 2.9-2.11, the versions
core_v0.16.1 pins: TransformerEngineBaseModule.get_extra_state and the norms' BasicOperation.get_extra_state
return an empty uint8 tensor when there is no FP8 state; both set_extra_state return at once on it, and on None).
"""
from __future__ import annotations

import argparse
import enum
import importlib
import os
import pickle
import re

import torch

from zo_megatron.checkpoint.megatron_stages import merge_stages, one_stage_model, pipeline_layout
from zo_megatron.checkpoint.tp_layout import (OUTPUT_LAYER, WORD_EMBEDDING, gated_mlp, local_rows, partition_stride,
                                             tp_axis)
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
# Transformer Engine's MLA spec: the latents' norms fused into the up projections (read only: the local
# spec's torch_dist keeps q_layernorm / kv_layernorm, and a q/k norm without MLA keeps its name)
_TE_MLA_NAMES = {f"self_attention.linear_{w}_up_proj.layer_norm_{p}": f"self_attention.{w}_layernorm.{p}"
                 for w in ("q", "kv") for p in ("weight", "bias")}
# MLA's down projections: the local spec's ColumnParallelLinear splits their rows over TP, Transformer
# Engine's duplicated TELinear keeps them whole on every rank
MLA_DOWN = ("self_attention.linear_q_down_proj.weight", "self_attention.linear_kv_down_proj.weight")
_MP_DIR = re.compile(r"^mp_rank_(\d{2})(_\d{3})?(_\d{3})?$")
_EXPERT = re.compile(r"^(.*\.mlp\.experts\.local_experts\.)(\d+)(\..*)$")
# --moe-grouped-gemm's experts: TEGroupedMLP's GroupedLinear (one weight{j} / bias{j} per local expert) and
# the legacy GroupedMLP's two concatenated weights (--moe-use-legacy-grouped-gemm)
_TE_GROUPED = re.compile(r"^(.*\.mlp\.experts\.)(linear_fc[12])\.(weight|bias)(\d+)$")
_LEGACY_GROUPED = re.compile(r"^(.*\.mlp\.experts\.)weight([12])$")


TRANSFORMER_IMPLS = ("local", "transformer_engine")          # Megatron-LM's --transformer-impl, as written
_LAYER = re.compile(r"^(decoder\.layers\.(?:\d+\.)?)(.+)$")       # a layer's key (one layer, or stacked)


def te_extra_state() -> torch.Tensor:
    """A Transformer Engine module's extra state as it saves it without FP8 (TE 2.9-2.11: an empty uint8
    tensor, from TransformerEngineBaseModule.get_extra_state and BasicOperation.get_extra_state alike)."""
    return torch.empty(0, dtype=torch.uint8)


def transformer_engine_names(keys, mla: bool) -> dict[str, str]:
    """{local spec name: Transformer Engine spec name} of parameter names (one rank file's, or every layer's
    before stacking): the norms Megatron-LM core_v0.16.1's get_gpt_layer_with_transformer_engine_spec fuses
    into a TELayerNormColumnParallelLinear renamed (the input norm into linear_qkv -- not under MLA, whose
    input_layernorm is a TENorm --, a dense layer's pre-MLP norm into mlp.linear_fc1, MLA's latent norms into
    linear_q_up_proj / linear_kv_up_proj); every other name is the same. A layer is dense when it has
    mlp.linear_fc1 (an MoE layer's pre_mlp_layernorm is a TENorm and keeps its name)."""
    keys = list(keys)
    dense = {m[1] for m in map(_LAYER.match, keys) if m and m[2].startswith("mlp.linear_fc1.")}
    out = {}
    for k in keys:
        m = _LAYER.match(k)
        new = k
        if m:
            prefix, (module, _, leaf) = m[1], m[2].rpartition(".")
            if module == "input_layernorm" and not mla:
                new = f"{prefix}self_attention.linear_qkv.layer_norm_{leaf}"
            elif module == "pre_mlp_layernorm" and prefix in dense:
                new = f"{prefix}mlp.linear_fc1.layer_norm_{leaf}"
            elif mla and module in ("self_attention.q_layernorm", "self_attention.kv_layernorm"):
                which = module.removeprefix("self_attention.").removesuffix("_layernorm")
                new = f"{prefix}self_attention.linear_{which}_up_proj.layer_norm_{leaf}"
        out[k] = new
    return out


def te_extra_state_modules(keys) -> list[str]:
    """The modules of the decoder that are Transformer Engine modules in its spec, by a rank file's keys
    under TE's names: every linear layer (TELinear and its column / row / layer-norm / grouped forms) and
    every norm of its own (TENorm: MLA's input_layernorm, an MoE layer's pre_mlp_layernorm, q/k norms,
    final_layernorm); each saves an `_extra_state`. (Each layer's core attention, a TEDotProductAttention,
    too: in the torch format only, _te_extra_states.)"""
    modules = set()
    for k in keys:
        module = k.rpartition(".")[0]
        last = module.rpartition(".")[2]
        if module.startswith("decoder.") and (last.startswith("linear_") or last.endswith("layernorm")):
            modules.add(module)
    return sorted(modules)


def _te_extra_states(keys) -> dict:
    """The `_extra_state` entries of a Transformer Engine run's torch-format file: each TE module's (TE's
    empty state; te_extra_state_modules, and each layer's self_attention.core_attention, a
    TEDotProductAttention) and the output layer's (megatron-core's own ColumnParallelLinear in both specs:
    None)."""
    keys = list(keys)
    modules = set(te_extra_state_modules(keys)) | {k.removesuffix("linear_proj.weight") + "core_attention"
                                                   for k in keys if k.endswith(".self_attention.linear_proj.weight")}
    return {**{f"{m}._extra_state": te_extra_state() for m in sorted(modules)}, "output_layer._extra_state": None}


def local_name(key: str) -> str:
    """Transformer Engine's fused-LayerNorm parameter names -> the local spec's (ours)."""
    for te, local in (*_TE_NAMES.items(), *_TE_MLA_NAMES.items()):
        if key.endswith("." + te):
            return key[: -len(te)] + local
    return key


def te_name(key: str) -> str:
    """local_name's inverse: the local spec's norm names -> the fused-LayerNorm names megatron-core's
    local spec saves them by in its sharded_state_dict (torch_dist)."""
    for te, local in _TE_NAMES.items():
        if key.endswith("." + local):
            return key[: -len(local)] + te
    return key


def iteration_subdir(iteration: int) -> str:
    """Megatron-LM's directory of an iteration: 'release' for 0 (its tracker parser refuses "0")."""
    return "release" if iteration == 0 else f"iter_{iteration:07d}"


def write_tracker(out_dir: str, iteration: int) -> None:
    with open(os.path.join(out_dir, TRACKER), "w") as f:
        f.write("release" if iteration == 0 else str(iteration))


def ours_to_megatron(name: str) -> str:
    return name.removeprefix(_OURS)


def megatron_tp_axis(name: str) -> int | None:
    """The axis megatron-core's local spec splits a parameter along in Megatron-LM's files: tp_layout's,
    but MLA's key/value down projection, which our model keeps whole, is a ColumnParallelLinear there."""
    return 0 if name.endswith(MLA_DOWN) else tp_axis(name)


def rank_layout(name: str, full_shape: tuple[int, ...], rank: int, tp: int, padded_vocab: int, swiglu: bool):
    """(axis, local rows, [(full offset, local offset, rows)]) of TP rank `rank`'s shard along the
    split axis (the layout of checkpoint/tp_layout.py, megatron_tp_axis's for MLA's down projections);
    None for a replicated parameter. Vocab rows past the full tensor are padding (zero in the files);
    SwiGLU's fc1 rank holds [gate_r; up_r] (two pieces)."""
    axis = megatron_tp_axis(name)
    if axis is None:
        return None
    if name.endswith(MLA_DOWN):
        if full_shape[0] % tp:
            raise ValueError(f"{name}: {full_shape[0]} rows do not split over TP={tp}")
        local = full_shape[0] // tp
    else:
        local = local_rows(name, full_shape, tp, padded_vocab)
    return axis, local, split_pieces(full_shape[axis], local, rank, tp, partition_stride(name, swiglu))


def _tp_shard(name: str, full: torch.Tensor, r: int, tp: int, padded_vocab: int, swiglu: bool) -> torch.Tensor:
    """TP rank r's shard of the full unpadded tensor `full` (vocab padding rows zero)."""
    layout = rank_layout(name, tuple(full.shape), r, tp, padded_vocab, swiglu)
    if layout is None:
        return full.clone()
    axis, local, pieces = layout
    shape = list(full.shape)
    shape[axis] = local
    shard = full.new_zeros(shape)
    for full_off, local_off, n in pieces:
        shard.narrow(axis, local_off, n).copy_(full.narrow(axis, full_off, n))
    return shard


def _extra_states(keys) -> list[str]:
    """megatron-core's local-spec linear layers (attention, MLP, every expert's and the shared
    expert's fc1/fc2, the output layer even when tied) each carry `<layer>._extra_state` (None)."""
    layers = {k.rpartition(".")[0] for k in keys if k.rpartition(".")[0].rpartition(".")[2].startswith("linear_")}
    return sorted(layers | {"output_layer"})


def rank_dir(tp_rank: int, ep_rank: int, ep: int, pp_rank: int = 0, pp: int = 1) -> str:
    """Megatron-LM's get_checkpoint_name: mp_rank_TT, then _PPP at PP > 1, then _EEE at EP > 1."""
    return f"mp_rank_{tp_rank:02d}" + (f"_{pp_rank:03d}" if pp > 1 else "") + (f"_{ep_rank:03d}" if ep > 1 else "")


def legacy_rank_files(tp: int, etp: int, ep: int) -> list[tuple[int, int, int]]:
    """(TP rank, EP rank, expert TP rank) of each file of Megatron-LM's torch format, in rank order.

    Megatron-LM's save_checkpoint writes that format from the ranks whose expert-data-parallel rank
    is 0, each to get_checkpoint_name's mp_rank_TT[_EEE] (its TP and EP rank). megatron-core orders
    both rank meshes 'tp-cp-ep-dp-pp' (the dense one with EP 1, the experts' with expert TP in TP's
    place and CP 1), so without pipeline or context parallelism those are the global ranks
    r < ETP x EP, each with TP rank r % TP, EP rank (r // ETP) % EP and expert TP rank r % ETP; at
    expert TP = TP that is every (TP rank, EP rank) once. One line for a layout the format cannot
    hold: two such ranks on one file (Megatron-LM overwrites one), or a TP rank none of them has
    (its dense shard is never written)."""
    files = [(r % tp, (r // etp) % ep, r % etp) for r in range(etp * ep)]
    layout = f"TP{tp} x expert TP{etp} x EP{ep}"
    seen: dict[tuple[int, int], int] = {}
    for r, (t, e, _) in enumerate(files):
        if (t, e) in seen:
            raise UserError(f"Megatron-LM's torch checkpoint format cannot hold {layout}: global ranks {seen[t, e]} "
                            f"and {r} (expert-data-parallel rank 0) both write {rank_dir(t, e, ep)}, so one expert TP "
                            f"shard is lost; use an expert TP that divides TP (--expert-tensor-parallel-size {tp})")
        seen[t, e] = r
    missing = sorted(set(range(tp)) - {t for t, _, _ in files})
    if missing:
        raise UserError(f"Megatron-LM's torch checkpoint format cannot hold {layout}: only global ranks "
                        f"0..{etp * ep - 1} (expert-data-parallel rank 0) write files, so TP rank {missing[0]}'s "
                        "dense shard is never written; use expert TP x EP >= TP "
                        f"(e.g. --expert-tensor-parallel-size {tp})")
    return files


def write(out_dir: str, weights: dict[str, torch.Tensor], args: argparse.Namespace, *, progress=None) -> list[str]:
    """Megatron-LM's files (legacy_rank_files) from full unpadded weights (our names, experts by
    global index): each its TP rank's dense shard and its EP rank's experts at its expert TP rank, under
    the layer names of args.transformer_impl (the module doc's table); returns the files."""
    tp, it = args.tensor_model_parallel_size, args.iteration
    te = getattr(args, "transformer_impl", "local") == "transformer_engine"
    ep = int(getattr(args, "expert_model_parallel_size", None) or 1)
    moe = bool(getattr(args, "num_experts", None))
    etp = int(getattr(args, "expert_tensor_parallel_size", None) or tp) if moe else tp
    per_rank = args.num_experts // ep if moe else 0
    sub = iteration_subdir(it)
    specs = legacy_rank_files(tp, etp, ep)
    files = []
    for t, e, k in specs:
        model = {}
        for name, full in weights.items():
            m = _EXPERT.match(ours_to_megatron(name))
            if m is None:
                # Transformer Engine's MLA down projections: duplicated TELinear layers, whole on every TP rank
                whole = te and name.endswith(MLA_DOWN)
                model[ours_to_megatron(name)] = full.clone() if whole else \
                    _tp_shard(name, full, t, tp, args.padded_vocab_size, gated_mlp(args))
                continue
            owner, j = divmod(int(m[2]), per_rank)  # global expert e x E/EP + j is EP rank e's local j
            if owner == e:
                model[f"{m[1]}{j}{m[3]}"] = _tp_shard(name, full, k, etp, args.padded_vocab_size, gated_mlp(args))
        if moe and getattr(args, "moe_grouped_gemm", False):
            model = _te_grouped_experts(model) if te else _grouped_experts(model, per_rank)
        if te:
            names = transformer_engine_names(model, bool(getattr(args, "multi_latent_attention", False)))
            model = {names[k]: v for k, v in model.items()}
            model.update(_te_extra_states(model))
        else:
            model.update({f"{layer}._extra_state": None for layer in _extra_states(model)})
        path = os.path.join(out_dir, sub, rank_dir(t, e, ep), FILE)
        os.makedirs(os.path.dirname(path))
        torch.save({"args": args, "checkpoint_version": CHECKPOINT_VERSION, "iteration": it, "model": model}, path)
        files.append(path)
        if progress is not None:
            progress(len(files), len(specs))
    write_tracker(out_dir, it)
    return files


def _grouped_experts(sd: dict, local: int) -> dict:
    """A rank file's SequentialMLP experts as the legacy GroupedMLP holds them (what the local spec
    builds for --moe-grouped-gemm): weight1 = local experts' fc1 weights transposed, stacked as
    (J, hidden, fc1 out) and stored [hidden, J x fc1 out]; weight2 = their fc2 weights transposed,
    (J, fc2 in, hidden) stored [J x fc2 in, hidden]. The inverse of _sequential_experts."""
    out, grouped = {}, {}
    for k, v in sd.items():
        m = _EXPERT.match(k)
        if m is None:
            out[k] = v
            continue
        fc = m[3].removeprefix(".").removesuffix(".weight")       # linear_fc1 / linear_fc2
        grouped.setdefault((m[1].removesuffix("local_experts."), fc), {})[int(m[2])] = v
    for (prefix, fc), by_j in grouped.items():
        stacked = torch.stack([by_j[j].t() for j in range(local)])
        out[f"{prefix}weight{fc[-1]}"] = stacked.reshape(stacked.shape[1], -1) if fc == "linear_fc1" \
            else stacked.reshape(-1, stacked.shape[2])
    return out


def _te_grouped_experts(sd: dict) -> dict:
    """A rank file's SequentialMLP experts as TEGroupedMLP holds them (what the Transformer Engine spec
    builds for --moe-grouped-gemm): local expert J's linear_fc1 / linear_fc2 weight (and bias) as
    `mlp.experts.linear_fc1.weight{J}` -- one parameter per GEMM of TE's GroupedLinear, the same tensor
    ([out, in], SwiGLU's [gate_r; up_r]). The inverse of _sequential_experts' TEGroupedMLP branch."""
    out = {}
    for k, v in sd.items():
        m = _EXPERT.match(k)
        if m is None:
            out[k] = v
            continue
        fc, _, leaf = m[3].removeprefix(".").partition(".")
        out[f"{m[1].removesuffix('local_experts.')}{fc}.{leaf}{m[2]}"] = v
    return out


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


def safe_load(path: str, *, model: bool = True) -> dict:
    """torch.load(weights_only=True) with the plain-data allow-list; one-line refusal otherwise.
    model: the file must hold a model state dict (a rank file; not torch_dist's common.pt)."""
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
    if not isinstance(sd, dict):
        raise UserError(f"{path}: holds a {type(sd).__name__}, not a dict: not a Megatron-LM checkpoint file")
    if model and not (isinstance(sd.get("model"), dict) or isinstance(sd.get("model0"), dict)):
        raise UserError(f"{path}: no 'model' (or virtual-pipeline 'model0', ...) state dict: not a Megatron-LM "
                        "model checkpoint")
    return sd


def find_iteration_dir(in_dir: str, iteration: int | None = None) -> tuple[str, int]:
    """(iteration directory, iteration) of a Megatron-LM checkpoint root: `iteration`'s (Megatron-LM's
    --ckpt-step), default the one its tracker names."""
    if iteration is not None:
        names = [n for n in (os.listdir(in_dir) if os.path.isdir(in_dir) else [])
                 if n == "release" or re.fullmatch(r"iter_\d{7}", n)]
        want = [n for n in names if (0 if n == "release" else int(n[5:])) == iteration]
        if not want:
            have = sorted(0 if n == "release" else int(n[5:]) for n in names)
            raise UserError(f"--iteration {iteration}: {in_dir} holds no such iteration (it holds "
                            f"{', '.join(map(str, have)) or 'none'})")
        return os.path.join(in_dir, want[0]), iteration
    tracker = os.path.join(in_dir, TRACKER)
    if not os.path.isfile(tracker):
        raise UserError(f"{in_dir}: no {TRACKER}; point --input at a Megatron-LM checkpoint directory (--save of a run)")
    with open(tracker, "rb") as f:
        text = f.read(64).decode("ascii", errors="replace").strip()
    if text == "release":
        d, it = os.path.join(in_dir, "release"), 0
    elif re.fullmatch(r"[0-9]+", text):
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
    if kind not in ("HuggingFaceTokenizer", "Llama2Tokenizer"):
        raise UserError(f"{where}: tokenizer_type={kind!r} and no vocab_size: the model's real vocabulary size is "
                        f"not in the checkpoint; {fixes}")
    from zo_megatron.data.errors import DataError
    from zo_megatron.data.tokenizer import HuggingFaceTokenizer, Llama2Tokenizer

    path = tokenizer_model or getattr(args, "tokenizer_model", None)
    source = f"--tokenizer-model {path}" if tokenizer_model else f"args.tokenizer_model={path!r}"
    sp = kind == "Llama2Tokenizer"              # Megatron-LM's vocab_size: the SentencePiece model's pieces
    what = "SentencePiece model file" if sp else "Hugging Face tokenizer"
    fixes = f"pass --tokenizer-model {'FILE' if sp else 'DIR'} (the run's {what}) or --vocab-size N"
    if not path or not (os.path.isfile(path) if sp else os.path.isdir(path)):
        raise UserError(f"{where}: a {kind} run with no vocab_size, and {source} is not a "
                        f"{'file' if sp else 'directory'} here, so the model's real vocabulary size is unknown: {fixes}")
    try:
        return (Llama2Tokenizer(path) if sp else HuggingFaceTokenizer(path)).vocab_size
    except DataError as exc:
        raise UserError(f"{where}: {source} cannot be read as the run's tokenizer ({exc}); {fixes}") from None


def _rank_layout(d: str, names: list[str], args) -> tuple[int, int, int, int, int | None, list]:
    """(TP, EP, expert TP, PP, virtual pipeline chunks, legacy_rank_files) of the rank directories
    `names` under `d`, as the args (rank 0's file's) say; one line for a missing or extra rank, or a
    layout the format cannot hold."""
    where = os.path.join(d, names[0], FILE)
    if not isinstance(args, argparse.Namespace):
        raise UserError(f"{where}: the checkpoint has no 'args' (argparse.Namespace): its model shape is unknown")
    pp, vp = pipeline_layout(args, where)
    experts = getattr(args, "num_experts", None) or None
    ep = int(getattr(args, "expert_model_parallel_size", None) or 1)
    if ep > 1 and not experts:
        raise UserError(f"{where}: args.expert_model_parallel_size={ep} but args.num_experts={experts!r}: the args "
                        "describe a dense model and the files are expert-parallel ranks; the args are not the run's")
    suffixes = max(len([g for g in _MP_DIR.match(n).groups()[1:] if g]) for n in names)
    if suffixes > (ep > 1) + (pp > 1):
        raise UserError(f"{d}: rank directories with {suffixes} suffixes (mp_rank_XX_YYY...) but the args name "
                        f"pipeline_model_parallel_size={pp} and expert_model_parallel_size={ep}: the args are not "
                        "the run's")
    tp = int(getattr(args, "tensor_model_parallel_size", None) or len(names))
    etp = int(getattr(args, "expert_tensor_parallel_size", None) or tp) if experts else tp
    try:
        files = legacy_rank_files(tp, etp, ep)
        want = [rank_dir(t, e, ep, p, pp) for p in range(pp) for t, e, _ in files]
    except UserError as exc:
        raise UserError(f"{where}: args.expert_tensor_parallel_size={etp}: {exc}") from None
    layout = f"TP{tp}" + (f" x expert TP{etp}" if etp != tp else "") + (f" x EP{ep}" if ep > 1 else "") \
        + (f" x PP{pp}" if pp > 1 else "")
    missing = [n for n in want if n not in names]
    if missing:
        raise UserError(f"{d}: {missing[0]} is missing ({len(missing)} of the {len(want)} rank directories of "
                        f"{layout} that the args name): the checkpoint is incomplete; copy every rank's directory")
    extra = sorted(set(names) - set(want))
    if extra:
        raise UserError(f"{d}: holds {extra[0]}, which args of {layout} (tensor_model_parallel_size={tp}"
                        + (f", expert_model_parallel_size={ep}" if experts else "")
                        + (f", expert_tensor_parallel_size={etp}" if etp != tp else "")
                        + (f", pipeline_model_parallel_size={pp}" if pp > 1 else "")
                        + ") do not name: the rank directories come from different runs")
    return tp, ep, etp, pp, vp, files


def _sequential_experts(path: str, sd: dict, args) -> dict:
    """A rank file's model with grouped-GEMM experts (--moe-grouped-gemm) under SequentialMLP's names
    (`mlp.experts.local_experts.J.linear_fc1.weight`, ...), the same tensors; other keys as they are.

    megatron-core 0.16.1 (transformer/moe/experts.py) keeps the two interchangeable in its
    distributed checkpoints: TEGroupedMLP's `linear_fc1.weight{J}` is local expert J's fc1 weight
    ([out, in], SwiGLU's [gate; up] per TP rank as the MLP's), and the legacy GroupedMLP holds
    weight1 = [hidden, J x fc1 out] and weight2 = [J x fc2 in, hidden], which its forward views as
    (J, hidden, fc1 out) and (J, fc2 in, hidden): local expert J's weights transposed."""
    out = {}
    local = (getattr(args, "num_experts", None) or 0) // int(getattr(args, "expert_model_parallel_size", None) or 1)
    for k, v in sd.items():
        te, legacy = _TE_GROUPED.match(k), _LEGACY_GROUPED.match(k)
        if te:
            out[f"{te[1]}local_experts.{te[4]}.{te[2]}.{te[3]}"] = v
        elif legacy:
            h = args.hidden_size
            if not local or v.dim() != 2 or v.shape[0 if legacy[2] == "1" else 1] != h or v.numel() % (local * h):
                raise UserError(f"{path}: {k} has shape {tuple(v.shape)}, not GroupedMLP's for {local} local experts "
                                f"of hidden size {h}: the files are not the run the args describe")
            per = v.view(local, h, -1) if legacy[2] == "1" else v.view(local, -1, h)
            for j in range(local):
                out[f"{legacy[1]}local_experts.{j}.linear_fc{legacy[2]}.weight"] = per[j].t().contiguous()
        else:
            out[k] = v
    return out


def _split_file(path: str, sd: dict, num_experts: int | None, ep_rank: int, ep: int) -> tuple[dict, dict]:
    """(dense parameters, experts by global index) of one rank file's model (EP rank e's local
    expert j is e x E/EP + j)."""
    per_rank = (num_experts or 0) // ep
    dense, experts = {}, {}
    for k, v in sd.items():
        m = _EXPERT.match(k)
        if m is None:
            dense[k] = v
            continue
        if not num_experts:
            raise UserError(f"{path}: holds {k} but args.num_experts=None: the args describe "
                            "a dense model and the files a mixture of experts; the args are not the run's")
        if int(m[2]) >= per_rank:
            raise UserError(f"{path}: holds {k}, but with args.num_experts={num_experts} "
                            f"over {ep} EP ranks each holds local experts 0..{per_rank - 1}: the files are not "
                            "the run the args describe")
        experts[f"{m[1]}{ep_rank * per_rank + int(m[2])}{m[3]}"] = v
    return dense, experts


def _mla_down_rows(key: str, args) -> int | None:
    """The full rows of an MLA down projection as the args give them (q_lora_rank; kv_lora_rank +
    qk_pos_emb_head_dim); None for another key or args without them (from-megatron then refuses the args)."""
    if key.endswith(MLA_DOWN[0]):
        return getattr(args, "q_lora_rank", None)
    rank, rope = getattr(args, "kv_lora_rank", None), getattr(args, "qk_pos_emb_head_dim", None)
    return rank + rope if key.endswith(MLA_DOWN[1]) and rank is not None and rope is not None else None


def _whole_on_every_rank(shard: dict, args, tp: int) -> set[str]:
    """The keys a TP rank's file holds whole rather than split: MLA's down projections saved by Transformer
    Engine's spec (a duplicated TELinear: the full rows on every rank; the local spec's hold 1/TP of them)."""
    return {k for k, v in shard.items() if tp > 1 and k.endswith(MLA_DOWN) and v.dim() == 2
            and v.shape[0] == _mla_down_rows(k, args)}


def _merge_shards(d: str, ranks: list[str], shards: list[dict], swiglu: bool,
                  whole: frozenset | set = frozenset()) -> dict[str, torch.Tensor]:
    """Full tensors (vocab padding rows kept) from one split's shards, rank by rank (`ranks`: the
    file each shard came from); `whole`: keys every rank holds whole (checked equal, taken once)."""
    keys, size = set(shards[0]), len(shards)
    for r, sh in enumerate(shards[1:], 1):
        if set(sh) != keys:
            raise UserError(f"{os.path.join(d, ranks[r], FILE)}: holds other parameters than {ranks[0]}: "
                            "the TP ranks come from different models")
    full = {}
    for k in sorted(keys):
        t0 = shards[0][k]
        for r, sh in enumerate(shards):
            if sh[k].shape != t0.shape:
                raise UserError(f"{os.path.join(d, ranks[r], FILE)}: {k} has shape {tuple(sh[k].shape)}, "
                                f"{ranks[0]}'s has {tuple(t0.shape)}: the TP ranks come from different models")
        if k in whole:
            for r, sh in enumerate(shards[1:], 1):
                if not torch.equal(sh[k], t0):
                    raise UserError(f"{os.path.join(d, ranks[r], FILE)}: {k} differs from {ranks[0]}'s, but a "
                                    "Transformer Engine run keeps it whole and the same on every TP rank (a "
                                    "duplicated linear): the TP ranks come from different models")
            full[k] = t0
            continue
        axis = megatron_tp_axis(k)
        t = t0
        if axis is not None:
            shape = list(t0.shape)
            shape[axis] *= size
            t = t0.new_empty(shape)
            for r, sh in enumerate(shards):
                for full_off, local_off, n in rank_layout(k, tuple(shape), r, size, shape[0], swiglu)[2]:
                    t.narrow(axis, full_off, n).copy_(sh[k].narrow(axis, local_off, n))
        full[k] = t
    return full


def read(in_dir: str, *, iteration: int | None = None, progress=None, vocab_size: int | None = None,
         tokenizer_model: str | None = None) -> tuple[dict[str, torch.Tensor], argparse.Namespace, int, int]:
    """(full unpadded weights by our names, experts by global index, in the files' dtype, args,
    iteration, vocab size) of a Megatron-LM checkpoint at any TP x EP x expert TP; vocab_size /
    tokenizer_model give the vocabulary when the args do not (_vocab_size); iteration: default the
    tracker's."""
    d, it = find_iteration_dir(in_dir, iteration)
    names = sorted(n for n in os.listdir(d) if _MP_DIR.match(n))
    if not names:
        raise UserError(f"{d}: no mp_rank_XX directories (the 'torch' format) and no metadata.json (the "
                        "'torch_dist' format): not a Megatron-LM checkpoint's iteration directory")
    first = os.path.join(d, names[0], FILE)
    if not os.path.isfile(first):
        raise UserError(f"{first} is missing: the checkpoint is incomplete")
    loaded = {names[0]: safe_load(first)}
    args = loaded[names[0]].get("args")
    tp, ep, etp, pp, vp, specs = _rank_layout(d, names, args)
    num_experts = getattr(args, "num_experts", None)
    dense: dict[int, tuple[str, dict]] = {}         # TP rank -> (its first file, its dense shard)
    experts: dict[int, tuple[str, dict]] = {}       # expert TP rank -> (its first file, every expert's shard)
    for i, (t, e, k) in enumerate(specs):
        stages = []
        for p in range(pp):
            name = rank_dir(t, e, ep, p, pp)
            path = os.path.join(d, name, FILE)
            if not os.path.isfile(path):
                raise UserError(f"{path} is missing: the checkpoint is incomplete")
            sd = loaded.pop(name, None) or safe_load(path)
            stages.append((path, one_stage_model(path, sd, args, pp, vp, p)))
            if progress is not None:
                progress(i * pp + p + 1, len(specs) * pp)
        path, model = merge_stages(stages, args) if pp > 1 else stages[0]
        name = os.path.basename(os.path.dirname(path))
        model = {local_name(key): v for key, v in model.items() if not key.endswith("_extra_state")}
        if num_experts and getattr(args, "moe_grouped_gemm", False):
            model = _sequential_experts(path, model, args)
        dense_part, expert_part = _split_file(path, model, num_experts, e, ep)
        if t not in dense:
            dense[t] = (name, dense_part)
        elif set(dense_part) != set(dense[t][1]) or \
                any(not torch.equal(v, dense[t][1][key]) for key, v in dense_part.items()):
            raise UserError(f"{path}: its dense parameters differ from {dense[t][0]}'s: the EP ranks "
                            "come from different models or iterations")
        experts.setdefault(k, (name, {}))[1].update(expert_part)
    swiglu = gated_mlp(args)            # linear_fc1 is [gate; up]: SwiGLU or quick GeGLU
    merged = _merge_shards(d, [dense[t][0] for t in range(tp)], [dense[t][1] for t in range(tp)], swiglu,
                           _whole_on_every_rank(dense[0][1], args, tp))
    if any(experts[k][1] for k in experts):
        merged.update(_merge_shards(d, [experts[k][0] for k in range(etp)], [experts[k][1] for k in range(etp)],
                                    swiglu))
    full, args, vocab = finish_read(merged, args, first, vocab_size, tokenizer_model)
    return full, args, it, vocab


def finish_read(merged: dict[str, torch.Tensor], args, where: str, vocab_size: int | None,
                tokenizer_model: str | None) -> tuple[dict[str, torch.Tensor], argparse.Namespace, int]:
    """(full unpadded weights by our names, args, vocab size) from full tensors under megatron-core's
    local names (vocab padding rows kept), as both formats' readers end."""
    vocab = _vocab_size(args, where, vocab_size, tokenizer_model)
    full = {}
    for k, t in merged.items():
        if k.startswith("output_layer.") and not getattr(args, "untie_embeddings_and_output_weights", False):
            raise UserError(f"{where}: holds {k} but args.untie_embeddings_and_output_weights is not set")
        if k.endswith((WORD_EMBEDDING, OUTPUT_LAYER)):
            if t.shape[0] < vocab:
                raise UserError(f"{where}: {k} has {t.shape[0]} rows for a vocabulary of {vocab}: not the run's "
                                "vocabulary (give the run's --vocab-size or --tokenizer-model)")
            t = t[:vocab]
        full[_OURS + k] = t.contiguous()          # the files' dtype: the writer converts box by box
    return full, args, vocab
