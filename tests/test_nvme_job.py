"""The job with --optimizer-nvme-path (issue 38): the same losses and grad norms as the in-memory job,
bit for bit (one rank, bf16, bf16 states and the master on disk, eval included; TP x DP and the other
cases are tests/test_nvme_engine.py's), the banner says where the states live
and warns when DIR is RAM-backed, DIR is empty after a clean exit; the flags' conflicts are one line,
exit 2."""
import os

import pytest

from tests.test_pretrain import TINY, _rows, _single


def test_job_with_states_on_disk_equals_the_in_memory_job(tmp_path):
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    nvme = os.path.join(shm or str(tmp_path), f"zo-nvme-job-{os.getpid()}")
    os.makedirs(nvme)
    common = ["--zero-offload", "--bf16", "--mock-data", "--train-iters", "3", *TINY, "--eval-interval", "2",
              "--exp-avg-dtype", "bf16", "--exp-avg-sq-dtype", "bf16", "--clip-grad", "0.1"]
    rows, out, io = {}, {}, {}
    try:
        for name, extra in (("memory", []), ("nvme", ["--optimizer-nvme-path", nvme, "--optimizer-nvme-master",
                                                      "--optimizer-nvme-buffer-size", "4096",
                                                      "--optimizer-nvme-buffer-count", "3"])):
            log = tmp_path / f"{name}.jsonl"
            r = _single([*common, *extra, "--log-jsonl", str(log)], tmp_path)    # DP > 1: test_nvme_engine.py
            assert r.returncode == 0, name + r.stderr[-3000:]
            rows[name] = [(x["loss"], x["grad_norm"], x["skipped"]) for x in _rows(log, "train")]
            io[name] = [(x.get("nvme_read_bytes_per_step"), x.get("nvme_written_bytes_per_step"),
                         x.get("nvme_io_wait_s_per_step")) for x in _rows(log, "train")]
            out[name] = r.stdout
        left = os.listdir(nvme)
    finally:
        for f in os.listdir(nvme):
            os.unlink(os.path.join(nvme, f))
        os.rmdir(nvme)
    assert len(rows["nvme"]) == 3 and rows["nvme"] == rows["memory"], rows
    line = next(x for x in out["nvme"].splitlines() if "optimizer states on disk" in x)
    assert "exp_avg (bf16), exp_avg_sq (bf16), fp32 master in " + nvme in line and "I/O ring 3 x 4096" in line
    assert ("is on tmpfs, which is host memory" in out["nvme"]) == (shm is not None)
    assert left == []                                          # the state files go at a clean exit
    # the progress line: the disk traffic per iteration and the exposed I/O wait, only with the tier
    iters = {k: [x for x in v.splitlines() if " iter " in x and " loss " in x] for k, v in out.items()}
    assert iters["nvme"] and all(" disk read " in x and " written " in x and " waited " in x for x in iters["nvme"])
    assert iters["memory"] and not any(" disk read " in x for x in iters["memory"])
    said = [x for x in out["nvme"].splitlines() if "TB per day over its 1 ranks" in x]
    assert len(said) == 1 and "GB written per step per rank" in said[0], out["nvme"][-2000:]
    assert all(x == (None, None, None) for x in io["memory"])   # the I/O fields only with the tier
    first, *rest = io["nvme"]                                  # the first row also wrote the initial states
    assert first[1] == 2 * first[0] > 0, io["nvme"]
    for read, written, wait in rest:                           # every step reads and writes each state once
        assert read == written == first[0] and wait >= 0.0, io["nvme"]


@pytest.mark.parametrize("extra,needle", [
    (["--optimizer-nvme-master"], "--optimizer-nvme-master applies to the optimizer states on disk: add "
                                  "--optimizer-nvme-path DIR"),
    (["--optimizer-nvme-path", "{d}"], "--optimizer-nvme-path puts the CPU optimizer's states on disk: add --zero-offload"),
    (["--zero-offload", "--optimizer-nvme-path", "{d}/nope"], "is not a directory"),
    (["--zero-offload", "--optimizer-nvme-path", "{d}", "--optimizer-nvme-buffer-size", "100"], "multiple of 64"),
], ids=["master-alone", "no-offload", "missing-dir", "buffer-size"])
def test_nvme_flag_conflicts_are_one_line(tmp_path, extra, needle):
    r = _single([*TINY, "--train-iters", "1", "--lr-warmup-iters", "0", *[a.format(d=tmp_path) for a in extra]], tmp_path)
    lines = [x for x in r.stderr.splitlines() if x.startswith("error:")]
    assert r.returncode == 2 and len(lines) == 1 and needle in lines[0], r.stderr[-2000:]
    assert "Traceback" not in r.stderr
