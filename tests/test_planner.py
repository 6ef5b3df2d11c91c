"""The memory planner: parameter counts, the memory model's formulas, the paper's reference
points, our maxima, and the CLI (tools/estimate_memory.py)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from zo_megatron import planner as P
from zo_megatron.planner import GiB, PlanInput, count_params, max_model, pad_vocab_size, plan

REPO = Path(__file__).resolve().parents[1]
CLI = REPO / "tools" / "estimate_memory.py"


# ------------------------------------------------------------------------------------------------
# parameter counts

def _megatron_layout(L, h, V, S):
    """(name, numel, split_over_tp) for every parameter of the GPT, from the layer list."""
    rows = [("embedding.word_embeddings.weight", V * h, True),
            ("embedding.position_embeddings.weight", S * h, False)]
    for i in range(L):
        p = f"decoder.layers.{i}."
        rows += [(p + "input_layernorm.weight", h, False), (p + "input_layernorm.bias", h, False),
                 (p + "self_attention.linear_qkv.weight", 3 * h * h, True),
                 (p + "self_attention.linear_qkv.bias", 3 * h, True),
                 (p + "self_attention.linear_proj.weight", h * h, True),
                 (p + "self_attention.linear_proj.bias", h, False),
                 (p + "pre_mlp_layernorm.weight", h, False), (p + "pre_mlp_layernorm.bias", h, False),
                 (p + "mlp.linear_fc1.weight", 4 * h * h, True), (p + "mlp.linear_fc1.bias", 4 * h, True),
                 (p + "mlp.linear_fc2.weight", 4 * h * h, True), (p + "mlp.linear_fc2.bias", h, False)]
    rows += [("decoder.final_layernorm.weight", h, False), ("decoder.final_layernorm.bias", h, False)]
    return rows


@pytest.mark.parametrize("L, h, V, S, t", [(2, 64, 50304, 128, 1), (3, 256, 51200, 1024, 4),
                                           (65, 4096, 50304, 1024, 1), (69, 9216, 51200, 1024, 16)])
def test_param_count_matches_layer_list(L, h, V, S, t):
    rows = _megatron_layout(L, h, V, S)
    total = sum(n for _, n, _ in rows)
    per_rank = sum(n // t if split else n for _, n, split in rows)
    replicated = sum(n for _, n, split in rows if not split)
    c = count_params(L, h, V, S, t)
    assert c["total"] == total == V * h + S * h + L * (12 * h * h + 13 * h) + 2 * h
    assert c["per_tp_rank"] == per_rank
    assert c["replicated_per_tp_rank"] == replicated
    # the TP ranks together hold the model once plus (t-1) extra copies of the replicated params
    assert t * c["per_tp_rank"] == c["total"] + (t - 1) * c["replicated_per_tp_rank"]


@pytest.mark.parametrize("t", [1, 2, 4, 8])
def test_plan_psi_sums_over_tp_ranks(t):
    p = plan(PlanInput(num_layers=3, hidden_size=256, num_attention_heads=8, tensor_parallel=t,
                       max_position_embeddings=512, seq_length=256))
    assert p.vocab_size_padded == pad_vocab_size(50257, t, 128) and p.vocab_size_padded % (128 * t) == 0
    assert t * p.params_per_tp_rank == p.params_total + (t - 1) * p.replicated_params_per_tp_rank
    assert p.params_per_tp_rank_padded >= p.params_per_tp_rank


def test_vocab_padding():
    assert pad_vocab_size(50257, 1, 128) == 50304
    assert pad_vocab_size(50257, 2, 128) == 50432
    assert pad_vocab_size(50257, 16, 128) == 51200
    assert pad_vocab_size(50257, 1, 1) == 50257


def test_param_count_matches_huggingface_gpt2():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=50257, n_positions=128)
    model = transformers.GPT2LMHeadModel(cfg)
    hf_total = sum(p.numel() for p in model.parameters())  # tied lm_head counted once
    unpadded = plan(PlanInput(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=128,
                              make_vocab_size_divisible_by=1))
    assert unpadded.params_total == hf_total
    padded = plan(PlanInput(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=128))
    assert padded.params_total - hf_total == (50304 - 50257) * 64  # the pad rows only


# ------------------------------------------------------------------------------------------------
# the memory model's formulas

def test_activation_formula_korthikanti():
    s, b, h, a, L = 1024, 2, 1024, 16, 4
    for t in (1, 2, 4):
        p = plan(PlanInput(num_layers=L, hidden_size=h, num_attention_heads=a, seq_length=s,
                           micro_batch_size=b, tensor_parallel=t, precision="bf16"))
        expected = L * s * b * h * (10 + 24 / t + 5 * a * s / (h * t))
        assert p.device_items["activations_layers"] == pytest.approx(expected, rel=1e-12)
        if t == 1:
            assert p.device_items["activations_layers"] == L * s * b * h * (34 + 5 * a * s / h)
    full = plan(PlanInput(num_layers=L, hidden_size=h, num_attention_heads=a, seq_length=s,
                          micro_batch_size=b, recompute="full"))
    assert full.device_items["activations_layer_inputs"] == L * 2 * s * b * h
    assert full.device_items["activations_recompute_working_set"] == s * b * h * (34 + 5 * a * s / h)
    V = full.vocab_size_padded
    assert full.device_items["logits_16bit"] == 2 * s * b * V
    assert full.device_items["logits_fp32_cross_entropy"] == 4 * s * b * V
    assert full.device_bytes_per_gpu < plan(full.input.replace(recompute=False)).device_bytes_per_gpu
    sel = plan(full.input.replace(recompute="selective"))
    # (+ 4 bytes a layer: the int32 mask type megatron-core passes through the core attention's checkpoint)
    assert sel.device_items["activations_layers"] == L * s * b * h * 34 + 4 * L


def test_zero_offload_line_items():
    base = PlanInput(num_layers=4, hidden_size=512, num_attention_heads=8, data_parallel=4,
                     tensor_parallel=2, bucket_size=1_000_000, precision="bf16")
    p = plan(base)
    psi, N = p.params_per_tp_rank_padded, 4
    assert psi % (N * base.partition_alignment) == 0 and psi - p.params_per_tp_rank < N * 128
    assert p.device_items["params_16bit"] == 2 * psi
    # bf16 reduces gradients in fp32 by default (Megatron's rule); the host copy stays 16-bit
    assert p.device_items["grad_buckets_x2"] == 2 * 4 * 1_000_000
    assert p.device_items["reduce_scatter_scratch"] == 4 * 1_000_000
    # two 16-bit scratch shards (a bucket / N each) where the GPU narrows fp32 shards for the copy home
    _, max_bucket = P._bucket_layout(base, p.vocab_size_padded, base.seq_length, N * base.partition_alignment)
    assert p.device_items["grad_narrow_scratch"] == 2 * 2 * (max_bucket // N)
    r16 = plan(base.replace(grad_reduce_fp32=False))
    assert r16.device_items["grad_buckets_x2"] == 2 * 2 * 1_000_000 and "grad_narrow_scratch" not in r16.device_items
    h32 = plan(base.replace(host_grad_fp32=True))
    assert h32.host_bytes_per_gpu == psi // N * (4 + 4 + 4 + 4 + 2) and "grad_narrow_scratch" not in h32.device_items
    with pytest.raises(ValueError, match="host_grad_fp32 needs grad_reduce_fp32"):
        plan(base.replace(grad_reduce_fp32=False, host_grad_fp32=True))
    hacc = plan(base.replace(grad_accum_steps=4, accumulate_on_host=True))
    assert "grads_kept_across_microbatches" not in hacc.device_items
    assert hacc.host_bytes_per_gpu == psi // N * (4 + 4 + 4 + 2 + 4)
    assert "grads_kept_across_microbatches" not in p.device_items
    assert p.host_bytes_per_gpu == psi // N * (4 + 4 + 4 + 2)
    assert p.host_items["master_fp32"] == 4 * psi // N * p.ranks_per_node
    assert plan(base.replace(bf16_optimizer_states=True)).host_bytes_per_gpu == psi // N * (4 + 2 + 2 + 2)
    assert plan(base.replace(dpu=True)).host_bytes_per_gpu == psi // N * (4 + 4 + 4 + 2 + 2)
    # accumulation in the fp32 main_grad where gradients are reduced in fp32 (issue 34, 2.5), else 16-bit
    accum = plan(base.replace(grad_accum_steps=4))
    assert accum.device_items["grads_kept_across_microbatches"] == (4 if accum.input.reduces_in_fp32() else 2) * psi
    accum16 = plan(base.replace(grad_accum_steps=4, grad_reduce_fp32=False))
    assert accum16.device_items["grads_kept_across_microbatches"] == 2 * psi
    fp32 = plan(base.replace(precision="fp32"))
    assert fp32.device_items["params_fp32"] == 4 * psi
    assert fp32.host_bytes_per_gpu == psi // N * 16
    # host per node = per GPU x ranks + per-process overhead x ranks (+ per node) + reserve (a tenth of
    # the host, at least 256 MiB, at most 32 GiB: 1.5 TiB here)
    assert p.host_bytes_per_node == (p.host_bytes_per_gpu * p.ranks_per_node
                                     + base.host_overhead_bytes_per_rank * p.ranks_per_node
                                     + base.host_overhead_bytes_per_node + 32 * GiB)


def test_baseline_is_16_bytes_per_param():
    for precision in ("bf16", "fp16", "fp32"):
        p = plan(PlanInput(num_layers=4, hidden_size=512, num_attention_heads=8,
                           zero_offload=False, precision=precision))
        states = sum(v for k, v in p.device_items.items()
                     if k.startswith(("params", "grads", "master", "adam")))
        assert states == 16 * p.params_per_tp_rank


def test_small_cpu_config_and_unified_check():
    inp = P.apply_hardware_preset(PlanInput(num_layers=2, hidden_size=64, num_attention_heads=4,
                                            seq_length=128, tensor_parallel=2, data_parallel=2,
                                            precision="fp32", micro_batch_size=4), "cpu")
    p = plan(inp)
    assert p.fits and p.world_size == 4 and p.ranks_per_node == 4 and p.num_nodes == 1
    assert inp.gpu_memory_bytes == inp.host_memory_bytes_per_node > 0
    assert any(r.startswith("unified") for r in p.reasons)
    assert not plan(inp.replace(host_memory_bytes_per_node=1 * GiB, gpu_memory_bytes=1 * GiB)).fits


def test_invalid_inputs_raise():
    with pytest.raises(ValueError, match="tensor_parallel"):
        plan(PlanInput(num_layers=2, hidden_size=64, num_attention_heads=4, tensor_parallel=3))
    with pytest.raises(ValueError, match="num_attention_heads"):
        plan(PlanInput(num_layers=2, hidden_size=65, num_attention_heads=4))
    with pytest.raises(ValueError, match="precision"):
        plan(PlanInput(num_layers=2, hidden_size=64, num_attention_heads=4, precision="fp8"))
    with pytest.raises(ValueError, match="dpu"):
        plan(PlanInput(num_layers=2, hidden_size=64, num_attention_heads=4, zero_offload=False, dpu=True))
    with pytest.raises(ValueError, match="max_position_embeddings"):
        plan(PlanInput(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=256,
                       max_position_embeddings=128))


def test_suggestions_when_it_does_not_fit():
    p = plan(PlanInput(**P.model_preset("13b"), micro_batch_size=4, precision="fp16",
                       recompute="full", zero_offload=False, gpus_per_node=1))
    assert not p.fits and not p.fits_device and p.fits_host
    assert any("ZeRO-Offload" in s and s.endswith("-> fits") for s in p.suggestions)
    big = plan(PlanInput(**P.model_preset("175b"), tensor_parallel=16, gpus_per_node=16,
                         precision="fp16", recompute="full"))
    assert not big.fits_host
    assert any("bf16" in s for s in big.suggestions)
    assert any("more nodes" in s and s.endswith("-> fits") for s in big.suggestions)
    assert plan(PlanInput(num_layers=2, hidden_size=64, num_attention_heads=4)).suggestions == []


def test_max_model_is_the_boundary():
    tmpl = PlanInput(num_layers=1, hidden_size=2048, num_attention_heads=16, precision="fp16",
                     recompute="full", gpus_per_node=1)
    params, shape = max_model(tmpl, "layers")
    assert plan(tmpl.replace(**shape)).fits
    assert not plan(tmpl.replace(num_layers=shape["num_layers"] + 1)).fits
    assert params == plan(tmpl.replace(**shape)).params_total
    params_h, shape_h = max_model(tmpl.replace(num_layers=24), "hidden")
    assert shape_h["hidden_size"] % 128 == 0 and shape_h["num_layers"] == 24
    assert plan(tmpl.replace(**shape_h)).fits
    assert not plan(tmpl.replace(num_layers=24, hidden_size=shape_h["hidden_size"] + 128)).fits
    tiny = tmpl.replace(gpu_memory_bytes=1 * GiB)
    assert max_model(tiny, "layers") == (0, None)


# ------------------------------------------------------------------------------------------------
# the paper's reference points and our maxima

def test_paper_reference_points():
    rows = {r["name"]: r for r in P.paper_checks()}
    assert all(r["ok"] for r in rows.values()), rows
    assert rows["13B, 1x V100-32GB, ZeRO-Offload, mb 4"]["fits"]
    assert not rows["13B, 1x V100-32GB, no offload, mb 4"]["fits"]
    assert rows["70B, DGX-2 TP=16, ZeRO-Offload, mb 8"]["fits"]
    assert not rows["70B, DGX-2 TP=16, no offload, mb 8"]["fits"]
    assert rows["15B, DGX-2 TP=16, no offload, mb 8"]["fits"]
    assert 13e9 <= rows["13B, 1x V100-32GB, ZeRO-Offload, mb 4"]["params"] < 14e9
    assert 70e9 <= rows["70B, DGX-2 TP=16, ZeRO-Offload, mb 8"]["params"] < 72e9


def test_baseline_maxima_are_paper_scale():
    single, dgx2 = P.baseline_maxima()
    assert 1.0e9 <= single["max_params"] < 3e9  # paper: PyTorch 1.4B
    assert 15e9 <= dgx2["max_params"] < 70e9  # paper: Megatron 15B


def test_our_maxima_meet_the_goals():
    v100, dgx2 = P.our_maxima()
    assert v100["max_params"] >= 15e9 and v100["meets_goal"]
    assert dgx2["max_params"] >= 100e9 and dgx2["meets_goal"]


# ------------------------------------------------------------------------------------------------
# CLI

def _cli(*args):
    """tools/estimate_memory.py's command line, in this process (tests/cli.py)."""
    from tests.cli import run_tool

    return run_tool("estimate_memory", *args, cwd=REPO)


def test_cli_json_and_exit_codes():
    r = _cli("--preset", "dgx2", "--model", "70b", "--tensor-parallel", "16", "--zero-offload",
             "--micro-batch-size", "8", "--recompute-granularity", "full", "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["fits"] is True
    assert isinstance(d["device_bytes_per_gpu"], int) and isinstance(d["host_bytes_per_node"], int)
    assert d["input"]["precision"] == "fp16"  # the dgx2 preset's default
    r = _cli("--preset", "dgx2", "--model", "70b", "--tensor-parallel", "16",
             "--micro-batch-size", "8", "--recompute-granularity", "full", "--no-zero-offload", "--json")
    assert r.returncode == 1 and json.loads(r.stdout)["fits"] is False
    r = _cli("--model", "13b", "--no-zero-offload")
    assert r.returncode == 1 and "DOES NOT FIT" in r.stdout and "suggestions" in r.stdout


@pytest.mark.parametrize("args", [
    ["--num-layers", "2", "--hidden-size", "250", "--num-attention-heads", "4"],
    ["--num-layers", "x"],
    ["--hidden-size", "256"],
    ["--model", "13b", "--micro-batch-size", "2", "--global-batch-size", "3"],
    ["--model", "13b", "--world-size", "6", "--tensor-parallel", "4"],
    ["--model", "nope"],
])
def test_cli_bad_input_exits_2_with_one_line(args):
    r = _cli(*args)
    assert r.returncode == 2
    assert r.stdout == "" and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_cli_max_model_and_paper_check():
    r = _cli("--preset", "v100-32gb", "--hidden-size", "4096", "--num-attention-heads", "32",
             "--recompute-granularity", "full", "--exp-avg-dtype", "bf16", "--exp-avg-sq-dtype", "bf16",
             "--zero-offload", "--max-model", "layers", "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["fits"] is True and d["max_params"] >= 15e9
    assert d["max_shape"]["hidden_size"] == 4096
    r = _cli("--paper-check")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "all reference points and goals hold" in r.stdout
    r = _cli("--paper-check", "--json")
    d = json.loads(r.stdout)
    assert d["ok"] is True and len(d["paper_checks"]) == 5 and len(d["our_maxima"]) == 2


def test_cli_cpu_preset_small_model():
    r = _cli("--preset", "cpu", "--num-layers", "2", "--hidden-size", "128",
             "--num-attention-heads", "4", "--seq-length", "128", "--tensor-parallel", "2",
             "--world-size", "4", "--fp32", "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["input"]["device_is_host"] is True and d["world_size"] == 4


def test_recompute_method_uniform_and_block_activation_lines():
    """Full recompute, uniform N: ceil(L/N) stored layer inputs and N layers live while a group is
    recomputed; block N: N stored inputs, the other L-N layers keep everything (the per-layer
    bytes of the no-recompute plan), one layer recomputed at a time."""
    L, s, b, h = 12, 1024, 4, 2048
    base = PlanInput(num_layers=L, hidden_size=h, num_attention_heads=16, seq_length=s, micro_batch_size=b,
                     precision="bf16")
    per_layer = plan(base).device_items["activations_layers"] // L
    inputs_one = 2 * s * b * h
    u1 = plan(base.replace(recompute="full")).device_items
    assert u1["activations_layer_inputs"] == L * inputs_one
    assert u1["activations_recompute_working_set"] == per_layer
    for n in (2, 4, 12):
        u = plan(base.replace(recompute="full", recompute_method="uniform", recompute_num_layers=n)).device_items
        assert u["activations_layer_inputs"] == L // n * inputs_one, n
        assert u["activations_recompute_working_set"] == n * per_layer, n
        blk = plan(base.replace(recompute="full", recompute_method="block", recompute_num_layers=n)).device_items
        assert blk["activations_layer_inputs"] == n * inputs_one, n
        assert blk.get("activations_layers", 0) == (L - n) * per_layer, n
        assert blk["activations_recompute_working_set"] == per_layer, n
    # block L is uniform 1; fewer recomputed layers cost more memory
    assert plan(base.replace(recompute="full", recompute_method="block", recompute_num_layers=L)).device_bytes_per_gpu \
        == plan(base.replace(recompute="full")).device_bytes_per_gpu
    sizes = [plan(base.replace(recompute="full", recompute_method="block", recompute_num_layers=n)).device_bytes_per_gpu
             for n in (12, 8, 4, 1)]
    assert sizes == sorted(sizes) and len(set(sizes)) == 4
    with pytest.raises(ValueError, match="recompute_method"):
        plan(base.replace(recompute="full", recompute_method="blocks"))
    with pytest.raises(ValueError, match="does not divide"):
        plan(base.replace(recompute="full", recompute_method="uniform", recompute_num_layers=5))
    # TFLOP/s: full recompute runs one more forward of the layers it recomputes, block N only N of them
    from zo_megatron.training.metrics import flops_per_token

    none, full = flops_per_token(L, h, s, 50304, None), flops_per_token(L, h, s, 50304, "full")
    for n in (1, 5, 12):
        blk = flops_per_token(L, h, s, 50304, "full", recomputed_layers=n)
        assert blk - none == pytest.approx((full - none) * n / L, rel=1e-12), n


def _activations(p) -> int:
    return sum(v for k, v in p.device_items.items() if k.startswith(("activations", "logits")))


@pytest.mark.parametrize("arch", [{}, dict(position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
                                           num_query_groups=4, untie_embeddings_and_output_weights=True,
                                           add_bias_linear=False)], ids=["gpt2", "llama"])
@pytest.mark.parametrize("device_is_host", [False, True], ids=["gpu", "cpu"])
def test_sdpa_attention_has_no_s_squared_term(arch, device_is_host):
    """--use-flash-attn (torch SDPA): every activation term is linear in the sequence length, so
    seq 1024 needs exactly 4x the activation bytes of seq 256; the local attention's s² scores do not."""
    L, h, a, b, t = 4, 1024, 16, 2, 2
    base = PlanInput(**arch, num_layers=L, hidden_size=h, num_attention_heads=a, micro_batch_size=b,
                     tensor_parallel=t, max_position_embeddings=4096, device_is_host=device_is_host,
                     attention_dropout=False)   # hidden dropout on: the masks stored
    for rc in (None, "selective"):
        sdpa = {s: plan(base.replace(seq_length=s, attention_backend="sdpa", recompute=rc)) for s in (256, 1024)}
        local = {s: plan(base.replace(seq_length=s, recompute=rc)) for s in (256, 1024)}
        # the per-layer items (the stored layers, and with selective recompute the attention core's
        # working set): exactly linear with SDPA, quadratic with the local attention
        key = "activations_recompute_working_set" if rc else "activations_layers"
        assert sdpa[1024].device_items[key] == pytest.approx(4 * sdpa[256].device_items[key], rel=1e-9)
        assert local[1024].device_items[key] > 4.5 * local[256].device_items[key]
        # the whole estimate: at most linear (constant terms: the output layer's weight gradient)
        assert _activations(sdpa[1024]) <= 4 * _activations(sdpa[256])
        # (with selective recompute the attention core is only a working set, here below the logits' phase)
        assert _activations(sdpa[1024]) <= _activations(local[1024]) if rc else \
            _activations(sdpa[1024]) < _activations(local[1024])
        layers = sdpa[1024].device_items["activations_layers"]
        # what SDPA keeps beyond q, k, v and its output: the fp32 logsumexp [b, a/t, s] per layer
        lse = 4 * b * (a // t) * 1024
        local_scores = local[1024].device_items["activations_layers"] - layers + L * lse
        if rc == "selective":
            assert sdpa[1024].device_items["activations_recompute_working_set"] == lse
        else:
            # GPT-2 (MHA, q/k/v views of the fused qkv output either way): the only difference per
            # layer is the local attention's scores (bf16 probs + dropout mask + dropout output: 5 bytes
            # per score) against the logsumexp
            if not arch:
                assert local_scores == L * 5 * b * (a // t) * 1024 * 1024
    # CPU with attention dropout: SDPA's math path keeps fp32 scores, probabilities and dropout output
    # plus fp32 q·scale, k·scale and v (instead of the bf16 q, k, v the fused kernel keeps, and of
    # the fused qkv tensor they are views of): quadratic again, and more than the local attention
    math_path = base.replace(seq_length=1024, attention_backend="sdpa", attention_dropout=True)
    p = plan(math_path)
    if device_is_host:
        s, d, at = 1024, h // a, a // t
        fused = plan(math_path.replace(attention_dropout=False))
        # what the fused kernel's layer keeps of q, k, v per token: GPT-2 the fused qkv tensor (3 views);
        # Llama (RoPE, 4 groups, grouped k/v): rotated q and k + the fused tensor kept alive by v
        g = 4 // t
        fused_qkv = 2 * 3 * at * d if not arch else 2 * d * (at + g + (at + 2 * g))
        assert p.device_items["activations_layers"] - fused.device_items["activations_layers"] == \
            L * (3 * 4 * b * at * s * s + 3 * 4 * b * at * s * d - 4 * b * at * s - s * b * fused_qkv)
        assert p.device_items["activations_layers"] > plan(base.replace(seq_length=1024)).device_items[
            "activations_layers"]
    else:
        assert p.device_items == plan(math_path.replace(attention_dropout=False)).device_items


@pytest.mark.parametrize("t", [2, 4, 8])
def test_sequence_parallel_divides_the_replicated_terms_by_tp(t):
    """--sequence-parallel: Korthikanti et al. 2022's per-layer count with SP, s·b·h·(34/t + 5·a·s/(h·t))
    (16-bit, dropout); the embedding/final-norm activations and the residual gradients / t; one
    w·s·b·h all-gather buffer; logits unchanged. At TP 1 it changes nothing (the job turns it off)."""
    s, b, h, a, L = 2048, 2, 1024, 16, 4
    base = PlanInput(num_layers=L, hidden_size=h, num_attention_heads=a, seq_length=s, micro_batch_size=b,
                     tensor_parallel=t, precision="bf16")
    off, on = plan(base), plan(base.replace(sequence_parallel=True))
    sbh = s * b * h
    assert on.device_items["activations_layers"] == pytest.approx(L * sbh * (34 / t + 5 * a * s / (h * t)),
                                                                  rel=1e-12)
    assert off.device_items["activations_layers"] == pytest.approx(L * sbh * (10 + 24 / t + 5 * a * s / (h * t)),
                                                                   rel=1e-12)
    assert on.device_items["activations_embedding_final"] == 5 * sbh // t      # dropout mask + 2 x 16 bits
    assert off.device_items["activations_embedding_final"] == 5 * sbh
    assert on.device_items["activations_layer_backward_grads"] == 2 * 2 * s * b * 4 * h // t + 2 * 2 * sbh // t
    assert on.device_items["activations_sp_gather_buffer"] == 2 * sbh
    assert "activations_sp_gather_buffer" not in off.device_items
    for k in ("logits_16bit", "logits_fp32_cross_entropy", "activations_tied_embedding_grad"):
        assert on.device_items[k] == off.device_items[k]
    assert on.device_bytes_per_gpu < off.device_bytes_per_gpu
    # selective recompute keeps the same split layers; SDPA + SP: everything linear in s, all but split / t
    sel = plan(base.replace(sequence_parallel=True, recompute="selective"))
    assert sel.device_items["activations_layers"] == pytest.approx(L * sbh * 34 / t + 4 * L, rel=1e-12)
    # full recompute: each checkpointed layer input is the sequence-parallel [s/t, b, h] hidden state
    full = plan(base.replace(sequence_parallel=True, recompute="full"))
    assert full.device_items["activations_layer_inputs"] == L * 2 * sbh // t
    assert full.device_items["activations_recompute_working_set"] == pytest.approx(sbh * (34 / t + 5 * a * s / (h * t)),
                                                                                 rel=1e-12)
    # RMSNorm + RoPE: the rope cos/sin tables stay whole (they are [s, d], per layer)
    llama = base.replace(position_embedding_type="rope", normalization="RMSNorm", swiglu=True)
    lo, ln = plan(llama), plan(llama.replace(sequence_parallel=True))
    rope = L * 4 * 2 * s * (h // a)
    # replicated: the two RMSNorms (fp32 input, fp32 normalized, 1/rms) + qkv/fc1 inputs + 2 masks
    replicated = 2 * (8 * sbh + 4 * s * b) + (2 * 2 + 2) * sbh
    split = lo.device_items["activations_layers"] - rope - L * replicated
    assert ln.device_items["activations_layers"] == split + rope + L * (replicated // t)
    # TP 1: off, as the job
    one = base.replace(tensor_parallel=1)
    assert plan(one.replace(sequence_parallel=True)).device_items == plan(one).device_items
    with pytest.raises(ValueError, match="multiple of tensor_parallel"):
        plan(base.replace(sequence_parallel=True, seq_length=s + 1))
