"""--use-flash-attn on one CUDA GPU: which SDPA kernel runs, equality with megatron-core's local
attention, and the device memory the s x s tensors took.

- The kernel: SDPAttention allows exactly one of flash / memory-efficient per call
  (torch.nn.attention.sdpa_kernel), so a forward that returns proves that kernel ran (torch
  raises rather than fall back). bf16 with head_dim 16 must take flash; fp32 (flash has no fp32)
  memory-efficient attention; GQA in fp32 repeats k/v for it.
- Equality: the same weights and batch through the local module and through SDPA: fp32 logits,
  loss and every gradient to 1e-5 (TF32 off), bf16 within the usual 2e-2 (L2 per tensor); GPT-2
  and a Llama shape (GQA 8 heads / 4 groups, RMSNorm, SwiGLU, RoPE).
- Memory: torch.cuda.max_memory_allocated over forward + backward at seq 2048: the local module's
  peak exceeds SDPA's by at least the [b, heads, s, s] probabilities it keeps (16-bit) -- the
  s x s term SDPA does not have.
Sequence parallelism needs TP >= 2 (two GPUs with NCCL); it is tested on the CPU worlds.
"""
import pytest
import torch

from tests.gpu.conftest import needs_cuda
from tests.harness import run_world
from tests.seeds import fresh_seed

GPT2 = dict(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=500, max_position_embeddings=2048)
LLAMA = dict(num_layers=2, hidden_size=96, num_attention_heads=8, num_query_groups=4, ffn_hidden_size=200,
             vocab_size=251, max_position_embeddings=2048, position_embedding_type="rope",
             normalization="RMSNorm", swiglu=True, add_bias_linear=False, untie_embeddings_and_output_weights=True)


def _pair_world(rank, shape, precision, seq, seed):
    """Local and SDPA on the same weights and batch; kernels, logits, loss, gradients (on the CPU)."""
    from zo_megatron.model import GPTConfig, build_gpt_model
    from zo_megatron.parallel import init_parallel

    torch.backends.cuda.matmul.allow_tf32 = False
    ps = init_parallel(1, seed=seed)
    shape = GPT2 if shape == "gpt2" else LLAMA
    gen = torch.Generator().manual_seed(seed + 1)
    tokens = torch.randint(0, shape["vocab_size"], (2, seq), generator=gen).to(ps.device)
    labels = torch.randint(0, shape["vocab_size"], (2, seq), generator=gen).to(ps.device)
    out = {}
    for backend in ("local", "sdpa"):
        cfg = GPTConfig(**shape, precision=precision, attention_backend=backend)
        model = build_gpt_model(cfg, 0, 1, seed).to(ps.device).to(cfg.dtype)
        logits = model(tokens)
        loss = model.loss(tokens, labels)
        loss.backward()
        attn = model.gpt.decoder.layers[0].self_attention.core_attention
        out[backend] = dict(device=str(logits.device), kernel=getattr(attn, "last_kernel", None),
                            logits=logits.detach()[..., :shape["vocab_size"]].float().cpu(), loss=loss.item(),
                            grads={n: p.grad.float().cpu() for n, p in model.named_parameters()})
    return out


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-30)).item()


def _rel_l2(a, b):
    return ((a - b).norm() / b.norm().clamp(min=1e-30)).item()


@needs_cuda("the CUDA SDPA kernels")
@pytest.mark.parametrize("shape,precision,kernel", [("gpt2", "bf16", "flash"), ("gpt2", "fp32", "efficient"),
                                                    ("llama", "bf16", "flash"), ("llama", "fp32", "efficient")])
def test_sdpa_runs_a_fused_kernel_and_equals_local_attention_on_cuda(shape, precision, kernel):
    seed = fresh_seed(f"gpu sdpa {shape} {precision}")
    out = run_world(_pair_world, 1, shape, precision, 256, seed)[0]
    local, sdpa = out["local"], out["sdpa"]
    assert sdpa["device"].startswith("cuda")
    assert local["kernel"] is None and sdpa["kernel"] == kernel, sdpa["kernel"]
    metric, tol = (_rel, 1e-5) if precision == "fp32" else (_rel_l2, 2e-2)
    assert metric(sdpa["logits"], local["logits"]) <= tol
    assert abs(sdpa["loss"] - local["loss"]) <= tol * abs(local["loss"])
    for n, g in local["grads"].items():
        assert metric(sdpa["grads"][n], g) <= tol, (n, metric(sdpa["grads"][n], g))


def _memory_world(rank, seq, seed):
    from zo_megatron.model import GPTConfig, build_gpt_model
    from zo_megatron.parallel import init_parallel

    ps = init_parallel(1, seed=seed)
    tokens = torch.randint(0, 500, (1, seq), device=ps.device)
    out = {}
    for backend in ("local", "sdpa"):
        cfg = GPTConfig(**{**GPT2, "num_layers": 1}, precision="bf16", attention_backend=backend)
        model = build_gpt_model(cfg, 0, 1, seed).to(ps.device).to(cfg.dtype)
        model.loss(tokens, tokens).backward()            # warm-up: one-time buffers, the mask cache
        for p in model.parameters():
            p.grad = None
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        model.loss(tokens, tokens).backward()
        torch.cuda.synchronize()
        out[backend] = torch.cuda.max_memory_allocated() - base
        del model
        torch.cuda.empty_cache()
    return out


@needs_cuda("the CUDA allocator's peak")
def test_sdpa_device_memory_has_no_s_squared_term():
    seq = 2048
    peaks = run_world(_memory_world, 1, seq, fresh_seed("gpu sdpa memory"))[0]
    probs = 2 * GPT2["num_attention_heads"] * seq * seq          # one [1, heads, s, s] bf16 tensor
    print(peaks)
    assert peaks["local"] - peaks["sdpa"] >= probs, peaks


MLA = dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=120, vocab_size=203,
           max_position_embeddings=512, position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
           add_bias_linear=False, untie_embeddings_and_output_weights=True, qk_layernorm=True,
           multi_latent_attention=True, q_lora_rank=24, kv_lora_rank=32, qk_head_dim=16, qk_pos_emb_head_dim=8,
           v_head_dim=16, rope_type="yarn", rotary_scaling_factor=4.0, mscale_all_dim=1.0)


def _mla_world(rank, precision, seq, seed):
    """Multi-latent attention on CUDA and on the CPU (the reference: checked against transformers there,
    tests/test_mla.py), the same weights and batch: the CUDA kernel, logits, loss, every gradient."""
    from zo_megatron.model import GPTConfig, build_gpt_model
    from zo_megatron.parallel import init_parallel

    torch.backends.cuda.matmul.allow_tf32 = False
    ps = init_parallel(1, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    tokens = torch.randint(0, MLA["vocab_size"], (2, seq), generator=gen)
    out = {}
    for device, dtype_of in ((ps.device, precision), (torch.device("cpu"), "fp32")):
        cfg = GPTConfig(**MLA, precision=dtype_of)
        model = build_gpt_model(cfg, 0, 1, seed).to(device).to(cfg.dtype)
        t = tokens.to(device)
        logits = model(t)
        loss = model.loss(t, t)
        loss.backward()
        attn = model.gpt.decoder.layers[0].self_attention.core_attention
        out[device.type] = dict(kernel=attn.last_kernel, logits=logits.detach()[..., :MLA["vocab_size"]].float().cpu(),
                                loss=loss.item(), grads={n: p.grad.float().cpu() for n, p in model.named_parameters()})
    return out


@needs_cuda("the CUDA SDPA kernels with multi-latent attention's head dims")
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_multi_latent_attention_runs_the_memory_efficient_kernel_on_cuda(precision):
    """MLA's query/key head dim (24) differs from its value's (16): flash cannot take that, torch's
    memory-efficient kernel can (model/attention.py pads only on a CPU); the CUDA model equals the CPU one
    (fp32 to 1e-5 with TF32 off, bf16 within 2e-2 L2 per tensor)."""
    seed = fresh_seed(f"gpu mla {precision}")
    out = run_world(_mla_world, 1, precision, 256, seed)[0]
    cuda, cpu = out["cuda"], out["cpu"]
    assert cuda["kernel"] == "efficient" and cpu["kernel"] == "flash", (cuda["kernel"], cpu["kernel"])
    metric, tol = (_rel, 1e-5) if precision == "fp32" else (_rel_l2, 2e-2)
    assert metric(cuda["logits"], cpu["logits"]) <= tol
    assert abs(cuda["loss"] - cpu["loss"]) <= tol * abs(cpu["loss"])
    for n, g in cpu["grads"].items():
        assert metric(cuda["grads"][n], g) <= tol, (n, metric(cuda["grads"][n], g))


def _document_world(rank, shape, backend, precision, seq, seed):
    """Per-document attention (segment_ids: --reset-attention-mask, --sft) on CUDA and on the CPU (the
    reference: packed equals each document run alone there, tests/test_document_attention.py), the same
    weights, batch and segments: the CUDA kernel, logits, loss, every gradient."""
    from zo_megatron.model import GPTConfig, build_gpt_model
    from zo_megatron.parallel import init_parallel

    torch.backends.cuda.matmul.allow_tf32 = False
    ps = init_parallel(1, seed=seed)
    shape = {"gpt2": GPT2, "llama": LLAMA, "mla": MLA}[shape]
    gen = torch.Generator().manual_seed(seed + 1)
    tokens = torch.randint(0, shape["vocab_size"], (2, seq), generator=gen)
    # 2-6 documents of random lengths per row, different per row
    segments = torch.stack([torch.randint(0, 5, (seq,), generator=gen).sort().values for _ in range(2)])
    out = {}
    for device, dtype_of in ((ps.device, precision), (torch.device("cpu"), "fp32")):
        cfg = GPTConfig(**shape, precision=dtype_of, attention_backend=backend)
        model = build_gpt_model(cfg, 0, 1, seed).to(device).to(cfg.dtype)
        t, s = tokens.to(device), segments.to(device)
        logits = model(t, segment_ids=s)
        loss = model.loss(t, t, None, None, s)
        loss.backward()
        attn = model.gpt.decoder.layers[0].self_attention.core_attention
        out[device.type] = dict(kernel=getattr(attn, "last_kernel", None),
                                logits=logits.detach()[..., :shape["vocab_size"]].float().cpu(), loss=loss.item(),
                                grads={n: p.grad.float().cpu() for n, p in model.named_parameters()})
    return out


@needs_cuda("the CUDA SDPA kernels with an attention mask")
@pytest.mark.parametrize("shape,backend,precision", [("gpt2", "sdpa", "bf16"), ("llama", "sdpa", "fp32"),
                                                     ("llama", "sdpa", "bf16"), ("mla", "sdpa", "bf16"),
                                                     ("gpt2", "local", "bf16")])
def test_per_document_attention_on_cuda_equals_the_cpu(shape, backend, precision):
    """With segment_ids SDPA takes model/gpt.py's additive mask: flash takes none, so torch's memory-efficient
    kernel must run (GQA k/v repeated for it); seq 250 is no multiple of 8, the mask's rows are padded once.
    The CUDA model equals the CPU one (fp32 to 1e-5 with TF32 off, 16-bit within 2e-2 L2 per tensor)."""
    seed = fresh_seed(f"gpu document mask {shape} {backend} {precision}")
    out = run_world(_document_world, 1, shape, backend, precision, 250, seed)[0]
    cuda, cpu = out["cuda"], out["cpu"]
    if backend == "sdpa":
        assert cuda["kernel"] == "efficient", cuda["kernel"]
    metric, tol = (_rel, 1e-5) if precision == "fp32" else (_rel_l2, 2e-2)
    assert metric(cuda["logits"], cpu["logits"]) <= tol
    assert abs(cuda["loss"] - cpu["loss"]) <= tol * abs(cpu["loss"])
    for n, g in cpu["grads"].items():
        assert metric(cuda["grads"][n], g) <= tol, (n, metric(cuda["grads"][n], g))


# GPT-OSS's attention and MLP, small: sinks, a window on every other layer, the clamped quick GeGLU, experts with biases
GPT_OSS = dict(num_layers=2, hidden_size=128, num_attention_heads=4, num_query_groups=2, kv_channels=64,
               ffn_hidden_size=96, vocab_size=251, max_position_embeddings=2048, position_embedding_type="rope",
               normalization="RMSNorm", untie_embeddings_and_output_weights=True, softmax_type="learnable",
               window_size=(31, 0), window_attn_skip_freq=2, quick_geglu=True, glu_linear_offset=1.0,
               activation_func_clamp_value=7.0, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=96)


def _sinks_world(rank, precision, seq, seed):
    """GPT-OSS's parts on CUDA and on the CPU (the reference: tests/test_attention_sinks.py, test_convert_gpt_oss.py),
    the same weights and batch: each layer's kernel, logits, loss, every gradient."""
    from zo_megatron.model import GPTConfig, build_gpt_model
    from zo_megatron.parallel import init_parallel

    torch.backends.cuda.matmul.allow_tf32 = False
    ps = init_parallel(1, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    tokens = torch.randint(0, GPT_OSS["vocab_size"], (2, seq), generator=gen)
    out = {}
    for device, dtype_of in ((ps.device, precision), (torch.device("cpu"), "fp32")):
        cfg = GPTConfig(**GPT_OSS, precision=dtype_of, attention_backend="sdpa")
        model = build_gpt_model(cfg, 0, 1, seed).to(device).to(cfg.dtype)
        with torch.no_grad():           # sinks that matter (the init draws them ~N(0, 0.02))
            for layer in model.gpt.decoder.layers:
                layer.self_attention.core_attention.softmax_offset.normal_(0.0, 1.0, generator=None)
        if device.type == "cpu":        # the same offsets as on CUDA
            for layer, offset in zip(model.gpt.decoder.layers, out["cuda"]["offsets"]):
                layer.self_attention.core_attention.softmax_offset.data.copy_(offset)
        t = tokens.to(device)
        logits = model(t)
        loss = model.loss(t, t)
        loss.backward()
        layers = [layer.self_attention.core_attention for layer in model.gpt.decoder.layers]
        out[device.type] = dict(kernels=[a.last_kernel for a in layers],
                                offsets=[a.softmax_offset.detach().float().cpu() for a in layers],
                                logits=logits.detach()[..., :GPT_OSS["vocab_size"]].float().cpu(), loss=loss.item(),
                                grads={n: p.grad.float().cpu() for n, p in model.named_parameters()})
    return out


@needs_cuda("the CUDA SDPA kernels with attention sinks")
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_gpt_oss_attention_sinks_on_cuda_equal_the_cpu(precision):
    """GPT-OSS's sinks on SDPA (model/sinks.py: a sink key and the offset in an extra head-dim channel, padded to a
    multiple of 8 on CUDA), its window layer (a mask: memory-efficient) and its full layer (is_causal: flash in
    bf16), its clamped quick GeGLU experts with biases at EP 1 (seq 250, no multiple of 8): the CUDA model equals the
    CPU one (fp32 to 1e-5 with TF32 off, bf16 within 2e-2 L2 per tensor; sinks' offsets included)."""
    seed = fresh_seed(f"gpu gpt-oss sinks {precision}")
    out = run_world(_sinks_world, 1, precision, 250, seed)[0]
    cuda, cpu = out["cuda"], out["cpu"]
    assert cuda["kernels"] == ["efficient", "flash" if precision == "bf16" else "efficient"], cuda["kernels"]
    metric, tol = (_rel, 1e-5) if precision == "fp32" else (_rel_l2, 2e-2)
    assert metric(cuda["logits"], cpu["logits"]) <= tol
    assert abs(cuda["loss"] - cpu["loss"]) <= tol * abs(cpu["loss"])
    for n, g in cpu["grads"].items():
        assert metric(cuda["grads"][n], g) <= tol, (n, metric(cuda["grads"][n], g))
