"""A check failing on a rank other than 0 is reported once, with its rank (issue 17, item 12)."""
import glob
import os
import sys

from tests.harness import run_world

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "pretrain", "pretrain_gpt.py")
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")


def _agree_world(rank):
    from zo_megatron.data.errors import DataError
    from zo_megatron.errors import UserError
    from zo_megatron.parallel import collectives, init_parallel

    init_parallel(1, seed=1)
    out = {}
    cases = {
        "none": {},
        "rank2": {2: DataError("shard 2 is truncated: re-run preprocessing")},
        "rank1_and_2": {1: UserError("first"), 2: UserError("second")},
        "bug_on_1": {1: RuntimeError("boom\nsecond line")},
        "long": {0: UserError("é" * 3000)},
    }
    for name, fails in cases.items():
        try:
            with collectives.all_ranks_agree():
                if rank in fails:
                    raise fails[rank]
            out[name] = "ok"
        except UserError as exc:
            out[name] = f"UserError:{exc}"
        except RuntimeError as exc:
            out[name] = f"RuntimeError:{exc}"
    # an agreement inside another (the job's agreed flush holds DPU's agreed join): the inner outcome
    # passes through the outer one unchanged, once, on every rank
    import contextlib
    import io

    printed = io.StringIO()              # what this rank prints (rank 0 prints an agreed error once)
    for name, fail in (("nested", UserError("inner")), ("nested_bug", RuntimeError("inner bug"))):
        try:
            with contextlib.redirect_stderr(printed), collectives.all_ranks_agree():
                with collectives.all_ranks_agree():
                    if rank == 1:
                        raise fail
            out[name] = "ok"
        except (UserError, RuntimeError) as exc:
            out[name] = f"{type(exc).__name__}:{exc}"
    out["printed"] = printed.getvalue().splitlines()
    out["after"] = collectives.all_reduce(__import__("torch").ones(1)).item()    # the world still works
    return out


def test_every_rank_learns_the_first_failing_rank_and_its_message():
    outs = run_world(_agree_world, 3)
    for rank, out in enumerate(outs):
        assert out["none"] == "ok"
        assert out["rank2"] == "UserError:rank 2: shard 2 is truncated: re-run preprocessing"
        assert out["rank1_and_2"] == "UserError:rank 1: first"
        if rank == 1:
            assert out["bug_on_1"] == "RuntimeError:boom\nsecond line"      # its own traceback stays
        else:
            assert out["bug_on_1"] == "UserError:rank 1: RuntimeError: boom (traceback on that rank)"
        assert out["long"].startswith("UserError:rank 0: ééé") and len(out["long"].encode()) < 2100
        assert out["nested"] == "UserError:rank 1: inner"          # not "rank 0: rank 1: inner"
        assert out["printed"] == ([] if rank else ["error: rank 1: inner",
                                                   "error: rank 1: RuntimeError: inner bug (traceback on that rank)"])
        assert out["nested_bug"] == ("RuntimeError:inner bug" if rank == 1 else
                                     "UserError:rank 1: RuntimeError: inner bug (traceback on that rank)")
        assert out["after"] == 3.0


def test_a_damaged_checkpoint_file_of_rank_1_is_one_line_naming_it(tmp_path):
    from zo_megatron.data import extract_corpus
    from zo_megatron.data.preprocess import preprocess

    files = extract_corpus(str(tmp_path / "txt"), limit=6)
    preprocess(files, str(tmp_path / "sotu"), progress=False)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_", "OMPI_", "PMI_", "SLURM_", "TORCHELASTIC"))}
    env.update(PYTHONPATH=ROOT, ZO_MEGATRON_CACHE=str(tmp_path / "cache"))
    ck = tmp_path / "ck"
    common = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "32",
              "--micro-batch-size", "2", "--lr", "1e-3", "--lr-decay-iters", "4", "--eval-iters", "0", "--no-progress-bar", "--zero-offload",
              "--data-path", str(tmp_path / "sotu_text_document"), "--split", "100,0,0"]

    def job(*extra):                    # two forked ranks (tests/test_pretrain.py's _job), not torchrun
        from tests.test_pretrain import _job

        return _job([*common, *extra], tmp_path, timeout=240)

    r = job("--train-iters", "2", "--save", str(ck))
    assert r.returncode == 0, r.stderr[-3000:]
    rank1 = glob.glob(str(ck / "iter_*" / "__1_0.distcp"))          # the data file rank 1 wrote
    assert len(rank1) == 1, os.listdir(ck)
    with open(rank1[0], "r+b") as f:
        f.truncate(os.path.getsize(rank1[0]) // 2)
    r = job("--train-iters", "4", "--load", str(ck))
    assert r.returncode != 0
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    # every rank checks every file before anything is loaded: the lowest rank reports, once
    assert len(errors) == 1 and errors[0].startswith("error: rank ") and "__1_0.distcp" in errors[0], \
        r.stderr[-3000:]
    # no rank of ours prints a traceback
    ours = (os.path.join(ROOT, "zo_megatron"), os.path.join(ROOT, "pretrain"))
    assert not any(ln.strip().startswith(tuple(f'File "{p}' for p in ours)) for ln in r.stderr.splitlines()), \
        r.stderr[-3000:]
    assert "resumed" not in r.stdout


def _timeout_world(rank):
    import time

    from zo_megatron.parallel import collectives, init_parallel

    init_parallel(1, seed=1)
    if rank == 1:                       # a peer that stopped answering: it never reaches the agreement
        time.sleep(8)
        return None
    t0 = time.monotonic()
    try:
        with collectives.all_ranks_agree():
            raise collectives.CollectiveTimeout("rank 1 did not answer")
    except collectives.CollectiveTimeout as exc:
        return str(exc), time.monotonic() - t0
    return "no error", time.monotonic() - t0


def test_a_timed_out_peer_is_not_waited_for_again_by_the_agreement():
    """A CollectiveTimeout inside the block (a timed host wait on a peer that stopped answering: the
    overlapped schedule's join waits for the peers' reduce-scatters) leaves at once with its own type,
    instead of the agreement's collective waiting for the same silent peer a second time (it would
    here for the 8 s rank 1 sleeps; on a real job for the process group's timeout)."""
    out = run_world(_timeout_world, 2)[0]
    assert out[0] == "rank 1 did not answer" and out[1] < 4, out
