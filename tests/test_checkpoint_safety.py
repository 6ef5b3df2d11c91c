"""Checkpoints that refuse what does not fit, never run code from their files, survive a kill at
any moment of a save, and take Megatron's load flags -- through the real job."""
import io
import json
import os
import pickle
import shutil

import pytest

from tests.harness import run_world
from tests.seeds import fresh_seed
from tests.test_checkpoint_resume import TINY, _log, _losses

KINDS = (".metadata", "__0_0.distcp", "checkpoint.json", "rng_tp00_dp000.json", "latest")


class _Payload:
    """Unpickling this creates `marker`: proof that code from the file ran."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def _edit_manifest(d, fn):
    path = os.path.join(d, "checkpoint.json")
    with open(path) as f:
        m = json.load(f)
    fn(m)
    with open(path, "w") as f:
        json.dump(m, f)


def _plant(root, kind, marker):
    """Plant a pickle payload in one file kind, as an attacker who controls every file would:
    sizes in the manifest and offsets in .metadata are made consistent, so only the refusal to
    unpickle stops it."""
    import torch

    d = os.path.join(root, "iter_0000002")
    payload = pickle.dumps(_Payload(marker))
    if kind == "latest":
        with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "wb") as f:
            f.write(payload)
        return
    if kind == "__0_0.distcp":
        buf = io.BytesIO()
        torch.save(_Payload(marker), buf)           # a torch.save zip whose data.pkl is the payload
        payload = buf.getvalue()
        with open(os.path.join(d, ".metadata"), "rb") as f:
            md = pickle.load(f)                     # test side: the file is ours
        for info in md.storage_data.values():       # every item now points at the payload
            info.offset, info.length = 0, len(payload)
        with open(os.path.join(d, ".metadata"), "wb") as f:
            pickle.dump(md, f)
    with open(os.path.join(d, kind), "wb") as f:
        f.write(payload)

    def sizes(m):
        m["files"] = {n: os.path.getsize(os.path.join(d, n)) for n in m["files"]}
    if kind != "checkpoint.json":
        _edit_manifest(d, sizes)


def _prepare(tmp):
    """Copies of the offload checkpoint F with one thing wrong each."""
    f = os.path.join(tmp, "F")
    v = _copy(f, os.path.join(tmp, "F_vocab"))
    _edit_manifest(os.path.join(v, "iter_0000002"), lambda m: m["model"].update(vocab_size=50000))
    m = _copy(f, os.path.join(tmp, "F_missing"))
    os.remove(os.path.join(m, "iter_0000002", "__0_0.distcp"))
    t = _copy(f, os.path.join(tmp, "F_trunc"))
    path = os.path.join(t, "iter_0000002", "__0_0.distcp")
    os.truncate(path, os.path.getsize(path) // 2)
    for kind in KINDS:
        _plant(_copy(f, os.path.join(tmp, f"F_payload{kind}")), kind, os.path.join(tmp, f"ran{kind}"))


def _jobs_with_prep(rank, jobs, cache, tmp):
    from tests.test_checkpoint_resume import _run_jobs

    out = _run_jobs(rank, jobs[:4], cache)          # F and G saved, rewound to iteration 2
    _prepare(tmp)
    return out + _run_jobs(rank, jobs[4:], cache)


def test_refusals_payloads_and_load_flags(tmp_path):
    seed = str(fresh_seed("refusals"))
    tmp = str(tmp_path)
    F, G = os.path.join(tmp, "F"), os.path.join(tmp, "G")
    base = [*TINY, "--fp32", "--seed", seed, "--eval-iters", "0", "--train-iters", "3"]
    off = [*base, "--zero-offload"]
    lg = lambda name: ["--log-jsonl", os.path.join(tmp, f"{name}.jsonl")]  # noqa: E731
    cases = {   # name: (argv, expected error fragment or None for success)
        "arch": ([*off, "--num-layers", "3", "--load", F], "--num-layers: 2 in the checkpoint, 3 here"),
        "vocab": ([*off, "--load", F + "_vocab"], "vocabulary has 50000 tokens"),
        "missing": ([*off, "--load", F + "_missing"], "__0_0.distcp is missing"),
        "trunc": ([*off, "--load", F + "_trunc"], "__0_0.distcp is truncated"),
        "base_into_off": ([*off, "--load", G], "written by the baseline optimizer"),
        "off_into_base": ([*base, "--load", F], "written by the zero_offload optimizer"),
        "schedule": ([*off, "--lr-decay-iters", "8", "--load", F], "learning-rate schedule differs"),
        "below": ([*off, "--train-iters", "1", "--load", F], "--train-iters 1 is below the checkpoint's iteration 2"),
        "override": ([*off, "--lr-decay-iters", "8", "--override-opt_param-scheduler", "--load", F, *lg("override")], None),
        "use_ckpt": ([*off, "--lr-decay-iters", "8", "--use-checkpoint-opt_param-scheduler", "--load", F, *lg("use_ckpt")], None),
        "weights_only": ([*off, "--no-load-optim", "--load", G, *lg("weights_only")], None),
        "finetune": ([*off, "--finetune", "--train-iters", "2", "--load", F, *lg("finetune")], None),
        **{f"payload{k}": ([*off, "--load", F + f"_payload{k}"], "") for k in KINDS},
    }
    jobs = [("job", [*off, "--save", F, "--save-interval", "2", *lg("F")]),
            ("job", [*base, "--save", G, "--save-interval", "2", *lg("G")])]
    jobs = [*jobs, ("reset", F, 2), ("reset", G, 2)] + [("job", argv) for argv, _ in cases.values()]
    out = run_world(_jobs_with_prep, 1, jobs, str(tmp_path / "cache"), tmp, timeout=600)[0]
    assert out[0]["rc"] == 0 and out[1]["rc"] == 0, out[:2]
    results = dict(zip(cases, out[4:]))
    for name, (_, want) in cases.items():
        r = results[name]
        if want is None:
            assert r.get("rc") == 0, (name, r)
            continue
        assert "error" in r, (name, r)
        msg = r["error"]
        assert "\n" not in msg and want in msg, (name, msg)
    for k in KINDS:                                    # refused, and no code from the file ran
        assert not os.path.exists(os.path.join(tmp, f"ran{k}")), k
        assert F + f"_payload{k}" in results[f"payload{k}"]["error"], results[f"payload{k}"]
    for name in ("arch", "schedule", "missing", "trunc"):
        assert F in results[name]["error"]
    f_log, g_log = _log(os.path.join(tmp, "F.jsonl")), _log(os.path.join(tmp, "G.jsonl"))
    f3 = {r["iteration"]: r for r in f_log}[3]
    # --use-checkpoint-opt_param-scheduler: the checkpoint's schedule, the exact continuation
    row = _log(os.path.join(tmp, "use_ckpt.jsonl"))[0]
    assert (row["iteration"], row["loss"], row["lr"]) == (3, f3["loss"], f3["lr"])
    # --override-opt_param-scheduler: this run's schedule (decay over 8 iterations: a higher rate)
    assert _log(os.path.join(tmp, "override.jsonl"))[0]["lr"] > f3["lr"]
    # --no-load-optim: the baseline's weights in the offload engine; iteration 3's forward is theirs
    w = _losses(os.path.join(tmp, "weights_only.jsonl"))
    g3 = {r["iteration"]: r["loss"] for r in g_log}[3]
    assert sorted(w) == [3] and abs(w[3] - g3) <= 1e-6 * abs(g3)
    # --finetune: iteration 0, the data from its start, with the trained weights (lower loss)
    ft = _losses(os.path.join(tmp, "finetune.jsonl"))
    assert sorted(ft) == [1, 2] and ft[1] < _losses(os.path.join(tmp, "F.jsonl"))[1]


def _kill_run(rank, argv, cache, point):
    os.environ["ZO_MEGATRON_CACHE"] = cache
    if point:
        os.environ["ZO_MEGATRON_TEST_KILL_SAVE"] = point
    from zo_megatron.training.loop import pretrain

    return pretrain(argv)


def test_a_save_killed_at_any_point_leaves_the_previous_checkpoint_loadable(tmp_path):
    seed = str(fresh_seed("kill during save"))
    save = tmp_path / "S"
    cache = str(tmp_path / "cache")
    common = [*TINY, "--zero-offload", "--fp32", "--seed", seed, "--eval-iters", "0", "--train-iters", "4",
              "--lr-decay-iters", "4", "--save", str(save), "--save-interval", "2"]
    latest = save / "latest_checkpointed_iteration.txt"
    runs = [("shards@4", []), ("before_rename@4", ["--load", str(save)]), ("before_latest@4", ["--load", str(save)])]
    for i, (point, extra) in enumerate(runs):
        with pytest.raises(AssertionError, match="exit code -9"):
            run_world(_kill_run, 1, [*common, *extra, "--log-jsonl", str(tmp_path / f"{i}.jsonl")], cache, point,
                      timeout=200)
        assert latest.read_text() == "2\n", point
        assert (save / "iter_0000002" / "checkpoint.json").exists()
        partial = (save / "iter_0000004.partial").exists()
        assert partial == (point != "before_latest@4"), point       # the rename happened only before `latest`
        assert (save / "iter_0000004").exists() == (point == "before_latest@4"), point
    # the next run resumes from 2 (the stale directories are ignored), saves 4 and keeps only it
    run_world(_kill_run, 1, [*common, "--load", str(save), "--keep-last", "1", "--log-jsonl",
                             str(tmp_path / "last.jsonl")], cache, None, timeout=200)
    assert latest.read_text() == "4\n"
    assert sorted(os.listdir(save)) == ["iter_0000004", "latest_checkpointed_iteration.txt"]
    first, last = _losses(tmp_path / "0.jsonl"), _losses(tmp_path / "last.jsonl")
    assert last == {3: first[3], 4: first[4]}


# every interpreter of the launch: on RANK == ZO_TEST_FULL_RANK, writing a file whose name ends in
# ZO_TEST_FULL_FILE fails as on a full disk (the save's own files: the manifest, the RNG state)
SAVE_DISK_FULL = """
import errno, os
if os.environ.get("RANK") == os.environ.get("ZO_TEST_FULL_RANK"):
    from zo_megatron.checkpoint import save
    _real = save.write_durable
    def _full(path, *args, **kwargs):
        if os.path.basename(path).endswith(os.environ["ZO_TEST_FULL_FILE"]):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
        return _real(path, *args, **kwargs)
    save.write_durable = _full
"""


@pytest.mark.parametrize("rank,name", [("0", "checkpoint.json"), ("1", ".json")], ids=["manifest-rank0", "rng-rank1"])
def test_a_save_file_failing_on_one_rank_is_one_line_on_every_rank(tmp_path, rank, name):
    """After DCP's shards (whose failure DCP reports to every rank) the save writes per-rank files (the
    RNG state, the checksums) and rank 0 the manifest and `latest`, separated by plain barriers: a full
    disk there on one rank left the others at the next barrier until they lost contact (found by review
    on 2026-12-07). Now the save fails on every rank with that rank's error: one line, the previous
    checkpoint (none here) stays latest."""
    from tests.test_pretrain import TINY as JOB, _run_with_fault

    save = tmp_path / "ckpt"
    r = _run_with_fault(tmp_path, ["--zero-offload", "--mock-data", *JOB, "--train-iters", "2", "--save", save],
                        SAVE_DISK_FULL, ZO_TEST_FULL_RANK=rank, ZO_TEST_FULL_FILE=name)
    assert "lost contact" not in r.stdout + r.stderr, r.stderr[-3000:]
    errors = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.startswith("error:")]
    assert len(errors) == 1, r.stderr[-3000:]
    assert errors[0].startswith(f"error: saving the checkpoint of iteration 2 to {save} failed (saving ") and \
        f"failed: rank {rank}: OSError: [Errno 28] No space left on device" in errors[0], errors[0]
    assert not (save / "latest_checkpointed_iteration.txt").exists()
