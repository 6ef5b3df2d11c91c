"""The engines tools/bench_train.py compares, as one rank runs them: zo_megatron's TP GPT under the
offload engine (each CPU-step schedule) or its non-offload baseline, HF GPT-2 under torch DDP, and
HF GPT-2 under DeepSpeed ZeRO-2 with CPU offload; all from the same initial weights
(build_variants), each behind one interface (step, eval_loss, weighted_params, info, close).
"""
from __future__ import annotations

import gc
import os
import time

from bench_train_common import BETAS, EPS, HF_VARIANTS, WD, deepspeed_status, split_cpus


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
                worker.submit(os.sched_setaffinity, 0, {split_cpus()[1]}).result()
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


class _Skip(Exception):
    pass


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
    if name == "zo_offload_dpu_predict":     # --dpu-corrector weight-prediction (issue 37's cost check)
        return _ZoVariant(name, ctx, True, schedule=dict(dpu_warmup_steps=1, dpu_weight_prediction=True))
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
    2.8): its own flags through its own pre-launch plan (training.prelaunch.job_plan), so `zo_offload`
    measures what users run: on a CUDA device `--overlap-cpu-step auto` (the share the free host
    memory holds, possibly none), on a CPU the synchronous step."""
    from types import SimpleNamespace

    from zo_megatron.training.arguments import parse_args
    from zo_megatron.training.prelaunch import job_plan

    a, cfg, ps = ctx.args, ctx.cfg, ctx.ps
    flags = ["--num-layers", str(a.layers), "--hidden-size", str(a.hidden), "--num-attention-heads", str(a.heads),
             "--seq-length", str(cfg.max_position_embeddings), "--micro-batch-size", str(ctx.micro_batch),
             "--tensor-parallel", str(ps.tp_size), "--bucket-size", str(a.bucket_size), "--zero-offload",
             f"--{cfg.precision}", "--lr", str(a.lr), "--train-iters", "1"]
    args = parse_args(flags)
    job_plan(args, SimpleNamespace(local_world_size=ctx.world), ps.dp_size, a.vocab)
    f = args.overlap_speculated_fraction
    return dict(overlap_cpu_step=f > 0, overlap_speculated_fraction=f) if f > 0 else {}



def build_variants(names, args, ps, cfg, mb, world) -> tuple[dict, dict]:
    """This rank's variants, in the order of `names` ({name: variant}), and the ones that cannot
    run here ({name: why}); the shared initial weights are dropped once all are built."""
    global _FULL
    variants, skipped = {}, {}
    for name in names:
        try:
            variants[name] = _make(name, args, ps, cfg, mb, world)
        except _Skip as s:
            skipped[name] = str(s)
    _FULL = None            # the shared initial weights: not part of any engine's footprint
    gc.collect()
    return variants, skipped
