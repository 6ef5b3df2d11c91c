"""--overlap-cpu-step's alternate state buffers: the swap at commit, rollback, skip, flush and checkpoint.

SpeculativeSchedule keeps the state before a step by writing the step's new state into a spare
set (the out-of-place CPU Adam) and re-pointing the engine at it: a commit keeps the written set,
a skip points back at the kept one, a redo rewrites the written set from the kept one. A wrong
swap anywhere shows up in the steps after it, so one engine runs a scripted sequence of every
transition (commit, rollback + redo, commit, skip, rollback for an unannounced rate, a flush
between backward and step (then the synchronous step, in place), a checkpoint right after a commit and a resume from it) next to the
synchronous engine on the same inputs, and everything is compared bitwise after every step. One
process, no process group: a few seconds.
"""
import pytest
import torch

from tests.seeds import fresh_seed

NO_CLIP, CLIPS = 1e9, 1e-4
# (what the step does, the outcome the overlapped engine must report)
SCRIPT = [("plain", "commit"), ("clip", "redo"), ("plain", "commit"), ("plain", "commit"), ("nan", "skip"),
          ("clip", "redo"), ("silent_lr", "redo"), ("flush", "in place"), ("save", "commit"), ("plain", "commit"),
          ("clip", "redo"), ("nan", "skip"), ("plain", "commit")]


def _engine(overlap, init_seed):
    from zo_megatron.offload.engine import AdamConfig, ZeroOffloadEngine

    torch.manual_seed(init_seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Tanh(),
                                torch.nn.Linear(16, 4))
    engine = ZeroOffloadEngine(model, precision="fp32", adam=AdamConfig(lr=1e-2, weight_decay=0.1),
                               pin_memory=False, device="cpu", bucket_size=1, clip_grad=NO_CLIP,
                               overlap_cpu_step=overlap, race_check=overlap)
    return model, engine


def _backward(model, engine, x, nan=False):
    with engine.forward_context():
        loss = model(x).square().mean()
    h = model[2].weight.register_hook(lambda g: g.index_fill(0, torch.tensor([1]), float("nan"))) if nan else None
    engine.backward(loss)
    if h is not None:
        h.remove()
    return loss.detach()


def _state(engine):
    return [t.clone() for t in (engine.master, engine.exp_avg, engine.exp_avg_sq)]


def _run(overlap, seed):
    """Runs SCRIPT; returns per-step records (and, overlapped, the swap checks' findings)."""
    gen = torch.Generator().manual_seed(seed)
    model, engine = _engine(overlap, init_seed=seed % 1000)
    rec, problems = [], []
    for s, (kind, expect) in enumerate(SCRIPT):
        x = torch.randn(5, 8, generator=gen)
        lr = 1e-2 * (1 + s / 10)
        engine.clip_grad = CLIPS if kind == "clip" else NO_CLIP
        if kind != "silent_lr":
            engine.expect_lr(lr)
        before, live_before = _state(engine), engine.master
        loss = _backward(model, engine, x, nan=kind == "nan")
        if kind == "flush":            # e.g. a checkpoint between backward and step: the speculation is
            engine.flush()             # rolled back and the step runs synchronously (in place)
        res = engine.step(lr=lr)
        if overlap:
            sched = engine.schedule
            swapped = engine.master is not live_before
            if (res.speculated_buckets < 3) != (expect == "in place"):
                problems.append((s, "speculated buckets", res.speculated_buckets))
            if expect == "in place" and (swapped or res.rolled_back_buckets):
                problems.append((s, "after a flush: the synchronous step in place", swapped, res))
            rolled = res.rolled_back_buckets == res.speculated_buckets
            if expect == "commit" and (not swapped or res.rolled_back_buckets):
                problems.append((s, "commit: the written set must become live", swapped, res))
            if expect in ("redo", "skip") and not rolled:
                problems.append((s, "must roll back", res))
            if expect == "skip" and (swapped or not res.skipped):
                problems.append((s, "skip: the kept state must be live again", swapped, res))
            if expect in ("commit", "redo") and not all(torch.equal(a, b) for a, b in zip(before, sched.spare)):
                problems.append((s, "the state before the step must be kept untouched in the spare set"))
            if sched.spare[0] is engine.master or sched.kept is not None:
                problems.append((s, "one live set and one spare set after a step"))
        rec.append(dict(loss=loss, skipped=res.skipped, norm=res.grad_norm, clip=res.clip_coef,
                        flat=engine.flat.clone(), state=_state(engine)))
        if kind == "save":             # right after a commit: a fresh engine (other initial weights) resumes
            sd = engine.state_dict()
            engine.close()
            model, engine = _engine(overlap, init_seed=seed % 1000 + 1)
            engine.load_state_dict(sd)
    engine.close()
    return rec, problems


def test_alternate_state_swaps_exactly_like_the_synchronous_step():
    seed = fresh_seed("overlap alternate state script")
    sync, _ = _run(False, seed)
    over, problems = _run(True, seed)
    assert not problems, problems
    for s, (a, b) in enumerate(zip(sync, over)):
        assert torch.equal(a["loss"], b["loss"]), (s, SCRIPT[s])
        assert a["skipped"] == b["skipped"] == (SCRIPT[s][0] == "nan"), (s, SCRIPT[s])
        assert a["clip"] == b["clip"] and (a["norm"] == b["norm"] or a["skipped"]), (s, SCRIPT[s])
        assert (a["clip"] < 1.0) == (SCRIPT[s][0] in ("clip", "nan")), (s, a["clip"])   # a skip reports 0
        assert torch.equal(a["flat"], b["flat"]), (s, SCRIPT[s], "16-bit parameters")
        for name, x, y in zip(("master", "exp_avg", "exp_avg_sq"), a["state"], b["state"]):
            assert torch.equal(x, y), (s, SCRIPT[s], name)


@pytest.mark.parametrize("target", ["kept", "written"])
def test_the_race_check_covers_both_state_sets(target):
    """A write, between a speculated kernel and the end of backward, to the state that kernel read
    (the kept set) or to what it wrote (the engine's set) is caught at the join."""
    model, engine = _engine(True, init_seed=0)
    with engine:
        _backward(model, engine, torch.randn(5, 8))
        engine.step()                                        # clean: no error

        def sabotage(g):
            engine.schedule.futures[0].result()              # bucket 0's kernel is done ...
            state = engine.schedule.kept if target == "kept" else (engine.master, engine.exp_avg, engine.exp_avg_sq)
            state[1][0] += 1.0                               # ... and something writes an exp_avg element
            return g
        with engine.forward_context():
            loss = model(torch.randn(5, 8)).square().mean()
        h = model[0].weight.register_hook(sabotage)          # the first layer's: the last gradient of backward
        engine.backward(loss)
        h.remove()
        name = "old exp_avg" if target == "kept" else "exp_avg"
        with pytest.raises(RuntimeError, match=f"overlap race: the {name} of a speculated segment"):
            engine.step()


def test_buckets_the_worker_has_not_started_run_on_the_main_thread_at_the_join(monkeypatch):
    """A worker that cannot keep up (here: busy with something else for the whole backward) does not
    make step() wait for it: the join takes the buckets it has not started back and runs them on the
    main thread, in order; the result is the synchronous engine's, bit for bit."""
    import threading

    from zo_megatron.offload import cpu_adam

    real, threads = cpu_adam.adam_step_segments, []

    def kernel(*a, **kw):
        threads.append(threading.current_thread().name)
        return real(*a, **kw)

    monkeypatch.setattr(cpu_adam, "adam_step_segments", kernel)
    seed = fresh_seed("overlap join takes queued buckets back")
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(seed))
    results = []
    for overlap in (False, True):
        model, engine = _engine(overlap, init_seed=seed % 1000)
        with engine:
            busy = threading.Event()
            if overlap:
                engine.schedule.worker.submit(busy.wait, 60)     # the worker is held for the whole backward
            threads.clear()
            _backward(model, engine, x)
            res = engine.step()
            busy.set()
            results.append((res, engine.flat.clone(), _state(engine), list(threads)))
    (sync, sync_flat, sync_state, _), (over, over_flat, over_state, over_threads) = results
    assert over.speculated_buckets >= 3 and over.rolled_back_buckets == 0
    assert over_threads and all(t == threading.current_thread().name for t in over_threads), over_threads
    assert torch.equal(sync_flat, over_flat)
    assert all(torch.equal(a, b) for a, b in zip(sync_state, over_state))
