#!/usr/bin/env python3
"""The delayed parameter update, reproduced in plain torch: no zo_megatron engine code.

    python tools/dpu_reproduction.py [--mode exact|delayed|predict|dc] [--dpu-warmup-steps 40]
                                     [--train-iters 300] [--out FILE.json]

Hugging Face `GPT2LMHeadModel` (the demo's 4 x 256, 4 heads, seq 256, fp32) trained by
`torch.optim.AdamW` (betas 0.9/0.95, weight decay 0.1 on matrices and embeddings, clip 1.0,
lr 1e-3 cosine to 1e-4 after 30 warm-up iterations, batch 8), fed by the project's data pipeline
on the embedded corpus — the demo's recipe, written from scratch so that a convergence gap seen
in the engine can be told apart from a bug in it (docs/dpu.md).

Two copies of the weights: the master (what the optimizer updates) and the "device" copy (what
forward/backward sees). The schedules, as the engine runs them (offload/engine.py):

  exact     the device copy is the master after every update.
  delayed   updates 1 .. W-1 exact; from update W on, update t's gradient is computed on the
            master after update t-2 (one update behind); an evaluation flushes (the device gets
            the master) and the next update is computed on fresh weights again.
  predict   delayed, but the device copy is extrapolated by the last update: it gets
            w_{t-1} + (w_{t-1} - w_{t-2}) instead of w_{t-1} (weight prediction, as PipeMare and
            SpecTrain do for pipeline staleness). The master stays exact; only the copy the
            gradient is computed on moves. In the engine this is free: the CPU Adam kernel has
            w_old and w_new of every element in registers when it writes the 16-bit copy.
  dc        delayed with delay compensation (DC-ASGD, Zheng et al. 2017): the stale gradient g
            is corrected to g + lambda * g * g * (w_now - w_used) before Adam sees it.

Prints the validation loss every --eval-interval iterations and writes the curve as JSON.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def lr_at(it: int, args) -> float:
    """Megatron's linear warm-up then cosine decay (it counts from 1)."""
    if it <= args.warmup:
        return args.lr * it / args.warmup
    frac = (it - args.warmup) / max(1, args.train_iters - args.warmup)
    return args.min_lr + 0.5 * (args.lr - args.min_lr) * (1 + math.cos(math.pi * min(1.0, frac)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=["exact", "delayed", "predict", "dc"], default="exact")
    ap.add_argument("--dpu-warmup-steps", type=int, default=40)
    ap.add_argument("--dc-lambda", type=float, default=1.0, help="delay compensation strength (--mode dc)")
    ap.add_argument("--train-iters", type=int, default=300)
    ap.add_argument("--eval-interval", type=int, default=25)
    ap.add_argument("--eval-iters", type=int, default=10)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--min-lr", type=float, default=1e-4)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from zo_megatron.data import build_gpt_datasets, build_tokenizer
    from zo_megatron.data.corpus import default_data_prefix

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    tok = build_tokenizer()
    n_evals = args.train_iters // args.eval_interval + 1
    train_ds, valid_ds, _ = build_gpt_datasets(
        default_data_prefix(), "969, 30, 1", args.seq, args.seed, tok,
        train_samples=args.train_iters * args.batch, valid_samples=args.eval_iters * args.batch * n_evals,
        test_samples=0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=tok.vocab_size, n_positions=args.seq, n_embd=256, n_layer=4,
                                       n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    device_params = list(model.parameters())
    master = [p.detach().clone() for p in device_params]       # what the optimizer owns
    prev_master = [m.clone() for m in master]                  # the master one update back
    for m in master:
        m.grad = torch.zeros_like(m)
    decay = [m for m, (n, _) in zip(master, model.named_parameters()) if m.dim() >= 2]
    no_decay = [m for m in master if m.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8)

    def batch(ds, i):
        items = [ds[j] for j in range(i * args.batch, (i + 1) * args.batch)]
        return (torch.stack([torch.as_tensor(x["tokens"]) for x in items]),
                torch.stack([torch.as_tensor(x["labels"]) for x in items]))

    def loss_of(tokens, labels):
        logits = model(input_ids=tokens).logits
        return torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1))

    @torch.no_grad()
    def set_device(values):
        for p, v in zip(device_params, values):
            p.copy_(v)

    @torch.no_grad()
    def evaluate() -> float:
        set_device(master)                                      # a flush: the device gets the master
        losses = [loss_of(*batch(valid_ds, i)).item() for i in range(args.eval_iters)]
        return sum(losses) / len(losses)

    curve, t0, fresh = [], time.monotonic(), True
    for it in range(1, args.train_iters + 1):
        tokens, labels = batch(train_ds, it - 1)
        model.zero_grad(set_to_none=True)
        loss = loss_of(tokens, labels)
        loss.backward()
        delayed = args.mode != "exact" and it >= args.dpu_warmup_steps and not fresh
        fresh = False
        with torch.no_grad():
            used = [p.detach().clone() for p in device_params] if args.mode == "dc" else None
            for m, p in zip(master, device_params):
                m.grad.copy_(p.grad)
            if args.mode == "dc" and delayed:                   # g + lambda g*g*(w_now - w_used)
                for m, u in zip(master, used):
                    m.grad.addcmul_(m.grad * m.grad, m - u, value=args.dc_lambda)
            norm = torch.nn.utils.clip_grad_norm_(master, 1.0)
            for group in opt.param_groups:
                group["lr"] = lr_at(it, args)
            for pm, m in zip(prev_master, master):
                pm.copy_(m)
            opt.step()
            if args.mode == "exact" or it < args.dpu_warmup_steps:
                set_device(master)
            elif args.mode == "predict":                        # w_{t-1} + (w_{t-1} - w_{t-2})
                set_device([2 * pm - pp for pm, pp in zip(prev_master, prev2)] if it > args.dpu_warmup_steps
                           else prev_master)
            else:                                               # one update behind
                set_device(prev_master)
            prev2 = [pm.clone() for pm in prev_master] if args.mode == "predict" else None
        row = {"iteration": it, "loss": loss.item(), "grad_norm": float(norm), "lr": lr_at(it, args)}
        if it % args.eval_interval == 0 or it == args.train_iters:
            row["val_loss"] = evaluate()
            fresh = True                                        # the flush: next gradient on fresh weights
            if args.mode != "exact" and it >= args.dpu_warmup_steps:
                set_device(master)
            print(f"[{args.mode}] it {it} loss {row['loss']:.4f} val {row['val_loss']:.4f} "
                  f"grad_norm {row['grad_norm']:.3f} ({time.monotonic() - t0:.0f} s)", flush=True)
        curve.append(row)
    result = {"mode": args.mode, "dpu_warmup_steps": args.dpu_warmup_steps, "dc_lambda": args.dc_lambda,
              "train_iters": args.train_iters, "final_val_loss": curve[-1]["val_loss"], "curve": curve}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f)
    print(f"[{args.mode}] final validation loss {result['final_val_loss']:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
