#!/usr/bin/env python
"""Will my model fit? Device memory per GPU and host memory per node for a zo_megatron job.

    python tools/estimate_memory.py --preset dgx2 --model 70b --tensor-model-parallel-size 16 \
        --zero-offload --micro-batch-size 8 --recompute-granularity full
    python tools/estimate_memory.py --preset v100-32gb --hidden-size 4096 --num-attention-heads 32 \
        --zero-offload --recompute-granularity full --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16 --max-model layers
    python tools/estimate_memory.py --preset h100-80gb --model llama3-8b --seq-length 8192 --zero-offload \
        --use-flash-attn --sequence-parallel --tensor-model-parallel-size 8
    python tools/estimate_memory.py --world-size 16 --gpu-memory-gb 31.75 --host-memory-gb 1536 \
        --gpus-per-node 16 --tensor-model-parallel-size 16 --num-layers 69 --hidden-size 9216 \
        --num-attention-heads 96 --seq-length 1024 --micro-batch-size 8 --train-iters 20000 --lr 1e-4 \
        --fp16 --recompute-granularity full --use-flash-attn --sequence-parallel --zero-offload \
        --tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR ...   # a pretrain_gpt.py command line
    python tools/estimate_memory.py --preset h100-80gb --world-size 8 --num-layers 32 --hidden-size 4096 \
        --num-attention-heads 32 --group-query-attention --num-query-groups 8 --ffn-hidden-size 14336 --swiglu \
        --normalization RMSNorm --position-embedding-type rope --untie-embeddings-and-output-weights \
        --disable-bias-linear --vocab-size 32000 --num-experts 8 --moe-router-topk 2 \
        --expert-model-parallel-size 8 --seq-length 4096 --zero-offload --use-flash-attn \
        --recompute-granularity full                     # Mixtral-8x7B: total vs active, experts per EP rank
    python tools/estimate_memory.py --preset h100-80gb --world-size 8 --tensor-model-parallel-size 8 \
        --num-layers 61 --hidden-size 7168 --num-attention-heads 128 --ffn-hidden-size 18432 --swiglu \
        --normalization RMSNorm --position-embedding-type rope --untie-embeddings-and-output-weights \
        --disable-bias-linear --vocab-size 129280 --multi-latent-attention --q-lora-rank 1536 \
        --kv-lora-rank 512 --qk-head-dim 128 --qk-pos-emb-head-dim 64 --v-head-dim 128 --qk-layernorm \
        --seq-length 4096 --zero-offload --sequence-parallel \
        --recompute-granularity full                     # DeepSeek-V3's attention (MLA) on a dense model
    python tools/estimate_memory.py --preset h100-80gb --world-size 8 --num-layers 24 --hidden-size 2880 \
        --num-attention-heads 64 --group-query-attention --num-query-groups 8 --kv-channels 64 \
        --ffn-hidden-size 2880 --vocab-size 201088 --normalization RMSNorm --position-embedding-type rope \
        --untie-embeddings-and-output-weights --num-experts 32 --moe-router-topk 4 --quick-geglu \
        --glu-linear-offset 1.0 --activation-func-clamp-value 7.0 --softmax-type learnable \
        --expert-model-parallel-size 8 --seq-length 4096 --zero-offload --use-flash-attn \
        --recompute-granularity full                     # GPT-OSS-20B: quick GeGLU, attention sinks, biases
    python tools/estimate_memory.py --paper-check

It takes pretrain_gpt.py's command line: every flag the job accepts (its own parser,
training/arguments.build_parser: data, schedule, logging and checkpoint flags are accepted and
ignored where they do not change memory), parsed and checked by the job's own code (finalize), and
resolved as the job resolves it on the target device: the demo model without shape flags,
Megatron's defaults with them, bf16 on a GPU (a --preset's own precision where it names one: fp16
on a V100), the CPU's rule with --preset cpu; the job's host reserve (min(32 GiB, max(256 MiB, host/10))) and
overheads; --tokenizer-type/--tokenizer-model/--vocab-file read as the job reads them for the
vocabulary (model_vocab_size); then --optimizer-offload-fraction auto and the CPU-step overlap
(--overlap-cpu-step [auto|full], --overlap-cpu-step-memory, --no-overlap-cpu-step; default auto on
a GPU, off where the device is the host) exactly as the job's pre-launch check (prelaunch.job_plan):
the input is built by the same function (planner.plan_input_from_flags), so both give the same plan
and the same speculated share. Mixtures of experts take Megatron-LM's MoE flags and
--expert-model-parallel-size: the plan prints total vs active parameters, experts per EP rank and,
at EP > 1, the experts' engine's lines ("expert_..."). Multi-latent attention takes Megatron-LM's MLA
flags (--multi-latent-attention, --q-lora-rank, --kv-lora-rank, --qk-head-dim, --qk-pos-emb-head-dim,
--v-head-dim, --rope-type; --qk-layernorm for the latents' norms); GPT-OSS's parts theirs (--quick-geglu,
--glu-linear-offset, --activation-func-clamp-value, --softmax-type). Its own flags: --model (a shape
preset), --world-size or --data-parallel-size, the hardware (--preset, --gpu-memory-gb,
--host-memory-gb, --gpus-per-node and the overheads) and the output (--json, --max-model,
--paper-check). Unlike the job it does not require --train-iters and --lr, and --seq-length defaults
to 1024 when a shape is given.
Memory sizes are GiB (2^30 bytes).
Exit status: 0 = fits (with --max-model: some model fits; with --paper-check: every reference
point and goal holds), 1 = does not fit, 2 = bad input (one line on stderr).
The memory model is described in docs/memory_planner.md.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

try:
    from zo_megatron import planner as P
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from zo_megatron import planner as P
from zo_megatron.errors import UserError  # noqa: E402
from zo_megatron.planner.params import RECOMPUTE_MODULES  # noqa: E402
from zo_megatron.training.arguments import build_parser as job_parser  # noqa: E402
from zo_megatron.training.arguments import check_batch_sizes, finalize  # noqa: E402
from zo_megatron.training.checkpoint_args import apply_checkpoint_args, given_dests  # noqa: E402

PROG = "estimate_memory.py"
SHAPE = ("num_layers", "hidden_size", "num_attention_heads")
DEFAULT_SEQ_LENGTH = 1024        # with a shape and no --seq-length (the job requires the flag)
GPT2_VOCAB_SIZE = 50257          # the bundled GPT-2 tokenizer's size: the job's default vocabulary


class BadInput(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    """One-line errors (exit 2 in main); remembers the command line (the flags given)."""

    def error(self, message):  # argparse prints usage + message otherwise
        raise BadInput(message)

    def parse_known_args(self, args=None, namespace=None):
        argv = sys.argv[1:] if args is None else list(args)
        ns, extra = super().parse_known_args(argv, namespace)
        ns.argv = argv
        return ns, extra


def build_parser() -> argparse.ArgumentParser:
    """pretrain_gpt.py's parser (every flag, the job's defaults) plus this tool's own flags."""
    ap = _Parser(prog=PROG, description=__doc__.split("\n\n")[0], parents=[job_parser()], add_help=False,
                 allow_abbrev=False, formatter_class=argparse.RawDescriptionHelpFormatter,
                 usage="%(prog)s [pretrain_gpt.py's flags] [--model NAME] [--world-size N | --data-parallel-size N]"
                       "\n       [--preset NAME] [--gpu-memory-gb G] [--host-memory-gb G] [--gpus-per-node N] ..."
                       "\n       [--json] [--max-model {layers,hidden}] [--paper-check]")
    for a in ap._actions:
        if a.dest == "seq_length":
            a.help = (f"tokens per sample (estimate_memory: {DEFAULT_SEQ_LENGTH} when a shape is given; the job "
                      "requires it)")
        elif a.dest == "vocab_size":
            a.help = ("the model's vocabulary before padding (default: the tokenizer's size as the job reads it when "
                      "a tokenizer flag names one, else the --model preset's, else GPT-2's 50257)")
    g = ap.add_argument_group("estimate_memory: model preset and job size")
    g.add_argument("--model", choices=list(P.MODEL_PRESETS),
                   help="model preset: shape, and for llama3-8b, llama3-70b, qwen2-7b also vocabulary and "
                        "architecture (explicit flags override it)")
    g.add_argument("--data-parallel-size", dest="dp", type=int)
    g.add_argument("--world-size", type=int, help="TP x DP, the job's ranks (alternative to --data-parallel-size)")
    g.add_argument("--no-zero-offload", dest="zero_offload", action="store_false", default=False,
                   help="(default) baseline: DDP + Adam on the device (16 bytes/param)")
    g.add_argument("--bf16-optimizer-states", action="store_true", help=argparse.SUPPRESS)  # old name
    g.add_argument("--moe-routing-imbalance", type=float, default=1.0,
                   help="mixture of experts: plan the busiest EP rank's experts at this many times the balanced "
                        "share of token slots (default 1: balanced, the aux loss's aim; bounded by what can reach "
                        "a rank and by --moe-expert-capacity-factor)")

    g = ap.add_argument_group("estimate_memory: hardware (default: a GPU, the PlanInput defaults: V100-32GB, "
                              "1.5 TiB host, every rank on one node)")
    g.add_argument("--preset", choices=list(P.HARDWARE_PRESETS),
                   help="; ".join(f"{k}: {v['description']}" for k, v in P.HARDWARE_PRESETS.items()))
    g.add_argument("--gpu-memory-gb", type=float, help="GiB per GPU (with --preset cpu: the host's, unified)")
    g.add_argument("--host-memory-gb", type=float, help="GiB of host RAM per node")
    g.add_argument("--gpus-per-node", type=int, help="ranks per node (default: every rank on one node)")
    g.add_argument("--device-overhead-gb", type=float, help="CUDA context etc. per GPU (default 1; 0 on cpu)")
    g.add_argument("--host-overhead-gb", type=float,
                   help="per process on the host (default 3; 0.49 on cpu, + 0.22 once per node for the launcher)")
    g.add_argument("--host-reserve-gb", type=float,
                   help="OS/page cache per node (default: the job's, min(32, max(0.25, 10%% of the host memory)))")
    g.add_argument("--fragmentation", type=float, help="allocator margin on transient bytes (0.1)")

    g = ap.add_argument_group("estimate_memory: output")
    g.add_argument("--json", action="store_true", help="print JSON instead of a table")
    g.add_argument("--max-model", choices=list(P.FAMILIES),
                   help="largest model that fits: 'layers' keeps hidden/heads and grows layers; "
                        "'hidden' keeps layers and grows hidden: GPT-2 in steps of lcm(128, heads), heads kept; a "
                        "Llama-family model keeps its head dim, heads per KV group and ffn/hidden ratio (and a mixture of "
                        "experts its experts, top-k and EP, its experts' FFN in ratio). The CPU-step "
                        "overlap never shrinks it: searched with the overlap off (`auto` and the default), then "
                        "resolved on the result")
    g.add_argument("--paper-check", action="store_true",
                   help="the ZeRO-Offload paper's reference points and our maxima")
    return ap


def _gib(x: float | None) -> int | None:
    return None if x is None else int(round(x * P.GiB))


def _apply_preset(args, parser: argparse.ArgumentParser) -> tuple[dict, int | None]:
    """The --model preset's flags where the command line left them at their defaults; returns
    (its shape, its vocabulary or None)."""
    preset = P.model_preset(args.model) if args.model else {}
    shape = {k: preset.pop(k) for k in SHAPE if k in preset}
    vocab = preset.pop("vocab_size", None)
    for key, value in preset.items():
        if key == "num_query_groups":
            if not args.group_query_attention:
                args.group_query_attention = True
                if args.num_query_groups == parser.get_default("num_query_groups"):
                    args.num_query_groups = value
        elif getattr(args, key) == parser.get_default(key):
            setattr(args, key, value)
    for key, value in P.MODEL_PRESET_NUMERICS.get(args.model, {}).items():
        if getattr(args, key) == parser.get_default(key):
            setattr(args, key, value)
    return shape, vocab


def _cpu_default_precision() -> str:
    """cpu_precision.default_precision's choice for a CPU device (this CPU's, measured and cached where its
    flags promise native bf16)."""
    from zo_megatron.data.corpus import default_cache_dir
    from zo_megatron.training.cpu_precision import choose, cpu_flags

    native = sorted(cpu_flags() & {"avx512_bf16", "amx_bf16"})
    return choose(native, default_cache_dir())[0] if native else "fp32"


def _device_is_host(args) -> bool:
    return bool(args.preset and P.HARDWARE_PRESETS[args.preset].get("device_is_host"))


def _job_args(args, parser: argparse.ArgumentParser) -> int | None:
    """What pretrain_gpt.py's parse_args does after argparse (checkpoint arguments, defaults, the
    job's checks), with this tool's presets and the target device's defaults; returns the model
    preset's vocabulary (None: none)."""
    argv = getattr(args, "argv", None)
    args.given = given_dests(parser, argv) if argv is not None else {
        a.dest for a in parser._actions if a.option_strings and getattr(args, a.dest, None) != a.default}
    try:
        if args.use_checkpoint_args:
            apply_checkpoint_args(parser, args, args.given)
        shape, vocab = _apply_preset(args, parser)
        for key, value in shape.items():
            if getattr(args, key) is None:
                setattr(args, key, value)
        if args.max_model == "layers" and args.num_layers is None:
            args.num_layers = 1
        if args.max_model == "hidden" and args.hidden_size is None and args.num_attention_heads is not None:
            args.hidden_size = math.lcm(128, args.num_attention_heads)
        given = [k for k in SHAPE if getattr(args, k) is not None]
        if given and len(given) < len(SHAPE):
            raise BadInput("give --model or --" + ", --".join(k.replace("_", "-") for k in SHAPE if k not in given))
        if given and not getattr(args, "checkpoint_demo", False):
            # what the job requires with a shape but memory does not depend on
            if args.seq_length is None:
                args.seq_length = DEFAULT_SEQ_LENGTH
            if args.train_iters is None and args.train_samples is None:
                args.train_iters = max(1, args.lr_warmup_iters or 0, args.lr_decay_iters or 0)
            if args.lr is None:
                args.lr = max(1e-4, args.min_lr or 0.0)
        if args.bf16_optimizer_states:
            args.exp_avg_dtype = args.exp_avg_sq_dtype = "bf16"
        if args.precision is None:   # the target's default: the job's on a GPU, a preset's own (V100: fp16)
            named = P.HARDWARE_PRESETS[args.preset].get("precision") if args.preset else None
            args.precision = named or (_cpu_default_precision() if _device_is_host(args) else "bf16")
        finalize(args)
    except UserError as e:
        raise BadInput(str(e)) from None
    return vocab


def _data_parallel(args) -> int:
    tp = args.tensor_parallel
    if args.dp is not None and args.world_size is not None and args.dp * tp != args.world_size:
        raise BadInput(f"--world-size {args.world_size} != TP {tp} x --data-parallel-size {args.dp}")
    if args.dp is not None:
        dp = args.dp
    elif args.world_size is not None:
        if args.world_size < 1 or tp < 1 or args.world_size % tp:
            raise BadInput(f"--world-size {args.world_size} is not a multiple of TP {tp}")
        dp = args.world_size // tp
    else:
        dp = 1
    if dp < 1:
        raise BadInput("the data parallel size must be >= 1")
    return dp


def _vocab_size(args, preset_vocab: int | None) -> int:
    """The job's vocabulary (prelaunch.model_vocab_size) when a tokenizer flag names a tokenizer; else
    --vocab-size, the --model preset's, or the bundled GPT-2 tokenizer's 50257."""
    if args.tokenizer_type in ("HuggingFaceTokenizer", "NullTokenizer") or args.vocab_file or args.merge_file:
        from zo_megatron.data import build_tokenizer
        from zo_megatron.training.prelaunch import model_vocab_size

        try:
            tok = build_tokenizer(args.vocab_file, args.merge_file, allow_custom_vocab=args.allow_custom_vocab,
                                  tokenizer_type=args.tokenizer_type, tokenizer_model=args.tokenizer_model,
                                  vocab_size=args.vocab_size)
            return model_vocab_size(args, tok)
        except UserError as e:
            raise BadInput(str(e)) from None
    return args.vocab_size or preset_vocab or GPT2_VOCAB_SIZE


def build_input(args, parser: argparse.ArgumentParser | None = None) -> P.PlanInput:
    """The job's PlanInput for this command line before the job's own resolutions (as
    prelaunch.job_plan_input): flags, vocabulary, data parallel size and the target's hardware."""
    parser = parser or build_parser()
    preset_vocab = _job_args(args, parser)
    dp = _data_parallel(args)
    try:
        check_batch_sizes(args, dp)
    except UserError as e:
        raise BadInput(str(e)) from None
    inp = P.plan_input_from_flags(args, data_parallel=dp, vocab_size=_vocab_size(args, preset_vocab))
    if args.preset:
        inp = P.apply_hardware_preset(inp, args.preset, keep_precision=True)
    overrides = {
        "gpu_memory_bytes": _gib(args.gpu_memory_gb),
        "host_memory_bytes_per_node": _gib(args.host_memory_gb),
        "gpus_per_node": args.gpus_per_node,
        "device_overhead_bytes": _gib(args.device_overhead_gb),
        "host_overhead_bytes_per_rank": _gib(args.host_overhead_gb),
        "fragmentation": args.fragmentation,
    }
    inp = inp.replace(**{k: v for k, v in overrides.items() if v is not None})
    if inp.device_is_host and args.gpu_memory_gb is None:   # the job: the device's memory is the host's
        inp = inp.replace(gpu_memory_bytes=inp.host_memory_bytes_per_node)
    host = inp.host_memory_bytes_per_node
    # prelaunch.job_plan_input's reserve: min(32 GiB, max(256 MiB, a tenth of the node's memory))
    reserve = _gib(args.host_reserve_gb) if args.host_reserve_gb is not None else P.os_reserve_bytes(host)
    inp = inp.replace(host_reserve_bytes=reserve)
    if args.preset == "cpu" and args.gpus_per_node is None:
        inp = inp.replace(gpus_per_node=None)
    inp.validate()
    return inp


def resolve(inp: P.PlanInput, args) -> tuple[P.PlanInput, dict]:
    """prelaunch.job_plan's resolution of `inp` (build_input's): --optimizer-offload-fraction auto, then
    the CPU-step overlap (--overlap-cpu-step's mode; None: auto on a GPU, off where the device is
    the host), resolved last. Returns the input the job plans and what it prints about them."""
    mode = args.overlap_cpu_step            # None, auto, full, memory (--overlap-cpu-step-memory), off
    budget = args.overlap_cpu_step_memory
    auto_offload = args.optimizer_offload_fraction == "auto"
    inp = inp.replace(overlap_cpu_step=mode in ("full", "memory"),
                      overlap_speculated_fraction=1.0 if mode == "full" else 0.0,
                      optimizer_offload_fraction=1.0 if auto_offload else args.optimizer_offload_fraction)
    if mode == "memory":
        f, _ = P.resolve_overlap(inp, mode, budget)
        inp = inp.replace(overlap_speculated_fraction=f)
    info = {}
    if auto_offload:
        from zo_megatron.training.user_report import auto_fraction_reason

        f = P.solve_offload_fraction(inp)
        inp = inp.replace(optimizer_offload_fraction=1.0 if f is None else f)
        info["optimizer_offload_fraction_reason"] = auto_fraction_reason(inp, f)
    f, reason = P.resolve_overlap(inp, mode, budget)
    info.update(overlap_speculated_fraction=f, overlap_reason=reason)
    return inp.replace(overlap_cpu_step=f > 0, overlap_speculated_fraction=f), info


def job_plan(args, parser: argparse.ArgumentParser | None = None) -> tuple[P.Plan, dict]:
    """The plan of this command line as the job's pre-launch check computes it, and what it says
    about its resolutions (overlap_speculated_fraction, overlap_reason, ...)."""
    inp, info = resolve(build_input(args, parser), args)
    return P.plan(inp), info


def _search_input(inp: P.PlanInput, args) -> P.PlanInput:
    """What --max-model searches with: the overlap off for `auto` and the default (it only takes
    memory the plan leaves free, so it must not shrink the model); an explicit `full` or
    --overlap-cpu-step-memory as the job would run it; --optimizer-offload-fraction auto at 1."""
    mode = args.overlap_cpu_step
    frac = 1.0 if args.optimizer_offload_fraction == "auto" else args.optimizer_offload_fraction
    inp = inp.replace(optimizer_offload_fraction=frac, overlap_cpu_step=False, overlap_speculated_fraction=0.0)
    if mode not in ("full", "memory") or not inp.zero_offload or inp.dpu:
        return inp
    f = 1.0 if mode == "full" else P.solve_overlap_fraction(inp.replace(overlap_cpu_step=True),
                                                            args.overlap_cpu_step_memory)
    return inp.replace(overlap_cpu_step=f > 0, overlap_speculated_fraction=f)


def max_model(inp: P.PlanInput, args) -> tuple[int, dict | None, P.PlanInput]:
    """(largest parameter count, its shape or None, its input before the job's resolutions)."""
    family = args.max_model

    def make(k):
        return P.family_member(inp, family, k)
    if args.overlap_cpu_step in ("full", "memory"):     # the overlap's share depends on the size
        limit = 100_000 if family == "layers" else max(1, 1_000_000 // make(1).hidden_size)
        k = P.largest_fitting(lambda k: P.plan(_search_input(make(k), args)).fits,
                              lambda k: P.may_fit(_search_input(make(k), args)), limit)
        if k == 0:
            return 0, None, make(1)
        best = P.plan(_search_input(make(k), args))
        shape = {key: getattr(best.input, key) for key in SHAPE}
        return best.params_total, shape, make(k)
    max_params, shape = P.max_model(_search_input(inp, args), family)
    return max_params, shape, inp.replace(**shape) if shape else make(1)


# ------------------------------------------------------------------------------------------------
# printing

def _g(n) -> str:
    return f"{n / P.GiB:10,.2f}"


def _cpu_step_line(p: P.Plan) -> str:
    """How the CPU step runs in this plan (--overlap-cpu-step and its share, DPU, or no offload)."""
    i = p.input
    if not i.zero_offload:
        return "Adam on the device (no --zero-offload)"
    if i.dpu:
        return "CPU Adam one step behind, overlapping the next forward/backward (--dpu)"
    if i.overlap_cpu_step and i.overlap_speculated_fraction > 0:
        rb = sum(v for k, v in p.host_items.items() if k.endswith("overlap_rollback"))
        return (f"overlapped with backward (--overlap-cpu-step): {i.overlap_speculated_fraction:.0%} of each rank's "
                f"host partition speculated, its rollback state {P.format_bytes(rb)} per node")
    return "synchronous, after backward (nothing speculated: no rollback state on the host)"


def moe_lines(p: P.Plan) -> list[str]:
    """A mixture of experts' lines: total vs active parameters, experts per EP rank, the engines."""
    i = p.input
    if i.num_experts is None:
        return []
    moe = i.moe()
    dense = p.params_per_tp_rank - p.params_expert_per_rank
    engines = (f"two engines: the dense parameters over DP {i.data_parallel}, the experts over expert DP "
               f"{i.expert_data_parallel()} (items 'expert_...')" if i.experts_apart() else
               f"one engine: the experts replicated over DP {i.data_parallel} as dense parameters")
    return [f"  experts    {P.format_params(p.params_active)} active of {P.format_params(p.params_total)} total "
            f"(top-{i.moe_router_topk} of {i.num_experts} experts in {sum(moe.layers)} of {i.num_layers} layers; "
            f"routed experts {P.format_params(p.params_experts_total)} of the total)",
            f"  per rank   {p.experts_per_ep_rank} of {i.num_experts} experts per EP rank (EP {i.expert_parallel}, "
            f"each split over expert TP {i.expert_tp()}): "
            f"{P.format_params(p.params_expert_per_rank)} expert + {P.format_params(dense)} dense parameters",
            f"  engines    {engines}; {i.moe_token_dispatcher_type} dispatcher",
            f"  routing    {_routing(i)}"]


def _routing(i: P.PlanInput) -> str:
    """The routed slots the plan gives the busiest EP rank, and why."""
    from zo_megatron.planner.moe import routed_slots

    slots, balanced = routed_slots(i), routed_slots(i.replace(moe_routing_imbalance=1.0,
                                                                moe_expert_capacity_factor=None,
                                                                moe_pad_expert_input_to_capacity=False))
    c = i.moe_expert_capacity_factor
    why = ("padded to capacity" if i.moe_pad_expert_input_to_capacity else
           f"imbalance {i.moe_routing_imbalance:g} (--moe-routing-imbalance)" if i.moe_routing_imbalance > 1 else
           "balanced (the aux loss's aim; --moe-routing-imbalance plans a busier rank)")
    if c is not None and c >= 0:
        why += f", capacity factor {c:g}"
    return f"{slots:,} token slots per MoE layer and micro-batch on the busiest EP rank ({slots / balanced:.2f}x " \
           f"balanced: {why})"


def print_plan(p: P.Plan, title: str = "zo_megatron memory plan", overlap_reason: str | None = None) -> None:
    i = p.input
    rc = i.normalized_recompute() or "off"
    if rc == "full" and (i.recompute_method, i.recompute_num_layers) != ("uniform", 1):
        rc = f"full ({i.recompute_method} {i.recompute_num_layers})"
    elif rc == "selective":
        rc = f"selective ({' '.join(m for m in RECOMPUTE_MODULES if m in i.selective_modules()) or 'nothing'})"
    print(title)
    heads = (f"q/k head dim {i.qk_head_dim}+{i.qk_pos_emb_head_dim}, v head dim {i.v_head_dim}"
             if i.multi_latent_attention else f"head dim {i.head_dim()}")
    print(f"  model      GPT {i.num_layers} layers x {i.hidden_size} hidden x "
          f"{i.num_attention_heads} heads ({heads}), ffn {i.ffn()}, seq {i.seq_length}, "
          f"vocab {i.vocab_size} -> {p.vocab_size_padded} (padded)")
    print(f"  architecture: {i.architecture_name()}")
    print(f"  params     {P.format_params(p.params_total)} total; per TP rank "
          f"{P.format_params(p.params_per_tp_rank)} ({p.replicated_params_per_tp_rank:,} replicated)")
    for line in moe_lines(p):
        print(line)
    print(f"  parallel   TP {i.tensor_parallel} x DP {i.data_parallel} = {p.world_size} ranks on "
          f"{p.num_nodes} node(s), {p.ranks_per_node} per node"
          + (f"; EP {i.expert_parallel} x expert TP {i.expert_tp()} x expert DP {i.expert_data_parallel()}"
             if i.num_experts is not None else ""))
    print(f"  training   {i.precision}, micro-batch {i.micro_batch_size}, grad accumulation "
          f"{i.grad_accum_steps}, recompute {rc}, ZeRO-Offload {'on' if i.zero_offload else 'off'}, "
          f"DPU {'on' if i.dpu else 'off'}, bucket {i.bucket_size:,} elements, optimizer states "
          f"{'bf16' if i.bf16_optimizer_states else 'fp32'}"
          + (f", {i.optimizer_offload_fraction:.0%} of the optimizer on the host"
             if i.zero_offload and i.optimizer_offload_fraction < 1 else ""))
    print(f"  CPU step   {_cpu_step_line(p)}")
    if overlap_reason:
        print(f"  overlap    {overlap_reason}")
    sdpa = "torch SDPA" + (" (multi-latent attention" + (", value heads padded to the q/k head dim on a CPU)"
                                                         if i.device_is_host and i.qk_dim() != i.v_dim() else ")")
                           if i.multi_latent_attention else " (--use-flash-attn)")
    print(f"  attention  {sdpa if i.attention_backend == 'sdpa' else 'local (s x s scores)'}"
          f", sequence parallel {'on' if i.sp() else 'off'}")
    print(f"  hardware   {P.format_bytes(i.gpu_memory_bytes)} per GPU, "
          f"{P.format_bytes(i.host_memory_bytes_per_node)} host per node"
          + (" (the device is the host: unified)" if i.device_is_host else ""))
    print()
    print(f"  {'device, per GPU':<40}{'GiB':>10}")
    for k, v in p.device_items.items():
        print(f"    {k:<38}{_g(v)}")
    print(f"    {'TOTAL':<38}{_g(p.device_bytes_per_gpu)}   of {P.format_bytes(i.gpu_memory_bytes)}")
    print(f"  {'host, per node (' + str(p.ranks_per_node) + ' ranks)':<40}{'GiB':>10}")
    for k, v in p.host_items.items():
        print(f"    {k:<38}{_g(v)}")
    print(f"    {'TOTAL':<38}{_g(p.host_bytes_per_node)}   of "
          f"{P.format_bytes(i.host_memory_bytes_per_node)}")
    print()
    print(f"  verdict: {'FITS' if p.fits else 'DOES NOT FIT'}")
    for r in p.reasons:
        print(f"    - {r}")
    for w in p.warnings:
        print(f"    ! {w}")
    if p.suggestions:
        print("  suggestions:")
        for s in p.suggestions:
            print(f"    * {s}")


def plan_dict(p: P.Plan, info: dict) -> dict:
    """Plan.to_dict() with the job's resolutions beside `fits` (overlap_speculated_fraction, 0 to 1)."""
    d = {}
    for k, v in p.to_dict().items():
        d[k] = v
        if k == "fits":
            d.update(info)
    return d


def run_paper_check(as_json: bool) -> int:
    checks = P.paper_checks()
    base = P.baseline_maxima()
    ours = P.our_maxima()
    ok = all(r["ok"] for r in checks) and all(r["meets_goal"] for r in ours)
    if as_json:
        print(json.dumps({"ok": ok, "fits": ok, "paper_checks": checks, "baseline_maxima": base,
                          "our_maxima": ours}, indent=2))
        return 0 if ok else 1
    print("ZeRO-Offload paper reference points (seq 1024, vocab 50257 padded, fp16, full recompute;")
    print("13B = 65x4096x32 heads, 15B = 78x4096x32, 70B = 69x9216x96; V100 = 31.75 GiB, 1.5 TiB host)")
    print(f"  {'case':<40}{'params':>8}  {'expect':<6}  {'planner':<7}  {'device/GPU':>12}  "
          f"{'host/node':>12}  check  paper")
    for r in checks:
        print(f"  {r['name']:<40}{P.format_params(r['params']):>8}  "
              f"{'fits' if r['expected_fits'] else 'no':<6}  {'fits' if r['fits'] else 'no':<7}  "
              f"{P.format_bytes(r['device_bytes_per_gpu']):>12}  "
              f"{P.format_bytes(r['host_bytes_per_node']):>12}  {'ok' if r['ok'] else 'FAIL':<5}  "
              f"{r['paper']}")
    print()
    print("Largest models WITHOUT ZeRO-Offload (planner; for comparison with the paper)")
    for r in base:
        s = r["shape"]
        print(f"  {r['name']:<52} {P.format_params(r['max_params']):>8}  "
              f"({s['num_layers']} layers)  {r['paper']}")
    print()
    print("Our maxima: ZeRO-Offload + full recompute + bf16 optimizer states, fp16, micro-batch 1, "
          "seq 1024")
    for r in ours:
        s = r["shape"]
        print(f"  {r['name']:<48} {P.format_params(r['max_params']):>8}  ({s['num_layers']} layers; "
              f"device {P.format_bytes(r['device_bytes_per_gpu'])}/GPU, host "
              f"{P.format_bytes(r['host_bytes_per_node'])}/node; limited by {r['limited_by']})  "
              f"goal >= {P.format_params(r['goal'])}: {'met' if r['meets_goal'] else 'NOT MET'}")
    print()
    print("all reference points and goals hold" if ok else "SOME CHECKS FAILED")
    return 0 if ok else 1


def main(argv=None) -> int:
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        if args.paper_check:
            return run_paper_check(args.json)
        inp = build_input(args, parser)
        if args.max_model:
            max_params, shape, best_inp = max_model(inp, args)
            resolved, info = resolve(best_inp, args)     # auto resolved on the largest model
            best = P.plan(resolved)
            if args.json:
                d = plan_dict(best, info)
                d.update(max_params=max_params, max_shape=shape, family=args.max_model)
                print(json.dumps(d, indent=2))
            else:
                if shape:
                    print(f"largest model ({args.max_model} family): {P.format_params(max_params)} "
                          f"= {shape['num_layers']} layers x {shape['hidden_size']} hidden x "
                          f"{shape['num_attention_heads']} heads\n")
                    print_plan(best, "plan for that model", info["overlap_reason"])
                else:
                    print(f"no model of the {args.max_model} family fits; the smallest:\n")
                    print_plan(best, "plan for the smallest model", info["overlap_reason"])
            return 0 if max_params > 0 else 1
        resolved, info = resolve(inp, args)
        p = P.plan(resolved)
        if args.json:
            print(json.dumps(plan_dict(p, info), indent=2))
        else:
            print_plan(p, overlap_reason=info["overlap_reason"])
        return 0 if p.fits else 1
    except (BadInput, ValueError) as exc:
        msg = str(exc).splitlines()[0] if str(exc) else repr(exc)
        print(f"{PROG}: error: {msg}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
