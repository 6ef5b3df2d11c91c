"""Megatron-LM's `torch_dist` checkpoint format (its default --ckpt-format) for its megatron-core GPT.

    DIR/latest_checkpointed_iteration.txt       "N" ("release" for iteration 0), as the torch format
    DIR/iter_000000N/metadata.json              {"sharded_backend": "torch_dist", ...}
    DIR/iter_000000N/common.pt                  torch.save of {"args", "checkpoint_version", "iteration", ...}
    DIR/iter_000000N/.metadata, __R_I.distcp    torch.distributed.checkpoint: one GLOBAL tensor per key

Unlike the torch format, the files do not depend on the run's TP, EP or PP: each rank saved its shard
of megatron-core's `sharded_state_dict` (megatron.core.dist_checkpointing), whose keys and global
shapes are layout-free (megatron-core 0.16.1, with Megatron-LM's metadata singleton_local_shards=False):

    embedding.word_embeddings.weight                  [padded vocab of the saving TP, h]
    decoder.layers.<p>                                [L, ...]: every layer stacked on a leading axis
    decoder.layers.<i>.<p>                            one layer: moe_layer_freq mixing dense and MoE layers
                                                      (non-homogeneous layers) and singleton_local_shards
    ...mlp.experts.experts.linear_fc1.weight          [E, ...]: the experts stacked (SequentialMLP,
                                                      GroupedMLP and TEGroupedMLP save the same keys)
    ...mlp.experts.experts.<e>.linear_fc1.weight      one expert (singleton_local_shards)
    ...linear_fc1.weight                              SwiGLU's [gate; up] of the whole FFN (both halves
                                                      global: TP rank r saved gate_r at r, up_r at TP + r);
                                                      singleton_local_shards: weight_w (gate), weight_v (up)
    ...self_attention.linear_qkv.layer_norm_weight    the norms under Transformer Engine's names, which the
    ...mlp.linear_fc1.layer_norm_weight               local spec's sharded_state_dict maps its norms to
    ...input_layernorm.weight, ...pre_mlp_layernorm.weight, ...self_attention.q_layernorm.weight
                                                      multi-latent attention: the local spec's MLA layers map
                                                      no names (Transformer Engine's keep input_layernorm, fuse
                                                      the latents' norms into linear_q/kv_up_proj.layer_norm_*
                                                      and a dense MLP's into linear_fc1); its down projections
                                                      are whole global tensors either way
    ..._extra_state/shard_*, optimizer.*, rng_state   not model weights: not read

So one reader serves every layout the run had: the global tensors are exactly the full TP-1 tensors of
the torch format's files (the QKV rows grouped per query group, SwiGLU's gate then up), which
megatron_lm.finish_read then turns into ours. Reading never runs pickled code: `.metadata` through
safe_load's allow-list unpickler (DCP's own classes, plain data), tensors with
torch.load(weights_only=True) inside DCP, common.pt through megatron_lm.safe_load.

write() is the other way (to-megatron --ckpt-format torch_dist): the same global tensors in the
classic form Megatron-LM saves, written by torch.distributed.checkpoint in one process, with the
`_extra_state` objects of the local linear layers that megatron-core's load asks for, common.pt and
metadata.json. A Megatron-LM run loads it at any TP x EP x PP (--ckpt-format torch_dist
--transformer-impl local --finetune). With args.transformer_impl 'transformer_engine' the keys are those
Transformer Engine's spec saves (megatron_lm.transformer_engine_names: its modules' own names, no keys map,
so an MoE layer's pre_mlp_layernorm and MLA's input_layernorm keep theirs) and the extra states are every
TE module's (its linear layers' and its norms', TE's empty state), for --transformer-impl transformer_engine.
"""
from __future__ import annotations

import itertools
import json
import os
import re
import warnings

import torch

from zo_megatron.checkpoint import megatron_lm
from zo_megatron.checkpoint.safe_load import SafeFileSystemReader, first_line, read_dcp_metadata
from zo_megatron.errors import UserError

CONFIG = "metadata.json"
COMMON = "common.pt"
BACKEND = "torch_dist"
_MODEL_PREFIXES = ("embedding.", "decoder.", "output_layer.")
_ONE_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_STACKED = re.compile(r"^decoder\.layers\.(?!\d+\.)(.+)$")
_EXPERTS = "mlp.experts.experts."
_ONE_EXPERT = re.compile(r"^(\d+)\.(.+)$")
_GLU_HALF = re.compile(r"^(.+)_([wv])$")


def is_torch_dist(iteration_dir: str) -> bool:
    """Whether a checkpoint's iteration directory holds megatron-core's distributed format."""
    return os.path.isfile(os.path.join(iteration_dir, CONFIG))


def _backend(d: str) -> None:
    path = os.path.join(d, CONFIG)
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as exc:
        raise UserError(f"{path}: cannot be read as JSON ({first_line(exc)}): the checkpoint is damaged") from None
    backend = config.get("sharded_backend") if isinstance(config, dict) else None
    if backend != BACKEND:
        raise UserError(f"{path}: sharded_backend {backend!r}: only Megatron-LM's {BACKEND!r} format (its default "
                        "--ckpt-format) and its 'torch' format are read; save the run with --ckpt-format torch_dist")


def _model_keys(md, d: str) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The model's tensors (global shape, dtype) in the checkpoint's metadata."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    keys = {k: (tuple(v.size), v.properties.dtype) for k, v in md.state_dict_metadata.items()
            if k.startswith(_MODEL_PREFIXES) and "._extra_state" not in k and isinstance(v, TensorStorageMetadata)}
    if not keys:
        raise UserError(f"{d}: no model tensors (embedding.*, decoder.*, output_layer.*) in the checkpoint: not a "
                        "Megatron-LM GPT checkpoint, or one saved without its model (--no-save-model)")
    return keys


def _load(d: str, keys: dict[str, tuple[tuple[int, ...], torch.dtype]], progress=None,
          batch_bytes: int = 1 << 30) -> dict[str, torch.Tensor]:
    """The global tensors of `keys`, read by torch.distributed.checkpoint in this process alone, about
    `batch_bytes` per read so that `progress(tensors read, tensors)` moves on a large model."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    state = {k: torch.empty(shape, dtype=dtype) for k, (shape, dtype) in keys.items()}
    batches, batch, size = [], [], 0
    for k, t in state.items():
        batch.append(k)
        size += t.numel() * t.element_size()
        if size >= batch_bytes:
            batches.append(batch)
            batch, size = [], 0
    batches += [batch] if batch else []
    done = 0
    for batch in batches:
        try:
            with warnings.catch_warnings():     # "torch.distributed is ... uninitialized": one process is the intent
                warnings.filterwarnings("ignore", message=".*torch.distributed is disabled")
                dcp.load({k: state[k] for k in batch}, storage_reader=SafeFileSystemReader(d), no_dist=True)
        except (CheckpointException, OSError, RuntimeError, ValueError) as exc:
            raise UserError(f"{d}: the checkpoint's tensors cannot be read ({type(exc).__name__}: {first_line(exc)}); "
                            "a .distcp file is missing or damaged: copy the whole iteration directory") from None
        done += len(batch)
        if progress is not None:
            progress(done, len(state))
    return state


def _unstack(key: str, t: torch.Tensor, num: int, what: str, where: str) -> list[torch.Tensor]:
    if t.dim() == 0 or t.shape[0] != num:
        raise UserError(f"{where}: {key} has shape {tuple(t.shape)}, not {num} {what} stacked on its first axis as "
                        "the args say: the args are not the run's")
    return list(t.unbind(0))


def _per_layer(tensors: dict[str, torch.Tensor], args, where: str) -> dict[str, torch.Tensor]:
    """{decoder.layers.<i>.<p>: tensor}: stacked layers and stacked experts taken apart, experts
    under SequentialMLP's names by global index (`local_experts.<e>`, as at EP 1)."""
    out: dict[str, torch.Tensor] = {}

    def put(k: str, t: torch.Tensor) -> None:
        if k in out:
            raise UserError(f"{where}: {k} is saved both stacked and alone: not one model's checkpoint")
        out[k] = t

    def layer(prefix: str, rest: str, t: torch.Tensor) -> None:
        if not rest.startswith(_EXPERTS):
            return put(prefix + rest, t)
        rest = rest[len(_EXPERTS):]
        m = _ONE_EXPERT.match(rest)
        base = prefix + "mlp.experts.local_experts."
        if m:
            return put(f"{base}{m[1]}.{m[2]}", t)
        for e, te in enumerate(_unstack(prefix + _EXPERTS + rest, t, int(getattr(args, "num_experts", 0) or 0),
                                        "experts", where)):
            put(f"{base}{e}.{rest}", te)

    for k, t in tensors.items():
        one, stacked = _ONE_LAYER.match(k), _STACKED.match(k)
        if one:
            layer(f"decoder.layers.{one[1]}.", one[2], t)
        elif stacked:
            for i, ti in enumerate(_unstack(k, t, int(args.num_layers), "layers", where)):
                layer(f"decoder.layers.{i}.", stacked[1], ti)
        else:
            put(k, t)
    return out


def _glu_halves(model: dict[str, torch.Tensor], where: str) -> dict[str, torch.Tensor]:
    """singleton_local_shards' SwiGLU halves (`linear_fc1.weight_w` gate, `_v` up) as one [gate; up]."""
    out, halves = {}, {}
    for k, t in model.items():
        m = _GLU_HALF.match(k)
        if m and ".linear_fc1." in k:
            halves.setdefault(m[1], {})[m[2]] = t
        else:
            out[k] = t
    for k, pair in halves.items():
        if set(pair) != {"w", "v"}:
            raise UserError(f"{where}: {k}_{'v' if 'w' in pair else 'w'} is missing beside its other SwiGLU half: "
                            "the checkpoint is incomplete")
        out[k] = torch.cat([pair["w"], pair["v"]])
    return out


def read(in_dir: str, *, iteration: int | None = None, progress=None, vocab_size: int | None = None,
         tokenizer_model: str | None = None) -> tuple[dict[str, torch.Tensor], object, int, int]:
    """megatron_lm.read's result for a torch_dist checkpoint: (full unpadded weights by our names,
    experts by global index, in the saved dtype; args; iteration; vocab size)."""
    d, it = megatron_lm.find_iteration_dir(in_dir, iteration)
    _backend(d)
    where = os.path.join(d, COMMON)
    if not os.path.isfile(where):
        raise UserError(f"{where} is missing: the checkpoint is incomplete (Megatron-LM writes it with the args)")
    args = megatron_lm.safe_load(where, model=False).get("args")
    if args is None or not hasattr(args, "num_layers"):
        raise UserError(f"{where}: no 'args' (argparse.Namespace): the model's shape is unknown")
    keys = _model_keys(read_dcp_metadata(d), d)
    tensors = _load(d, keys, progress)
    model = _glu_halves(_per_layer(tensors, args, where), where)
    model = {megatron_lm.local_name(k): t for k, t in model.items()}
    full, args, vocab = megatron_lm.finish_read(model, args, where, vocab_size, tokenizer_model)
    return full, args, it, vocab


def _homogeneous(args) -> bool:
    """megatron-core's TransformerBlock.sharded_state_dict stacks the layers unless moe_layer_freq
    mixes dense and MoE layers (a list, or an int above 1)."""
    freq = getattr(args, "moe_layer_freq", 1) if getattr(args, "num_experts", None) else 1
    return not isinstance(freq, (list, tuple)) and int(freq) <= 1


def global_tensors(weights: dict[str, torch.Tensor], args) -> tuple[dict[str, torch.Tensor], dict[str, tuple]]:
    """(the GLOBAL tensors Megatron-LM's torch_dist save holds for full unpadded weights -- our names,
    experts by global index; vocab padded for args' TP -- the inverse of read's taking apart; and each
    key's stacked leading axes: (), (L,), (E,) or (L, E)). Consumes `weights`: each stacked key
    replaces its parts, so the model is never held twice."""
    from zo_megatron.checkpoint.tp_layout import OUTPUT_LAYER, WORD_EMBEDDING

    flat: dict[str, torch.Tensor] = {}
    mla = bool(getattr(args, "multi_latent_attention", False))
    if getattr(args, "transformer_impl", "local") == "transformer_engine":
        # Transformer Engine's spec saves its modules' own names (no keys map): the fused norms', a TENorm's
        rename = megatron_lm.transformer_engine_names([megatron_lm.ours_to_megatron(n) for n in weights], mla).get
    else:
        # megatron-core's local MLA layer spec has no sharded_state_dict_keys_map: its norms keep their names
        rename = (lambda k: k) if mla else megatron_lm.te_name
    for name in list(weights):
        t = weights.pop(name)
        key = rename(megatron_lm.ours_to_megatron(name))
        if key.endswith((WORD_EMBEDDING, OUTPUT_LAYER)) and t.shape[0] < args.padded_vocab_size:
            t = torch.cat([t, t.new_zeros(args.padded_vocab_size - t.shape[0], *t.shape[1:])])
        flat[key] = t
    axes = {k: () for k in flat}

    def stack(pattern: str, name, size) -> None:
        groups: dict[str, dict[int, str]] = {}
        for key in list(flat):
            m = re.match(pattern, key)
            if m:
                groups.setdefault(name(m), {})[int(m["i"])] = key
        for new, parts in groups.items():
            if sorted(parts) != list(range(size)):
                raise UserError(f"{new}: parts {sorted(parts)} of {size}: the weights are not the model's")
            flat[new] = torch.stack([flat.pop(parts[i]) for i in range(size)])
            axes[new] = (size, *axes.pop(parts[0]))
            for i in range(1, size):
                axes.pop(parts[i])

    if getattr(args, "num_experts", None):
        stack(r"^(?P<pre>.*\.mlp\.experts\.)local_experts\.(?P<i>\d+)\.(?P<rest>.+)$",
              lambda m: f"{m['pre']}experts.{m['rest']}", int(args.num_experts))
    if _homogeneous(args):
        stack(r"^decoder\.layers\.(?P<i>\d+)\.(?P<rest>.+)$", lambda m: f"decoder.layers.{m['rest']}",
              int(args.num_layers))
    return flat, axes


def _extra_states(tensors: dict[str, torch.Tensor], axes: dict[str, tuple], te: bool = False) -> dict[str, list]:
    """The `_extra_state` objects the decoder's modules save, one per stacked position, under
    ShardedObject's unique key `<module>._extra_state/shard_<offsets>_<shape>` (a module not stacked:
    shard_0_1), each the list of one ShardedObject's data that megatron-core's torch_dist strategy stores:
    the local linear layers' None, or (te) every Transformer Engine module's empty state -- its linear
    layers and its norms (megatron_lm.te_extra_state_modules; a TEDotProductAttention saves none here:
    megatron-core's sharded_state_dict of it is empty for the vanilla softmax). A load asks for every one."""
    modules = set(megatron_lm.te_extra_state_modules(tensors)) if te else None
    out = {}
    for key in tensors:
        module, _, leaf = key.rpartition(".")
        if not key.startswith("decoder.") or leaf != "weight":
            continue
        if not (module in modules if te else module.rpartition(".")[2].startswith("linear_")):
            continue
        shape = axes[key] or (1,)
        for offset in itertools.product(*(range(n) for n in shape)):
            out[f"{module}._extra_state/shard_{'.'.join(map(str, offset))}_{'.'.join(map(str, shape))}"] = \
                [megatron_lm.te_extra_state() if te else None]
    if not te:
        # megatron-core's block builds the final norm of a local-spec model as TENorm wherever Transformer
        # Engine is installed (transformer_block.py: LayerNormImpl), and a torch_dist load then asks for its
        # extra state; a load without TE does not ask for it (an entry nothing asks for is not read)
        out["decoder.final_layernorm._extra_state/shard_0_1"] = [megatron_lm.te_extra_state()]
    return out


def write(out_dir: str, weights: dict[str, torch.Tensor], args, log=None) -> None:
    """Megatron-LM's torch_dist checkpoint of the model from full unpadded weights (our names,
    experts by global index; consumed): what its save_checkpoint writes at --ckpt-format torch_dist
    with singleton_local_shards false, less the optimizer and RNG state. out_dir: a new directory;
    log: told what is being written before the (one) DCP write starts."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    it = args.iteration
    d = os.path.join(out_dir, megatron_lm.iteration_subdir(it))
    os.makedirs(d)
    tensors, axes = global_tensors(weights, args)
    te = getattr(args, "transformer_impl", "local") == "transformer_engine"
    state = {**tensors, **_extra_states(tensors, axes, te)}
    threads = max(1, min(4, os.cpu_count() or 1))      # one file per thread: megatron-core reads any number
    if log is not None:
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        log(f"  writing {len(tensors)} global tensors ({size / 2**30:.2f} GiB) and {len(state) - len(tensors)} "
            f"_extra_state objects with torch.distributed.checkpoint, {threads} writer threads")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled")
        # not flattened: each object stays one item (torch.save([None])), as megatron-core stores it
        dcp.save(state, storage_writer=dcp.FileSystemWriter(d, thread_count=threads),
                 planner=DefaultSavePlanner(flatten_state_dict=False), no_dist=True)
    torch.save({"args": args, "checkpoint_version": megatron_lm.CHECKPOINT_VERSION, "iteration": it,
                "content_metadata": {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}},
               os.path.join(d, COMMON))
    with open(os.path.join(d, CONFIG), "w") as f:
        json.dump({"sharded_backend": BACKEND, "sharded_backend_version": 1, "common_backend": "torch",
                   "common_backend_version": 1}, f)
    megatron_lm.write_tracker(out_dir, it)
