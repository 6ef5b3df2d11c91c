"""Searches over the memory model: suggestions when a run does not fit, the largest model that fits."""
from __future__ import annotations

import math

from zo_megatron.planner.inputs import Plan, PlanInput
from zo_megatron.planner.params import Architecture
from zo_megatron.planner.memory import _compute, _ranks_layout, _try, may_fit
from zo_megatron.planner.units import format_bytes


def _describe(p: Plan) -> str:
    verdict = "fits" if p.fits else "still does not fit"
    return (f"device {format_bytes(p.device_bytes_per_gpu)}/GPU, host "
            f"{format_bytes(p.host_bytes_per_node)}/node -> {verdict}")


BF16_STATES_FLAGS = "--exp-avg-dtype bf16 --exp-avg-sq-dtype bf16"


_MODULE_WORDS = {"core_attn": "the attention core", "layernorm": "the norms", "mlp": "the MLPs",
                 "moe": "the MoE layers"}


def _selective_modules_worth_trying(inp: PlanInput) -> tuple:
    """Every --recompute-modules entry the job accepts for this model: the attention core, the norms,
    the dense MLPs (not with linear biases: the job refuses that) and the MoE layers."""
    moe = inp.moe()
    dense = moe is None or not all(moe.layers)
    return ("core_attn", "layernorm", *(("mlp",) if dense and not inp.add_bias_linear else ()),
            *(("moe",) if moe is not None else ()))


def _suggest(base: Plan) -> list[str]:
    """Changes that help, each re-planned. Every flag is written as pretrain_gpt.py takes it, inside
    backticks, so it can be pasted (tests/test_planner_compat.py parses each one)."""
    inp = base.input
    out: list[str] = []
    global_batch = inp.micro_batch_size * inp.grad_accum_steps * inp.data_parallel

    def add(text: str, changed: PlanInput) -> Plan | None:
        p = _try(changed)
        if p is not None:
            out.append(f"{text}: {_describe(p)}")
        return p

    if not inp.zero_offload:
        add("enable ZeRO-Offload (`--zero-offload`)", inp.replace(zero_offload=True))
    if not base.fits_device:
        if inp.normalized_recompute() != "full":
            modules = _selective_modules_worth_trying(inp)
            if modules and set(modules) != inp.selective_modules():
                what = ", ".join(_MODULE_WORDS[m] for m in modules)
                add(f"recompute {what} instead of keeping them, not whole layers (`--recompute-granularity "
                    f"selective --recompute-modules {' '.join(modules)}`)",
                    inp.replace(recompute="selective", recompute_modules=modules))
            add("enable full activation recompute (`--recompute-granularity full`)",
                inp.replace(recompute="full"))
        if inp.attention_backend != "sdpa":
            add("core attention through torch SDPA: no s x s scores stored (`--use-flash-attn`)",
                inp.replace(attention_backend="sdpa"))
        if inp.tensor_parallel > 1 and not inp.sequence_parallel and inp.seq_length % inp.tensor_parallel == 0:
            add("split norm/dropout activations over TP (`--sequence-parallel`)", inp.replace(sequence_parallel=True))
        if inp.micro_batch_size > 1:
            # a smaller global batch (same accumulation), and the same global batch (more
            # accumulation: with ZeRO-Offload that keeps 16-bit gradients on the device)
            # (without ZeRO-Offload accumulation is free: the gradients are on the device anyway)
            for keep_global in ((False, True) if inp.zero_offload else (True,)):
                mb = inp.micro_batch_size
                while mb > 1:
                    mb //= 2
                    accum = (max(1, global_batch // (mb * inp.data_parallel)) if keep_global
                             else inp.grad_accum_steps)
                    p = _try(inp.replace(micro_batch_size=mb, grad_accum_steps=accum))
                    if p is not None and p.fits_device:
                        break
                if keep_global and inp.zero_offload and accum == inp.grad_accum_steps:
                    continue
                what = ("same global batch" if keep_global else
                        f"global batch {mb * accum * inp.data_parallel}")
                add(f"lower the micro-batch to {mb} (`--micro-batch-size {mb} --global-batch-size "
                    f"{mb * accum * inp.data_parallel}`: grad accumulation {accum}, {what})",
                    inp.replace(micro_batch_size=mb, grad_accum_steps=accum))
        _tp_suggestions(inp, add, global_batch)
        _ep_suggestions(inp, add)
        if inp.precision == "fp32":
            add("train in bf16 (`--bf16`; or `--fp16`)", inp.replace(precision="bf16"))
        if inp.zero_offload and inp.bucket_size > 5_000_000:
            add("smaller gradient buckets (`--bucket-size 5000000`)", inp.replace(bucket_size=5_000_000))
    if not base.fits_host:
        if inp.overlap_cpu_step and inp.overlap_speculated_fraction > 0:
            from zo_megatron.planner.memory import solve_overlap_fraction

            f = solve_overlap_fraction(inp)
            add(f"speculate only what the free host memory holds (`--overlap-cpu-step auto`: {f:.0%} of the "
                "partition)" if f > 0 else "the synchronous CPU step (`--no-overlap-cpu-step`: no rollback state)",
                inp.replace(overlap_cpu_step=f > 0, overlap_speculated_fraction=f))
        if inp.zero_offload and not inp.bf16_optimizer_states:
            add(f"keep Adam moments in bf16 on the host (`{BF16_STATES_FLAGS}`)",
                inp.replace(bf16_optimizer_states=True))
        if inp.dpu:
            add("turn off DPU: drop --dpu (no pending-gradient buffer)",
                inp.replace(dpu=False, dpu_weight_prediction=False))
        if inp.gpus_per_node is not None:
            dp = inp.data_parallel * 2
            for _ in range(8):
                p = _try(inp.replace(data_parallel=dp))
                if p is not None and p.fits_host:
                    break
                dp *= 2
            add(f"spread over more nodes: launch {inp.tensor_parallel * dp} ranks for data parallel {dp} "
                f"({math.ceil(inp.tensor_parallel * dp / inp.gpus_per_node)} nodes)",
                inp.replace(data_parallel=dp))
    _accumulation_and_sequence_suggestions(base, add)
    # all of the memory savers at once (micro-batch kept: with ZeRO-Offload, trading micro-batch
    # for accumulation costs b16·Ψ of device memory), then also micro-batch 1
    combo = inp.replace(zero_offload=True, recompute="full", bf16_optimizer_states=True, dpu=False)
    p = None
    if combo != inp:
        p = add(f"all savers together (`--zero-offload --recompute-granularity full {BF16_STATES_FLAGS}`"
                f"{', drop --dpu' if inp.dpu else ''})", combo)
    if (p is None or not p.fits) and inp.micro_batch_size > 1:
        add(f"all savers together and micro-batch 1 (`--zero-offload --recompute-granularity full "
            f"{BF16_STATES_FLAGS} --micro-batch-size 1 --global-batch-size {inp.grad_accum_steps * inp.data_parallel}`"
            f"{', drop --dpu' if inp.dpu else ''})", combo.replace(micro_batch_size=1))
    return out


def _devices(inp: PlanInput) -> int:
    """The devices this job may be laid over without more hardware: its ranks, or the GPUs of the
    nodes it occupies when the node has more (gpus_per_node: the job's ranks per node in its own
    pre-launch check, a hardware preset's GPUs per node in estimate_memory.py)."""
    world, nodes, _ = _ranks_layout(inp)
    return max(world, nodes * inp.gpus_per_node) if inp.gpus_per_node else world


def _ep_suggestions(inp: PlanInput, add) -> None:
    """More expert parallelism on the same ranks: each GPU holds E / EP experts (EP divides the experts,
    EP x expert TP the world; at EP > 1 the job trains with --zero-offload only)."""
    if inp.num_experts is None or not inp.zero_offload:
        return
    ep, world = inp.expert_parallel * 2, inp.tensor_parallel * inp.data_parallel
    while ep * inp.expert_tp() <= world and ep <= inp.num_experts:
        if inp.num_experts % ep == 0 and world % (ep * inp.expert_tp()) == 0:
            p = add(f"raise expert parallelism to {ep} (`--expert-model-parallel-size {ep}`: "
                    f"{inp.num_experts // ep} of {inp.num_experts} experts per GPU)", inp.replace(expert_parallel=ep))
            if p is not None and p.fits_device:
                break
        ep *= 2


def _tp_suggestions(inp: PlanInput, add, global_batch: int) -> None:
    """A larger TP on the devices the job has (never more: a one-GPU machine gets none), within a
    node; where TP x DP would need more devices, the same ranks with a smaller DP (global batch kept)."""
    devices, ranks = _devices(inp), inp.tensor_parallel * inp.data_parallel
    node = min(inp.gpus_per_node or devices, devices)
    t = inp.tensor_parallel * 2
    while t <= min(node, inp.num_attention_heads):
        dp = inp.data_parallel if t * inp.data_parallel <= devices else ranks // t
        if inp.num_attention_heads % t == 0 and dp >= 1 and t * dp <= devices and \
                global_batch % (inp.micro_batch_size * dp) == 0:
            # experts at TP > 1 need sequence parallelism (megatron-core's MoE layer; the job's rule)
            sp = inp.num_experts is not None and not inp.sequence_parallel
            changed = inp.replace(tensor_parallel=t, data_parallel=dp, sequence_parallel=inp.sequence_parallel or sp,
                                  grad_accum_steps=global_batch // (inp.micro_batch_size * dp))
            how = (f"launched on {t * dp} ranks" if dp == inp.data_parallel else
                   f" --global-batch-size {global_batch}`, launched on the same {t * dp} ranks: DP {dp}")
            p = add(f"raise tensor parallel to {t} (`--tensor-model-parallel-size {t}"
                    + (" --sequence-parallel" if sp else "")
                    + ("`, " if dp == inp.data_parallel else "") + f"{how})", changed)
            if p is not None and p.fits_device:
                break
        t *= 2


def _shortfall(p: Plan) -> int:
    """Bytes over budget, summed over the plan's checks (device, host, unified on a CPU)."""
    i = p.input
    over = max(0, p.device_bytes_per_gpu - i.gpu_memory_bytes) + \
        max(0, p.host_bytes_per_node - i.host_memory_bytes_per_node)
    if i.device_is_host:
        over += max(0, p.device_bytes_per_gpu * p.ranks_per_node + p.host_bytes_per_node - i.host_memory_bytes_per_node)
    return over


def _activations_bind(p: Plan) -> bool:
    """Whether the activations are what is over: every failing check would fit without them."""
    i = p.input
    act = sum(v for k, v in p.device_items.items() if k.startswith(("activations", "logits"))
              or k == "allocator_fragmentation")
    if p.host_bytes_per_node > i.host_memory_bytes_per_node or act <= 0:
        return False        # the host holds no activations
    device_over = p.device_bytes_per_gpu - i.gpu_memory_bytes
    unified_over = p.device_bytes_per_gpu * p.ranks_per_node + p.host_bytes_per_node - i.host_memory_bytes_per_node
    return device_over <= act and (not i.device_is_host or unified_over <= act * p.ranks_per_node)


def _accumulation_and_sequence_suggestions(base: Plan, add) -> None:
    """`--accumulate-grads-on-host` where the gradients kept across micro-batches are what it saves
    (it moves them from the device into an fp32 host accumulator: only where that lowers the need),
    and a shorter `--seq-length` where the activations bind (the shortest halving that fits)."""
    inp = base.input
    if inp.zero_offload and inp.grad_accum_steps > 1 and not inp.accumulate_on_host:
        p = _try(inp.replace(accumulate_on_host=True))
        if p is not None and _shortfall(p) < _shortfall(base):
            add("accumulate gradients on the host in fp32 (`--accumulate-grads-on-host`: no gradients kept on the "
                "device across micro-batches)", inp.replace(accumulate_on_host=True))
    if not _activations_bind(base):
        return
    s, unit = inp.seq_length, inp.tensor_parallel if inp.sp() else 1
    while s // 2 >= max(unit, 1) and (s // 2) % unit == 0:
        s //= 2
        p = _try(inp.replace(seq_length=s))
        if p is not None and p.fits:
            keep = inp.max_position_embeddings is not None and inp.position_embedding_type == "learned_absolute"
            add(f"shorter sequences: the activations are what is over (`--seq-length {s}"
                + (f" --max-position-embeddings {inp.max_position_embeddings}" if keep else "") + "`)",
                inp.replace(seq_length=s))
            return


def plan(inp: PlanInput) -> Plan:
    """Memory per GPU and per node for `inp`, the verdict, and suggestions if it does not fit.

    Raises ValueError on an inconsistent configuration (e.g. heads not divisible by TP)."""
    p = _compute(inp)
    if not p.fits:
        p.suggestions = _suggest(p)
    return p


# ------------------------------------------------------------------------------------------------
# the largest model that fits

FAMILIES = ("layers", "hidden")


def max_model(inp_template: PlanInput, family: str = "layers", *, max_layers: int = 100_000,
              max_hidden: int = 1_000_000) -> tuple[int, dict[str, int] | None]:
    """Largest model of a shape family that fits `inp_template`'s hardware and settings.

    family="layers": hidden size and heads fixed, num_layers grows (1, 2, 3, ...).
    family="hidden": num_layers fixed, hidden grows (`family_member`: GPT-2 in steps of lcm(128,
                     heads) with the heads fixed; a Llama-family template keeping its proportions).
    Returns (params_total, {"num_layers", "hidden_size", "num_attention_heads"}), or (0, None)
    when even the smallest member does not fit. Exact although memory is not monotone along a
    family (largest_fitting).
    """
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")
    limit = max_layers if family == "layers" else \
        max(1, max_hidden // family_member(inp_template, family, 1).hidden_size)
    lo = largest_fitting(lambda k: _compute(family_member(inp_template, family, k)).fits,
                         lambda k: may_fit(family_member(inp_template, family, k)), limit)
    if lo == 0:
        return 0, None
    best = _compute(family_member(inp_template, family, lo))
    shape = {"num_layers": best.input.num_layers, "hidden_size": best.input.hidden_size,
             "num_attention_heads": best.input.num_attention_heads}
    if best.input.arch() != Architecture() and family == "hidden":    # the grown Llama's own proportions
        shape.update(num_query_groups=best.input.num_query_groups, ffn_hidden_size=best.input.ffn_hidden_size)
        if best.input.num_experts is not None:
            shape.update(moe_ffn_hidden_size=best.input.moe_ffn_hidden_size,
                         moe_shared_expert_intermediate_size=best.input.moe_shared_expert_intermediate_size)
    return best.params_total, shape


def family_member(template: PlanInput, family: str, k: int) -> PlanInput:
    """Size k of a shape family (max_model's): k layers, or a k-th hidden size.

    GPT-2 (the template's architecture is GPT-2's): hidden = k x lcm(128, heads), heads fixed.
    Llama family (any other architecture: rope, RMSNorm, SwiGLU, GQA, untied...): the template's
    proportions kept, so the grown model is a Llama shape: its head dimension (128 for the llama3
    presets) and its heads per KV group; k x TP query groups (TP must divide them), hidden = heads x
    head dim; an explicit ffn size grown in the template's ratio to hidden (Llama-3's 3.5h = 1.3 x
    8/3 h) and rounded up as Meta's reference code does, to a multiple (the largest power of two up to
    1024 that divides the template's ffn: 1024 for Llama-3, as its multiple_of).

    A mixture of experts keeps its experts, top-k, EP and dispatcher: "layers" adds layers (megatron's
    integer --moe-layer-freq continues its pattern; a 0/1 list fixes the layer count: refused), "hidden"
    grows the experts' and the shared expert's FFN sizes with the dense one's rule (their ratio to
    hidden kept, rounded up to their own multiple)."""
    if family == "layers":
        if template.num_experts is not None and not isinstance(template.moe_layer_freq, int):
            raise ValueError("--moe-layer-freq as a list fixes the number of layers: use --max-model hidden, or an "
                             "integer --moe-layer-freq")
        return template.replace(num_layers=k)
    if template.arch() == Architecture():
        hidden = k * math.lcm(128, template.num_attention_heads)
        grown = {name: _grown_ffn(getattr(template, name), hidden, template)     # explicit experts' sizes
                 for name in ("moe_ffn_hidden_size", "moe_shared_expert_intermediate_size") if getattr(template, name)}
        return template.replace(hidden_size=hidden, **grown)
    d, groups = template.head_dim(), template.query_groups()
    per_group = template.num_attention_heads // groups
    new_groups = k * template.tensor_parallel
    heads = new_groups * per_group
    hidden = heads * d
    changes = dict(hidden_size=hidden, num_attention_heads=heads,
                   num_query_groups=new_groups if template.num_query_groups is not None else None)
    for name in ("ffn_hidden_size", "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size"):
        f0 = getattr(template, name)
        if f0:
            changes[name] = _grown_ffn(f0, hidden, template)
    return template.replace(**changes)


def _grown_ffn(f0: int, hidden: int, template: PlanInput) -> int:
    """An explicit FFN size grown in its ratio to hidden, rounded up to its own multiple (the largest power
    of two up to 1024 dividing it, as Meta's multiple_of) and TP."""
    multiple = math.lcm(next(m for m in (1024, 512, 256, 128, 64, 32, 16, 8, 4, 2, 1) if f0 % m == 0),
                        template.tensor_parallel)
    return -(-f0 * hidden // (template.hidden_size * multiple)) * multiple


def largest_fitting(fits, may_fit, limit: int) -> int:
    """Largest k in [1, limit] with fits(k) (0: none), where `fits` need not be monotone but
    `may_fit` is, and holds wherever `fits` does (memory.may_fit): bisect on may_fit (exponential,
    then binary), then step down to the first k that fits. The steps down are bounded by the
    sawtooth of the bucket overfill, one bucket's bytes over what one size step adds."""
    for k in range(largest_monotone(may_fit, limit), 0, -1):
        if fits(k):
            return k
    return 0


def largest_monotone(holds, limit: int) -> int:
    """Largest k in [1, limit] with holds(k), for a monotone `holds` (0: none): exponential, then
    binary."""
    if not holds(1):
        return 0
    lo, hi = 1, 2
    while hi <= limit and holds(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, limit + 1)
    while hi - lo > 1:  # holds(lo), not holds(hi) (or hi beyond the limit)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if holds(mid) else (lo, mid)
    return lo
