"""Device memory, pinned host memory and the whole job on one CUDA GPU.

- Pinned host buffers are registered at their exact size while the engine lives and unregistered
  by close() -- also when the training code raised inside `with engine:`.
- Device memory: the model is built on the host, so before the engine nothing is on the device;
  after it, torch.cuda.max_memory_allocated equals the planner's model-state items (16-bit
  parameters + gradient buckets + narrowing scratch); through three training steps the peak stays
  under the planner's device total (model states + activations + fragmentation margin; the CUDA
  context it also budgets is outside torch's allocator).
- pretrain_gpt.py trains 20 iterations on the GPU end to end, with evaluation and a checkpoint.
"""
import json
import os
import subprocess
import sys

import pytest
import torch

from tests.gpu.conftest import needs_cuda, nvml_process_bytes
from tests.harness import run_world
from tests.seeds import fresh_seed

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "pretrain", "pretrain_gpt.py")
LAYERS, HIDDEN, HEADS, SEQ, VOCAB, MICRO = 4, 512, 8, 256, 50257, 4


def _engine(seed, precision, attention_backend="local", **kw):
    from zo_megatron.model import GPTConfig, build_gpt_model
    from zo_megatron.offload.engine import ZeroOffloadEngine
    from zo_megatron.parallel import init_parallel

    ps = init_parallel(1, seed=seed, num_attention_heads=HEADS, hidden_size=HIDDEN)
    cfg = GPTConfig(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, vocab_size=VOCAB,
                    max_position_embeddings=SEQ, precision=precision, attention_backend=attention_backend)
    model = build_gpt_model(cfg, 0, 1, seed)
    return ps, model, lambda **more: ZeroOffloadEngine(model, precision=precision, dp_group=ps.dp_group,
                                                       device=ps.device, **kw, **more)


def _pinned_world(rank, seed):
    ps, model, make = _engine(seed, "bf16")
    engine = make()
    staging = [engine.host_grad] + ([engine.host_param] if engine.host_param is not engine.host_grad else [])
    while_alive = [t.is_pinned() for t in staging]
    registered = engine.dev.registered_bytes
    expected = sum(t.numel() * t.element_size() for t in staging)
    engine.close()
    after_close = [t.is_pinned() for t in staging]
    engine.close()                                  # idempotent
    # an error inside `with engine:` still unregisters
    ps2, model2, make2 = _engine(seed, "bf16", host_grad_dtype="fp32")
    caught = False
    try:
        with make2() as engine2:
            staging2 = [engine2.host_grad, engine2.host_param]
            during = [t.is_pinned() for t in staging2]
            raise RuntimeError("boom")
    except RuntimeError:
        caught = True
    return dict(while_alive=while_alive, after_close=after_close, registered=registered, expected=expected,
                during=during, after_error=[t.is_pinned() for t in staging2], caught=caught)


@needs_cuda("pinned host memory")
def test_pinned_buffers_are_registered_and_freed():
    out = run_world(_pinned_world, 1, fresh_seed("pinned"))[0]
    assert all(out["while_alive"]) and out["registered"] == out["expected"] > 0
    assert not any(out["after_close"])
    assert out["caught"] and all(out["during"]) and not any(out["after_error"])


def _memory_world(rank, seed, precision, attention_backend="local"):
    from zo_megatron.planner import PlanInput, plan

    torch.cuda.reset_peak_memory_stats()
    from zo_megatron.offload.loss_scaler import DynamicLossScaler

    ps, model, make = _engine(seed, precision, attention_backend)
    before_engine = torch.cuda.max_memory_allocated()
    # fp16: a scale that does not overflow on step 1 (the default 2^32 skips the first steps)
    engine = make() if precision != "fp16" else make(loss_scaler=DynamicLossScaler(initial_scale=2.0**12))
    after_build = torch.cuda.max_memory_allocated()
    gen = torch.Generator().manual_seed(seed)
    for _ in range(3):
        tokens = torch.randint(0, VOCAB, (MICRO, SEQ), generator=gen).to(ps.device)
        labels = torch.randint(0, VOCAB, (MICRO, SEQ), generator=gen).to(ps.device)
        engine.backward(model.loss(tokens, labels))
        assert not engine.step().skipped
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    reserved = torch.cuda.max_memory_reserved()
    nvml = nvml_process_bytes(torch.cuda.current_device())     # the whole process on the GPU
    p = plan(PlanInput(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, vocab_size=VOCAB,
                       seq_length=SEQ, micro_batch_size=MICRO, precision=precision, bucket_size=40_000_000,
                       dropout=False, fused_softmax=False, attention_backend=attention_backend))
    states = sum(v for k, v in p.device_items.items() if k.startswith(("params_", "grad_")))
    overhead = p.device_items["framework_overhead"]
    out = dict(before_engine=before_engine, after_build=after_build, peak=peak, planned_states=states,
               planned_transient=p.device_bytes_per_gpu - states - overhead,
               planned_total=p.device_bytes_per_gpu, items=p.device_items,
               accounted=engine.accounting.device_model_state_bytes, nvml=nvml, reserved=reserved)
    engine.close()
    return out


@needs_cuda("the CUDA caching allocator's peak")
@pytest.mark.parametrize("precision,attention_backend", [("bf16", "local"), ("fp16", "local"), ("bf16", "sdpa")])
def test_device_memory_stays_within_the_plan(precision, attention_backend):
    """(--use-flash-attn: torch SDPA's flash kernel, planned without the s x s scores)"""
    out = run_world(_memory_world, 1, fresh_seed(f"memory {precision} {attention_backend}"), precision,
                    attention_backend)[0]
    print(json.dumps({k: v for k, v in out.items() if k != "items"}), out["items"])
    where = os.environ.get("ZO_GPU_MEASURE_DIR")        # tools/gpu_proof.py reads it, pass or fail
    if where:
        with open(os.path.join(where, f"device_memory_{precision}-{attention_backend}.json"), "w") as f:
            json.dump(out, f, indent=1)
    assert out["before_engine"] == 0, "the fp32 model must be built on the host"
    # model states: the planner's bytes, exactly up to the allocator's 512-byte rounding
    assert out["after_build"] <= out["planned_states"] * 1.01, out
    assert out["accounted"] <= out["planned_states"] * 1.01, out
    # activations: an estimate (validated on the CPU within -11%..+2% of torch's peak); on the H100 it
    # measured 3.4% under this shape's transient peak, which the planner's 1 GiB CUDA-overhead budget
    # (cuBLAS workspace, NCCL buffers) absorbs in a real plan: both stated here
    transient = out["peak"] - out["after_build"]
    print(f"transient peak {transient} vs planned {out['planned_transient']} "
          f"({transient / out['planned_transient'] - 1:+.1%})")
    assert transient <= out["planned_transient"] * 1.10, out
    assert out["peak"] <= out["planned_total"], out
    # NVML (issue 34, 2.7): what the process holds on the GPU, context and caches included, against
    # the plan with its CUDA-overhead budget; printed where NVML's per-process count is unavailable
    if out["nvml"] is None:
        print("NVML per-process memory unavailable here: the plan's overhead budget is not checked")
    else:
        print(f"NVML process memory {out['nvml']} vs planned total {out['planned_total']}")
        assert out["nvml"] <= out["planned_total"], (
            f"NVML process memory {out['nvml']} > the plan's device total {out['planned_total']} (its "
            f"framework_overhead {out['items']['framework_overhead']}); allocator peak {out['peak']}, "
            f"reserved peak {out['reserved']}")


def _run(args, tmp_path, timeout=600):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_", "TORCHELASTIC"))}
    env["ZO_MEGATRON_CACHE"] = str(tmp_path / "cache")
    env["PYTHONPATH"] = ROOT
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", SCRIPT, *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("offload", [True, False], ids=["zero-offload", "ddp-baseline"])
def test_pretrain_gpt_20_iterations_with_eval_and_checkpoint(tmp_path, offload):
    log, save = tmp_path / "log.jsonl", tmp_path / "ckpt"
    args = ["--num-layers", "2", "--hidden-size", "128", "--num-attention-heads", "4", "--seq-length", "128",
            "--micro-batch-size", "4", "--train-iters", "20", "--lr", "3e-3", "--lr-warmup-iters", "2",
            "--min-lr", "3e-4", "--lr-decay-style", "cosine", "--log-interval", "5", "--eval-interval", "10",
            "--eval-iters", "2", "--save", str(save), "--save-interval", "10", "--log-jsonl", str(log),
            "--no-progress-bar", "--bf16"] + (["--zero-offload"] if offload else [])
    r = _run(args, tmp_path)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    expect_device = "cuda" if torch.cuda.is_available() else "cpu"
    assert f"device {expect_device}" in r.stdout, r.stdout[:2000]
    assert "NO --data-path GIVEN: training on the bundled demo corpus" in r.stdout
    rows = [json.loads(line) for line in open(log)]
    train = [x for x in rows if x["kind"] == "train"]
    evals = [x for x in rows if x["kind"] != "train"]
    assert [x["iteration"] for x in train] == [5, 10, 15, 20]
    assert all(x["loss"] == x["loss"] for x in train) and train[-1]["loss"] < train[0]["loss"]
    assert len(evals) >= 2
    if expect_device == "cuda":
        assert all(x["device_peak_bytes"] > 0 for x in train)
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "20"
    assert (save / "iter_0000010").is_dir() and (save / "iter_0000020").is_dir()
    # resume from the checkpoint on the GPU: 5 more iterations, keeping the finished schedule (a longer
    # --train-iters alone is refused, as in Megatron: the decay must match the checkpoint's)
    r2 = _run(args[:args.index("--train-iters") + 1] + ["25"] + args[args.index("--train-iters") + 2:]
              + ["--lr-decay-iters", "20", "--load", str(save)], tmp_path)
    assert r2.returncode == 0, r2.stdout[-4000:] + r2.stderr[-4000:]
    assert "resumed from" in r2.stdout
