"""--overlap-cpu-step's rollback state: commit, rollback, skip, flush, checkpoint, a bounded share, back-off.

SpeculativeSchedule backs up the state of each speculated segment before its in-place kernel
(and writes its parameters apart where they would overwrite the gradient): a commit keeps what
was written, a skip copies the backup back, a redo copies it back and updates the whole
partition again. A wrong restore anywhere shows up in the steps after it, so one engine runs a scripted sequence of every
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


def _engine(overlap, init_seed, fraction=1.0, backoff=False):
    from zo_megatron.offload.engine import AdamConfig, ZeroOffloadEngine

    torch.manual_seed(init_seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Tanh(),
                                torch.nn.Linear(16, 4))
    engine = ZeroOffloadEngine(model, precision="fp32", adam=AdamConfig(lr=1e-2, weight_decay=0.1),
                               pin_memory=False, device="cpu", bucket_size=1, clip_grad=NO_CLIP,
                               overlap_cpu_step=overlap, race_check=overlap, overlap_speculated_fraction=fraction)
    if overlap and not backoff:     # the script's every step speculates (no back-off after a rollback)
        engine.schedule.max_backoff = 0
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
    rec, problems, spec = [], [], []
    for s, (kind, expect) in enumerate(SCRIPT):
        x = torch.randn(5, 8, generator=gen)
        lr = 1e-2 * (1 + s / 10)
        engine.clip_grad = CLIPS if kind == "clip" else NO_CLIP
        if kind != "silent_lr":
            engine.expect_lr(lr)
        before = _state(engine)
        loss = _backward(model, engine, x, nan=kind == "nan")
        if kind == "flush":            # e.g. a checkpoint between backward and step: the speculation is
            engine.flush()             # rolled back and the step runs synchronously (in place)
            if overlap and not all(torch.equal(a, b) for a, b in zip(before, _state(engine))):
                problems.append((s, "a flush must restore the state before the backward"))
        res = engine.step(lr=lr)
        if overlap:
            if expect == "in place" and (res.speculated_buckets or res.rolled_back_buckets):
                problems.append((s, "after a flush: the synchronous step, nothing speculated", res))
            if expect == "commit" and res.rolled_back_buckets:
                problems.append((s, "commit: nothing rolled back", res))
            if expect in ("redo", "skip") and res.rolled_back_buckets != res.speculated_buckets:
                problems.append((s, "must roll back what it speculated", res))
            if expect == "skip" and not all(torch.equal(a, b) for a, b in zip(before, _state(engine))):
                problems.append((s, "skip: the state before the step must be restored"))
            spec.append(res.speculated_buckets)
        rec.append(dict(loss=loss, skipped=res.skipped, norm=res.grad_norm, clip=res.clip_coef,
                        flat=engine.flat.clone(), state=_state(engine)))
        if kind == "save":             # right after a commit: a fresh engine (other initial weights) resumes
            sd = engine.state_dict()
            engine.close()
            model, engine = _engine(overlap, init_seed=seed % 1000 + 1)
            engine.load_state_dict(sd)
    engine.close()
    if overlap and not sum(spec):
        problems.append(("script", "no step speculated anything", spec))
    return rec, problems


def test_rollback_state_restores_exactly_like_the_synchronous_step():
    seed = fresh_seed("overlap rollback state script")
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
def test_the_race_check_covers_the_backup_and_the_state(target):
    """A write, between a speculated kernel and the end of backward, to the state it backed up
    (the backup) or to what it wrote (the engine's state) is caught at the join."""
    model, engine = _engine(True, init_seed=0)
    with engine:
        _backward(model, engine, torch.randn(5, 8))
        engine.step()                                        # clean: no error

        def sabotage(g):
            engine.schedule.futures[0].result()              # bucket 0's kernel is done ...
            state = engine.schedule.backup if target == "kept" else (engine.master, engine.exp_avg, engine.exp_avg_sq)
            state[1][0] += 1.0                               # ... and something writes an exp_avg element
            return g
        with engine.forward_context():
            loss = model(torch.randn(5, 8)).square().mean()
        h = model[0].weight.register_hook(sabotage)          # the first layer's: the last gradient of backward
        engine.backward(loss)
        h.remove()
        name = "kept exp_avg" if target == "kept" else "exp_avg"
        with pytest.raises(RuntimeError, match=f"overlap race: the {name} of a speculated segment"):
            engine.step()


def test_buckets_the_worker_has_not_started_are_updated_unspeculated_on_the_main_thread(monkeypatch):
    """A worker that cannot keep up (here: busy with something else for the whole backward) does not
    make step() wait for it: the join takes the buckets it has not started back, and their
    segments are updated after the validation on the main thread, unspeculated (no backup copies
    on the critical path); the result is the synchronous engine's, bit for bit."""
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
    assert over.speculated_buckets == 0 and over.rolled_back_buckets == 0
    assert over_threads and all(t == threading.current_thread().name for t in over_threads), over_threads
    assert torch.equal(sync_flat, over_flat)
    assert all(torch.equal(a, b) for a, b in zip(sync_state, over_state))


def test_a_bounded_share_speculates_only_its_prefix_and_stays_exact():
    """overlap_speculated_fraction 0.4: the backup holds floor(0.4 x partition) elements, only
    segments that end within it are speculated, and every step equals the synchronous engine's
    bit for bit; the engine's overlap bytes are the planner's formula."""
    from zo_megatron.planner.memory import overlap_rollback_host_bytes

    seed = fresh_seed("overlap bounded share")
    gen = torch.Generator().manual_seed(seed)
    xs = [torch.randn(5, 8, generator=gen) for _ in range(6)]
    out = []
    for overlap in (False, True):
        model, engine = _engine(overlap, init_seed=seed % 1000, fraction=0.4)
        with engine:
            flats = []
            for s, x in enumerate(xs):
                engine.clip_grad = CLIPS if s == 3 else NO_CLIP
                engine.expect_lr(1e-2)
                _backward(model, engine, x)
                if overlap:
                    engine.schedule.before_norm(engine)
                    sched, segs = engine.schedule, engine._host_segments
                    assert all(segs[j][1] <= sched.budget for j in sched.done), (sched.done, sched.budget)
                engine.step(lr=1e-2)
                flats.append(engine.flat.clone())
            out.append((flats, _state(engine)))
            if overlap:
                cut = engine._cut
                assert engine.schedule.budget == int(0.4 * cut) and 0 < engine.schedule.limit < len(engine._host_segments)
                assert engine.accounting.host_overlap_bytes == overlap_rollback_host_bytes(cut, 4, 4, 4, 0.4)
    (sf, ss), (of, os_) = out
    assert all(torch.equal(a, b) for a, b in zip(sf, of))
    assert all(torch.equal(a, b) for a, b in zip(ss, os_))


def test_rollbacks_back_off_and_a_commit_resets():
    """Clipped every step but one: speculate and roll back, then 1, 2, 4 synchronous steps between
    probes; the unclipped probe commits and the next step speculates again."""
    seed = fresh_seed("overlap back-off")
    gen = torch.Generator().manual_seed(seed)
    model, engine = _engine(True, init_seed=seed % 1000, backoff=True)
    sched = engine.schedule

    def first_bucket_done(g):          # the last gradient of backward waits for bucket 0's kernel, so
        if sched.futures:              # a speculating step always speculates something
            sched.futures[0].result()
        return g

    h = model[0].weight.register_hook(first_bucket_done)
    active, rolled = [], []
    with engine:
        for s in range(12):
            engine.clip_grad = NO_CLIP if s == 10 else CLIPS
            engine.expect_lr(1e-2)
            _backward(model, engine, torch.randn(5, 8, generator=gen))
            active.append(sched.active)
            res = engine.step(lr=1e-2)
            rolled.append(res.rolled_back_buckets > 0)
    h.remove()
    # 0 probe | 1 held | 2 probe | 3-4 held | 5 probe | 6-9 held | 10 probe, unclipped: commit | 11 probe
    assert active == [True, False, True, False, False, True, False, False, False, False, True, True], active
    assert rolled == [True, False, True, False, False, True, False, False, False, False, False, True], rolled
