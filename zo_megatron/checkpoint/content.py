"""What a checkpoint holds, as DCP keys over FULL (TP-merged, vocab-unpadded) tensors.

    model/<param>             fp32 weights: the offload engine's fp32 master, the baseline's params
    buffers/<name>            the model's persistent buffers that are not parameters (megatron-core's
                              router expert bias, --moe-router-enable-expert-bias): the same on every
                              rank, written by global rank 0, read whole by every rank
    optim/exp_avg/<param>     Adam's first moment (its own dtype: fp32 or bf16)
    optim/exp_avg_sq/<param>  Adam's second moment

Both optimizer engines use the same keys, so weights move between them (--no-load-optim). Each
rank declares the boxes it holds: the offload engine its DP partition's flat fragments of its TP
shard (boxes.py), the baseline its whole TP shard (DP replicas hold copies: DP rank 0 writes
them). Parameters replicated over TP (LayerNorms, biases of row-parallel layers, position
embeddings) are written by TP rank 0 and read by every TP rank (a routed expert's: expert TP rank
0, which at expert TP 1 is every rank holding it). Vocab padding rows, whose size
depends on TP, are neither saved nor loaded: the logits of those rows are masked to -inf. A
stride-2 shard (SwiGLU's fc1: [gate_r; up_r]) is two boxes of the full tensor, so resharding
TP works for it as for any other tensor. A routed expert's keys name its global index (the model's
`full_name`: EP rank r's local expert j is expert r x E/EP + j), so EP ranks write disjoint keys.
"""
from __future__ import annotations

import torch

from zo_megatron.checkpoint.boxes import Box, cut_box, flat_range_boxes, shifted
from zo_megatron.checkpoint.planner import Piece
from zo_megatron.model.sharding import model_shard_infos

MODEL = "model/"
BUFFERS = "buffers/"
EXP_AVG = "optim/exp_avg/"
EXP_AVG_SQ = "optim/exp_avg_sq/"
STATE_KEYS = {"master": MODEL, "exp_avg": EXP_AVG, "exp_avg_sq": EXP_AVG_SQ}


def optimizer_kind(optimizer) -> str:
    return "zero_offload" if optimizer.holds_master_weights else "baseline"


def _full_name(model):
    return getattr(model, "full_name", lambda n: n)


def full_shapes(model, tp_rank: int, tp_size: int, vocab_size: int) -> dict[str, tuple[int, ...]]:
    """Every parameter's full unpadded shape: the same at any TP x DP x EP layout (an EP rank holds
    some experts of each layer; every expert of a layer has the same shapes, so all E are listed)."""
    import re

    full_name = _full_name(model)
    experts = getattr(getattr(model, "cfg", None), "num_experts", None)
    out = {}
    for n, i in model_shard_infos(model, tp_rank, tp_size, vocab_size).items():
        name, shape = full_name(n), tuple(i.full_shape)
        m = re.match(r"(.*\.mlp\.experts\.local_experts\.)\d+(\..*)", name) if experts else None
        out.update({f"{m[1]}{e}{m[2]}": shape for e in range(experts)} if m else {name: shape})
    return out


def _pieces(key: str, info, box: Box, flat: torch.Tensor) -> list[Piece]:
    """The Pieces for `box` of a local tensor whose box elements start at flat[box.flat_start]:
    one per TP piece of the shard it meets (two for SwiGLU's stride-2 fc1), placed in the full
    tensor; vocab padding rows are dropped."""
    if info.tp_axis is None:
        parts = [(box, 0)]
    else:
        parts = [(cut, f - l) for f, l, n in info.pieces
                 if (cut := cut_box(box, info.tp_axis, l, l + n)) is not None]
    return [Piece(key, tuple(info.full_shape), shifted(b, info.tp_axis, by),
                  flat[b.flat_start:b.flat_start + b.numel].view(b.sizes))
            for b, by in parts]


def offload_pieces(engine, ps, vocab_size: int, *, saving: bool, with_optimizer: bool) -> list[Piece]:
    infos = model_shard_infos(engine.model, ps.tp_rank, ps.tp_size, vocab_size)
    full_name = _full_name(engine.model)
    out = []
    for name, param, start, n, views in engine.host_state_views():
        info = infos[name]
        if saving and info.replicated and info.split_rank != 0:    # TP rank 0 (an expert's: expert TP rank 0)
            continue
        for box in flat_range_boxes(tuple(param.shape), start, start + n):
            for what, prefix in STATE_KEYS.items():
                if what != "master" and not with_optimizer:
                    continue
                out += _pieces(prefix + full_name(name), info, box, views[what])
    return out


def _ensure_adam_state(opt: torch.optim.Optimizer, p: torch.Tensor) -> dict:
    """torch AdamW's per-parameter state, created as a step would create it (to load into)."""
    st = opt.state[p]
    if not st:
        st["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
        st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    return st


def baseline_pieces(optimizer, ps, vocab_size: int, *, saving: bool, with_optimizer: bool) -> list[Piece]:
    model = optimizer.model
    infos = model_shard_infos(model, ps.tp_rank, ps.tp_size, vocab_size)
    out = []
    if saving and ps.dp_rank != 0:              # DP replicas hold the same tensors
        return out
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        info = infos[name]
        if saving and info.replicated and info.split_rank != 0:
            continue
        box = Box((0,) * p.dim(), tuple(p.shape), 0)
        tensors = {"master": p.data}
        if with_optimizer:
            st = _ensure_adam_state(optimizer.opt, p)
            tensors.update(exp_avg=st["exp_avg"], exp_avg_sq=st["exp_avg_sq"])
        for what, t in tensors.items():
            out += _pieces(STATE_KEYS[what] + _full_name(model)(name), info, box, t.reshape(-1))
    return out


def persistent_buffers(model) -> dict[str, torch.Tensor]:
    """The model's state_dict entries that are neither parameters nor megatron-core's `_extra_state`."""
    params = {n for n, _ in model.named_parameters()}
    return {n: t for n, t in model.state_dict(keep_vars=True).items()
            if n not in params and not n.endswith("_extra_state") and isinstance(t, torch.Tensor)}


def buffer_pieces(model, ps, *, saving: bool) -> list[Piece]:
    if saving and ps.rank != 0:
        return []
    full_name = _full_name(model)
    return [Piece(BUFFERS + full_name(n), tuple(t.shape), Box((0,) * t.dim(), tuple(t.shape), 0), t.data)
            for n, t in persistent_buffers(model).items()]


def pieces(model, optimizer, ps, vocab_size: int, *, saving: bool, with_optimizer: bool = True) -> list[Piece]:
    fn = offload_pieces if optimizer.holds_master_weights else baseline_pieces
    return fn(optimizer, ps, vocab_size, saving=saving, with_optimizer=with_optimizer) + \
        buffer_pieces(model, ps, saving=saving)


def set_baseline_step(optimizer, step: int) -> None:
    """torch AdamW counts steps per parameter: set them all after loading the moments."""
    for p in optimizer.model.parameters():
        st = optimizer.opt.state.get(p)
        if st:
            st["step"].fill_(float(step))
