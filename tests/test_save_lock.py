"""One job per save directory: a second job on a directory in use is refused in one line naming the
first (host, pid, start); a dead job's lock is taken over; another host's needs --force-save-lock."""
import json
import os
import signal
import socket
import subprocess
import sys
import time

from tests.harness import run_world
from tests.test_checkpoint_args import SHAPE, _main
from tests.test_pretrain import SCRIPT, _clean_env

RUN = ["--micro-batch-size", "2", "--lr", "1e-3", "--no-progress-bar", "--fp32", "--eval-iters", "0",
       "--split", "100,0,0", "--zero-offload"]


def test_two_jobs_on_one_save_directory(tmp_path):
    from zo_megatron.data import extract_corpus
    from zo_megatron.data.preprocess import preprocess

    d = str(tmp_path)
    preprocess(extract_corpus(f"{d}/txt", limit=4), f"{d}/sotu", progress=False)
    data = ["--data-path", f"{d}/sotu_text_document"]
    save = f"{d}/ck"
    lock = os.path.join(save, "zo_megatron.lock")
    # job A: long enough to be running while B starts
    a = subprocess.Popen([sys.executable, SCRIPT, *SHAPE, *RUN, *data, "--train-iters", "100000", "--save", save,
                          "--save-interval", "100000", "--exit-signal-handler"],
                         env=_clean_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while not os.path.exists(lock):
            assert a.poll() is None and time.monotonic() < deadline, a.communicate()[1][-3000:]
            time.sleep(0.2)
        held = json.load(open(lock))
        assert held["pid"] == a.pid and held["host"] == socket.gethostname()
        rc, out, err = run_world(_main, 1, [*SHAPE, *RUN, *data, "--train-iters", "2", "--save", save],
                                 timeout=300)[0]
        lines = [ln for ln in err.splitlines() if "error:" in ln]
        assert rc == 2 and len(lines) == 1, err
        assert f"--save {save} is in use by another job (pid {a.pid} on host {socket.gethostname()}" in lines[0]
        assert os.listdir(save) == ["zo_megatron.lock"]          # B wrote nothing
    finally:
        a.send_signal(signal.SIGKILL)                             # A dies without releasing its lock
        a.communicate(timeout=60)
    assert os.path.exists(lock)
    # the dead job's lock is taken over; the job runs, saves and releases it
    rc, out, err = run_world(_main, 1, [*SHAPE, *RUN, *data, "--train-iters", "1", "--save", save], timeout=300)[0]
    assert rc == 0, err
    assert "taking over the stale lock" in out and not os.path.exists(lock)
    # a holder on another host cannot be checked: refused, unless --force-save-lock
    json.dump({"host": "elsewhere", "pid": 1, "started": time.time()}, open(lock, "w"))
    rc, out, err = run_world(_main, 1, [*SHAPE, *RUN, *data, "--train-iters", "2", "--save", save,
                                        "--override-opt_param-scheduler"], timeout=300)[0]
    assert rc == 2 and "on host elsewhere" in err and "--force-save-lock" in err, err
    rc, out, err = run_world(_main, 1, [*SHAPE, *RUN, *data, "--train-iters", "2", "--save", save, "--load", save,
                                        "--override-opt_param-scheduler", "--force-save-lock"], timeout=300)[0]
    assert rc == 0, err
    assert not os.path.exists(lock)
