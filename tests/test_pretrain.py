"""pretrain_gpt.py end to end, from the command line, on real text (a slice of the SOTU corpus).

The job runs through pretrain_gpt.main() on a local world of forked ranks (`_job`, `_single`:
tests/harness.py's forkserver has imported torch and megatron-core once, so a run costs seconds,
not torchrun's ~8 s of interpreter start-up per process); `_torchrun` and `_single_process` start
the real launcher or a fresh interpreter, for the tests that are about launching.
"""
import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
import time
import types

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "pretrain", "pretrain_gpt.py")
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")
TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
        "--micro-batch-size", "4", "--lr", "3e-3", "--lr-warmup-iters", "2", "--min-lr", "3e-4",
        "--lr-decay-style", "cosine", "--log-interval", "1", "--eval-interval", "4", "--eval-iters", "2",
        "--no-progress-bar", "--split", "90,10,0"]
TRAIN_KEYS = {"iteration", "loss", "lr", "grad_norm", "loss_scale", "skipped", "tokens_per_s",
              "nan_iterations", "tflops_per_rank", "device_model_state_bytes", "host_model_state_bytes"}


def _clean_env(tmp_path):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_", "OMPI_", "PMI_", "SLURM_", "TORCHELASTIC"))}
    env["ZO_MEGATRON_CACHE"] = str(tmp_path / "cache")
    env["PYTHONPATH"] = ROOT
    return env


@pytest.fixture(scope="module")
def sotu_prefix(tmp_path_factory):
    from zo_megatron.data import extract_corpus
    from zo_megatron.data.preprocess import preprocess

    d = tmp_path_factory.mktemp("sotu")
    files = extract_corpus(str(d / "txt"), limit=12)
    preprocess(files, str(d / "sotu"), progress=False)
    return str(d / "sotu_text_document")


def _torchrun(args, tmp_path, nproc=2, timeout=300):
    """The job under the real torchrun (for what the launcher itself does: signals, killed ranks)."""
    cmd = [TORCHRUN, "--standalone", f"--nproc-per-node={nproc}", SCRIPT, *args]
    return subprocess.run(cmd, env=_clean_env(tmp_path), capture_output=True, text=True, timeout=timeout)


def _single_process(args, tmp_path, timeout=120):
    """The job as `python pretrain_gpt.py ...` in a fresh interpreter, no launcher."""
    return subprocess.run([sys.executable, SCRIPT, *args], env=_clean_env(tmp_path), capture_output=True,
                          text=True, timeout=timeout)


def _rank_job(rank, argv, env):
    """One rank of the job: pretrain_gpt.main(argv) with its stdout and stderr captured."""
    os.environ.update(env)
    sys.path.insert(0, os.path.join(ROOT, "pretrain"))
    import pretrain_gpt

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = pretrain_gpt.main(argv)
        except SystemExit as exc:
            rc = exc.code if isinstance(exc.code, int) else 1
    return rc, out.getvalue(), err.getvalue()


def _job(args, tmp_path, nproc=2, timeout=300, **env):
    """The job on `nproc` forked ranks, as subprocess.run reports a launch: the first non-zero
    exit status (0 if none), every rank's stdout and stderr in rank order."""
    from tests.harness import run_world

    env = {"ZO_MEGATRON_CACHE": str(tmp_path / "cache"), **env}
    res = run_world(_rank_job, nproc, [str(a) for a in args], env, timeout=timeout)
    return types.SimpleNamespace(returncode=next((rc for rc, _, _ in res if rc), 0),
                                 stdout="".join(o for _, o, _ in res), stderr="".join(e for _, _, e in res))


def _single(args, tmp_path, timeout=120):
    """The job on one forked rank (see `_job`)."""
    return _job(args, tmp_path, nproc=1, timeout=timeout)


def _rows(path, kind):
    with open(path) as f:
        return [r for r in map(json.loads, f) if r["kind"] == kind]


def test_tp2_zero_offload_trains_on_real_text(sotu_prefix, tmp_path):
    log = tmp_path / "log.jsonl"
    save = tmp_path / "ckpt"
    r = _job(["--tensor-parallel", "2", "--zero-offload", "--data-path", sotu_prefix, "--train-iters", "12",
                   "--log-jsonl", str(log), "--save", str(save), *TINY], tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    train, evals = _rows(log, "train"), _rows(log, "eval")
    assert [row["iteration"] for row in train] == list(range(1, 13))      # --log-interval 1: every iteration
    for row in train:
        assert TRAIN_KEYS <= set(row)
        assert row["skipped"] == 0 and row["tokens_per_s"] > 0
    first, last = sum(r["loss"] for r in train[:3]) / 3, sum(r["loss"] for r in train[-3:]) / 3
    assert last < first - 0.5, (first, last)
    assert [e["iteration"] for e in evals] == [4, 8, 12]
    assert evals[-1]["val_loss"] < evals[0]["val_loss"]
    assert {"iteration", "val_loss", "val_ppl"} <= set(evals[-1])
    for field in ("loss", "lr", "grad norm", "loss scale", "skipped", "tok/s", "TFLOP/s", "model states", "eta"):
        assert field in r.stdout, field
    assert "validation loss at iteration 12" in r.stdout
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "12"
    # megatron-core's known notices (Apex/TE absent, a CUDA-graph deprecation) are hidden, in one line
    assert "Apex is not installed" not in r.stderr and "full scope is deprecated" not in r.stderr, r.stderr[-2000:]
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in r.stderr          # set for TP > 1, as Megatron-LM does
    assert r.stdout.count("hidden: megatron-core's notices") == 1


def test_tensorboard_events_are_written(sotu_prefix, tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = tmp_path / "tb"
    r = _single(["--data-path", sotu_prefix, "--train-iters", "4", "--tensorboard-dir", str(tb), *TINY], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    acc = EventAccumulator(str(tb))
    acc.Reload()
    losses = acc.Scalars("train/loss")
    assert [e.step for e in losses] == [1, 2, 3, 4]
    assert [e.step for e in acc.Scalars("eval/val_loss")] == [4]


def test_a_model_shape_without_data_path_says_loudly_it_trains_on_the_demo_corpus(tmp_path):
    r = _single(["--train-iters", "2", "--eval-iters", "0", *TINY], tmp_path, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "NO --data-path GIVEN: training on the bundled demo corpus" in r.stdout


@pytest.mark.parametrize("case", ["missing_prefix", "truncated_idx", "vocab_mismatch", "vocab_hash", "batch"])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(case, sotu_prefix, tmp_path):
    prefix = sotu_prefix
    extra = []
    if case == "missing_prefix":
        prefix = str(tmp_path / "nope_text_document")
        needle = prefix
    elif case == "truncated_idx":
        prefix = str(tmp_path / "cut_text_document")
        shutil.copy(sotu_prefix + ".bin", prefix + ".bin")
        data = open(sotu_prefix + ".idx", "rb").read()
        open(prefix + ".idx", "wb").write(data[: len(data) // 2])
        needle = prefix + ".idx"
    elif case == "vocab_mismatch":
        # An index whose token ids do not fit the GPT-2 vocabulary (dtype int32, id 70000).
        import numpy as np
        from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

        prefix = str(tmp_path / "big_text_document")
        b = IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
        import torch

        b.add_document(torch.tensor([1, 2, 70000, 3], dtype=torch.int32), [4])
        b.finalize(prefix + ".idx")
        needle = prefix
    elif case == "vocab_hash":
        bad = tmp_path / "vocab.json"
        bad.write_text('{"a": 0}')
        extra = ["--vocab-file", str(bad)]
        needle = str(bad)
    else:
        extra = ["--global-batch-size", "6"]
        needle = "--global-batch-size 6"
    save = tmp_path / "save"
    r = _single(["--data-path", prefix, "--train-iters", "2", "--save", str(save), *TINY, *extra], tmp_path)
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    lines = [ln for ln in r.stderr.strip().splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and needle in lines[0], r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    assert not save.exists()


def test_offload_and_ddp_baseline_agree_in_fp32_and_baseline_runs_bf16(sotu_prefix, tmp_path):
    """Without --zero-offload the job trains the plain DDP + AdamW baseline; in fp32 both must
    follow the same trajectory (same model, data and AdamW math), here at TP=1 x DP=2."""
    common = ["--data-path", sotu_prefix, "--train-iters", "5", *TINY, "--eval-interval", "100"]
    losses = {}
    out = {}
    for name, extra in (("offload", ["--zero-offload", "--fp32"]), ("ddp", ["--fp32"]), ("ddp_bf16", ["--bf16"]),
                        # the planner finds that the whole optimizer fits on the (CPU) device
                        ("offload_auto", ["--zero-offload", "--fp32", "--optimizer-offload-fraction", "auto"])):
        log = tmp_path / f"{name}.jsonl"
        r = _job([*common, *extra, "--log-jsonl", str(log)], tmp_path)
        assert r.returncode == 0, name + r.stderr[-3000:]
        losses[name] = [row["loss"] for row in _rows(log, "train")]
        out[name] = r.stdout
    assert "optimizer 0% on the host, the rest on the device; auto: 0% on the host: the whole optimizer fits " \
        "on the device" in out["offload_auto"] and "ZeRO-Offload (CPU Adam)" not in out["offload_auto"].splitlines()[0]
    for variant in ("offload", "offload_auto"):
        for a, b in zip(losses[variant], losses["ddp"]):
            assert abs(a - b) / abs(b) <= 1e-4, (variant, losses[variant], losses["ddp"])
    assert losses["ddp_bf16"][-1] < losses["ddp_bf16"][0]


def test_activation_recompute_does_not_change_the_math(sotu_prefix, tmp_path):
    """Full and selective recompute (megatron-core's, through the model config; --recompute-modules
    too) redo the forward in backward: the fp32 losses must be identical to the run that stores
    activations."""
    common = ["--tensor-parallel", "2", "--zero-offload", "--fp32", "--data-path", sotu_prefix,
              "--train-iters", "3", *TINY, "--eval-interval", "100"]
    losses = {}
    for name, extra in (("none", []), ("full", ["--recompute-granularity", "full"]),
                        ("selective", ["--recompute-activations"]),
                        ("modules", ["--recompute-granularity", "selective", "--recompute-modules", "core_attn",
                                     "layernorm"])):
        log = tmp_path / f"{name}.jsonl"
        r = _job([*common, *extra, "--log-jsonl", str(log)], tmp_path)
        assert r.returncode == 0, name + r.stderr[-3000:]
        losses[name] = [row["loss"] for row in _rows(log, "train")]
    assert losses["full"] == losses["none"]
    assert losses["selective"] == losses["none"]
    assert losses["modules"] == losses["none"]


def _run_with_fault(tmp_path, argv, site_code: str, **env_extra):
    """The job under torchrun on 2 ranks with `site_code` loaded by each interpreter (a fault that
    env_extra aims at a rank); it must fail, every rank ending well inside the launch's timeout."""
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(site_code)
    env = _clean_env(tmp_path)
    env.update(PYTHONPATH=f"{site}{os.pathsep}{ROOT}", **env_extra)
    t0 = time.monotonic()
    r = subprocess.run([TORCHRUN, "--standalone", "--nproc-per-node=2", SCRIPT, *map(str, argv)],
                       capture_output=True, text=True, timeout=240, env=env)
    print(f"{time.monotonic() - t0:.0f} s, exit {r.returncode}", r.stdout[-2000:], r.stderr[-4000:])
    assert r.returncode != 0 and time.monotonic() - t0 < 200, r.stderr[-3000:]
    return r
