"""DPU and partial offload are visible: a warning when the delay would never start, and when it starts
inside the learning-rate warm-up or the first 1% of the run (issue 37), one line when it starts, the
corrector on the banner, `delayed_update` in every JSONL train row, and `--optimizer-offload-fraction auto` says the
budget and why; the banner never claims a CPU Adam that holds 0% of the optimizer."""
import json

from tests.harness import run_world
from tests.test_checkpoint_args import SHAPE, _main

RUN = ["--micro-batch-size", "2", "--lr", "1e-3", "--no-progress-bar", "--fp32", "--eval-iters", "0",
       "--split", "100,0,0", "--zero-offload", "--log-interval", "1"]


def test_dpu_and_auto_offload_say_what_they_do(tmp_path):
    from zo_megatron.data import extract_corpus
    from zo_megatron.data.preprocess import preprocess

    d = str(tmp_path)
    preprocess(extract_corpus(f"{d}/txt", limit=4), f"{d}/sotu", progress=False)
    data = ["--data-path", f"{d}/sotu_text_document"]
    log = f"{d}/dpu.jsonl"
    rc, out, err = run_world(_main, 1, [*SHAPE, *RUN, *data, "--dpu", "--dpu-warmup-steps", "2", "--train-iters", "4",
                                        "--log-jsonl", log, "--lr-warmup-iters", "2",
                                        "--dpu-corrector", "weight-prediction"], timeout=300)[0]
    assert rc == 0, err
    early = [ln for ln in out.splitlines() if "warning: --dpu delays from update 2" in ln]
    assert len(early) == 1 and "inside the learning-rate warm-up (--lr-warmup-iters 2)" in early[0], out
    assert "first 1% of the run" not in early[0] and "raise --dpu-warmup-steps past 2" in early[0], early
    assert "device copy extrapolated by the last update (--dpu-corrector weight-prediction)" in out, out
    assert [r["delayed_update"] for r in map(json.loads, open(log)) if r["kind"] == "train"] == [False, True, True, True]
    starts = [ln for ln in out.splitlines() if "delayed parameter update starts" in ln]
    assert len(starts) == 1 and "at iteration 2:" in starts[0], out
    rc, out, err = run_world(_main, 1, [*SHAPE, *RUN, *data, "--dpu", "--train-iters", "3"], timeout=300)[0]
    assert rc == 0, err
    assert "warning: --dpu given, but the delayed parameter update would start at iteration 40" in out, out
    assert "use --dpu-warmup-steps at most 3 to delay any" in out, out
    assert "warning: --dpu delays from update" not in out, out      # it never starts: the other warning
    rc, out, err = run_world(_main, 1, [*SHAPE, *RUN, *data, "--dpu", "--dpu-warmup-steps", "1", "--train-iters",
                                        "200", "--exit-interval", "1"], timeout=300)[0]
    assert rc == 0, err
    early = [ln for ln in out.splitlines() if "warning: --dpu delays from update 1" in ln]
    assert len(early) == 1 and "in the first 1% of the run (--train-iters 200)" in early[0], out
    assert "inside the learning-rate warm-up" not in early[0] and "no corrector (--dpu-corrector none" in out, out
    rc, out, err = run_world(_main, 1, [*SHAPE, *RUN, *data, "--optimizer-offload-fraction", "auto", "--train-iters",
                                        "1"], timeout=300)[0]
    assert rc == 0, err
    head = out.splitlines()[0]
    assert "ZeRO-Offload (CPU Adam)" not in head and "0% offloaded" in head, head
    assert "auto: 0% on the host: the whole optimizer fits on the device (needs device" in out and "budget:" in out, out
