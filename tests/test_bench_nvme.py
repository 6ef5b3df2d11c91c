"""tools/bench_nvme.py's CLI at a tiny size: it measures both numbers, moves the bytes the pass must move
(12 B each way per element: fp32 master and moments, each chunk padded to 4 KiB), and its passes on
disk end bitwise equal to the in-memory kernel (the tool checks and fails otherwise)."""
import json

import pytest

from tests.cli import run_tool


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
