"""--sequence-parallel: megatron-core's sequence-parallel regions with our norms.

The model at TP 2 and 4 with sequence parallelism equals the same model without it and a
single-process Hugging Face GPT-2 (logits, loss, every gradient, norm weights included, after
the TP sum of the gradients megatron-core's finalize_model_grads does for parameters tagged
`sequence_parallel`); both optimizers (ZeRO-Offload engine and the DDP baseline) do that sum
themselves and train like torch AdamW on the HF model; checkpoints move between runs with and
without it.
"""
import pytest
import torch
import torch.distributed as dist

from tests.fp32_bounds import assert_fp32_weights_match, fp32_spread
from tests.harness import run_world
from tests.seeds import fresh_seed
from tests.test_model_tp import _check_against_reference

transformers = pytest.importorskip("transformers")

LAYERS, HIDDEN, HEADS, SEQ, BATCH, VOCAB = 2, 64, 4, 16, 4, 997

# megatron-core's tagging: every norm weight/bias (ours) and every row-parallel bias (its own).
SP_TAGGED = {f"decoder.layers.{i}.{m}" for i in range(LAYERS) for m in (
    "input_layernorm.weight", "input_layernorm.bias", "pre_mlp_layernorm.weight", "pre_mlp_layernorm.bias",
    "self_attention.linear_proj.bias", "mlp.linear_fc2.bias")} | {"decoder.final_layernorm.weight",
                                                                  "decoder.final_layernorm.bias"}


def _forward_backward(ps, cfg, seed, batch_seed):
    """One forward/backward of the model `cfg` describes on a fresh batch; full logits, loss and
    gathered full gradients (sequence-parallel gradients summed over TP first)."""
    from zo_megatron.model import build_gpt_model
    from zo_megatron.model.sharding import gather_full, model_shard_infos
    from zo_megatron.parallel import collectives

    tp = ps.tp_size
    model = build_gpt_model(cfg, ps.tp_rank, tp, seed)
    infos = model_shard_infos(model, ps.tp_rank, tp, VOCAB)
    params = {n: gather_full(p.detach(), infos[n], ps.tp_group, tp) for n, p in model.named_parameters()}
    model.to(cfg.dtype)
    gen = torch.Generator().manual_seed(batch_seed)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    logits = model(tokens)
    loss = model.loss(tokens, labels)
    loss.backward()
    kernels = {getattr(layer.self_attention.core_attention, "last_kernel", None) for layer in model.gpt.decoder.layers}
    shards = [torch.empty_like(logits.detach().float()) for _ in range(tp)]
    dist.all_gather(shards, logits.detach().float().contiguous(), group=ps.tp_group)
    tagged = {n.removeprefix("gpt.") for n, p in model.named_parameters() if getattr(p, "sequence_parallel", False)}
    grads, partial = {}, {}
    for n, p in model.named_parameters():
        g = p.grad.float().clone()
        if getattr(p, "sequence_parallel", False):
            partial[n] = g.clone()
            collectives.all_reduce(g, group=ps.tp_group)
        grads[n] = gather_full(g, infos[n], ps.tp_group, tp)
    return dict(params=params, logits=torch.cat(shards, dim=-1)[..., :VOCAB], loss=loss.item(), grads=grads,
                tokens=tokens, labels=labels, tagged=tagged, partial=partial, kernels=kernels)


def _model_world(rank, tp, seed, batch_seed, backend):
    from zo_megatron.model import GPTConfig
    from zo_megatron.parallel import init_parallel

    ps = init_parallel(tp, seed=seed, num_attention_heads=HEADS, hidden_size=HIDDEN)
    out = {}
    for sp in (False, True):
        cfg = GPTConfig(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, vocab_size=VOCAB,
                        max_position_embeddings=SEQ, precision="fp32", sequence_parallel=sp,
                        attention_backend=backend)
        out[sp] = _forward_backward(ps, cfg, seed, batch_seed)
    return out if rank == 0 else None


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-30)).item()


@pytest.mark.parametrize("tp,backend", [(2, "local"), (4, "local"), (2, "sdpa")])
def test_sequence_parallel_equals_tp_without_it_and_hf_gpt2(tp, backend):
    seed = fresh_seed(f"sequence parallel tp{tp} {backend}")
    out = run_world(_model_world, tp, tp, seed, seed + 1, backend)[0]
    plain, sp = out[False], out[True]
    assert plain["tagged"] == set() and sp["tagged"] == SP_TAGGED
    # The tagged gradients really are partial on each rank: without the TP sum they would be wrong.
    for n, g in sp["partial"].items():
        assert _rel(g, sp["grads"][n]) > 1e-3, n
    assert _rel(sp["logits"], plain["logits"]) <= 1e-5
    assert abs(sp["loss"] - plain["loss"]) <= 1e-5 * abs(plain["loss"])
    for n, g in plain["grads"].items():
        assert _rel(sp["grads"][n], g) <= 1e-5, n
    for o in (plain, sp):
        _check_against_reference(o, VOCAB, tol=1e-5)


def _sp_errors_world(rank):
    from zo_megatron.errors import ConfigError
    from zo_megatron.model import GPTConfig, build_gpt_model
    from zo_megatron.offload.engine import ZeroOffloadEngine
    from zo_megatron.parallel import init_parallel
    from zo_megatron.training.plain_optimizer import PlainDDPOptimizer

    ps = init_parallel(2, seed=1, num_attention_heads=HEADS, hidden_size=HIDDEN)
    cfg = GPTConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=HEADS, vocab_size=VOCAB,
                    max_position_embeddings=SEQ, precision="fp32", sequence_parallel=True)
    model = build_gpt_model(cfg, ps.tp_rank, ps.tp_size, 1)
    errors = []
    try:
        model.loss(torch.zeros(1, SEQ - 1, dtype=torch.long), torch.zeros(1, SEQ - 1, dtype=torch.long))
    except ConfigError as e:
        errors.append(str(e))
    for build in (lambda: ZeroOffloadEngine(model, precision="fp32", dp_group=ps.dp_group, tp_rank=ps.tp_rank),
                  lambda: PlainDDPOptimizer(model, precision="fp32", dp_group=ps.dp_group, tp_rank=ps.tp_rank)):
        try:
            build().close()
        except ConfigError as e:
            errors.append(str(e))
    return errors


def test_odd_sequence_and_missing_tp_group_are_one_line_errors():
    errors = run_world(_sp_errors_world, 2)[0]
    assert len(errors) == 3, errors
    assert "not divisible by TP 2" in errors[0]
    assert all("tp_group" in e for e in errors[1:]), errors
    assert all("\n" not in e for e in errors)


# ---------------------------------------------------------------------------------- optimizers
def _train_world(rank, tp, seed, optimizer):
    """tests/test_offload_engine.py's training run (10 steps, 2-step accumulation, clip, decay,
    per-step lr) with sequence parallelism, for either optimizer."""
    from tests import test_offload_engine as T
    from zo_megatron.model import GPTConfig, build_gpt_model
    from zo_megatron.offload.engine import AdamConfig, ZeroOffloadEngine
    from zo_megatron.parallel import collectives, init_parallel
    from zo_megatron.training.plain_optimizer import PlainDDPOptimizer

    ps = init_parallel(tp, seed=seed, num_attention_heads=T.HEADS, hidden_size=T.HIDDEN)
    cfg = GPTConfig(num_layers=T.LAYERS, hidden_size=T.HIDDEN, num_attention_heads=T.HEADS, vocab_size=T.VOCAB,
                    max_position_embeddings=T.SEQ, precision="fp32", sequence_parallel=True)
    model = build_gpt_model(cfg, ps.tp_rank, ps.tp_size, seed)
    adam = AdamConfig(lr=T._lr(0), beta1=T.BETAS[0], beta2=T.BETAS[1], eps=T.EPS, weight_decay=T.WD)
    common = dict(precision="fp32", adam=adam, clip_grad=T.CLIP, dp_group=ps.dp_group, tp_rank=ps.tp_rank,
                  tp_group=ps.tp_group)
    if optimizer == "offload":
        opt = ZeroOffloadEngine(model, bucket_size=3000, device=ps.device, **common)
    else:
        opt = PlainDDPOptimizer(model, **common)
    init = T._full_params(model, ps)
    losses, norms, clips = [], [], []
    for step, micro_batches in enumerate(T._batches(seed + 7, ps.dp_size)):
        total = torch.zeros(())
        for i, (tokens, labels) in enumerate(micro_batches):
            mine = slice(ps.dp_rank * T.MICRO, (ps.dp_rank + 1) * T.MICRO)
            with opt.forward_context():
                loss = model.loss(tokens[mine], labels[mine])
            opt.backward(loss / T.ACCUM, last_micro_batch=i == T.ACCUM - 1)
            total += loss.detach().float() / T.ACCUM
        collectives.all_reduce(total, group=ps.dp_group)
        res = opt.step(lr=T._lr(step))
        losses.append(total.item() / ps.dp_size)
        norms.append(res.grad_norm)
        clips.append(res.clip_coef)
    final = T._full_params(model, ps)
    opt.close()
    return dict(init=init, final=final, losses=losses, norms=norms, clips=clips) if rank == 0 else None


@pytest.mark.parametrize("optimizer", ["offload", "ddp"])
def test_tp2_dp2_with_sequence_parallel_equals_torch_adamw(optimizer):
    from tests import test_offload_engine as T

    seed = fresh_seed(f"sequence parallel {optimizer} tp2 dp2")
    out = run_world(_train_world, 4, 2, seed, optimizer)[0]
    ref_losses, ref_norms, ref_final = T._reference(out["init"], seed, 2)
    assert min(out["clips"]) < 1.0
    for ours, ref in zip(out["losses"], ref_losses):
        assert abs(ours - ref) / abs(ref) <= 1e-5
    for ours, ref in zip(out["norms"], ref_norms):
        assert abs(ours - ref) / ref <= 1e-5
    # the bounds of test_offload_engine's fp32 test
    assert_fp32_weights_match(out["final"], ref_final, fp32_spread(
        lambda init: T._reference(init, seed, 2, dtype=torch.float32)[2], out["init"]))
    for name in ref_final:
        assert not torch.equal(out["final"][name], out["init"][name]), f"{name} never moved"


# --------------------------------------------------------------------------------- checkpoints
def test_checkpoints_move_between_runs_with_and_without_sequence_parallel_and_sdpa(tmp_path):
    """Through the real job (TP 2, ZeRO-Offload, fp32): neither flag changes a weight, so a
    checkpoint saved with --sequence-parallel --use-flash-attn resumes without them and vice
    versa, continuing the plain run's trajectory (to 1e-6: only summation orders differ)."""
    from tests.test_checkpoint_resume import TINY, _losses, _world

    seed = str(fresh_seed("sp/sdpa checkpoints"))
    common = [*TINY, "--zero-offload", "--fp32", "--seed", seed, "--eval-iters", "0", "--tensor-parallel", "2"]
    both = ["--sequence-parallel", "--use-flash-attn"]
    ck = {k: str(tmp_path / k) for k in ("plain", "both")}
    log = {k: str(tmp_path / f"{k}.jsonl") for k in ("plain", "both", "plain_to_both", "both_to_plain")}
    out = _world(2, [
        [*common, "--train-iters", "4", "--save", ck["plain"], "--save-interval", "2", "--log-jsonl", log["plain"]],
        [*common, *both, "--train-iters", "2", "--save", ck["both"], "--log-jsonl", log["both"]],
        ("reset", ck["plain"], 2),
        [*common, *both, "--train-iters", "4", "--load", ck["plain"], "--log-jsonl", log["plain_to_both"]],
        [*common, "--train-iters", "4", "--load", ck["both"], "--log-jsonl", log["both_to_plain"]]], tmp_path)
    for o in out:
        assert o is None or o.get("rc") == 0, o
    banner = out[1]["stdout"]
    assert "sequence parallel over TP 2" in banner and "torch SDPA" in banner, banner
    assert "no sequence parallelism" in out[0]["stdout"] and "local DotProductAttention" in out[0]["stdout"]
    ref = _losses(log["plain"])
    assert sorted(ref) == [1, 2, 3, 4]
    for name, iters in (("both", (1, 2)), ("plain_to_both", (3, 4)), ("both_to_plain", (3, 4))):
        got = _losses(log[name])
        assert sorted(got) == list(iters), (name, got)
        for i in iters:
            assert abs(got[i] - ref[i]) <= 1e-6 * abs(ref[i]), (name, i, got[i], ref[i])
