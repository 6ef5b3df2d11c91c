"""Searches over the memory model: suggestions when a run does not fit, the largest model that fits."""
from __future__ import annotations

import math

from zo_megatron.planner.inputs import Plan, PlanInput
from zo_megatron.planner.memory import _compute, _try, may_fit
from zo_megatron.planner.units import format_bytes


def _describe(p: Plan) -> str:
    verdict = "fits" if p.fits else "still does not fit"
    return (f"device {format_bytes(p.device_bytes_per_gpu)}/GPU, host "
            f"{format_bytes(p.host_bytes_per_node)}/node -> {verdict}")


BF16_STATES_FLAGS = "--exp-avg-dtype bf16 --exp-avg-sq-dtype bf16"


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
        t = inp.tensor_parallel * 2
        limit = inp.gpus_per_node if inp.gpus_per_node and inp.gpus_per_node > 1 else 16
        while t <= min(limit, inp.num_attention_heads):
            if inp.num_attention_heads % t == 0:
                p = add(f"raise tensor parallel to {t} (`--tensor-model-parallel-size {t}`, "
                        f"launched on {t * inp.data_parallel} ranks)", inp.replace(tensor_parallel=t))
                if p is not None and p.fits_device:
                    break
            t *= 2
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
    family="hidden": num_layers and heads fixed, hidden grows in steps of lcm(128, heads)
                     (so the head dimension stays an integer and hidden stays a multiple of 128).
    Returns (params_total, {"num_layers", "hidden_size", "num_attention_heads"}), or (0, None)
    when even the smallest member does not fit. Exact although memory is not monotone along a
    family (largest_fitting).
    """
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")
    if family == "layers":
        def make(k):
            return inp_template.replace(num_layers=k)
        limit = max_layers
    else:
        step = math.lcm(128, inp_template.num_attention_heads)

        def make(k):
            return inp_template.replace(hidden_size=k * step)
        limit = max(1, max_hidden // step)

    lo = largest_fitting(lambda k: _compute(make(k)).fits, lambda k: may_fit(make(k)), limit)
    if lo == 0:
        return 0, None
    best = _compute(make(lo))
    shape = {"num_layers": best.input.num_layers, "hidden_size": best.input.hidden_size,
             "num_attention_heads": best.input.num_attention_heads}
    return best.params_total, shape


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
