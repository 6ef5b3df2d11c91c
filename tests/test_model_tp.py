"""The TP GPT equals an independent single-process reference: Hugging Face GPT-2.

Each world builds the model from a seed, runs one forward/backward on a fresh random batch, and
sends rank 0's gathered (full, unpadded) weights, logits, loss and gradients back. The parent
loads those weights into transformers' GPT2LMHeadModel, runs the same batch, and compares every
element. Gathered weights are also compared across TP sizes (layout-independent init).
"""
import pytest
import torch
import torch.distributed as dist

from tests.harness import run_world
from tests.seeds import fresh_seed

transformers = pytest.importorskip("transformers")

LAYERS, HIDDEN, HEADS, SEQ, BATCH = 2, 64, 4, 16, 4


def _world(rank, tp, precision, vocab, divisible_by, seed, batch_seed):
    from zo_megatron.model import GPTConfig, build_gpt_model
    from zo_megatron.model.sharding import gather_full, model_shard_infos
    from zo_megatron.parallel import init_parallel

    ps = init_parallel(tp, seed=seed, num_attention_heads=HEADS, hidden_size=HIDDEN)
    cfg = GPTConfig(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, vocab_size=vocab,
                    max_position_embeddings=SEQ, make_vocab_size_divisible_by=divisible_by, precision=precision)
    model = build_gpt_model(cfg, ps.tp_rank, ps.tp_size, seed)
    infos = model_shard_infos(model, ps.tp_rank, ps.tp_size, vocab)
    full_params = {n: gather_full(p.detach(), infos[n], ps.tp_group, tp) for n, p in model.named_parameters()}
    model.to(cfg.dtype)

    gen = torch.Generator().manual_seed(batch_seed)
    tokens = torch.randint(0, vocab, (BATCH, SEQ), generator=gen)
    labels = torch.randint(0, vocab, (BATCH, SEQ), generator=gen)
    per_dp = BATCH // ps.dp_size
    mine = slice(ps.dp_rank * per_dp, (ps.dp_rank + 1) * per_dp)

    logits = model(tokens[mine])
    loss = model.loss(tokens[mine], labels[mine])
    loss.backward()

    # Full-vocab logits: gather the TP shards, drop padding; then the full batch over DP.
    local_logits = logits.detach().float().contiguous()
    shards = [torch.empty_like(local_logits) for _ in range(tp)]
    dist.all_gather(shards, local_logits, group=ps.tp_group)
    logits_full = torch.cat(shards, dim=-1)[..., :vocab].contiguous()
    parts = [torch.empty_like(logits_full) for _ in range(ps.dp_size)]
    dist.all_gather(parts, logits_full, group=ps.dp_group)
    loss_mean = loss.detach().float().clone()
    dist.all_reduce(loss_mean, group=ps.dp_group)
    loss_mean /= ps.dp_size

    grads = {}
    for n, p in model.named_parameters():
        g = p.grad.float()
        dist.all_reduce(g, group=ps.dp_group)
        grads[n] = gather_full(g / ps.dp_size, infos[n], ps.tp_group, tp)
    if rank != 0:
        return None
    return dict(params=full_params, logits=torch.cat(parts), loss=loss_mean.item(), grads=grads,
                tokens=tokens, labels=labels, padded=cfg.padded_vocab_size(tp))


def _reference(out, vocab, dtype=torch.float32):
    """Single-process HF GPT-2 on the same weights and batch, in fp32 (or `dtype`; the loss in
    fp32 either way); logits and gradients returned in fp32."""
    from zo_megatron.checkpoint.hf.gpt2 import from_hf, to_hf

    hc = transformers.GPT2Config(vocab_size=vocab, n_positions=SEQ, n_embd=HIDDEN, n_layer=LAYERS,
                                 n_head=HEADS, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                 activation_function="gelu_new", layer_norm_epsilon=1e-5)
    hf = transformers.GPT2LMHeadModel(hc).float()
    hf.load_state_dict(to_hf(out["params"], LAYERS, HEADS), strict=True)
    hf.to(dtype)
    logits = hf(out["tokens"]).logits.float()
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), out["labels"].reshape(-1))
    loss.backward()
    hf_grads = {n: p.grad.float() for n, p in hf.named_parameters()}
    hf_grads["lm_head.weight"] = hf_grads["transformer.wte.weight"]
    return logits.detach(), loss.item(), from_hf(hf_grads, LAYERS, HEADS)


def _rel_err(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-30)).item()


def _rel_err_l2(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30)).item()


# bf16: logits and loss within BF16_TOL of the fp32 reference. Gradients, per tensor (L2):
# ||ours - ref|| / ||ref|| within BF16_TENSOR_TOL, or BF16_FACTOR x the error of HF GPT-2 run in bf16
# on the same draw, whichever is larger; and over the whole model, the RMS of those per-tensor
# errors within BF16_POOLED_FACTOR x the RMS of HF's. Why two bounds: the norm weights' and biases'
# gradients are sums over every token that nearly cancel, and at TP > 1 the row-parallel partial
# sums are rounded to bf16 before the all-reduce (as in Megatron-LM), so one tensor's error is a
# heavy-tailed draw, while the model-wide RMS is steady. Measured at TP 2 (Intel Xeon, AVX512_BF16 +
# AMX, torch 2.13.0+cpu, 200 seeds, 2026-12-02): the worst tensor 1.29-2.12% (p99 2.11%), up to 2.36x
# HF's error on that tensor; CI's seed 1920372539 drew 2.44% where HF's own was 0.67% (3.63x), which
# failed the old bound (3x HF, floor 2%). The RMS ratio: 0.98-1.32 (p99 1.29; that seed 1.26). So the
# per-tensor floor is 2x the worst draw seen and the pooled bound 1.5x; a wrong sharding, scale or
# missing term is 10% and more on its tensor, and a 3% error on every tensor is 3.7x HF's RMS
# (test_the_bf16_bounds_pass_hf_in_bf16_and_fail_a_wrong_gradient holds both).
BF16_TOL, BF16_TENSOR_TOL, BF16_FACTOR, BF16_POOLED_FACTOR = 2e-2, 5e-2, 3.0, 2.0


def _check_against_reference(out, vocab, tol, metric=_rel_err, bf16_floor=False):
    ref_logits, ref_loss, ref_grads = _reference(out, vocab)
    assert metric(out["logits"], ref_logits) <= tol
    assert abs(out["loss"] - ref_loss) / abs(ref_loss) <= tol
    assert set(out["grads"]) == set(ref_grads)
    hf16 = _reference(out, vocab, torch.bfloat16)[2] if bf16_floor else None
    ours_errors, hf_errors = [], []
    for name, g in out["grads"].items():
        assert g.shape == ref_grads[name].shape, name
        error = metric(g, ref_grads[name])
        if bf16_floor:
            hf_error = metric(hf16[name], ref_grads[name])
            ours_errors.append(error)
            hf_errors.append(hf_error)
            bound = max(BF16_TENSOR_TOL, BF16_FACTOR * hf_error)
        else:
            bound = tol
        assert error <= bound, (name, error, bound)
    if bf16_floor:
        rms = lambda xs: (sum(x * x for x in xs) / len(xs)) ** 0.5
        assert rms(ours_errors) <= BF16_POOLED_FACTOR * rms(hf_errors), \
            ("the gradients' RMS error", rms(ours_errors), rms(hf_errors))


@pytest.mark.parametrize("tp,world", [(1, 1), (2, 2), (4, 4), (2, 4)])
def test_tp_matches_single_process_fp32(tp, world):
    vocab = 997  # padded to a multiple of 128*TP: the last TP shard holds padding rows
    seed = fresh_seed(f"tp{tp} world{world} fp32 vs HF")
    out = run_world(_world, world, tp, "fp32", vocab, 128, seed, seed + 1)[0]
    assert out["padded"] % (128 * tp) == 0 and out["padded"] >= vocab
    _check_against_reference(out, vocab, tol=1e-5)


def test_tp2_matches_single_process_bf16():
    seed = fresh_seed("tp2 bf16 vs HF")
    out = run_world(_world, 2, 2, "bf16", 997, 128, seed, seed + 1)[0]
    # bf16 has an 8-bit mantissa: per-element error vs the fp32 reference is judged tensor-wide and
    # model-wide (the bounds above; the fp32 tests bound the max element error by 1e-5).
    _check_against_reference(out, 997, tol=BF16_TOL, metric=_rel_err_l2, bf16_floor=True)



def test_the_bf16_bounds_pass_hf_in_bf16_and_fail_a_wrong_gradient():
    """The bf16 bounds hide no wrong gradient: HF GPT-2 itself in bf16 passes; the same with one
    tensor's gradient scaled by 1.1 (a wrong scale), a zeroed bias, or every gradient 3% off (below
    the per-tensor floor, caught by the model-wide RMS) fails."""
    from zo_megatron.checkpoint.hf.gpt2 import from_hf

    seed = fresh_seed("bf16 floor power")
    torch.manual_seed(seed)
    vocab = 997
    hc = transformers.GPT2Config(vocab_size=vocab, n_positions=SEQ, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS)
    params = {n: t.clone() for n, t in from_hf(dict(transformers.GPT2LMHeadModel(hc).state_dict()),
                                                LAYERS, HEADS).items()}
    gen = torch.Generator().manual_seed(seed + 1)
    out = dict(params=params, tokens=torch.randint(0, vocab, (BATCH, SEQ), generator=gen),
               labels=torch.randint(0, vocab, (BATCH, SEQ), generator=gen))
    out["logits"], out["loss"], out["grads"] = _reference(out, vocab, torch.bfloat16)
    _check_against_reference(out, vocab, tol=BF16_TOL, metric=_rel_err_l2, bf16_floor=True)
    for name, wrong in (("gpt.decoder.layers.1.mlp.linear_fc1.weight", lambda g: g * 1.1),
                        ("gpt.decoder.layers.0.input_layernorm.bias", torch.zeros_like),
                        ("every tensor", lambda g: g * 1.03)):
        grads = out["grads"]
        bad_grads = ({n: wrong(g) for n, g in grads.items()} if name == "every tensor"
                     else {**grads, name: wrong(grads[name])})
        bad = {**out, "grads": bad_grads}
        with pytest.raises(AssertionError, match="RMS" if name == "every tensor" else name):
            _check_against_reference(bad, vocab, tol=BF16_TOL, metric=_rel_err_l2, bf16_floor=True)
            pytest.fail(f"{name} off passed")

def test_gpt2_vocab_padding_never_reaches_the_loss():
    """50257 is not a multiple of 128*2: 175 pad rows at TP=2 must not change the loss."""
    seed = fresh_seed("gpt2 vocab padding")
    out = run_world(_world, 2, 2, "fp32", 50257, 128, seed, seed + 1)[0]
    assert out["padded"] == 50432
    _check_against_reference(out, 50257, tol=1e-5)


def test_init_is_layout_independent():
    seed = fresh_seed("layout-independent init")
    full = {tp: run_world(_world, tp, tp, "fp32", 997, 128, seed, 0)[0]["params"] for tp in (1, 2, 4)}
    for tp in (2, 4):
        assert set(full[tp]) == set(full[1])
        for name, t in full[1].items():
            assert torch.equal(full[tp][name], t), (tp, name)


def _recompute_world(rank, seed):
    """One forward/backward per recompute setting from the same weights and batch: the loss and
    every gradient, and how many times each layer ran forward."""
    from zo_megatron.model import GPTConfig, build_gpt_model
    from zo_megatron.parallel import init_parallel

    ps = init_parallel(2, seed=seed, num_attention_heads=HEADS, hidden_size=HIDDEN)
    gen = torch.Generator().manual_seed(seed + 1)
    tokens = torch.randint(0, 300, (2, SEQ), generator=gen)
    labels = torch.randint(0, 300, (2, SEQ), generator=gen)
    out = {}
    for name, kw in (("none", {}), ("uniform1", dict(recompute="full")),
                     ("uniform2", dict(recompute="full", recompute_method="uniform", recompute_num_layers=2)),
                     ("block1", dict(recompute="full", recompute_method="block", recompute_num_layers=1)),
                     ("block3", dict(recompute="full", recompute_method="block", recompute_num_layers=3))):
        cfg = GPTConfig(num_layers=4, hidden_size=HIDDEN, num_attention_heads=HEADS, vocab_size=300,
                        max_position_embeddings=SEQ, precision="fp32", **kw)
        model = build_gpt_model(cfg, ps.tp_rank, ps.tp_size, seed)
        calls = [0] * 4
        for i, layer in enumerate(model.gpt.decoder.layers):
            layer.register_forward_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
        loss = model.loss(tokens, labels)
        loss.backward()
        out[name] = dict(loss=loss.item(), calls=calls,
                         grads={n: p.grad.clone() for n, p in model.named_parameters()})
    return out if rank == 0 else None


def test_full_recompute_methods_recompute_the_layers_they_say_and_change_nothing():
    """--recompute-method uniform N / block N (megatron-core's own): the same loss and gradients as
    no recompute, bit for bit; uniform runs every layer forward twice, block N only the first N."""
    from tests.seeds import fresh_seed

    out = run_world(_recompute_world, 2, fresh_seed("recompute methods"))[0]
    ref = out["none"]
    assert ref["calls"] == [1, 1, 1, 1]
    expected_calls = {"uniform1": [2, 2, 2, 2], "uniform2": [2, 2, 2, 2], "block1": [2, 1, 1, 1],
                      "block3": [2, 2, 2, 1]}
    for name, calls in expected_calls.items():
        got = out[name]
        assert got["calls"] == calls, (name, got["calls"])
        assert got["loss"] == ref["loss"], name
        for n, g in ref["grads"].items():
            assert torch.equal(got["grads"][n], g), (name, n)
