"""Will my model fit? The memory model of zo_megatron's engine, per GPU and per node.

Pure Python (no torch, no megatron): `tools/estimate_memory.py` and the pre-launch check call it.
Every number below is a line item you can read in `Plan.device_items` / `Plan.host_items`.
The formulas are written out in docs/memory_planner.md; the short version, per TP rank, with
t = tensor parallel, N = data parallel, Ψ = parameters on this TP rank (padded to N partitions),
b16 = 2 bytes (bf16/fp16) or 4 (fp32):

  device, ZeRO-Offload   b16·Ψ params + bg·bucket gradient buckets x2 (x1 when one bucket holds every
                         parameter; + grad_bucket_oversize when the largest bucket -- the one holding
                         the word embedding, a parameter never straddles buckets -- exceeds bucket_size;
                         bg = 4 when gradients are reduced in fp32, the bf16 default, else b16)
                         (+ 2·largest bucket/N x2 narrowing scratch on a GPU when fp32-reduced shards
                         go home as 16 bits) (+ bg·bucket reduce-scatter scratch when N > 1: an
                         allowance, the engine reduce-scatters in place) (+ b16·Ψ 16-bit gradients
                         kept across micro-batches when grad_accum_steps > 1, unless they accumulate
                         on the host) + activations + fragmentation + CUDA overhead
  device, baseline       16 bytes/param (2 param + 2 grad + 4 master + 4 m + 4 v; fp32: 4+4+4+4)
  host per GPU           Ψ/N · (4 master + 4|2 m + 4|2 v + b16 staging [+ 4 fp32 host gradients:
                         staging 4 + 2 params] [+ 4 host accumulator] [+ DPU: another gradient staging
                         [+ accumulator]])
  host per node          host per GPU x ranks on the node + per-process overhead x ranks + OS reserve
  activations            stored: Korthikanti et al. 2022, s·b·h·(10 + 24/t + 5·a·s/(h·t)) bytes per layer
                         (16-bit, dropout, no sequence parallel); full recompute stores b16·s·b·h per
                         layer. On top, the largest of three phases that never coexist: the logits
                         (+ their fp32 copies), the output layer's backward (+ the tied embedding's
                         gradient, held to the end of backward), one layer's backward (its recompute
                         working set + its gradients). `_activation_items` has the details; validated
                         against torch's measured CPU peak in tests/test_planner_validation.py.

Parameter count of the GPT-2-style model (learned positions, tied embeddings, biases, LayerNorms):
  P = V_pad·h + S·h + L·(12h² + 13h) + 2h,   V_pad = V rounded up to a multiple of 128·t
  Ψ_tp = V_pad·h/t + S·h + L·((12h² + 7h)/t + 6h) + 2h
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

__all__ = [
    "GiB", "PlanInput", "Plan", "plan", "plan_input_from_flags", "max_model", "count_params", "pad_vocab_size",
    "HARDWARE_PRESETS", "MODEL_PRESETS", "apply_hardware_preset", "model_preset", "paper_checks",
    "baseline_maxima", "our_maxima", "GOALS", "FAMILIES",
    "format_bytes", "format_params",
]

GiB = 1024 ** 3
MiB = 1024 ** 2

PRECISIONS = ("bf16", "fp16", "fp32")
RECOMPUTE = (None, "full", "selective")


# ------------------------------------------------------------------------------------------------
# input / output

@dataclass
class PlanInput:
    """A training configuration. Shape fields use Megatron's names; bytes are bytes.

    Defaults describe the paper's single-GPU setting: one V100-32GB with the DGX-2's 1.5 TiB host.
    """
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    vocab_size: int = 50257
    seq_length: int = 1024
    max_position_embeddings: int | None = None  # None: = seq_length
    ffn_hidden_size: int | None = None  # None: 4 x hidden_size (Megatron's default)
    tensor_parallel: int = 1
    data_parallel: int = 1
    micro_batch_size: int = 1
    grad_accum_steps: int = 1
    precision: str = "bf16"  # "bf16" | "fp16" | "fp32"
    zero_offload: bool = True
    dpu: bool = False
    recompute: bool | str | None = False  # False/None, True/"full", "selective"
    recompute_method: str = "uniform"  # full only: "uniform" (checkpoints of N layers) | "block" (first N layers)
    recompute_num_layers: int = 1  # full only: N
    bucket_size: int = 50_000_000  # elements per gradient bucket (two are allocated)
    bf16_optimizer_states: bool = False  # exp_avg/exp_avg_sq stored as bf16 on the host
    gpu_memory_bytes: int = 32510 * MiB  # V100-SXM3-32GB as torch reports it
    host_memory_bytes_per_node: int = 1536 * GiB  # DGX-2: 1.5 TiB
    gpus_per_node: int | None = None  # None: every rank of the job on one node
    make_vocab_size_divisible_by: int = 128
    # activation-model details
    dropout: bool = True  # dropout masks stored (Korthikanti's formula assumes dropout on)
    fused_softmax: bool = True  # False: torch softmax in fp32 (CPU path) keeps fp32 probs too
    # overheads and layout
    device_overhead_bytes: int = 1 * GiB  # CUDA context + cuBLAS workspace + NCCL buffers
    host_overhead_bytes_per_rank: int = 3 * GiB  # python + torch + megatron + CUDA host side
    host_reserve_bytes: int = 32 * GiB  # OS, page cache, data loader on the node
    fragmentation: float = 0.10  # caching-allocator margin on the transient device bytes
    partition_alignment: int = 128  # elements; each DP partition is a multiple of this
    accumulate_on_host: bool = False  # True: fp32 host accumulator instead of device 16-bit grads
    grad_reduce_fp32: bool | None = None  # fp32 bucket buffers + reduce-scatter; None: on for bf16 (Megatron)
    host_grad_fp32: bool = False  # reduced gradients copied home in fp32 (needs grad_reduce_fp32)
    device_is_host: bool = False  # CPU runs: "device" bytes also live in host RAM
    optimizer_offload_fraction: float = 1.0  # share of each partition's optimizer on the host (Megatron's name)
    overlap_cpu_step: bool = False  # --overlap-cpu-step: rollback backup (overlap_rollback_host_bytes)

    def ffn(self) -> int:
        return 4 * self.hidden_size if self.ffn_hidden_size is None else self.ffn_hidden_size

    def normalized_recompute(self) -> str | None:
        r = self.recompute
        if r is None or r is False or r == "" or r == "none":
            return None
        if r is True:
            return "full"
        if r in ("full", "selective"):
            return r
        raise ValueError(f"recompute must be False, True, 'full' or 'selective', got {r!r}")

    def reduces_in_fp32(self) -> bool:
        """Bucket buffers and the reduce-scatter in fp32 (the engine's default rule)."""
        if self.precision == "fp32":
            return True
        return self.precision == "bf16" if self.grad_reduce_fp32 is None else bool(self.grad_reduce_fp32)

    def replace(self, **changes) -> "PlanInput":
        return dataclasses.replace(self, **changes)

    def validate(self) -> None:
        def pos(name):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        for name in ("num_layers", "hidden_size", "num_attention_heads", "vocab_size",
                     "seq_length", "tensor_parallel", "data_parallel", "micro_batch_size",
                     "grad_accum_steps", "bucket_size", "make_vocab_size_divisible_by",
                     "partition_alignment"):
            pos(name)
        if self.max_position_embeddings is not None:
            pos("max_position_embeddings")
            if self.seq_length > self.max_position_embeddings:
                raise ValueError(f"seq_length {self.seq_length} > max_position_embeddings "
                                 f"{self.max_position_embeddings}")
        if self.gpus_per_node is not None:
            pos("gpus_per_node")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {self.precision!r}")
        self.normalized_recompute()
        if self.recompute_method not in ("uniform", "block"):
            raise ValueError(f"recompute_method must be 'uniform' or 'block', got {self.recompute_method!r}")
        pos("recompute_num_layers")
        if self.normalized_recompute() == "full" and self.recompute_method == "uniform" and \
                self.num_layers % self.recompute_num_layers:
            raise ValueError(f"recompute_num_layers {self.recompute_num_layers} does not divide num_layers "
                             f"{self.num_layers} (uniform recompute checkpoints whole groups)")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not divisible by "
                             f"num_attention_heads {self.num_attention_heads}")
        if self.num_attention_heads % self.tensor_parallel:
            raise ValueError(f"num_attention_heads {self.num_attention_heads} is not divisible by "
                             f"tensor_parallel {self.tensor_parallel}")
        if self.ffn_hidden_size is not None:
            pos("ffn_hidden_size")
            if self.ffn_hidden_size % self.tensor_parallel:
                raise ValueError(f"ffn_hidden_size {self.ffn_hidden_size} is not divisible by "
                                 f"tensor_parallel {self.tensor_parallel}")
        if self.host_grad_fp32 and not self.reduces_in_fp32():
            raise ValueError("host_grad_fp32 needs grad_reduce_fp32")
        if self.dpu and not self.zero_offload:
            raise ValueError("dpu (delayed parameter update) requires zero_offload")
        if not 0.0 <= self.optimizer_offload_fraction <= 1.0:
            raise ValueError(f"optimizer_offload_fraction must be in [0, 1], got {self.optimizer_offload_fraction}")
        for name in ("gpu_memory_bytes", "host_memory_bytes_per_node"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")
        for name in ("device_overhead_bytes", "host_overhead_bytes_per_rank", "host_reserve_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        if not 0 <= self.fragmentation < 1:
            raise ValueError(f"fragmentation must be in [0, 1), got {self.fragmentation}")


@dataclass
class Plan:
    input: PlanInput
    fits: bool
    reasons: list[str]  # one line per check (device / host / unified), saying OK or how far over
    suggestions: list[str]  # when it does not fit: changes that help, each re-planned
    warnings: list[str]
    device_bytes_per_gpu: int
    host_bytes_per_gpu: int  # model-state bytes on the host for one rank (no process overhead)
    host_bytes_per_node: int
    device_items: dict[str, int]  # per GPU
    host_items: dict[str, int]  # per node (already multiplied by the ranks on the node)
    params_total: int
    params_per_tp_rank: int  # Ψ, unpadded
    params_per_tp_rank_padded: int  # Ψ padded so N partitions of partition_alignment fit
    replicated_params_per_tp_rank: int
    vocab_size_padded: int
    world_size: int
    num_nodes: int
    ranks_per_node: int
    fits_device: bool
    fits_host: bool

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["input"] = dataclasses.asdict(self.input)
        return d


# ------------------------------------------------------------------------------------------------
# parameter counts

def pad_vocab_size(vocab_size: int, tensor_parallel: int = 1, divisible_by: int = 128) -> int:
    """Megatron's padding: round V up to a multiple of divisible_by x TP."""
    multiple = divisible_by * tensor_parallel
    return ((vocab_size + multiple - 1) // multiple) * multiple


def count_params(num_layers: int, hidden_size: int, vocab_size_padded: int,
                 max_position_embeddings: int, tensor_parallel: int = 1,
                 ffn_hidden_size: int | None = None) -> dict[str, int]:
    """Parameters of the GPT-2-style model, total and on one TP rank (Megatron layout).

    Split over t: word embedding (vocab rows), qkv weight 3h x h + bias 3h (column parallel),
    proj weight h x h (row parallel), fc1 f x h + bias f (column), fc2 h x f (row); f = ffn size (4h).
    Replicated: position embedding S x h, proj bias h, fc2 bias h, two LayerNorms 2h each, final LN 2h.
    """
    L, h, V, S, t = num_layers, hidden_size, vocab_size_padded, max_position_embeddings, tensor_parallel
    f = 4 * h if ffn_hidden_size is None else ffn_hidden_size
    if h % t or V % t or f % t:
        raise ValueError(f"hidden_size {h}, ffn size {f} and padded vocab {V} must be divisible by TP {t}")
    split_per_layer = 3 * h * h + 3 * h + h * h + f * h + f + h * f  # 12h² + 7h at f = 4h
    rep_per_layer = 2 * h + h + 2 * h + h  # LN1, proj bias, LN2, fc2 bias = 6h
    total = V * h + S * h + L * (split_per_layer + rep_per_layer) + 2 * h
    replicated = S * h + L * rep_per_layer + 2 * h
    per_rank = V * h // t + L * (split_per_layer // t) + replicated
    return {"total": total, "per_tp_rank": per_rank, "replicated_per_tp_rank": replicated}


# ------------------------------------------------------------------------------------------------
# the model

def _bytes16(precision: str) -> int:
    return 4 if precision == "fp32" else 2


def _activation_items(inp: PlanInput, vocab_padded: int) -> dict[str, int]:
    """Activation bytes on one GPU at the peak of forward + backward (Korthikanti et al. 2022, no SP).

    Stored activations P (all layers, or each layer's input with full recompute) stay live through
    backward. On top of P the peak is the largest of three phases that never coexist:

      A1  end of forward / loss backward: final-LN and output-layer inputs + the logits: the 16-bit
          logits (w) next to their fp32 copy that the vocab-parallel cross-entropy keeps (4); in
          backward that fp32 softmax becomes the gradient in place, and with a padded vocabulary
          the pad-column mask (GPTModelTP.forward) clones it in fp32 (4 more instead of w);
      A2  output-layer backward: the fp32/16-bit logits gradient + its contiguous copy (2·w) + the
          output layer's weight gradient, which (tied to the word embedding) is held until the
          embedding lookup's gradient is added at the very end of backward (w·V_pad·h/t);
      B   backward of the last layer: its activations (recomputed with recompute: the working
          set) + its gradients (fc1-output sized 4h/t twice, residual stream twice) + that held
          embedding gradient.

    Line items: P, each phase's parts, and `activations_phases_not_coexisting` (<= 0), which takes
    back what the phases would double count: the items sum to P + max(A1, A2, B).
    """
    s, b, h = inp.seq_length, inp.micro_batch_size, inp.hidden_size
    a, t, L, f = inp.num_attention_heads, inp.tensor_parallel, inp.num_layers, inp.ffn()
    w = _bytes16(inp.precision)
    sbh = s * b * h
    mask = 1 if inp.dropout else 0
    # replicated over TP: inputs of LN1, qkv, LN2, fc1 (b16 each) + 2 dropout masks
    replicated = (4 * w + 2 * mask) * sbh
    # split over TP: q, k, v, proj input (4 sbh) + fc1 out / gelu in (f/h sbh) + fc2 in (f/h sbh)
    split = w * (4 * sbh + 2 * s * b * f) // t
    # attention scores a·s·s·b: probs saved by softmax (+ fp32 probs and a 16-bit copy if unfused)
    probs = w if (inp.fused_softmax or w == 4) else 4 + w
    scores_per_elem = probs + (mask + w if inp.dropout else 0)  # dropout mask + dropout output
    scores = scores_per_elem * a * s * s * b // t
    per_layer_full = replicated + split + scores

    items: dict[str, int] = {}
    rc = inp.normalized_recompute()
    working_set = 0
    if rc is None:
        items["activations_layers"] = L * per_layer_full
    elif rc == "selective":
        items["activations_layers"] = L * (replicated + split)
        working_set = items["activations_recompute_working_set"] = scores  # one layer's attention core
    elif inp.recompute_method == "uniform":
        # full, uniform N: keep the input of each group of N layers; backward recomputes one group
        # at a time, so a whole group's activations are live at once
        n = min(inp.recompute_num_layers, L)
        items["activations_layer_inputs"] = (L // n) * w * sbh
        working_set = items["activations_recompute_working_set"] = n * per_layer_full
    else:
        # full, block N: the first N layers keep only their input and are recomputed one at a time;
        # the others store everything (an upper bound: by the time backward reaches the recomputed
        # layers the others' activations are freed, so this overstates the peak by <= one layer)
        n = min(inp.recompute_num_layers, L)
        items["activations_layer_inputs"] = n * w * sbh
        if L > n:
            items["activations_layers"] = (L - n) * per_layer_full
        working_set = items["activations_recompute_working_set"] = per_layer_full
    # phase A1: embedding dropout mask, final LayerNorm input, output-layer input; the logits
    items["activations_embedding_final"] = emb_final = (mask + 2 * w) * sbh
    logits = s * b * vocab_padded // t
    items["logits" if w == 4 else "logits_16bit"] = w * logits
    items["logits_fp32_cross_entropy"] = 4 * logits
    pad_mask = (4 - w) * logits if vocab_padded > inp.vocab_size else 0
    if pad_mask:
        items["logits_grad_vocab_pad_mask"] = pad_mask
    phase_a1 = emb_final + (w + 4) * logits + pad_mask
    # held from the output layer's backward to the embedding's (phases A2 and B)
    items["activations_tied_embedding_grad"] = emb_grad = w * vocab_padded * h // t
    phase_a2 = emb_final + 2 * w * logits + emb_grad
    # phase B: one layer's backward
    items["activations_layer_backward_grads"] = layer_grads = 2 * w * s * b * f // t + 2 * w * sbh
    phase_b = working_set + layer_grads + emb_grad
    listed = sum(v for k, v in items.items()
                 if k not in ("activations_layers", "activations_layer_inputs"))
    items["activations_phases_not_coexisting"] = max(phase_a1, phase_a2, phase_b) - listed
    return items


def _bucket_layout(inp: PlanInput, vocab_padded: int, max_positions: int, quantum: int) -> tuple[int, int]:
    """(number of buckets, largest bucket in elements) of the engine's flat layout on one TP rank.

    The engine (offload/flat_buffer.py) walks the parameters in backward order (reverse
    registration order) and closes a bucket as soon as it holds >= bucket_size elements, padded to
    a multiple of N x alignment; a parameter never straddles two buckets. Whole layers that cannot
    close a bucket are skipped in one step and a repeating pattern of buckets over layers is jumped
    over, so this stays cheap for deep models and tiny buckets alike (checked against a
    parameter-by-parameter walk)."""
    h, t, L, cap, f = inp.hidden_size, inp.tensor_parallel, inp.num_layers, inp.bucket_size, inp.ffn()
    # one layer, registration order: LN1 w/b, proj w/b, qkv w/b, LN2 w/b, fc1 w/b, fc2 w/b
    layer = [h, h, h * h // t, h, 3 * h * h // t, 3 * h // t, h, h, f * h // t, f // t, f * h // t, h]
    layer_bwd, layer_total = layer[::-1], sum(layer)
    count, largest, fill, open_ = 0, 0, 0, False

    def add(n: int) -> None:
        nonlocal count, largest, fill, open_
        fill, open_ = fill + n, True
        if fill >= cap:
            count, largest = count + 1, max(largest, -(-fill // quantum) * quantum)
            fill, open_ = 0, False

    for n in (h, h):                      # final LayerNorm bias, weight
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
    add(max_positions * h)                # position embedding
    add(vocab_padded * h // t)            # word embedding (also the output layer)
    if open_:
        count, largest = count + 1, max(largest, -(-fill // quantum) * quantum)
    return count, largest


def _ranks_layout(inp: PlanInput) -> tuple[int, int, int]:
    world = inp.tensor_parallel * inp.data_parallel
    per_node = world if inp.gpus_per_node is None else min(inp.gpus_per_node, world)
    nodes = math.ceil(world / per_node)
    return world, nodes, per_node


def _compute(inp: PlanInput) -> Plan:
    """The numbers, without suggestions."""
    inp.validate()
    t, N = inp.tensor_parallel, inp.data_parallel
    w = _bytes16(inp.precision)
    S = inp.max_position_embeddings or inp.seq_length
    V_pad = pad_vocab_size(inp.vocab_size, t, inp.make_vocab_size_divisible_by)
    counts = count_params(inp.num_layers, inp.hidden_size, V_pad, S, t, inp.ffn_hidden_size)
    psi = counts["per_tp_rank"]
    chunk = N * inp.partition_alignment
    psi_pad = (psi + chunk - 1) // chunk * chunk
    part = psi_pad // N
    world, nodes, per_node = _ranks_layout(inp)
    warnings: list[str] = []

    dev: dict[str, int] = {}
    host_gpu: dict[str, int] = {}
    opt_b = 2 if inp.bf16_optimizer_states else 4
    p16 = "params_fp32" if w == 4 else "params_16bit"
    if inp.zero_offload:
        bucket = min(inp.bucket_size, psi_pad)
        n_buckets, max_bucket = _bucket_layout(inp, V_pad, S, chunk)
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
        if inp.grad_accum_steps > 1 and not inp.accumulate_on_host:
            dev["grads_kept_across_microbatches"] = w * psi_pad
        # --optimizer-offload-fraction F: the engine keeps the partition's first F on the host
        # (rounded to 64 elements) and the tail on the device: fp32 master, m, v and gradient there.
        tail = 0 if inp.optimizer_offload_fraction >= 1 else \
            part - min(part, round(inp.optimizer_offload_fraction * part / 64) * 64)
        if tail:
            dev["optimizer_on_device_fp32"] = 16 * tail
        part -= tail
        host_gpu["master_fp32"] = 4 * part
        host_gpu["adam_exp_avg"] = opt_b * part
        host_gpu["adam_exp_avg_sq"] = opt_b * part
        if wh == w:                       # one buffer: gradients in, updated parameters out
            host_gpu["grad_param_staging" + ("_fp32" if w == 4 else "_16bit")] = w * part
        else:
            host_gpu["grad_staging_fp32"] = 4 * part
            host_gpu["param_staging_16bit"] = w * part
        if inp.grad_accum_steps > 1 and inp.accumulate_on_host:
            host_gpu["grad_accumulator_fp32"] = 4 * part
        if inp.overlap_cpu_step:
            host_gpu["overlap_rollback"] = overlap_rollback_host_bytes(part, w, wh, opt_b)
        if inp.dpu:                       # the second landing set: gradients [+ fp32 accumulator]
            host_gpu["dpu_pending_grad"] = wh * part + (
                4 * part if inp.grad_accum_steps > 1 and inp.accumulate_on_host else 0)
    else:
        dev[p16] = w * psi
        dev["grads_fp32" if w == 4 else "grads_16bit"] = w * psi
        if w == 2:
            dev["master_fp32"] = 4 * psi
        dev["adam_exp_avg"] = opt_b * psi
        dev["adam_exp_avg_sq"] = opt_b * psi
    act = _activation_items(inp, V_pad)
    dev.update(act)
    dev["allocator_fragmentation"] = int(inp.fragmentation * sum(act.values()))
    dev["framework_overhead"] = inp.device_overhead_bytes

    host_per_gpu = sum(host_gpu.values())
    host_node = {k: v * per_node for k, v in host_gpu.items()}
    host_node["process_overhead"] = inp.host_overhead_bytes_per_rank * per_node
    host_node["os_reserve"] = inp.host_reserve_bytes
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

    return Plan(input=inp, fits=fits, reasons=reasons, suggestions=[], warnings=warnings,
                device_bytes_per_gpu=device_total, host_bytes_per_gpu=host_per_gpu,
                host_bytes_per_node=host_total, device_items=dev, host_items=host_node,
                params_total=counts["total"], params_per_tp_rank=psi,
                params_per_tp_rank_padded=psi_pad,
                replicated_params_per_tp_rank=counts["replicated_per_tp_rank"],
                vocab_size_padded=V_pad, world_size=world, num_nodes=nodes,
                ranks_per_node=per_node, fits_device=fits_device, fits_host=fits_host)


def overlap_rollback_host_bytes(part: int, param_bytes: int, host_grad_bytes: int, state_bytes: int) -> int:
    """--overlap-cpu-step's extra host bytes for a host partition of `part` elements: the backup of
    what a speculated CPU Adam overwrites (fp32 master + both moments, restored on a rollback), and
    the updated parameters' own staging buffer when it would otherwise share the gradient's (the
    gradient must survive for a redo). Equals the engine's accounting.host_overlap_bytes."""
    return part * (4 + 2 * state_bytes) + (param_bytes * part if host_grad_bytes == param_bytes else 0)


def solve_offload_fraction(inp: PlanInput, step: float = 0.05) -> float | None:
    """`--optimizer-offload-fraction auto`: the smallest host share F (so the largest device share
    of the optimizer), on a grid of `step`, with which the run fits; None if not even F=1 fits."""
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
        if inp.zero_offload and not inp.bf16_optimizer_states:
            add(f"keep Adam moments in bf16 on the host (`{BF16_STATES_FLAGS}`)",
                inp.replace(bf16_optimizer_states=True))
        if inp.dpu:
            add("turn off DPU: drop --dpu (no pending-gradient buffer)", inp.replace(dpu=False))
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


def plan_input_from_flags(flags: Any, *, data_parallel: int, vocab_size: int, **hardware: Any) -> PlanInput:
    """The PlanInput of a pretrain_gpt.py run, built from its flags: the one builder behind both the
    job's pre-launch check and tools/estimate_memory.py (which takes the same flag names and
    defaults), so the two can never plan different models. `flags` has pretrain_gpt.py's argparse
    attribute names; `hardware` the PlanInput fields of the machine (memory sizes, overheads)."""
    precision = flags.precision or "bf16"
    mb = flags.micro_batch_size
    gbs = flags.global_batch_size
    if gbs is None:
        accum = 1
    elif gbs < 1 or gbs % (mb * data_parallel):
        raise ValueError(f"--global-batch-size {gbs} is not a multiple of --micro-batch-size {mb} x DP {data_parallel}")
    else:
        accum = gbs // (mb * data_parallel)
    recompute = flags.recompute_granularity or ("selective" if flags.recompute_activations else None)
    return PlanInput(
        num_layers=flags.num_layers, hidden_size=flags.hidden_size, num_attention_heads=flags.num_attention_heads,
        ffn_hidden_size=flags.ffn_hidden_size, vocab_size=vocab_size, seq_length=flags.seq_length,
        max_position_embeddings=flags.max_position_embeddings or flags.seq_length, tensor_parallel=flags.tensor_parallel,
        data_parallel=data_parallel, micro_batch_size=mb, grad_accum_steps=accum, precision=precision,
        zero_offload=flags.zero_offload, dpu=bool(getattr(flags, "dpu", False)), recompute=recompute,
        recompute_method=getattr(flags, "recompute_method", None) or "uniform",
        recompute_num_layers=getattr(flags, "recompute_num_layers", None) or 1,
        bucket_size=flags.bucket_size, make_vocab_size_divisible_by=flags.make_vocab_size_divisible_by,
        # the model's attention is torch's softmax in fp32 (not a fused kernel) on every device
        dropout=flags.hidden_dropout > 0 or flags.attention_dropout > 0, fused_softmax=False,
        bf16_optimizer_states=flags.exp_avg_dtype == "bf16",
        grad_reduce_fp32=flags.accumulate_allreduce_grads_in_fp32,
        host_grad_fp32=flags.main_grads_dtype == "fp32" and precision != "fp32",
        accumulate_on_host=flags.accumulate_grads_on_host, **hardware)


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
    when even the smallest member does not fit. Memory grows monotonically along both families,
    so this is an exponential + binary search.
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

    def fits(k):
        return _compute(make(k)).fits

    if not fits(1):
        return 0, None
    lo, hi = 1, 2
    while hi <= limit and fits(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, limit + 1)
    while hi - lo > 1:  # fits(lo), not fits(hi) (or hi beyond the limit)
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    best = _compute(make(lo))
    shape = {"num_layers": best.input.num_layers, "hidden_size": best.input.hidden_size,
             "num_attention_heads": best.input.num_attention_heads}
    return best.params_total, shape


# ------------------------------------------------------------------------------------------------
# presets

def _host_ram_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import os
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 16 * GiB


# GPU capacities are what torch.cuda.get_device_properties().total_memory reports (approximately);
# the CUDA context is a separate line item (device_overhead_bytes).
HARDWARE_PRESETS: dict[str, dict[str, Any]] = {
    "v100-32gb": dict(  # the paper's single-GPU runs: one V100 of a DGX-2, with its host memory
        gpu_memory_bytes=32510 * MiB, gpus_per_node=1, host_memory_bytes_per_node=1536 * GiB,
        precision="fp16", description="1x V100-32GB, 1.5 TiB host (the paper's single-GPU setup)"),
    "dgx2": dict(
        gpu_memory_bytes=32510 * MiB, gpus_per_node=16, host_memory_bytes_per_node=1536 * GiB,
        precision="fp16", description="DGX-2: 16x V100-32GB, 1.5 TiB host"),
    "a100-80gb": dict(
        gpu_memory_bytes=int(79.1 * GiB), gpus_per_node=8, host_memory_bytes_per_node=2048 * GiB,
        precision="bf16", description="DGX A100 80GB: 8x A100-80GB, 2 TiB host"),
    "h100-80gb": dict(
        gpu_memory_bytes=int(79.1 * GiB), gpus_per_node=8, host_memory_bytes_per_node=2048 * GiB,
        precision="bf16", description="DGX H100: 8x H100-80GB, 2 TiB host"),
    "cpu": dict(  # CPU runs (gloo): one process per "GPU", all of them in this machine's RAM
        gpu_memory_bytes=None, gpus_per_node=None, host_memory_bytes_per_node=None,
        device_overhead_bytes=0, host_overhead_bytes_per_rank=1 * GiB, host_reserve_bytes=1 * GiB,
        device_is_host=True, fused_softmax=False, description="this machine's CPU and RAM (device = host RAM)"),
}


def apply_hardware_preset(inp: PlanInput, name: str, *, keep_precision: bool = False) -> PlanInput:
    """Return `inp` with a hardware preset's memory sizes (and its default precision unless
    keep_precision)."""
    if name not in HARDWARE_PRESETS:
        raise ValueError(f"unknown hardware preset {name!r}; one of {sorted(HARDWARE_PRESETS)}")
    fields = {k: v for k, v in HARDWARE_PRESETS[name].items() if k != "description"}
    if name == "cpu":
        ram = _host_ram_bytes()
        fields["gpu_memory_bytes"] = ram
        fields["host_memory_bytes_per_node"] = ram
    if keep_precision:
        fields.pop("precision", None)
    return inp.replace(**fields)


# name -> (num_layers, hidden_size, num_attention_heads)
MODEL_PRESETS: dict[str, tuple[int, int, int]] = {
    "gpt2-small": (12, 768, 12),
    "gpt2-medium": (24, 1024, 16),
    "gpt2-large": (36, 1280, 20),
    "gpt2-xl": (48, 1600, 25),
    "1.3b": (24, 2048, 16),
    "2.7b": (32, 2560, 32),
    "6.7b": (32, 4096, 32),
    "10b": (50, 4096, 32),  # paper-style shapes: 12·L·h² at h = 4096
    "13b": (65, 4096, 32),
    "15b": (78, 4096, 32),
    "70b": (69, 9216, 96),  # 12·69·9216² = 70.3B; 96 heads (head dim 96) so TP=16 divides them
    "100b": (80, 10240, 80),
    "175b": (96, 12288, 96),  # GPT-3
}


def model_preset(name: str) -> dict[str, int]:
    if name not in MODEL_PRESETS:
        raise ValueError(f"unknown model preset {name!r}; one of {list(MODEL_PRESETS)}")
    L, h, a = MODEL_PRESETS[name]
    return {"num_layers": L, "hidden_size": h, "num_attention_heads": a}


# ------------------------------------------------------------------------------------------------
# the paper's reference points and our own maxima

def _paper_inputs() -> list[tuple[str, PlanInput, bool, str]]:
    v100 = dict(seq_length=1024, precision="fp16", recompute="full", gpus_per_node=1,
                gpu_memory_bytes=HARDWARE_PRESETS["v100-32gb"]["gpu_memory_bytes"],
                host_memory_bytes_per_node=1536 * GiB)
    dgx2 = dict(v100, gpus_per_node=16)
    return [
        ("13B, 1x V100-32GB, ZeRO-Offload, mb 4",
         PlanInput(**model_preset("13b"), micro_batch_size=4, zero_offload=True, **v100),
         True, "paper: 13B fits"),
        ("13B, 1x V100-32GB, no offload, mb 4",
         PlanInput(**model_preset("13b"), micro_batch_size=4, zero_offload=False, **v100),
         False, "paper: PyTorch alone tops out at 1.4B"),
        ("70B, DGX-2 TP=16, ZeRO-Offload, mb 8",
         PlanInput(**model_preset("70b"), tensor_parallel=16, micro_batch_size=8,
                   zero_offload=True, **dgx2),
         True, "paper: 70B fits with MP=16"),
        ("70B, DGX-2 TP=16, no offload, mb 8",
         PlanInput(**model_preset("70b"), tensor_parallel=16, micro_batch_size=8,
                   zero_offload=False, **dgx2),
         False, "paper: Megatron alone tops out at 15B"),
        ("15B, DGX-2 TP=16, no offload, mb 8",
         PlanInput(**model_preset("15b"), tensor_parallel=16, micro_batch_size=8,
                   zero_offload=False, **dgx2),
         True, "paper: Megatron alone trains 15B"),
    ]


def paper_checks() -> list[dict[str, Any]]:
    """The paper's headline points, evaluated with this planner.

    Shapes: seq 1024, vocab 50257 (padded), fp16 (V100 has no bf16), full recompute
    (activation checkpointing, as in the paper); 13B = 65 layers x 4096 hidden x 32 heads,
    15B = 78 x 4096 x 32, 70B = 69 x 9216 x 96 heads (12·L·h² = 13.1B / 15.7B / 70.3B).
    Also reports the no-offload maxima (paper: 1.4B on one V100, 15B on a DGX-2) for context.
    """
    rows = []
    for name, inp, expected, paper in _paper_inputs():
        p = plan(inp)
        rows.append({"name": name, "params": p.params_total, "expected_fits": expected,
                     "fits": p.fits, "ok": p.fits == expected, "paper": paper,
                     "device_bytes_per_gpu": p.device_bytes_per_gpu,
                     "host_bytes_per_node": p.host_bytes_per_node,
                     "gpu_memory_bytes": inp.gpu_memory_bytes,
                     "host_memory_bytes_per_node": inp.host_memory_bytes_per_node})
    return rows


def baseline_maxima() -> list[dict[str, Any]]:
    """Largest models WITHOUT ZeRO-Offload (to set beside the paper's 1.4B and 15B)."""
    v100 = _paper_inputs()[1][1]  # 13B no-offload template; we vary the shape
    dgx2 = _paper_inputs()[3][1]
    out = []
    for name, tmpl, paper in (
            ("no offload, 1x V100-32GB, h=2048 (16 heads), mb 4",
             v100.replace(hidden_size=2048, num_attention_heads=16), "paper (PyTorch): 1.4B"),
            ("no offload, DGX-2 TP=16, h=4096 (32 heads), mb 8",
             dgx2.replace(hidden_size=4096, num_attention_heads=32), "paper (Megatron): 15B")):
        mp, shape = max_model(tmpl, "layers")
        out.append({"name": name, "max_params": mp, "shape": shape, "paper": paper})
    return out


GOALS = {"v100": 15e9, "dgx2": 100e9}


def our_maxima() -> list[dict[str, Any]]:
    """Our goal: >= 15B on one V100-32GB and >= 100B on one DGX-2, with ZeRO-Offload, full
    recompute, bf16 optimizer states (host), fp16 on the GPU, micro-batch 1, seq 1024."""
    common = dict(seq_length=1024, precision="fp16", recompute="full", micro_batch_size=1,
                  zero_offload=True, bf16_optimizer_states=True,
                  gpu_memory_bytes=HARDWARE_PRESETS["v100-32gb"]["gpu_memory_bytes"],
                  host_memory_bytes_per_node=1536 * GiB)
    cases = [
        ("1x V100-32GB, h=4096 (32 heads), layers grow", "v100",
         PlanInput(num_layers=1, hidden_size=4096, num_attention_heads=32, gpus_per_node=1,
                   **common)),
        ("DGX-2 TP=16, h=10240 (80 heads), layers grow", "dgx2",
         PlanInput(num_layers=1, hidden_size=10240, num_attention_heads=80, tensor_parallel=16,
                   gpus_per_node=16, **common)),
    ]
    rows = []
    for name, key, tmpl in cases:
        mp, shape = max_model(tmpl, "layers")
        p = plan(tmpl.replace(**shape))
        limit = "device" if not _compute(tmpl.replace(num_layers=shape["num_layers"] + 1)).fits_device \
            else "host"
        rows.append({"name": name, "max_params": mp, "shape": shape, "goal": GOALS[key],
                     "meets_goal": mp >= GOALS[key], "limited_by": limit,
                     "device_bytes_per_gpu": p.device_bytes_per_gpu,
                     "host_bytes_per_node": p.host_bytes_per_node})
    return rows


# ------------------------------------------------------------------------------------------------
# formatting

def format_bytes(n: int | float) -> str:
    return f"{n / GiB:,.2f} GiB"


def format_params(n: int | float) -> str:
    if n >= 1e9:
        return f"{n / 1e9:.2f}B"
    if n >= 1e6:
        return f"{n / 1e6:.1f}M"
    return f"{int(n):,}"
