"""The memory planner and the TFLOP/s count on multi-latent attention (MLA: DeepSeek-V2/V3, megatron-core's
MLASelfAttention as zo_megatron/model/mla.py builds it).

- Parameters: the planner's list (names, registration order, sizes, which are split over TP) is the built
  model's on every rank at TP 1 and TP 2 (a q latent with RMSNorm latent norms; queries projected directly
  without norms; LayerNorm latent norms with linear_proj's bias, learned positions and tied embeddings), its
  per-rank count the rank's parameters, its total GPTConfig.num_parameters() (which tests/test_mla.py
  checks against transformers' DeepseekV3); DeepSeek-V3's whole shape gives its public 671B total and 37B
  active parameters. What one MLA layer keeps for backward and the activation peak are measured in
  tests/test_planner_validation.py (the -mla cases).
- TFLOP/s: Megatron-LM's MLA branch of num_floating_point_operations (core_v0.16.1, transcribed below)
  for random shapes, and FlopCounterMode on the built model: every projection GEMM of a forward, and of a
  backward (twice the forward), counted by torch; the causal core against torch's count of SDPA's math
  path on the same head dims (Megatron counts half of each s x s product).
- The tools and the job: the MLA flags reach the planner through the job's parser (estimate_memory.py, the
  pre-launch check's input, find_max_model.py's job flags), the plan names MLA, refusals are one line.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import pytest
import torch

from tests.harness import run_world
from tests.seeds import fresh_seed
from zo_megatron import planner as P

REPO = Path(__file__).resolve().parents[1]
VOCAB, SEQ, MICRO = 256, 16, 2          # VOCAB a multiple of 128 x 2: padded = unpadded at TP 1 and 2
_MLA = dict(multi_latent_attention=True, attention_backend="sdpa", kv_lora_rank=16, qk_head_dim=12,
            qk_pos_emb_head_dim=8, v_head_dim=10)
_DEEPSEEK = dict(position_embedding_type="rope", normalization="RMSNorm", swiglu=True, add_bias_linear=False,
                 untie_embeddings_and_output_weights=True)
CONFIGS = {
    # DeepSeek-V3's attention: a q latent, latent norms (RMSNorm), YaRN
    "q_latent": dict(_DEEPSEEK, **_MLA, num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=96,
                     q_lora_rank=24, qk_layernorm=True),
    # DeepSeek-V2-Lite's: queries projected directly; here without latent norms, plain rope
    "q_direct": dict(_DEEPSEEK, **_MLA, num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=96,
                     q_lora_rank=None, rope_type="rope"),
    # GPT-2's rest (learned positions, LayerNorm: latent norms with biases, linear_proj's bias, GELU, tied)
    "gpt2": dict(**_MLA, num_layers=2, hidden_size=64, num_attention_heads=4, q_lora_rank=16, qk_layernorm=True),
}
# DeepSeek-V3 (its Hugging Face config.json): 61 layers, the first 3 dense, 256 routed experts (top 8) and one
# shared expert of 2048, MLA with latents 1536 / 512, heads 128+64 / 128; no multi-token prediction module
DEEPSEEK_V3 = dict(_DEEPSEEK, num_layers=61, hidden_size=7168, num_attention_heads=128, ffn_hidden_size=18432,
                   vocab_size=129280, qk_layernorm=True, multi_latent_attention=True, attention_backend="sdpa",
                   q_lora_rank=1536, kv_lora_rank=512, qk_head_dim=128, qk_pos_emb_head_dim=64, v_head_dim=128,
                   num_experts=256, moe_router_topk=8, moe_ffn_hidden_size=2048,
                   moe_shared_expert_intermediate_size=2048, moe_layer_freq=[0] * 3 + [1] * 58)


def _plan_fields(cfg: dict) -> dict:
    return {k: v for k, v in cfg.items() if k in P.PlanInput.__dataclass_fields__}


# ------------------------------------------------------------------------------------------------
# parameters

def _built(rank, tp, names):
    """Each config's parameters on this rank (name, numel, TP-split) and GPTConfig.num_parameters()."""
    from zo_megatron.model import GPTConfig, build_gpt_model
    from zo_megatron.parallel import init_parallel

    ps = init_parallel(tp, seed=1)
    out = {}
    for name in names:
        cfg = GPTConfig(**CONFIGS[name], vocab_size=VOCAB, max_position_embeddings=SEQ)
        model = build_gpt_model(cfg, ps.tp_rank, ps.tp_size, seed=1)
        out[name] = dict(rows=[(n.removeprefix("gpt."), p.numel(), bool(getattr(p, "tensor_model_parallel", False)))
                               for n, p in model.named_parameters()], num_parameters=cfg.num_parameters())
    return out


@pytest.fixture(scope="module")
def built():
    return {tp: run_world(_built, tp, tp, list(CONFIGS), timeout=240) for tp in (1, 2)}


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_parameters_per_rank_are_the_built_models(built, name, tp):
    """Names, registration order, local sizes and the TP split of every parameter on every rank (the kv down
    projection replicated, q_down / q_up / kv_up / linear_proj split); the per-rank count and the total."""
    inp = P.PlanInput(**_plan_fields(CONFIGS[name]), vocab_size=VOCAB, seq_length=SEQ, tensor_parallel=tp)
    rows = P.model_parameters(inp.num_layers, inp.hidden_size, inp.ffn(), inp.num_attention_heads, VOCAB, SEQ,
                              inp.arch())
    local = [(n, k // tp if split else k, split) for n, k, split in rows]
    counts = P.count_params(inp.num_layers, inp.hidden_size, VOCAB, SEQ, tp, inp.ffn(),
                            num_attention_heads=inp.num_attention_heads, arch=inp.arch())
    for got in built[tp]:
        assert local == got[name]["rows"]
        assert counts["per_tp_rank"] == sum(n for _, n, _ in got[name]["rows"])
        assert counts["total"] == got[name]["num_parameters"]
    p = P.plan(inp)
    assert (p.params_total, p.params_per_tp_rank) == (counts["total"], counts["per_tp_rank"])
    # replicated on every TP rank: the norms (latent norms included), the kv down projection, linear_proj's
    # bias and the position table
    assert tp * counts["per_tp_rank"] == counts["total"] + (tp - 1) * counts["replicated_per_tp_rank"]
    kv_down = next(k for n, k, _ in rows if n.endswith("0.self_attention.linear_kv_down_proj.weight"))
    assert kv_down == (inp.kv_lora_rank + inp.qk_pos_emb_head_dim) * inp.hidden_size


def test_deepseek_v3_counts_its_public_671b_and_37b_active():
    from zo_megatron.model import GPTConfig

    # (at TP 1 the vocabulary is not padded: 129280 is a multiple of 128)
    p = P.plan(P.PlanInput(**_plan_fields(DEEPSEEK_V3), seq_length=4096, expert_parallel=8, data_parallel=8))
    assert p.params_total == GPTConfig(**DEEPSEEK_V3, max_position_embeddings=4096).num_parameters() == 671_026_404_352
    assert 37.0e9 < p.params_active < 37.6e9                                            # "37B activated"
    assert "MLA: q latent 1536, kv latent 512, qk head 128+64, v head 128, yarn, latent norms" in \
        p.input.architecture_name() and p.input.architecture_name().startswith("DeepSeek-family")


def test_mla_plan_differs_from_the_standard_attention_it_was_planned_as():
    """The shape without its MLA fields is planned as standard attention: other parameters, other bytes."""
    inp = P.PlanInput(**_plan_fields(CONFIGS["q_latent"]), vocab_size=VOCAB, seq_length=128, micro_batch_size=2,
                      device_is_host=True)
    plain = inp.replace(multi_latent_attention=False, qk_layernorm=False)
    a, b = P.plan(inp), P.plan(plain)
    assert a.params_total != b.params_total
    assert a.device_items["activations_layers"] != b.device_items["activations_layers"]


def test_mla_refusals():
    base = P.PlanInput(**_plan_fields(CONFIGS["q_latent"]), vocab_size=VOCAB, seq_length=SEQ)
    for changes, message in ((dict(tensor_parallel=4, q_lora_rank=6, num_attention_heads=4), "q_lora_rank 6"),
                             (dict(num_query_groups=2), "MLA's keys and values come from one latent"),
                             (dict(tensor_parallel=4, qk_pos_emb_head_dim=6),
                              "= 22 is not divisible by tensor_parallel 4"),
                             (dict(attention_backend="local"), "runs on torch SDPA"),
                             (dict(rope_type="ntk"), "rope_type")):
        with pytest.raises(ValueError, match=message):
            P.plan(base.replace(**changes))


# ------------------------------------------------------------------------------------------------
# activations: the layer's parts (what is measured is in tests/test_planner_validation.py)

def test_layer_parts_as_modelled():
    """Each MLA part moves one layer's bytes by what it keeps: the q latent (whole on every rank; with
    sequence parallelism this rank's tokens), the kv latent with its rotary key part, the query/key/value per head, the value
    heads padded to the q/k head dim for torch's CPU flash kernel."""
    from zo_megatron.planner.layer_activations import _layer_saved

    s, b, w = 128, 2, 2
    gpu = P.PlanInput(**_plan_fields(dict(CONFIGS["q_direct"], qk_head_dim=16)), vocab_size=VOCAB, seq_length=s,
                      micro_batch_size=b, dropout=False)            # q/k head 16+8 = 24, v head 10
    rep, split, scores = _layer_saved(gpu)
    n, qk, v, r_kv, r_q = 4, 24, 10, 16, 24
    latent = gpu.replace(q_lora_rank=r_q)
    assert _layer_saved(latent)[0] - rep == w * s * b * r_q                 # the gathered q latent
    tp2 = latent.replace(tensor_parallel=2)
    sp = tp2.replace(sequence_parallel=True)
    # sequence parallelism splits both latents over TP (model/mla.py copies the q latent's slice), not the
    # rope tables
    assert _layer_saved(tp2)[0] - _layer_saved(sp)[0] == (_layer_saved(tp2)[0] - 4 * w * s * 8) // 2
    # per head: q, k (24 each), v (10), linear_proj's input (10); 4 bytes of logsumexp
    assert split == s * b * (w * n * (2 * qk + v) + w * n * v + w * (5 * 96)) and scores == 4 * n * s * b
    cpu = gpu.replace(device_is_host=True)                          # v padded to 24, SDPA's output too
    assert _layer_saved(cpu)[1] - split == s * b * w * n * ((qk - v) + qk)
    # the kv latent: kv_lora_rank + qk_pos_emb_head_dim kept whole without its norm, and both rope tables
    assert rep == 2 * (8 * s * b * 64 + 4 * s * b) + 2 * w * s * b * 64 + w * s * b * (r_kv + 8) + 4 * w * s * 8


# ------------------------------------------------------------------------------------------------
# TFLOP/s

def megatron_mla_flops_per_token(*, num_layers, hidden_size, seq_length, ffn_hidden_size, padded_vocab_size,
                                 num_attention_heads, q_lora_rank, kv_lora_rank, qk_head_dim, qk_pos_emb_head_dim,
                                 v_head_dim, swiglu=False, moe_layers=None, moe_ffn_hidden_size=None,
                                 moe_router_topk=2, moe_shared_expert_intermediate_size=None):
    """Megatron-LM's `num_floating_point_operations(args, batch_size)` (megatron/training/training.py at
    core_v0.16.1, transformer_flops with args.multi_latent_attention: no MTP, no linear attention) divided
    by batch_size x seq_length. Transcribed, names as there."""
    batch_size = 1
    if moe_layers is None:
        num_dense_layers, num_moe_layers, num_experts_routed_to = num_layers, 0, 0
    else:
        num_moe_layers = sum(moe_layers)
        num_dense_layers = num_layers - num_moe_layers
        num_experts_routed_to = moe_router_topk
    mtp_num_layers = 0
    moe_ffn_hidden_size = moe_ffn_hidden_size if moe_ffn_hidden_size is not None else ffn_hidden_size
    shared_expert_ffn_hidden_size = 0 if moe_shared_expert_intermediate_size is None \
        else moe_shared_expert_intermediate_size
    forward_backward_expansion_factor = 3
    fma_expansion_factor = 2
    ffn_expansion_factor = 3 if swiglu else 2
    if q_lora_rank is None:
        q_term = hidden_size * num_attention_heads * (qk_head_dim + qk_pos_emb_head_dim)
    else:
        q_term = q_lora_rank * (hidden_size + num_attention_heads * (qk_head_dim + qk_pos_emb_head_dim) + 1)
    standard_self_attn_term = (
        forward_backward_expansion_factor
        * fma_expansion_factor
        * (
            q_term
            + kv_lora_rank * (hidden_size + num_attention_heads * (qk_head_dim + v_head_dim) + 1)
            + hidden_size * qk_pos_emb_head_dim
            + (num_attention_heads * v_head_dim) * hidden_size
            + seq_length * (num_attention_heads * (qk_head_dim + qk_pos_emb_head_dim)) / 2
            + seq_length * num_attention_heads * v_head_dim / 2
        )
    )
    self_attn_term = standard_self_attn_term * num_layers
    total = (
        batch_size * seq_length * (
            forward_backward_expansion_factor * fma_expansion_factor * hidden_size * (
                (ffn_hidden_size * ffn_expansion_factor) * num_dense_layers
                + (moe_ffn_hidden_size * num_experts_routed_to * ffn_expansion_factor) * num_moe_layers
                + (shared_expert_ffn_hidden_size * ffn_expansion_factor) * num_moe_layers
            )
            + self_attn_term
            + forward_backward_expansion_factor * fma_expansion_factor * hidden_size * padded_vocab_size
            * (mtp_num_layers + 1)
        )
    )
    return total / (batch_size * seq_length)


def test_flops_per_token_is_megatrons_mla_count():
    """Random MLA shapes (a q latent or none, SwiGLU or GELU, dense or MoE layers) against the transcription."""
    from zo_megatron.training.metrics import flops_per_token

    rng = random.Random(fresh_seed("mla flops"))
    for _ in range(100):
        heads, h = rng.choice([1, 2, 4, 16, 128]), rng.choice([64, 512, 2048, 7168])
        mla = dict(q_lora_rank=rng.choice([None, 24, 1536]), kv_lora_rank=rng.choice([16, 512]),
                   qk_head_dim=rng.choice([8, 128]), qk_pos_emb_head_dim=rng.choice([4, 64]),
                   v_head_dim=rng.choice([10, 128]))
        L, s, V, f = rng.randint(1, 61), rng.choice([16, 4096, 4097]), rng.randint(1000, 130000), rng.randint(1, 20000)
        swiglu = rng.random() < 0.7
        moe = {}
        if rng.random() < 0.4:
            moe = dict(moe_layers=[rng.random() < 0.8 for _ in range(L)], moe_ffn_hidden_size=rng.randint(1, 4096),
                       moe_router_topk=rng.randint(1, 8),
                       moe_shared_expert_intermediate_size=rng.choice([None, rng.randint(1, 4096)]))
        want = megatron_mla_flops_per_token(num_layers=L, hidden_size=h, seq_length=s, ffn_hidden_size=f,
                                            padded_vocab_size=V, num_attention_heads=heads, swiglu=swiglu, **mla,
                                            **moe)
        got = flops_per_token(L, h, s, V, None, f, num_attention_heads=heads, swiglu=swiglu,
                              multi_latent_attention=True, **mla, **moe)
        assert isinstance(got, int) and got == pytest.approx(want, rel=1e-12), (L, h, s, V, f, heads, mla, moe)
        # the attention core once more per layer with selective recompute of core_attn
        d_qk = mla["qk_head_dim"] + mla["qk_pos_emb_head_dim"]
        again = flops_per_token(L, h, s, V, "selective", f, num_attention_heads=heads, swiglu=swiglu,
                                multi_latent_attention=True, recompute_modules=("core_attn",), **mla, **moe)
        assert again - got == L * s * heads * (d_qk + mla["v_head_dim"])


def _counted(rank, name, seq, recompute_modules=None):
    """FlopCounterMode on one forward and one forward + backward of the built model (TP 1, fp32): torch's
    count of every GEMM (its CPU flash attention kernel is not in torch's registry: counted apart)."""
    from torch.utils.flop_counter import FlopCounterMode

    from zo_megatron.model import GPTConfig, build_gpt_model
    from zo_megatron.parallel import init_parallel

    ps = init_parallel(1, seed=1)
    recompute = dict(recompute="selective", recompute_modules=recompute_modules) if recompute_modules else {}
    cfg = GPTConfig(**CONFIGS[name], vocab_size=VOCAB, max_position_embeddings=seq, **recompute)
    model = build_gpt_model(cfg, ps.tp_rank, ps.tp_size, seed=1)
    tokens = torch.randint(0, VOCAB, (MICRO, seq))
    with FlopCounterMode(display=False) as fwd:
        logits = model(tokens)
    with FlopCounterMode(display=False) as both:
        model(tokens).float().square().mean().backward()
    kernels = {str(op) for counts in fwd.get_flop_counts().values() for op in counts}
    return fwd.get_total_flops(), both.get_total_flops(), tuple(logits.shape), sorted(kernels)


@pytest.mark.parametrize("name", ["q_latent", "q_direct"])
def test_flops_per_token_against_torchs_flop_counter(name):
    """The projections (q down/up or q, kv down/up, linear_proj), the MLP and the LM head of a forward, as
    torch's FlopCounterMode counts the built model's GEMMs, are Megatron's count less its attention core and
    its latent-norm terms (2 FLOPs per latent channel: Megatron's "+ 1" per latent rank); the backward's GEMMs
    are twice the forward's. The core: torch's count of SDPA's math path on [b, n, s, d_qk] queries and keys
    and [b, n, s, d_v] values, of which Megatron's causal count is half."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from zo_megatron.training.metrics import flops_per_token

    cfg = dict(CONFIGS[name])
    fwd, both, shape, kernels = run_world(_counted, 1, name, SEQ, timeout=240)[0]
    assert shape[-1] == VOCAB and "aten.mm" in kernels
    tokens = MICRO * SEQ
    n, h, d_qk, d_v = cfg["num_attention_heads"], cfg["hidden_size"], 12 + 8, 10
    latents = (cfg["q_lora_rank"] or 0) + cfg["kv_lora_rank"]
    per_token = flops_per_token(cfg["num_layers"], h, SEQ, VOCAB, None, cfg["ffn_hidden_size"], num_attention_heads=n,
                                swiglu=True, multi_latent_attention=True,
                                **{k: cfg[k] for k in ("q_lora_rank", "kv_lora_rank", "qk_head_dim",
                                                       "qk_pos_emb_head_dim", "v_head_dim")})
    core = SEQ * n * (d_qk + d_v)                                         # Megatron's, per token and layer
    assert per_token * tokens == 3 * (fwd + tokens * cfg["num_layers"] * (core + 2 * latents))
    assert both == 3 * fwd
    # --recompute-modules mla_up_proj: torch counts the up projections' GEMMs once more in the backward
    _, both_up, _, _ = run_world(_counted, 1, name, SEQ, ("mla_up_proj",), timeout=240)[0]
    up = flops_per_token(cfg["num_layers"], h, SEQ, VOCAB, "selective", cfg["ffn_hidden_size"], num_attention_heads=n,
                         swiglu=True, multi_latent_attention=True, recompute_modules=("mla_up_proj",),
                         **{k: cfg[k] for k in ("q_lora_rank", "kv_lora_rank", "qk_head_dim",
                                                "qk_pos_emb_head_dim", "v_head_dim")})
    assert both_up > both and (up - per_token) * tokens == both_up - both, (up - per_token, both_up - both)
    q, k, v = torch.zeros(MICRO, n, SEQ, d_qk), torch.zeros(MICRO, n, SEQ, d_qk), torch.zeros(MICRO, n, SEQ, d_v)
    with sdpa_kernel([SDPBackend.MATH]), FlopCounterMode(display=False) as attention:
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert attention.get_total_flops() == 2 * tokens * core


def test_the_jobs_flops_read_the_mla_fields():
    """training/metrics.model_flops_per_token (what the job's TFLOP/s and MFU divide by) of an MLA GPTConfig."""
    from zo_megatron.model import GPTConfig
    from zo_megatron.training.metrics import flops_per_token, model_flops_per_token

    for name, cfg in CONFIGS.items():
        conf = GPTConfig(**cfg, vocab_size=VOCAB, max_position_embeddings=SEQ)
        mla = {k: getattr(conf, k) for k in ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim",
                                             "v_head_dim")}
        want = flops_per_token(conf.num_layers, conf.hidden_size, SEQ, VOCAB, None, conf.ffn_size,
                               num_attention_heads=conf.num_attention_heads, swiglu=conf.swiglu,
                               multi_latent_attention=True, **mla)
        assert model_flops_per_token(conf, SEQ, VOCAB, None) == want, name
        plain = flops_per_token(conf.num_layers, conf.hidden_size, SEQ, VOCAB, None, conf.ffn_size,
                                num_attention_heads=conf.num_attention_heads, swiglu=conf.swiglu)
        assert want != plain, name


# ------------------------------------------------------------------------------------------------
# the tools and the job

V3_SMALL = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "8", "--ffn-hidden-size", "512",
            "--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
            "--untie-embeddings-and-output-weights", "--disable-bias-linear", "--vocab-size", "1024",
            "--multi-latent-attention", "--q-lora-rank", "96", "--kv-lora-rank", "64", "--qk-head-dim", "32",
            "--qk-pos-emb-head-dim", "16", "--v-head-dim", "32", "--qk-layernorm", "--seq-length", "512"]


def _cli(*args):
    from tests.cli import run_tool

    return run_tool("estimate_memory", *args)


def test_estimate_memory_plans_mla_from_the_jobs_flags():
    from zo_megatron.model import GPTConfig

    r = _cli(*V3_SMALL, "--tensor-model-parallel-size", "2", "--sequence-parallel", "--world-size", "2", "--json")
    assert r.returncode in (0, 1), r.stderr
    d = json.loads(r.stdout)
    i = d["input"]
    fields = ("multi_latent_attention", "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim",
              "v_head_dim", "qk_layernorm", "attention_backend")
    assert tuple(i[k] for k in fields) == (True, 96, 64, 32, 16, 32, True, "sdpa")
    cfg = GPTConfig(num_layers=4, hidden_size=256, num_attention_heads=8, ffn_hidden_size=512, swiglu=True,
                    normalization="RMSNorm", position_embedding_type="rope", untie_embeddings_and_output_weights=True,
                    add_bias_linear=False, vocab_size=1024, multi_latent_attention=True, q_lora_rank=96,
                    kv_lora_rank=64, qk_head_dim=32, qk_pos_emb_head_dim=16, v_head_dim=32, qk_layernorm=True,
                    attention_backend="sdpa", max_position_embeddings=512)
    assert d["params_total"] == cfg.num_parameters()
    assert d["architecture"].startswith("DeepSeek-family (RMSNorm, SwiGLU, MLA: q latent 96, kv latent 64")
    text = _cli(*V3_SMALL).stdout
    assert "q/k head dim 32+16, v head dim 32" in text and "torch SDPA (multi-latent attention" in text


def test_the_jobs_prelaunch_input_is_mla():
    """pretrain_gpt.py's own argument path (parse_args, the job's checks, prelaunch.job_plan_input)."""
    from zo_megatron.training.arguments import check_batch_sizes, parse_args
    from zo_megatron.training.prelaunch import job_plan_input

    args = parse_args([*V3_SMALL, "--train-iters", "1", "--lr", "1e-4", "--rope-type", "rope"])
    check_batch_sizes(args, 1)
    inp = job_plan_input(args, argparse.Namespace(local_world_size=1), 1, 1024)
    assert inp.multi_latent_attention and (inp.q_lora_rank, inp.kv_lora_rank, inp.rope_type) == (96, 64, "rope")
    assert inp.attention_backend == "sdpa" and inp.qk_dim() == 48 and inp.v_dim() == 32


@pytest.mark.parametrize("args, message", [
    (["--kv-lora-rank", "64"], "configures multi-latent attention: add --multi-latent-attention"),
    ([*V3_SMALL, "--attention-backend", "local"], "--attention-backend local with --multi-latent-attention"),
    ([*V3_SMALL, "--group-query-attention", "--num-query-groups", "2"], "MLA's keys and values come from one latent"),
    (["--recompute-granularity", "selective", "--recompute-modules", "mla_up_proj"],
     "recomputes multi-latent attention's up projections: the model has none"),
])
def test_estimate_memory_refuses_in_one_line(args, message):
    r = _cli(*args)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and message in lines[0], r.stderr


def test_find_max_model_passes_mla_to_the_job_and_the_plan():
    sys.path.insert(0, str(REPO / "tools"))
    import find_max_model as fmm

    argv = ["--family", "llama", "--num-attention-heads", "8", "--hidden-size", "256", "--multi-latent-attention",
            "--q-lora-rank", "96", "--kv-lora-rank", "64", "--qk-head-dim", "32", "--qk-pos-emb-head-dim", "16",
            "--v-head-dim", "32", "--qk-layernorm", "--skip-run", "--seq-length", "256"]
    a = fmm.build_parser().parse_args(argv)
    a.precision = "bf16"
    rule = fmm.Rule(a)
    flags = rule.job_flags(3)
    assert "--group-query-attention" not in flags and "--multi-latent-attention" in flags
    assert flags[flags.index("--q-lora-rank") + 1] == "96" and "--qk-layernorm" in flags
    planner = fmm.JobPlanner(rule, 16 * P.GiB, 1)
    i = planner.plan(3).input
    assert (i.multi_latent_attention, i.q_lora_rank, i.kv_lora_rank, i.qk_layernorm, i.num_layers) == \
        (True, 96, 64, True, 3)
    k = planner.largest(10_000)
    assert k >= 1 and not planner.plan(k + 1).fits
    from tests.cli import run_tool

    r = run_tool("find_max_model", *argv, "--deepspeed", "--host-memory", "8GiB")
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "DeepSpeed's side builds" in lines[0], r.stderr


def test_the_jobs_banner_names_mla():
    """The banner's model line (GPTConfig.architecture_name) and attention line (user_report.attention_line:
    on a CPU the value heads are padded to the q/k head dim, so torch's flash kernel runs)."""
    from types import SimpleNamespace

    from zo_megatron.model import GPTConfig
    from zo_megatron.training.user_report import attention_line

    cfg = GPTConfig(**CONFIGS["q_latent"], vocab_size=VOCAB, max_position_embeddings=SEQ)
    assert cfg.architecture_name().startswith("MLA(q latent 24, kv latent 16, qk 12+8, v 10, latent norms, YaRN x")
    direct = GPTConfig(**CONFIGS["q_direct"], vocab_size=VOCAB, max_position_embeddings=SEQ)
    assert direct.architecture_name().startswith("MLA(queries direct, kv latent 16, qk 12+8, v 10, RoPE base ")
    assert "flash attention kernel (cpu)" in attention_line(cfg, SimpleNamespace(tp_size=1, device=torch.device("cpu")))
