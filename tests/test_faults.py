"""Faults at run time: NaN steps, signals, a dead rank, a dead node. Each case is bounded in time,
asserts the message and exit code, and that no process of the job is left running."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.test_pretrain import SCRIPT, TINY, TORCHRUN, _clean_env, _job, _rows
from tests.harness import PortTaken, on_a_fresh_port


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    from zo_megatron.data import extract_corpus
    from zo_megatron.data.preprocess import preprocess

    d = tmp_path_factory.mktemp("faults")
    preprocess(extract_corpus(str(d / "txt"), limit=8), str(d / "sotu"), progress=False)
    return str(d / "sotu_text_document")


def _env(tmp_path, **extra):
    env = _clean_env(tmp_path)
    env.update(extra)
    return env


def _leftovers(marker: str) -> list[str]:
    """Processes whose command line still holds `marker` (a path unique to the test)."""
    out = subprocess.run(["pgrep", "-af", marker], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if "pgrep" not in line]


FP32 = ["--fp32", "--lr-decay-style", "constant", "--eval-interval", "100", "--eval-iters", "1"]


def test_nan_steps_are_skipped_everywhere_and_a_run_of_them_stops_with_a_checkpoint(corpus, tmp_path):
    """Rank 1's loss is NaN at iteration 2 (skipped on both ranks, training goes on) and at 4, 5, 6:
    --max-skipped-iters 3 stops the run after 6 with a checkpoint of the last good state."""
    save, log = tmp_path / "ckpt", tmp_path / "log.jsonl"
    args = ["--zero-offload", "--data-path", corpus, "--train-iters", "12", "--save", str(save),
            "--log-jsonl", str(log), "--max-skipped-iters", "3", *TINY, *FP32]
    r = _job(args, tmp_path, ZO_FAULT_INJECT="nan@1:2;nan@1:4,5,6")
    assert r.returncode != 0, r.stdout[-2000:]
    assert "error: 3 consecutive iterations (up to 6) were skipped for a NaN/inf loss or gradient" in r.stderr
    train = {row["iteration"]: row for row in _rows(log, "train")}
    assert [i for i, row in sorted(train.items()) if row["skipped"]] == [2, 4, 5, 6]
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "6"
    # the checkpoint holds the state after iteration 3 (the last good step): it resumes, finite
    r2 = _job(["--zero-offload", "--data-path", corpus, "--train-iters", "8", "--lr-decay-iters", "12",
               "--load", str(save), "--log-jsonl", str(tmp_path / "resumed.jsonl"), *TINY, *FP32], tmp_path)
    assert r2.returncode == 0, r2.stderr[-3000:]
    resumed = _rows(tmp_path / "resumed.jsonl", "train")
    assert [row["iteration"] for row in resumed] == [7, 8]
    assert all(row["skipped"] == 0 and row["loss"] < train[3]["loss"] + 0.5 for row in resumed), resumed


def test_sigterm_on_one_rank_stops_every_rank_with_a_checkpoint_and_resume_is_exact(corpus, tmp_path):
    common = ["--zero-offload", "--data-path", corpus, "--train-iters", "6", *TINY, *FP32]
    straight = tmp_path / "straight.jsonl"
    assert _job([*common, "--log-jsonl", str(straight)], tmp_path).returncode == 0
    save, log = tmp_path / "ckpt", tmp_path / "stopped.jsonl"
    r = subprocess.run([TORCHRUN, "--standalone", "--nproc-per-node=2", SCRIPT, *common, "--save", str(save),
                        "--log-jsonl", str(log)], capture_output=True, text=True, timeout=300,
                       env=_env(tmp_path, ZO_FAULT_INJECT="term@1:3"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"stopped by SIGTERM after iteration 3; resume with --load {save}" in r.stdout
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
    resumed = tmp_path / "resumed.jsonl"
    r2 = _job([*common, "--load", str(save), "--log-jsonl", str(resumed)], tmp_path)
    assert r2.returncode == 0, r2.stderr[-3000:]
    ref = {row["iteration"]: row["loss"] for row in _rows(straight, "train")}
    got = {row["iteration"]: row["loss"] for row in _rows(log, "train") + _rows(resumed, "train")}
    assert got == ref                       # bitwise: fp32 on the CPU, same order of operations


def test_a_second_signal_exits_at_once(tmp_path):
    code = ("import os, signal, time\n"
            "from zo_megatron.training.faults import StopSignal\n"
            "s = StopSignal(True)\n"
            "os.kill(os.getpid(), signal.SIGTERM)\n"
            "assert s.received == signal.SIGTERM and s.agreed() == signal.SIGTERM\n"
            "print('first signal noted', flush=True)\n"
            "os.kill(os.getpid(), signal.SIGINT)\n"
            "time.sleep(30)\n"
            "print('not reached')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       env=_env(tmp_path))
    assert r.stdout.strip() == "first signal noted" and r.returncode == 128 + signal.SIGINT, (r.stdout, r.stderr)


@pytest.mark.parametrize("nproc,victim,at", [(2, 1, 3), (4, 2, 2)])
def test_a_rank_killed_under_torchrun_stops_the_job(corpus, tmp_path, nproc, victim, at):
    t0 = time.monotonic()
    r = subprocess.run([TORCHRUN, "--standalone", f"--nproc-per-node={nproc}", SCRIPT, "--zero-offload",
                        "--data-path", corpus, "--train-iters", "50", *TINY, *FP32],
                       capture_output=True, text=True, timeout=240,
                       env=_env(tmp_path, ZO_FAULT_INJECT=f"kill@{victim}:{at}"))
    assert r.returncode != 0
    out = r.stdout + r.stderr
    assert f"rank      : {victim}" in out or f"rank: {victim}" in out, out[-3000:]     # torchrun names it
    assert "Signal 9 (SIGKILL)" in out or "exitcode  : -9" in out, out[-3000:]
    assert time.monotonic() - t0 < 200
    assert not _leftovers(corpus), _leftovers(corpus)


TIMEOUT_S = 30          # --distributed-timeout-minutes 0.5


def lose_a_node(corpus, tmp_path, how, node_env=lambda node: {}):
    """Two torchrun agents as two nodes on localhost (DP=2); once training is under way node 1
    (agent and worker) gets `how`: SIGKILL closes its sockets, SIGSTOP leaves it hung with them
    open, as a frozen or unreachable node does (only --distributed-timeout-minutes ends the wait).
    Returns the survivor's (exit code, stdout, stderr, seconds from the loss to its exit)."""
    return on_a_fresh_port(lambda port: _lose_a_node_on(port, corpus, tmp_path, how, node_env))


def _lose_a_node_on(port, corpus, tmp_path, how, node_env):
    log = tmp_path / "log.jsonl"
    if log.exists():
        log.unlink()                               # an earlier attempt's
    agents = []
    for node in (0, 1):
        cmd = [TORCHRUN, "--nnodes=2", f"--node-rank={node}", "--nproc-per-node=1", "--master-addr=127.0.0.1",
               f"--master-port={port}", SCRIPT, "--zero-offload", "--data-path", corpus, "--train-iters", "500",
               "--distributed-timeout-minutes", str(TIMEOUT_S / 60), "--log-jsonl", str(log), *TINY, *FP32]
        agents.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                       env=_env(tmp_path, **node_env(node)), start_new_session=True))
    node1 = []
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:          # wait until training is under way
            if log.exists() and any(json.loads(x).get("iteration", 0) >= 2 for x in log.read_text().splitlines()):
                break
            if agents[0].poll() is not None:
                out, err = agents[0].communicate()
                if "EADDRINUSE" in err:
                    raise PortTaken(err[-500:])
                pytest.fail(f"node 0 ended before training was under way:\n{out[-2000:]}\n{err[-3000:]}")
            time.sleep(0.5)
        else:
            pytest.fail("training never reached iteration 2")
        # the agent and its worker (torchrun starts workers in their own sessions)
        kids = subprocess.run(["pgrep", "-P", str(agents[1].pid)], capture_output=True, text=True).stdout.split()
        node1 = [agents[1].pid, *map(int, kids)]
        for pid in node1:
            os.kill(pid, how)
        t_lost = time.monotonic()
        out, err = agents[0].communicate(timeout=TIMEOUT_S + 60)
        waited = time.monotonic() - t_lost
    finally:
        for pid in node1:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for a in agents:
            if a.poll() is None:
                os.killpg(a.pid, signal.SIGKILL)
            a.wait()
    return agents[0].returncode, out, err, waited


def assert_the_survivor_ended_with_one_line(corpus, how, returncode, err, waited):
    """Non-zero within the timeout plus a few seconds (a hung peer: not before the timeout), the
    one line naming the rank and the iteration, and no process of the job left running."""
    assert returncode != 0
    assert waited < TIMEOUT_S + 30, waited
    assert "error: rank 0 lost contact with its peers in a collective during iteration" in err, err[-3000:]
    assert "resume from the last checkpoint with --load" in err
    if how == signal.SIGSTOP:
        assert 25 < waited, f"a hung peer must be waited for the timeout ({TIMEOUT_S} s), not {waited:.0f} s"
    time.sleep(1)
    assert not _leftovers(corpus), _leftovers(corpus)


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGSTOP], ids=["node-dies", "node-hangs"])
def test_a_lost_node_ends_the_survivors_within_the_timeout(corpus, tmp_path, how):
    """Node 1 of two dies or hangs: the survivor prints which rank lost contact at which iteration
    and exits non-zero within the timeout plus a few seconds."""
    returncode, out, err, waited = lose_a_node(corpus, tmp_path, how)
    assert_the_survivor_ended_with_one_line(corpus, how, returncode, err, waited)


def test_save_directory_without_room_for_a_checkpoint_is_refused_before_training(tmp_path, monkeypatch):
    import shutil as sh
    from collections import namedtuple

    from zo_megatron.errors import UserError
    from zo_megatron.training.prelaunch import check_free_space, checkpoint_bytes

    need = checkpoint_bytes(124_000_000, True, False)
    assert need == 124_000_000 * 16                     # weights + master + two fp32 moments
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(sh, "disk_usage", lambda p: usage(10 * need, 9 * need, need - 1))
    with pytest.raises(UserError, match=r"--save .*/new/dir: .* free on its filesystem, but one checkpoint"):
        check_free_space(str(tmp_path / "new" / "dir"), need)
    monkeypatch.setattr(sh, "disk_usage", lambda p: usage(10 * need, 8 * need, need))
    check_free_space(str(tmp_path / "new" / "dir"), need)            # exactly enough: accepted


def test_a_save_that_fails_midway_keeps_the_previous_checkpoint_and_stops_with_one_line(corpus, tmp_path):
    """Every fsync of the save at iteration 4 fails with ENOSPC (a full disk, on both ranks): the
    run stops with one line naming the directory and the error; iteration 2 stays latest and
    resumes; the failed save's partial directory is removed by the next save."""
    save = tmp_path / "ckpt"
    common = ["--zero-offload", "--data-path", corpus, "--save", str(save), "--save-interval", "2", *TINY, *FP32]
    r = _job([*common, "--train-iters", "6"], tmp_path, ZO_FAULT_INJECT="enospc@0:4;enospc@1:4")
    assert r.returncode != 0
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1, r.stderr[-3000:]
    assert f"saving the checkpoint of iteration 4 to {save} failed" in errors[0], errors
    assert "No space left on device" in errors[0] and "previous checkpoint (iteration 2) is intact" in errors[0], \
        errors[0]
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    r2 = _job([*common, "--train-iters", "6", "--load", str(save)], tmp_path)
    assert r2.returncode == 0, r2.stderr[-3000:]
    assert "resumed from" in r2.stdout and "iteration 2" in r2.stdout
    assert sorted(os.listdir(save)) == ["iter_0000002", "iter_0000004", "iter_0000006",
                                        "latest_checkpointed_iteration.txt"], os.listdir(save)
