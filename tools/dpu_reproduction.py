#!/usr/bin/env python3
"""The delayed parameter update, reproduced in plain torch: no zo_megatron engine code.

    python tools/dpu_reproduction.py [--mode ARM ...] [--seeds 3] [--shape demo|long]
                                     [--dpu-warmup-steps 40] [--train-iters N] [--jobs 2]
                                     [--runs-dir DIR] [--out FILE.json] [--png FILE.png]

Hugging Face `GPT2LMHeadModel` (fp32) trained by AdamW written out here as torch.optim.AdamW
computes it (betas 0.9/0.95, weight decay 0.1 on matrices and embeddings, clip 1.0, lr 1e-3
cosine to 1e-4 after 30 warm-up iterations, batch 8), fed by the project's data pipeline on the
embedded corpus: the demo's recipe, written from scratch so that a convergence gap seen in the
engine can be told apart from a bug in it (docs/dpu.md). --shape demo: the demo model (4 x 256,
4 heads, seq 256), 300 iterations; --shape long: 2 x 128, seq 128, 2000 iterations and the same
4096-token corpus BPE (the long mode of tools/dpu_convergence.py, tools/dpu_report.MODES).

Two copies of the weights: the master w (what the optimizer updates) and the device copy p (what
forward/backward sees). Update k consumes g_k = grad f(p_k) and makes w_{k+1}. The arms (--mode,
repeatable), as the engine runs them (offload/schedules.py), updates 1 .. W-1 exact in all:

  exact        p_k = w_k.
  delayed      from update W on, p_{k+1} = w_k (one update behind); an evaluation flushes (the
               device gets the master) and the next gradient is computed on fresh weights.
  predict      delayed, p_{k+1} = w_k + (w_k - w_{k-1}) (weight prediction, --dpu-weight-prediction;
               after a flush, as in the engine, the first delayed update is not extrapolated).
  dc           delayed with delay compensation (DC-ASGD): g <- g + lambda g*g*(w_k - p_k).
  fresh-gradient       proposal 4A of the mitigation study (FG-LA), its oracle: p_{k+1} =
               P_k - lr_k (1-b1)/(1-b1^k) c_k g_k * D, with P_k = w_k - lr_k [wd w_k + b1 m_{k-1}/(1-b1^k) D]
               the part of update k the CPU knows before g_k (CPU step k-1 emits it), c_k g_k the
               clipped fresh gradient the device still holds, and D = 1/(sqrt(v_{k-1}/(1-b2^k)) + eps)
               in fp32: the Adam denominator of the step before (v is one step stale, the only
               difference to exact w_{k+1}).
  fresh-gradient-bf16  the same with D rounded to bf16 (what a device cache of 2 B/param holds).
  fresh-gradient-stale the same with the D of the previous update (D shipped one step later).
  fresh-gradient-v-bf16  the device gets v_{k-1} (bf16) instead of D and forms v_k =
               b2 v_{k-1} + (1-b2)(c_k g_k)^2 and D_k itself: exact w_{k+1} up to bf16 rounding of v
               (same bytes as a bf16 D; not in the proposal).
  nadamw       exact updates with the NAdamW form at constant beta1 (proposal 4B):
               u_k = [b1 m_k/(1-b1^(k+1)) + (1-b1) g_k/(1-b1^k)] D_k (not torch's mu schedule).
  nadamw-predict       that update, delayed, with weight prediction.

Every --eval-interval iterations: the validation loss (the same --eval-iters batches each time).
Every 10 iterations: ||p_k - w_k|| / ||w_k - w_{k-1}|| (the device's distance to the exact weights
in units of the last update) and where it sits (the tensor with most of it, and how much of that lies
in the elements whose fresh gradient dwarfs the v before it). Every arm runs with --seeds seeds (init and data order; seed s gives
every arm the same init and batches); the report gives each arm's mean, spread and gap to exact
(tools/dpu_report.py). Each run's curve is kept in --runs-dir (reused when its settings match, so
an interrupted measurement resumes).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tools"))

import dpu_report  # noqa: E402

DELAYED = {"delayed", "predict", "dc", "fresh-gradient", "fresh-gradient-bf16", "fresh-gradient-stale",
           "fresh-gradient-v-bf16", "nadamw-predict"}
ARMS = ["exact", *sorted(DELAYED - {"nadamw-predict"}), "nadamw", "nadamw-predict"]
PREDICTING = {"predict", "nadamw-predict"}


def lr_at(it: int, cfg: dict) -> float:
    """Megatron's linear warm-up then cosine decay (it counts from 1)."""
    if it <= cfg["warmup"]:
        return cfg["lr"] * it / cfg["warmup"]
    frac = (it - cfg["warmup"]) / max(1, cfg["train_iters"] - cfg["warmup"])
    return cfg["min_lr"] + 0.5 * (cfg["lr"] - cfg["min_lr"]) * (1 + math.cos(math.pi * min(1.0, frac)))


# ------------------------------------------------------------------------------ the optimizer
def adam_denominator(v, bias_step: int, beta2: float, eps: float):
    """D = 1 / (sqrt(v / (1 - b2^bias_step)) + eps), elementwise."""
    return 1.0 / ((v / (1.0 - beta2 ** bias_step)).sqrt() + eps)


def fresh_gradient_weights(w, m_prev, g, D, *, lr: float, wd: float, beta1: float, step: int):
    """Proposal 4A: the device weights for the next forward after update `step` (= k):

        P = w - lr [wd w + b1 m_prev / (1 - b1^k) D]      (the CPU's part: no g_k in it)
        p = P - lr (1 - b1) / (1 - b1^k) g D              (the device's part: the fresh g_k)

    w = w_k, m_prev = m_{k-1}, g = c_k g_k (clipped). With D = D_k this is exactly AdamW's w_{k+1}."""
    bc1 = 1.0 - beta1 ** step
    P = w - lr * (wd * w + (beta1 / bc1) * m_prev * D)
    return P - lr * ((1.0 - beta1) / bc1) * g * D


class Adam:
    """AdamW as torch.optim.AdamW computes it: w <- w (1 - lr wd), then
    w <- w - lr/(1-b1^k) m / (sqrt(v)/sqrt(1-b2^k) + eps). nesterov=True: the NAdamW form with
    constant beta1, w <- w - lr [b1 m_k/(1-b1^(k+1)) + (1-b1) g/(1-b1^k)] / (sqrt(v)/sqrt(1-b2^k) + eps).
    `wds`: the weight decay of each tensor."""

    def __init__(self, params, wds, betas=(0.9, 0.95), eps=1e-8, nesterov=False):
        import torch

        self.wds, self.betas, self.eps, self.nesterov = list(wds), betas, eps, nesterov
        self.m = [torch.zeros_like(p) for p in params]
        self.v = [torch.zeros_like(p) for p in params]
        self.k = 0

    def step(self, params, grads, lr: float) -> None:
        import torch

        b1, b2 = self.betas
        self.k += 1
        k = self.k
        bc1, bc2 = 1.0 - b1 ** k, 1.0 - b2 ** k
        with torch.no_grad():
            for p, g, m, v, wd in zip(params, grads, self.m, self.v, self.wds):
                m.mul_(b1).add_(g, alpha=1.0 - b1)
                v.mul_(b2).addcmul_(g, g, value=1.0 - b2)
                denom = (v.sqrt() / math.sqrt(bc2)).add_(self.eps)
                p.mul_(1.0 - lr * wd)
                if self.nesterov:
                    num = m * (b1 / (1.0 - b1 ** (k + 1))) + g * ((1.0 - b1) / bc1)
                    p.addcdiv_(num, denom, value=-lr)
                else:
                    p.addcdiv_(m, denom, value=-lr / bc1)


def clip_(grads, max_norm: float) -> float:
    """torch.nn.utils.clip_grad_norm_'s rule on a list of tensors, in place; the norm before."""
    import torch

    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])).item()
    coef = max_norm / (norm + 1e-6)
    if coef < 1.0:
        for g in grads:
            g.mul_(coef)
    return norm


# --------------------------------------------------------------------------------- one update
class Schedule:
    """The device copy after each update, by arm (the module docstring)."""

    def __init__(self, arm: str, opt: Adam, warmup: int):
        self.arm, self.opt, self.warmup = arm, opt, warmup
        self.prev_D = None                  # fresh-gradient-stale: the D of the previous update
        self.extrapolate = False            # predict: the previous update was delayed, not flushed

    def fresh_gradient(self, master, grads, lr: float):
        """The device weights of the fresh-gradient arms, from the state before update k."""
        import torch

        opt, k = self.opt, self.opt.k + 1
        b1, b2 = opt.betas
        out, Ds = [], []
        for w, g, m, v, wd in zip(master, grads, opt.m, opt.v, opt.wds):
            if self.arm == "fresh-gradient-v-bf16":       # v_k formed on the device from bf16 v_{k-1}
                v_dev = v.to(torch.bfloat16).float()
                D = adam_denominator(v_dev * b2 + (1.0 - b2) * g * g, k, b2, opt.eps)
            else:
                D = adam_denominator(v, k, b2, opt.eps)
                Ds.append(D)
                if self.arm == "fresh-gradient-bf16":
                    D = D.to(torch.bfloat16).float()
                elif self.arm == "fresh-gradient-stale" and self.prev_D is not None:
                    D = self.prev_D[len(out)]
            out.append(fresh_gradient_weights(w, m, g, D, lr=lr, wd=wd, beta1=b1, step=k))
        self.prev_D = Ds
        return out

    def device_after(self, k: int, master, before, predicted):
        """The device copy for iteration k+1 (master = w_{k+1}, before = w_k)."""
        delayed = self.arm in DELAYED and k >= self.warmup
        if not delayed:
            self.extrapolate = False
            return master
        if self.arm.startswith("fresh-gradient"):
            return predicted
        if self.arm in PREDICTING:
            out = [2 * b - p for b, p in zip(before, self._prev)] if self.extrapolate else before
            self.extrapolate = True
            return out
        return before                                      # delayed, dc: one update behind

    def remember(self, before_prev) -> None:
        self._prev = before_prev                           # w_{k-1}, for the prediction

    def flushed(self) -> None:
        self.extrapolate = False


def update(sched: Schedule, k: int, master, device, grads, lr: float, dc_lambda: float = 1.0):
    """Update k from the gradients computed on `device` (p_k): clip, step the master in place
    (w_k -> w_{k+1}); returns (the device copy for iteration k+1, w_k, the norm before clipping)."""
    if sched.arm == "dc":                                   # g + lambda g*g*(w_k - p_k)
        for g, w, p in zip(grads, master, device):
            g.addcmul_(g * g, w - p, value=dc_lambda)
    norm = clip_(grads, 1.0)
    predicted = sched.fresh_gradient(master, grads, lr) if sched.arm.startswith("fresh-gradient") else None
    before = [m.clone() for m in master]
    sched.opt.step(master, grads, lr)
    nxt = sched.device_after(k, master, before, predicted)
    sched.remember(before)
    return nxt, before, norm


def _where(names, errs, device, master, grads, opt) -> tuple:
    """Where the device error ||p - w||^2 sits: the tensor holding most of it, its share, and the
    share of that tensor's error in the elements whose fresh gradient dwarfs the v before it
    ((c g)^2 > 100 v_{k-1}, v_{k-1} recovered from v_k), with those elements' fraction."""
    i = max(range(len(errs)), key=errs.__getitem__)
    b2 = opt.betas[1]
    g2 = grads[i] * grads[i]
    v_prev = (opt.v[i] - (1.0 - b2) * g2) / b2
    outlier = g2 > 100.0 * v_prev.clamp_min(0.0)
    e = (device[i] - master[i]) ** 2
    return (names[i], errs[i] / sum(errs), e[outlier].sum().item() / max(e.sum().item(), 1e-300),
            outlier.float().mean().item())


def run(arm: str, seed: int, cfg: dict) -> dict:
    """One arm, one seed: the training curve, the validation curve and the device-weight error."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from zo_megatron.data import build_gpt_datasets, build_tokenizer
    from zo_megatron.data.corpus import default_data_prefix

    torch.set_num_threads(cfg["threads"])
    torch.manual_seed(seed)
    # The shape's vocabulary as the engine's long mode trains it (the corpus's own BPE), else GPT-2's.
    tok = (build_tokenizer(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=dpu_report.corpus_tokenizer(cfg["vocab"]))
           if cfg.get("vocab") else build_tokenizer())
    b, T = cfg["batch"], cfg["train_iters"]
    train_ds, valid_ds, _ = build_gpt_datasets(
        default_data_prefix(tokenizer=tok), "969, 30, 1", cfg["seq"], seed, tok, train_samples=T * b,
        valid_samples=cfg["eval_iters"] * b, test_samples=0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=tok.vocab_size, n_positions=cfg["seq"], n_embd=cfg["hidden"],
                                       n_layer=cfg["layers"], n_head=cfg["heads"], resid_pdrop=0.0,
                                       embd_pdrop=0.0, attn_pdrop=0.0))
    device = list(model.parameters())
    master = [p.detach().clone() for p in device]
    opt = Adam(master, [0.1 if p.dim() >= 2 else 0.0 for p in device], betas=(cfg["beta1"], 0.95),
               nesterov=arm.startswith("nadamw"))
    sched = Schedule(arm, opt, cfg["dpu_warmup_steps"])
    sched.remember([m.clone() for m in master])

    def batch(ds, i):
        items = [ds[j] for j in range(i * b, (i + 1) * b)]
        return (torch.stack([torch.as_tensor(x["tokens"]) for x in items]),
                torch.stack([torch.as_tensor(x["labels"]) for x in items]))

    def loss_of(tokens, labels):
        logits = model(input_ids=tokens).logits
        return torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1))

    @torch.no_grad()
    def set_device(values):
        for p, v in zip(device, values):
            p.copy_(v)

    @torch.no_grad()
    def evaluate() -> float:
        set_device(master)                                      # a flush: the device gets the master
        sched.flushed()
        return sum(loss_of(*batch(valid_ds, i)).item() for i in range(cfg["eval_iters"])) / cfg["eval_iters"]

    names = [n for n, _ in model.named_parameters()]
    out = {"arm": arm, "seed": seed, "train": [], "val": [], "weight_error": [], "weight_error_where": [],
           "grad_norm": []}
    t0 = time.monotonic()
    for k in range(1, T + 1):
        model.zero_grad(set_to_none=True)
        loss = loss_of(*batch(train_ds, k - 1))
        loss.backward()
        with torch.no_grad():
            grads = [p.grad.detach().clone() for p in device]
            nxt, before, norm = update(sched, k, master, device, grads, lr_at(k, cfg), cfg["dc_lambda"])
            set_device(nxt)
        out["train"].append((k, loss.item()))
        out["grad_norm"].append((k, norm))
        if k % cfg["eval_interval"] == 0 or k == T:
            out["val"].append((k, evaluate()))
            print(f"[{arm} seed {seed}] it {k} loss {loss.item():.4f} val {out['val'][-1][1]:.4f} "
                  f"grad_norm {norm:.3f} ({time.monotonic() - t0:.0f} s)", flush=True)
        if (k + 1) % dpu_report.DIAG_EVERY == 0 and k < T:     # the weights iteration k+1 will use
            with torch.no_grad():
                errs = [((p - w) ** 2).sum().item() for p, w in zip(device, master)]
                den = sum(((w - v) ** 2).sum().item() for w, v in zip(master, before))
            out["weight_error"].append((k + 1, math.sqrt(sum(errs) / den) if den > 0 else 0.0))
            if sum(errs) > 0:
                out["weight_error_where"].append((k + 1, *_where(names, errs, device, master, grads, opt)))
    out["final_val_loss"] = out["val"][-1][1]
    out["wall_s"] = time.monotonic() - t0
    return out


# ------------------------------------------------------------------------------------ the CLI
def _weight_error_line(arm: str, by_seed: dict, warmup: int) -> str:
    """The device's mean distance to the exact weights after the delay starts, and where it sits."""
    errs = [v for r in by_seed.values() for it, v in r["weight_error"] if it > warmup]
    where = [w for r in by_seed.values() for w in r.get("weight_error_where", []) if w[0] > warmup]
    line = f"  {arm:28s} weight error after W: " + (f"mean {sum(errs) / len(errs):.3f}, max {max(errs):.3f}"
                                                     if errs else "n/a")
    if where:
        top = max(set(w[1] for w in where), key=[w[1] for w in where].count)
        mine = [w for w in where if w[1] == top]
        line += (f"; mostly in {top} ({len(mine)}/{len(where)} checks, {sum(w[2] for w in mine) / len(mine):.0%} of "
                 f"the error), {sum(w[3] for w in mine) / len(mine):.0%} of that in the "
                 f"{sum(w[4] for w in mine) / len(mine):.2%} of its elements with (c g)^2 > 100 v_(k-1)")
    return line



def _config(args) -> dict:
    shape = dict(dpu_report.MODES[args.shape])
    for key in ("train_iters", "eval_interval"):
        if getattr(args, key) is not None:
            shape[key] = getattr(args, key)
    return {**shape, "shape": args.shape, "dpu_warmup_steps": args.dpu_warmup_steps, "lr": args.lr,
            "min_lr": args.min_lr, "warmup": args.warmup, "eval_iters": args.eval_iters, "beta1": args.beta1,
            "dc_lambda": args.dc_lambda, "threads": args.threads}


def _cached(path: str, key: str):
    if os.path.exists(path):
        with open(path) as f:
            run_ = json.load(f)
        if run_.get("config_key") == key:
            return run_
    return None


def _run_to_file(arm: str, seed: int, cfg: dict, path: str, key: str) -> dict:
    result = run(arm, seed, cfg)
    result["config_key"] = key
    with open(path + ".partial", "w") as f:
        json.dump(result, f)
    os.replace(path + ".partial", path)
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", action="append", choices=ARMS, help="an arm (repeatable; default: exact)")
    ap.add_argument("--shape", choices=sorted(dpu_report.MODES), default="demo")
    ap.add_argument("--seeds", type=int, default=1, help="seeds per arm: --seed, --seed + 1, ...")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--dpu-warmup-steps", type=int, default=40)
    ap.add_argument("--dc-lambda", type=float, default=1.0, help="delay compensation strength (--mode dc)")
    ap.add_argument("--beta1", type=float, default=0.9, help="Adam beta1 of every arm (0.9: the project's)")
    ap.add_argument("--train-iters", type=int, default=None, help="default: the shape's")
    ap.add_argument("--eval-interval", type=int, default=None, help="default: the shape's")
    ap.add_argument("--eval-iters", type=int, default=10)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--min-lr", type=float, default=1e-4)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per run")
    ap.add_argument("--jobs", type=int, default=1, help="runs at once (processes)")
    ap.add_argument("--runs-dir", default=None, help="keep each run's curve here, reused when its settings match "
                                                     "(default: $ZO_MEGATRON_CACHE/dpu_reproduction_runs)")
    ap.add_argument("--out", default=None, help="every curve and the summary as JSON")
    ap.add_argument("--png", default=None, help="the curves with bands over seeds")
    args = ap.parse_args(argv)
    arms = args.mode or ["exact"]
    cfg = _config(args)
    key = hashlib.sha256(json.dumps({k: v for k, v in cfg.items() if k != "threads"}, sort_keys=True)
                         .encode()).hexdigest()[:16]
    seeds = [args.seed + i for i in range(args.seeds)]
    from zo_megatron.data.corpus import default_cache_dir

    runs_dir = args.runs_dir or os.path.join(default_cache_dir(), "dpu_reproduction_runs")
    os.makedirs(runs_dir, exist_ok=True)
    results: dict = {arm: {} for arm in arms}
    todo = []
    for seed in seeds:                      # seed-major: the runs of one seed (paired) finish together
        for arm in arms:
            path = os.path.join(runs_dir, f"{args.shape}_{arm}_seed{seed}_{key}.json")
            hit = _cached(path, key)
            if hit is not None:
                results[arm][seed] = hit
            else:
                todo.append((arm, seed, path))
    if args.jobs <= 1:
        for a, s, p in todo:
            results[a][s] = _run_to_file(a, s, cfg, p, key)
    else:
        with ProcessPoolExecutor(args.jobs, mp_context=get_context("spawn")) as pool:
            futures = {(a, s): pool.submit(_run_to_file, a, s, cfg, p, key) for a, s, p in todo}
            for (a, s), f in futures.items():
                results[a][s] = f.result()
    finals = {arm: {s: r["final_val_loss"] for s, r in by.items()} for arm, by in results.items()}
    for arm, by in results.items():
        for r in by.values():
            r["spikes"] = dpu_report.spike_counts([tuple(x) for x in r["train"]])
    # The targets hold for W=40 at the shape's own length only.
    as_issued = args.dpu_warmup_steps == 40 and cfg["train_iters"] == dpu_report.MODES[args.shape]["train_iters"]
    summary = dpu_report.summary(finals, args.shape if as_issued else "")
    print(f"final validation loss, {args.shape} shape, {cfg['train_iters']} iterations, W={args.dpu_warmup_steps}:")
    print("\n".join(dpu_report.format_summary(summary)))
    for arm, by in results.items():
        print(_weight_error_line(arm, by, args.dpu_warmup_steps))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"config": cfg, "seeds": seeds, "summary": summary, "runs": results}, f)
    if args.png:
        dpu_report.plot({a: {s: {k: [tuple(x) for x in r[k]] for k in ("train", "val", "weight_error")}
                             for s, r in by.items()} for a, by in results.items()}, args.png,
                        f"plain-torch reproduction, {args.shape} shape", args.dpu_warmup_steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
