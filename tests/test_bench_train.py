"""tools/bench_train.py end to end on a tiny GPT: the JSON contract and the fairness check.

The tool runs (in a subprocess, as a user would) 2 steps of every variant at world 1 and DP=2 in
fp32, in the compute-bound regime (both under `make test-all`): one command runs several worlds one
after another, and none may inherit
another's process-group state (DeepSpeed caches its groups in module globals). Checked: the JSON
rows carry the issue's keys with the right types for every variant present, bytes on the wire are
zero at one rank and positive at two, and every variant's `loss_after` (the loss on a held-out
batch after the steps, all variants starting from the same weights) agrees with every other's to
1e-4 relative, and so does the norm of every variant's parameter change (matrices and vectors,
counted once over the ranks) to 1e-3 -- zo_megatron's engines against HF GPT-2 under torch DDP and
DeepSpeed are the independent references for each other. Timings are not asserted. The learning rate is 2e-3 (the
tool's default since its loss check compares loss changes) so that a variant that skips part of the update (e.g. the biases and
LayerNorms, a 1e-4 move each) misses the 1e-4 check by far, and the steps must lower the held-out
loss by over 1% (the tool's Zipf-distributed tokens are learnable; uniform ones were not).

DeepSpeed joins when it imports and its CPU Adam op is already built (building it takes
minutes: `docs/performance.md`); without deepspeed its row must say skipped and why.
"""
import json
import math
import os
import subprocess
import sys

import pytest

from tests.seeds import fresh_seed

pytest.importorskip("transformers")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KEYS = {"variant": str, "tp": int, "dp": int, "precision": str, "median_step_s": float, "tokens_per_s": float,
        "loss_after": float, "comm_bytes_per_rank": int}


def _deepspeed_state() -> str:
    """'ready' (importable, CPU Adam op built), 'unbuilt' or 'missing'."""
    probe = ("import os, sys; os.environ.setdefault('DS_ACCELERATOR', 'cpu')\n"
             "try:\n import deepspeed\nexcept Exception:\n print('missing'); sys.exit()\n"
             "from deepspeed.ops.op_builder import CPUAdamBuilder\n"
             "from torch.utils.cpp_extension import _get_build_directory\n"
             "d = _get_build_directory(CPUAdamBuilder().name, False)\n"
             "print('ready' if any(f.endswith('.so') for f in os.listdir(d)) else 'unbuilt')\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    return (out.stdout.strip().splitlines() or ["missing"])[-1]


# `make test`: the compute-bound regime; `make test-all` adds the optimizer-bound one (the same
# variants and checks at other shapes; docs/testing.md)
@pytest.mark.parametrize("regime", [pytest.param("compute-bound", id="compute-bound"),
                                    pytest.param("both", id="both-regimes", marks=pytest.mark.slow)])
def test_bench_train_json_and_loss_agreement(tmp_path, regime):
    seed = fresh_seed("bench_train tiny")
    ds = _deepspeed_state()
    variants = ["zo_offload", "zo_offload_f0.5", "zo_baseline", "torch_ddp"]
    if ds in ("ready", "missing"):       # missing: the tool must mark the row skipped
        variants.append("deepspeed_offload")
    out = tmp_path / "bench.json"
    cmd = [sys.executable, os.path.join(REPO, "tools", "bench_train.py"), "--worlds", "1,dp2", "--precision", "fp32",
           "--regime", regime, "--layers", "2", "--hidden", "64", "--heads", "4", "--vocab", "512",
           "--steps", "2", "--warmup", "0", "--seed", str(seed), "--lr", "2e-3", "--variants", ",".join(variants),
           "--json", str(out)]
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), DS_ACCELERATOR="cpu")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert os.path.getsize(tmp_path / "bench.png") > 0
    rows = [r for r in data["rows"] if not r.get("skipped")]
    skipped = [r for r in data["rows"] if r.get("skipped")]
    regimes = ("compute-bound", "optimizer-bound") if regime == "both" else (regime,)
    if ds == "missing":
        assert [r["variant"] for r in skipped] == ["deepspeed_offload"] * 2 * len(regimes)
        assert all("deepspeed" in r["skipped"] for r in skipped)
    else:
        assert skipped == []
    measured = [v for v in variants if ds == "ready" or v != "deepspeed_offload"]
    for regime, world, ranks in [(g, w, n) for g in regimes
                                 for w, n in (("1", 1), ("dp2", 2))]:
        mine = [r for r in rows if r["world"] == world and r["regime"] == regime]
        assert sorted(r["variant"] for r in mine) == sorted(measured)
        for r in mine:
            for k, t in KEYS.items():
                assert isinstance(r[k], t), (r["variant"], k, r[k])
            assert (r["tp"], r["dp"], r["precision"]) == (1, ranks, "fp32")
            assert r["median_step_s"] > 0 and r["tokens_per_s"] > 0 and math.isfinite(r["loss_after"])
            assert (r["comm_bytes_per_rank"] > 0) == (ranks > 1), (r["variant"], world, r["comm_bytes_per_rank"])
        # the fairness check: same weights, batches, clipping and AdamW -> the same loss, pairwise
        for a in mine:
            for b in mine:
                rel = abs(a["loss_after"] - b["loss_after"]) / abs(b["loss_after"])
                assert rel <= 1e-4, (regime, world, a["variant"], a["loss_after"], b["variant"], b["loss_after"])
        # all started from the same weights, and the steps moved them: down, by far more than the
        # check's visibility floor (10x the spread of loss_before, >= 1e-6 of the loss), so the
        # verdict cannot hinge on the seed -- on uniform tokens the held-out loss moved by noise of
        # either sign (-5.8e-5 at seed 1838021242: INCONCLUSIVE, a chance CI failure)
        for r in mine:
            assert abs(r["loss_before"] - mine[0]["loss_before"]) <= 1e-5 * abs(mine[0]["loss_before"]), r["variant"]
            assert r["loss_change"] > 1e-2 * r["loss_before"], (regime, world, r["variant"], r["loss_change"])
        # the parameters' change, counted once per parameter over TP and DP: HF GPT-2 under DDP holds
        # the whole model on every rank, ours splits it, and the norms of the update agree pairwise
        for g in ("matrices", "vectors"):
            for a in mine:
                assert a[f"update_norm_{g}"] > 0, (a["variant"], g)
                for b in mine:
                    rel = abs(a[f"update_norm_{g}"] - b[f"update_norm_{g}"]) / b[f"update_norm_{g}"]
                    assert rel <= 1e-3, (regime, world, g, a["variant"], a[f"update_norm_{g}"], b["variant"],
                                         b[f"update_norm_{g}"])


def test_a_world_whose_picked_port_was_taken_starts_again_on_a_fresh_one(monkeypatch):
    """tools/bench_train_runner.run_world picks a free port that rank 0 binds seconds later; where
    another process took it (EADDRINUSE) the world is started again, up to twice, and any other
    failure is raised as it is."""
    import torch.multiprocessing as mp

    monkeypatch.syspath_prepend(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))
    import bench_train_runner as R

    calls = []

    def once(job, fail=("EADDRINUSE",)):
        calls.append(job)
        if len(calls) <= len(fail):
            raise mp.ProcessRaisedException(f"torch.distributed.DistNetworkError: ... {fail[len(calls) - 1]} ...", 0, 1)
        return {"ok": len(calls)}

    monkeypatch.setattr(R, "_run_world_once", once)
    assert R.run_world({"tp": 1, "dp": 1}) == {"ok": 2} and len(calls) == 2
    calls.clear()
    monkeypatch.setattr(R, "_run_world_once", lambda job: once(job, ("EADDRINUSE",) * 3))
    with pytest.raises(mp.ProcessRaisedException, match="EADDRINUSE"):
        R.run_world({"tp": 1, "dp": 1})
    assert len(calls) == 3
    calls.clear()
    monkeypatch.setattr(R, "_run_world_once", lambda job: once(job, ("out of memory",)))
    with pytest.raises(mp.ProcessRaisedException, match="out of memory"):
        R.run_world({"tp": 1, "dp": 1})
    assert len(calls) == 1
