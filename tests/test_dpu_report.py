"""Issue 37: the DPU convergence report's statistics (tools/dpu_report.py) and the arms of the
plain-torch reproduction (tools/dpu_reproduction.py) against float64 references of their own
definitions on a tiny problem (a random quadratic; seconds)."""
import json
import math
import os
import statistics
import sys

import numpy as np
import pytest
import torch

from tests.seeds import fresh_seed

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))
import dpu_report  # noqa: E402
import dpu_reproduction as repro  # noqa: E402

B1, B2, EPS, WD = 0.9, 0.95, 1e-8, 0.1


# ------------------------------------------------------------------------------ the statistics
def test_seed_statistics_and_the_paired_gap_with_its_uncertainty():
    exact = {1: 5.0, 2: 5.2, 3: 4.9}
    arm = {1: 5.1, 2: 5.5, 3: 5.0, 4: 9.9}                 # seed 4 has no exact partner: left out
    s = dpu_report.seed_stats(list(exact.values()))
    assert s["n"] == 3 and s["mean"] == pytest.approx(np.mean([5.0, 5.2, 4.9])) and s["std"] == pytest.approx(statistics.stdev([5.0, 5.2, 4.9]))
    g = dpu_report.gap_to_exact(arm, exact)
    d, me = [0.1, 0.3, 0.1], np.mean([5.0, 5.2, 4.9])
    assert g["seeds"] == [1, 2, 3]
    assert g["gap"] == pytest.approx(np.mean(d) / me)
    assert g["gap_se"] == pytest.approx(np.std(d, ddof=1) / math.sqrt(3) / me)
    assert g["gap_2sigma"] == pytest.approx(2 * g["gap_se"])
    assert g["per_seed_gap"] == pytest.approx([0.1 / 5.0, 0.3 / 5.2, 0.1 / 4.9])
    assert g["exact_spread"] == pytest.approx(np.std([5.0, 5.2, 4.9], ddof=1))
    assert g["within_exact_spread"] is False               # 0.167 behind > the exact spread 0.153


def test_targets_and_one_seed():
    one = dpu_report.gap_to_exact({7: 5.05}, {7: 5.0})
    assert one["gap_se"] is None and one["exact_spread"] is None and one["gap"] == pytest.approx(0.01)
    assert dpu_report.meets_target(one, "demo") is True
    assert dpu_report.meets_target(one, "long") is False      # 1% > 0.5%, and no spread to be within
    assert dpu_report.meets_target(one, "") is None
    close = dpu_report.gap_to_exact({1: 5.01, 2: 5.21, 3: 4.91}, {1: 5.0, 2: 5.2, 3: 4.9})
    assert close["within_exact_spread"] and dpu_report.meets_target(close, "long")
    rows = dpu_report.summary({"exact": {1: 5.0, 2: 5.2, 3: 4.9}, "dpu": {1: 5.5, 2: 5.6, 3: 5.4}}, "demo")
    assert "gap_to_exact" not in rows["exact"] and rows["dpu"]["meets_target"] is False
    assert len(dpu_report.format_summary(rows)) == 2


def test_loss_spikes_against_a_hand_count():
    seed = fresh_seed("spikes")
    rng = np.random.default_rng(seed)
    base = 6.0 - np.arange(60) * 0.01 + rng.uniform(-0.05, 0.05, 60)   # < 2% noise: never a spike
    planted = [23, 41, 42]
    for i in planted:
        base[i - 1] *= 1.2
    curve = [(i + 1, float(v)) for i, v in enumerate(base)]
    counts = dpu_report.spike_counts(curve)
    assert counts["iterations"] == planted and counts["total"] == 3
    assert counts["per_window"] == {10: 0, 20: 0, 30: 1, 40: 0, 50: 2, 60: 0}
    it, mean, lo, hi = dpu_report.band([[(1, 1.0), (2, 2.0)], [(1, 3.0), (2, 4.0), (3, 9.0)]])
    assert it == [1, 2] and mean == [2.0, 3.0] and lo == [1.0, 2.0] and hi == [3.0, 4.0]


# ----------------------------------------------------------------- the reproduction's arms
def _quadratic(seed, shapes=((6, 5), (7,))):
    """f(p) = sum_i 0.5 (p_i - c_i)^T H_i (p_i - c_i): gradients H_i (p_i - c_i)."""
    rng = np.random.default_rng(seed)
    hs, cs, w0 = [], [], []
    for shape in shapes:
        n = int(np.prod(shape))
        a = rng.normal(size=(n, n))
        hs.append(a @ a.T / n * 3 + np.eye(n) * 0.1)
        cs.append(rng.normal(size=n))
        w0.append(rng.normal(size=n) * 0.5)
    return shapes, hs, cs, w0


def _grad(hs, cs, ps):
    return [h @ (p - c) for h, c, p in zip(hs, cs, ps)]


def _lr(k):
    return 0.05 * (0.6 + 0.4 * math.cos(k))


def _reference(hs, cs, w0, wds, steps, warmup, arm):
    """float64, straight from the definitions (docs: the mitigation study, sections 0 and 4A):
    AdamW state m, v, w; the device p_{k+1} = w_{k+1} before the W-th update, then
    fresh-gradient: P_k - lr (1-b1)/(1-b1^k) c g_k D', P_k = w_k - lr [wd w_k + b1 m_{k-1}/(1-b1^k) D'],
    D' = 1/(sqrt(v_{k-1}/(1-b2^k)) + eps); delayed: w_k."""
    w = [x.copy() for x in w0]
    p = [x.copy() for x in w0]
    m = [np.zeros_like(x) for x in w0]
    v = [np.zeros_like(x) for x in w0]
    devices = []
    for k in range(1, steps + 1):
        g = _grad(hs, cs, p)
        norm = math.sqrt(sum(float(x @ x) for x in g))
        c = min(1.0, 1.0 / (norm + 1e-6))
        g = [x * c for x in g]
        lr, bc1, bc2 = _lr(k), 1 - B1 ** k, 1 - B2 ** k
        Dp = [1 / (np.sqrt(vv / bc2) + EPS) for vv in v]              # D' from v_{k-1}
        fg = [ww - lr * (wd * ww + B1 * mm / bc1 * d) - lr * (1 - B1) / bc1 * gg * d
              for ww, mm, gg, d, wd in zip(w, m, g, Dp, wds)]
        old = [x.copy() for x in w]
        m = [B1 * mm + (1 - B1) * gg for mm, gg in zip(m, g)]
        v = [B2 * vv + (1 - B2) * gg * gg for vv, gg in zip(v, g)]
        w = [ww - lr * (wd * ww + mm / bc1 / (np.sqrt(vv / bc2) + EPS)) for ww, mm, vv, wd in zip(w, m, v, wds)]
        if k < warmup:
            p = [x.copy() for x in w]
        else:
            p = fg if arm == "fresh-gradient" else old
        devices.append([x.copy() for x in p])
    return devices


def _run_arm(hs, cs, w0, wds, steps, warmup, arm):
    """The reproduction's own update() and Schedule, in fp32, on the same problem."""
    master = [torch.tensor(x, dtype=torch.float32) for x in w0]
    opt = repro.Adam(master, wds, betas=(B1, B2), eps=EPS, nesterov=arm.startswith("nadamw"))
    sched = repro.Schedule(arm, opt, warmup)
    sched.remember([x.clone() for x in master])
    device = [x.clone() for x in master]
    devices = []
    for k in range(1, steps + 1):
        grads = [torch.tensor(g, dtype=torch.float32) for g in _grad(hs, cs, [d.double().numpy() for d in device])]
        nxt, _, _ = repro.update(sched, k, master, device, grads, _lr(k))
        device = [x.clone() for x in nxt]
        devices.append([d.double().numpy() for d in device])
    return devices


@pytest.mark.parametrize("arm", ["fresh-gradient", "delayed"])
def test_the_fresh_gradient_oracle_matches_its_float64_definition(arm):
    seed = fresh_seed(f"fresh-gradient reference ({arm})")
    shapes, hs, cs, w0 = _quadratic(seed)
    wds = [WD, 0.0]
    steps, warmup = 14, 4
    ref = _reference(hs, cs, w0, wds, steps, warmup, arm)
    got = _run_arm(hs, cs, w0, wds, steps, warmup, arm)
    for k, (r, g) in enumerate(zip(ref, got), start=1):
        for rt, gt in zip(r, g):
            scale = max(1.0, float(np.abs(rt).max()))
            assert np.abs(rt - gt).max() <= 2e-5 * scale, (arm, k, np.abs(rt - gt).max())


def test_the_fresh_gradient_formula_with_the_fresh_denominator_is_adamw():
    """p = P_k - lr (1-b1)/(1-b1^k) g D with D = D_k (v_k, not v_{k-1}) is exactly AdamW's w_{k+1}:
    the only difference of the oracle to exact updates is the staleness of v (float64)."""
    seed = fresh_seed("fresh-gradient identity")
    gen = torch.Generator().manual_seed(seed)
    w, m, v, g = (torch.randn(50, generator=gen, dtype=torch.float64) for _ in range(4))
    v = v.abs()
    k, lr = 7, 3e-3
    opt = repro.Adam([w], [WD], betas=(B1, B2), eps=EPS)
    opt.m[0].copy_(m)
    opt.v[0].copy_(v)
    opt.k = k                                              # the next step is k + 1
    v_new = B2 * v + (1 - B2) * g * g
    p = repro.fresh_gradient_weights(w, m, g, repro.adam_denominator(v_new, k + 1, B2, EPS), lr=lr, wd=WD,
                                     beta1=B1, step=k + 1)
    exact = w.clone()
    opt.step([exact], [g.clone()], lr)
    torch.testing.assert_close(p, exact, rtol=1e-12, atol=1e-14)


def test_the_reproduction_adamw_is_torchs_and_nadamw_its_definition():
    seed = fresh_seed("reproduction AdamW")
    gen = torch.Generator().manual_seed(seed)
    p0 = [torch.randn(5, 4, generator=gen, dtype=torch.float64), torch.randn(3, generator=gen, dtype=torch.float64)]
    grads = [[torch.randn_like(x) for x in p0] for _ in range(5)]
    mine = [x.clone() for x in p0]
    theirs = [x.clone().requires_grad_() for x in p0]
    torch_opt = torch.optim.AdamW([{"params": [theirs[0]], "weight_decay": WD}, {"params": [theirs[1]], "weight_decay": 0.0}],
                                  lr=1e-2, betas=(B1, B2), eps=EPS, foreach=False)
    opt = repro.Adam(mine, [WD, 0.0], betas=(B1, B2), eps=EPS)
    nad = [x.clone() for x in p0]
    nopt = repro.Adam(nad, [WD, 0.0], betas=(B1, B2), eps=EPS, nesterov=True)
    w, m, v = [x.numpy().copy() for x in p0], [np.zeros(x.shape) for x in p0], [np.zeros(x.shape) for x in p0]
    for k, gs in enumerate(grads, start=1):
        for t, g in zip(theirs, gs):
            t.grad = g.clone()
        torch_opt.step()
        opt.step(mine, [g.clone() for g in gs], 1e-2)
        nopt.step(nad, [g.clone() for g in gs], 1e-2)
        for i, (g, wd) in enumerate(zip(gs, [WD, 0.0])):     # NAdamW, constant beta1 (proposal 4B)
            g = g.numpy()
            m[i] = B1 * m[i] + (1 - B1) * g
            v[i] = B2 * v[i] + (1 - B2) * g * g
            u = (B1 * m[i] / (1 - B1 ** (k + 1)) + (1 - B1) * g / (1 - B1 ** k)) / (np.sqrt(v[i] / (1 - B2 ** k)) + EPS)
            w[i] = w[i] * (1 - 1e-2 * wd) - 1e-2 * u
    for a, b in zip(mine, theirs):
        torch.testing.assert_close(a, b.detach(), rtol=1e-12, atol=1e-14)
    for a, b in zip(nad, w):
        np.testing.assert_allclose(a.numpy(), b, rtol=1e-12, atol=1e-14)


# ------------------------------------------------------------ the convergence tool's report
def test_the_convergence_report_cost_and_diagnostics_from_runs():
    import argparse

    import dpu_convergence as conv

    def run(final, tps, host, err):
        train = [(i, 6.0 - 0.01 * i) for i in range(1, 61)]
        return {"train": train, "val": [(30, final + 0.5), (60, final)], "final_val_loss": final,
                "weight_error": [(i, err) for i in range(10, 61, 10)], "median_tokens_per_s": tps,
                "host_model_state_bytes": host, "device_model_state_bytes": 100, "host_peak_bytes_max": host + 7,
                "spikes": dpu_report.spike_counts(train)}

    runs = {"exact": {1: run(5.0, 100.0, 1000, 0.0), 2: run(5.2, 110.0, 1000, 0.0)},
            "dpu": {1: run(5.5, 150.0, 1400, 1.0), 2: run(5.6, 160.0, 1400, 1.0)},
            "dpu+weight-prediction": {1: run(5.2, 140.0, 1800, 0.3), 2: run(5.4, 150.0, 1800, 0.2)}}
    args = argparse.Namespace(mode="demo", dpu_warmup_steps=40, train_iters=None, nproc=1, tensor_parallel=1,
                              jobs=1, tolerance=0.02)
    out = conv.report(runs, args, "fp32", [])
    assert out["best"] == "dpu+weight-prediction" and out["final_val_loss_exact"] == pytest.approx(5.1)
    assert out["relative_gap"] == pytest.approx(0.45 / 5.1) and not out["within_tolerance"]
    c = out["cost"]
    assert c["dpu"]["tokens_per_s_vs_exact"] == pytest.approx(155 / 105)
    assert c["dpu+weight-prediction"]["tokens_per_s_vs_dpu"] == pytest.approx(145 / 155)
    assert c["dpu+weight-prediction"]["extra_host_bytes"] == 800 and c["dpu"]["extra_device_bytes"] == 0
    d = out["diagnostics"]
    assert d["dpu+weight-prediction"]["mean_weight_error_after_warmup"] == pytest.approx(0.25)
    assert d["exact"]["mean_weight_error_after_warmup"] == 0.0 and d["dpu"]["spikes_per_seed"] == {1: 0, 2: 0}
    assert out["summary"]["dpu"]["meets_target"] is False
    long_flags = conv.mode_flags("long", None, None)
    assert long_flags[long_flags.index("--train-iters") + 1] == "2000" and "--num-layers" in long_flags
    assert "--num-layers" not in conv.mode_flags("demo", None, None)


def test_the_demo_timeline_is_drawn_from_the_files_kept_beside_the_logs(tmp_path, capsys):
    """A --reuse of committed logs has no live --timeline: the tool draws dpu_timeline.png from the copy
    the dpu run left in the runs directory, and without one says so in a line instead of failing."""
    import dpu_convergence as conv

    runs, out = tmp_path / "runs", tmp_path / "out"
    runs.mkdir()
    out.mkdir()
    conv._timeline(str(runs), str(out), 2)
    assert "not redrawn" in capsys.readouterr().out and not (out / "dpu_timeline.png").exists()
    for rank in (0, 1):                  # the lines pretrain_gpt.py --timeline writes, per rank
        with open(runs / f"{conv.TIMELINE}.rank{rank}", "w") as f:
            for it in range(1, 12):
                for j, phase in enumerate(("forward", "backward", "cpu_step")):
                    f.write(json.dumps({"rank": rank, "iteration": it, "phase": phase,
                                        "start": it + 0.3 * j, "end": it + 0.3 * j + 0.25}) + "\n")
    conv._timeline(str(runs), str(out), 2)
    assert (out / "dpu_timeline.png").stat().st_size > 0
