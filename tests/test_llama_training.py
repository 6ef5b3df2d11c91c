"""A Llama-shaped model (RoPE, RMSNorm, SwiGLU, GQA, untied, no biases) through the ZeRO-Offload
engine and DCP checkpoints.

- The engine at TP2 x DP2 trains as single-process torch AdamW on transformers' LlamaForCausalLM
  (weight decay on matrices only: the embedding and the untied output layer decay, RMSNorm weights
  do not; a clip that clips; gradient accumulation).
- A checkpoint saved at TP2 x DP2 loads at TP2 x DP2, TP1 x DP2 and TP4 x DP1 into the same full
  fp32 weights and Adam moments, bit for bit. The full tensors are assembled here from each rank's
  raw host buffers with the layout written out in this file (SwiGLU fc1 rank r = [gate_r; up_r]),
  not with zo_megatron's sharding code.
"""
import pytest
import torch

from tests.fp32_bounds import assert_fp32_weights_match
from tests.harness import run_world
from tests.seeds import fresh_seed
from tests.test_model_llama import hf_to_ours
from tests.training_loops import random_batches, train_engine_steps, train_with_torch_adamw

transformers = pytest.importorskip("transformers")

LAYERS, HIDDEN, HEADS, GROUPS, FFN, SEQ, VOCAB = 2, 96, 8, 4, 200, 12, 251
MICRO, ACCUM, STEPS = 2, 2, 4
WD, CLIP, BETAS, EPS = 0.1, 0.05, (0.9, 0.95), 1e-6
ARCH = dict(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, num_query_groups=GROUPS,
            ffn_hidden_size=FFN, vocab_size=VOCAB, max_position_embeddings=64, precision="fp32",
            position_embedding_type="rope", rotary_base=500000, normalization="RMSNorm", layernorm_epsilon=1e-5,
            swiglu=True, add_bias_linear=False, untie_embeddings_and_output_weights=True)


def _lr(step):
    return 2e-3 * (0.5 + 0.5 * step / STEPS)


def _batches(seed, dp):
    return random_batches(seed, STEPS, ACCUM, MICRO * dp, SEQ, VOCAB)


def _hf_llama(seed):
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN,
                                      num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                                      num_key_value_heads=GROUPS, max_position_embeddings=64, rms_norm_eps=1e-5,
                                      tie_word_embeddings=False,
                                      rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
    config._attn_implementation = "eager"
    model = transformers.LlamaForCausalLM(config).float()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.05 + (1.0 if "norm" in name else 0.0))
    return model


def _setup(tp, seed, init=None):
    from zo_megatron.model import GPTConfig, build_gpt_model
    from zo_megatron.model.sharding import load_full_params
    from zo_megatron.offload.engine import AdamConfig, ZeroOffloadEngine
    from zo_megatron.parallel import init_parallel

    ps = init_parallel(tp, seed=seed)
    cfg = GPTConfig(**ARCH)
    model = build_gpt_model(cfg, ps.tp_rank, ps.tp_size, seed)
    if init is not None:
        load_full_params(model, init, ps.tp_rank, ps.tp_size, VOCAB)
    adam = AdamConfig(lr=_lr(0), beta1=BETAS[0], beta2=BETAS[1], eps=EPS, weight_decay=WD)
    engine = ZeroOffloadEngine(model, precision="fp32", adam=adam, clip_grad=CLIP, bucket_size=5000,
                               dp_group=ps.dp_group, tp_rank=ps.tp_rank, device=ps.device)
    return ps, cfg, model, engine


def _train(ps, model, engine, seed, steps):
    return train_engine_steps(ps, model, engine, _batches(seed, ps.dp_size)[:steps], _lr)


# ------------------------------------------------------------------------- engine vs torch AdamW
def _engine_world(rank, tp, seed, init):
    from zo_megatron.model.sharding import gather_full_params

    ps, cfg, model, engine = _setup(tp, seed, init)
    losses, norms = _train(ps, model, engine, seed, STEPS)
    final = {n: t.clone() for n, t in gather_full_params(model, ps.tp_group, ps.tp_rank, ps.tp_size, VOCAB).items()}
    engine.close()
    return dict(losses=losses, norms=norms, final=final) if rank == 0 else None


def _torch_adamw(hf, seed, dtype):
    """Single-process torch AdamW on a copy of `hf` in `dtype`: (losses, grad norms, final weights
    in our names). Megatron's rule: no decay for 1-D parameters (RMSNorm weights), decay for every
    matrix (embedding, untied output layer included)."""
    import copy

    hf = copy.deepcopy(hf).to(dtype)
    losses, norms = train_with_torch_adamw(hf, _batches(seed, 2), lr=_lr, weight_decay=WD, clip=CLIP, betas=BETAS,
                                           eps=EPS, vocab=VOCAB)
    return losses, norms, hf_to_ours({n: p.detach() for n, p in hf.named_parameters()}, HEADS, GROUPS, tied=False)


def test_engine_tp2_dp2_matches_torch_adamw_on_transformers_llama():
    """Losses and grad norms within 1e-5, every weight within 1e-5 of its tensor's largest
    element (or 3x torch's own fp32 error on this draw: tests/fp32_bounds.py) of float64 torch."""
    seed = fresh_seed("llama engine TP2xDP2")
    hf = _hf_llama(seed)
    init = hf_to_ours({k: v.detach().clone() for k, v in hf.state_dict().items()}, HEADS, GROUPS, tied=False)
    out = run_world(_engine_world, 4, 2, seed, init, timeout=400)[0]
    losses, norms, ref = _torch_adamw(hf, seed, torch.float64)
    assert min(norms) > CLIP                               # the clip is exercised
    for step in range(STEPS):
        assert abs(out["losses"][step] - losses[step]) <= 1e-5 * abs(losses[step]), step
        assert abs(out["norms"][step] - norms[step]) <= 1e-5 * norms[step], step
    assert set(out["final"]) == set(ref)
    assert_fp32_weights_match(out["final"], ref, _torch_adamw(hf, seed, torch.float32)[2], max_rtol=1e-5)


# ---------------------------------------------------------------------------- DCP save / reshard
def _local_state(engine):
    """Each parameter's TP-local host state as {name: {what: (shape, [(start, flat values)])}}:
    this DP rank's fragments, read straight from the engine's host buffers."""
    out = {}
    for name, param, start, n, views in engine.host_state_views():
        entry = out.setdefault(name, {"shape": tuple(param.shape), "pieces": []})
        entry["pieces"].append((start, {k: v.detach().float().clone() for k, v in views.items()}))
    return out


def _save_world(rank, tmp, seed):
    from zo_megatron.checkpoint import save_checkpoint

    ps, cfg, model, engine = _setup(2, seed)
    _train(ps, model, engine, seed, 2)
    save_checkpoint(tmp, 2, ps=ps, model=model, optimizer=engine, vocab_size=VOCAB,
                    train_state=dict(consumed_samples=0, consumed_valid_samples=0, opt_param_scheduler=None),
                    model_meta=cfg.arch_meta(), args={})
    out = (ps.tp_rank, _local_state(engine))
    engine.close()
    return out


def _load_world(rank, tp, tmp, seed):
    from zo_megatron.checkpoint.load import LoadOptions, load_checkpoint

    ps, cfg, model, engine = _setup(tp, seed + 1)          # another init: the load must overwrite it all
    load_checkpoint(tmp, ps=ps, model=model, optimizer=engine, vocab_size=VOCAB, model_meta=cfg.arch_meta(),
                    schedule={}, opts=LoadOptions())
    out = (ps.tp_rank, _local_state(engine), {n: p.detach().clone() for n, p in model.named_parameters()},
           engine.step_count)
    engine.close()
    return out


def _tp_local(results):
    """{tp_rank: {name: {what: local tensor}}}: the DP fragments of each TP shard put together."""
    shards: dict = {}
    for tp_rank, state in (r[:2] for r in results):
        for name, entry in state.items():
            for start, views in entry["pieces"]:
                for what, v in views.items():
                    flat = shards.setdefault(tp_rank, {}).setdefault(name, {}).setdefault(
                        what, torch.full((torch.Size(entry["shape"]).numel(),), float("nan")))
                    flat[start:start + v.numel()] = v.reshape(-1)
    return {r: {n: {w: t.view(state_shape(results, n)) for w, t in d.items()} for n, d in per.items()}
            for r, per in shards.items()}


def state_shape(results, name):
    return results[0][1][name]["shape"]


def _assemble(local: dict, tp: int) -> dict:
    """Full unpadded tensors from TP-local shards, with Megatron's layout written out here."""
    full = {}
    for name in local[0]:
        parts = [local[r][name] for r in range(tp)]
        full[name] = {}
        for what in parts[0]:
            ts = [p[what] for p in parts]
            if name.endswith("mlp.linear_fc1.weight"):            # rank r: [gate_r; up_r]
                half = ts[0].shape[0] // 2
                t = torch.cat([x[:half] for x in ts] + [x[half:] for x in ts])
            elif name.endswith(("word_embeddings.weight", "output_layer.weight")):
                t = torch.cat(ts)[:VOCAB]                           # vocab padding rows dropped
            elif name.endswith("linear_qkv.weight"):
                t = torch.cat(ts)
            elif name.endswith(("linear_proj.weight", "linear_fc2.weight")):
                t = torch.cat(ts, dim=1)
            else:                                                   # replicated: every TP rank the same
                assert all(torch.equal(x, ts[0]) for x in ts), name
                t = ts[0]
            full[name][what] = t
    return full


def test_dcp_checkpoint_of_swiglu_gqa_untied_model_reshards_tp2_to_tp1_and_tp4(tmp_path):
    seed = fresh_seed("llama DCP reshard")
    ck = str(tmp_path / "ck")
    saved = run_world(_save_world, 4, ck, seed, timeout=400)
    truth = _assemble(_tp_local(saved), 2)
    assert not any(torch.isnan(t).any() for d in truth.values() for t in d.values())
    assert truth["gpt.decoder.layers.0.mlp.linear_fc1.weight"]["exp_avg"].abs().max() > 0
    for tp, world in ((2, 4), (1, 2), (4, 4)):
        loaded = run_world(_load_world, world, tp, ck, seed, timeout=400)
        assert all(r[3] == 2 for r in loaded)                                   # Adam's step count
        got = _assemble(_tp_local(loaded), tp)
        assert set(got) == set(truth), (tp, set(got) ^ set(truth))
        for name, d in truth.items():
            for what, t in d.items():
                assert torch.equal(got[name][what], t), (tp, name, what)
        # the model's own parameters hold the loaded master weights
        params = {r[0]: {n: {"master": p} for n, p in r[2].items()} for r in loaded}
        for name, d in _assemble(params, tp).items():
            assert torch.equal(d["master"], truth[name]["master"]), (tp, name)


@pytest.mark.slow
def test_job_trains_a_llama_shape_saves_at_tp2_and_resumes_at_tp1(tmp_path):
    """pretrain_gpt.py with a Megatron-LM Llama launch's architecture flags: trains at TP2 with
    --zero-offload, saves, resumes at TP1 x DP2 from the resharded checkpoint and goes on."""
    from tests.test_checkpoint_resume import TINY, _log, _world

    seed = str(fresh_seed("llama job"))
    llama = ["--position-embedding-type", "rope", "--rotary-base", "500000", "--normalization", "RMSNorm",
             "--norm-epsilon", "1e-5", "--swiglu", "--group-query-attention", "--num-query-groups", "2",
             "--untie-embeddings-and-output-weights", "--disable-bias-linear"]
    common = [*TINY, *llama, "--zero-offload", "--fp32", "--seed", seed, "--eval-iters", "0"]
    ck, log1, log2 = str(tmp_path / "ck"), str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")
    out = _world(2, [[*common, "--tensor-parallel", "2", "--train-iters", "2", "--save", ck, "--log-jsonl", log1],
                     [*common, "--tensor-parallel", "1", "--train-iters", "3", "--load", ck, "--log-jsonl", log2]],
                 tmp_path)
    for r in out:
        assert r.get("rc") == 0, r
    assert "RoPE(base 500000)+RMSNorm+SwiGLU+GQA(2 groups)+untied+no-bias" in out[0]["stdout"]
    assert [r["iteration"] for r in _log(log1)] == [1, 2] and [r["iteration"] for r in _log(log2)] == [3]
    import math

    assert all(math.isfinite(r["loss"]) for r in _log(log1) + _log(log2))
