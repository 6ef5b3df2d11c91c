"""Issue 37: ZO_DPU_DIAGNOSTICS, the debug-only measure of how far the device copy is from the exact
weights under DPU (zo_megatron/offload/dpu_diagnostics.py), on the engine of tests/test_dpu.py."""
import json
import os

import pytest

from tests.harness import run_world
from tests.seeds import fresh_seed
from tests.test_dpu import WARMUP, _dpu_world

pytest.importorskip("transformers")


def _world(rank, path, every, tp, seed, engine_kw, flush_at):
    from zo_megatron.offload import dpu_diagnostics

    if path is None:
        os.environ.pop(dpu_diagnostics.ENV, None)
    else:
        os.environ[dpu_diagnostics.ENV] = f"{path}:{every}"
    out = _dpu_world(rank, tp, "fp32", seed, 1, engine_kw, None, flush_at)
    if rank == 0 and path is not None:
        out["rows"] = [json.loads(line) for line in open(path)]
    return out


def test_plain_dpu_is_one_update_behind_and_the_norms_agree_across_tp(tmp_path):
    """fp32 plain DPU: the device holds exactly w_{n-1}, so the error is exactly one last update.
    W=3, every 2nd update, a flush after the 7th: updates 4, 6, 10, 12 are measured (8 ran on the
    exact master the flush sent; step n joins update n-1, so 12 is measured). The norms are over the
    whole model: TP=2 gives the same last update as TP=1 (TP-replicated parameters once)."""
    seed = fresh_seed("dpu diagnostics")
    one = run_world(_world, 1, str(tmp_path / "tp1.jsonl"), 2, 1, seed, {}, 6)[0]["rows"]
    two = run_world(_world, 2, str(tmp_path / "tp2.jsonl"), 2, 2, seed, {}, 6)[0]["rows"]
    assert WARMUP == 3
    for rows in (one, two):
        assert [r["update"] for r in rows] == [4, 6, 10, 12]
        assert all(r["weight_error"] == 1.0 for r in rows), rows
    for a, b in zip(one, two):
        assert b["last_update"] == pytest.approx(a["last_update"], rel=1e-4)
        assert a["last_update"] > 0


def test_weight_prediction_is_closer_and_off_costs_nothing(tmp_path):
    from zo_megatron.offload import dpu_diagnostics
    from zo_megatron.offload.schedules import DelayedSchedule

    seed = fresh_seed("dpu diagnostics, prediction")
    rows = run_world(_world, 1, str(tmp_path / "wp.jsonl"), 3, 1, seed, {"dpu_weight_prediction": True}, None)[0]["rows"]
    assert [r["update"] for r in rows] == [6, 9, 12]
    assert all(0.0 < r["weight_error"] < 1.0 for r in rows), rows
    os.environ.pop(dpu_diagnostics.ENV, None)           # unset: every diagnostic call hangs off this None
    schedule = DelayedSchedule(3)
    try:
        assert schedule.diagnostics is None
    finally:
        schedule.close()
    old = os.environ.get(dpu_diagnostics.ENV)
    try:
        for spec, want in (("/x/y.jsonl:7", ("/x/y.jsonl", 7)), ("c:/z.jsonl", ("c:/z.jsonl", 10))):
            os.environ[dpu_diagnostics.ENV] = spec
            d = dpu_diagnostics.WeightError.from_env()
            assert (d.path, d.every) == want
    finally:
        os.environ.pop(dpu_diagnostics.ENV, None)
        if old is not None:
            os.environ[dpu_diagnostics.ENV] = old
