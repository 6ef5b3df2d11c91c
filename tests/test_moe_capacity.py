"""Expert capacity and token dropping (--moe-expert-capacity-factor, --moe-pad-expert-input-to-capacity,
--moe-token-drop-policy; issue 39) against an independent float64 torch reference.

The reference is written from Megatron-LM's documented semantics, not from megatron-core's code: each
rank routes its own T = seq x batch tokens (flattened [s, b], sequence-major) to the top k of E experts
with a softmax over the k chosen logits; each expert keeps at most capacity = ceil(T x k / E x factor)
of the rank's assignments, dropping the lowest-probability ones ("probs") or the latest tokens
("position"); a dropped assignment contributes nothing from that expert; padding each expert's input to
its capacity changes nothing numerically. On 2 forked gloo ranks (different tokens on each), one MoE
layer of our model (megatron-core's MoELayer as zo_megatron.model.gpt builds it) runs forward and
backward under a random upstream gradient at EP 1 (allgather, DP 2), EP 2 with the alltoall dispatcher,
EP 2 with the allgather dispatcher, and TP 2 with sequence parallelism (allgather, DP 1: each TP rank's
router sees, and drops over, its own sequence shard); the output, the input's gradient and every parameter's gradient
(router, each expert's fc1 and fc2, summed over the ranks that hold them) equal the reference's, every
element. The factor is chosen so that E x capacity < T x k: every rank drops, which the test asserts on
the routing map megatron-core's router returns (and, with padding, that each expert runs exactly its
capacity of tokens). Without a factor nothing is dropped.
"""
import math

import pytest
import torch

from tests.harness import next_port, run_world
from tests.seeds import fresh_seed

HIDDEN, FFN, EXPERTS, TOPK, SEQ, BATCH = 16, 12, 4, 2, 8, 2
TOKENS = SEQ * BATCH                          # per rank
FACTOR = 0.75                                 # capacity ceil(16 x 2 / 4 x 0.75) = 6: 4 x 6 < 32 assignments
LAYOUTS = ((1, 1, "allgather"), (1, 2, "alltoall"), (1, 2, "allgather"), (2, 1, "allgather"))  # (TP, EP, dispatcher)
CASES = ((None, False, "probs"), (FACTOR, False, "probs"), (FACTOR, True, "probs"), (FACTOR, False, "position"),
         (FACTOR, True, "position"))                                  # (factor, pad, policy)


def _cfg(dispatcher, factor, pad, policy, sequence_parallel=False):
    from zo_megatron.model import GPTConfig

    return GPTConfig(sequence_parallel=sequence_parallel, num_layers=1, hidden_size=HIDDEN, num_attention_heads=2, vocab_size=32,
                     max_position_embeddings=SEQ, ffn_hidden_size=FFN, swiglu=True, add_bias_linear=False,
                     normalization="RMSNorm", position_embedding_type="rope", num_experts=EXPERTS,
                     moe_router_topk=TOPK, moe_token_dispatcher_type=dispatcher, moe_expert_capacity_factor=factor,
                     moe_pad_expert_input_to_capacity=pad, moe_token_drop_policy=policy, precision="fp32")


def _weights(seed):
    """The MoE layer's full weights: router [E, h], expert e's fc1 [gate; up] [2f, h] and fc2 [h, f]."""
    gen = torch.Generator().manual_seed(seed)
    out = {"router.weight": torch.randn(EXPERTS, HIDDEN, generator=gen)}
    for e in range(EXPERTS):
        out[f"experts.{e}.linear_fc1.weight"] = torch.randn(2 * FFN, HIDDEN, generator=gen) * 0.3
        out[f"experts.{e}.linear_fc2.weight"] = torch.randn(HIDDEN, FFN, generator=gen) * 0.3
    return out


def _full(mlp, name):
    """Our full name of an MoE layer parameter: the expert's global index in place of its local one."""
    if name.startswith("experts.local_experts."):
        j, rest = name.removeprefix("experts.local_experts.").split(".", 1)
        return f"experts.{mlp.local_expert_indices[int(j)]}.{rest}"
    return name


def _inputs(tensors, rank, tp):
    """Rank `rank`'s tokens: its own [s, b] at TP 1 (DP 2), its sequence shard of sample 0's at TP 2 (SP)."""
    return tensors[rank] if tp == 1 else tensors[0].chunk(tp)[rank]


def _world(rank, weights, xs, gs):
    from zo_megatron.model import build_gpt_model
    from zo_megatron.model.sharding import gather_full, shard_info, shard_of
    from zo_megatron.parallel import collectives, destroy_parallel, init_parallel

    out = {}
    for tp, ep, dispatcher in LAYOUTS:
        next_port()                                  # chosen now, not when the test started
        ps = init_parallel(tp, expert_parallel=ep)
        for factor, pad, policy in CASES:
            model = build_gpt_model(_cfg(dispatcher, factor, pad, policy, tp > 1), ps.tp_rank, tp, seed=1)
            mlp = model.gpt.decoder.layers[0].mlp
            infos = {n: shard_info(f"decoder.layers.0.mlp.{_full(mlp, n)}", p, ps.tp_rank, tp)
                     for n, p in mlp.named_parameters()}
            with torch.no_grad():
                for n, p in mlp.named_parameters():
                    p.copy_(shard_of(weights[_full(mlp, n)], infos[n]))
            maps = []
            mlp.router.register_forward_hook(lambda _m, _i, o: maps.append(o[1].detach().clone()))
            x = _inputs(xs, rank, tp).clone().requires_grad_(True)
            y, _ = mlp(x)
            (y * _inputs(gs, rank, tp)).sum().backward()
            grads = {}
            for n, p in mlp.named_parameters():
                g = p.grad
                if getattr(p, "sequence_parallel", False) and tp > 1:     # the router: megatron's finalize_model_grads
                    g = collectives.all_reduce(g.clone(), "sum", ps.tp_group)
                grads[_full(mlp, n)] = gather_full(g, infos[n], ps.tp_group, tp).clone()
            out[(tp, ep, dispatcher, factor, pad, policy)] = dict(
                y=y.detach().clone(), dx=x.grad.clone(), routing_map=maps[0], grads=grads, tp_rank=ps.tp_rank)
        collectives.barrier()
        destroy_parallel()
    return out


def _reference(weights, x, factor, pad, policy):
    """One rank's MoE layer output from Megatron-LM's documented semantics (float64 autograd graph),
    and the assignments it drops. `pad` is not an argument of the math: padding changes nothing."""
    del pad
    h = x.reshape(-1, HIDDEN)
    tokens = h.shape[0]
    logits = h @ weights["router.weight"].T
    top, chosen = logits.topk(TOPK, dim=1)
    probs = torch.zeros(tokens, EXPERTS, dtype=h.dtype).scatter(1, chosen, torch.softmax(top, dim=1))
    routed = torch.zeros(tokens, EXPERTS, dtype=torch.bool).scatter(1, chosen, True)
    capacity = tokens if factor is None else math.ceil(tokens * TOPK / EXPERTS * factor)
    y = torch.zeros_like(h)
    dropped = 0
    for e in range(EXPERTS):
        assigned = routed[:, e].nonzero().flatten().tolist()         # in [s, b] order
        if policy == "probs":
            assigned = sorted(assigned, key=lambda t: -probs[t, e].item())
        kept = torch.tensor(sorted(assigned[:capacity]), dtype=torch.long)
        dropped += len(assigned) - len(kept)
        if not len(kept):
            continue
        gate, up = (h[kept] @ weights[f"experts.{e}.linear_fc1.weight"].T).chunk(2, dim=1)
        out = (torch.nn.functional.silu(gate) * up) @ weights[f"experts.{e}.linear_fc2.weight"].T
        y = y.index_add(0, kept, probs[kept, e, None] * out)
    return y.reshape(x.shape), dropped, capacity


def _rel_err(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp(min=1e-30)).item()


def test_capacity_dropping_and_padding_equal_the_reference_at_ep1_ep2_alltoall_allgather_and_tp2():
    seed = fresh_seed("moe capacity")
    weights = _weights(seed)
    gen = torch.Generator().manual_seed(seed + 1)
    xs = torch.randn(2, SEQ, BATCH, HIDDEN, generator=gen)
    gs = torch.randn(2, SEQ, BATCH, HIDDEN, generator=gen)
    world = run_world(_world, 2, weights, xs, gs, timeout=300)
    for (tp, ep, dispatcher) in LAYOUTS:
        for factor, pad, policy in CASES:
            key = (tp, ep, dispatcher, factor, pad, policy)
            # the reference: each rank's tokens (a TP rank's sequence shard under SP) routed on their own
            ref_w = {n: w.double().requires_grad_(True) for n, w in weights.items()}
            ref_x = [_inputs(xs, r, tp).double().requires_grad_(True) for r in range(2)]
            outs = [_reference(ref_w, ref_x[r], factor, pad, policy) for r in range(2)]
            sum((o[0] * _inputs(gs, r, tp).double()).sum() for r, o in enumerate(outs)).backward()
            grads = {}
            for r in range(2):
                got = world[r][key]
                y_ref, dropped, capacity = outs[r]
                assert _rel_err(got["y"], y_ref) <= 1e-5, (key, r, _rel_err(got["y"], y_ref))
                assert _rel_err(got["dx"], ref_x[r].grad) <= 1e-5, (key, r)
                per_expert = got["routing_map"].sum(dim=0)
                if factor is None:
                    assert dropped == 0 and per_expert.sum() == y_ref.numel() // HIDDEN * TOPK, key
                elif pad:
                    assert dropped > 0 and per_expert.tolist() == [capacity] * EXPERTS, (key, per_expert)
                else:
                    assert dropped > 0 and per_expert.sum() == y_ref.numel() // HIDDEN * TOPK - dropped, \
                        (key, dropped, per_expert)
                if got["tp_rank"] == 0:           # TP ranks hold the same gathered gradients
                    for n, g in got["grads"].items():
                        grads[n] = grads[n] + g if n in grads else g
            assert set(grads) == set(ref_w), key
            for n, g in grads.items():
                assert _rel_err(g, ref_w[n].grad) <= 1e-5, (key, n, _rel_err(g, ref_w[n].grad))


SHAPE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32", "--lr", "1e-3",
         "--micro-batch-size", "2", "--train-iters", "5", "--disable-bias-linear", "--swiglu"]


def test_the_flags_reach_megatron_core_and_bad_input_is_one_line_each():
    """Megatron-LM's names and defaults; the job's flags give GPTConfig's fields and megatron-core's
    TransformerConfig; a negative factor is megatron-core's "no dropping"; each rule one line, before
    anything starts (parse_args is the job's check of its command line)."""
    from zo_megatron.errors import ConfigError
    from zo_megatron.model.gpt import transformer_config
    from zo_megatron.training import components
    from zo_megatron.training.arguments import parse_args

    moe = ["--num-experts", "4", "--moe-router-topk", "2"]
    args = parse_args([*SHAPE, *moe])
    assert (args.moe_expert_capacity_factor, args.moe_pad_expert_input_to_capacity, args.moe_token_drop_policy) == \
        (None, False, "probs")
    args = parse_args([*SHAPE, *moe, "--moe-expert-capacity-factor", "1.25", "--moe-pad-expert-input-to-capacity",
                       "--moe-token-drop-policy", "position"])
    args.model_vocab_size = 128
    core = transformer_config(components.model_config(args), 1)
    assert (core.moe_expert_capacity_factor, core.moe_pad_expert_input_to_capacity, core.moe_token_drop_policy) == \
        (1.25, True, "position")
    args = parse_args([*SHAPE, *moe, "--moe-expert-capacity-factor", "-1"])
    args.model_vocab_size = 128
    assert components.model_config(args).moe_expert_capacity_factor is None
    cases = [
        (["--moe-expert-capacity-factor", "1.0"], "--moe-expert-capacity-factor configures mixture-of-experts layers: "
                                                   "add --num-experts"),
        ([*moe, "--moe-pad-expert-input-to-capacity"], "add --moe-expert-capacity-factor"),
        ([*moe, "--moe-token-drop-policy", "random"], "--moe-token-drop-policy random: choose one of probs, position"),
        ([*moe, "--moe-expert-capacity-factor", "0"], "a capacity of 0 tokens"),
        ([*moe, "--moe-expert-capacity-factor", "2.5", "--moe-pad-expert-input-to-capacity",
          "--moe-token-dispatcher-type", "alltoall"], "use a factor <= 2 (nothing is dropped above it)"),
    ]
    for flags, says in cases:
        with pytest.raises(ConfigError) as err:
            parse_args([*SHAPE, *flags])
        assert "\n" not in str(err.value) and says in str(err.value), (flags, str(err.value))


def test_checkpoints_record_capacity_and_older_ones_read_as_no_dropping():
    """Architecture fields: recorded, compared on resume (one line naming the flag's field), printed as
    job flags; a checkpoint from before them reads as Megatron-LM's defaults (no dropping)."""
    from zo_megatron.checkpoint.arch import job_flags
    from zo_megatron.checkpoint.load import _check_model
    from zo_megatron.errors import UserError
    from zo_megatron.model.config import ARCH_FIELDS, complete_arch_meta

    fields = ("moe_expert_capacity_factor", "moe_pad_expert_input_to_capacity", "moe_token_drop_policy")
    assert set(fields) <= set(ARCH_FIELDS)
    dropping = _cfg("allgather", 1.5, True, "position").arch_meta()
    dropless = _cfg("allgather", None, False, "probs").arch_meta()
    assert {k: dropping[k] for k in fields} == dict(zip(fields, (1.5, True, "position")))
    assert "--moe-expert-capacity-factor 1.5 --moe-pad-expert-input-to-capacity --moe-token-drop-policy position" \
        in job_flags(dropping)
    assert "capacity" not in job_flags(dropless) and "drop-policy" not in job_flags(dropless)
    older = {k: v for k, v in dropless.items() if k not in fields}
    assert complete_arch_meta(older) == dropless
    _check_model({"model": older}, dropless, "ckpt")
    _check_model({"model": dropping}, dropping, "ckpt")
    with pytest.raises(UserError) as err:
        _check_model({"model": older}, dropping, "ckpt")
    assert "\n" not in str(err.value) and all(f in str(err.value) for f in fields), str(err.value)
