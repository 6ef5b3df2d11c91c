"""The memory model: device bytes per GPU and host bytes per node, one function per component.

The formulas are written out in docs/memory_planner.md and in the package docstring
(zo_megatron/planner/__init__.py)."""
from __future__ import annotations

import math

from zo_megatron.planner.inputs import Plan, PlanInput
from zo_megatron.planner.buckets import _bucket_layout, bucket_walk
from zo_megatron.planner.layer_activations import (_bytes16, _core_attention_backward, _layer_saved, _norm_saved,
                                                   _selective_layer, attention_mask_bytes)
from zo_megatron.planner.moe import moe_backward_grads, moe_dispatcher
from zo_megatron.planner.params import count_params, pad_vocab_size
from zo_megatron.planner.units import format_bytes


def _activation_items(inp: PlanInput, vocab_padded: int) -> dict[str, int]:
    """Activation bytes on one GPU at the peak of forward + backward (Korthikanti et al. 2022).

    Stored activations P (all layers, or each layer's input with full recompute) stay live through
    backward. On top of P the peak is the largest of three phases that never coexist:

      A1  end of forward / loss backward: final-norm and output-layer inputs + the logits: the 16-bit
          logits (w) next to their fp32 copy that the vocab-parallel cross-entropy keeps (4); in
          backward that fp32 softmax becomes the gradient in place, and with a padded vocabulary
          the pad-column mask (GPTModelTP.forward) clones it in fp32 (4 more instead of w);
      A2  output-layer backward: the fp32/16-bit logits gradient + its contiguous copy (2·w) + the
          output layer's weight gradient (w·V_pad·h/t): tied to the word embedding it is held until
          the embedding lookup's gradient is added at the very end of backward; untied it is its
          own parameter, first in backward order, and goes to its bucket at once;
      B   backward of the last layer: its activations (recomputed with recompute: the working
          set) + its gradients (2f wide: fc1-output sized twice with GELU, fc1's [gate; up] output
          once with SwiGLU; the residual stream twice) + the held tied embedding gradient.
      B'  the same layer's core attention backward on torch SDPA's CPU math path: its two fp32 s x s
          gradients, net of what the layer released before (`_core_attention_backward`), + the
          residual stream's gradients + the held tied embedding gradient.

    Line items: P, each phase's parts, and `activations_phases_not_coexisting` (<= 0), which takes
    back what the phases would double count: the items sum to P + max(A1, A2, B, B').
    With sequence parallelism the all-gather buffer is live in every phase; so is the attention mask of
    per-document attention or a sliding window (`activations_attention_mask`) where something keeps it for backward
    (layer_activations.attention_mask_bytes; else it ends with the forward, beside the logits).
    """
    s, b, h = inp.seq_length, inp.micro_batch_size, inp.hidden_size
    t, L, f = inp.tensor_parallel, inp.num_layers, inp.ffn()
    w = _bytes16(inp.precision)
    sbh = s * b * h
    mask = 1 if inp.dropout else 0
    # the layers' kinds (dense, and with experts MoE: `moe.py`), each kind's saved bytes
    moe = inp.moe()
    kinds = list(moe.layers) if moe is not None else [False] * L
    saved = {kind: _layer_saved(inp, kind) for kind in set(kinds)}
    full = {kind: sum(v) for kind, v in saved.items()}          # a layer's activations, all of them

    items: dict[str, int] = {}
    # a layer's input (what full recompute checkpoints): [s/t, b, h] with sequence parallelism
    layer_input = w * sbh // (t if inp.sp() else 1)
    rc = inp.normalized_recompute()
    working_set = 0
    if rc is None:
        items["activations_layers"] = sum(full[k] for k in kinds)
    elif rc == "selective":
        # what each layer keeps; in backward one recomputed module at a time holds its activations again
        selective = {kind: _selective_layer(inp, kind) for kind in set(kinds)}
        items["activations_layers"] = sum(selective[k][0] for k in kinds)
        working_set = items["activations_recompute_working_set"] = max(v[1] for v in selective.values())
    elif inp.recompute_method == "uniform":
        # full, uniform N: keep the input of each group of N layers; backward recomputes one group
        # at a time, so a whole group's activations are live at once
        n = min(inp.recompute_num_layers, L)
        items["activations_layer_inputs"] = (L // n) * layer_input
        working_set = items["activations_recompute_working_set"] = max(
            sum(full[k] for k in kinds[i:i + n]) for i in range(0, L, n))
    else:
        # full, block N: the first N layers keep only their input and are recomputed one at a time;
        # the others store everything (an upper bound: by the time backward reaches the recomputed
        # layers the others' activations are freed, so this overstates the peak by <= one layer)
        n = min(inp.recompute_num_layers, L)
        items["activations_layer_inputs"] = n * layer_input
        if L > n:
            items["activations_layers"] = sum(full[k] for k in kinds[n:])
        working_set = items["activations_recompute_working_set"] = max(full.values())
    # phase A1: embedding dropout mask, final norm input (+ RMSNorm's own), output-layer input; the logits
    emb_final = (mask + w) * sbh + _norm_saved(inp, sbh, s * b)[0]
    # sequence parallel: the embedding dropout, final norm and the output layer's (local) input are
    # 1/t of the sequence; megatron's global memory buffer keeps one all-gathered [s, b, h] tensor
    sp_buffer = w * sbh if inp.sp() else 0
    items["activations_embedding_final"] = emb_final = emb_final // t if inp.sp() else emb_final
    # experts: the allgather dispatcher gathers T x EP tokens into the same global buffer (its larger
    # size); the alltoall's transient buffers live during one MoE layer's forward (phase A0) and
    # backward (B)
    dispatch_buffer, dispatch_transient = moe_dispatcher(inp) if moe is not None else (0, 0)
    if dispatch_buffer > sp_buffer:
        items["moe_dispatch_gather_buffer"] = sp_buffer = dispatch_buffer
    elif sp_buffer:
        items["activations_sp_gather_buffer"] = sp_buffer
    if dispatch_transient:
        items["moe_dispatch_transient"] = dispatch_transient
    logits = s * b * vocab_padded // t
    items["logits" if w == 4 else "logits_16bit"] = w * logits
    items["logits_fp32_cross_entropy"] = 4 * logits
    pad_mask = (4 - w) * logits if vocab_padded > inp.vocab_size else 0
    if pad_mask:
        items["logits_grad_vocab_pad_mask"] = pad_mask
    phase_a1 = sp_buffer + emb_final + (w + 4) * logits + pad_mask
    out_grad = w * vocab_padded * h // t
    if inp.untie_embeddings_and_output_weights:
        # the output layer's own weight gradient, moved to its bucket as soon as it is complete
        items["activations_output_layer_weight_grad"] = out_grad
        emb_grad = 0
    else:
        # held from the output layer's backward to the embedding's (phases A2 and B)
        items["activations_tied_embedding_grad"] = emb_grad = out_grad
    phase_a2 = sp_buffer + emb_final + 2 * w * logits + out_grad
    # phase B: one layer's backward
    # two fc1-output-sized gradients with GELU (fc2's input, fc1's output); with a gated MLP (SwiGLU, quick
    # GeGLU) the same 2f bytes are one gradient of fc1's [gate; up] output (measured:
    # tests/test_planner_validation.py, tests/test_planner_gptoss.py)
    # (the residual stream's two gradients: 1/t of the sequence with sequence parallelism)
    # (an MoE layer: its routed slots' and shared expert's gradients, moe.moe_backward_grads)
    residual = 2 * w * sbh // (t if inp.sp() else 1)
    items["activations_layer_backward_grads"] = layer_grads = residual + max(
        moe_backward_grads(inp) if kind else 2 * w * s * b * f // t for kind in set(kinds))
    phase_b = sp_buffer + working_set + layer_grads + emb_grad + dispatch_transient
    # phase B', the same layer's core attention backward, where torch SDPA's CPU math path holds two fp32
    # s x s gradients beyond what that layer has released by then (layer_activations._core_attention_backward)
    attention_backward = max(_core_attention_backward(inp, kind) for kind in set(kinds))
    if attention_backward:
        items["activations_core_attention_backward"] = attention_backward
    phase_b_attention = sp_buffer + working_set + residual + emb_grad + attention_backward
    phase_a0 = sp_buffer + dispatch_transient       # the last MoE layer's dispatch in forward
    in_forward, held, phase_forward_end = _attention_mask(
        inp, items, sp_buffer + emb_final + (w + (4 if pad_mask else 0)) * logits)
    listed = sum(v for k, v in items.items()
                 if k not in ("activations_layers", "activations_layer_inputs"))
    items["activations_phases_not_coexisting"] = max(phase_a0 + in_forward, phase_a1 + held, phase_a2 + held,
                                                     phase_b + held, phase_b_attention + held,
                                                     phase_forward_end) - listed
    return items


def _attention_mask(inp: PlanInput, items: dict[str, int], forward_end: int) -> tuple[int, int, int]:
    """The attention mask of per-document attention or a sliding window (layer_activations.attention_mask_bytes;
    0s without one): its item, and
    (what it adds to the forward's phases, what it adds to the others, the phase at the end of forward).
    One mask per micro-batch, live in forward and, where something keeps it for backward, in every phase;
    otherwise (SDPA's CPU math path) gone when forward returns: `forward_end` (the logits then) + the mask."""
    mask, kept = attention_mask_bytes(inp)
    if not mask:
        return 0, 0, 0
    items["activations_attention_mask"] = mask
    return mask, mask if kept else 0, forward_end + mask


def _ranks_layout(inp: PlanInput) -> tuple[int, int, int]:
    world = inp.tensor_parallel * inp.data_parallel
    per_node = world if inp.gpus_per_node is None else min(inp.gpus_per_node, world)
    nodes = math.ceil(world / per_node)
    return world, nodes, per_node


def _compute(inp: PlanInput, bucket_overfill: bool = True) -> Plan:
    """The numbers, without suggestions. bucket_overfill=False: as if no bucket held more than
    bucket_size elements (see may_fit)."""
    inp.validate()
    t, N = inp.tensor_parallel, inp.data_parallel
    S = inp.max_position_embeddings or inp.seq_length
    V_pad = pad_vocab_size(inp.vocab_size, t, inp.make_vocab_size_divisible_by)
    moe = inp.moe()
    counts = count_params(inp.num_layers, inp.hidden_size, V_pad, S, t, inp.ffn(),
                          num_attention_heads=inp.num_attention_heads, arch=inp.arch(), moe=moe,
                          expert_tensor_parallel=inp.expert_tp() if moe is not None else None)
    psi = counts["per_tp_rank"]
    world, nodes, per_node = _ranks_layout(inp)
    warnings: list[str] = []

    opt_b = 2 if inp.bf16_optimizer_states else 4
    # one engine over DP, or at EP > 1 or an expert TP other than TP two (offload/expert_parallel.py): the
    # dense parameters over DP, this rank's experts over expert DP (EDP = world / (expert TP x EP)); expert
    # items are named "expert_..."
    groups = [("", "all", psi, N)]
    if inp.experts_apart():
        groups = [("", "dense", counts["dense_per_tp_rank"], N),
                  ("expert_", "expert", counts["expert_per_rank"], inp.expert_data_parallel())]
    dev: dict[str, int] = {}
    host_gpu: dict[str, int] = {}
    disk_rank = 0
    psi_pad = 0
    share = inp.optimizer_offload_fraction    # the host part of the partition, as _offload_model_states cuts it
    for prefix, group, numel, n in groups:
        chunk = n * inp.partition_alignment
        padded = (numel + chunk - 1) // chunk * chunk
        psi_pad += padded
        part = padded // n
        if inp.zero_offload:
            d, hg = _offload_model_states(inp, padded, part, chunk, V_pad, S, opt_b, bucket_overfill, n, group)
        else:
            d, hg = _device_model_states(inp, numel, opt_b), {}
        dev.update({prefix + k: v for k, v in d.items()})
        host_gpu.update({prefix + k: v for k, v in hg.items()})
        host_part = part if share >= 1 else min(part, round(share * part / 64) * 64)
        disk_rank += nvme_bytes(inp, host_part, opt_b)[1]
    act = _activation_items(inp, V_pad)
    dev.update(act)
    dev["allocator_fragmentation"] = int(inp.fragmentation * sum(act.values()))
    dev["framework_overhead"] = inp.device_overhead_bytes

    host_per_gpu = sum(host_gpu.values())
    disk_node = disk_rank * per_node
    host_node = {k: v * per_node for k, v in host_gpu.items()}
    host_node["process_overhead"] = inp.host_overhead_bytes_per_rank * per_node + inp.host_overhead_bytes_per_node
    host_node["os_reserve"] = inp.reserve()
    device_total = sum(dev.values())
    host_total = sum(host_node.values())

    fits_device = device_total <= inp.gpu_memory_bytes
    fits_host = host_total <= inp.host_memory_bytes_per_node
    reasons = [
        f"device: {format_bytes(device_total)} per GPU of {format_bytes(inp.gpu_memory_bytes)} "
        + ("(OK)" if fits_device else
           f"(OVER by {format_bytes(device_total - inp.gpu_memory_bytes)}; largest item "
           f"{max(dev, key=dev.get)} = {format_bytes(max(dev.values()))})"),
        f"host: {format_bytes(host_total)} per node of {format_bytes(inp.host_memory_bytes_per_node)} "
        + ("(OK)" if fits_host else
           f"(OVER by {format_bytes(host_total - inp.host_memory_bytes_per_node)}; "
           f"{per_node} ranks x {format_bytes(host_per_gpu)} model states)"),
    ]
    if disk_node:
        reasons.append(f"disk (--optimizer-nvme-path): {format_bytes(disk_node)} per node of optimizer states "
                       f"({per_node} ranks; checked against the directory's free space at launch)")
    setup = _setup_host_bytes(inp, host_gpu, sum(n for _, _, n, _ in groups), per_node) if inp.zero_offload else 0
    if setup > host_total:     # the set-up peak binds (the tier, with few bytes per parameter left on the host)
        ok = setup <= inp.host_memory_bytes_per_node
        reasons.append(f"host at set-up: {format_bytes(setup)} per node of {format_bytes(inp.host_memory_bytes_per_node)}"
                       f" ({per_node} ranks each holding its model in fp32 while the engine places it) "
                       + ("(OK)" if ok else f"(OVER by {format_bytes(setup - inp.host_memory_bytes_per_node)}: "
                                            "raise TP or put fewer ranks on a node)"))
        fits_host = fits_host and ok
    fits = fits_device and fits_host
    if inp.device_is_host:
        unified = device_total * per_node + host_total
        ok = unified <= inp.host_memory_bytes_per_node
        reasons.append(f"unified (device bytes live in host RAM): {per_node} x "
                       f"{format_bytes(device_total)} + {format_bytes(host_total)} = "
                       f"{format_bytes(unified)} of {format_bytes(inp.host_memory_bytes_per_node)} "
                       + ("(OK)" if ok else "(OVER)"))
        fits = fits and ok
        fits_host = fits_host and ok

    if inp.gpus_per_node is not None and t > inp.gpus_per_node:
        warnings.append(f"tensor parallel {t} spans nodes ({inp.gpus_per_node} GPUs per node): "
                        "TP collectives would cross the network")
    if inp.gpus_per_node is not None and world % inp.gpus_per_node and nodes > 1:
        warnings.append(f"world size {world} does not fill {nodes} nodes of {inp.gpus_per_node}")
    if inp.dpu and inp.grad_accum_steps > 1:
        warnings.append("DPU with gradient accumulation: the pending gradient is the accumulated one")
    if fits:
        warnings += _margin_warnings(inp, device_total, host_total, per_node)

    return Plan(input=inp, fits=fits, reasons=reasons, suggestions=[], warnings=warnings,
                device_bytes_per_gpu=device_total, host_bytes_per_gpu=host_per_gpu,
                host_bytes_per_node=host_total, device_items=dev, host_items=host_node,
                params_total=counts["total"], params_per_tp_rank=psi,
                params_per_tp_rank_padded=psi_pad,
                replicated_params_per_tp_rank=counts["replicated_per_tp_rank"],
                vocab_size_padded=V_pad, world_size=world, num_nodes=nodes,
                ranks_per_node=per_node, fits_device=fits_device, fits_host=fits_host,
                disk_bytes_per_node=disk_node, host_setup_bytes_per_node=setup, params_active=counts["active"],
                params_experts_total=counts["experts_total"], params_expert_per_rank=counts["expert_per_rank"],
                experts_per_ep_rank=moe.local_experts if moe is not None else 0)


# How far a measured peak has been from the plan (docs/memory_planner.md, "The edge, measured":
# process-tree peak RSS against the planned total, CPU runs of tools/find_max_model.py at 3 and
# 12 GiB: within 5% either way once the CPU process overhead was measured). A plan closer than
# this to a budget fits on paper but may not in the run.
PLAN_ERROR_MARGIN = 0.05


def _margin_warnings(inp: PlanInput, device_total: int, host_total: int, per_node: int) -> list[str]:
    """One line per check that fits with less headroom than PLAN_ERROR_MARGIN of what it plans (the
    OS reserve is no planned use: it is the headroom's own part)."""
    reserve = inp.reserve()
    checks = [("host", host_total - reserve, inp.host_memory_bytes_per_node - reserve)]
    if inp.device_is_host:        # one RAM: the unified check is the one that binds
        checks = [("unified", device_total * per_node + host_total - reserve,
                   inp.host_memory_bytes_per_node - reserve)]
    else:
        checks.insert(0, ("device", device_total, inp.gpu_memory_bytes))
    out = []
    for name, planned, budget in checks:
        free = budget - planned
        if 0 <= free < PLAN_ERROR_MARGIN * planned:
            out.append(f"near the edge: the {name} plan, {format_bytes(planned)}, leaves {format_bytes(free)} of "
                       f"{format_bytes(budget)}" + ("" if name == "device" else f" (the host less its "
                                                    f"{format_bytes(reserve)} OS reserve)")
                       + f" free ({free / planned:.1%} of the plan); measured peaks have been up to "
                       f"{PLAN_ERROR_MARGIN:.0%} from their plan (docs/memory_planner.md, \"The edge, measured\"), "
                       "so the run may not fit: leave more room")
    return out


def _offload_model_states(inp: PlanInput, psi_pad: int, part: int, chunk: int, V_pad: int, S: int, opt_b: int,
                          bucket_overfill: bool, N: int | None = None,
                          group: str = "all") -> tuple[dict[str, int], dict[str, int]]:
    """ZeRO-Offload's model states: (device items per GPU, host items per GPU) for a partition of
    `part` elements of a TP rank's `psi_pad` (padded) parameters, over N ranks (DP; the expert
    engine's: expert DP), the engine's parameters `group` (buckets.BUCKET_GROUPS)."""
    w = _bytes16(inp.precision)
    p16 = "params_fp32" if w == 4 else "params_16bit"
    dev: dict[str, int] = {}
    host_gpu: dict[str, int] = {}
    N = inp.data_parallel if N is None else N
    bucket = min(inp.bucket_size, psi_pad)
    n_buckets, max_bucket, copied_pair = bucket_walk(inp, V_pad, S, chunk, group)
    if not bucket_overfill:
        max_bucket = min(max_bucket, bucket)
        copied_pair = 0               # may_fit leaves the copies out as the overfill: both follow the layout
    buffers = min(2, n_buckets)       # the engine allocates one buffer when one bucket holds it all
    wg = 4 if inp.reduces_in_fp32() else w    # bytes per gradient element in the buckets
    wh = 4 if inp.host_grad_fp32 else w       # bytes per gradient element copied home
    dev[p16] = w * psi_pad
    dev["grad_buckets_x2"] = buffers * wg * bucket
    if max_bucket > bucket:           # a parameter never straddles buckets: the largest (the word
        dev["grad_bucket_oversize"] = buffers * wg * (max_bucket - bucket)   # embedding) may overfill one
    if wg != wh and not inp.device_is_host:   # fp32 shards narrowed on the GPU before the copy home
        dev["grad_narrow_scratch"] = buffers * wh * (max_bucket // N)
    if N > 1:
        dev["reduce_scatter_scratch"] = wg * bucket
        if inp.device_is_host and copied_pair:
            dev["reduce_scatter_copies"] = reduce_scatter_copies(wg, copied_pair)
    if inp.grad_accum_steps > 1 and not inp.accumulate_on_host:
        # fp32 when reduced in fp32 (the engine's main_grad, as Megatron's), else 16-bit param.grad
        dev["grads_kept_across_microbatches"] = (4 if wg == 4 else w) * psi_pad
    # --optimizer-offload-fraction F: the engine keeps the partition's first F on the host
    # (rounded to 64 elements) and the tail on the device: fp32 master, m, v and gradient there.
    tail = 0 if inp.optimizer_offload_fraction >= 1 else \
        part - min(part, round(inp.optimizer_offload_fraction * part / 64) * 64)
    if tail:
        dev["optimizer_on_device_fp32"] = 16 * tail
    part -= tail
    if not inp.nvme_master:           # --optimizer-nvme-path: the moments (and master) in files
        host_gpu["master_fp32"] = 4 * part
    if not inp.nvme_states:
        host_gpu["adam_exp_avg"] = opt_b * part
        host_gpu["adam_exp_avg_sq"] = opt_b * part
    else:
        host_gpu["nvme_io_ring"] = nvme_bytes(inp, part, opt_b)[0]
    if wh == w:                       # one buffer: gradients in, updated parameters out
        host_gpu["grad_param_staging" + ("_fp32" if w == 4 else "_16bit")] = w * part
    else:
        host_gpu["grad_staging_fp32"] = 4 * part
        host_gpu["param_staging_16bit"] = w * part
    if inp.grad_accum_steps > 1 and inp.accumulate_on_host:
        host_gpu["grad_accumulator_fp32"] = 4 * part
    if inp.overlap_cpu_step and inp.overlap_speculated_fraction > 0:
        host_gpu["overlap_rollback"] = overlap_rollback_host_bytes(
            part, w, wh, opt_b, inp.overlap_speculated_fraction,
            inp.grad_accum_steps > 1 and inp.accumulate_on_host, moments_on_disk=inp.nvme_states,
            master_on_disk=inp.nvme_master)
    if inp.dpu:                       # the second landing set: gradients [+ fp32 accumulator]
        host_gpu["dpu_pending_grad"] = wh * part + (
            4 * part if inp.grad_accum_steps > 1 and inp.accumulate_on_host else 0)
    return dev, host_gpu


def reduce_scatter_copies(reduce_bytes: int, copied_pair: int) -> int:
    """Device bytes of the copies gloo makes of the gradient buckets, where the device is the host (a CPU run)
    at DP > 1: `reduce_bytes` per element (the bucket buffers' dtype), `copied_pair` elements
    (buckets.BucketWalk.copied_pair).

    Why: a bucket below buckets.GLOO_COPIED_BELOW_NUMEL elements is reduce-scattered by gloo's own
    reduce_scatter, which all-reduces a clone of the whole bucket (not in place, unlike NCCL) and frees it when
    the engine waits for the collective. The engine (offload/grad_buckets.py) waits only when it copies the
    bucket's shard home, when the bucket's buffer is reused: two buckets later, so the copies of two
    consecutive buckets are alive together (from the second one's send to the next bucket's first gradient,
    and at the end of backward). Where that falls on a layer's backward (small buckets, full recompute: up to
    two copies beside the recomputed layer) it adds to the activation peak, and the plan does not model when:
    the item is on top of it. Measured with torch's allocator on CPU worlds
    (tests/test_planner_validation.py): never more than this, and this to within the buckets' padding (the
    planner's N x 128 elements, the engine's N x 64) where the pair is sent back to back. A GPU (NCCL
    reduce-scatters in place) makes none, nor does a larger bucket (one in-place all_reduce). Not the
    collective library's own buffers: `reduce_scatter_scratch` stays their allowance."""
    return reduce_bytes * copied_pair


def _setup_host_bytes(inp: PlanInput, host_gpu: dict[str, int], model_numel: int, per_node: int) -> int:
    """Host bytes per node at the engine's set-up peak: each rank builds its model (its TP shard, its
    experts) on the host in fp32 (model/gpt.py: use_cpu_initialization) and the engine places it
    parameter by parameter (offload/engine.py _place_model_on_device) while the fp32 master, the
    NVMe ring (the initial states go through it) and, on a GPU, the pinned staging are allocated;
    the moments and landing buffers are touched only after the model is released, and on a CPU the
    16-bit flat buffer grows as the fp32 parameters go. In memory this stays below training's 14
    bytes/param/DP at DP 1; with the states on disk it is what binds the host (6 B/param at DP 1
    with the master on disk against 2 in training). Equals the steady-state host lines where the
    set-up holds nothing more than training does."""
    held = ("master_fp32", "nvme_io_ring") + (() if inp.device_is_host else ("grad_param_staging_16bit",
                                                                           "grad_param_staging_fp32",
                                                                           "grad_staging_fp32", "param_staging_16bit"))
    engine = sum(v for k, v in host_gpu.items() if k.removeprefix("expert_") in held)
    return per_node * (4 * model_numel + engine) + inp.host_overhead_bytes_per_rank * per_node \
        + inp.host_overhead_bytes_per_node + inp.reserve()


def nvme_bytes(inp: PlanInput, part: int, opt_b: int) -> tuple[int, int]:
    """(host bytes of the I/O ring, disk bytes) of one rank's states on --optimizer-nvme-path, for a
    host partition of `part` elements (offload/nvme_store.py): each state's chunk is padded to 4 KiB;
    the ring has min(count, chunks) buffers, each one chunk of every state on disk. Exact for the ring
    when the partition holds at least `count` chunks (one chunk when it fits in one buffer); the disk
    bytes count ceil(part / size) chunks (the store may cut a few more, smaller ones), plus, with
    --overlap-cpu-step, a second place for each chunk within the speculated share (the rollback's
    state on disk: nvme_store.py's shadow slots; the store counts the chunks that end within it)."""
    if not (inp.zero_offload and inp.nvme_states) or part <= 0:
        return 0, 0
    sizes = [opt_b, opt_b] + ([4] if inp.nvme_master else [])
    chunk = min(inp.nvme_buffer_size, part)
    slot = sum(-(-chunk * b // 4096) * 4096 for b in sizes)
    chunks = -(-part // chunk)
    shadow = math.floor(inp.overlap_speculated_fraction * part) // chunk \
        if inp.overlap_cpu_step and inp.overlap_speculated_fraction > 0 else 0
    return min(inp.nvme_buffer_count, chunks) * slot, (chunks + shadow) * slot


def _device_model_states(inp: PlanInput, psi: int, opt_b: int) -> dict[str, int]:
    """The plain DDP + AdamW baseline: every model state on the device."""
    w = _bytes16(inp.precision)
    p16 = "params_fp32" if w == 4 else "params_16bit"
    dev: dict[str, int] = {}
    dev[p16] = w * psi
    dev["grads_fp32" if w == 4 else "grads_16bit"] = w * psi
    if w == 2:
        dev["master_fp32"] = 4 * psi
    dev["adam_exp_avg"] = opt_b * psi
    dev["adam_exp_avg_sq"] = opt_b * psi
    return dev


def overlap_rollback_host_bytes(part: int, param_bytes: int, host_grad_bytes: int, state_bytes: int,
                                fraction: float = 1.0, accumulate_on_host: bool = False,
                                moments_on_disk: bool = False, master_on_disk: bool = False) -> int:
    """--overlap-cpu-step's extra host bytes for a host partition of `part` elements of which
    `fraction` is speculated (offload/schedules.SpeculativeSchedule): the rollback backup of the
    fp32 master + both moments of that prefix, and its own 16-bit parameter buffer where the
    parameters would otherwise be written over the gradient the update reads (the gradient must
    survive for the norm and a redo). States on disk (--optimizer-nvme-path, -master) keep their
    rollback state on disk (nvme_bytes' second places), not here. Equals the engine's
    accounting.host_overlap_bytes."""
    n = math.floor(fraction * part)
    aliased = host_grad_bytes == param_bytes and not accumulate_on_host
    backup = (0 if master_on_disk else 4) + (0 if moments_on_disk else 2 * state_bytes)
    return n * backup + (param_bytes * n if aliased else 0)


def overlap_full_bytes_per_rank(inp: PlanInput) -> int:
    """overlap_rollback_host_bytes at fraction 1 for this plan's host partition (one rank)."""
    p = _compute(inp.replace(overlap_cpu_step=True, overlap_speculated_fraction=1.0))
    return sum(v for k, v in p.host_items.items() if k.endswith("overlap_rollback")) // p.ranks_per_node


def solve_overlap_fraction(inp: PlanInput, budget_bytes_per_rank: int | None = None) -> float:
    """The share of each rank's host partition --overlap-cpu-step speculates, in steps of 1%.
    budget_bytes_per_rank None (`auto`): as much as the host memory left free by everything else
    holds with the plan's error margin kept (PLAN_ERROR_MARGIN: no "near the edge" line), 0 when the run does
    not fit without the overlap or is near the edge already; so `auto` never makes a fitting run not fit. An explicit budget (--overlap-cpu-step-memory): the share it holds, at most 1 (whether the
    run then fits is the plan's verdict)."""
    full = overlap_full_bytes_per_rank(inp)
    free_rollback = full <= 0 and inp.zero_offload and inp.nvme_states   # all of it on disk, none in memory
    if full <= 0 and not free_rollback:
        return 0.0
    if budget_bytes_per_rank is not None:
        return 1.0 if free_rollback else math.floor(min(1.0, budget_bytes_per_rank / full) * 100) / 100
    base = _try(inp.replace(overlap_cpu_step=False))
    if base is None or not base.fits or not _fits_disk(base) or not _keeps_headroom(base):
        return 0.0
    f = 1.0 if free_rollback else \
        math.floor(min(1.0, _headroom_free_bytes(base) / (full * base.ranks_per_node)) * 100) / 100
    while f > 0:              # the 1% grid and the partition's rounding: step down until it fits
        p = _try(inp.replace(overlap_cpu_step=True, overlap_speculated_fraction=f))
        if p is not None and p.fits and _fits_disk(p) and _keeps_headroom(p):
            return f
        f = round(f - 0.01, 2)
    return 0.0


def _host_check(p: Plan) -> tuple[int, int]:
    """(planned, budget) of the host check _margin_warnings makes: the host less its OS reserve, with the device's
    bytes too where the device is the host (one RAM)."""
    reserve = p.input.reserve()
    planned = p.host_bytes_per_node - reserve
    if p.input.device_is_host:
        planned += p.device_bytes_per_gpu * p.ranks_per_node
    return planned, p.input.host_memory_bytes_per_node - reserve


def _keeps_headroom(p: Plan) -> bool:
    """The host plan leaves PLAN_ERROR_MARGIN of itself free (no "near the edge" line): `auto` speculates only
    memory the plan shows is free with that margin kept, since measured peaks have been up to that far from
    their plan; a default that ate the margin could make a run that fits without it fail."""
    planned, budget = _host_check(p)
    return budget - planned >= PLAN_ERROR_MARGIN * planned


def _headroom_free_bytes(p: Plan) -> int:
    """Host bytes per node a plan can still take and keep the margin: budget / (1 + margin) - planned."""
    planned, budget = _host_check(p)
    return max(0, int(budget / (1 + PLAN_ERROR_MARGIN)) - planned)


def _fits_disk(p: Plan) -> bool:
    """The state files (with the overlap's second places) fit the free space the job measured on
    --optimizer-nvme-path (unknown: estimate_memory plans without the directory)."""
    free = p.input.nvme_disk_free_bytes
    return free is None or p.disk_bytes_per_node <= free


OVERLAP_MODES = ("auto", "full", "memory", "off")
# At EP > 1 the job's two engines (offload/expert_parallel.py) each take the one resolved speculated
# share and offload fraction (training/components.build_optimizer): the model-state lines plan DPU,
# the overlap's share of each engine's host partition, a partial offload's device tail and the NVMe
# tier per engine, so the defaults resolve as for a dense model.


def resolve_overlap(inp: PlanInput, mode: str | None, budget_bytes_per_rank: int | None = None) -> tuple[float, str]:
    """--overlap-cpu-step as the job resolves it: (speculated share of each rank's host partition,
    one line saying why). mode None is the default: `auto` on a GPU, off where the device is the
    host (device and CPU Adam share the cores). Off without ZeRO-Offload or with DPU (which takes
    the CPU step off the critical path already). `memory`: --overlap-cpu-step-memory's budget."""
    host_default = mode is None and inp.device_is_host
    if mode is None:
        mode = "off" if host_default else "auto"
    if mode not in OVERLAP_MODES:
        raise ValueError(f"overlap mode must be one of {OVERLAP_MODES}, got {mode!r}")
    if mode == "off" or not inp.zero_offload or inp.dpu:
        why = ("the device is the host: it shares the cores" if host_default else "--no-overlap-cpu-step"
               if mode == "off" else "no --zero-offload" if not inp.zero_offload else "--dpu")
        return 0.0, f"CPU step overlap off ({why})"
    full = overlap_full_bytes_per_rank(inp)
    need = f"all of it would take {format_bytes(full)}/rank"
    if inp.zero_offload and inp.nvme_states:            # the rollback state of the states on disk: on disk
        disk = _try(inp.replace(overlap_cpu_step=True, overlap_speculated_fraction=1.0))
        none = _try(inp.replace(overlap_cpu_step=False))
        if disk is not None and none is not None:
            need += f" + {format_bytes(disk.disk_bytes_per_node - none.disk_bytes_per_node)} of disk per node"
    if mode == "full":
        return 1.0, f"--overlap-cpu-step: the whole partition speculated ({need})"
    f = solve_overlap_fraction(inp, budget_bytes_per_rank if mode == "memory" else None)
    if mode == "memory":
        return f, (f"--overlap-cpu-step-memory {format_bytes(budget_bytes_per_rank)}/rank: {f:.0%} of the partition "
                   f"speculated ({need})")
    if f == 0:
        base = _try(inp.replace(overlap_cpu_step=False))
        why = ("the run does not fit even without it" if base is None or not base.fits
               else f"the plan leaves no host memory free for the rollback state (with a {PLAN_ERROR_MARGIN:.0%} "
                    "margin kept)")
        return 0.0, f"--overlap-cpu-step auto: nothing speculated, {why} ({need}); the CPU step is synchronous"
    return f, (f"--overlap-cpu-step auto: {f:.0%} of the partition speculated, what the host memory the plan "
               f"leaves free holds with a {PLAN_ERROR_MARGIN:.0%} margin kept ({need})")


def solve_offload_fraction(inp: PlanInput, step: float = 0.05) -> float | None:
    """`--optimizer-offload-fraction auto`: the smallest host share F (so the largest device share
    of the optimizer), on a grid of `step`, with which the run fits; None if not even F=1 fits. At EP > 1
    the one F is each engine's (offload/expert_parallel.py): both keep that share of their partition."""
    n = round(1 / step)
    for i in range(n + 1):
        f = i / n
        p = _try(inp.replace(optimizer_offload_fraction=f))
        if p is not None and p.fits:
            return f
    return None


def _try(inp: PlanInput) -> Plan | None:
    try:
        return _compute(inp)
    except ValueError:
        return None



def may_fit(inp: PlanInput) -> bool:
    """True whenever _compute(inp).fits is, and monotone in the model's size, which `fits` is not.

    Why `fits` is not: a parameter never straddles two buckets, so the bucket that takes the word
    embedding also holds whatever the layers before it left open, anywhere from nothing to just
    under bucket_size elements. One more layer can close that bucket earlier and shrink the largest
    bucket by up to bucket_size: the device total is a sawtooth over the number of layers (seen:
    75 layers over the budget, 76-80 under it). Without that overfill every item grows with the
    model, so this is the monotone bound a search can bisect on."""
    return _compute(inp, bucket_overfill=False).fits
