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

`--split-cores` (one rank, >= 2 CPUs): the rank's main thread -- forward, backward, everything
torch does, with ONE intra-op thread -- is pinned to CPU 0 and the CPU Adam (ONE thread, on the
schedule's worker under overlap/DPU, inline in step() otherwise) to CPU 1, so the "device" and
the CPU optimizer are two separate resources as on a GPU machine (docs/overlap.md has the
command). `--timeline FILE` writes each variant's phases as `--timeline` JSON lines
(FILE.<variant>) and draws them with tools/plot_timeline.py (FILE.<variant>.png).

Fairness: every variant starts from the same weights (zo_megatron's layout-independent init,
mapped to HF names with zo_megatron/checkpoint/hf/gpt2.py), sees the same batches (random tokens,
one stream per DP rank), clips the global gradient norm at --clip-grad (1.0) and uses the same AdamW
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
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _path in (REPO, os.path.join(REPO, "tools")):
    if _path not in sys.path:
        sys.path.insert(0, _path)

from bench_loss_check import (BF16_RTOL, CHANGE_RTOL, FP32_RTOL, UPDATE_GROUPS, VISIBLE,  # noqa: E402,F401
                              check_losses, update_sums)

VARIANTS = ("zo_offload", "zo_offload_f0.5", "zo_baseline", "torch_ddp", "deepspeed_offload")
# The CPU-step schedules (docs/overlap.md), on request: --variants zo_offload,zo_offload_overlap,zo_offload_dpu
SCHEDULE_VARIANTS = ("zo_offload_overlap", "zo_offload_dpu")
HF_VARIANTS = ("torch_ddp", "deepspeed_offload")
REGIMES = {"compute-bound": dict(seq=256, micro_batch=4), "optimizer-bound": dict(seq=32, micro_batch=1)}
BETAS, EPS, WD = (0.9, 0.95), 1e-8, 0.1
# (layers, hidden, heads) for --sweep: ~10M .. ~1.3B parameters (vocab 50257)
SWEEP_SHAPES = ((2, 128, 4), (6, 512, 8), (12, 768, 12), (24, 1024, 16), (24, 1536, 16), (24, 2048, 16))


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


def world_name(tp: int, dp: int) -> str:
    if tp == 1 and dp == 1:
        return "1"
    return (f"tp{tp}" if tp > 1 else "") + (f"dp{dp}" if dp > 1 else "")


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
    if args.split_cores and (args.world_list != [(1, 1)] or _cpus() < 2):
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
# small helpers

def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def _mem_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 << 30


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _median(xs):
    return statistics.median(xs) if xs else float("nan")


def gpt_params(layers: int, hidden: int, vocab: int, seq: int) -> int:
    """GPT-2 parameter count (tied embeddings, biases, 4h MLP)."""
    return vocab * hidden + seq * hidden + layers * (12 * hidden * hidden + 13 * hidden) + 2 * hidden


def deepspeed_status() -> tuple[bool, str]:
    """(importable, version or the reason it is not)."""
    if not _cuda_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")      # explicit: DeepSpeed's CPU accelerator
    try:
        import deepspeed
        return True, deepspeed.__version__
    except Exception as e:       # ImportError, or a broken install raising anything at import
        return False, f"deepspeed not importable ({type(e).__name__}: {str(e).splitlines()[0][:120]}); " \
                      "install it with `pip install deepspeed==0.19.8`"


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


# ------------------------------------------------------------------------------------------------
# one rank: the variants

class _Variant:
    """A model + optimizer as one engine runs them: step() returns the loss and fills phase times."""

    name = ""
    hf = False

    def step(self, tokens, labels, times: dict) -> float:
        raise NotImplementedError

    def eval_loss(self, tokens, labels) -> float:
        raise NotImplementedError

    def info(self) -> dict:
        raise NotImplementedError

    def weighted_params(self) -> list:
        """(parameter the forward uses, what this rank's copy counts for) pairs: summed over the
        ranks, each parameter of the model counts once (the update check's norms)."""
        raise NotImplementedError

    def close(self) -> None:
        pass


def _hf_loss(logits, labels):
    import torch

    return torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1))


def _decay_groups(params_named):
    params_named = list(params_named)          # named_parameters() is a generator: read it once
    decay = [p for _, p in params_named if p.dim() > 1]
    no_decay = [p for _, p in params_named if p.dim() <= 1]
    return [{"params": decay, "weight_decay": WD}, {"params": no_decay, "weight_decay": 0.0}]


class _ZoVariant(_Variant):
    """zo_megatron's TP GPT driven by a TrainingOptimizer (the offload engine or the baseline)."""

    def __init__(self, name, ctx, offload: bool, fraction: float = 1.0, schedule: dict | None = None):
        from zo_megatron.model import build_gpt_model
        from zo_megatron.optimizer_api import AdamConfig

        self.name, self.ctx, self.offload = name, ctx, offload
        ps, cfg, a = ctx.ps, ctx.cfg, ctx.args
        adam = AdamConfig(lr=a.lr, beta1=BETAS[0], beta2=BETAS[1], eps=EPS, weight_decay=WD)
        if offload:
            from zo_megatron.offload.engine import ZeroOffloadEngine

            self.model = build_gpt_model(cfg, ps.tp_rank, ps.tp_size, a.seed)
            self.opt = ZeroOffloadEngine(self.model, precision=cfg.precision, adam=adam, clip_grad=a.clip_grad,
                                         bucket_size=a.bucket_size, dp_group=ps.dp_group, tp_rank=ps.tp_rank,
                                         device=ps.device, optimizer_offload_fraction=fraction,
                                         tp_group=ps.tp_group, **(schedule or {}))
            worker = self.opt.schedule.worker
            if a.split_cores and worker is not None:     # the CPU Adam's own core
                worker.submit(os.sched_setaffinity, 0, {_split_cpus()[1]}).result()
        else:
            from zo_megatron.training.plain_optimizer import PlainDDPOptimizer

            self.model = build_gpt_model(cfg.__class__(**{**cfg.__dict__, "precision": "fp32"}), ps.tp_rank,
                                         ps.tp_size, a.seed, device=ps.device)
            self.opt = PlainDDPOptimizer(self.model, precision=cfg.precision, adam=adam, clip_grad=a.clip_grad,
                                         dp_group=ps.dp_group, tp_rank=ps.tp_rank, tp_group=ps.tp_group)
        self.n_local = sum(p.numel() for p in self.model.parameters())
        self.phase_log: list[list] = []                    # per step: (phase, start, end), --timeline

    def step(self, tokens, labels, times):
        now, sync = time.perf_counter, self.ctx.sync
        self.opt.drain_phases()
        if hasattr(self.opt, "expect_lr"):
            self.opt.expect_lr(self.ctx.args.lr)
        m0 = time.monotonic()
        t0 = now()
        with self.opt.forward_context():
            loss = self.model.loss(tokens, labels)
        sync()
        t1, m1 = now(), time.monotonic()
        self.opt.backward(loss)
        sync()
        t2, m2 = now(), time.monotonic()
        res = self.opt.step(lr=self.ctx.args.lr)
        sync()
        t3 = now()
        assert not res.skipped, f"{self.name}: a step was skipped"
        times.update(forward=t1 - t0, backward=t2 - t1)
        if self.offload:
            ph = {}
            drained = self.opt.drain_phases()
            self.phase_log.append([("forward", m0, m1), ("backward", m1, m2)] + list(drained))
            for name, s, e in drained:
                ph[name] = ph.get(name, 0.0) + (e - s)
            times["grad_sync"] = ph.get("grad_sync", 0.0)
            # the CPU Adam on the critical path: the synchronous kernel, or the wait for the worker
            times["cpu_adam"] = ph.get("cpu_step", 0.0) if self.opt.schedule.worker is None else 0.0
            times["cpu_adam_wait"] = ph.get("cpu_step_wait", 0.0) + ph.get("cpu_step_rollback", 0.0) + (
                ph.get("cpu_step", 0.0) if self.opt.schedule.name == "speculative" else 0.0)   # a redo
            times["cpu_adam_off_path"] = ph.get("cpu_step_speculated", 0.0) + (
                ph.get("cpu_step", 0.0) if self.opt.schedule.name == "delayed" else 0.0)
            times["param_return"] = ph.get("param_return", 0.0)
            # the rest of step(): grad-norm pass + agreement, clip; with F < 1 also the device share's AdamW
            times["grad_norm"] = max(0.0, (t3 - t2) - times["grad_sync"] - times["cpu_adam"]
                                     - times["cpu_adam_wait"] - times["param_return"])
        else:
            times["optimizer"] = t3 - t2
        return loss.item()

    def eval_loss(self, tokens, labels):
        import torch

        self.opt.flush()                                   # DPU: the pending update belongs to the model
        with torch.no_grad(), self.opt.forward_context():
            return self.model.loss(tokens, labels).item()

    def weighted_params(self):
        # TP-split pieces are counted by their own TP rank, replicated ones by TP rank 0; DP replicas share
        ps = self.ctx.ps
        return [(p, (1.0 if getattr(p, "tensor_model_parallel", False) or ps.tp_rank == 0 else 0.0) / ps.dp_size)
                for p in self.model.parameters()]

    def info(self):
        acc = self.opt.accounting
        return dict(comm_bytes_per_rank=int(acc.sent_bytes), device_state_bytes=int(acc.device_model_state_bytes),
                    host_state_bytes=int(acc.host_bytes), comm_source="engine accounting",
                    state_source="engine accounting")

    def close(self):
        self.opt.close()


class _DDPVariant(_Variant):
    """HF GPT2LMHeadModel + torch DDP (over every rank) + AdamW(fused=True)."""

    hf = True

    def __init__(self, ctx):
        import torch

        self.name, self.ctx = "torch_ddp", ctx
        dev = ctx.ps.device
        self.model = ctx.hf_model().to(dev)
        self.ddp = torch.nn.parallel.DistributedDataParallel(
            self.model, device_ids=[dev.index] if dev.type == "cuda" else None, gradient_as_bucket_view=True)
        self.opt = torch.optim.AdamW(_decay_groups(self.model.named_parameters()), lr=ctx.args.lr, betas=BETAS,
                                     eps=EPS, fused=True)
        self.autocast = (torch.autocast(dev.type, dtype=torch.bfloat16) if ctx.cfg.precision == "bf16"
                         else torch.autocast(dev.type, enabled=False))
        self.n = sum(p.numel() for p in self.model.parameters())

    def step(self, tokens, labels, times):
        import torch

        now, sync = time.perf_counter, self.ctx.sync
        t0 = now()
        with self.autocast:
            loss = _hf_loss(self.ddp(input_ids=tokens, use_cache=False).logits, labels)
        sync()
        t1 = now()
        loss.backward()                # DDP all-reduces the gradient buckets during backward
        sync()
        t2 = now()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.ctx.args.clip_grad or float("inf"))
        for g in self.opt.param_groups:
            g["lr"] = self.ctx.args.lr
        self.opt.step()
        self.opt.zero_grad(set_to_none=False)      # the grads stay views of DDP's buckets
        sync()
        times.update(forward=t1 - t0, backward=t2 - t1, optimizer=now() - t2)
        return loss.item()

    def eval_loss(self, tokens, labels):
        import torch

        with torch.no_grad(), self.autocast:
            return _hf_loss(self.model(input_ids=tokens, use_cache=False).logits, labels).item()

    def weighted_params(self):
        return [(p, 1.0 / self.ctx.world) for p in self.model.parameters()]       # every rank: a replica

    def info(self):
        n, w = self.n, self.ctx.world
        return dict(comm_bytes_per_rank=int(2 * (w - 1) * 4 * n // w), device_state_bytes=16 * n + 4 * n,
                    host_state_bytes=0, comm_source="ring all-reduce of fp32 gradients: 2 (N-1)/N x 4 B x params",
                    state_source="fp32 params + grads + Adam m, v (16 B/param) + DDP's fp32 buckets (4 B/param)")


class _DeepSpeedVariant(_Variant):
    """HF GPT2LMHeadModel under DeepSpeed ZeRO-2 with the optimizer offloaded to the CPU."""

    hf = True

    def __init__(self, ctx):
        import deepspeed

        self.name, self.ctx = "deepspeed_offload", ctx
        a, bf16 = ctx.args, ctx.cfg.precision == "bf16"
        model = ctx.hf_model()
        self.n = sum(p.numel() for p in model.parameters())
        config = {
            "train_micro_batch_size_per_gpu": ctx.micro_batch,
            "gradient_accumulation_steps": 1,
            "gradient_clipping": a.clip_grad,
            "bf16": {"enabled": bf16},
            "optimizer": {"type": "AdamW", "params": {"lr": a.lr, "betas": list(BETAS), "eps": EPS,
                                                      "weight_decay": WD}},
            "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu",
                                                                          "pin_memory": ctx.ps.device.type == "cuda"},
                                  "overlap_comm": False, "contiguous_gradients": True,
                                  "reduce_bucket_size": a.bucket_size, "allgather_bucket_size": a.bucket_size},
            "steps_per_print": 1 << 30,
            "wall_clock_breakdown": False,
        }
        self.engine, self.opt, _, _ = deepspeed.initialize(model=model, model_parameters=_decay_groups(
            model.named_parameters()), config=config)
        self.esz = 2 if bf16 else 4

    def step(self, tokens, labels, times):
        now, sync = time.perf_counter, self.ctx.sync
        t0 = now()
        loss = _hf_loss(self.engine(input_ids=tokens, use_cache=False).logits, labels)
        sync()
        t1 = now()
        self.engine.backward(loss)        # ZeRO-2: gradient reduce + copy of this rank's partition to the CPU
        sync()
        t2 = now()
        self.engine.step()                # DeepSpeedCPUAdam, params back to the device, all-gather
        sync()
        times.update(forward=t1 - t0, backward=t2 - t1, optimizer=now() - t2)
        return loss.item()

    def eval_loss(self, tokens, labels):
        import torch

        with torch.no_grad():
            return _hf_loss(self.engine.module(input_ids=tokens, use_cache=False).logits, labels).item()

    def weighted_params(self):
        return [(p, 1.0 / self.ctx.world) for p in self.engine.module.parameters()]

    def info(self):
        n, w, e = self.n, self.ctx.world, self.esz
        return dict(comm_bytes_per_rank=int(2 * (w - 1) * e * n // w),
                    device_state_bytes=2 * e * n,
                    host_state_bytes=16 * n // w,
                    comm_source=f"ring reduce-scatter of gradients + all-gather of params ({e} B each): "
                                "2 (N-1)/N x B x params",
                    state_source="device: params + gradient buffers; host: fp32 master + Adam m, v + fp32 grad "
                                 "partition (16 B/param / ranks)")


class _Ctx:
    """What the variants of one rank share: parallel state, config, batches, the initial weights."""

    def __init__(self, args, ps, cfg, micro_batch, world, full):
        import torch

        self.args, self.ps, self.cfg, self.micro_batch, self.world, self.full = args, ps, cfg, micro_batch, world, full
        cuda = ps.device.type == "cuda"
        self.sync = (lambda: torch.cuda.synchronize(ps.device)) if cuda else (lambda: None)

    def hf_model(self):
        import transformers

        from zo_megatron.checkpoint.hf.gpt2 import to_hf

        a, cfg = self.args, self.cfg
        hc = transformers.GPT2Config(vocab_size=a.vocab, n_positions=cfg.max_position_embeddings, n_embd=a.hidden,
                                     n_layer=a.layers, n_head=a.heads, resid_pdrop=0.0, embd_pdrop=0.0,
                                     attn_pdrop=0.0, activation_function="gelu_new", layer_norm_epsilon=1e-5,
                                     bos_token_id=min(50256, a.vocab - 1), eos_token_id=min(50256, a.vocab - 1))
        model = transformers.GPT2LMHeadModel(hc).float()
        model.load_state_dict(to_hf(self.full, a.layers, a.heads), strict=True)
        return model


def _rank_main(rank, job, port, out_path):
    args, tp, dp, precision, regime = job["args"], job["tp"], job["dp"], job["precision"], job["regime"]
    world = tp * dp
    threads = 1 if args.split_cores else args.threads or max(1, _cpus() // world)
    if args.split_cores:                  # the main thread (and so torch's inline intra-op work) on CPU 0
        os.sched_setaffinity(0, {_split_cpus()[0]})
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), ZO_CPU_ADAM_THREADS=str(threads),
                      OMP_NUM_THREADS=str(threads))
    import warnings

    warnings.filterwarnings("ignore")
    import torch

    torch.set_num_threads(threads)
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import logging

    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    from zo_megatron.model import GPTConfig
    from zo_megatron.parallel import collectives, destroy_parallel, init_parallel
    from zo_megatron.training.metrics import host_rss_bytes, proc_memory_bytes

    shape = dict(REGIMES[regime])
    if args.seq:
        shape["seq"] = args.seq
    if args.micro_batch:
        shape["micro_batch"] = args.micro_batch
    seq, mb = shape["seq"], shape["micro_batch"]
    ps = init_parallel(tp, seed=args.seed, num_attention_heads=args.heads, hidden_size=args.hidden)
    dev = ps.device
    cfg = GPTConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                    vocab_size=args.vocab, max_position_embeddings=seq, precision=precision,
                    attention_backend="sdpa" if args.use_flash_attn else "local",
                    sequence_parallel=args.sequence_parallel)
    result = dict(rows=[], skipped={})
    variants: dict[str, _Variant] = {}
    for name in job["variants"]:
        try:
            variants[name] = _make(name, args, ps, cfg, mb, world)
        except _Skip as s:
            result["skipped"][name] = str(s)
    global _FULL
    _FULL = None            # the shared initial weights: not part of any engine's footprint
    import gc

    gc.collect()
    names = list(variants)
    total = args.warmup + args.steps
    # one batch stream per DP rank (zo variants); HF variants in a TP world: one per rank (pure DP)
    def batches(stream):
        gen = torch.Generator().manual_seed(args.seed + 1000 * (stream + 1))
        return [(torch.randint(0, args.vocab, (mb, seq), generator=gen).to(dev),
                 torch.randint(0, args.vocab, (mb, seq), generator=gen).to(dev)) for _ in range(total)]

    zo_batches = batches(ps.dp_rank)
    hf_batches = zo_batches if tp == 1 else batches(rank)
    gen = torch.Generator().manual_seed(args.seed + 7)
    eval_batch = (torch.randint(0, args.vocab, (2, seq), generator=gen).to(dev),
                  torch.randint(0, args.vocab, (2, seq), generator=gen).to(dev))
    before = {v: variants[v].eval_loss(*eval_batch) for v in names}
    # the update check's "before": each variant's parameters as its forward uses them, on the host
    start = {v: [(p.detach().to("cpu", copy=True), w) for p, w in variants[v].weighted_params()] for v in names}
    records = {v: [] for v in names}
    losses = {v: [] for v in names}
    load = [os.getloadavg()[0]]
    for i in range(total):
        k = i % max(1, len(names))
        order = names[k:] + names[:k]          # rotate which variant goes first
        for v in order:
            times: dict[str, float] = {}
            ctx_batches = hf_batches if variants[v].hf else zo_batches
            ps_sync = variants[v].ctx.sync
            ps_sync()
            collectives.barrier()
            t0 = time.perf_counter()
            loss = variants[v].step(*ctx_batches[i], times)
            ps_sync()
            collectives.barrier()
            times["total"] = time.perf_counter() - t0
            records[v].append(times)
            losses[v].append(loss)
        load.append(os.getloadavg()[0])
        if rank == 0:       # a world can take many minutes (emulated bf16): show where it is
            done = "  ".join(f"{v} {records[v][-1]['total']:.2f}s" for v in names)
            print(f"  step {i + 1}/{total}{' (warm-up)' if i < args.warmup else ''}, rank 0: {done}",
                  file=sys.stderr, flush=True)
    infos = {v: variants[v].info() for v in names}
    evals = {v: variants[v].eval_loss(*eval_batch) for v in names}      # (DPU: flushes the last update)
    updates = {}
    for v in names:
        now = variants[v].weighted_params()
        assert len(now) == len(start[v]), f"{v}: the parameter list changed during the steps"
        sums = torch.tensor(update_sums((b, p, w) for (b, w), (p, _) in zip(start[v], now)), dtype=torch.float64)
        collectives.all_reduce(sums, "sum")
        updates[v] = {f"update_norm_{g}": float(x) ** 0.5 for g, x in zip(UPDATE_GROUPS, sums.tolist())}
    del start
    # the world's step is its slowest rank's: MAX over ranks, per step and phase
    for v in names:
        keys = sorted(records[v][0])
        flat = torch.tensor([[r[k] for k in keys] for r in records[v]], dtype=torch.float64)
        collectives.all_reduce(flat, "max")
        rows = flat[args.warmup:]
        per = {k: rows[:, c].tolist() for c, k in enumerate(keys)}
        loss_t = torch.tensor([losses[v][-1]], dtype=torch.float64)
        collectives.all_reduce(loss_t, "sum")
        hf = variants[v].hf
        result["rows"].append(dict(
            variant=v, tp=1 if hf else tp, dp=world if hf else dp, world=world_name(tp, dp), ranks=world,
            precision=precision, regime=regime, seq=seq, micro_batch=mb,
            tokens_per_step=mb * seq * (world if hf else dp), step_times_s=per, loss_after=evals[v],
            loss_before=before[v], world_tp=tp, world_dp=dp, loss_first=losses[v][0], loss_last_step=float(loss_t.item()) / world,
            **updates[v], **infos[v]))
    result["threads"] = threads
    result["device"] = str(dev)
    result["device_name"] = torch.cuda.get_device_name(dev) if dev.type == "cuda" else None
    result["backend"] = collectives.default_backend(dev)
    result["load_average_during"] = load
    # the rank's own peak (VmHWM: getrusage's ru_maxrss would include the driver that spawned it)
    result["peak_rss_bytes"] = host_rss_bytes()
    result["rss_end_bytes"] = proc_memory_bytes().get("vmrss", 0)
    if args.timeline and rank == 0:
        _write_timelines(args.timeline, {v: variants[v] for v in names}, precision, regime)
    for v in names:
        variants[v].close()
    collectives.barrier()
    destroy_parallel()
    if rank == 0 and out_path:
        with open(out_path, "w") as f:
            json.dump(result, f)
    return result


class _Skip(Exception):
    pass


_SPLIT: tuple[int, int] | None = None


def _split_cpus() -> tuple[int, int]:
    """--split-cores: the first two CPUs the process could run on before it pinned its main
    thread (torch's, the CPU Adam's)."""
    global _SPLIT
    if _SPLIT is None:
        cpus = sorted(os.sched_getaffinity(0))
        _SPLIT = (cpus[0], cpus[1])
    return _SPLIT


def _write_timelines(path: str, variants: dict, precision: str, regime: str) -> None:
    """Each offload variant's per-step phases as --timeline JSON lines + a PNG (plot_timeline)."""
    from plot_timeline import plot

    for name, v in variants.items():
        log = getattr(v, "phase_log", None)
        if not log:
            continue
        rows = [dict(rank=0, iteration=i + 1, phase=p, start=s, end=e)
                for i, phases in enumerate(log) for p, s, e in phases]
        out = f"{path}.{name}"
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        last = rows[-1]["iteration"]
        plot([r for r in rows if r["iteration"] >= last - 2], out + ".png",
             f"{name}, {precision}, {regime}: the last 3 steps")
        print(f"wrote {out} and {out}.png", file=sys.stderr)


def _make(name, args, ps, cfg, mb, world):
    """Build one variant (the shared initial weights come from a zo_megatron model, mapped to HF)."""
    global _FULL
    ctx = _Ctx(args, ps, cfg, mb, world, None)
    if name in HF_VARIANTS:
        if _FULL is None:
            from zo_megatron.model import build_gpt_model
            from zo_megatron.model.sharding import gather_full_params

            m = build_gpt_model(cfg.__class__(**{**cfg.__dict__, "precision": "fp32"}), ps.tp_rank, ps.tp_size,
                                args.seed)
            _FULL = gather_full_params(m, ps.tp_group, ps.tp_rank, ps.tp_size, args.vocab)
            del m
        ctx.full = _FULL
    if name == "zo_offload":                 # the job's default schedule on this device
        return _ZoVariant(name, ctx, True, schedule=job_default_schedule(ctx))
    if name == "zo_offload_f0.5":
        return _ZoVariant(name, ctx, True, 0.5)
    if name == "zo_baseline":
        return _ZoVariant(name, ctx, False)
    if name == "zo_offload_overlap":
        return _ZoVariant(name, ctx, True, schedule=dict(overlap_cpu_step=True))
    if name == "zo_offload_dpu":
        return _ZoVariant(name, ctx, True, schedule=dict(dpu_warmup_steps=1))
    if name == "torch_ddp":
        variant = _DDPVariant(ctx)
    else:
        ok, why = deepspeed_status()
        if not ok:
            raise _Skip(why)
        variant = _DeepSpeedVariant(ctx)
    ctx.full = None               # built: the variant keeps no reference to the initial weights
    return variant


_FULL = None


def job_default_schedule(ctx) -> dict:
    """The CPU-step schedule pretrain_gpt.py would run for this shape on this machine (issue 34,
    2.8): its own flags through its own pre-launch plan (training.loop.job_plan), so `zo_offload`
    measures what users run: on a CUDA device `--overlap-cpu-step auto` (the share the free host
    memory holds, possibly none), on a CPU the synchronous step."""
    from types import SimpleNamespace

    from zo_megatron.training.arguments import parse_args
    from zo_megatron.training.loop import job_plan

    a, cfg, ps = ctx.args, ctx.cfg, ctx.ps
    flags = ["--num-layers", str(a.layers), "--hidden-size", str(a.hidden), "--num-attention-heads", str(a.heads),
             "--seq-length", str(cfg.max_position_embeddings), "--micro-batch-size", str(ctx.micro_batch),
             "--tensor-parallel", str(ps.tp_size), "--bucket-size", str(a.bucket_size), "--zero-offload",
             f"--{cfg.precision}", "--lr", str(a.lr), "--train-iters", "1"]
    args = parse_args(flags)
    job_plan(args, SimpleNamespace(local_world_size=ctx.world), ps.dp_size, a.vocab)
    f = args.overlap_speculated_fraction
    return dict(overlap_cpu_step=f > 0, overlap_speculated_fraction=f) if f > 0 else {}


# ------------------------------------------------------------------------------------------------
# driver

def _spawn_entry(rank, job, port, out_path):
    _rank_main(rank, job, port, out_path)


def run_world(job) -> dict:
    """One world (TP x DP ranks, spawned here), all its variants interleaved; rank 0's result."""
    world = job["tp"] * job["dp"]
    port = _free_port()
    fd, out_path = tempfile.mkstemp(prefix="bench_train_", suffix=".json")
    os.close(fd)
    try:
        # every world in fresh processes, one rank too: DeepSpeed keeps its process groups in
        # module globals, which would outlive this world's destroyed groups in the next one
        import torch.multiprocessing as mp

        mp.spawn(_spawn_entry, args=(job, port, out_path), nprocs=world, join=True)
        with open(out_path) as f:
            return json.load(f)
    finally:
        os.unlink(out_path)


def _flops_per_step(row, args) -> float:
    """Model FLOPs of one step: Megatron-LM's count (zo_megatron.training.metrics.flops_per_token, the
    one the training log uses) x tokens, with the benchmark's vocabulary as every variant sees it."""
    from zo_megatron.training.metrics import flops_per_token

    return float(flops_per_token(args.layers, args.hidden, row["seq"], args.vocab, None) * row["tokens_per_step"])


def summarize(res: dict, args, cpus: int) -> list[dict]:
    """Per-variant rows with medians, spreads, ratios and the loss check of one world."""
    rows = []
    for r in res["rows"]:
        st = r["step_times_s"]
        tot = st["total"]
        med = _median(tot)
        phases = {k: _median(v) for k, v in st.items() if k != "total"}
        overhead = _median([t - f - b for t, f, b in zip(tot, st["forward"], st["backward"])])
        q = sorted(tot)
        row = dict(r)
        row.update(median_step_s=med, min_step_s=q[0], max_step_s=q[-1],
                   spread_s=(q[-1] - q[0]), tokens_per_s=r["tokens_per_step"] / med,
                   model_tflops=_flops_per_step(r, args) / med / 1e12, phases_s=phases,
                   engine_overhead_s=overhead, threads_per_rank=res["threads"],
                   oversubscribed=r["ranks"] * res["threads"] > cpus,
                   load_average_during=[min(res["load_average_during"]), max(res["load_average_during"])],
                   device=res["device"], device_name=res["device_name"])
        row["params"] = gpt_params(args.layers, args.hidden, args.vocab, r["seq"])
        rows.append(row)
    ref = next((x for x in rows if x["variant"] == "zo_offload"), None)
    for x in rows:
        x["ratio_to_zo_offload"] = x["median_step_s"] / ref["median_step_s"] if ref else None
        x["overhead_ratio_to_zo_offload"] = (x["engine_overhead_s"] / ref["engine_overhead_s"]
                                             if ref and ref["engine_overhead_s"] > 0 else None)
    # loss agreement: every variant that saw the same global batch, against their median
    # groups that saw the same global batches: all variants, except in a TP world, where the HF
    # variants (pure DP over every rank) form their own group
    groups: dict[str, list] = {}
    for x in rows:
        own = x["variant"] in HF_VARIANTS and x["world_tp"] > 1
        groups.setdefault("dpu" if x["variant"] == "zo_offload_dpu" else "hf" if own else "all", []).append(x)
    for key, members in groups.items():
        if key == "dpu" or len(members) < 2:
            for x in members:
                if key == "dpu":
                    x["loss_rel_diff"], x["loss_check"] = None, "n/a: DPU's updates are one step stale by design"
                    continue
                x["loss_rel_diff"], x["loss_check"] = None, "n/a: no other variant saw the same batches"
            continue
        check_losses(members, members[0]["precision"])
        if key != "all":
            for x in members:
                x["loss_check"] += (": against the other HF variant only (pure DP over the TP world's ranks: "
                                    "another global batch)")
    for name, why in res.get("skipped", {}).items():
        rows.append(dict(variant=name, skipped=why, world=res["rows"][0]["world"] if res["rows"] else None,
                         precision=rows[0]["precision"] if rows else None,
                         regime=rows[0]["regime"] if rows else None))
    return rows


def _fmt_bytes(n) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


_PHASE_ORDER = ("forward", "backward", "grad_sync", "grad_norm", "cpu_adam", "cpu_adam_wait", "cpu_adam_off_path",
                "param_return", "optimizer")


def print_table(rows: list[dict]) -> None:
    head = (f"  {'variant':<18}{'tp':>3}{'dp':>3}{'median':>9}{'min':>8}{'max':>8}{'tok/s':>9}{'TFLOP/s':>9}"
            f"{'x zo_off':>9}{'overhd':>8}{'sent/rank':>11}{'dev state':>11}{'host state':>11}{'loss_after':>12}  check")
    print(head)
    for x in rows:
        if x.get("skipped"):
            print(f"  {x['variant']:<18}  skipped: {x['skipped']}")
            continue
        ratio = f"{x['ratio_to_zo_offload']:.2f}x" if x["ratio_to_zo_offload"] else "-"
        print(f"  {x['variant']:<18}{x['tp']:>3}{x['dp']:>3}{x['median_step_s']:>8.3f}s{x['min_step_s']:>7.3f}s"
              f"{x['max_step_s']:>7.3f}s{x['tokens_per_s']:>9.0f}{x['model_tflops']:>9.4f}{ratio:>9}"
              f"{x['engine_overhead_s']:>7.3f}s{_fmt_bytes(x['comm_bytes_per_rank']):>11}"
              f"{_fmt_bytes(x['device_state_bytes']):>11}{_fmt_bytes(x['host_state_bytes']):>11}"
              f"{x['loss_after']:>12.6f}  {x['loss_check'].split(':')[0]}"
              f"{' (vs the other HF variant)' if 'HF variant only' in x['loss_check'] else ''}")
    print("  phases (medians, s):")
    for x in rows:
        if x.get("skipped"):
            continue
        ph = x["phases_s"]
        print("    " + f"{x['variant']:<18}" + "  ".join(f"{k} {ph[k]:.3f}" for k in _PHASE_ORDER if k in ph))


def plot(rows: list[dict], path: str) -> str | None:
    """Bar chart: one panel per (regime, precision), a bar group per world, a bar per variant."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install matplotlib): no chart"
    ok = [x for x in rows if not x.get("skipped")]
    panels = sorted({(x["regime"], x["precision"]) for x in ok})
    if not panels:
        return "no rows to plot"
    variants = [v for v in VARIANTS if any(x["variant"] == v for x in ok)]
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.2), squeeze=False)
    for ax, (regime, prec) in zip(axes[0], panels):
        worlds = [w for w in dict.fromkeys(x["world"] for x in ok if x["regime"] == regime and x["precision"] == prec)]
        width = 0.8 / max(1, len(variants))
        for j, v in enumerate(variants):
            ys, errs = [], [[], []]
            for w in worlds:
                r = next((x for x in ok if (x["regime"], x["precision"], x["world"], x["variant"]) ==
                          (regime, prec, w, v)), None)
                ys.append(r["median_step_s"] if r else 0.0)
                errs[0].append(r["median_step_s"] - r["min_step_s"] if r else 0.0)
                errs[1].append(r["max_step_s"] - r["median_step_s"] if r else 0.0)
            xs = [i + (j - (len(variants) - 1) / 2) * width for i in range(len(worlds))]
            ax.bar(xs, ys, width, yerr=errs, capsize=2, label=v)
        ax.set_xticks(range(len(worlds)))
        ax.set_xticklabels([f"world {w}" for w in worlds])
        ax.set_ylabel("median step time (s), min-max")
        ax.set_title(f"{regime}, {prec}")
    axes[0][0].legend(fontsize=8)
    fig.suptitle("tools/bench_train.py: step time per variant (lower is better)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.sweep:
        return sweep_main(args)
    cpus = _cpus()
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
    print(f"bench_train: GPT {args.layers} layers x {args.hidden} hidden x {args.heads} heads, vocab {args.vocab}; "
          f"{args.steps} timed steps per variant after {args.warmup} warm-up, interleaved")
    print(f"  host: {_cpu_model()}, {cpus} CPU(s); device: {'CUDA ' + torch.cuda.get_device_name(0) if cuda else 'cpu'};"
          f" torch {torch.__version__}; deepspeed: {ds_info if ds_ok else 'not available'}")
    if not ds_ok:
        print(f"  deepspeed_offload rows are skipped: {ds_info}")
    all_rows, load_samples = [], [os.getloadavg()]
    t_start = time.perf_counter()
    for regime in args.regimes:
        for prec in args.precisions:
            for tp, dp in args.world_list:
                world = tp * dp
                threads = args.threads or max(1, cpus // world)
                shape = {**REGIMES[regime], **({"seq": args.seq} if args.seq else {}),
                         **({"micro_batch": args.micro_batch} if args.micro_batch else {})}
                print()
                print(f"== {regime} (seq {shape['seq']}, micro-batch {shape['micro_batch']}), {prec}, world "
                      f"{world_name(tp, dp)} (TP={tp} x DP={dp}, {world} rank(s), {threads} thread(s) each)")
                if world * threads > cpus:
                    print(f"  NOTE: {world} ranks x {threads} thread(s) on {cpus} CPU(s): OVERSUBSCRIBED -- "
                          "the ranks time-share the cores, step times are not a scaling measurement")
                if tp > 1 and any(v in HF_VARIANTS for v in args.variant_list):
                    print(f"  NOTE: HF GPT-2 has no TP: torch_ddp / deepspeed_offload run pure DP={world} on the "
                          f"same {world} ranks ({tp}x our global batch per step: compare tokens/s; their loss is checked "
                          "against each other only)")
                if prec == "bf16" and cuda is False:
                    print("  NOTE: bf16 on a CPU without native bf16 (AVX2) is emulated: slow for every variant")
                job = dict(args=args, tp=tp, dp=dp, precision=prec, regime=regime, variants=args.variant_list)
                load_samples.append(os.getloadavg())
                res = run_world(job)
                load_samples.append(os.getloadavg())
                rows = summarize(res, args, cpus)
                print_table(rows)
                all_rows.extend(rows)
    wall = time.perf_counter() - t_start
    loads = [s[0] for s in load_samples]
    print()
    print(f"load average (1 min) during the run: min {min(loads):.2f}, max {max(loads):.2f} on {cpus} CPU(s) "
          "(a shared machine: read the min-max spread before trusting a ratio)")
    bad = [x for x in all_rows if not x.get("skipped") and x["loss_check"].startswith(("DIFFERS", "INCONCLUSIVE"))]
    for x in bad:
        print(f"LOSS MISMATCH: {x['variant']} {x['regime']} {x['precision']} world {x['world']}: "
              f"loss_after {x['loss_after']:.6f}, {x['loss_check']}")
    png = args.plot or (os.path.splitext(args.json)[0] + ".png" if args.json else None)
    if png:
        why = plot(all_rows, png)
        print(f"chart: {png}" if why is None else f"chart not written: {why}")
    print(f"wall time {wall:.0f}s")
    if args.json:
        out = dict(tool="tools/bench_train.py", config={k: v for k, v in vars(args).items()
                                                       if k not in ("world_list",)},
                   cpu_model=_cpu_model(), cpus=cpus, torch=torch.__version__,
                   deepspeed=ds_info if ds_ok else None, deepspeed_skip_reason=None if ds_ok else ds_info,
                   load_average_samples=loads, load_average_min_max=[min(loads), max(loads)], wall_s=wall,
                   loss_mismatches=len(bad), rows=all_rows)
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 1 if bad else 0


# ------------------------------------------------------------------------------------------------
# --sweep: cost against model size

def sweep_main(args) -> int:
    import copy

    cpus = _cpus()
    ds_ok, ds_info = deepspeed_status()
    seq, mb = REGIMES["optimizer-bound"]["seq"], REGIMES["optimizer-bound"]["micro_batch"]
    avail = _mem_available()
    # both engines' host footprint is ~16-20 B/param + the model; 40 B/param leaves headroom
    limit = args.sweep_max_params or avail / 40
    shapes = [s for s in SWEEP_SHAPES if gpt_params(s[0], s[1], args.vocab, seq) <= limit]
    variants = ["zo_offload"] + (["deepspeed_offload"] if ds_ok else [])
    print(f"bench_train --sweep: {', '.join(variants)}, 1 rank, fp32, seq {seq}, micro-batch {mb}; "
          f"{_fmt_bytes(avail)} available -> models up to {limit / 1e6:.0f}M params")
    if not ds_ok:
        print(f"  deepspeed_offload skipped: {ds_info}")
    points = []
    for layers, hidden, heads in shapes:
        n = gpt_params(layers, hidden, args.vocab, seq)
        for v in variants:
            a = copy.copy(args)
            a.layers, a.hidden, a.heads, a.seq, a.micro_batch = layers, hidden, heads, seq, mb
            job = dict(args=a, tp=1, dp=1, precision="fp32", regime="optimizer-bound", variants=[v])
            t0 = time.perf_counter()
            res = _run_isolated(job)
            row = res["rows"][0] if res.get("rows") else None
            pt = dict(variant=v, layers=layers, hidden=hidden, heads=heads, params=n,
                      median_step_s=_median(row["step_times_s"]["total"]) if row else None,
                      peak_host_rss_bytes=res.get("peak_rss_bytes", 0),
                      host_rss_after_steps_bytes=res.get("rss_end_bytes", 0), wall_s=time.perf_counter() - t0,
                      skipped=res.get("skipped", {}).get(v) or res.get("error"))
            points.append(pt)
            print(f"  {v:<18} {n / 1e6:8.1f}M params: step {pt['median_step_s'] or float('nan'):.3f}s, "
                  f"host RSS after the steps {_fmt_bytes(pt['host_rss_after_steps_bytes'])} "
                  f"(peak {_fmt_bytes(pt['peak_host_rss_bytes'])}, setup included)")
    png = args.plot or (os.path.splitext(args.json)[0] + ".png" if args.json else None)
    if png:
        _plot_sweep(points, png)
        print(f"chart: {png}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(tool="tools/bench_train.py --sweep", cpus=cpus, cpu_model=_cpu_model(),
                           mem_available_bytes=avail, load_average=os.getloadavg(), points=points), f, indent=1)
    return 0


def _run_isolated(job) -> dict:
    """One single-rank sweep job in its own process (run_world), so its peak RSS is its own; a
    rank that dies (out of memory?) is an `error` entry, and the sweep goes on."""
    import torch.multiprocessing as mp

    try:
        return run_world(job)
    except (mp.ProcessExitedException, mp.ProcessRaisedException) as exc:
        return dict(error=f"rank failed: {str(exc).strip().splitlines()[-1]} (out of memory?)")


def _plot_sweep(points, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for v in dict.fromkeys(p["variant"] for p in points):
        ps = [p for p in points if p["variant"] == v and p["median_step_s"]]
        a1.plot([p["params"] / 1e6 for p in ps], [p["median_step_s"] for p in ps], "o-", label=v)
        a2.plot([p["params"] / 1e6 for p in ps], [p["host_rss_after_steps_bytes"] / 2**30 for p in ps], "o-",
                 label=v)
    for ax, lab in ((a1, "median step time (s)"), (a2, "host RSS after the steps (GiB)")):
        ax.set_xscale("log")
        ax.set_xlabel("parameters (M)")
        ax.set_ylabel(lab)
        ax.legend()
        ax.grid(alpha=0.3)
    fig.suptitle("tools/bench_train.py --sweep: 1 rank, fp32, seq 32, micro-batch 1")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit(130)
