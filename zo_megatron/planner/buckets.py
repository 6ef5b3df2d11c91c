"""The engine's bucket layout on one rank (offload/flat_buffer.py), walked without building it."""
from __future__ import annotations

from zo_megatron.planner.inputs import PlanInput
from zo_megatron.param_names import is_routed_expert
from zo_megatron.planner.params import layer_parameters, model_parameters

BUCKET_GROUPS = ("all", "dense", "expert")


def _bucket_layout(inp: PlanInput, vocab_padded: int, max_positions: int, quantum: int,
                   group: str = "all") -> tuple[int, int]:
    """(number of buckets, largest bucket in elements) of one engine's flat layout on one rank.

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
    count, largest, fill, open_ = 0, 0, 0, False

    def add(n: int) -> None:
        nonlocal count, largest, fill, open_
        if n == 0:
            return
        fill, open_ = fill + n, True
        if fill >= cap:
            count, largest = count + 1, max(largest, -(-fill // quantum) * quantum)
            fill, open_ = 0, False

    for n in after[::-1]:
        add(n)
    # megatron's integer --moe-layer-freq repeats with its period: at a layer boundary the walk depends
    # only on `fill` and the position in the period, so a repeated state jumps over whole cycles
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
                count, i, seen = count + cycles * (count - count0), i - cycles * (i0 - i), None
                continue
            seen[key] = (i, count)
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
        count, largest = count + 1, max(largest, -(-fill // quantum) * quantum)
    return count, largest


def _dense_bucket_layout(inp: PlanInput, vocab_padded: int, max_positions: int, quantum: int) -> tuple[int, int]:
    """(number of buckets, largest bucket in elements) of the engine's flat layout on one TP rank.

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
    count, largest, fill, open_ = 0, 0, 0, False

    def add(n: int) -> None:
        nonlocal count, largest, fill, open_
        fill, open_ = fill + n, True
        if fill >= cap:
            count, largest = count + 1, max(largest, -(-fill // quantum) * quantum)
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
                cycles = left // period
                count, left, seen = count + cycles * (count - count0), left - cycles * period, None
                continue
            seen[fill] = (left, count)
        for n in layer_bwd:
            add(n)
        left -= 1
    for n in before[::-1]:                # (position embedding,) word embedding (tied: the output layer)
        add(n)
    if open_:
        count, largest = count + 1, max(largest, -(-fill // quantum) * quantum)
    return count, largest
