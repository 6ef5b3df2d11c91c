"""Sequence-parallel gradients in the offload engine's buckets.

megatron-core's rule (distributed/finalize_model_grads.py): a parameter tagged `sequence_parallel`
(norm weights/biases, row-parallel biases) is replicated over TP but saw only this rank's 1/TP of
the sequence, so its gradient is summed over the TP group. In the engine that sum runs inside the
bucket, just before the bucket's DP reduce-scatter: one TP all-reduce of the bucket's tagged
elements (packed). Every TP rank has the same layout, so the pieces line up; the sums are linear,
so the order with the DP reduction is free.
"""
from __future__ import annotations

import torch

from zo_megatron.errors import ConfigError
from zo_megatron.parallel import collectives


class SequenceParallelGrads:
    """bucket -> [(offset in the bucket, numel)] of its sequence-parallel parameters, and their TP sum."""

    def __init__(self, layout, tp_group):
        self.tp_group = tp_group
        self.pieces = self._pieces(layout)

    def _pieces(self, layout) -> dict[int, list[tuple[int, int]]]:
        pieces: dict[int, list[tuple[int, int]]] = {}
        for s in layout.slots:
            if getattr(s.param, "sequence_parallel", False):
                pieces.setdefault(s.bucket, []).append((s.start - layout.buckets[s.bucket].start, s.numel))
        if not pieces:
            return {}
        if self.tp_group is None:
            raise ConfigError("the model has sequence-parallel parameters: pass the engine its TP group "
                              "(tp_group=...) so their gradients are summed over TP")
        if collectives.group_size(self.tp_group) == 1:
            return {}
        sig = torch.tensor([len(pieces), sum(n for p in pieces.values() for _, n in p), layout.numel],
                           dtype=torch.int64)
        lo = collectives.all_reduce(sig.clone(), "min", self.tp_group)
        hi = collectives.all_reduce(sig.clone(), "max", self.tp_group)
        if not torch.equal(lo, hi):
            raise ConfigError(f"TP ranks disagree on the sequence-parallel parameters (buckets/elements/flat size "
                              f"{sig.tolist()} here, {lo.tolist()}..{hi.tolist()} across TP): every TP rank must "
                              "build the same model with the same --sequence-parallel and --bucket-size")
        return pieces

    def reduce(self, b: int, buf: torch.Tensor) -> None:
        """Sum bucket `b`'s sequence-parallel gradients in `buf` over the TP group, in place."""
        pieces = self.pieces.get(b)
        if not pieces:
            return
        if len(pieces) == 1:
            off, n = pieces[0]
            collectives.all_reduce(buf[off:off + n], group=self.tp_group)
            return
        packed = torch.cat([buf[off:off + n] for off, n in pieces])
        collectives.all_reduce(packed, group=self.tp_group)
        at = 0
        for off, n in pieces:
            buf[off:off + n].copy_(packed[at:at + n])
            at += n
