"""Resume and reshard through the real job (pretrain), run in-process on shared gloo worlds.

One world of N ranks runs a list of jobs in sequence (each job its own rendezvous port); jobs
log per-iteration losses to JSONL; "reset" steps make a checkpoint directory's latest point back
to an earlier iteration, as if the run had been stopped there.
"""
import contextlib
import io
import json
import os
import shutil


from tests.harness import next_port, run_world
from tests.seeds import fresh_seed

# Small enough that the GPT-2 vocabulary's output layer (50304 logits per token) stays cheap.
TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--micro-batch-size", "1", "--global-batch-size", "4", "--lr", "3e-3", "--lr-warmup-iters", "1",
        "--min-lr", "3e-4", "--lr-decay-style", "cosine", "--lr-decay-iters", "6", "--log-interval", "1",
        "--no-progress-bar", "--skip-memory-check"]


def _run_jobs(rank, jobs, cache):
    os.environ["ZO_MEGATRON_CACHE"] = cache
    from zo_megatron.errors import UserError
    from zo_megatron.training.loop import pretrain

    out = []
    for job in jobs:
        if job[0] == "reset":                        # ("reset", dir, iteration): rank 0 rewinds latest
            _, d, it = job
            if rank == 0:
                for name in os.listdir(d):
                    if name.startswith("iter_") and int(name[5:12]) > it:
                        shutil.rmtree(os.path.join(d, name))
                with open(os.path.join(d, "latest_checkpointed_iteration.txt"), "w") as f:
                    f.write(f"{it}\n")
            out.append(None)
            continue
        _, argv = job
        next_port()                                  # chosen now, not when the test started
        buf = io.StringIO()
        try:
            with contextlib.redirect_stdout(buf):
                rc = pretrain(argv)
            out.append({"rc": rc, "stdout": buf.getvalue()})
        except UserError as exc:
            out.append({"error": str(exc), "stdout": buf.getvalue()})
    return out


def _world(n, jobs, tmp_path, timeout=400):
    jobs = [j if j[0] == "reset" else ("job", j) for j in jobs]
    return run_world(_run_jobs, n, jobs, str(tmp_path / "cache"), timeout=timeout)[0]


def _log(path, kind="train"):
    with open(path) as f:
        return [r for r in map(json.loads, f) if r["kind"] == kind]


def _losses(path, key="loss"):
    return {r["iteration"]: r[key] for r in _log(path)}


def test_reshard_matrix_continues_the_trajectory_and_same_layout_resume_is_bitwise(tmp_path):
    """fp32, offload, fixed global batch: every TP x DP layout trains the same trajectory up to
    rounding. Saved at iteration 3 on one layout, loaded on another, iterations 4-6 must match
    the straight run to 1e-6; on the same layout bit for bit. The 4-rank world also checks the
    exact TP2 x DP2 resume with dropout on."""
    seed = str(fresh_seed("reshard matrix"))
    common = [*TINY, "--zero-offload", "--fp32", "--seed", seed, "--eval-iters", "0"]
    ck = {k: str(tmp_path / k) for k in ("t2d2", "t2d1", "t1d2", "drop")}
    log = {k: str(tmp_path / f"{k}.jsonl") for k in
           ("straight", "same", "t1d4", "t1d1", "t2d1", "t2d1_t1d2", "t1d2", "t1d2_t2d2", "drop_a", "drop_b")}
    dropout = [*common, "--tensor-parallel", "2", "--train-iters", "4", "--lr-decay-iters", "4",
               "--hidden-dropout", "0.2", "--attention-dropout", "0.2"]

    def run(tp, iters, name, *extra):
        return [*common, "--tensor-parallel", str(tp), "--train-iters", str(iters), "--log-jsonl", log[name], *extra]

    # The TP1 x DP2 runs keep part of the optimizer on the device (--optimizer-offload-fraction):
    # the checkpoint is written from, and read into, partitions split between host and device.
    out2 = _world(2, [run(2, 3, "t2d1", "--save", ck["t2d1"]),
                      run(1, 6, "t2d1_t1d2", "--load", ck["t2d1"],        # TP2 x DP1 -> TP1 x DP2
                          "--optimizer-offload-fraction", "0.3"),
                      run(1, 3, "t1d2", "--save", ck["t1d2"], "--optimizer-offload-fraction", "0.5")], tmp_path)
    out4 = _world(4, [run(2, 6, "straight", "--save", ck["t2d2"], "--save-interval", "3"),
                      ("reset", ck["t2d2"], 3),
                      run(2, 6, "same", "--load", ck["t2d2"]),            # TP2 x DP2 -> TP2 x DP2
                      run(1, 6, "t1d4", "--load", ck["t2d2"]),            # TP2 x DP2 -> TP1 x DP4
                      run(2, 6, "t1d2_t2d2", "--load", ck["t1d2"]),       # TP1 x DP2 -> TP2 x DP2
                      [*dropout, "--save", ck["drop"], "--save-interval", "2", "--log-jsonl", log["drop_a"]],
                      ("reset", ck["drop"], 2),
                      [*dropout, "--load", ck["drop"], "--log-jsonl", log["drop_b"]]],
                  tmp_path)
    out1 = _world(1, [run(1, 6, "t1d1", "--load", ck["t2d2"])], tmp_path)  # TP2 x DP2 -> TP1 x DP1
    for o in out1 + out2 + out4:
        assert o is None or o.get("rc") == 0, o
    ref = _losses(log["straight"])
    assert sorted(ref) == [1, 2, 3, 4, 5, 6]
    same = _losses(log["same"])
    assert same == {i: ref[i] for i in (4, 5, 6)}                         # bitwise
    assert "resharded" not in out4[2]["stdout"]
    for name, line in (("t1d4", "resharded from TP2 x DP2 to TP1 x DP4"),
                       ("t1d1", "resharded from TP2 x DP2 to TP1 x DP1"),
                       ("t2d1_t1d2", "resharded from TP2 x DP1 to TP1 x DP2"),
                       ("t1d2_t2d2", "resharded from TP1 x DP2 to TP2 x DP2")):
        got = _losses(log[name])
        assert sorted(got) == [4, 5, 6], (name, got)
        for i in (4, 5, 6):
            assert abs(got[i] - ref[i]) <= 1e-6 * abs(ref[i]), (name, i, got[i], ref[i])
        stdout = {"t1d4": out4[3], "t1d1": out1[0], "t2d1_t1d2": out2[1], "t1d2_t2d2": out4[4]}[name]["stdout"]
        assert sum(line in ln for ln in stdout.splitlines()) == 1, stdout
    for name in ("t2d1", "t1d2"):                                          # the saving runs agree too
        got = _losses(log[name])
        for i in (1, 2, 3):
            assert abs(got[i] - ref[i]) <= 1e-6 * abs(ref[i]), (name, i, got[i], ref[i])
    drop_a, drop_b = _losses(log["drop_a"]), _losses(log["drop_b"])
    assert drop_b == {3: drop_a[3], 4: drop_a[4]}


def test_resume_with_dropout_is_exact_in_bf16_and_for_the_baseline_and_validation_continues(tmp_path):
    """Dropout on: the RNG streams (megatron's tracker included) must continue; evaluation every
    2 iterations: the validation samples must continue (consumed_valid_samples). Iterations 3-4
    and the validation loss at 4 of a run resumed from 2 equal the straight run's, bit for bit."""
    seed = str(fresh_seed("dropout resume"))
    common = [*TINY, "--seed", seed, "--hidden-dropout", "0.2", "--attention-dropout", "0.2",
              "--eval-interval", "2", "--eval-iters", "2", "--train-iters", "4", "--lr-decay-iters", "4",
              "--split", "80,20,0"]
    cases = {"tp2_offload_bf16": ["--tensor-parallel", "2", "--zero-offload", "--bf16"],
             "dp2_offload_fp32": ["--zero-offload", "--fp32"],
             "dp2_baseline_fp32": ["--fp32"]}
    jobs = []
    for name, extra in cases.items():
        ck = str(tmp_path / name)
        jobs += [[*common, *extra, "--save", ck, "--save-interval", "2", "--log-jsonl", str(tmp_path / f"{name}_a.jsonl")],
                 ("reset", ck, 2),
                 [*common, *extra, "--load", ck, "--log-jsonl", str(tmp_path / f"{name}_b.jsonl")]]
    norng = "dp2_offload_fp32"
    jobs.append([*common, *cases[norng], "--load", str(tmp_path / norng), "--no-load-rng",
                 "--log-jsonl", str(tmp_path / "norng.jsonl")])
    out = _world(2, jobs, tmp_path)
    for o in out:
        assert o is None or o.get("rc") == 0, o
    for name in cases:
        a, b = tmp_path / f"{name}_a.jsonl", tmp_path / f"{name}_b.jsonl"
        straight, resumed = _losses(a), _losses(b)
        assert sorted(resumed) == [3, 4]
        assert resumed == {3: straight[3], 4: straight[4]}, name
        assert [e["val_loss"] for e in _log(b, "eval")] == [e["val_loss"] for e in _log(a, "eval")][1:], name
    # --no-load-rng: fresh dropout masks, so the resumed losses differ from the exact resume
    assert _losses(tmp_path / "norng.jsonl")[3] != _losses(tmp_path / f"{norng}_a.jsonl")[3]
