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
