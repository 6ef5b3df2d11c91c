"""The engine and the model on one CUDA GPU, against independent references.

- The TP model (TP=1) equals Hugging Face GPT-2 on the GPU: logits, loss, every gradient.
- The ZeRO-Offload engine on CUDA equals single-process fp32 torch AdamW on the CPU (the same
  reference as tests/test_offload_engine.py): fp32; bf16 (fp32 gradient reduction, the default);
  fp16 with a live dynamic loss scale and an overflow injected at step 4.
- The process group carries the "cpu:gloo,cuda:nccl" map: a CPU and a CUDA all-reduce both run
  on one group, and megatron-core's TP/DP subgroups inherit the map (world of 1: NCCL itself).
- DP=2 (conftest.dp2_backend): on a machine with two or more GPUs each rank gets its own GPU and
  CUDA tensors go through NCCL ("cpu:gloo,cuda:nccl"), the real thing. With one GPU, NCCL refuses
  two ranks on one device, so the world uses gloo for CUDA tensors ("cpu:gloo,cuda:gloo"): that
  proves the engine's CUDA path with real DP=2 collectives on CUDA tensors -- async Work handles,
  the side stream waiting on them, fixed bucket order, the all-gather into the flat buffer -- and
  equality with torch, but NOT NCCL's behaviour: gloo's Work.wait() blocks the host, NCCL's only
  orders streams, so stream-ordering bugs that only NCCL's asynchrony exposes need two GPUs.
- Every tracking test also compares the unclipped grad norm with the reference's each step
  (tests/test_offload_engine.py's NORM_RTOL_16 in 16 bits): a wrong gradient scale hides from
  the weights under Adam and a hard clip.
"""
import pytest
import torch

from tests.fp32_bounds import assert_fp32_weights_match, fp32_spread
from tests.gpu.conftest import HAVE_CUDA, device, dp2_backend
from tests.harness import run_world
from tests.seeds import fresh_seed
from tests.test_offload_engine import ACCUM, NORM_RTOL_16, STEPS, _norm_errors, _reference, _train_world

transformers = pytest.importorskip("transformers")

LAYERS, HIDDEN, HEADS, SEQ, VOCAB, BATCH = 2, 64, 4, 32, 500, 4


def _hf_world(rank, seed):
    from zo_megatron.checkpoint.hf.gpt2 import to_hf
    from zo_megatron.model import GPTConfig, build_gpt_model
    from zo_megatron.model.sharding import gather_full_params
    from zo_megatron.parallel import init_parallel

    ps = init_parallel(1, seed=seed, num_attention_heads=HEADS, hidden_size=HIDDEN)
    cfg = GPTConfig(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, vocab_size=VOCAB,
                    max_position_embeddings=SEQ, precision="fp32")
    model = build_gpt_model(cfg, 0, 1, seed).to(ps.device)
    full = gather_full_params(model, ps.tp_group, 0, 1, VOCAB)      # TP=1: every tensor whole
    hc = transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS,
                                 resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                 activation_function="gelu_new", layer_norm_epsilon=1e-5)
    hf = transformers.GPT2LMHeadModel(hc).float()
    hf.load_state_dict(to_hf({n: t.cpu() for n, t in full.items()}, LAYERS, HEADS), strict=True)
    hf.to(ps.device)
    gen = torch.Generator().manual_seed(seed + 1)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen).to(ps.device)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen).to(ps.device)
    ours = model(tokens)[..., :VOCAB].float()
    loss = model.loss(tokens, labels)
    loss.backward()
    ref_logits = hf(tokens).logits
    ref_loss = torch.nn.functional.cross_entropy(ref_logits.reshape(-1, VOCAB), labels.reshape(-1))
    ref_loss.backward()
    from zo_megatron.checkpoint.hf.gpt2 import from_hf

    hf_grads = {n: p.grad for n, p in hf.named_parameters()}
    hf_grads["lm_head.weight"] = hf_grads["transformer.wte.weight"]
    ref_grads = from_hf(hf_grads, LAYERS, HEADS)            # our names, full unpadded tensors
    our_grads = {n: p.grad for n, p in model.named_parameters()}
    return dict(device=str(ours.device), logits=(ours.detach().cpu(), ref_logits.detach().cpu()),
                loss=(loss.item(), ref_loss.item()),
                grads={n: (our_grads[n].cpu(), g.cpu()) for n, g in ref_grads.items()})


def test_tp_model_equals_hf_gpt2_on_the_gpu():
    seed = fresh_seed("gpu hf")
    out = run_world(_hf_world, 1, seed)[0]
    assert out["device"].startswith(device().type)
    ours, ref = out["logits"]
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)
    assert abs(out["loss"][0] - out["loss"][1]) <= 1e-5 * abs(out["loss"][1])
    assert len(out["grads"]) >= 10
    for name, (g, r) in out["grads"].items():
        g = g[:r.shape[0]] if g.shape != r.shape else g      # vocab padding rows
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-5 * r.abs().max().item(), msg=lambda m: f"{name}: {m}")


def _max_rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def _check_against_reference(out, seed, dp, tol, bias_tol, skip_step=None):
    ref_losses, ref_norms, ref_final = _reference(out["init"], seed, dp, ACCUM, skip_step=skip_step)
    for ours, ref in zip(out["losses"], ref_losses):
        assert abs(ours - ref) / abs(ref) <= tol, (ours, ref)
    norm_tol = 1e-5 if tol <= 1e-5 else NORM_RTOL_16
    errors = _norm_errors(out["norms"], ref_norms)
    assert len(errors) == STEPS - (skip_step is not None) and max(errors) <= norm_tol, (out["norms"], ref_norms)
    if tol <= 1e-5:           # fp32: tests/fp32_bounds.py, against float64 torch
        torch32 = fp32_spread(lambda init: _reference(init, seed, dp, ACCUM, skip_step=skip_step, dtype=torch.float32)[2],
                              out["init"])
        assert_fp32_weights_match(out["final"], ref_final, torch32, norm_rtol=tol)
        return
    for name, ref in ref_final.items():
        err = ((out["final"][name] - ref).norm() / ref.norm()).item()
        assert err <= (bias_tol if name.endswith(".bias") else tol), (name, err)


def test_engine_on_cuda_fp32_equals_torch_adamw():
    """fp32 on the GPU vs float64 torch on the CPU: 1e-5 relative per tensor, or 3x torch's own fp32
    error on this draw (cuBLAS and the CPU sum in different orders; TF32 is off)."""
    seed = fresh_seed("gpu fp32")
    out = run_world(_train_world, 1, 1, "fp32", seed)[0]
    _check_against_reference(out, seed, 1, 1e-5, 1e-5)


@pytest.mark.parametrize("engine_kw", [{}, {"host_grad_dtype": "fp32"}, {"accumulate_on_host": True},
                                       {"optimizer_offload_fraction": 0.5}],
                         ids=["default", "host32", "hostacc", "offload-half"])
def test_engine_on_cuda_bf16_tracks_torch_adamw(engine_kw):
    """Tolerances as on the CPU: 2% (10% for the zero-initialised biases)."""
    seed = fresh_seed(f"gpu bf16 {engine_kw}")
    out = run_world(_train_world, 1, 1, "bf16", seed, ACCUM, engine_kw)[0]
    _check_against_reference(out, seed, 1, 2e-2, 1e-1)


def test_engine_on_cuda_fp16_real_scale_and_overflow():
    from zo_megatron.offload.loss_scaler import DynamicLossScaler

    seed = fresh_seed("gpu fp16")
    scaler = DynamicLossScaler(initial_scale=2.0**14, growth_interval=3, hysteresis=1)
    out = run_world(_train_world, 1, 1, "fp16", seed, ACCUM, {"loss_scaler": scaler}, 4)[0]
    assert out["skipped"] == [i == 4 for i in range(STEPS)]
    assert out["scales"] == [2.0**14] * 3 + [2.0**15] * 2 + [2.0**14] * 3 + [2.0**15] * 2
    _check_against_reference(out, seed, 1, 1e-2, 5e-2, skip_step=4)


@pytest.mark.parametrize("precision,tol,bias_tol", [("fp32", 1e-5, 1e-5), ("bf16", 2e-2, 1e-1)])
def test_two_ranks_on_one_gpu_equal_torch_adamw(precision, tol, bias_tol):
    """DP=2: NCCL with two GPUs, gloo for CUDA tensors on one (the module docstring says what each proves)."""
    seed = fresh_seed(f"gpu dp2 {precision}")
    backend = dp2_backend()
    out = run_world(_train_world, 2, 1, precision, seed, ACCUM, None, None, backend)[0]
    _check_against_reference(out, seed, 2, tol, bias_tol)


def _backend_world(rank):
    import torch.distributed as dist

    from zo_megatron.parallel import init_parallel

    ps = init_parallel(1, seed=1)
    configs = [dist.get_backend_config(g) for g in (None, ps.tp_group, ps.dp_group)]
    cpu = torch.ones(3)
    dist.all_reduce(cpu, group=ps.dp_group)              # gloo
    dev = torch.ones(3, device=ps.device)
    dist.all_reduce(dev, group=ps.dp_group)              # NCCL on a GPU
    torch.cuda.synchronize() if ps.device.type == "cuda" else None
    return dict(configs=configs, device=str(ps.device), cpu=cpu.tolist(), dev=dev.cpu().tolist())


def test_process_groups_carry_a_backend_per_device():
    out = run_world(_backend_world, 1)[0]
    want = "cpu:gloo,cuda:nccl" if HAVE_CUDA else "cpu:gloo"
    assert all(c.startswith(want) for c in out["configs"]), out["configs"]
    assert out["cpu"] == out["dev"] == [1.0, 1.0, 1.0]
