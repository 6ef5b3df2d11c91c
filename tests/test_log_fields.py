"""Issue 35, item 17: the log says how far the run is (consumed samples and tokens, right across a
resume that changes the global batch), when (a wall-clock timestamp), how well the device is used
(MFU where its peak is known) and every rank's memory peak, not rank 0's only; tools/plot_loss.py
puts each record at its consumed tokens."""
import datetime
import json
import os
import sys

import pytest

from tests.harness import run_world
from tests.test_checkpoint_args import ROOT, SHAPE, _main

BALLAST_MIB = 192
RUN = ["--micro-batch-size", "2", "--lr", "1e-3", "--no-progress-bar", "--fp32", "--log-interval", "1",
       "--eval-interval", "2", "--eval-iters", "1", "--split", "80,20,0", "--zero-offload", "--lr-decay-iters", "6"]


def _main_with_ballast(rank, argv):
    """Rank 1 holds BALLAST_MIB more resident memory than rank 0 for the whole run."""
    ballast = b"\x01" * (BALLAST_MIB << 20) if rank == 1 else b""     # filled: every page resident
    try:
        return _main(rank, argv)
    finally:
        del ballast


def _rows(path, kind):
    return [r for r in map(json.loads, open(path)) if r.get("kind") == kind]


def test_consumed_tokens_time_and_every_ranks_peak_across_a_resume_that_changes_the_batch(tmp_path):
    from zo_megatron.data import extract_corpus
    from zo_megatron.data.preprocess import preprocess

    d = str(tmp_path)
    preprocess(extract_corpus(f"{d}/txt", limit=6), f"{d}/sotu", progress=False)
    log, ckpt, seq = f"{d}/log.jsonl", f"{d}/ckpt", 16
    common = [*SHAPE, *RUN, "--data-path", f"{d}/sotu_text_document", "--log-jsonl", log, "--save", ckpt]
    started = datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0)
    for gb, iters in ((4, 4), (8, 6)):                     # the resume doubles the global batch
        res = run_world(_main_with_ballast, 2, [*common, "--global-batch-size", str(gb), "--train-iters",
                                                str(iters), *(["--load", ckpt] if gb == 8 else [])], timeout=300)
        assert all(rc == 0 for rc, _, _ in res), res[0][2][-3000:] + res[1][2][-3000:]
    ended = datetime.datetime.now(datetime.timezone.utc)
    train, evals = _rows(log, "train"), _rows(log, "eval")
    assert [r["iteration"] for r in train] == [1, 2, 3, 4, 5, 6]
    want = [4, 8, 12, 16, 24, 32]                         # samples: 4 per iteration, then 8
    assert [r["consumed_samples"] for r in train] == want
    assert [r["consumed_tokens"] for r in train] == [s * seq for s in want]
    by_iter = {r["iteration"]: r["consumed_tokens"] for r in train}
    assert evals and all(e["consumed_tokens"] == by_iter[e["iteration"]] for e in evals)
    times = [datetime.datetime.fromisoformat(r["time"]) for r in train]
    assert all(t.utcoffset() == datetime.timedelta(0) for t in times)
    assert started <= times[0] and times == sorted(times) and times[-1] <= ended
    for r in train:
        assert r["mfu"] is None                           # a CPU has no known peak
        per_rank = r["host_peak_bytes_per_rank"]
        assert len(per_rank) == 2 and per_rank[0] == r["host_rss_bytes"]     # rank 0's own, same sample
        assert per_rank[1] - per_rank[0] > (BALLAST_MIB - 48) << 20, per_rank
        assert r["host_peak_bytes_max"] == per_rank[1] and r["host_peak_rank"] == 1
        assert r["device_peak_bytes_per_rank"] is None and r["device_peak_bytes_max"] is None
        assert r["device_reserved_peak_bytes"] is None

    # plot_loss: the second run's points sit at their consumed tokens, not iteration x its batch
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    import plot_loss

    runs = plot_loss.runs_of(log)
    assert len(runs) == 2
    assert plot_loss.token_axis(runs[1], "train") == [24 * seq, 32 * seq]
    assert plot_loss.token_axis(runs[1], "train") != [i * 8 * seq for i in (5, 6)]


def test_a_log_without_consumed_tokens_falls_back_to_its_headers_batch(tmp_path):
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    import plot_loss

    log = tmp_path / "old.jsonl"
    rows = [{"kind": "header", "args": {"global_batch_size": 4, "seq_length": 32}},
            {"kind": "train", "iteration": 1, "loss": 9.0}, {"kind": "train", "iteration": 2, "loss": 8.0},
            {"kind": "eval", "iteration": 2, "val_loss": 8.5}]
    log.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run,) = plot_loss.runs_of(str(log))
    assert plot_loss.token_axis(run, "train") == [128, 256] and plot_loss.token_axis(run, "eval") == [256]
    run["header"] = {}
    assert plot_loss.token_axis(run, "train") is None


@pytest.mark.parametrize("name, peak", [("NVIDIA H100 80GB HBM3", 989.4), ("NVIDIA H100 PCIe", 756.0),
                                        ("NVIDIA H200", 989.4), ("NVIDIA A100-SXM4-80GB", 312.0),
                                        ("NVIDIA GeForce RTX 4090", None)])
def test_mfu_denominator_by_device_name(name, peak):
    from zo_megatron.training.metrics import peak_tflops_of

    assert peak_tflops_of(name) == peak


def test_the_log_line_names_time_consumed_samples_mfu_and_the_peak_rank(capsys):
    from zo_megatron.training.metrics import Metrics

    m = Metrics(enabled=True, total_iters=10, progress_bar=False)
    row = {"iteration": 3, "time": "2026-11-27T12:00:05+00:00", "consumed_samples": 1536, "loss": 5.0, "lr": 1e-4,
           "grad_norm": 1.0, "loss_scale": 1.0, "skipped": 0, "nan_iterations": 0, "tokens_per_s": 100.0,
           "step_time_s": 0.5, "tflops_per_rank": 123.0, "mfu": 0.124, "device_model_state_bytes": 1 << 30,
           "host_model_state_bytes": 7 << 30, "host_rss_bytes": 3 << 30, "host_peak_bytes_max": 5 << 30,
           "host_peak_rank": 3, "device_peak_bytes_max": 60 << 30, "device_peak_rank": 2}
    m.log_train(row)
    line = capsys.readouterr().out
    assert line.startswith(" [2026-11-27 12:00:05 UTC] iter      3/10 | loss 5.0000")
    assert "consumed 1,536 samples" in line and "MFU 12.4%" in line
    assert "host peak 5.0 GiB (rank 3)" in line and "device peak 60.0 GiB (rank 2)" in line


class _FullDisk:
    """A file or writer whose writes fail as on a full disk."""

    def __init__(self, *args, **kwargs):
        self.calls = 0

    def _fail(self, *args, **kwargs):
        import errno

        self.calls += 1
        raise OSError(errno.ENOSPC, "No space left on device")

    write = add_scalar = add_text = _fail

    def close(self):
        pass


@pytest.mark.parametrize("sink", ["jsonl", "tensorboard"])
def test_a_log_that_cannot_be_written_stops_that_log_not_the_run(tmp_path, capsys, monkeypatch, sink):
    """Only rank 0 writes the logs: a full disk under --log-jsonl or --tensorboard-dir raised there and
    left the other ranks in their next collective until they lost contact (found by review on
    2026-12-07). The failed log stops with one warning; the other log and the console go on."""
    from zo_megatron.training.metrics import Metrics

    jsonl = tmp_path / "log.jsonl"
    m = Metrics(enabled=True, total_iters=4, progress_bar=False, jsonl_path=str(jsonl),
                tensorboard_dir=str(tmp_path / "tb"))
    row = lambda it: {"iteration": it, "loss": 5.0 - it, "lr": 1e-4, "grad_norm": 1.0, "loss_scale": 1.0,  # noqa: E731
                      "skipped": 0, "nan_iterations": 0, "tokens_per_s": 100.0, "step_time_s": 0.5,
                      "tflops_per_rank": 1.0, "device_model_state_bytes": 1, "host_model_state_bytes": 1,
                      "host_rss_bytes": 1}
    m.log_train(row(1))
    broken = _FullDisk()
    if sink == "jsonl":
        m._jsonl = broken
    else:
        m._tb = broken
    for it in (2, 3):
        m.log_train(row(it))                    # no exception
    m.close()
    out = capsys.readouterr()
    warnings = [ln for ln in out.err.splitlines() if ln.startswith("warning:")]
    flag = "--log-jsonl" if sink == "jsonl" else "--tensorboard-dir"
    assert len(warnings) == 1 and warnings[0].startswith(f"warning: {flag} ") and "No space left" in warnings[0], \
        out.err
    assert broken.calls == 1                    # given up after its first failure
    assert [ln.split("|")[0].split()[-1] for ln in out.out.splitlines() if "iter " in ln] == ["1/4", "2/4", "3/4"]
    kept = [json.loads(x)["iteration"] for x in jsonl.read_text().splitlines() if json.loads(x)["kind"] == "train"]
    assert kept == ([1] if sink == "jsonl" else [1, 2, 3])


def test_a_timeline_or_trace_that_cannot_be_written_stops_with_a_warning(tmp_path, capsys):
    """--timeline (every rank writes its own) and --profile (the profiled ranks write a trace): a full disk
    or an unusable path there raised on that rank alone, leaving the others in their next collective
    (found by review on 2026-12-07). Each stops with one warning; the run goes on."""
    from types import SimpleNamespace

    import torch

    from zo_megatron.training.profiling import StepProfiler
    from zo_megatron.training.timeline import Timeline

    (tmp_path / "afile").write_text("x")
    bad = Timeline(str(tmp_path / "afile" / "tl.jsonl"), 1, 2, torch.device("cpu"))      # its directory is a file
    bad.record_all(1, [("forward", 0.0, 1.0)])
    bad.close()
    tl = Timeline(str(tmp_path / "tl.jsonl"), 0, 1, torch.device("cpu"))
    tl.record_all(1, [("forward", 0.0, 1.0)])
    broken = _FullDisk()
    tl._f = broken
    for it in (2, 3):
        tl.record_all(it, [("forward", it, it + 1.0), ("backward", it + 1.0, it + 2.0)])
    tl.close()
    assert broken.calls == 1 and json.loads((tmp_path / "tl.jsonl").read_text())["iteration"] == 1
    prof = StepProfiler(SimpleNamespace(profile_step_start=0, profile_step_end=1, tensorboard_dir=str(tmp_path / "afile"),
                                        save=None), 0, "cpu")
    prof.begin_if_due(0)
    torch.ones(4).sum()
    prof.end_if_due(1)                          # writing under a file: no trace, no exception
    assert not list(tmp_path.glob("afile*/*"))
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("warning:")]
    assert len(err) == 3, err
    assert err[0].startswith(f"warning: --timeline {tmp_path}/afile/tl.jsonl.rank1 (rank 1): writing failed")
    assert err[1].startswith(f"warning: --timeline {tmp_path}/tl.jsonl (rank 0): writing failed (OSError")
    assert err[2].startswith("warning: --profile rank 0: writing ") and "no trace, training goes on" in err[2]
