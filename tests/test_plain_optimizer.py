"""The DDP + AdamW baseline against single-process torch: the same reference as the engine's.

Its gradients are averaged over DP before the norm, so every DP replica holds the same ones: the
global norm must count them once (a sum over the whole world counted each replica again and
reported sqrt(DP) times the true norm, clipping early).
"""
import pytest
import torch

from tests.fp32_bounds import assert_fp32_weights_match, fp32_spread
from tests.harness import run_world
from tests.seeds import fresh_seed
from tests.test_offload_engine import ACCUM, BETAS, CLIP, EPS, HEADS, HIDDEN, LAYERS, MICRO, SEQ, VOCAB, WD, \
    _batches, _full_params, _lr, _reference

pytest.importorskip("transformers")


def _baseline_world(rank, tp, seed):
    from zo_megatron.model import GPTConfig, build_gpt_model
    from zo_megatron.offload.engine import AdamConfig
    from zo_megatron.parallel import collectives, init_parallel
    from zo_megatron.training.plain_optimizer import PlainDDPOptimizer

    ps = init_parallel(tp, seed=seed, num_attention_heads=HEADS, hidden_size=HIDDEN)
    cfg = GPTConfig(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, vocab_size=VOCAB,
                    max_position_embeddings=SEQ, precision="fp32")
    model = build_gpt_model(cfg, ps.tp_rank, ps.tp_size, seed)
    opt = PlainDDPOptimizer(model, precision="fp32", clip_grad=CLIP, dp_group=ps.dp_group, tp_rank=ps.tp_rank,
                            adam=AdamConfig(lr=_lr(0), beta1=BETAS[0], beta2=BETAS[1], eps=EPS, weight_decay=WD))
    init = _full_params(model, ps)
    losses, norms = [], []
    for step, micro_batches in enumerate(_batches(seed + 7, ps.dp_size)):
        total = torch.zeros(())
        for i, (tokens, labels) in enumerate(micro_batches):
            mine = slice(ps.dp_rank * MICRO, (ps.dp_rank + 1) * MICRO)
            loss = model.loss(tokens[mine], labels[mine])
            opt.backward(loss / ACCUM, last_micro_batch=i == ACCUM - 1)
            total += loss.detach() / ACCUM
        collectives.all_reduce(total, group=ps.dp_group)
        res = opt.step(lr=_lr(step))
        losses.append(total.item() / ps.dp_size)
        norms.append(res.grad_norm)
    final = _full_params(model, ps)
    return dict(init=init, final=final, losses=losses, norms=norms) if rank == 0 else None


@pytest.mark.parametrize("tp,world", [(1, 2), (2, 4)])
def test_baseline_grad_norm_and_weights_equal_torch(tp, world):
    seed = fresh_seed(f"baseline tp{tp} world{world}")
    out = run_world(_baseline_world, world, tp, seed)[0]
    ref_losses, ref_norms, ref_final = _reference(out["init"], seed, world // tp)
    for ours, ref in zip(out["norms"], ref_norms):
        assert abs(ours - ref) <= 1e-5 * ref, (out["norms"], ref_norms)
    for ours, ref in zip(out["losses"], ref_losses):
        assert abs(ours - ref) <= 1e-5 * abs(ref)
    assert_fp32_weights_match(out["final"], ref_final, fp32_spread(
        lambda init: _reference(init, seed, world // tp, dtype=torch.float32)[2], out["init"]))


@pytest.mark.parametrize("counted", [(True, True, True), (True, False, True), (False, False, False)])
def test_norm_stats_stay_on_the_gradients_device(counted):
    """The norm and the non-finite flag are built where the gradients live, whichever of them are
    counted. On the 'meta' device (standing in for CUDA: any device but the CPU), a CPU zero for
    an empty uncounted list made torch.stack raise "not on the expected device" -- every TP=1
    CUDA run of the DDP baseline crashed at its first step."""
    from zo_megatron.training.plain_optimizer import local_norm_stats

    grads = [torch.empty(n, device="meta") for n in (3, 5, 7)]
    for count_zeros in (False, True):
        stats = local_norm_stats(grads, list(counted), count_zeros)
        assert stats.device.type == "meta" and stats.shape == (3,) and stats.dtype == torch.float64


def test_norm_stats_count_the_counted_gradients_exact_zeros():
    """--log-num-zeros-in-grad's count: exact zeros of the counted gradients only (an uncounted TP copy's
    zeros are its counted twin's), 0 when not asked."""
    from zo_megatron.training.plain_optimizer import local_norm_stats

    seed = fresh_seed("zeros in grad")
    gen = torch.Generator().manual_seed(seed)
    grads = [torch.randn(n, generator=gen) for n in (64, 33, 80)]
    for g in grads:
        g[torch.rand(g.numel(), generator=gen) < 0.3] = 0.0
    counted = [True, False, True]
    want = sum(int((g == 0).sum()) for g, c in zip(grads, counted) if c)
    assert want > 0 and local_norm_stats(grads, counted, True)[2].item() == want
    assert local_norm_stats(grads, counted)[2].item() == 0.0


@pytest.mark.parametrize("poison", [None, "counted", "uncounted"])
def test_norm_stats_values_equal_float64(poison):
    from zo_megatron.training.plain_optimizer import local_norm_stats

    seed = fresh_seed(f"norm stats {poison}")
    gen = torch.Generator().manual_seed(seed)
    grads = [torch.randn(n, generator=gen) for n in (3, 17, 5, 9)]
    counted = [True, False, True, False]
    if poison == "counted":
        grads[2][1] = float("inf")
    elif poison == "uncounted":
        grads[3][4] = float("nan")
    stats = local_norm_stats(grads, counted)
    ref = sum(float((g.double() ** 2).sum()) for g, c in zip(grads, counted) if c)
    if poison is None:
        assert abs(stats[0].item() - ref) <= 1e-6 * ref and stats[1].item() == 0.0
    else:
        # a non-finite gradient shows either in the sum (counted) or in the flag (uncounted)
        assert not torch.isfinite(stats[0]).item() or stats[1].item() == 1.0
        assert stats[1].item() == (1.0 if poison == "uncounted" else 0.0)
