"""The layout of one TP rank's parameters: a flat buffer cut into buckets, each split over DP.

    flat buffer (16-bit, on the device; the model's parameters are views into it)
    |<------ bucket 0 ------>|<------ bucket 1 ------>| ...        (params in backward order)
    | r0 | r1 | r2 | r3 | pad | r0 | r1 | r2 | r3 | pad|           (each bucket split in N shards)

    host partition of DP rank r = [bucket0.shard(r) | bucket1.shard(r) | ...]   (Psi/N elements)

Buckets follow the order gradients appear in backward (parameters in reverse registration
order), so a bucket is complete early and its reduce-scatter overlaps the rest of backward. Every
bucket is padded to a multiple of N * ALIGN elements so all shards are equal (what
reduce-scatter and all-gather need) and SIMD-aligned on the host.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from zo_megatron.errors import ConfigError
from zo_megatron.parallel import collectives

ALIGN = 64  # elements: keeps every host shard 128-byte aligned for the CPU Adam kernel


@dataclass
class ParamSlot:
    name: str
    param: torch.nn.Parameter
    start: int                  # offset in the flat buffer
    numel: int
    bucket: int
    decay: bool                 # gets weight decay
    tp_replicated: bool         # identical on every TP rank: counted once in the global norm
    decoupled: bool = False     # the word embedding / output layer: --decoupled-lr's rate


@dataclass
class Bucket:
    index: int
    start: int                  # flat buffer range [start, end)
    end: int
    dp_size: int
    host_start: int = 0         # where this rank's shard sits in the host partition
    slots: list[ParamSlot] = field(default_factory=list)

    @property
    def numel(self) -> int:
        return self.end - self.start

    @property
    def shard_numel(self) -> int:
        return self.numel // self.dp_size

    def shard_range(self, dp_rank: int) -> tuple[int, int]:
        s = self.start + dp_rank * self.shard_numel
        return s, s + self.shard_numel


@dataclass(frozen=True)
class Segment:
    """A run of the host partition with one weight-decay setting, one norm rule and one learning rate."""

    start: int
    end: int
    decay: bool
    counted: bool               # counted in the global grad norm on this rank
    decoupled: bool = False     # takes the decoupled learning rate (--decoupled-lr), see is_decoupled


def is_decoupled(p: torch.nn.Parameter) -> bool:
    """Megatron-LM's --decoupled-lr group: the parameters megatron-core's LanguageModule marks
    `is_embedding_or_output_parameter` (the word embedding and the output layer's weight; tied, the
    one shared weight). The position embedding is not one of them."""
    return bool(getattr(p, "is_embedding_or_output_parameter", False))


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


class FlatLayout:
    """Assigns every parameter a slot in the flat buffer and a bucket; derives the host partition."""

    def __init__(self, named_params: list[tuple[str, torch.nn.Parameter]], *, dp_size: int, dp_rank: int,
                 tp_rank: int, bucket_size: int, no_decay_embeddings: bool = False):
        if bucket_size < 1:
            raise ConfigError(f"--bucket-size must be >= 1 element (got {bucket_size})")
        if not 0 <= dp_rank < dp_size:
            raise ConfigError(f"DP rank {dp_rank} is outside a DP group of size {dp_size}")
        self.dp_size, self.dp_rank = dp_size, dp_rank
        quantum = dp_size * ALIGN
        self.slots: list[ParamSlot] = []
        self.buckets: list[Bucket] = []
        offset = 0
        current: Bucket | None = None
        for name, p in reversed(named_params):       # backward order
            if current is None:
                current = Bucket(len(self.buckets), offset, offset, dp_size)
            tp_split = bool(getattr(p, "tensor_model_parallel", False))
            decay = p.dim() > 1 and not (no_decay_embeddings and "embedding" in name)
            slot = ParamSlot(name, p, offset, p.numel(), current.index, decay,
                             tp_replicated=not tp_split and tp_rank != 0, decoupled=is_decoupled(p))
            current.slots.append(slot)
            self.slots.append(slot)
            offset += p.numel()
            if offset - current.start >= bucket_size:
                offset = current.start + _round_up(offset - current.start, quantum)
                current.end = offset
                self.buckets.append(current)
                current = None
        if current is not None:
            offset = current.start + _round_up(offset - current.start, quantum)
            current.end = offset
            self.buckets.append(current)
        self.numel = offset
        host = 0
        for b in self.buckets:
            b.host_start = host
            host += b.shard_numel
        self.host_numel = host
        self.max_bucket_numel = max(b.numel for b in self.buckets)
        self.segments = self._segments()

    def _segments(self) -> list[Segment]:
        """Split this rank's host partition where weight decay, the norm rule or the learning rate
        (decoupled or not) changes.

        Bucket padding joins its neighbour (its gradient and value are always zero)."""
        marks: list[tuple] = []                    # (host offset, decay, counted, decoupled)
        for b in self.buckets:
            lo, hi = b.shard_range(self.dp_rank)
            for s in b.slots:
                a, e = max(lo, s.start), min(hi, s.start + s.numel)
                if a < e:
                    marks.append((b.host_start + a - lo, s.decay, not s.tp_replicated, s.decoupled))
        runs: list[list] = []
        for off, *flags in marks:
            if not runs or runs[-1][1:] != flags:
                runs.append([off, *flags])
        if not runs:
            return [Segment(0, self.host_numel, False, True)]
        runs[0][0] = 0
        ends = [r[0] for r in runs[1:]] + [self.host_numel]
        return [Segment(r[0], e, *r[1:]) for r, e in zip(runs, ends)]

    def check_same_across(self, dp_group, dp_size: int) -> None:
        """Every DP rank must derive the same layout, or the collectives would mix up shards."""
        if dp_size == 1:
            return
        sig = torch.tensor([self.numel, len(self.buckets), self.max_bucket_numel], dtype=torch.int64)
        lo = collectives.all_reduce(sig.clone(), "min", dp_group)
        hi = collectives.all_reduce(sig.clone(), "max", dp_group)
        if not torch.equal(lo, hi):
            raise ConfigError(
                f"DP ranks disagree on the parameter partitioning (flat size/buckets/max bucket "
                f"{sig.tolist()} here, {lo.tolist()}..{hi.tolist()} across the DP group): every DP rank "
                f"must build the same model with the same --bucket-size")

    def padding(self) -> list[tuple[int, int]]:
        """The flat buffer's (start, end) ranges no parameter covers: the buckets' padding."""
        gaps, end = [], 0
        for s in sorted(self.slots, key=lambda s: s.start):
            if s.start > end:
                gaps.append((end, s.start))
            end = max(end, s.start + s.numel)
        return gaps + ([(end, self.numel)] if end < self.numel else [])

    def counted_param_runs(self) -> list[tuple[int, int]]:
        """(start, end) runs of this rank's host partition holding parameter elements the global norm
        counts here (no TP copy, no bucket padding), merged where they touch: what
        --log-num-zeros-in-grad counts."""
        runs: list[list[int]] = []
        for slot, host, _, n in sorted(self.host_fragments(), key=lambda f: f[1]):
            if slot.tp_replicated:
                continue
            if runs and runs[-1][1] == host:
                runs[-1][1] = host + n
            else:
                runs.append([host, host + n])
        return [(a, e) for a, e in runs]

    def host_fragments(self):
        """(slot, host_start, param_start, length): which piece of each param this rank holds."""
        for b in self.buckets:
            lo, hi = b.shard_range(self.dp_rank)
            for s in b.slots:
                a, e = max(lo, s.start), min(hi, s.start + s.numel)
                if a < e:
                    yield s, b.host_start + a - lo, a - s.start, e - a
