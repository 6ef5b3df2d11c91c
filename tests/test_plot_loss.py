"""The JSONL starts each run with a header record, tools/plot_loss.py draws a real log of the job
(two appended runs) into a non-blank PNG, and a run that fails during set-up leaves no log file."""
import json
import os
import subprocess
import sys

from tests.harness import run_world
from tests.test_checkpoint_args import ROOT, SHAPE, _main

RUN = ["--micro-batch-size", "2", "--lr", "1e-3", "--no-progress-bar", "--fp32", "--log-interval", "1",
       "--eval-interval", "2", "--eval-iters", "1", "--split", "80,20,0"]


def test_two_appended_runs_plot_into_a_non_blank_png(tmp_path):
    from zo_megatron.data import extract_corpus
    from zo_megatron.data.preprocess import preprocess

    d = str(tmp_path)
    preprocess(extract_corpus(f"{d}/txt", limit=6), f"{d}/sotu", progress=False)
    log = f"{d}/log.jsonl"
    for seed in ("1", "2"):
        rc, out, err = run_world(_main, 1, [*SHAPE, *RUN, "--data-path", f"{d}/sotu_text_document", "--train-iters",
                                            "4", "--seed", seed, "--log-jsonl", log], timeout=300)[0]
        assert rc == 0, err
    rows = [json.loads(x) for x in open(log)]
    headers = [r for r in rows if r["kind"] == "header"]
    assert len(headers) == 2 and rows[0]["kind"] == "header"
    assert [h["args"]["seed"] for h in headers] == [1, 2]
    assert headers[0]["world"] == {"world_size": 1, "tensor_parallel": 1, "data_parallel": 1, "device": "cpu"}
    assert headers[0]["versions"]["torch"] and "megatron-core" in headers[0]["versions"]
    png = f"{d}/loss.png"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "plot_loss.py"), log, "--output", png],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "2 run(s)" in r.stdout, r.stderr
    import matplotlib.image
    import numpy as np

    img = matplotlib.image.imread(png)[..., :3]
    assert img.shape[0] > 300 and img.shape[1] > 600
    coloured = (np.abs(img - img.mean(axis=2, keepdims=True)).sum(axis=2) > 0.2).mean()   # curves, not greys
    assert coloured > 0.002, coloured
    # a file that is not a log: one error line, exit 2
    open(f"{d}/bad.jsonl", "w").write("not json\n")
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "plot_loss.py"), f"{d}/bad.jsonl", "-o",
                        f"{d}/bad.png"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.startswith("error:") and not os.path.exists(f"{d}/bad.png")


def test_a_run_that_fails_during_set_up_leaves_no_log_or_event_file(tmp_path):
    """Refused while building the datasets (after the logger exists): an evaluation asked of an empty
    validation split; the message names both ways out with numbers that fit."""
    from zo_megatron.data import extract_corpus
    from zo_megatron.data.preprocess import preprocess

    d = str(tmp_path)
    preprocess(extract_corpus(f"{d}/txt", limit=6), f"{d}/sotu", progress=False)
    rc, out, err = run_world(_main, 1, [*SHAPE, *RUN, "--train-iters", "4", "--data-path", f"{d}/sotu_text_document",
                                        "--split", "969,30,1", "--eval-iters", "100",
                                        "--log-jsonl", f"{d}/logs/log.jsonl", "--tensorboard-dir", f"{d}/tb"],
                             timeout=300)[0]
    lines = [ln for ln in err.splitlines() if "error:" in ln]
    assert rc == 2 and len(lines) == 1, err
    assert "use --split 91,9,0" in lines[0] and "--eval-iters 0" in lines[0], lines[0]
    assert not os.path.exists(f"{d}/logs") and not os.path.exists(f"{d}/tb"), os.listdir(d)
