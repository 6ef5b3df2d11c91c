#!/usr/bin/env python
"""Will my model fit? Device memory per GPU and host memory per node for a zo_megatron job.

    python tools/estimate_memory.py --preset dgx2 --model 70b --tensor-model-parallel-size 16 \
        --zero-offload --micro-batch-size 8 --recompute-granularity full
    python tools/estimate_memory.py --preset v100-32gb --hidden-size 4096 --num-attention-heads 32 \
        --zero-offload --recompute-granularity full --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16 --max-model layers
    python tools/estimate_memory.py --preset h100-80gb --model llama3-8b --seq-length 8192 --zero-offload \
        --use-flash-attn --sequence-parallel --tensor-model-parallel-size 8
    python tools/estimate_memory.py --num-layers 80 --hidden-size 8192 --num-attention-heads 64 \
        --ffn-hidden-size 28672 --vocab-size 128256 --swiglu --group-query-attention --num-query-groups 8 \
        --position-embedding-type rope --normalization RMSNorm --disable-bias-linear \
        --untie-embeddings-and-output-weights          # Llama-3-70B by hand: the job's architecture flags
    python tools/estimate_memory.py --paper-check

Model, architecture, batch and training flags are pretrain_gpt.py's, with its defaults (the
architecture: GPT-2 unless its flags say otherwise; the output names the architecture planned) (no --zero-offload: the DDP
baseline; dropout 0; the model's unfused fp32 softmax, or torch SDPA with --use-flash-attn), and the input is built by the same function
as the job's pre-launch check (planner.plan_input_from_flags), so both give the same plan.
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
from zo_megatron.errors import ConfigError  # noqa: E402
from zo_megatron.training.arguments import (  # noqa: E402
    add_architecture_flags, add_attention_flags, architecture_kwargs, check_attention_flags)

PROG = "estimate_memory.py"


class BadInput(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2 (argparse prints usage + message otherwise)
        raise BadInput(message)


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(prog=PROG, description=__doc__.split("\n\n")[0],
                 formatter_class=argparse.RawDescriptionHelpFormatter)
    g = ap.add_argument_group("model")
    g.add_argument("--model", choices=list(P.MODEL_PRESETS),
                   help="model preset: shape, and for llama3-8b, llama3-70b, qwen2-7b also vocabulary and "
                        "architecture (explicit flags override it)")
    g.add_argument("--num-layers", type=int)
    g.add_argument("--hidden-size", type=int)
    g.add_argument("--num-attention-heads", type=int)
    g.add_argument("--seq-length", type=int, default=1024)
    g.add_argument("--max-position-embeddings", type=int)
    g.add_argument("--ffn-hidden-size", type=int,
                   help="MLP size (default 4 x hidden; int(4h x 2/3 / 64) x 64 with --swiglu)")
    g.add_argument("--vocab-size", type=int, help="tokenizer vocabulary (default: the preset's, else GPT-2's 50257)")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    g.add_argument("--attention-dropout", type=float, default=0.0)
    g.add_argument("--hidden-dropout", type=float, default=0.0)
    g = ap.add_argument_group("architecture (pretrain_gpt.py's flags; default GPT-2: learned positions, LayerNorm, "
                              "GELU, biases, tied embeddings)")
    add_architecture_flags(g)

    g = ap.add_argument_group("attention and sequence parallelism (pretrain_gpt.py's flags)")
    add_attention_flags(g)

    g = ap.add_argument_group("parallelism and batch")
    g.add_argument("--tensor-model-parallel-size", "--tensor-parallel", dest="tensor_parallel", type=int, default=1)
    g.add_argument("--data-parallel-size", dest="dp", type=int)
    g.add_argument("--world-size", type=int, help="TP x DP (alternative to --data-parallel-size)")
    g.add_argument("--micro-batch-size", type=int, default=1)
    g.add_argument("--global-batch-size", type=int,
                   help="default: micro-batch x DP (no gradient accumulation)")

    g = ap.add_argument_group("training")
    prec = g.add_mutually_exclusive_group()
    prec.add_argument("--bf16", dest="precision", action="store_const", const="bf16")
    prec.add_argument("--fp16", dest="precision", action="store_const", const="fp16")
    prec.add_argument("--fp32", dest="precision", action="store_const", const="fp32")
    g.add_argument("--zero-offload", dest="zero_offload", action="store_true", default=False,
                   help="optimizer states and step on the host (as pretrain_gpt.py: off by default)")
    g.add_argument("--no-zero-offload", dest="zero_offload", action="store_false",
                   help="(default) baseline: DDP + Adam on the device (16 bytes/param)")
    g.add_argument("--dpu", action="store_true", help="delayed parameter update")
    g.add_argument("--dpu-weight-prediction", action="store_true",
                   help="with --dpu: the device copy extrapolated by the last update (+4 host bytes/param/DP)")
    g.add_argument("--recompute-activations", action="store_true", help="Megatron's shorthand for --recompute-granularity selective")
    g.add_argument("--recompute-granularity", choices=["full", "selective"])
    g.add_argument("--recompute-method", choices=["uniform", "block"],
                   help="with full: checkpoints of N layers (uniform, default) or only the first N layers (block)")
    g.add_argument("--recompute-num-layers", type=int, help="N for --recompute-method (default 1)")
    g.add_argument("--bucket-size", type=int, default=40_000_000, help="elements per gradient bucket")
    g.add_argument("--exp-avg-dtype", choices=["fp32", "bf16"], default="fp32",
                   help="dtype of Adam's first moment on the host (pretrain_gpt.py's flag)")
    g.add_argument("--exp-avg-sq-dtype", choices=["fp32", "bf16"], default="fp32",
                   help="dtype of Adam's second moment on the host (must match --exp-avg-dtype)")
    g.add_argument("--bf16-optimizer-states", action="store_true", help=argparse.SUPPRESS)  # old name
    g.add_argument("--accumulate-allreduce-grads-in-fp32", action=argparse.BooleanOptionalAction, default=None,
                   help="fp32 gradient buckets + reduce-scatter (default: on for bf16, as pretrain_gpt.py)")
    g.add_argument("--main-grads-dtype", choices=["fp32", "bf16", "fp16"],
                   help="dtype of the gradients copied to the host (default: the parameter dtype)")
    g.add_argument("--accumulate-grads-on-host", action="store_true",
                   help="fp32 host gradient accumulator instead of 16-bit device gradients across micro-batches")

    g = ap.add_argument_group("hardware")
    g.add_argument("--preset", choices=list(P.HARDWARE_PRESETS),
                   help="; ".join(f"{k}: {v['description']}" for k, v in P.HARDWARE_PRESETS.items()))
    g.add_argument("--gpu-memory-gb", type=float, help="GiB per GPU")
    g.add_argument("--host-memory-gb", type=float, help="GiB of host RAM per node")
    g.add_argument("--gpus-per-node", type=int)
    g.add_argument("--device-overhead-gb", type=float, help="CUDA context etc. per GPU (default 1)")
    g.add_argument("--host-overhead-gb", type=float, help="per process on the host (default 3)")
    g.add_argument("--host-reserve-gb", type=float, help="OS/page cache per node (default 32)")
    g.add_argument("--fragmentation", type=float, help="allocator margin on transient bytes (0.1)")

    g = ap.add_argument_group("output")
    g.add_argument("--json", action="store_true", help="print JSON instead of a table")
    g.add_argument("--max-model", choices=list(P.FAMILIES),
                   help="largest model that fits: 'layers' keeps hidden/heads and grows layers; "
                        "'hidden' keeps layers/heads and grows hidden in steps of lcm(128, heads)")
    g.add_argument("--paper-check", action="store_true",
                   help="the ZeRO-Offload paper's reference points and our maxima")
    return ap


def _gib(x: float | None) -> int | None:
    return None if x is None else int(round(x * P.GiB))


def _apply_preset(args, parser: argparse.ArgumentParser) -> dict:
    """The preset's fields where the command line left the flag at its default; returns the shape."""
    preset = P.model_preset(args.model) if args.model else {}
    shape = {k: preset.pop(k) for k in ("num_layers", "hidden_size", "num_attention_heads") if k in preset}
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
    if args.vocab_size is None:
        args.vocab_size = 50257
    return shape


def build_input(args, parser: argparse.ArgumentParser | None = None) -> P.PlanInput:
    shape = _apply_preset(args, parser or build_parser())
    for key in ("num_layers", "hidden_size", "num_attention_heads"):
        if getattr(args, key) is not None:
            shape[key] = getattr(args, key)
    if args.max_model == "layers":
        shape.setdefault("num_layers", 1)
    if args.max_model == "hidden" and "num_attention_heads" in shape:
        shape.setdefault("hidden_size", math.lcm(128, shape["num_attention_heads"]))
    missing = [k for k in ("num_layers", "hidden_size", "num_attention_heads") if k not in shape]
    if missing:
        raise BadInput("give --model or --" + ", --".join(m.replace("_", "-") for m in missing))
    for key, value in shape.items():
        setattr(args, key, value)
    try:
        architecture_kwargs(args)     # the job's own refusals (e.g. --window-size)
        check_attention_flags(args)   # -> args.core_attention; SP off at TP 1 (with the job's warning)
    except ConfigError as e:
        raise BadInput(str(e)) from None

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
    if args.bf16_optimizer_states:
        args.exp_avg_dtype = args.exp_avg_sq_dtype = "bf16"
    if args.exp_avg_dtype != args.exp_avg_sq_dtype:
        raise BadInput("--exp-avg-dtype and --exp-avg-sq-dtype must match")
    if args.micro_batch_size < 1 or dp < 1:
        raise BadInput("--micro-batch-size and the data parallel size must be >= 1")
    inp = P.plan_input_from_flags(args, data_parallel=dp, vocab_size=args.vocab_size)
    if args.preset:
        inp = P.apply_hardware_preset(inp, args.preset, keep_precision=args.precision is not None)
    overrides = {
        "precision": args.precision,
        "gpu_memory_bytes": _gib(args.gpu_memory_gb),
        "host_memory_bytes_per_node": _gib(args.host_memory_gb),
        "gpus_per_node": args.gpus_per_node,
        "device_overhead_bytes": _gib(args.device_overhead_gb),
        "host_overhead_bytes_per_rank": _gib(args.host_overhead_gb),
        "host_reserve_bytes": _gib(args.host_reserve_gb),
        "fragmentation": args.fragmentation,
    }
    inp = inp.replace(**{k: v for k, v in overrides.items() if v is not None})
    if args.preset == "cpu" and args.gpus_per_node is None:
        inp = inp.replace(gpus_per_node=None)
    inp.validate()
    return inp


# ------------------------------------------------------------------------------------------------
# printing

def _g(n) -> str:
    return f"{n / P.GiB:10,.2f}"


def print_plan(p: P.Plan, title: str = "zo_megatron memory plan") -> None:
    i = p.input
    rc = i.normalized_recompute() or "off"
    if rc == "full" and (i.recompute_method, i.recompute_num_layers) != ("uniform", 1):
        rc = f"full ({i.recompute_method} {i.recompute_num_layers})"
    print(title)
    print(f"  model      GPT {i.num_layers} layers x {i.hidden_size} hidden x "
          f"{i.num_attention_heads} heads (head dim {i.head_dim()}), ffn {i.ffn()}, seq {i.seq_length}, "
          f"vocab {i.vocab_size} -> {p.vocab_size_padded} (padded)")
    print(f"  architecture: {i.architecture_name()}")
    print(f"  params     {P.format_params(p.params_total)} total; per TP rank "
          f"{P.format_params(p.params_per_tp_rank)} ({p.replicated_params_per_tp_rank:,} replicated)")
    print(f"  parallel   TP {i.tensor_parallel} x DP {i.data_parallel} = {p.world_size} ranks on "
          f"{p.num_nodes} node(s), {p.ranks_per_node} per node")
    print(f"  training   {i.precision}, micro-batch {i.micro_batch_size}, grad accumulation "
          f"{i.grad_accum_steps}, recompute {rc}, ZeRO-Offload {'on' if i.zero_offload else 'off'}, "
          f"DPU {'on' if i.dpu else 'off'}, bucket {i.bucket_size:,} elements, optimizer states "
          f"{'bf16' if i.bf16_optimizer_states else 'fp32'}")
    print(f"  attention  {'torch SDPA (--use-flash-attn)' if i.attention_backend == 'sdpa' else 'local (s x s scores)'}"
          f", sequence parallel {'on' if i.sp() else 'off'}")
    print(f"  hardware   {P.format_bytes(i.gpu_memory_bytes)} per GPU, "
          f"{P.format_bytes(i.host_memory_bytes_per_node)} host per node")
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
            max_params, shape = P.max_model(inp, args.max_model)
            best = P.plan(inp.replace(**shape)) if shape else P.plan(inp.replace(
                **({"num_layers": 1} if args.max_model == "layers" else
                   {"hidden_size": math.lcm(128, inp.num_attention_heads)})))
            if args.json:
                d = best.to_dict()
                d.update(max_params=max_params, max_shape=shape, family=args.max_model)
                print(json.dumps(d, indent=2))
            else:
                if shape:
                    print(f"largest model ({args.max_model} family): {P.format_params(max_params)} "
                          f"= {shape['num_layers']} layers x {shape['hidden_size']} hidden x "
                          f"{shape['num_attention_heads']} heads\n")
                    print_plan(best, "plan for that model")
                else:
                    print(f"no model of the {args.max_model} family fits; the smallest:\n")
                    print_plan(best, "plan for the smallest model")
            return 0 if max_params > 0 else 1
        p = P.plan(inp)
        if args.json:
            print(json.dumps(p.to_dict(), indent=2))
        else:
            print_plan(p)
        return 0 if p.fits else 1
    except (BadInput, ValueError) as exc:
        msg = str(exc).splitlines()[0] if str(exc) else repr(exc)
        print(f"{PROG}: error: {msg}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
