"""Delayed parameter update (DPU) against a single-process reference of the same schedule.

The reference is HF GPT-2 + torch.optim.AdamW run on one process over the global batches, with
the delayed schedule written out by hand: updates before the W-th are applied at once; from the
W-th on, the gradient of step t is applied at step t+1, after step t+1's gradient was computed on
the parameters of one update before; a flush applies what is pending. The worlds run with the
engine's race check on: the flat parameter buffer must not change between the first forward and
the end of backward of any step that overlaps a CPU update.
"""
import threading

import pytest
import torch
import torch.distributed as dist

from tests.fp32_bounds import assert_fp32_weights_match, fp32_spread
from tests.harness import run_world
from tests.seeds import fresh_seed
from tests.test_offload_engine import BETAS, CLIP, EPS, HEADS, HIDDEN, LAYERS, MICRO, SEQ, VOCAB, WD, \
    _full_params, _setup

transformers = pytest.importorskip("transformers")

STEPS, WARMUP = 12, 3


def _lr(step):
    return 2e-3 * (0.5 + 0.5 * step / STEPS)


def _batches(seed, dp, accum):
    gen = torch.Generator().manual_seed(seed)
    n = MICRO * dp
    return [[(torch.randint(0, VOCAB, (n, SEQ), generator=gen), torch.randint(0, VOCAB, (n, SEQ), generator=gen))
             for _ in range(accum)] for _ in range(STEPS)]


def _dpu_world(rank, tp, precision, seed, accum, engine_kw, overflow_step=None, flush_at=None, backend=None):
    from zo_megatron.parallel import collectives

    ps, cfg, model, engine = _setup(tp, seed, precision, backend=backend, dpu_warmup_steps=WARMUP, race_check=True,
                                    **engine_kw)
    init = _full_params(model, ps)
    victim = model.gpt.decoder.layers[0].mlp.linear_fc1.weight
    poison_rank = min(1, dist.get_world_size() - 1)
    losses, skipped, scales, in_flight = [], [], [], []
    for step, micro_batches in enumerate(_batches(seed + 7, ps.dp_size, accum)):
        total = torch.zeros(())
        for i, (tokens, labels) in enumerate(micro_batches):
            mine = slice(ps.dp_rank * MICRO, (ps.dp_rank + 1) * MICRO)
            with engine.forward_context():
                loss = model.loss(tokens[mine].to(ps.device), labels[mine].to(ps.device))
            handle = None
            if step == overflow_step and i == accum - 1 and dist.get_rank() == poison_rank:
                handle = victim.register_hook(lambda g: g.index_fill(0, torch.tensor([3], device=g.device), float("inf")))
            engine.backward(loss / accum, last_micro_batch=i == accum - 1)
            if handle is not None:
                handle.remove()
            total += loss.detach().float().cpu() / accum
        collectives.all_reduce(total, group=ps.dp_group)
        res = engine.step(lr=_lr(step))
        in_flight.append(engine.schedule.pending is not None)
        if step == flush_at:
            assert engine.flush() is not None
        losses.append(total.item() / ps.dp_size)
        skipped.append(res.skipped)
        scales.append(res.loss_scale)
    engine.flush()
    final = _full_params(model, ps)
    acc = engine.accounting
    engine.close()
    return dict(init=init, final=final, losses=losses, skipped=skipped, scales=scales, in_flight=in_flight,
                pending_bytes=acc.host_dpu_pending_bytes, staging_bytes=acc.host_staging_bytes,
                acc_bytes=acc.host_accumulator_bytes) if rank == 0 else None


def _reference(init, seed, dp, accum, warmup, skip_step=None, flush_at=None, predict=False, dtype=torch.float64):
    """One process: the delayed schedule above with torch.optim.AdamW (warmup None: no delay), in
    float64 by default; in fp32 it measures torch's own rounding on this trajectory
    (tests/fp32_bounds.py).

    predict (--dpu-weight-prediction): the optimizer's parameters (the master) live apart from
    the model's (the device copy); a delayed update joined at the next step gives the model
    w_new + (w_new - w_old), every other update (warm-up, a flush, the end) the master itself."""
    from zo_megatron.checkpoint.hf.gpt2 import from_hf, to_hf

    hc = transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS,
                                 resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                 activation_function="gelu_new", layer_norm_epsilon=1e-5)
    model = transformers.GPT2LMHeadModel(hc).to(dtype)
    model.load_state_dict(to_hf(init, LAYERS, HEADS), strict=True)
    params = list(model.parameters())
    decay = [p for p in params if p.dim() > 1]
    no_decay = [p for p in params if p.dim() <= 1]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": WD}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=_lr(0), betas=BETAS, eps=EPS)

    master = [p.detach().clone() for p in params] if predict else None

    def apply(update, predicted=False):
        grads, lr = update
        if master is not None:                        # the optimizer steps the master
            with torch.no_grad():
                for p, m in zip(params, master):
                    p.copy_(m)
        for p, g in zip(params, grads):
            p.grad = g
        for group in opt.param_groups:
            group["lr"] = lr
        opt.step()
        if master is not None:
            with torch.no_grad():
                for p, m in zip(params, master):
                    new = p.detach().clone()
                    if predicted:                     # the device copy, extrapolated by this update
                        p.copy_(new + (new - m))
                    m.copy_(new)

    losses, pending, updates = [], None, 0
    for step, micro_batches in enumerate(_batches(seed + 7, dp, accum)):
        opt.zero_grad()
        total = 0.0
        for tokens, labels in micro_batches:          # on the parameters the device holds now
            logits = model(tokens).logits
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))
            (loss / accum).backward()
            total += loss.item() / accum
        losses.append(total)
        torch.nn.utils.clip_grad_norm_(params, CLIP)
        update = ([p.grad.clone() for p in params], _lr(step))
        if pending is not None:                       # g_{t-1} is applied after g_t was computed
            apply(pending, predicted=True)
            pending = None
        if step == skip_step:
            continue
        updates += 1
        if warmup is not None and updates >= warmup:
            pending = update
        else:
            apply(update)
        if step == flush_at and pending is not None:
            apply(pending)
            pending = None
    if pending is not None:
        apply(pending)
    sd = {n: p.detach() for n, p in model.named_parameters()}
    sd["lm_head.weight"] = sd["transformer.wte.weight"]
    return losses, from_hf(sd, LAYERS, HEADS)


def _assert_matches(out, ref_losses, ref_final, torch32_final, other_losses, why_other):
    """Every loss and every final parameter tensor equal the float64 reference's (losses 1e-5
    relative; tensors as tests/fp32_bounds.py says, `torch32_final` being the reference's
    fp32 runs, fp32_spread), and the losses differ from `other_losses` (the schedule the test must tell its own
    from) by more than 1e-4 somewhere."""
    for ours, ref in zip(out["losses"], ref_losses):
        assert abs(ours - ref) / abs(ref) <= 1e-5, (ours, ref)
    assert max(abs(a - b) / abs(b) for a, b in zip(out["losses"], other_losses)) > 1e-4, why_other
    assert_fp32_weights_match(out["final"], ref_final, torch32_final)


@pytest.mark.parametrize("tp,world,accum,engine_kw,flush_at", [
    (1, 1, 1, {}, 6),                       # a flush mid-run (as evaluation does), then delayed again
    # exhaustive variants (docs/testing.md): DP2 with accumulation is tp1dp2-hostacc2's and the
    # weight-prediction test's, TP2 x DP2 the other two's sizes at once
    pytest.param(1, 2, 2, {}, None, marks=pytest.mark.slow),
    (2, 2, 2, {}, None),
    pytest.param(2, 4, 1, {}, None, marks=pytest.mark.slow),
    (1, 2, 2, {"accumulate_on_host": True}, None)],
    ids=["tp1dp1-flush", "tp1dp2-accum2", "tp2dp1-accum2", "tp2dp2", "tp1dp2-hostacc2"])
def test_dpu_fp32_equals_the_delayed_reference(tp, world, accum, engine_kw, flush_at):
    seed = fresh_seed(f"dpu fp32 tp{tp} world{world} accum{accum} {engine_kw}")
    out = run_world(_dpu_world, world, tp, "fp32", seed, accum, engine_kw, None, flush_at)[0]
    dp = world // tp
    ref_losses, ref_final = _reference(out["init"], seed, dp, accum, WARMUP, flush_at=flush_at)
    # in flight after every step from the W-th update on, except right after the flush
    assert out["in_flight"] == [i >= WARMUP - 1 for i in range(STEPS)]
    exact_losses, _ = _reference(out["init"], seed, dp, accum, None)
    torch32 = fp32_spread(lambda init: _reference(init, seed, dp, accum, WARMUP, flush_at=flush_at,
                                                  dtype=torch.float32)[1], out["init"])
    _assert_matches(out, ref_losses, ref_final, torch32, exact_losses,
                    "DPU must change the trajectory (else this test would not tell delayed from exact)")
    # accounting: one more landing buffer (and accumulator) than without DPU
    assert out["pending_bytes"] == out["staging_bytes"] + out["acc_bytes"] > 0


@pytest.mark.parametrize("tp,world,accum,flush_at", [(1, 2, 2, 6), (2, 2, 2, None)],
                         ids=["tp1dp2-accum2-flush", "tp2dp1-accum2"])
def test_dpu_weight_prediction_equals_the_predicted_reference(tp, world, accum, flush_at):
    """--dpu-weight-prediction: forward/backward run on w_t + (w_t - w_{t-1}) after a delayed update,
    on the exact master after a flush and at the end; the master is exact Adam of those gradients."""
    seed = fresh_seed(f"dpu weight prediction tp{tp} world{world}")
    out = run_world(_dpu_world, world, tp, "fp32", seed, accum, {"dpu_weight_prediction": True}, None, flush_at)[0]
    dp = world // tp
    ref_losses, ref_final = _reference(out["init"], seed, dp, accum, WARMUP, flush_at=flush_at, predict=True)
    plain_losses, _ = _reference(out["init"], seed, dp, accum, WARMUP, flush_at=flush_at)
    torch32 = fp32_spread(lambda init: _reference(init, seed, dp, accum, WARMUP, flush_at=flush_at, predict=True,
                                                  dtype=torch.float32)[1], out["init"])
    _assert_matches(out, ref_losses, ref_final, torch32, plain_losses,
                    "the prediction must change the trajectory (else this test would not tell it from plain DPU)")


def test_dpu_bf16_with_fp32_host_gradients_tracks_the_reference():
    """bf16 with fp32 host gradients: the 16-bit output buffer is shared by both landing sets."""
    seed = fresh_seed("dpu bf16 host32")
    out = run_world(_dpu_world, 2, 1, "bf16", seed, 2, {"host_grad_dtype": "fp32"})[0]
    ref_losses, ref_final = _reference(out["init"], seed, 2, 2, WARMUP)
    for ours, ref in zip(out["losses"], ref_losses):
        assert abs(ours - ref) / abs(ref) <= 2e-2
    for name, ref in ref_final.items():
        err = ((out["final"][name] - ref).norm() / ref.norm()).item()
        assert err <= (1e-1 if name.endswith(".bias") else 2e-2), (name, err)


@pytest.mark.parametrize("predict", [False, pytest.param(True, marks=pytest.mark.slow)],
                         ids=["plain", "weight-prediction"])      # the second: an exhaustive variant
def test_dpu_fp16_overflow_at_a_delayed_step(predict):
    """An inf injected at delayed step 6 on one rank: g_6 is dropped everywhere, the scale halves
    at step 6 as without DPU, the pending g_5 is still applied (with weight prediction: its
    extrapolated copy goes to the device, as the reference's)."""
    from zo_megatron.offload.loss_scaler import DynamicLossScaler

    seed = fresh_seed(f"dpu fp16 overflow predict={predict}")
    scaler = DynamicLossScaler(initial_scale=2.0**14, growth_interval=3, hysteresis=1)
    out = run_world(_dpu_world, 2, 1, "fp16", seed, 2, {"loss_scaler": scaler, "dpu_weight_prediction": predict}, 6)[0]
    assert out["skipped"] == [i == 6 for i in range(STEPS)]
    assert out["scales"] == [2.0**14] * 3 + [2.0**15] * 3 + [2.0**16] + [2.0**15] * 3 + [2.0**16] * 2, out["scales"]
    ref_losses, ref_final = _reference(out["init"], seed, 2, 2, WARMUP, skip_step=6, predict=predict)
    for ours, ref in zip(out["losses"], ref_losses):
        assert abs(ours - ref) / abs(ref) <= 1e-2, (ours, ref)
    for name, ref in ref_final.items():
        err = ((out["final"][name] - ref).norm() / ref.norm()).item()
        assert err <= (1e-1 if name.endswith(".bias") else 2e-2), (name, err)


# ------------------------------------------------------------------ one process, no process group
def _tiny_engine(**kw):
    from zo_megatron.offload.engine import AdamConfig, ZeroOffloadEngine

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    return model, ZeroOffloadEngine(model, precision="fp32", adam=AdamConfig(lr=1e-2), pin_memory=False,
                                    device="cpu", dpu_warmup_steps=2, **kw)


def _one_step(model, engine, before_backward=None):
    with engine.forward_context():
        loss = model(torch.randn(5, 8)).square().mean()
    if before_backward is not None:
        before_backward()
    engine.backward(loss)
    return engine.step()


def test_the_cpu_step_runs_while_the_next_forward_and_backward_run(monkeypatch):
    """The kernel of update 2 blocks until the main thread is inside step 3's backward: a
    synchronous update would never get there (the wait would time out)."""
    from zo_megatron.offload import cpu_adam

    model, engine = _tiny_engine()
    real, inside_next_step = cpu_adam.adam_step_segments, threading.Event()

    def kernel(*a, **kw):
        if kw["step"] == 2:
            assert inside_next_step.wait(timeout=30), "update 2 was not overlapped with step 3"
        return real(*a, **kw)

    monkeypatch.setattr(cpu_adam, "adam_step_segments", kernel)
    with engine:
        _one_step(model, engine)                       # update 1: at once
        _one_step(model, engine)                       # update 2: handed to the worker
        assert engine.schedule.pending is not None
        _one_step(model, engine, inside_next_step.set)  # step 3 runs while update 2 waits
        assert engine.flush() is not None
        assert engine.step_count == 3


def test_a_worker_error_surfaces_at_the_next_join_with_its_message(monkeypatch):
    from zo_megatron.offload import cpu_adam

    model, engine = _tiny_engine()
    real = cpu_adam.adam_step_segments

    def kernel(*a, **kw):
        if kw["step"] == 2:
            raise ValueError("injected kernel failure 42")
        return real(*a, **kw)

    monkeypatch.setattr(cpu_adam, "adam_step_segments", kernel)
    with engine:
        _one_step(model, engine)
        _one_step(model, engine)                       # the failure happens on the worker
        with pytest.raises(ValueError, match="injected kernel failure 42"):
            _one_step(model, engine)                   # ... and is raised here, at the join


def test_close_joins_the_worker_and_raises_its_error(monkeypatch):
    from zo_megatron.offload import cpu_adam

    model, engine = _tiny_engine()
    real = cpu_adam.adam_step_segments
    monkeypatch.setattr(cpu_adam, "adam_step_segments",
                        lambda *a, **kw: (_ for _ in ()).throw(OSError("late failure")) if kw["step"] == 2
                        else real(*a, **kw))
    _one_step(model, engine)
    _one_step(model, engine)
    with pytest.raises(OSError, match="late failure"):
        engine.close()
    assert engine._hooks == [] and engine.schedule.worker is None


def test_the_race_check_catches_a_parameter_written_during_an_update():
    model, engine = _tiny_engine(race_check=True)
    with engine:
        _one_step(model, engine)
        _one_step(model, engine)
        _one_step(model, engine)                       # clean delayed step: no error
        sabotage = lambda: model[2].bias.data.add_(1.0)   # noqa: E731 - a write while an update is in flight
        with pytest.raises(RuntimeError, match="DPU race: 4 parameter elements changed"):
            _one_step(model, engine, sabotage)


# ------------------------------------------------------------------ memory: planner == accounting
_MEM_CASES = [  # (precision, engine kwargs, grad_accum_steps as planned)
    ("bf16", {}, 1),
    ("bf16", {"host_grad_dtype": "fp32"}, 1),
    ("fp16", {"accumulate_on_host": True}, 4),
    ("fp32", {}, 1),
]


def _accounting_world(rank):
    from zo_megatron.model import GPTConfig, build_gpt_model
    from zo_megatron.offload.engine import ZeroOffloadEngine
    from zo_megatron.parallel import init_parallel

    ps = init_parallel(1, seed=5, num_attention_heads=HEADS, hidden_size=HIDDEN)
    out = []
    for precision, kw, _ in _MEM_CASES:
        cfg = GPTConfig(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, vocab_size=VOCAB,
                        max_position_embeddings=SEQ, precision=precision)
        for dpu, predict in ((None, False), (WARMUP, False), (WARMUP, True)):
            model = build_gpt_model(cfg, ps.tp_rank, ps.tp_size, 5)
            with ZeroOffloadEngine(model, precision=precision, bucket_size=3000, dp_group=ps.dp_group,
                                   dpu_warmup_steps=dpu, dpu_weight_prediction=predict, **kw) as engine:
                out.append(engine.accounting.as_dict())
    return out


def test_planner_dpu_line_equals_the_engine_accounting():
    """The planner's `dpu_pending_grad` item is exactly what DPU adds to the engine's host bytes,
    for 16-bit and fp32 host gradients and with host accumulation (DP=2: per partition). The
    prediction adds nothing: the CPU Adam kernel writes the extrapolated copy in its own pass
    (before issue 37 it kept the fp32 master before the update, +4 B per element, and the
    planner had a line for it)."""
    from zo_megatron.planner import PlanInput, plan

    accounts = run_world(_accounting_world, 2)[0]
    for c, (precision, kw, accum) in enumerate(_MEM_CASES):
        off, on, predicting = accounts[3 * c:3 * c + 3]
        added = on["host_bytes"] - off["host_bytes"]
        assert added == on["host_dpu_pending_bytes"] > 0
        p = plan(PlanInput(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, vocab_size=VOCAB,
                           seq_length=SEQ, max_position_embeddings=SEQ, data_parallel=2, micro_batch_size=MICRO,
                           grad_accum_steps=accum, precision=precision, bucket_size=3000, dpu=True,
                           host_grad_fp32=kw.get("host_grad_dtype") == "fp32",
                           accumulate_on_host=kw.get("accumulate_on_host", False), device_is_host=True))
        planned = p.host_items["dpu_pending_grad"] // p.ranks_per_node
        assert abs(planned - added) <= 0.01 * added, (precision, kw, planned, added)
        # --dpu-weight-prediction: nothing more, in the engine and in the plan
        assert predicting["host_bytes"] == on["host_bytes"], (precision, kw)
        assert plan(p.input.replace(dpu_weight_prediction=True)).host_items == p.host_items


# ------------------------------------------------------------------ the job: flags, timeline, plot
def test_the_job_trains_with_dpu_writes_a_timeline_and_it_plots(tmp_path):
    import json
    import os

    from tests.test_pretrain import TINY, _job, _rows
    from zo_megatron.data import extract_corpus
    from zo_megatron.data.preprocess import preprocess

    files = extract_corpus(str(tmp_path / "txt"), limit=8)
    preprocess(files, str(tmp_path / "sotu"), progress=False)
    log, tl = tmp_path / "log.jsonl", tmp_path / "run.timeline"
    r = _job(["--zero-offload", "--dpu", "--dpu-warmup-steps", "3", "--data-path",
              str(tmp_path / "sotu_text_document"), "--train-iters", "8", "--log-jsonl", str(log),
              "--timeline", str(tl), *TINY], tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "delayed parameter update after 3 exact updates" in r.stdout
    assert [e["iteration"] for e in _rows(log, "eval")] == [4, 8]
    for rank in (0, 1):
        rows = [json.loads(line) for line in open(f"{tl}.rank{rank}")]
        by_iter = {}
        for row in rows:
            assert row["rank"] == rank and row["end"] >= row["start"]
            by_iter.setdefault(row["iteration"], set()).add(row["phase"])
        assert sorted(by_iter) == list(range(1, 9))
        for it, phases in by_iter.items():
            assert {"forward", "backward", "grad_sync"} <= phases, (it, phases)
        assert sum(row["phase"] == "cpu_step" for row in rows) == 8          # every update ran once
        # from the 3rd update on the parameters return at the next step (or the flush before eval)
        assert sum(row["phase"] == "cpu_step_wait" for row in rows) == 8 - 2
    import subprocess
    import sys

    from tests.test_pretrain import ROOT

    p = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "plot_timeline.py"), str(tl), "--out",
                        str(tmp_path / "t.png")], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "rank 1: mean ms" in p.stdout and "CPU step overlapped with forward/backward" in p.stdout
    assert os.path.getsize(tmp_path / "t.png") > 10_000


def test_the_job_with_weight_prediction_resumes_bitwise_and_starts_as_exact_updates(tmp_path):
    """--dpu --dpu-corrector weight-prediction in the job (2 ranks, DP2): saved at iteration 3 (the
    flush before the checkpoint gives it the exact master) and resumed there, iterations 4-6 log the
    uninterrupted run's losses and grad norms bit for bit; its first W updates are exact updates, so
    the losses of iterations 1..W equal those of the job without --dpu bit for bit, and from W+1
    on they differ (the delay and the prediction act)."""
    from tests.test_pretrain import TINY, _job, _rows
    from zo_megatron.data import extract_corpus
    from zo_megatron.data.preprocess import preprocess

    preprocess(extract_corpus(str(tmp_path / "txt"), limit=8), str(tmp_path / "sotu"), progress=False)
    w = 2
    base = ["--zero-offload", "--data-path", str(tmp_path / "sotu_text_document"), "--train-iters", "6", *TINY]
    dpu = ["--dpu", "--dpu-warmup-steps", str(w), "--dpu-corrector", "weight-prediction"]
    ck = tmp_path / "ck"

    def run(name, *extra):
        log = tmp_path / f"{name}.jsonl"
        r = _job([*base, *extra, "--log-jsonl", str(log)], tmp_path)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        return {row["iteration"]: (row["loss"], row["grad_norm"]) for row in _rows(log, "train")}

    whole = run("whole", *dpu, "--save", str(ck), "--save-interval", "3")
    resumed = run("resumed", *dpu, "--load", str(ck), "--ckpt-step", "3")
    exact = run("exact")
    assert sorted(resumed) == [4, 5, 6] and {i: whole[i] for i in resumed} == resumed, (whole, resumed)
    assert [whole[i] for i in range(1, w + 1)] == [exact[i] for i in range(1, w + 1)], (whole, exact)
    assert all(whole[i][0] != exact[i][0] for i in range(w + 1, 7)), (whole, exact)


def test_dpu_without_zero_offload_is_one_line(tmp_path):
    from tests.test_pretrain import TINY, _single

    r = _single(["--dpu", "--train-iters", "2", *TINY], tmp_path)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "error: --dpu delays the CPU optimizer's update: add --zero-offload"], r.stderr
