"""The dataset index cache must be one directory for every rank (training/components.py): megatron-core
builds the indices on rank 0 and the other ranks read them from there. A rank whose --data-cache-path
is a directory of its own (as a node-local disk in a multi-node job) failed inside megatron-core with a
traceback ("MockGPTDataset failed to build as a mock data generator") and rank 0 lost its peer; now
both ranks exit 2 and rank 0 prints one line naming the rank that does not see the cache."""
import os

from tests.harness import run_world
from tests.test_pretrain import _rank_job

ARGV = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--micro-batch-size", "1", "--lr", "1e-3", "--train-iters", "2", "--mock-data", "--tokenizer-type",
        "NullTokenizer", "--vocab-size", "100", "--no-progress-bar", "--zero-offload", "--fp32"]


def _rank_with_own_cache(rank, base):
    """This rank's --data-cache-path is a directory of its own, as on a node with its own disk."""
    return _rank_job(rank, [*ARGV, "--data-cache-path", os.path.join(base, f"node{rank}")],
                     {"ZO_MEGATRON_CACHE": os.path.join(base, "zo")})


def test_an_index_cache_not_shared_by_every_rank_is_one_line(tmp_path):
    (rc0, _, err0), (rc1, out1, err1) = run_world(_rank_with_own_cache, 2, str(tmp_path), timeout=120)
    assert (rc0, rc1) == (2, 2), (err0[-2000:], err1[-2000:])
    errors = [line for line in err0.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and "Traceback" not in err0 + err1, (err0[-2000:], err1[-2000:])
    assert errors[0].startswith(f"error: --data-cache-path {tmp_path / 'node0'} is not one directory for every "
                                "rank: rank 1 does not see the file rank 0 wrote there"), errors
    assert "use a directory on a file system every node mounts" in errors[0]
    assert not [ln for ln in err1.splitlines() if ln.startswith("error")], err1[-2000:]   # rank 0 reports it
    assert not [n for n in os.listdir(tmp_path / "node0") if n.startswith(".shared-probe")]   # the probe is gone


def _rank_in(rank, base, dirs, read_only_probe=False):
    """The job with --data-cache-path dirs[rank]; read_only_probe: rank 0 cannot create files there
    (a read-only mount of a built cache; as root a chmod would not stop it, so open() refuses)."""
    if read_only_probe and rank == 0:
        import zo_megatron.training.components as components

        def refuse(path, *a, **k):
            if ".shared-probe-" in str(path):
                raise PermissionError(13, "Read-only file system", str(path))
            return open(path, *a, **k)
        components.open = refuse
    return _rank_job(rank, [*ARGV, "--eval-iters", "0", "--data-cache-path", os.path.join(base, dirs[rank])],
                     {"ZO_MEGATRON_CACHE": os.path.join(base, "zo")})


def test_a_cache_copied_to_every_node_or_read_only_is_used_as_it_is(tmp_path):
    """megatron-core reads a cache hit from any directory: a built cache copied to each node's own disk
    trains (megatron-core finds its files on every rank), and so does a shared cache rank 0 cannot
    write to (the probe is skipped: it cannot tell, megatron-core reads its files)."""
    import shutil

    built = run_world(_rank_in, 2, str(tmp_path), ["node0", "node0"], timeout=120)
    assert [rc for rc, _, _ in built] == [0, 0], built[0][2][-2000:]
    shutil.copytree(tmp_path / "node0", tmp_path / "node1")
    for dirs, read_only in ((["node0", "node1"], False), (["node0", "node0"], True)):
        out = run_world(_rank_in, 2, str(tmp_path), dirs, read_only, timeout=120)
        assert [rc for rc, _, _ in out] == [0, 0], (dirs, out[0][2][-2000:], out[1][2][-2000:])
        assert "iter      2/2" in out[0][1], out[0][1][-2000:]
