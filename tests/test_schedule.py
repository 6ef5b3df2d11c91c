"""The LR schedule against Megatron-LM's OptimizerParamScheduler, on a grid of settings.

The reference is a line-by-line transcription of `OptimizerParamScheduler.get_lr` (megatron-core
0.16.1, megatron/core/optimizer_param_scheduler.py) and of how Megatron's train loop drives it
(`get_optimizer_param_scheduler`: steps = iterations x global batch; `train_step`: the update uses
the current rate, then `step(increment=global batch)` only if the update succeeded).
"""
import argparse
import math
import random

import pytest

from tests.megatron_reference import megatron_get_lr
from tests.seeds import fresh_seed
from zo_megatron.errors import ConfigError
from zo_megatron.training.schedule import DECAY_STYLES, WSD_DECAY_STYLES, LRScheduler


def _args(**kw):
    base = dict(lr=1e-3, min_lr=1e-5, lr_warmup_iters=0, lr_decay_iters=None, lr_decay_style="linear",
                train_iters=50, global_batch_size=8, lr_warmup_init=0.0, lr_warmup_fraction=None,
                lr_wsd_decay_iters=None, lr_wsd_decay_style="exponential", train_samples=None)
    base.update(kw)
    return argparse.Namespace(**base)


def _grid(rng):
    for style in DECAY_STYLES:
        for wsd_style in (WSD_DECAY_STYLES if style == "WSD" else (None,)):
            for warmup in (0, 1, rng.randint(2, 12)):
                for init in (0.0, rng.uniform(0, 1e-4)):
                    train = rng.randint(warmup + 2, 40)
                    decay = rng.choice([None, rng.randint(warmup + 1, train + 10)])
                    yield _args(lr=rng.uniform(2e-4, 3e-3), min_lr=rng.choice([0.0, rng.uniform(0, 1e-4)]),
                                lr_warmup_iters=warmup, lr_decay_iters=decay, lr_decay_style=style,
                                train_iters=train, global_batch_size=rng.randint(1, 16), lr_warmup_init=init,
                                lr_wsd_decay_iters=rng.randint(1, decay or train) if style == "WSD" else None,
                                lr_wsd_decay_style=wsd_style or "exponential")


def _megatron_scheduler(OptimizerParamScheduler, opt, a):
    """megatron-core's scheduler over `opt`'s param groups for the job's flags `a` (sample-based steps,
    as Megatron-LM builds it), constant weight decay."""
    gbs = a.global_batch_size
    return OptimizerParamScheduler(
        opt, init_lr=a.lr_warmup_init, max_lr=a.lr, min_lr=a.min_lr, lr_warmup_steps=a.lr_warmup_iters * gbs,
        lr_decay_steps=(a.lr_decay_iters or a.train_iters) * gbs, lr_decay_style=a.lr_decay_style,
        start_wd=0.1, end_wd=0.1, wd_incr_steps=1, wd_incr_style="constant",
        wsd_decay_steps=a.lr_wsd_decay_iters * gbs if a.lr_wsd_decay_iters else None,
        lr_wsd_decay_style=a.lr_wsd_decay_style)


def test_every_update_uses_megatrons_rate_on_a_grid():
    rng = random.Random(fresh_seed("lr grid"))
    n = 0
    for a in _grid(rng):
        gbs = a.global_batch_size
        decay = (a.lr_decay_iters or a.train_iters) * gbs
        ref = dict(init_lr=a.lr_warmup_init, max_lr=a.lr, min_lr=a.min_lr, lr_warmup_steps=a.lr_warmup_iters * gbs,
                   lr_decay_steps=decay, lr_decay_style=a.lr_decay_style,
                   wsd_decay_steps=a.lr_wsd_decay_iters * gbs if a.lr_wsd_decay_iters else None,
                   lr_wsd_decay_style=a.lr_wsd_decay_style)
        s = LRScheduler.from_args(a)
        # Megatron's loop: update k (1-based) uses the rate at (k-1) x gbs; skipped updates do not advance.
        skipped = {k for k in range(1, a.train_iters + 1) if rng.random() < 0.2}
        done = 0
        for k in range(1, a.train_iters + 5):
            want = megatron_get_lr(done * gbs, **ref)
            got = s.get_lr()
            assert got == pytest.approx(want, rel=1e-12, abs=1e-15), (a, k, got, want)
            if k not in skipped:
                s.step(gbs)
                done += 1
            n += 1
    assert n > 500


def test_first_warmup_update_is_at_init_lr_and_last_decay_update_above_min_lr():
    s = LRScheduler.from_args(_args(lr=1e-3, min_lr=1e-4, lr_warmup_iters=4, train_iters=10, lr_decay_style="linear"))
    lrs = []
    for _ in range(10):
        lrs.append(s.get_lr())
        s.step(8)
    assert lrs[0] == 0.0 and lrs[4] == pytest.approx(1e-3)
    assert lrs[-1] > 1e-4 and s.get_lr() == pytest.approx(1e-4)


def test_inverse_square_root_reaches_min_lr_after_decay_iters():
    s = LRScheduler.from_args(_args(lr=1e-3, min_lr=1e-6, lr_warmup_iters=2, lr_decay_iters=10, train_iters=30,
                                    lr_decay_style="inverse-square-root", global_batch_size=1))
    s.step(10)
    assert s.get_lr() == pytest.approx(1e-3 * math.sqrt(2 / 10))
    s.step(1)
    assert s.get_lr() == 1e-6


def test_warmup_fraction_and_train_samples_follow_megatron():
    a = _args(lr_warmup_fraction=0.25, train_samples=100, train_iters=12, global_batch_size=8)
    s = LRScheduler.from_args(a)
    assert (s.lr_warmup_steps, s.lr_decay_steps) == (25, 100)


def test_real_megatron_scheduler_agrees():
    """Also against megatron-core's class itself (the transcription could drift from a newer version)."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    rng = random.Random(fresh_seed("lr megatron class"))
    for a in _grid(rng):
        gbs = a.global_batch_size
        opt = argparse.Namespace(param_groups=[{}])
        m = _megatron_scheduler(OptimizerParamScheduler, opt, a)
        s = LRScheduler.from_args(a)
        for _ in range(a.train_iters + 3):
            assert s.get_lr() == pytest.approx(opt.param_groups[0]["lr"], rel=1e-12, abs=1e-15), a
            s.step(gbs)
            m.step(gbs)


def test_state_dict_round_trip_and_mismatch():
    a = _args(lr_warmup_iters=3, train_iters=20, lr_decay_style="cosine")
    s = LRScheduler.from_args(a)
    for _ in range(7):
        s.step(8)
    t = LRScheduler.from_args(a)
    t.load_state_dict(s.state_dict())
    assert t.get_lr() == s.get_lr() and t.num_steps == 56
    longer = LRScheduler.from_args(_args(lr_warmup_iters=3, train_iters=30, lr_decay_style="cosine"))
    with pytest.raises(ConfigError, match="lr_decay_steps"):
        longer.load_state_dict(s.state_dict())
    longer.load_state_dict(s.state_dict(), override=True)
    assert longer.lr_decay_steps == 240
    longer.load_state_dict(s.state_dict(), use_checkpoint=True)
    assert longer.lr_decay_steps == 160 and longer.get_lr() == s.get_lr()


@pytest.mark.parametrize("kw, match", [
    (dict(lr_decay_style="WSD"), "--lr-wsd-decay-iters"),
    (dict(lr_warmup_iters=51, train_iters=50), "warmup"),
    (dict(min_lr=1e-2), "--min-lr"),
])
def test_bad_settings_are_one_line(kw, match):
    with pytest.raises(ConfigError, match=match):
        LRScheduler.from_args(_args(**kw))


def _decoupled(rng, a):
    """A decoupled peak above the floor it decays to, and --decoupled-min-lr given or not."""
    a.decoupled_lr = rng.uniform(max(a.min_lr, 1e-4), 5e-3)
    a.decoupled_min_lr = rng.choice([None, rng.uniform(0, a.decoupled_lr)])
    return a


def test_decoupled_rate_is_megatrons_decoupled_param_group_on_a_grid():
    """--decoupled-lr / --decoupled-min-lr: the rate megatron-core's OptimizerParamScheduler gives
    the param group its _get_param_groups builds for them (the default group's max_lr/min_lr
    overridden by get_standard_config_overrides' decoupled entry), every update; the other group
    keeps --lr's rate."""
    from megatron.core.optimizer import OptimizerConfig, get_standard_config_overrides
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    rng = random.Random(fresh_seed("decoupled lr megatron class"))
    floors = set()
    for a in map(lambda a: _decoupled(rng, a), _grid(rng)):
        gbs = a.global_batch_size
        config = OptimizerConfig(lr=a.lr, min_lr=a.min_lr, decoupled_lr=a.decoupled_lr,
                                 decoupled_min_lr=a.decoupled_min_lr)
        override = next(v for k, v in get_standard_config_overrides(config).items()
                        if k.attr == "is_embedding_or_output_parameter")
        groups = [{"max_lr": a.lr, "min_lr": a.min_lr}, {"max_lr": a.lr, "min_lr": a.min_lr, **override}]
        floors.add(groups[1]["min_lr"] == a.min_lr)
        opt = argparse.Namespace(param_groups=groups)
        m = _megatron_scheduler(OptimizerParamScheduler, opt, a)
        s = LRScheduler.from_args(a)
        for _ in range(a.train_iters + 3):
            assert s.get_lr() == pytest.approx(groups[0]["lr"], rel=1e-12, abs=1e-15), a
            assert s.get_decoupled_lr() == pytest.approx(groups[1]["lr"], rel=1e-12, abs=1e-15), a
            s.step(gbs)
            m.step(gbs)
    assert floors == {True, False}, "both floors (--decoupled-min-lr given or not) must be drawn"


def test_decoupled_rate_warms_up_then_decays_to_decoupled_min_lr():
    """Llama-3 8B's flags (--decoupled-lr 5.0e-4 --decoupled-min-lr 4.5e-5) on a 4-iteration warmup
    and a cosine decay over 10, by Megatron's formula written out."""
    s = LRScheduler.from_args(_args(lr=1.5e-4, min_lr=1e-5, lr_warmup_iters=4, train_iters=10, lr_decay_style="cosine",
                                    decoupled_lr=5.0e-4, decoupled_min_lr=4.5e-5))
    for k in range(12):             # update k + 1 uses the rate after k updates (8 samples each)
        want = 5.0e-4 * k / 4 if k <= 4 else \
            4.5e-5 + 0.5 * (math.cos(math.pi * min(k - 4, 6) / 6) + 1.0) * (5.0e-4 - 4.5e-5)
        assert s.get_decoupled_lr() == pytest.approx(want, rel=1e-12, abs=1e-18), k
        s.step(8)
    assert s.get_decoupled_lr() == 4.5e-5 and s.get_lr() == 1e-5


def test_decoupled_min_lr_alone_changes_nothing_as_in_megatron():
    s = LRScheduler.from_args(_args(decoupled_min_lr=4.5e-5))
    assert s.get_decoupled_lr() is None and s.state_dict()["decoupled_min_lr"] is None


def test_the_decoupled_rates_are_part_of_the_schedule_state():
    a = _args(lr_warmup_iters=3, train_iters=20, lr_decay_style="cosine", decoupled_lr=4e-3, decoupled_min_lr=1e-6)
    s = LRScheduler.from_args(a)
    s.step(56)
    other = LRScheduler.from_args(_args(lr_warmup_iters=3, train_iters=20, lr_decay_style="cosine", decoupled_lr=3e-3))
    with pytest.raises(ConfigError, match="decoupled_lr"):
        other.load_state_dict(s.state_dict())
    other.load_state_dict(s.state_dict(), use_checkpoint=True)
    assert other.get_decoupled_lr() == s.get_decoupled_lr() and other.decoupled_min_lr == 1e-6


@pytest.mark.parametrize("kw, match", [
    (dict(decoupled_lr=1e-3, decoupled_min_lr=2e-3), "^--decoupled-min-lr 0.002 exceeds --decoupled-lr 0.001"),
    (dict(decoupled_lr=1e-6), "^--decoupled-lr 1e-06 is below --min-lr 1e-05"),
])
def test_a_climbing_decoupled_decay_is_one_line(kw, match):
    with pytest.raises(ConfigError, match=match):
        LRScheduler.from_args(_args(**kw))
