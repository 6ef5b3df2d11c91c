"""--decoupled-lr (Megatron-LM's decoupled param group): the word embedding and the output layer
train at their own rate on the same schedule, in every optimizer.

- against float64 single-process torch: HF GPT-2 + torch.optim.AdamW with the embedding in a group
  of its own, both rates from a hand-computed warmup + cosine schedule, vs the offload engine at
  TP1 x DP2 (all on the host; 10% of each partition in the device tail, cut inside the embedding)
  and the DDP baseline;
- which parameters: exactly those megatron-core's own `_get_param_groups` gives the decoupled
  max_lr (tied and untied output layer), in every schedule (synchronous, partial offload, DPU with
  and without weight prediction, speculative overlap) and the baseline: with --lr 0 only they move.
"""
import math

import pytest
import torch

from tests.fp32_bounds import assert_fp32_weights_match, fp32_spread
from tests.harness import run_world
from tests.seeds import fresh_seed
from tests.test_offload_engine import BETAS, CLIP, EPS, HEADS, HIDDEN, LAYERS, MICRO, SEQ, VOCAB, WD, _batches, \
    _full_params

transformers = pytest.importorskip("transformers")

ACCUM, STEPS = 1, 6
WORD_EMBEDDING, OUTPUT_LAYER = "embedding.word_embeddings.weight", "output_layer.weight"


def _rates(step):
    """(rate, decoupled rate) of update `step` (0-based): linear warmup over 2 updates from 1e-4,
    then cosine decay to each group's floor at update STEPS, as Megatron's scheduler per group."""
    def rate(peak, floor, init=1e-4, warmup=2):
        if step <= warmup:
            return init + (peak - init) * step / warmup
        return floor + 0.5 * (math.cos(math.pi * (step - warmup) / (STEPS - warmup)) + 1.0) * (peak - floor)
    return rate(2e-3, 2e-4), rate(8e-3, 5e-4)


def _train_world(rank, seed, variants):
    """Each variant ({"plain": True} or engine keywords) trains STEPS steps at _rates from the same
    model; rank 0 returns the initial and every variant's final full parameters."""
    from zo_megatron.model import GPTConfig, build_gpt_model
    from zo_megatron.offload.engine import AdamConfig, ZeroOffloadEngine
    from zo_megatron.parallel import init_parallel
    from zo_megatron.training.plain_optimizer import PlainDDPOptimizer

    ps = init_parallel(1, seed=seed, num_attention_heads=HEADS, hidden_size=HIDDEN)
    cfg = GPTConfig(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, vocab_size=VOCAB,
                    max_position_embeddings=SEQ, precision="fp32")
    adam = AdamConfig(lr=1.0, beta1=BETAS[0], beta2=BETAS[1], eps=EPS, weight_decay=WD)   # never used: step() has rates
    out = {}
    for name, kw in variants.items():
        model = build_gpt_model(cfg, ps.tp_rank, ps.tp_size, seed)
        out.setdefault("init", _full_params(model, ps))
        if kw.get("plain"):
            opt = PlainDDPOptimizer(model, precision="fp32", adam=adam, clip_grad=CLIP, dp_group=ps.dp_group,
                                    tp_rank=ps.tp_rank)
        else:
            opt = ZeroOffloadEngine(model, precision="fp32", adam=adam, clip_grad=CLIP, bucket_size=3000,
                                    dp_group=ps.dp_group, tp_rank=ps.tp_rank, device=ps.device, **kw)
        mine = slice(ps.dp_rank * MICRO, (ps.dp_rank + 1) * MICRO)
        clips = []
        for step, micro_batches in enumerate(_batches(seed + 7, ps.dp_size, ACCUM)[:STEPS]):
            tokens, labels = micro_batches[0]
            opt.backward(model.loss(tokens[mine], labels[mine]))
            lr, decoupled_lr = _rates(step)
            clips.append(opt.step(lr, decoupled_lr).clip_coef)
        assert min(clips) < 1.0, "the clip threshold must actually clip in this test"
        out[name] = _full_params(model, ps)
        opt.close()
    return out if rank == 0 else None


def _reference(init, seed, dp, dtype=torch.float64):
    """HF GPT-2 + torch.optim.AdamW: (decay, no decay, the tied word embedding) as three groups."""
    from zo_megatron.checkpoint.hf.gpt2 import from_hf, to_hf

    hc = transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS,
                                 resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                 activation_function="gelu_new", layer_norm_epsilon=1e-5)
    model = transformers.GPT2LMHeadModel(hc).to(dtype)
    model.load_state_dict(to_hf(init, LAYERS, HEADS), strict=True)
    wte = model.transformer.wte.weight                   # also lm_head.weight (tied)
    rest = [p for p in model.parameters() if p is not wte]
    opt = torch.optim.AdamW([{"params": [p for p in rest if p.dim() > 1], "weight_decay": WD},
                             {"params": [p for p in rest if p.dim() <= 1], "weight_decay": 0.0},
                             {"params": [wte], "weight_decay": WD, "decoupled": True}], lr=0.0, betas=BETAS, eps=EPS)
    for step, micro_batches in enumerate(_batches(seed + 7, dp, ACCUM)[:STEPS]):
        opt.zero_grad()
        tokens, labels = micro_batches[0]
        torch.nn.functional.cross_entropy(model(tokens).logits.reshape(-1, VOCAB), labels.reshape(-1)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        lr, decoupled_lr = _rates(step)
        for g in opt.param_groups:
            g["lr"] = decoupled_lr if g.get("decoupled") else lr
        opt.step()
    sd = {n: p.detach() for n, p in model.named_parameters()}
    sd["lm_head.weight"] = sd["transformer.wte.weight"]
    return from_hf(sd, LAYERS, HEADS)


def test_every_optimizer_equals_torch_adamw_with_a_decoupled_group():
    """fp32 engine (host only; 10% device tail) and baseline at TP1 x DP2 vs float64 torch AdamW,
    every element of every tensor (tests/fp32_bounds.py). With one rate for all, the embedding
    would end ~1e-1 away: the test fails on code without the decoupled rate."""
    seed = fresh_seed("decoupled lr vs torch")
    variants = {"offload": {}, "offload_tail": {"optimizer_offload_fraction": 0.9}, "plain": {"plain": True}}
    out = run_world(_train_world, 2, seed, variants)[0]
    ref = _reference(out["init"], seed, 2)
    ref32 = fp32_spread(lambda init: _reference(init, seed, 2, dtype=torch.float32), out["init"])
    for name in variants:
        assert_fp32_weights_match(out[name], ref, ref32)


def _megatron_decoupled_names(model):
    """The parameters megatron-core's own optimizer puts in a group with max_lr = --decoupled-lr."""
    from megatron.core.optimizer import OptimizerConfig, _get_param_groups

    config = OptimizerConfig(lr=1e-3, min_lr=1e-5, decoupled_lr=7e-4, decoupled_min_lr=3e-6)
    groups = _get_param_groups([model.gpt], config, None)
    ids = {id(p) for g in groups if g["max_lr"] == 7e-4 and g["min_lr"] == 3e-6 for p in g["params"]}
    return {n for n, p in model.gpt.named_parameters() if id(p) in ids}


def _membership_world(rank, seed, untied):
    """--lr 0 and a decoupled rate: after 2 updates (flushed), which parameters moved, per variant."""
    from zo_megatron.model import GPTConfig, build_gpt_model
    from zo_megatron.offload.engine import AdamConfig, ZeroOffloadEngine
    from zo_megatron.parallel import init_parallel
    from zo_megatron.training.plain_optimizer import PlainDDPOptimizer

    ps = init_parallel(1, seed=seed, num_attention_heads=HEADS, hidden_size=HIDDEN)
    cfg = GPTConfig(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, vocab_size=VOCAB,
                    max_position_embeddings=SEQ, precision="fp32", untie_embeddings_and_output_weights=untied)
    adam = AdamConfig(weight_decay=WD)
    variants = {"sync": {}, "tail": {"optimizer_offload_fraction": 0.5}, "dpu": {"dpu_warmup_steps": 1},
                "dpu_prediction": {"dpu_warmup_steps": 1, "dpu_weight_prediction": True},
                "overlap": {"overlap_cpu_step": True}, "plain": None}
    batches = _batches(seed + 7, ps.dp_size, 1)[:2]
    mine = slice(ps.dp_rank * MICRO, (ps.dp_rank + 1) * MICRO)
    out = {}
    for name, kw in variants.items():
        model = build_gpt_model(cfg, ps.tp_rank, ps.tp_size, seed)
        out["megatron"] = _megatron_decoupled_names(model)
        init = {n: p.detach().clone() for n, p in model.gpt.named_parameters()}
        opt = PlainDDPOptimizer(model, precision="fp32", adam=adam, dp_group=ps.dp_group) if kw is None else \
            ZeroOffloadEngine(model, precision="fp32", adam=adam, bucket_size=2000, dp_group=ps.dp_group,
                              device=ps.device, **kw)
        if name == "overlap":
            opt.schedule.max_backoff = 0
        for (tokens, labels), in batches:
            if hasattr(opt, "expect_lr"):
                opt.expect_lr(0.0, 1e-2)
            opt.backward(model.loss(tokens[mine], labels[mine]))
            opt.step(0.0, 1e-2)
        opt.flush()
        out[name] = {n for n, p in model.gpt.named_parameters() if not torch.equal(p.detach(), init[n])}
        opt.close()
    return out


@pytest.mark.parametrize("untied", [False, True], ids=["tied", "untied"])
def test_exactly_megatrons_decoupled_parameters_take_the_decoupled_rate(untied):
    seed = fresh_seed(f"decoupled membership untied={untied}")
    for out in run_world(_membership_world, 2, seed, untied):
        want = {WORD_EMBEDDING, OUTPUT_LAYER} if untied else {WORD_EMBEDDING}
        assert out.pop("megatron") == want
        for name, moved in out.items():
            assert moved == want, (name, moved)


def test_the_job_logs_the_decoupled_rate_and_resumes_it_exactly(tmp_path):
    """pretrain with --decoupled-lr/--decoupled-min-lr (ZeRO-Offload, DP2): the banner names them, the
    JSONL's decoupled_lr is Megatron's rate for that group every iteration; a resume from iteration 2 continues bit for
    bit, also with --use-checkpoint-opt_param-scheduler and no decoupled flags (the checkpoint's
    values); another --decoupled-lr is refused naming it."""
    from tests.megatron_reference import megatron_get_lr
    from tests.test_checkpoint_resume import TINY, _log, _world

    seed = str(fresh_seed("decoupled lr resume"))
    base = [*TINY, "--seed", seed, "--train-iters", "4", "--lr-decay-iters", "4", "--zero-offload", "--fp32"]
    flags = ["--decoupled-lr", "3e-2", "--decoupled-min-lr", "1e-3"]
    ck = str(tmp_path / "ck")
    logs = {k: str(tmp_path / f"{k}.jsonl") for k in ("straight", "resumed", "checkpoint_schedule")}
    out = _world(2, [
        [*base, *flags, "--save", ck, "--save-interval", "2", "--log-jsonl", logs["straight"]],
        ("reset", ck, 2),
        [*base, *flags, "--load", ck, "--log-jsonl", logs["resumed"]],
        [*base, "--decoupled-lr", "2e-2", "--decoupled-min-lr", "1e-3", "--load", ck],
        [*base, "--load", ck, "--use-checkpoint-opt_param-scheduler", "--log-jsonl", logs["checkpoint_schedule"]],
    ], tmp_path)
    assert [o is None or o.get("rc") for o in out] == [0, True, 0, None, 0], out
    assert "--decoupled-lr" in out[3]["error"] and "0.03" in out[3]["error"], out[3]["error"]
    assert "word embedding and output layer: lr 0.03, min 0.001 (--decoupled-lr)" in out[0]["stdout"]   # the banner
    straight = {r["iteration"]: r for r in _log(logs["straight"])}
    for k, r in straight.items():
        want = megatron_get_lr((k - 1) * 4, init_lr=0.0, max_lr=3e-2, min_lr=1e-3, lr_warmup_steps=4,
                               lr_decay_steps=16, lr_decay_style="cosine")
        assert r["decoupled_lr"] == pytest.approx(want, rel=1e-12, abs=1e-18), (k, r["decoupled_lr"], want)
    keys = ("loss", "grad_norm", "lr", "decoupled_lr")
    for name in ("resumed", "checkpoint_schedule"):
        rows = {r["iteration"]: r for r in _log(logs[name])}
        assert sorted(rows) == [3, 4], name
        for k in (3, 4):
            assert [rows[k][x] for x in keys] == [straight[k][x] for x in keys], (name, k)
