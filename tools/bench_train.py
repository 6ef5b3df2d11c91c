#!/usr/bin/env python
"""Side-by-side training-step benchmark: zo_megatron vs DeepSpeed ZeRO-Offload vs plain torch.

    python tools/bench_train.py                                   # the full table (slow on a CPU)
    python tools/bench_train.py --worlds 1,dp2 --precision fp32 --steps 10 --json out.json
    python tools/bench_train.py --regime optimizer-bound --worlds 1 --precision fp32
    python tools/bench_train.py --sweep --json sweep.json         # step time / host memory vs size

One command, one table. For a GPT shape and each world (TP x DP) it runs, interleaved in the same
processes, the variants:

  zo_offload         zo_megatron's TP GPT + ZeroOffloadEngine (--zero-offload: fp32 master and
                     Adam on the host, ONE CPU Adam kernel call per step), with the CPU-step
                     schedule the job would pick here (job_default_schedule: on CUDA the bounded
                     --overlap-cpu-step auto, on a CPU the synchronous step)
  zo_offload_f0.5    the same with optimizer_offload_fraction=0.5 (--optimizer-offload-fraction
                     0.5: half of each rank's partition is updated on the device by fused AdamW)
  zo_baseline        the same TP GPT + zo_megatron's own non-offload baseline (PlainDDPOptimizer:
                     fp32 weights, gradient all-reduce, torch AdamW(fused=True) on the device)
  torch_ddp          HF transformers GPT2LMHeadModel + torch DDP + AdamW(fused=True)
  deepspeed_offload  the same HF model under DeepSpeed ZeRO stage 2 with
                     "offload_optimizer": {"device": "cpu"} (DeepSpeedCPUAdam), when `deepspeed`
                     imports (otherwise the row says skipped and why)

and, when named in --variants, the other schedules of the CPU step (offload/schedules.py):

  zo_offload_overlap zo_offload with --overlap-cpu-step (per-bucket CPU Adam during backward,
                     speculated and validated: the same losses as zo_offload, bit for bit)
  zo_offload_dpu     zo_offload with --dpu from the first update (W=1: one update stale, so its
                     loss is not compared; it is flushed before the evaluation loss)
  zo_offload_dpu_predict  zo_offload_dpu with --dpu-corrector weight-prediction (the kernel writes
                     the extrapolated copy: its step time against zo_offload_dpu is the corrector's cost)

`--split-cores` (one rank, >= 2 CPUs): the rank's main thread -- forward, backward, everything
torch does, with ONE intra-op thread -- is pinned to CPU 0 and the CPU Adam (ONE thread, on the
schedule's worker under overlap/DPU, inline in step() otherwise) to CPU 1, so the "device" and
the CPU optimizer are two separate resources as on a GPU machine (docs/overlap.md has the
command). `--timeline FILE` writes each variant's phases as `--timeline` JSON lines
(FILE.<variant>) and draws them with tools/plot_timeline.py (FILE.<variant>.png).

Fairness: every variant starts from the same weights (zo_megatron's layout-independent init,
mapped to HF names with zo_megatron/checkpoint/hf/gpt2.py), sees the same batches (Zipf-distributed
tokens, which the model learns in its first steps, one stream per DP rank), clips the global gradient norm at --clip-grad (1.0) and uses the same AdamW
(betas 0.9/0.95, eps 1e-8, weight decay 0.1 on matrices only, the same lr). After the steps each
variant's loss on a fixed held-out batch is reported (`loss_after`), and its change since before
the steps is checked against the group's median change (check_losses, tools/bench_loss_check.py):
within 2% in fp32 (and loss_after within 1e-4), within 20% in bf16, where each engine runs its own
mixed-precision scheme (ours: bf16 weights; DDP / zo_baseline: autocast; DeepSpeed: bf16 module
with fp32 master); so is the norm of its parameters' change over the matrices and over the vectors
(`update_norm_matrices`, `update_norm_vectors`; 1e-3 in fp32, 3% / 10% in bf16). A variant that
does not update, updates only half of the model or skips its biases fails; so does a run whose
steps do not move the loss visibly (INCONCLUSIVE).

Worlds: `1`, `dp2`, `tp2`, `tp2dp2` (or `tpXdpY`), one process per rank, spawned by this tool
(torch.multiprocessing, gloo on 127.0.0.1 / NCCL for CUDA tensors). HF transformers' GPT-2 has
no tensor parallelism: in a world with TP > 1 the HF variants (torch_ddp, deepspeed_offload) run
as pure DP over the same ranks (DP = TP x DP), every rank on its own micro-batch: the rows say
`tp=1, dp=<ranks>`, their tokens per step are TP times ours, so compare tokens/s, not step time,
and their loss is not comparable (another global batch: `loss_check` says n/a). Threads per rank
= CPUs / ranks; more ranks than CPUs is oversubscribed, and the output says so.

Regimes (`--regime compute-bound|optimizer-bound|both`): compute-bound = seq 256, micro-batch 4
(forward/backward dominate); optimizer-bound = seq 32, micro-batch 1 (the optimizer step and the
communication dominate: the regime fast GPUs live in). Default GPT: 6 layers x 512 hidden, 8
heads, vocab 50257 (44.8M parameters).

Reported per variant (table + `--json FILE`, rows keyed `variant`): `tp`, `dp`, `precision`,
`median_step_s` (+ min/max, the world's step = its slowest rank's), `tokens_per_s`,
`model_tflops` (Megatron-LM's FLOP count per step, as the training log's TFLOP/s), `ratio_to_zo_offload`, `comm_bytes_per_rank`
(bytes a rank sends per step in the ring model: the engines' own accounting for zo_megatron,
the algorithm's volume for DDP's all-reduce and DeepSpeed's reduce-scatter + all-gather; DP
traffic only: megatron-core's TP activation all-reduces are not counted),
`device_state_bytes` / `host_state_bytes` (model states: params, grads, master, moments), the
per-phase medians, `engine_overhead_s` (step minus forward and backward), `loss_after`, and the
load average during the run. Phases: zo_offload: forward, backward (loss.backward with the
bucket hooks: async reduce-scatters are issued here), grad_sync (the wait for the reduce-scatters
and the shards' copy home: on a CPU the two are one wait), grad_norm (+ clip agreement), cpu_adam
(ONE kernel call), param_return (host->device + all-gather); the others: forward, backward (DDP:
its all-reduce hides inside; DeepSpeed: its gradient reduce and copy to the CPU), optimizer.
A PNG bar chart of the step times is written next to the JSON (or to --plot).

`--sweep` runs zo_offload and deepspeed_offload at one rank, fp32, optimizer-bound shape, over
model sizes from ~10M parameters to the largest whose estimated host footprint fits this
machine's available memory, each in a fresh process, and plots step time and host memory (RSS
after the steps; the peak, setup included, is in the JSON) against parameters (PNG + JSON).

The tool is in parts (issue 36): bench_train_common (constants, machine probes), bench_train_variants
(the engines of one rank), bench_train_runner (one world's ranks and their timed steps) and
bench_train_report (rows, table, JSON, charts); this script parses the command line and composes them.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _path in (REPO, os.path.join(REPO, "tools")):
    if _path not in sys.path:
        sys.path.insert(0, _path)

# the loss check's names stay importable from here (tests/test_bench_loss_check.py)
from bench_loss_check import (BF16_RTOL, CHANGE_RTOL, FP32_RTOL, UPDATE_GROUPS, VISIBLE,  # noqa: E402,F401
                              check_losses, update_sums)
from bench_train_common import (REGIMES, SCHEDULE_VARIANTS, SWEEP_SHAPES, VARIANTS, cpu_count,  # noqa: E402
                                deepspeed_status, gpt_params, mem_available, world_name)
from bench_train_report import (finish, print_header, print_sweep_header, print_sweep_point,  # noqa: E402
                                print_table, print_world_header, summarize, write_sweep)
from bench_train_runner import run_sweep_point, run_world  # noqa: E402


# ------------------------------------------------------------------------------------------------
# arguments

def _parse_world(text: str) -> tuple[int, int]:
    """'1' -> (1, 1); 'dp2' -> (1, 2); 'tp2' -> (2, 1); 'tp2dp2' -> (2, 2)."""
    t = text.strip().lower()
    if t == "1":
        return 1, 1
    tp = dp = 1
    rest = t
    if rest.startswith("tp"):
        num = ""
        rest = rest[2:]
        while rest and rest[0].isdigit():
            num, rest = num + rest[0], rest[1:]
        if not num:
            raise ValueError(text)
        tp = int(num)
    if rest.startswith("dp") and rest[2:].isdigit():
        dp = int(rest[2:])
        rest = ""
    if rest or tp < 1 or dp < 1:
        raise ValueError(text)
    return tp, dp


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worlds", default="1,dp2,tp2,tp2dp2", help="comma-separated: 1, dpN, tpN, tpNdpM")
    p.add_argument("--precision", default="bf16,fp32", help="comma-separated: bf16, fp32")
    p.add_argument("--regime", default="both", choices=("compute-bound", "optimizer-bound", "both"))
    p.add_argument("--steps", type=int, default=10, help="timed steps per variant (interleaved)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per variant first")
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help="comma-separated subset of " + ", ".join(VARIANTS + SCHEDULE_VARIANTS))
    p.add_argument("--split-cores", action="store_true",
                   help="one rank: main thread (torch, 1 intra-op thread) on CPU 0, CPU Adam (1 thread) on CPU 1")
    p.add_argument("--timeline", metavar="FILE", help="write each variant's phases (FILE.<variant>) and a PNG of them")
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--seq", type=int, default=None, help="override the regime's sequence length")
    p.add_argument("--micro-batch", type=int, default=None, help="override the regime's sequences per rank")
    p.add_argument("--bucket-size", type=int, default=40_000_000, help="zo_megatron gradient bucket (elements)")
    p.add_argument("--use-flash-attn", action="store_true",
                   help="zo_megatron variants: core attention through torch SDPA (no s x s activations)")
    p.add_argument("--sequence-parallel", action="store_true",
                   help="zo_megatron variants at TP > 1: megatron-core sequence parallelism (norm/dropout "
                        "activations split over TP)")
    p.add_argument("--lr", type=float, default=2e-3,
                   help="AdamW lr of every variant; the loss check needs the steps to move the held-out loss "
                        "visibly (at 1e-4 a missed update of biases and norms went unseen)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--clip-grad", type=float, default=1.0,
                   help="global grad-norm clip of every variant (0: none; with zo_offload_overlap a step that "
                        "clips is rolled back and redone, one that does not is committed)")
    p.add_argument("--threads", type=int, default=0, help="threads per rank (default: CPUs / ranks)")
    p.add_argument("--sweep", action="store_true", help="scaling sweep of zo_offload and deepspeed_offload")
    p.add_argument("--sweep-max-params", type=float, default=0,
                   help="--sweep: largest model (parameters; default: what fits the available memory)")
    p.add_argument("--json", metavar="FILE", help="write the rows as JSON")
    p.add_argument("--plot", metavar="PNG", help="bar chart (default: the --json path with .png)")
    args = p.parse_args(argv)
    try:
        args.world_list = [_parse_world(w) for w in args.worlds.split(",") if w.strip()]
    except ValueError as e:
        p.error(f"--worlds: cannot read {e.args[0]!r}; use 1, dpN, tpN or tpNdpM (e.g. --worlds 1,dp2,tp2,tp2dp2)")
    args.precisions = [x.strip() for x in args.precision.split(",") if x.strip()]
    bad = [x for x in args.precisions if x not in ("bf16", "fp32")]
    if bad or not args.precisions:
        p.error(f"--precision: {','.join(bad) or 'empty'} not understood; use bf16, fp32 or bf16,fp32")
    args.variant_list = [x.strip() for x in args.variants.split(",") if x.strip()]
    bad = [x for x in args.variant_list if x not in VARIANTS + SCHEDULE_VARIANTS]
    if bad or not args.variant_list:
        p.error(f"--variants: unknown {','.join(bad) or 'empty'}; choose from {', '.join(VARIANTS + SCHEDULE_VARIANTS)}")
    if args.split_cores and (args.world_list != [(1, 1)] or cpu_count() < 2):
        p.error("--split-cores needs --worlds 1 and at least 2 CPUs (one for torch, one for the CPU Adam)")
    args.regimes = list(REGIMES) if args.regime == "both" else [args.regime]
    if args.steps < 1 or args.warmup < 0:
        p.error("--steps must be >= 1 and --warmup >= 0")
    if args.hidden % args.heads:
        p.error(f"--hidden {args.hidden} is not divisible by --heads {args.heads}")
    for tp, dp in args.world_list:
        if args.heads % tp:
            p.error(f"world {world_name(tp, dp)}: --heads {args.heads} is not divisible by TP={tp}")
    return args



# ------------------------------------------------------------------------------------------------
# composing the parts

def main(argv=None) -> int:
    args = parse_args(argv)
    if args.sweep:
        return sweep_main(args)
    cpus = cpu_count()
    ds_ok, ds_info = deepspeed_status()
    import torch

    cuda = torch.cuda.is_available()
    if cuda:
        need = max(tp * dp for tp, dp in args.world_list)
        if torch.cuda.device_count() < need:
            print(f"error: world with {need} ranks needs {need} GPUs (one rank per GPU) but CUDA sees "
                  f"{torch.cuda.device_count()}; choose smaller --worlds, or hide CUDA "
                  f"(CUDA_VISIBLE_DEVICES=) to benchmark the CPU/gloo worlds", file=sys.stderr)
            return 2
    print_header(args, cpus, cuda, ds_ok, ds_info)
    all_rows, load_samples = [], [os.getloadavg()]
    t_start = time.perf_counter()
    for regime in args.regimes:
        for prec in args.precisions:
            for tp, dp in args.world_list:
                print_world_header(args, regime, prec, tp, dp, cpus, cuda)
                job = dict(args=args, tp=tp, dp=dp, precision=prec, regime=regime, variants=args.variant_list)
                load_samples.append(os.getloadavg())
                res = run_world(job)
                load_samples.append(os.getloadavg())
                rows = summarize(res, args, cpus)
                print_table(rows)
                all_rows.extend(rows)
    return finish(args, all_rows, load_samples, time.perf_counter() - t_start, cpus, ds_ok, ds_info)


def sweep_main(args) -> int:
    """--sweep: cost against model size."""
    cpus = cpu_count()
    ds_ok, ds_info = deepspeed_status()
    seq, mb = REGIMES["optimizer-bound"]["seq"], REGIMES["optimizer-bound"]["micro_batch"]
    avail = mem_available()
    # both engines' host footprint is ~16-20 B/param + the model; 40 B/param leaves headroom
    limit = args.sweep_max_params or avail / 40
    shapes = [s for s in SWEEP_SHAPES if gpt_params(s[0], s[1], args.vocab, seq) <= limit]
    variants = ["zo_offload"] + (["deepspeed_offload"] if ds_ok else [])
    print_sweep_header(variants, seq, mb, avail, limit, ds_ok, ds_info)
    points = []
    for layers, hidden, heads in shapes:
        for v in variants:
            points.append(run_sweep_point(args, layers, hidden, heads, v, seq, mb))
            print_sweep_point(points[-1])
    write_sweep(args, points, cpus, avail)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit(130)
