"""DPU and partial offload are visible: a warning when the delay would never start, one line when it
starts, `delayed_update` in every JSONL train row, and `--optimizer-offload-fraction auto` says the
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
                                        "--log-jsonl", log], timeout=300)[0]
    assert rc == 0, err
    assert [r["delayed_update"] for r in map(json.loads, open(log)) if r["kind"] == "train"] == [False, True, True, True]
    starts = [ln for ln in out.splitlines() if "delayed parameter update starts" in ln]
    assert len(starts) == 1 and "at iteration 2:" in starts[0], out
    rc, out, err = run_world(_main, 1, [*SHAPE, *RUN, *data, "--dpu", "--train-iters", "3"], timeout=300)[0]
    assert rc == 0, err
    assert "warning: --dpu given, but the delayed parameter update would start at iteration 40" in out, out
    assert "use --dpu-warmup-steps at most 3 to delay any" in out, out
    rc, out, err = run_world(_main, 1, [*SHAPE, *RUN, *data, "--optimizer-offload-fraction", "auto", "--train-iters",
                                        "1"], timeout=300)[0]
    assert rc == 0, err
    head = out.splitlines()[0]
    assert "ZeRO-Offload (CPU Adam)" not in head and "0% offloaded" in head, head
    assert "auto: 0% on the host: the whole optimizer fits on the device (needs device" in out and "budget:" in out, out
