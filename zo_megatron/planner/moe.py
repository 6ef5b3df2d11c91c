"""What a mixture-of-experts layer adds to the activations (megatron-core 0.16.1's MoELayer, local
spec, SequentialMLP experts; read from its source and measured with saved-tensor hooks in
tests/test_planner_moe.py). Per rank, for one micro-batch of T = s·b tokens per TP group (T_loc =
T/t of them on a rank with sequence parallelism), k = top-k, E experts, f_e the experts' FFN size,
t = TP, e_t = expert TP (default t), w = 2 bytes (bf16/fp16) or 4 (fp32). The experts see the tokens
of their expert-TP group, T_e = T_loc·e_t (= T at e_t = t). Routing is assumed balanced (the aux
loss's aim): each EP rank's experts receive k·T_e token slots, whatever EP is (allgather: T_e·EP
gathered over expert TP x EP, k/EP of their slots local; alltoall: k·T_loc slots sent, as many
received, gathered over expert TP) — unless the plan says otherwise (`routed_slots`):
`moe_routing_imbalance` r (planner only) plans the busiest EP rank at r x the balanced share, and a
capacity factor c (--moe-expert-capacity-factor) bounds each expert at cap = ceil(k·T_loc/E·c) slots
from each router rank (megatron-core's get_capacity over the router's tokens), which
--moe-pad-expert-input-to-capacity fills exactly.
"""
from __future__ import annotations

import math

from zo_megatron.planner.inputs import PlanInput
from zo_megatron.planner.mlp_activations import expert_saved_widths, mlp_saved_widths

# bytes the router keeps per local token and routing slot: the fp32 top-k probabilities and two int64
# index tensors (top-k indices, their scatter into the routing map)
ROUTER_BYTES_PER_SLOT = 4 + 8 + 8
# and per routed slot on the expert side: the int64 permutation index (saved by the gather/scatter)
PERMUTE_INDEX_BYTES = 8


def _w(inp: PlanInput) -> int:
    return 4 if inp.precision == "fp32" else 2


def _capacity(inp: PlanInput) -> int | None:
    """Each expert's slots from one router rank under a capacity factor (None: no capacity)."""
    c = inp.moe_expert_capacity_factor
    if c is None or c < 0:                        # megatron-core: None or negative = no dropping
        return None
    _, T_loc = _tokens(inp)
    return math.ceil(inp.moe_router_topk * T_loc / inp.num_experts * c)


def local_slots(inp: PlanInput) -> int:
    """Routed rows this rank's router sends: k·T_loc, or at most E x capacity (exactly, padded)."""
    _, T_loc = _tokens(inp)
    cap, k, e = _capacity(inp), inp.moe_router_topk, inp.num_experts
    if cap is None:
        return k * T_loc
    return e * cap if inp.moe_pad_expert_input_to_capacity else min(k * T_loc, e * cap)


def routed_slots(inp: PlanInput) -> int:
    """Token slots this EP rank's experts compute in one MoE layer call: k·T_e balanced, times
    moe_routing_imbalance for the busiest rank, never above what can reach it (each of the expert TP
    x EP group's tokens sends at most min(k, E/EP) slots here) nor, with a capacity, E·cap·e_t (each
    local expert takes at most cap from each of the group's ranks); padded to capacity: exactly that."""
    T_e, T_loc = _tokens(inp)
    k, e, ep, et = inp.moe_router_topk, inp.num_experts, inp.expert_parallel, inp.expert_tp()
    cap = _capacity(inp)
    if cap is not None and inp.moe_pad_expert_input_to_capacity:
        return e * cap * et
    bound = T_loc * et * ep * min(k, e // ep)
    if cap is not None:
        bound = min(bound, e * cap * et)
    return min(math.ceil(inp.moe_routing_imbalance * k * T_e), bound)


def _tokens(inp: PlanInput) -> tuple[int, int]:
    """(T_e: the tokens of one micro-batch this rank's expert-TP group routes, T_loc: those on this
    rank's sequence shard)."""
    t = inp.seq_length * inp.micro_batch_size
    local = t // inp.tensor_parallel if inp.sp() else t
    return local * inp.expert_tp() if inp.sp() else t, local


def moe_mlp_saved(inp: PlanInput) -> int:
    """Bytes one MoE layer's MLP keeps for backward on one rank (instead of the dense MLP's
    F·f/t·w per token, F = mlp_activations.mlp_saved_widths: 2 GELU, 5 SwiGLU, 7 GPT-OSS's clamped quick
    GeGLU; the router's input is the pre-MLP norm's output, which the layer keeps as a dense layer's fc1
    keeps it).

    routed experts (k·T slots): their input rows (the permuted tokens, h wide: split views keep the
      whole tensor), each expert's MLP (F·f_e/e_t, + f_e/e_t: the output scaled by its routing weight is a
      new tensor: mlp_activations.expert_saved_widths), the routing weight (w) and the permutation index (8)
      per slot (the experts' biases keep nothing more: mlp_activations);
    router, per local token: fp32 scores (4·E) and per slot ROUTER_BYTES_PER_SLOT;
    routing map and weights of the local experts, E x T_e (allgather: the gathered tokens; alltoall:
      the local ones): bool + 16-bit;
    shared expert: a dense MLP of its size (F·f_s/t per token) and, gated, its output (h) and the
      sigmoid (1) per local token."""
    e, k, h = inp.num_experts, inp.moe_router_topk, inp.hidden_size
    w, f_e, et = _w(inp), inp.moe_ffn(), inp.expert_tp()
    T, T_loc = _tokens(inp)
    routed = routed_slots(inp) * (w * h + w * expert_saved_widths(inp) * f_e // et + w + PERMUTE_INDEX_BYTES)
    router = T_loc * (4 * e + ROUTER_BYTES_PER_SLOT * k)
    routing_map = (w + 1) * e * (T if inp.moe_token_dispatcher_type == "allgather" else T_loc)
    return routed + router + routing_map + shared_expert_saved(inp)


def shared_expert_saved(inp: PlanInput) -> int:
    """The shared expert's part of `moe_mlp_saved`: a dense MLP of its size (F·f_s/t per token) and,
    gated, its output (h) and the sigmoid (1) per local token (what --recompute-modules
    shared_experts recomputes instead)."""
    if not inp.moe_shared_expert_intermediate_size:
        return 0
    w, mlp = _w(inp), mlp_saved_widths(inp)
    _, T_loc = _tokens(inp)
    # dense: over TP, on the TP group's s·b tokens
    shared = w * mlp * inp.moe_shared_expert_intermediate_size // inp.tensor_parallel * inp.seq_length * \
        inp.micro_batch_size
    if inp.moe_shared_expert_gate:
        shared += w * T_loc * (inp.hidden_size + 1)
    return shared


def moe_backward_grads(inp: PlanInput) -> int:
    """The largest gradients of one MoE layer's backward besides the residual stream's: each routed
    slot's fc1-output gradient (2·f_e/e_t wide, as the dense MLP's 2f) and its input-row gradient (h),
    and the shared expert's fc1-output gradient (2·f_s/t per token)."""
    t, w = inp.tensor_parallel, _w(inp)
    shared = 2 * w * inp.seq_length * inp.micro_batch_size * (inp.moe_shared_expert_intermediate_size or 0) // t
    return routed_slots(inp) * w * (2 * inp.moe_ffn() // inp.expert_tp() + inp.hidden_size) + shared


def moe_dispatcher(inp: PlanInput) -> tuple[int, int]:
    """(persistent, transient) bytes of the token dispatcher on one rank.

    allgather (expert TP x EP > 1): the hidden states of the expert TP x EP group's T_e·EP tokens are gathered into
      megatron-core's global memory buffer ("mpu", the one sequence parallelism's linears gather into:
      one buffer of the larger size, live in every phase), persistent w·T·EP·h; transient, the gathered
      routing weights and map (fp32 + bool, E per gathered token).
    alltoall: transient, the permuted local slots (`local_slots` rows of h) and what the all-to-all
      receives (`routed_slots` / e_t: as many, balanced); the rows gathered over expert TP and sorted
      by expert are the experts' saved input.
    Both dispatchers' backward moves gradients of the same sizes (counted in the layer's backward)."""
    e, h, w, ep = inp.num_experts, inp.hidden_size, _w(inp), inp.expert_parallel
    T, T_loc = _tokens(inp)
    if inp.moe_token_dispatcher_type == "allgather":
        if inp.expert_tp() * ep == 1:
            return 0, 0
        return w * T * ep * h, 5 * e * T * ep
    return 0, (local_slots(inp) + routed_slots(inp) // inp.expert_tp()) * h * w
