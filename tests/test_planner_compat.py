"""The planner, the job and the tool agree with each other and with Megatron (issue 17, items 7-9
and 11): --ffn-hidden-size counts, one PlanInput builder, copy-pasteable suggestions, the host
memory limit of a cgroup or a SLURM allocation."""
import argparse
import random
import re
import sys
from pathlib import Path

import pytest

from tests.megatron_reference import megatron_flops_per_token
from tests.seeds import fresh_seed
from zo_megatron import planner as P
from zo_megatron.parallel.launch_env import memory_limit_bytes
from zo_megatron.training.arguments import parse_args

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))
import estimate_memory  # noqa: E402

HARDWARE = ("gpu_memory_bytes", "host_memory_bytes_per_node", "gpus_per_node", "device_overhead_bytes",
            "host_overhead_bytes_per_rank", "host_overhead_bytes_per_node", "host_reserve_bytes", "device_is_host",
            "fragmentation")


@pytest.mark.parametrize("ffn_mult", [None, 3, 8])
def test_ffn_hidden_size_in_param_count_matches_huggingface(ffn_mult):
    transformers = pytest.importorskip("transformers")
    h = 64
    f = None if ffn_mult is None else ffn_mult * h
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=3, n_embd=h, n_head=4, vocab_size=1000,
                                                                 n_positions=128, n_inner=f))
    p = P.plan(P.PlanInput(num_layers=3, hidden_size=h, num_attention_heads=4, vocab_size=1000, seq_length=128,
                           ffn_hidden_size=f, make_vocab_size_divisible_by=1))
    assert p.params_total == sum(t.numel() for t in model.parameters())
    # per TP rank: the split parameters (fc1, fc2 included) divide by TP, the rest is replicated
    t2 = P.count_params(3, h, 1024, 128, 2, f)
    assert 2 * t2["per_tp_rank"] == t2["total"] + t2["replicated_per_tp_rank"]


def test_ffn_hidden_size_in_activations_and_buckets():
    base = P.PlanInput(num_layers=2, hidden_size=256, num_attention_heads=4, seq_length=128, micro_batch_size=2,
                       precision="bf16", dropout=False)
    wide = P.plan(base.replace(ffn_hidden_size=8 * 256))
    narrow = P.plan(base)
    s, b, h = 128, 2, 256
    # fc1 output and fc2 input (2 bytes each element) grow with f: 2 x 2 x s b (8h - 4h) per layer
    assert wide.device_items["activations_layers"] - narrow.device_items["activations_layers"] == 2 * 2 * 2 * s * b * 4 * h
    assert wide.params_total - narrow.params_total == 2 * (2 * h * 4 * h + 4 * h)


def test_flops_per_token_follows_megatron_with_any_ffn_and_architecture():
    """Megatron-LM core_v0.16.1's count (transcribed in tests/megatron_reference.py) for random shapes,
    GPT-2 (MHA, GELU) and Llama-family (GQA, SwiGLU, kv_channels)."""
    from zo_megatron.training.metrics import flops_per_token

    rng = random.Random(fresh_seed("flops"))
    for _ in range(100):
        heads = rng.choice([1, 2, 4, 8, 16])
        h = heads * rng.randint(1, 64)
        L, s, V = rng.randint(1, 48), rng.choice([128, 1024, 4096]), rng.randint(1000, 60000)
        f = rng.choice([None, rng.randint(1, 16 * h)])
        llama = rng.random() < 0.5
        groups = rng.choice([g for g in range(1, heads + 1) if heads % g == 0]) if llama else None
        kv = rng.choice([None, rng.randint(1, 128)]) if llama else None
        swiglu = llama and rng.random() < 0.8
        ffn = f or (int(4 * h * 2 / 3 / 64) * 64 if swiglu else 4 * h)
        want = megatron_flops_per_token(num_layers=L, hidden_size=h, seq_length=s, ffn_hidden_size=ffn,
                                        padded_vocab_size=V, num_attention_heads=heads, kv_channels=kv,
                                        num_query_groups=groups, swiglu=swiglu)
        got = flops_per_token(L, h, s, V, None, f, num_attention_heads=heads, num_query_groups=groups,
                              kv_channels=kv, swiglu=swiglu)
        assert got == pytest.approx(want, rel=1e-12), (L, h, s, V, f, heads, groups, kv, swiglu)
        if not llama:      # GPT-2 needs no head count
            assert flops_per_token(L, h, s, V, None, f) == got


def _matmul_flops_by_hand(L, h, a, s, V, f, groups=None, d=None, swiglu=False):
    """FLOPs of one sequence's forward + backward, counted GEMM by GEMM (2mnk each; backward = 2 x
    forward). Causal attention: Megatron counts half of the s x s score and probs @ V products.
    Independent of the formula's algebra: a list of GEMMs."""
    d = d or h // a
    g = groups or a
    gemms = [(s, (a + 2 * g) * d, h, False)]               # linear_qkv (m, n, k, causal)
    gemms += [(s, s, d, True)] * a                         # scores Q K^T, per head
    gemms += [(s, d, s, True)] * a                         # probs @ V, per head
    gemms.append((s, h, a * d, False))                     # linear_proj
    gemms.append((s, 2 * f if swiglu else f, h, False))    # linear_fc1 ([gate; up] with SwiGLU)
    gemms.append((s, h, f, False))                         # linear_fc2
    per_layer = sum(2 * m * n * k // (2 if causal else 1) for m, n, k, causal in gemms)
    head = 2 * s * V * h                                   # the LM head
    return 3 * (L * per_layer + head)


@pytest.mark.parametrize("shape", [
    dict(L=2, h=64, a=4, s=16, V=128, f=256),                                        # GPT-2 shape
    dict(L=3, h=96, a=6, s=32, V=256, f=384),                                        # GPT-2, odd sizes
    dict(L=2, h=64, a=8, s=16, V=128, f=192, groups=2, swiglu=True),                 # Llama: GQA + SwiGLU
    dict(L=2, h=64, a=4, s=24, V=384, f=160, groups=1, d=32, swiglu=True),           # MQA, kv_channels != h/a
])
def test_flops_per_token_equals_a_gemm_by_gemm_count(shape):
    """Exact integers for small shapes: the GEMMs of one sequence, counted one by one, / seq."""
    from zo_megatron.training.metrics import flops_per_token

    want = _matmul_flops_by_hand(**shape)
    s = shape["s"]
    assert want % s == 0
    got = flops_per_token(shape["L"], shape["h"], s, shape["V"], None, shape["f"], num_attention_heads=shape["a"],
                          num_query_groups=shape.get("groups"), kv_channels=shape.get("d"),
                          swiglu=shape.get("swiglu", False))
    assert isinstance(got, int) and got == want // s
    # GPT-2 before this fix counted the attention products in full: 4sh more per layer-forward
    if "groups" not in shape:
        L, h = shape["L"], shape["h"]
        full = want + 3 * L * 2 * s * s * h                # the other half of the s x s products
        assert full // s - got == 3 * L * 2 * s * h


def _job_input(argv, dp, **env):
    from zo_megatron.training.arguments import check_batch_sizes
    from zo_megatron.training.prelaunch import job_plan_input

    args = parse_args(argv)
    check_batch_sizes(args, dp)
    return job_plan_input(args, argparse.Namespace(local_world_size=dp * args.tensor_parallel), dp, 50257)


@pytest.mark.parametrize("argv", [
    ["--num-layers", "24", "--hidden-size", "2048", "--num-attention-heads", "16", "--seq-length", "2048",
     "--train-iters", "10", "--lr", "1e-4", "--bf16", "--zero-offload", "--micro-batch-size", "4"],
    ["--num-layers", "4", "--hidden-size", "512", "--num-attention-heads", "8", "--seq-length", "512",
     "--train-iters", "10", "--lr", "1e-4", "--fp16", "--ffn-hidden-size", "1536", "--recompute-activations",
     "--tensor-model-parallel-size", "2", "--global-batch-size", "16", "--hidden-dropout", "0.1",
     "--zero-offload", "--exp-avg-dtype", "bf16", "--exp-avg-sq-dtype", "bf16", "--accumulate-grads-on-host"],
    ["--num-layers", "2", "--hidden-size", "128", "--num-attention-heads", "4", "--seq-length", "128",
     "--train-iters", "10", "--lr", "1e-4", "--fp32", "--recompute-granularity", "full", "--bucket-size", "1000"],
    ["--num-layers", "4", "--hidden-size", "512", "--num-attention-heads", "8", "--seq-length", "512",
     "--train-iters", "10", "--lr", "1e-4", "--bf16", "--zero-offload", "--tensor-model-parallel-size", "2",
     "--position-embedding-type", "rope", "--rotary-base", "500000", "--normalization", "RMSNorm",
     "--norm-epsilon", "1e-6", "--swiglu", "--group-query-attention", "--num-query-groups", "2",
     "--untie-embeddings-and-output-weights", "--disable-bias-linear", "--add-qkv-bias", "--qk-layernorm"],
    ["--num-layers", "4", "--hidden-size", "512", "--num-attention-heads", "8", "--seq-length", "1024",
     "--train-iters", "10", "--lr", "1e-4", "--bf16", "--zero-offload", "--tensor-model-parallel-size", "4",
     "--use-flash-attn", "--sequence-parallel", "--attention-dropout", "0.1"],
    ["--num-layers", "4", "--hidden-size", "512", "--num-attention-heads", "8", "--seq-length", "1024",
     "--train-iters", "10", "--lr", "1e-4", "--bf16", "--attention-backend", "flash", "--sequence-parallel"],
])
def test_job_and_tool_plan_the_same_run(argv):
    dp = 2
    job = _job_input(argv, dp)
    # the same command line, less the flags the tool has no use for
    tool_args = [a for i, a in enumerate(argv) if a not in ("--train-iters", "--lr")
                 and (i == 0 or argv[i - 1] not in ("--train-iters", "--lr"))]
    tool = estimate_memory.build_input(estimate_memory.build_parser().parse_args([*tool_args, "--data-parallel-size",
                                                                                  str(dp)]))
    tool = tool.replace(**{k: getattr(job, k) for k in HARDWARE})
    # the job resolves "fp32 reduction: on for bf16" up front, the tool when planning: same rule
    tool, job = (i.replace(grad_reduce_fp32=i.reduces_in_fp32()) for i in (tool, job))
    assert tool == job
    assert P.plan(tool).device_bytes_per_gpu == P.plan(job).device_bytes_per_gpu
    if "--swiglu" in argv:          # the architecture flags reached both
        assert job.swiglu and job.query_groups() == 2 and job.untie_embeddings_and_output_weights
        assert job.position_embedding_type == "rope" and job.normalization == "RMSNorm" and job.qk_layernorm
        assert not job.add_bias_linear and job.add_qkv_bias
    # --use-flash-attn / --attention-backend flash and --sequence-parallel reached both (SP off at TP 1)
    flash = "--use-flash-attn" in argv or "--attention-backend" in argv
    assert job.attention_backend == ("sdpa" if flash else "local")
    assert job.sp() == ("--sequence-parallel" in argv and job.tensor_parallel > 1)
    assert job.attention_dropout_on() == ("--attention-dropout" in argv)


def _suggestion_cases():
    """(job argv, data parallel, hardware) that do not fit, for every kind of suggestion."""
    small_gpu = dict(gpu_memory_bytes=8 * P.GiB, host_memory_bytes_per_node=1024 * P.GiB, gpus_per_node=8)
    small_host = dict(gpu_memory_bytes=80 * P.GiB, host_memory_bytes_per_node=100 * P.GiB, gpus_per_node=8)
    shape = ["--num-layers", "32", "--hidden-size", "4096", "--num-attention-heads", "32", "--seq-length", "2048",
             "--train-iters", "10", "--lr", "1e-4"]
    return [
        ([*shape, "--fp32", "--micro-batch-size", "8"], 1, small_gpu),
        ([*shape, "--bf16", "--micro-batch-size", "4", "--zero-offload", "--bucket-size", "50000000"], 2, small_gpu),
        ([*shape, "--bf16", "--micro-batch-size", "1", "--zero-offload"], 8, small_host),
        ([*shape, "--bf16", "--micro-batch-size", "8", "--zero-offload", "--tensor-model-parallel-size", "2"], 1,
         small_gpu),
        # issue 35 item 16: accumulation on the host, a shorter sequence, TP on the same ranks (DP 4 -> 2)
        ([*shape, "--bf16", "--micro-batch-size", "1", "--global-batch-size", "32", "--zero-offload",
          "--recompute-granularity", "full"], 4, dict(small_gpu, gpu_memory_bytes=32 * P.GiB, gpus_per_node=4)),
        (["--num-layers", "4", "--hidden-size", "1024", "--num-attention-heads", "16", "--seq-length", "16384",
          "--train-iters", "10", "--lr", "1e-4", "--bf16", "--zero-offload"], 1, dict(small_gpu, gpus_per_node=1)),
    ]


def test_every_suggested_flag_is_a_real_pretrain_gpt_flag_that_does_what_it_says():
    seen = set()
    n = 0
    for argv, dp, hw in _suggestion_cases():
        args = parse_args(argv)
        base = P.plan_input_from_flags(args, data_parallel=dp, vocab_size=50257, **hw)
        p = P.plan(base)
        assert not p.fits and p.suggestions
        for s in p.suggestions:
            spans = re.findall(r"`([^`]+)`", s)
            if not spans:
                assert "--" not in s.replace("drop --dpu", ""), f"a flag outside backticks: {s}"
                continue
            flags = spans[0].split()
            given = argv
            if {"--bf16", "--fp16", "--fp32"} & set(flags):       # precision flags replace each other
                given = [a for a in argv if a not in ("--bf16", "--fp16", "--fp32")]
            new = parse_args([*given, *flags])                    # parses, and passes the job's checks
            seen.update(f for f in flags if f.startswith("--"))
            same_ranks = re.search(r"launched on the same (\d+) ranks: DP (\d+)", s)   # TP up, DP down
            changed = P.plan_input_from_flags(new, data_parallel=int(same_ranks.group(2)) if same_ranks else dp,
                                              vocab_size=50257, **hw)
            assert s.endswith(P._describe(P.plan(changed))), (s, P._describe(P.plan(changed)))
            n += 1
    assert n >= 6
    assert {"--zero-offload", "--recompute-granularity", "--micro-batch-size", "--tensor-model-parallel-size",
            "--bf16", "--bucket-size", "--exp-avg-dtype", "--exp-avg-sq-dtype", "--use-flash-attn",
            "--sequence-parallel", "--accumulate-grads-on-host", "--seq-length", "--global-batch-size"} <= seen, seen


# ------------------------------------------------------------------------------------------------
# host memory limit (item 11)

def _fake(tmp_path, cgroup, files):
    (tmp_path / "proc/self").mkdir(parents=True)
    (tmp_path / "proc/self/cgroup").write_text(cgroup)
    for rel, text in files.items():
        f = tmp_path / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(text + "\n")
    return str(tmp_path)


GiB = P.GiB


@pytest.mark.parametrize("cgroup, files, env, want", [
    ("0::/\n", {}, {}, 64 * GiB),                                                        # nothing: physical
    ("0::/\n", {"sys/fs/cgroup/memory.max": "max"}, {}, 64 * GiB),
    ("0::/job/step\n", {"sys/fs/cgroup/job/step/memory.max": str(20 * GiB)}, {}, 20 * GiB),      # v2
    ("0::/job/step\n", {"sys/fs/cgroup/job/memory.max": str(12 * GiB),                            # parent binds
                        "sys/fs/cgroup/job/step/memory.max": "max"}, {}, 12 * GiB),
    ("12:memory:/slurm/job_7\n3:cpu,cpuacct:/slurm/job_7\n",                                      # v1
     {"sys/fs/cgroup/memory/slurm/job_7/memory.limit_in_bytes": str(30 * GiB)}, {}, 30 * GiB),
    ("12:memory:/\n", {"sys/fs/cgroup/memory/memory.limit_in_bytes": str(9223372036854771712)}, {}, 64 * GiB),
    ("0::/\n", {}, {"SLURM_MEM_PER_NODE": "16384"}, 16 * GiB),                            # srun --mem=16G
    ("0::/\n", {}, {"SLURM_MEM_PER_NODE": "0"}, 64 * GiB),                                # --mem=0: whole node
    ("0::/\n", {}, {"SLURM_MEM_PER_CPU": "2048", "SLURM_CPUS_ON_NODE": "6"}, 12 * GiB),   # --mem-per-cpu=2G
    ("0::/a\n", {"sys/fs/cgroup/a/memory.max": str(10 * GiB)}, {"SLURM_MEM_PER_NODE": "16384"}, 10 * GiB),
])
def test_memory_limit_from_cgroup_and_slurm(tmp_path, cgroup, files, env, want):
    root = _fake(tmp_path, cgroup, files)
    assert memory_limit_bytes(env, root=root, physical_bytes=64 * GiB) == want


def test_the_jobs_memory_check_uses_the_slurm_limit(monkeypatch):
    monkeypatch.setenv("SLURM_MEM_PER_NODE", "3000")
    argv = ["--num-layers", "2", "--hidden-size", "128", "--num-attention-heads", "4", "--seq-length", "128",
            "--train-iters", "10", "--lr", "1e-4", "--fp32"]
    inp = _job_input(argv, 1)
    assert inp.host_memory_bytes_per_node == min(3000 * 1024 ** 2, memory_limit_bytes({}))
