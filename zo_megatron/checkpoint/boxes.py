"""Cut a flat range of a tensor into rectangular boxes: how a ZeRO fragment becomes DCP chunks.

A ZeRO partition holds a flat range [s, e) of a (TP-local) parameter. DCP, like every N-d
checkpoint format, describes a tensor's pieces as boxes (offsets, sizes); DTensor cannot express
an uneven flat range. A flat range of a row-major tensor is at most 2(ndim-1)+1 boxes: a partial
row at the head, whole rows in the middle, a partial row at the tail, recursively along the axes.
Boxes come out in flat order and each is a contiguous run of the range, so it can be written from
or read into a plain view of a host buffer.
"""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Box:
    offsets: tuple[int, ...]     # where the box starts in the tensor
    sizes: tuple[int, ...]
    flat_start: int              # index of its first element, counted from the range's start

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)


def flat_range_boxes(shape: tuple[int, ...], start: int, end: int) -> list[Box]:
    """Boxes covering elements [start, end) of a row-major tensor of `shape`, in flat order."""
    if not 0 <= start <= end <= math.prod(shape):
        raise ValueError(f"flat range [{start}, {end}) outside a tensor of shape {tuple(shape)}")
    raw: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    _cut(tuple(shape), start, end, raw)
    out, flat = [], 0
    for offsets, sizes in raw:
        out.append(Box(offsets, sizes, flat))
        flat += math.prod(sizes)
    return out


def _cut(shape, s, e, out) -> None:
    if s >= e:
        return
    if len(shape) == 1:
        out.append(((s,), (e - s,)))
        return
    inner = math.prod(shape[1:])
    row = s // inner
    if s % inner:                                   # head: the rest of a partial row
        stop = min(e, (row + 1) * inner)
        _row(shape, row, s - row * inner, stop - row * inner, out)
        s, row = stop, row + 1
    full = e // inner
    if s < e and full > row:                        # middle: whole rows
        out.append(((row,) + (0,) * (len(shape) - 1), (full - row,) + tuple(shape[1:])))
        s = full * inner
    if s < e:                                       # tail: the start of a row
        _row(shape, full, 0, e - full * inner, out)


def _row(shape, row, s, e, out) -> None:
    sub: list = []
    _cut(tuple(shape[1:]), s, e, sub)
    out.extend(((row,) + o, (1,) + z) for o, z in sub)


def cut_box(box: Box, axis: int, lo: int, hi: int) -> Box | None:
    """The part of `box` within [lo, hi) along `axis` (a TP piece of a strided shard, or the
    rows before the vocab padding); None if nothing is left. Cutting along axis 0 keeps a
    contiguous run of the box's elements."""
    b_lo, b_hi = box.offsets[axis], box.offsets[axis] + box.sizes[axis]
    s, e = max(lo, b_lo), min(hi, b_hi)
    if s >= e:
        return None
    if (s, e) == (b_lo, b_hi):
        return box
    if axis != 0:
        raise ValueError("only an axis-0 (row) cut keeps a box contiguous")
    off = list(box.offsets)
    off[0] = s
    return Box(tuple(off), (e - s,) + box.sizes[1:], box.flat_start + (s - b_lo) * math.prod(box.sizes[1:]))


def clip_box(box: Box, axis: int, limit: int) -> Box | None:
    """The part of `box` below `limit` along `axis` (vocab padding rows are not saved); None if
    nothing is left. Clipping along axis 0 keeps a prefix of the box's elements."""
    return cut_box(box, axis, 0, limit)


def shifted(box: Box, axis: int | None, by: int) -> Box:
    """The same box in the TP-merged tensor: moved by this TP shard's offset along its split axis."""
    if axis is None or by == 0:
        return box
    off = list(box.offsets)
    off[axis] += by
    return Box(tuple(off), box.sizes, box.flat_start)
