"""tools/bench_nvme.py's CLI at a tiny size: it measures both numbers, moves the bytes the pass must move
(12 B each way per element: fp32 master and moments, each chunk padded to 4 KiB), and its passes on
disk end bitwise equal to the in-memory kernel (the tool checks and fails otherwise)."""
import json
import os
import random

import pytest

from tests.cli import run_tool
from tests.seeds import fresh_seed


def test_bench_nvme_measures_the_ceiling_and_an_exact_pass(tmp_path):
    out = tmp_path / "r.json"
    n = 100_000
    r = run_tool("bench_nvme", "--dir", tmp_path, "--ceiling-mib", "4", "--elements", str(n), "--buffer-size", "16K",
                 "--passes", "2", "--json", out)
    assert r.returncode == 0, r.stderr
    res = json.loads(out.read_text())
    c, p = res["ceiling"], res["pass"]
    assert c["bytes"] == 4 << 20 and c["write_gbps"] > 0 and c["read_gbps"] > 0 and len(c["runs"]) == 2
    assert c["read_gbps"] == max(r["read_gbps"] for r in c["runs"])
    assert p["bitwise_equal"] and p["chunks"] >= -(-n // 16384)
    for moved in (p["read_bytes"], p["written_bytes"]):          # one pass, three fp32 states
        assert 12 * n <= moved <= 12 * n + p["chunks"] * 3 * 4096
    assert 0 < p["of_ceiling"] and len(p["pass_s_all"]) == 2
    assert "states bitwise equal" in r.stdout and "of the ceiling" in r.stdout
    assert [f.name for f in tmp_path.iterdir()] == ["r.json"]   # nothing left behind


@pytest.mark.slow       # three tiny jobs under torchrun: 1-3 min here
def test_bench_nvme_job_mode_times_whole_jobs_that_train_alike(tmp_path):
    """--job: one real job per arm (states in memory, moments on disk, moments + master on disk); the
    arms train the same losses bit for bit (the tier is exact), each step moves the bytes the states
    on disk hold (n partition elements x 8 B for fp32 moments, 12 B with the master, chunks padded
    to 4 KiB; n counted here from GPT-2's shape), and the ratios are to the in-memory arm."""
    out = tmp_path / "r.json"
    layers, hidden, seq = 1, 64, 32
    r = run_tool("bench_nvme", "--job", "--no-dpu-arms", "--dir", tmp_path, "--ceiling-mib", "4", "--num-layers",
                 str(layers), "--hidden-size", str(hidden), "--num-attention-heads", "4", "--seq-length", str(seq),
                 "--train-iters", "3", "--warmup", "1", "--buffer-size", "65536", "--json", out)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    arms = {j["arm"]: j for j in res["jobs"]}
    assert list(arms) == ["memory", "moments on disk", "moments + master on disk"]
    n = -(-50257 // 128) * 128 * hidden + seq * hidden + layers * (12 * hidden ** 2 + 13 * hidden) + 2 * hidden
    chunks = -(-n // 65536)
    for name, per_elem in (("moments on disk", 8), ("moments + master on disk", 12)):
        j = arms[name]
        assert per_elem * n <= j["read_bytes_per_step"] == j["written_bytes_per_step"] <= per_elem * n + chunks * 3 * 4096
        assert j["loss"] == arms["memory"]["loss"] and len(j["loss"]) == 3
        assert j["over_memory"] == j["step_s"] / arms["memory"]["step_s"] and j["step_s"] > 0
    assert arms["memory"]["read_bytes_per_step"] == 0 and arms["memory"]["over_memory"] == 1.0
    assert "x memory" in r.stdout and [f.name for f in tmp_path.iterdir()] == ["r.json"]


def _bench_module():
    import importlib
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))
    return importlib.import_module("bench_nvme")


def test_job_modes_dpu_arms_are_delayed_in_every_timed_iteration(tmp_path, monkeypatch):
    """--job's --dpu arms start the delay at update --warmup (a 6-iteration run never left DPU's 40
    exact warm-up updates before, so those arms timed the synchronous step), and an arm whose log says
    a timed iteration was not delayed fails the tool instead of being reported."""
    import argparse
    import subprocess as sp

    bench = _bench_module()
    warmup = random.Random(fresh_seed("bench_nvme dpu arms")).randint(1, 4)
    a = argparse.Namespace(num_layers=1, hidden_size=64, num_attention_heads=4, seq_length=32, micro_batch_size=1,
                           nproc=1, train_iters=warmup + 3, precision="fp32", buffer_size="64K", buffer_count=2,
                           dpu_arms=True, overlap_arms=True, warmup=warmup, timeout=60)
    seen, real_job_arm = [], bench.job_arm
    monkeypatch.setattr(bench, "job_arm", lambda d, model, flags, a, tag: seen.append((tag, flags)) or
                        {"arm": tag, "flags": flags, "step_s": 1.0})
    bench.jobs(str(tmp_path), a)
    dpu = [f for tag, f in seen if "--dpu" in f]
    assert len(dpu) == 3 and all(f[f.index("--dpu-warmup-steps") + 1] == str(warmup) for f in dpu), seen
    assert sum("--overlap-cpu-step" in f for _, f in seen) == 3 and len(seen) == 9

    def fake_run(cmd, **kw):                       # a job whose log has one timed iteration not delayed
        log = cmd[cmd.index("--log-jsonl") + 1]
        with open(log, "w") as f:
            for i in range(a.train_iters):
                f.write(json.dumps({"kind": "train", "step_time_s": 1.0, "loss": 1.0,
                                    "delayed_update": i != a.train_iters - 1}) + "\n")
        return sp.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(bench.subprocess, "run", fake_run)
    with pytest.raises(SystemExit, match="were not all delayed"):
        real_job_arm(str(tmp_path), [], ["--dpu"], a, "memory + --dpu")
