"""The planner's `reduce_scatter_copies` (planner/memory.py) and the bucket walk behind it (planner/buckets.py).

Where the device is the host, gloo reduce-scatters a gradient bucket below 2**20 elements by all-reducing a
clone of the whole bucket; the engine keeps the clones of two consecutive buckets alive at once (until a
bucket's buffer is reused). The planner counts the largest such pair of its bucket layout. What the engine
and gloo really hold is measured in tests/test_planner_validation.py (item 4); here:

* the planner's limit is collectives' rule for running a CPU reduce-scatter as one in-place all_reduce;
* the planner's bucket walk (whole layers skipped, repeating patterns jumped over) gives what the engine's
  own layout (offload/flat_buffer.FlatLayout, on meta parameters of the planner's shapes) gives, bucket
  count, largest bucket and largest copied pair, for random dense and MoE models, deep ones included;
* the item is there only where the copies are made: a CPU device, DP > 1, a bucket below the limit.
"""
from __future__ import annotations

import random

import pytest
import torch

from tests.seeds import fresh_seed
from zo_megatron import planner as P
from zo_megatron.offload.flat_buffer import ALIGN, FlatLayout
from zo_megatron.param_names import is_routed_expert
from zo_megatron.parallel import collectives
from zo_megatron.planner.buckets import GLOO_COPIED_BELOW_NUMEL, bucket_walk
from zo_megatron.planner.params import model_parameters, pad_vocab_size

LIMIT = GLOO_COPIED_BELOW_NUMEL


def test_the_limit_is_the_one_collectives_runs_in_place_from():
    """Below the limit a CPU reduce-scatter is gloo's own (a copy), from it one in-place all_reduce."""
    assert LIMIT == collectives.GLOO_ALL_REDUCE_MIN_NUMEL
    for dtype in (torch.float32, torch.bfloat16):
        assert not collectives._as_all_reduce("reduce_scatter", torch.empty(LIMIT - 1, dtype=dtype))
        assert collectives._as_all_reduce("reduce_scatter", torch.empty(LIMIT, dtype=dtype))


def _engine_walk(inp: P.PlanInput, group: str, dp: int):
    """(count, largest, copied pair) of the engine's FlatLayout over the planner's parameter shapes, on meta
    tensors: the reference the planner's walk must equal. A bucket is copied when its parameters' elements
    are below the limit (the planner's rule; its padded size may be at or past it, see buckets._Closer)."""
    t = inp.tensor_parallel
    moe = inp.moe()
    et = inp.expert_tp() if moe is not None else t
    vocab = pad_vocab_size(inp.vocab_size, t, inp.make_vocab_size_divisible_by)
    rows = model_parameters(inp.num_layers, inp.hidden_size, inp.ffn(), inp.num_attention_heads, vocab,
                            inp.max_position_embeddings or inp.seq_length, inp.arch(), moe)
    named = []
    for name, n, split in rows:
        expert = is_routed_expert(name)
        if group != "all" and expert != (group == "expert"):
            continue
        numel = n // (et if expert else t) if split else n
        if numel:
            named.append((name, torch.nn.Parameter(torch.empty(numel, device="meta"))))
    layout = FlatLayout(named, dp_size=dp, dp_rank=0, tp_rank=0, bucket_size=inp.bucket_size)
    copied = [b.numel if sum(s.numel for s in b.slots) < LIMIT else 0 for b in layout.buckets]
    pair = max([copied[0]] + [a + b for a, b in zip(copied, copied[1:])])
    return len(layout.buckets), layout.max_bucket_numel, pair


def _random_input(rng: random.Random) -> tuple[P.PlanInput, str]:
    """A random model, layout and bucket size (tiny to past the limit), and which engine's group to walk."""
    heads = rng.choice([4, 8])
    h = heads * rng.choice([16, 32, 64])
    tp, dp = rng.choice([1, 2, 4]), rng.choice([1, 2, 4])
    fields = dict(num_layers=rng.choice([1, 2, 3, 7, rng.randint(20, 300)]), hidden_size=h,
                  num_attention_heads=heads, vocab_size=rng.choice([1000, 5000, 50257]), seq_length=128,
                  tensor_parallel=tp, data_parallel=dp, partition_alignment=ALIGN, device_is_host=True,
                  bucket_size=rng.choice([rng.randint(1, 5000), rng.randint(5000, 400_000),
                                          rng.randint(LIMIT - 70_000, LIMIT + 70_000), 40_000_000]))
    if rng.random() < 0.5:      # the Llama shape: untied output layer, RMSNorm, SwiGLU, GQA, no biases
        fields.update(position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
                      num_query_groups=heads // 2 if heads // 2 % tp == 0 else None,
                      untie_embeddings_and_output_weights=True, add_bias_linear=False)
    group = "all"
    if rng.random() < 0.4:      # experts, every layer or a period, at EP 1 (one engine) or apart
        ep = rng.choice([1, 2])
        fields.update(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=h,
                      moe_layer_freq=rng.choice([1, 2, 3, [1, 0] * (fields["num_layers"] // 2) + [1] *
                                                 (fields["num_layers"] % 2)]),
                      expert_parallel=ep, data_parallel=dp * ep)
        group = rng.choice(["dense", "expert"]) if ep > 1 else "all"
    return P.PlanInput(**fields), group


def _check_walk(inp: P.PlanInput, group: str, note) -> int:
    """The planner's walk of `group` against the engine's layout; returns the copied pair."""
    # the engine's group over its DP: the dense one over DP, the experts over expert DP
    n = inp.expert_data_parallel() if group == "expert" else inp.data_parallel
    vocab = pad_vocab_size(inp.vocab_size, inp.tensor_parallel, inp.make_vocab_size_divisible_by)
    walk = bucket_walk(inp, vocab, inp.max_position_embeddings or inp.seq_length, n * ALIGN, group)
    assert tuple(walk) == _engine_walk(inp, group, n), (note, inp, group)
    return walk.copied_pair


# layouts whose largest copied pair straddles the period of a repeating bucket pattern the walk jumps over
# (the last bucket of one period, the first of the next): found by the draw below when the walk jumped every
# repeated period (GPT-2 and the Llama shape)
JUMPED_PERIODS = [dict(num_layers=7, hidden_size=256, num_attention_heads=8, vocab_size=5000, data_parallel=4,
                       bucket_size=377246),
                  dict(num_layers=208, hidden_size=128, num_attention_heads=4, vocab_size=50257, tensor_parallel=4,
                       bucket_size=39695, position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
                       untie_embeddings_and_output_weights=True, add_bias_linear=False)]


@pytest.mark.parametrize("shape", JUMPED_PERIODS, ids=["gpt2", "llama"])
def test_the_pair_across_a_jumped_period_is_walked(shape):
    inp = P.PlanInput(**shape, seq_length=128, partition_alignment=ALIGN, device_is_host=True)
    assert _check_walk(inp, "all", shape) > 0


def test_bucket_walk_equals_the_engine_layout():
    seed = fresh_seed("bucket walk vs FlatLayout")
    rng = random.Random(seed)
    checked = copied = 0
    while checked < 150:
        inp, group = _random_input(rng)
        try:
            inp.validate()
        except ValueError:
            continue
        copied += _check_walk(inp, group, seed) > 0
        checked += 1
    assert copied > 20            # the draw reaches layouts with copies and without


def _cpu(**kw) -> P.PlanInput:
    base = dict(num_layers=2, hidden_size=128, num_attention_heads=4, vocab_size=1000, seq_length=128,
                data_parallel=2, bucket_size=200_000, precision="bf16", device_is_host=True, device_overhead_bytes=0)
    return P.PlanInput(**{**base, **kw})


def test_the_item_is_the_largest_copied_pair_where_gloo_copies():
    p = P.plan(_cpu())
    walk = bucket_walk(p.input, p.vocab_size_padded, p.input.seq_length, 2 * p.input.partition_alignment)
    assert walk.count == 2 and walk.copied_pair < LIMIT
    # bf16 gradients are reduced in fp32 buckets (4 bytes), 16-bit ones copy 2 bytes per element
    assert p.device_items["reduce_scatter_copies"] == 4 * walk.copied_pair
    assert P.plan(_cpu(grad_reduce_fp32=False)).device_items["reduce_scatter_copies"] == 2 * walk.copied_pair
    # on the device total, beside the allowance for the library's own buffers
    assert p.device_items["reduce_scatter_scratch"] == 4 * 200_000
    assert "reduce_scatter_copies" not in P.plan(_cpu(device_is_host=False)).device_items   # NCCL: in place
    assert "reduce_scatter_copies" not in P.plan(_cpu(data_parallel=1)).device_items   # no collective
    # buckets of 2**20 elements and more: one in-place all_reduce, no copy; only the last bucket (the
    # embeddings and what the layers left open) is smaller, so the pair is that one bucket
    big = P.plan(_cpu(num_layers=40, hidden_size=512, num_attention_heads=8, bucket_size=LIMIT))
    big_walk = bucket_walk(big.input, big.vocab_size_padded, 128, 2 * big.input.partition_alignment)
    assert big_walk.count > 3 and big_walk.largest >= LIMIT and 0 < big_walk.copied_pair < LIMIT
    assert big.device_items["reduce_scatter_copies"] == 4 * big_walk.copied_pair
    # may_fit's monotone bound leaves the copies out with the overfill (both follow the layout's sawtooth)
    assert "reduce_scatter_copies" not in P.memory._compute(_cpu(), bucket_overfill=False).device_items


def test_the_expert_engine_plans_its_own_copies():
    inp = _cpu(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=128, expert_parallel=2, data_parallel=4,
               bucket_size=50_000)
    p = P.plan(inp)
    items, vocab = p.device_items, p.vocab_size_padded
    for prefix, group, n in (("", "dense", 4), ("expert_", "expert", inp.expert_data_parallel())):
        walk = bucket_walk(inp, vocab, 128, n * inp.partition_alignment, group)
        assert walk.copied_pair and items[prefix + "reduce_scatter_copies"] == 4 * walk.copied_pair
