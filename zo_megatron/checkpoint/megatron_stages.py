"""Megatron-LM pipeline stages read back into one model (from-megatron; megatron_lm.read calls these).

A run saved with --pipeline-model-parallel-size P has one file per TP rank, stage and EP rank
(mp_rank_TT_PPP[_EEE]); a virtual pipeline's stage holds "model0", "model1", ... (one per chunk).
Each chunk numbers its layers from 0, offset by megatron-core's own get_transformer_layer_offset for
the args' split (even, --decoder-first/last-pipeline-num-layers, a virtual pipeline, the embedding /
loss accounted in the split); the embedding is the first stage's, the final norm and output layer the
last's (with tied embeddings the last stage's output_layer copy must equal the embedding).
"""
from __future__ import annotations

import re

import torch

from zo_megatron.errors import UserError

_MERGE_PIPELINE = "merge the pipeline stages with Megatron-LM's tools/checkpoint/convert.py --target-pipeline-parallel-size 1"


def pipeline_layout(args, where: str) -> tuple[int, int | None]:
    """(pipeline stages, virtual chunks per stage or None) of the args; one line for a custom layout."""
    pp = int(getattr(args, "pipeline_model_parallel_size", None) or 1)
    vp = getattr(args, "virtual_pipeline_model_parallel_size", None)
    layout = getattr(args, "pipeline_model_parallel_layout", None)
    if pp > 1 and layout:
        raise UserError(f"{where}: args.pipeline_model_parallel_layout={layout!r}: a hand-written stage layout is not "
                        f"read; {_MERGE_PIPELINE}")
    return pp, (int(vp) if pp > 1 and vp else None)


def layer_offset(args, pp: int, vp: int | None, pp_rank: int, vp_stage: int) -> int:
    """The global index of layer 0 of pipeline stage `pp_rank`'s chunk `vp_stage`: megatron-core's
    get_transformer_layer_offset on the TransformerConfig fields Megatron-LM sets from the args
    (core_transformer_config_from_args: num_layers_in_first/last_pipeline_stage are
    --decoder-first/last-pipeline-num-layers)."""
    from types import SimpleNamespace

    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    cfg = SimpleNamespace(
        num_layers=args.num_layers, pipeline_model_parallel_size=pp, pipeline_model_parallel_layout=None,
        num_layers_in_first_pipeline_stage=getattr(args, "decoder_first_pipeline_num_layers", None),
        num_layers_in_last_pipeline_stage=getattr(args, "decoder_last_pipeline_num_layers", None),
        virtual_pipeline_model_parallel_size=vp,
        account_for_embedding_in_pipeline_split=bool(getattr(args, "account_for_embedding_in_pipeline_split", False)),
        account_for_loss_in_pipeline_split=bool(getattr(args, "account_for_loss_in_pipeline_split", False)))
    return int(get_transformer_layer_offset(cfg, vp_stage=vp_stage if vp else None, pp_rank=pp_rank))


_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")


def one_stage_model(path: str, sd: dict, args, pp: int, vp: int | None, pp_rank: int) -> dict:
    """A stage file's model chunks as one state dict with global layer numbers (its embedding,
    final norm and output layer as they are)."""
    chunks = [sd["model"]] if vp is None else [sd.get(f"model{v}") for v in range(vp)]
    if vp is not None and (any(not isinstance(c, dict) for c in chunks) or f"model{vp}" in sd):
        raise UserError(f"{path}: args.virtual_pipeline_model_parallel_size={vp} but the file holds "
                        f"{sorted(k for k in sd if k.startswith('model'))}: the args are not the run's")
    if pp == 1:
        return chunks[0]
    out = {}
    for v, chunk in enumerate(chunks):
        offset = layer_offset(args, pp, vp, pp_rank, v)
        for k, t in chunk.items():
            m = _LAYER.match(k)
            key = f"decoder.layers.{offset + int(m[1])}.{m[2]}" if m else k
            if key in out:
                raise UserError(f"{path}: {key} is in two virtual-pipeline chunks: the args' split is not the run's")
            out[key] = t
    return out


def merge_stages(stages: list[tuple[str, dict]], args) -> tuple[str, dict]:
    """One TP x EP position's pipeline stages as one state dict: layers from each stage, the rest
    from wherever it is; with tied embeddings the last stage's output_layer copy is checked against
    the first stage's word embedding and dropped (megatron-core keeps the two equal)."""
    out: dict = {}
    tied_copy = None
    for path, model in stages:
        for k, t in model.items():
            if k == "output_layer.weight" and not getattr(args, "untie_embeddings_and_output_weights", False):
                tied_copy = (path, t)
                continue
            if k in out and not k.endswith("_extra_state"):
                raise UserError(f"{path}: {k} is also in another pipeline stage's file: the stages overlap, so the "
                                "args' split (pipeline_model_parallel_size, decoder_first/last_pipeline_num_layers, "
                                "virtual_pipeline_model_parallel_size) is not the run's")
            out[k] = t
    if tied_copy is not None:
        path, t = tied_copy
        emb = out.get("embedding.word_embeddings.weight")
        if emb is None or emb.shape != t.shape or not torch.equal(emb, t):
            raise UserError(f"{path}: output_layer.weight differs from the first stage's embedding.word_embeddings."
                            "weight, but args.untie_embeddings_and_output_weights is not set: the last stage's copy "
                            "of the tied embedding was not kept in sync; the checkpoint is not one model")
    return stages[0][0], out
