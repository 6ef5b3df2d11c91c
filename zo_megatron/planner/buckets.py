"""The engine's bucket layout on one rank (offload/flat_buffer.py), walked without building it."""
from __future__ import annotations

from typing import NamedTuple

from zo_megatron.planner.inputs import PlanInput
from zo_megatron.param_names import is_routed_expert
from zo_megatron.planner.params import layer_parameters, model_parameters

BUCKET_GROUPS = ("all", "dense", "expert")
# Where the device is the host, a bucket's reduce-scatter over DP goes through gloo. Below this many elements
# it is gloo's own reduce_scatter (ProcessGroupGloo::reduce_scatter_tensor_coalesced, torch 2.13), which
# all-reduces a clone of the whole bucket (a torch allocation) that lives until the engine waits for the
# collective; from here on parallel/collectives.py runs it as one in-place all_reduce (no copy). The same number
# as collectives.GLOO_ALL_REDUCE_MIN_NUMEL (the planner does not import torch; tests/test_reduce_scatter_copies.py
# checks that they agree).
GLOO_COPIED_BELOW_NUMEL = 1 << 20


class BucketWalk(NamedTuple):
    """One engine's flat layout on one rank, in elements: `count` buckets, the `largest` (padded), and
    `copied_pair`: the largest sum of two consecutive buckets below GLOO_COPIED_BELOW_NUMEL elements (a bucket
    at or above it counts 0; a layout of one bucket: that bucket). The engine can hold two such copies at
    once (grad_buckets.py: a sent bucket's copy home, which ends gloo's collective, runs only when its buffer
    is reused, two buckets later; memory._offload_model_states' `reduce_scatter_copies`)."""
    count: int
    largest: int
    copied_pair: int


def _bucket_layout(inp: PlanInput, vocab_padded: int, max_positions: int, quantum: int,
                   group: str = "all") -> tuple[int, int]:
    """(number of buckets, largest bucket in elements) of one engine's flat layout on one rank (`bucket_walk`)."""
    return tuple(bucket_walk(inp, vocab_padded, max_positions, quantum, group)[:2])


class _Closer:
    """The running state of a walk: buckets closed so far, the largest, the largest copied pair."""
    __slots__ = ("count", "largest", "prev", "pair")

    def __init__(self):
        self.count = self.largest = self.prev = self.pair = 0

    def close(self, fill: int, quantum: int) -> None:
        size = -(-fill // quantum) * quantum
        # copied when its elements are below the limit: the engine pads to a smaller quantum than the
        # planner (N x 64 elements against N x 128), so a bucket the planner pads up to the limit may still
        # be below it in the engine; counted at the planner's padded size
        copied = size if fill < GLOO_COPIED_BELOW_NUMEL else 0
        self.count, self.largest = self.count + 1, max(self.largest, size)
        self.pair, self.prev = max(self.pair, self.prev + copied), copied

    def walk(self) -> BucketWalk:
        return BucketWalk(self.count, self.largest, self.pair)


def bucket_walk(inp: PlanInput, vocab_padded: int, max_positions: int, quantum: int,
                group: str = "all") -> BucketWalk:
    """One engine's flat layout on one rank (BucketWalk).

    group: "all" (one engine holds every parameter: a dense model, or experts at EP 1 and expert TP =
    TP), "dense" or "expert" (at EP > 1 or another expert TP, offload/expert_parallel.py's two engines: the dense parameters, and this
    EP rank's routed experts). A dense model takes the fast walk (`_dense_bucket_layout`)."""
    if group not in BUCKET_GROUPS:
        raise ValueError(f"group must be one of {BUCKET_GROUPS}, got {group!r}")
    moe = inp.moe()
    if moe is None and group == "all":
        return _dense_bucket_layout(inp, vocab_padded, max_positions, quantum)
    h, t, cap, f, a, arch = (inp.hidden_size, inp.tensor_parallel, inp.bucket_size, inp.ffn(),
                             inp.num_attention_heads, inp.arch())

    et = inp.expert_tp() if moe is not None else t

    def local(rows) -> list[int]:
        return [n // (et if is_routed_expert(name) else t) if split else n for name, n, split in rows
                if group == "all" or is_routed_expert(name) == (group == "expert")]

    kinds = moe.layers if moe is not None else (False,) * inp.num_layers
    layer = {False: local(layer_parameters(h, f, a, arch)), True: local(layer_parameters(h, f, a, arch, moe))}
    total = {k: sum(v) for k, v in layer.items()}
    outside = model_parameters(0, h, f, a, vocab_padded, max_positions, arch)
    first_after = next(i for i, (name, _, _) in enumerate(outside) if name.startswith("decoder.final"))
    before, after = local(outside[:first_after]), local(outside[first_after:])
    walk, fill, open_ = _Closer(), 0, False

    def add(n: int) -> None:
        nonlocal fill, open_
        if n == 0:
            return
        fill, open_ = fill + n, True
        if fill >= cap:
            walk.close(fill, quantum)
            fill, open_ = 0, False

    for n in after[::-1]:
        add(n)
    # megatron's integer --moe-layer-freq repeats with its period: at a layer boundary the walk depends
    # only on `fill` and the position in the period, so a repeated state jumps over whole cycles (the buckets
    # they close repeat the ones walked, so the largest bucket and copied pair are already seen)
    period = inp.moe_layer_freq if isinstance(inp.moe_layer_freq, int) else None
    seen: dict[tuple[int, int], tuple[int, int]] | None = {} if period else None
    i = len(kinds)
    while i > 0:
        kind = kinds[i - 1]
        if seen is not None:
            key = (fill, i % period)
            if key in seen:
                i0, count0 = seen[key]
                cycles = (i // (i0 - i)) if i0 > i else 0
                # jump whole cycles, keeping at least one more period to walk
                cycles = max(0, cycles - 1)
                walk.count, i, seen = walk.count + cycles * (walk.count - count0), i - cycles * (i0 - i), None
                continue
            seen[key] = (i, walk.count)
        if fill + total[kind] < cap:
            if total[kind]:
                fill, open_ = fill + total[kind], True
        else:
            for n in layer[kind][::-1]:
                add(n)
        i -= 1
    for n in before[::-1]:
        add(n)
    if open_:
        walk.close(fill, quantum)
    return walk.walk()


def _dense_bucket_layout(inp: PlanInput, vocab_padded: int, max_positions: int, quantum: int) -> BucketWalk:
    """The engine's flat layout on one TP rank (BucketWalk).

    The engine (offload/flat_buffer.py) walks the parameters in backward order (reverse
    registration order: the untied output layer, the final norm, the layers from last to first,
    the position and word embeddings) and closes a bucket as soon as it holds >= bucket_size
    elements, padded to a multiple of N x alignment; a parameter never straddles two buckets. Whole
    layers that cannot close a bucket are skipped in one step and a repeating pattern of buckets
    over layers is jumped over, so this stays cheap for deep models and tiny buckets alike (checked
    against a parameter-by-parameter walk)."""
    h, t, L, cap, f = inp.hidden_size, inp.tensor_parallel, inp.num_layers, inp.bucket_size, inp.ffn()
    arch, a = inp.arch(), inp.num_attention_heads
    layer = [n // t if split else n for _, n, split in layer_parameters(h, f, a, arch)]
    outside = model_parameters(0, h, f, a, vocab_padded, max_positions, arch)
    first_after = next(i for i, (name, _, _) in enumerate(outside) if name.startswith("decoder.final"))
    before = [n // t if split else n for _, n, split in outside[:first_after]]   # embeddings
    after = [n // t if split else n for _, n, split in outside[first_after:]]    # final norm, output layer
    layer_bwd, layer_total = layer[::-1], sum(layer)
    walk, fill, open_ = _Closer(), 0, False

    def add(n: int) -> None:
        nonlocal fill, open_
        fill, open_ = fill + n, True
        if fill >= cap:
            walk.close(fill, quantum)
            fill, open_ = 0, False

    for n in after[::-1]:                 # (untied output layer,) final norm bias, weight
        add(n)
    left = L
    seen: dict[int, tuple[int, int]] | None = {}   # fill at a layer boundary -> (left, count)
    while left:
        k = min(left, (cap - 1 - fill) // layer_total) if fill + layer_total < cap else 0
        if k:
            fill, open_, left = fill + k * layer_total, True, left - k
            continue
        if seen is not None:              # the walk only depends on `fill` here: jump over cycles
            if fill in seen:
                left0, count0 = seen[fill]
                period = left0 - left
                # one period is left to walk: the pair of buckets across a period's boundary (the
                # period's last and the next one's first) is then seen; the cycles jumped repeat the rest
                cycles = max(0, left // period - 1)
                walk.count, left, seen = walk.count + cycles * (walk.count - count0), left - cycles * period, None
                continue
            seen[fill] = (left, walk.count)
        for n in layer_bwd:
            add(n)
        left -= 1
    for n in before[::-1]:                # (position embedding,) word embedding (tied: the output layer)
        add(n)
    if open_:
        walk.close(fill, quantum)
    return walk.walk()
