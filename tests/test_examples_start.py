"""Every script under examples/ starts on its first launch (issue 35, item 1; DEVELOPERS' rule).

Each script is run by bash with its launcher stubbed (tests/example_scripts.py), with tiny
overriding flags appended through its "$@" (a 1-layer model, TP 1, one iteration; everything
else the script's own: its --save X --load X on a directory that does not exist yet, its
tokenizer, precision and attention flags). The command line it launches is then run as one
process on this CPU and must reach its first iteration, warning that --load found nothing.
The module's tests share one ZO_MEGATRON_CACHE (the embedded corpus tokenized once per tokenizer, as
a user's second job finds it; the product builds that cache under a lock for concurrent jobs): a
cold cache costs each test 5 s of tokenizing here, and what is first about the launch is its
--save X --load X."""
import os
import subprocess
import sys

import pytest

from tests import example_scripts as X

TINY = ["--num-layers", "1", "--hidden-size", "64", "--num-attention-heads", "4", "--num-query-groups", "2",
        "--ffn-hidden-size", "128", "--seq-length", "64", "--max-position-embeddings", "64",
        "--micro-batch-size", "1", "--global-batch-size", "1", "--train-iters", "1", "--tensor-parallel", "1",
        "--lr", "1e-3", "--lr-warmup-iters", "0", "--lr-decay-iters", "1", "--eval-iters", "1",
        "--eval-interval", "1", "--no-progress-bar"]
# a mixture of experts' script (mixtral_8x7b_ep8.sh, qwen3_30b_a3b_ep8.sh, deepseek_v2_lite_ep8.sh) also gets 4
# small experts, top 2, on the one process: EP 1, the one layer MoE (a script's per-layer list is for its own
# depth; its routing, dispatcher and aux-loss flags are its own)
TINY_MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "64",
            "--expert-model-parallel-size", "1", "--moe-layer-freq", "1"]
EXAMPLES = [p for p in X.EXAMPLES if X.launches_pretrain(p)]


@pytest.fixture(scope="module")
def corpus_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("examples_cache")


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_the_example_reaches_its_first_iteration_on_its_first_launch(path, tmp_path, hf_tokenizer_dir, corpus_cache):
    assert '"$@"' in path.read_text(), f"{path.name} must pass \"$@\" on to pretrain_gpt.py"
    tiny = TINY + (TINY_MOE if "--num-experts" in path.read_text() else [])
    launch = X.launch(path, tmp_path, {"TOKENIZER_MODEL": hf_tokenizer_dir}, tiny)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_", "OMPI_", "PMI_", "SLURM_", "TORCHELASTIC"))}
    env.update(ZO_MEGATRON_CACHE=str(corpus_cache), PYTHONPATH=str(X.ROOT))
    r = subprocess.run([sys.executable, str(X.ROOT / X.ENTRY), *launch.job_argv], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert " iter      1/1 | loss" in r.stdout, r.stdout[-2000:]
    if "--load" in launch.job_argv:
        assert "no checkpoint there yet" in r.stdout and "starting from randomly initialised weights" in r.stdout
