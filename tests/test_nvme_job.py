"""The job with --optimizer-nvme-path (issue 38): the same losses and grad norms as the in-memory job,
bit for bit (one rank, bf16, bf16 states and the master on disk, eval included; TP x DP and the other
cases are tests/test_nvme_engine.py's), the banner says where the states live
and warns when DIR is RAM-backed, DIR is empty after a clean exit; the flags' conflicts are one line,
exit 2; the disk filling up mid-step on one rank of two stops the job with one line, no rank
hanging, and the last checkpoint resumes to the uninterrupted run's losses."""
import os

import pytest

from tests.test_pretrain import TINY, _rank_job, _rows, _run_with_fault, _single


def test_job_with_states_on_disk_equals_the_in_memory_job(tmp_path):
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    nvme = os.path.join(shm or str(tmp_path), f"zo-nvme-job-{os.getpid()}")
    os.makedirs(nvme)
    common = ["--zero-offload", "--bf16", "--mock-data", "--train-iters", "3", *TINY, "--eval-interval", "2",
              "--exp-avg-dtype", "bf16", "--exp-avg-sq-dtype", "bf16", "--clip-grad", "0.1"]
    rows, out, io = {}, {}, {}
    try:
        for name, extra in (("memory", []), ("nvme", ["--optimizer-nvme-path", nvme, "--optimizer-nvme-master",
                                                      "--optimizer-nvme-buffer-size", "4096",
                                                      "--optimizer-nvme-buffer-count", "3"])):
            log = tmp_path / f"{name}.jsonl"
            r = _single([*common, *extra, "--log-jsonl", str(log)], tmp_path)    # DP > 1: test_nvme_engine.py
            assert r.returncode == 0, name + r.stderr[-3000:]
            rows[name] = [(x["loss"], x["grad_norm"], x["skipped"]) for x in _rows(log, "train")]
            io[name] = [(x.get("nvme_read_bytes_per_step"), x.get("nvme_written_bytes_per_step"),
                         x.get("nvme_io_wait_s_per_step")) for x in _rows(log, "train")]
            out[name] = r.stdout
        left = os.listdir(nvme)
    finally:
        for f in os.listdir(nvme):
            os.unlink(os.path.join(nvme, f))
        os.rmdir(nvme)
    assert len(rows["nvme"]) == 3 and rows["nvme"] == rows["memory"], rows
    line = next(x for x in out["nvme"].splitlines() if "optimizer states on disk" in x)
    assert "exp_avg (bf16), exp_avg_sq (bf16), fp32 master in " + nvme in line and "I/O ring 3 x 4096" in line
    assert ("is on tmpfs, which is host memory" in out["nvme"]) == (shm is not None)
    assert left == []                                          # the state files go at a clean exit
    # the progress line: the disk traffic per iteration and the exposed I/O wait, only with the tier
    iters = {k: [x for x in v.splitlines() if " iter " in x and " loss " in x] for k, v in out.items()}
    assert iters["nvme"] and all(" disk read " in x and " written " in x and " waited " in x for x in iters["nvme"])
    assert iters["memory"] and not any(" disk read " in x for x in iters["memory"])
    said = [x for x in out["nvme"].splitlines() if "TB per day over its 1 ranks" in x]
    assert len(said) == 1 and "GB written per step per rank" in said[0], out["nvme"][-2000:]
    assert all(x == (None, None, None) for x in io["memory"])   # the I/O fields only with the tier
    first, *rest = io["nvme"]                                  # the first row also wrote the initial states
    assert first[1] == 2 * first[0] > 0, io["nvme"]
    for read, written, wait in rest:                           # every step reads and writes each state once
        assert read == written == first[0] and wait >= 0.0, io["nvme"]
    # before any step, the banner projects what the run writes: each step's bytes (those the log then
    # measures) x the iterations x the ranks
    said = [x for x in out["nvme"].splitlines() if "the run's 3 iterations write about" in x]
    assert len(said) == 1, out["nvme"][-3000:]
    assert f"each step reads and writes {first[0] / 1e9:.3g} GB per rank" in said[0], (said, first)
    assert f"write about {3 * first[0] / 1e12:.3g} TB over its 1 ranks" in said[0], (said, first)


def test_overlapped_job_with_states_on_disk_equals_the_in_memory_one_and_resumes(tmp_path):
    """--overlap-cpu-step with the states and the master on disk: the in-memory overlapped job's losses
    and grad norms bit for bit (a clip that never clips: the speculated chunks commit), a save
    in the middle and a resume from it as well; the banner's overlap line counts the rollback state on
    disk; DIR empty after."""
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    common = ["--zero-offload", "--bf16", "--mock-data", *TINY, "--eval-interval", "2", "--clip-grad", "1000",
              "--overlap-cpu-step", "--lr-warmup-iters", "0", "--lr-decay-style", "constant"]
    tier = ["--optimizer-nvme-path", nvme, "--optimizer-nvme-master", "--optimizer-nvme-buffer-size", "4096",
            "--optimizer-nvme-buffer-count", "3"]
    rows, out = {}, {}
    for name, extra in (("memory", []), ("nvme", tier),
                        ("nvme-resumed", [*tier, "--load", tmp_path / "ckpt", "--ckpt-step", "2"])):
        log = tmp_path / f"{name}.jsonl"
        save = [] if name == "memory" else ["--save", tmp_path / ("ckpt" if name == "nvme" else "ckpt2"),
                                            "--save-interval", "2"]
        r = _single([str(a) for a in (*common, "--train-iters", "4", *extra, *save, "--log-jsonl", log)], tmp_path)
        assert r.returncode == 0, name + r.stderr[-3000:]
        rows[name] = [(x["iteration"], x["loss"], x["grad_norm"], x["skipped"], x.get("speculated_buckets"),
                       x.get("rolled_back_buckets")) for x in _rows(log, "train")]
        out[name] = r.stdout
        assert os.listdir(nvme) == [], (name, os.listdir(nvme))     # the state files go at a clean exit
    same = {k: [x[:4] for x in v] for k, v in rows.items()}    # (the speculated units differ: chunks, segments)
    assert len(same["nvme"]) == 4 and same["nvme"] == same["memory"], rows
    assert sum(x[4] or 0 for x in rows["nvme"]) > 0 and not any(x[5] for x in rows["nvme"]), rows   # committed
    assert same["nvme-resumed"] == same["memory"][2:], rows        # resumed at iteration 2: bit for bit
    line = next(x for x in out["nvme"].splitlines() if "--overlap-cpu-step" in x and "speculated" in x)
    assert "of disk per node" in line, line


def test_the_whole_optimizer_on_the_device_leaves_the_disk_unused(tmp_path):
    """--optimizer-offload-fraction 0 with the tier, and auto, which picks 0 for this small model (the
    device is the host's memory): the in-memory job's losses bit for bit, no state file, one banner
    line saying DIR is unused. Before, the store was opened for an empty host partition (a traceback),
    and auto was refused with the tier."""
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    # fp32: two launches of one bf16 job on an AMX Xeon (Sapphire Rapids class, torch 2.13 CPU, oneDNN) gave
    # first-iteration losses 1.5e-6 apart in about one launch of four, whatever the optimizer tier (measured
    # 2026-12-07: 10.82866096 vs 10.82864571): bit-identity across launches holds for fp32 matmuls only there
    common = ["--zero-offload", "--mock-data", "--train-iters", "2", "--fp32", *TINY]
    rows, out = {}, {}
    for name, extra in (("memory", ["--optimizer-offload-fraction", "0"]),
                        ("nvme", ["--optimizer-offload-fraction", "0", "--optimizer-nvme-path", str(nvme)]),
                        ("nvme-auto", ["--optimizer-offload-fraction", "auto", "--optimizer-nvme-path", str(nvme)])):
        log = tmp_path / f"{name}.jsonl"
        r = _single([*common, *extra, "--log-jsonl", str(log)], tmp_path)
        assert r.returncode == 0, name + r.stderr[-3000:]
        rows[name] = [(x["loss"], x["grad_norm"]) for x in _rows(log, "train")]
        out[name] = r.stdout
        assert os.listdir(nvme) == [], name
    assert len(rows["nvme"]) == 2 and rows["nvme"] == rows["memory"] == rows["nvme-auto"], rows
    assert "0% on the host" in out["nvme-auto"], out["nvme-auto"][-2000:]
    for name in ("nvme", "nvme-auto"):
        said = [x for x in out[name].splitlines() if "optimizer states on disk: none" in x]
        assert len(said) == 1 and f"{nvme} is not used" in said[0], out[name][-2000:]


@pytest.mark.parametrize("extra,needle", [
    (["--optimizer-nvme-master"], "--optimizer-nvme-master applies to the optimizer states on disk: add "
                                  "--optimizer-nvme-path DIR"),
    (["--optimizer-nvme-path", "{d}"], "--optimizer-nvme-path puts the CPU optimizer's states on disk: add --zero-offload"),
    (["--zero-offload", "--optimizer-nvme-path", "{d}/nope"], "is not a directory"),
    (["--zero-offload", "--optimizer-nvme-path", "{d}", "--optimizer-nvme-buffer-size", "100"], "multiple of 64"),
], ids=["master-alone", "no-offload", "missing-dir", "buffer-size"])
def test_nvme_flag_conflicts_are_one_line(tmp_path, extra, needle):
    r = _single([*TINY, "--train-iters", "1", "--lr-warmup-iters", "0", *[a.format(d=tmp_path) for a in extra]], tmp_path)
    lines = [x for x in r.stderr.splitlines() if x.startswith("error:")]
    assert r.returncode == 2 and len(lines) == 1 and needle in lines[0], r.stderr[-2000:]
    assert "Traceback" not in r.stderr


# Loaded by every interpreter of the launch (PYTHONPATH): in the rank named by ZO_TEST_DISK_QUOTA
# ("rank:bytes") the state files may take that many bytes of writes in all; the write that would pass
# it fails with ENOSPC, as a disk filling up does (offload/nvme_io.py's _pwritev, its one system call).
FILLING_DISK = """
import errno, os
_rank, _, _quota = os.environ.get("ZO_TEST_DISK_QUOTA", "").partition(":")
if _rank and os.environ.get("RANK") == _rank:
    from zo_megatron.offload import nvme_io
    _real, _written = nvme_io._pwritev, [0]
    def _filling(fd, bufs, offset):
        n = sum(memoryview(b).nbytes for b in bufs)
        if _written[0] + n > int(_quota):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        _written[0] += n
        return _real(fd, bufs, offset)
    nvme_io._pwritev = _filling
"""


def _run_filling_disk(tmp_path, argv, quota: int):
    """The job under torchrun on 2 ranks, rank 1's state files allowed `quota` bytes of writes
    (FILLING_DISK); it must fail, every rank ending well inside the launch's timeout (none waits)."""
    return _run_with_fault(tmp_path, argv, FILLING_DISK, ZO_TEST_DISK_QUOTA=f"1:{quota}")


def _world(tmp_path, argv):
    import types

    from tests.harness import run_world

    res = run_world(_rank_job, 2, [str(a) for a in argv], {"ZO_MEGATRON_CACHE": str(tmp_path / "cache")}, timeout=300)
    return types.SimpleNamespace(rcs=[rc for rc, _, _ in res], stderr="".join(e for _, _, e in res))


@pytest.mark.slow       # three 2-rank runs, 1.5-2.5 min here
def test_disk_full_mid_step_is_one_line_and_the_last_checkpoint_resumes(tmp_path):
    """Issue 38's fault: the disk fills while rank 1 writes its states back in iteration 3 (after the
    checkpoint of iteration 2), under torchrun. Every rank ends (no hang), one `error:` line in all, and
    it is rank 1's full disk with --optimizer-nvme-path (the ranks agree on the CPU step's outcome:
    schedules.cpu_step_agreed; before, rank 0 went on to the all-gather and the line was its "lost
    contact with its peers"); iteration 2 stays the latest checkpoint, and resuming from it gives
    iteration 3 the loss and grad norm of the run the disk never stopped."""
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    common = ["--zero-offload", "--mock-data", "--train-iters", "3", *TINY, "--eval-interval", "100",
              "--save-interval", "2", "--optimizer-nvme-path", nvme, "--optimizer-nvme-buffer-size", "4096",
              "--optimizer-nvme-buffer-count", "2"]
    ref = _world(tmp_path, [*common, "--save", tmp_path / "ref", "--log-jsonl", tmp_path / "ref.jsonl"])
    assert ref.rcs == [0, 0], ref.stderr[-3000:]
    rows = _rows(tmp_path / "ref.jsonl", "train")
    step = rows[1]["nvme_written_bytes_per_step"]                 # per rank: DP partitions are equal
    assert step > 0 and rows[0]["nvme_written_bytes_per_step"] == 2 * step   # + the initial states
    save = tmp_path / "ckpt"
    quota = 3 * step + step // 2            # the initial states, iterations 1 and 2, half of iteration 3
    r = _run_filling_disk(tmp_path, [*common, "--save", save], quota)
    errors = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.startswith("error:")]
    assert len(errors) == 1, r.stderr[-3000:]
    disk = "no space left on the device while writing optimizer states"
    assert errors[0].startswith(f"error: rank 1: {nvme}/zo_optimizer.tp0.dp1."), errors[0]
    assert disk in errors[0] and "--optimizer-nvme-path" in errors[0], errors[0]
    assert "lost contact" not in r.stdout + r.stderr
    assert f'File "{ROOT}/zo_megatron' not in r.stderr               # no traceback through the job's code
    assert " iter      2/" in r.stdout or " iter 2/" in r.stdout or "iteration 2" in r.stdout, r.stdout[-2000:]
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    res = _world(tmp_path, [*common, "--save", save, "--load", save, "--log-jsonl", tmp_path / "resumed.jsonl"])
    assert res.rcs == [0, 0], res.stderr[-3000:]
    again = _rows(tmp_path / "resumed.jsonl", "train")
    assert [(x["iteration"], x["loss"], x["grad_norm"]) for x in again] == \
        [(x["iteration"], x["loss"], x["grad_norm"]) for x in rows if x["iteration"] == 3]
    assert os.listdir(nvme) == []                                 # the resumed run reclaimed and removed them


# (--clip-grad, the rank's writes allowed, in steps' writes): a clip that never clips commits every
# speculated step, and the disk fills in iteration 2's speculated pass (initial states, iteration 1,
# a tenth of iteration 2); one that always clips rolls iteration 1 back, and the disk fills in its redo
# (initial states, iteration 1's speculated pass, half the redo)
@pytest.mark.parametrize("clip,quota", [("1000", 2.1), ("0.001", 2.5)], ids=["speculated-pass", "redo"])
def test_disk_full_in_an_overlapped_step_is_one_line_on_every_rank(tmp_path, clip, quota):
    """The same fault under --overlap-cpu-step (found by review on 2026-12-07): the speculated pass
    writes the chunks it updates during backward, on the worker, and a step that rolls back redoes the
    update; neither was inside the ranks' agreement, so rank 1's full disk left rank 0 at the norm's
    all-reduce or the all-gather until it lost contact. Every rank ends with rank 1's one line."""
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    common = ["--zero-offload", "--mock-data", *TINY, "--eval-interval", "100", "--overlap-cpu-step",
              "--clip-grad", clip, "--lr-warmup-iters", "0", "--lr-decay-style", "constant",
              "--optimizer-nvme-path", nvme, "--optimizer-nvme-buffer-size", "4096",
              "--optimizer-nvme-buffer-count", "2"]
    ref = _world(tmp_path, [*common, "--train-iters", "2", "--log-interval", "1", "--log-jsonl", tmp_path / "ref.jsonl"])
    assert ref.rcs == [0, 0], ref.stderr[-3000:]
    rows = _rows(tmp_path / "ref.jsonl", "train")
    step = rows[1]["nvme_written_bytes_per_step"]     # a step's writes (iteration 2: committed, or held back)
    assert rows[0]["speculated_buckets"] and bool(rows[0]["rolled_back_buckets"]) == (clip != "1000"), rows
    r = _run_filling_disk(tmp_path, [*common, "--train-iters", "3", "--log-interval", "1"], int(quota * step))
    assert "lost contact" not in r.stdout + r.stderr, r.stderr[-3000:]
    errors = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.startswith("error:")]
    assert len(errors) == 1, r.stderr[-3000:]
    assert errors[0].startswith(f"error: rank 1: {nvme}/zo_optimizer.tp0.dp1."), errors[0]
    assert "no space left on the device while writing optimizer states" in errors[0], errors[0]
    assert "speculated" in r.stdout or "--overlap-cpu-step" in r.stdout, r.stdout[-2000:]   # the overlap was on


@pytest.mark.parametrize("save", [False, True], ids=["next-step", "save"])
def test_a_failed_write_still_in_flight_after_a_step_is_one_line_on_every_rank(tmp_path, save):
    """A CPU step's last chunks are still being written when its agreed block ends (the disk works
    while the device does). Their failure used to surface outside any agreement -- in the next step's
    read-ahead when backward starts, or in the save's wait for the writes -- so rank 1 left while the
    other ranks went on to the reduce-scatters or the save (found by review on 2026-12-07). Now a
    read-ahead leaves a failed write for the next blocking wait (the next agreed CPU step), and
    evaluation, a save and the end of training flush the writes inside an agreement. The disk fills
    on the very last byte of iteration 2's writes."""
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    common = ["--zero-offload", "--mock-data", *TINY, "--eval-interval", "100", "--optimizer-nvme-path", nvme,
              "--optimizer-nvme-buffer-size", "4096", "--optimizer-nvme-buffer-count", "2", "--log-interval", "1"]
    ref = _world(tmp_path, [*common, "--train-iters", "2", "--log-jsonl", tmp_path / "ref.jsonl"])
    assert ref.rcs == [0, 0], ref.stderr[-3000:]
    step = _rows(tmp_path / "ref.jsonl", "train")[1]["nvme_written_bytes_per_step"]
    extra = ["--save", tmp_path / "ckpt", "--save-interval", "2"] if save else []
    r = _run_filling_disk(tmp_path, [*common, "--train-iters", "3", *extra], 3 * step - 1)  # initial + 2 steps
    assert "lost contact" not in r.stdout + r.stderr, r.stderr[-3000:]
    errors = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(f"error: rank 1: {nvme}/zo_optimizer.tp0.dp1."), errors
    assert "no space left on the device while writing optimizer states" in errors[0], errors[0]
    if save:
        assert not (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").exists()


# Loaded by every interpreter of the launch: in the rank named by ZO_TEST_BAD_MASTER the master read back
# from disk fails its checksum, as a state file changed on disk does (nvme_io.StateFileError)
BAD_MASTER = """
import os
if os.environ.get("RANK") == os.environ.get("ZO_TEST_BAD_MASTER"):
    from zo_megatron.offload import nvme_io, nvme_store
    def _bad(self, out):
        raise nvme_io.StateFileError(f"{self.config.path}/master: bytes 0..4096 changed on disk since they were "
                                     "written (test)")
    nvme_store.NvmeStateStore.copy_master_to = _bad
"""


def _assert_bad_master_line(r, nvme):
    assert "lost contact" not in r.stdout + r.stderr, r.stderr[-3000:]
    errors = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.startswith("error:")]
    assert errors == [f"error: rank 1: {nvme}/master: bytes 0..4096 changed on disk since they were written (test)"], \
        r.stderr[-3000:]


NVME_MASTER = ["--zero-offload", "--mock-data", *TINY, "--optimizer-nvme-master", "--optimizer-nvme-buffer-size", "4096",
               "--optimizer-nvme-buffer-count", "2"]


def test_a_bad_master_read_at_a_dpu_flush_is_one_line_on_every_rank(tmp_path):
    """DPU with weight prediction and the master on disk: before an evaluation the exact master is read
    back from disk (DelayedSchedule.flush); that read failing on rank 1 alone (found by review on
    2026-12-07) left rank 0 at the parameters' all-gather until it lost contact. Every rank ends with
    rank 1's one line."""
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    r = _run_with_fault(tmp_path, [*NVME_MASTER, "--optimizer-nvme-path", nvme, "--train-iters", "3", "--eval-interval",
                                   "2", "--eval-iters", "1", "--dpu", "--dpu-warmup-steps", "1", "--dpu-weight-prediction"],
                        BAD_MASTER, ZO_TEST_BAD_MASTER="1")
    _assert_bad_master_line(r, nvme)


def test_a_bad_master_read_at_a_resume_is_one_line_on_every_rank(tmp_path):
    """The same read when a resume re-derives the 16-bit parameters from the master on disk
    (reload_params_from_master, after the checkpoint's states were written into the state files)."""
    nvme, save = tmp_path / "nvme", tmp_path / "ckpt"
    nvme.mkdir()
    argv = [*NVME_MASTER, "--optimizer-nvme-path", nvme, "--eval-interval", "100", "--save", save]
    ok = _world(tmp_path, [*argv, "--train-iters", "3", "--exit-interval", "2"])
    assert ok.rcs == [0, 0], ok.stderr[-3000:]
    r = _run_with_fault(tmp_path, [*argv, "--train-iters", "3", "--load", save], BAD_MASTER, ZO_TEST_BAD_MASTER="1")
    _assert_bad_master_line(r, nvme)
