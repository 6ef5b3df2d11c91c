"""A bad command line under each launcher: our one `error:` line is what the reader is left with.

torchrun: its own summary ("Root Cause (first observed failure)") names our line instead of
"error_file: <N/A>", and torchrun exits 1 (its status, whatever the workers' were); mpirun:
our line once, exit 2; plain python: our line last, exit 2 (docs/launch.md)."""
import os
import re
import shutil
import subprocess
import sys

import pytest

from tests.test_pretrain import SCRIPT, TORCHRUN, _clean_env

SHAPE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
         "--train-iters", "2"]


def _root_cause(stderr: str) -> str:
    m = re.search(r"Root Cause \(first observed failure\):\n(.*?)\n=+", stderr, re.S)
    assert m, stderr[-3000:]
    return m.group(1)


@pytest.mark.parametrize("extra, line", [
    (["--lr", "-1"], "error: --lr -1.0 is out of range: it must be > 0"),
    (["--no-such-flag"], "pretrain_gpt.py: error: unrecognized arguments: --no-such-flag"),
], ids=["bad value", "unknown flag"])
def test_torchrun_summary_names_our_error_line_as_the_root_cause(tmp_path, extra, line):
    r = subprocess.run([TORCHRUN, "--standalone", "--nproc-per-node=2", SCRIPT, *SHAPE, *extra],
                       env=_clean_env(tmp_path), capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, r.stderr[-3000:]            # torchrun's own status for a failed worker
    root = _root_cause(r.stderr)
    assert f"traceback : {line}" in root and "exitcode  : 2" in root, root
    assert "<N/A>" not in root, root
    # printed once by the job (rank 0), besides the summary's copies
    assert sum(ln.startswith(line) for ln in r.stderr.splitlines()) == 1, r.stderr[-3000:]


def test_plain_python_ends_with_the_error_line_and_exits_2(tmp_path):
    r = subprocess.run([sys.executable, SCRIPT, *SHAPE, "--lr", "-1"], env=_clean_env(tmp_path),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1] == "error: --lr -1.0 is out of range: it must be > 0"


def test_mpirun_prints_the_line_once_and_exits_2(tmp_path):
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    mpiexec = mpiexec if os.path.exists(mpiexec) else shutil.which("mpiexec")
    if mpiexec is None:
        pytest.skip("mpiexec not found: pip install 'zo_megatron[mpi]'")
    env = _clean_env(tmp_path)
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    r = subprocess.run([mpiexec, "-n", "2", "--oversubscribe", "--bind-to", "none", sys.executable, SCRIPT, *SHAPE,
                        "--lr", "-1"], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    out = r.stdout + r.stderr
    assert out.count("error: --lr -1.0 is out of range") == 1, out[-2000:]


@pytest.mark.parametrize("extra, line", [
    (["--lr", "-1"], "error: --lr -1.0 is out of range"),
    (["--no-such-flag"], "pretrain_gpt.py: error: unrecognized arguments: --no-such-flag"),
], ids=["bad value", "unknown flag"])
@pytest.mark.parametrize("rank", ["0", "1"])
def test_a_rank_that_does_not_print_the_refusal_exits_after_the_one_that_does(rank, extra, line, monkeypatch,
                                                                               capsys):
    """A launcher ends the whole job at the first non-zero exit (Open MPI's prterun, torchrun's
    agent). Rank 1, which does not print a refusal, exited at once and got rank 0 killed before its
    line was out: CI's `mpirun -n 2 ... --lr -1` showed only prterun's notice naming rank 1. Now a
    rank that does not print waits errors.REPORT_GRACE_S first; rank 0 prints and exits at once.
    The same for a flag argparse refuses (2026-12-06: torchrun killed rank 0 before its
    "unrecognized arguments" line was out, test_torchrun_summary_names_our_error_line_as_the_root_cause)."""
    import time

    from zo_megatron import errors

    sys.path.insert(0, os.path.dirname(SCRIPT))
    import pretrain_gpt

    monkeypatch.setattr(errors, "REPORT_GRACE_S", 1.0)
    slept, real_sleep = [], time.sleep
    monkeypatch.setattr(errors.time, "sleep", lambda s: slept.append(s) or real_sleep(s))
    for k in [k for k in os.environ if k.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "OMPI_", "PMI_", "SLURM_"))]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setenv("WORLD_SIZE", "2")
    t0 = time.monotonic()
    try:
        rc = pretrain_gpt.main([*SHAPE, *extra])
    except SystemExit as exc:                    # argparse's refusal exits from the parser
        rc = exc.code
    waited = time.monotonic() - t0
    err = capsys.readouterr().err
    assert rc == 2
    if rank == "0":
        assert err.strip().splitlines()[-1].startswith(line) and slept == [], (err, slept)
    else:
        assert "error:" not in err and slept == [1.0] and waited >= 1.0, (err, slept, waited)
