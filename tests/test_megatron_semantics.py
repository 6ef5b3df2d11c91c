"""The job's numbers mean what Megatron-LM's mean: one small fp16 run with gradient accumulation
checks the LR of every update (skipped fp16 steps do not advance the schedule), how many samples
an evaluation covers (--eval-iters counts global batches), and that evaluation and checkpoint time
stay out of the training log's timings (Megatron stops its interval timer around them)."""
import json
import os

import pytest

from tests.harness import built_once, run_world
from tests.megatron_reference import megatron_get_lr

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SLOW_S = 1000.0


def _slow_eval_and_save_job(rank, argv, env):
    """The job on a forked rank (tests/harness.py) whose evaluation and checkpoint saving each move
    the trainer's clock SLOW_S seconds on."""
    import time

    import zo_megatron.checkpoint as ck
    import zo_megatron.training.evaluation as evaluation
    import zo_megatron.training.trainer as trainer
    from tests.test_pretrain import _rank_job

    class Clock:
        offset = 0.0

        def __getattr__(self, name):
            return getattr(time, name)

        def monotonic(self):
            return time.monotonic() + self.offset

    clock = trainer.time = Clock()
    ev, sv = evaluation.Evaluator.run, ck.save_checkpoint

    def slow_eval(*a, **k):
        clock.offset += SLOW_S
        return ev(*a, **k)

    def slow_save(*a, **k):
        clock.offset += SLOW_S
        return sv(*a, **k)

    evaluation.Evaluator.run, ck.save_checkpoint = slow_eval, slow_save
    return _rank_job(rank, argv, env)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    rows, d = built_once(tmp_path_factory, "megatron_semantics", _semantics_run)   # once for both workers
    return [x for x in rows if x["kind"] == "train"], [x for x in rows if x["kind"] == "eval"], d


def _semantics_run(d):
    from zo_megatron.data import extract_corpus
    from zo_megatron.data.preprocess import preprocess

    files = extract_corpus(str(d / "txt"), limit=8)
    preprocess(files, str(d / "sotu"), progress=False)
    # Evaluation and checkpoint saving are made slow on purpose -- on the loop's clock, which jumps
    # SLOW_S seconds inside them (deterministic on a loaded machine): that time must not reach the log.
    log = d / "log.jsonl"
    args = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
            "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "9", "--fp16",
            "--lr", "2e-3", "--min-lr", "1e-4", "--lr-warmup-iters", "3", "--lr-decay-style", "cosine",
            "--log-interval", "1", "--eval-interval", "3", "--eval-iters", "2", "--save", str(d / "ckpt"),
            "--save-interval", "5", "--exit-interval", "8", "--split", "80,20,0", "--no-progress-bar", "--data-path",
            str(d / "sotu_text_document"), "--log-jsonl", str(log)]
    (rc, out, err), = run_world(_slow_eval_and_save_job, 1, args, {"ZO_MEGATRON_CACHE": str(d / "cache")},
                                timeout=300)
    assert rc == 0, out[-3000:] + err[-3000:]
    return [json.loads(line) for line in open(log)]


def test_lr_of_every_update_is_megatrons_and_skipped_steps_do_not_advance(run):
    train, _, _ = run
    assert len(train) == 8 and sum(r["skipped"] for r in train) >= 1, "the fp16 run should skip its first steps"
    done = 0
    for r in train:
        want = megatron_get_lr(done * 4, init_lr=0.0, max_lr=2e-3, min_lr=1e-4, lr_warmup_steps=3 * 4,
                               lr_decay_steps=9 * 4, lr_decay_style="cosine")
        assert r["lr"] == pytest.approx(want, rel=1e-12, abs=1e-15), (r["iteration"], r["lr"], want)
        done += 1 - r["skipped"]


def test_eval_iters_counts_global_batches(run):
    _, evals, _ = run
    assert [e["iteration"] for e in evals] == [3, 6]
    assert all(e["eval_samples"] == 2 * 4 for e in evals), evals   # --eval-iters x --global-batch-size


def test_eval_and_checkpoint_time_stay_out_of_the_log_window(run):
    train, _, _ = run
    by_it = {r["iteration"]: r for r in train}
    # Iteration 4's window holds the evaluation after iteration 3; 6's the save after 5; 7's the eval after 6.
    for it in (4, 6, 7):
        assert by_it[it]["step_time_s"] < SLOW_S / 10, (it, [r["step_time_s"] for r in train])


def test_exit_interval_saves_and_stops(run):
    """Megatron's --exit-interval: after iteration 8 of 9 the job saves a checkpoint and exits 0."""
    _, _, d = run
    assert sorted(p.name for p in (d / "ckpt").glob("iter_*")) == ["iter_0000005", "iter_0000008"]
