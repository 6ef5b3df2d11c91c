"""tools/bench_nvme.py's CLI at a tiny size: it measures both numbers, moves the bytes the pass must move
(12 B each way per element: fp32 master and moments, each chunk padded to 4 KiB), and its passes on
disk end bitwise equal to the in-memory kernel (the tool checks and fails otherwise)."""
import json

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
