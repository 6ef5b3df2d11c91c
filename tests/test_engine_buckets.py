"""Bucket bookkeeping of the engine against torch.optim.AdamW, on hand-built models.

What can go wrong when gradients do not arrive in the tidy backward order:
- with gradient accumulation, a parameter unused in the last micro-batch still carries what the
  earlier micro-batches accumulated; buckets may be open and incomplete when backward ends;
- a DP rank may produce gradients for parameters another rank does not touch, so buckets
  complete in a different order on each rank: the reduce-scatters must still be issued in one
  fixed order everywhere, or ranks hang or mix up equal-sized buckets.
Randomized over which parameters the last micro-batch uses and in what order (the backward
order is the reverse of the forward order here), at DP=1 and DP=2 with several tiny buckets;
every element of the updated parameters is compared with torch.
"""
import os

import pytest
import torch

from tests.harness import run_world
from tests.seeds import fresh_seed

# (name, shape): 2-D parameters get weight decay, 1-D ones do not (the engine's rule).
SHAPES = [("w0", (4,)), ("w1", (3, 4)), ("w2", (4,)), ("w3", (4, 5)), ("w4", (8,)), ("w5", (4,)),
          ("w6", (2, 8)), ("w7", (4,))]
BUCKET = 8          # elements: five buckets, w7+w6 | w5+w4 | w3 | w2+w1 | w0
LR, BETAS, EPS, WD, CLIP = 1e-2, (0.9, 0.95), 1e-8, 0.1, 2.0
TRIALS = int(os.environ.get("ZO_BUCKET_TRIALS", "25"))   # trials per test (more: a longer hunt)


class Weights(torch.nn.Module):
    def __init__(self, gen):
        super().__init__()
        for name, shape in SHAPES:
            setattr(self, name, torch.nn.Parameter(torch.randn(shape, generator=gen)))

    def forward(self, xs: dict, order):
        return sum((getattr(self, n) * xs[n]).sum() for n in order)


def _trial_inputs(seed: int, trial: int, dp: int, accum: int):
    """Per DP rank: the micro-batches' coefficients and which params (in order) each one uses."""
    gen = torch.Generator().manual_seed(seed * 1000 + trial)
    names = [n for n, _ in SHAPES]
    ranks = []
    for r in range(dp):
        micro = []
        for m in range(accum):
            xs = {n: torch.randn(s, generator=gen) for n, s in SHAPES}
            if m < accum - 1:
                order = [names[i] for i in torch.randperm(len(names), generator=gen)]
            else:   # the last micro-batch: a random subset in a random order
                keep = torch.rand(len(names), generator=gen) < 0.5
                if r == 0 and dp > 1:   # rank 0 always uses some parameters rank 1 may skip
                    keep[torch.randint(0, len(names), (2,), generator=gen)] = True
                order = [names[i] for i in torch.randperm(len(names), generator=gen) if keep[i]]
            micro.append((xs, order))
        ranks.append(micro)
    return ranks


def _engine_trial(seed, trial, dp, dp_rank, dp_group, accum):
    from zo_megatron.offload.engine import AdamConfig, ZeroOffloadEngine

    gen = torch.Generator().manual_seed(seed * 7 + trial)
    model = Weights(gen)
    init = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine = ZeroOffloadEngine(model, precision="fp32", bucket_size=BUCKET, dp_group=dp_group, clip_grad=CLIP,
                               adam=AdamConfig(lr=LR, beta1=BETAS[0], beta2=BETAS[1], eps=EPS, weight_decay=WD))
    assert len(engine.layout.buckets) == 5
    for m, (xs, order) in enumerate(_trial_inputs(seed, trial, dp, accum)[dp_rank]):
        # A micro-batch that uses no parameter still runs backward (every rank does, every step).
        loss = model(xs, order) if order else torch.zeros((), requires_grad=True)
        engine.backward(loss, last_micro_batch=m == accum - 1)
    res = engine.step()
    out = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine.close()
    return init, out, res.grad_norm


def _reference(init, seed, trial, dp, accum):
    model = torch.nn.Module()
    for n, t in init.items():
        setattr(model, n, torch.nn.Parameter(t.clone()))
    for r, micro in enumerate(_trial_inputs(seed, trial, dp, accum)):
        for xs, order in micro:
            if order:
                (sum((getattr(model, n) * xs[n]).sum() for n in order) / dp).backward()
    params = dict(model.named_parameters())
    for p in params.values():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    norm = torch.nn.utils.clip_grad_norm_(list(params.values()), CLIP).item()
    opt = torch.optim.AdamW([{"params": [p for p in params.values() if p.dim() > 1], "weight_decay": WD},
                             {"params": [p for p in params.values() if p.dim() <= 1], "weight_decay": 0.0}],
                            lr=LR, betas=BETAS, eps=EPS)
    opt.step()
    return {n: p.detach() for n, p in params.items()}, norm


def _check(seed, trial, dp, accum, init, out, norm):
    ref, ref_norm = _reference(init, seed, trial, dp, accum)
    assert abs(norm - ref_norm) <= 1e-5 * ref_norm, (trial, norm, ref_norm)
    for name in ref:
        torch.testing.assert_close(out[name], ref[name], rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"trial {trial}, {name}: {m}")


@pytest.mark.parametrize("accum", [1, 2])
def test_dp1_random_subsets_and_orders_equal_torch(accum):
    seed = fresh_seed(f"dp1 accum{accum}")
    for trial in range(TRIALS):
        init, out, norm = _engine_trial(seed, trial, 1, 0, None, accum)
        _check(seed, trial, 1, accum, init, out, norm)


def _dp2_world(rank, seed, accum):
    from zo_megatron.parallel import init_parallel

    ps = init_parallel(1, seed=seed)
    results = []
    for trial in range(TRIALS):
        results.append(_engine_trial(seed, trial, ps.dp_size, ps.dp_rank, ps.dp_group, accum))
    return results


@pytest.mark.parametrize("accum", [1, 2])
def test_dp2_ranks_using_different_params_equal_torch(accum):
    seed = fresh_seed(f"dp2 accum{accum}")
    outs = run_world(_dp2_world, 2, seed, accum, timeout=240)
    for trial in range(TRIALS):
        init, out, norm = outs[0][trial]
        assert all(torch.equal(out[n], outs[1][trial][1][n]) for n in out), "DP replicas diverged"
        _check(seed, trial, 2, accum, init, out, norm)
