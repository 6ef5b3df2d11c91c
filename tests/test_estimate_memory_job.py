"""tools/estimate_memory.py takes the job's command line and resolves it as the job does (issue 34,
item 1): every pretrain_gpt.py flag, the job's defaults on the target device (demo model, bf16 on
a GPU, the host reserve), the tokenizer's vocabulary, --optimizer-offload-fraction auto and the
CPU-step overlap (--overlap-cpu-step [auto|full], --overlap-cpu-step-memory, --no-overlap-cpu-step;
default auto on a GPU, off where the device is the host), compared with the job's own
training/prelaunch.job_plan (CUDA mocked for a GPU target); --json's overlap_speculated_fraction, the
table's overlap lines, and --max-model, which the overlap never shrinks."""
from __future__ import annotations

import importlib.util
import json
import math
import random
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import pytest
import torch

from tests.hf_tokenizer import HF_VOCAB_SIZE
from tests.seeds import fresh_seed
from zo_megatron import planner as P
from zo_megatron.errors import UserError

ROOT = Path(__file__).resolve().parents[1]
CLI = ROOT / "tools" / "estimate_memory.py"
GiB = P.GiB


def _tool():
    spec = importlib.util.spec_from_file_location("estimate_memory", CLI)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool


E = _tool()
SHAPE = ["--num-layers", "24", "--hidden-size", "2048", "--num-attention-heads", "16", "--seq-length", "2048"]


def run(capsys, *argv):
    """main() in-process: (exit status, stdout, stderr)."""
    capsys.readouterr()
    rc = E.main([str(a) for a in argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def plan(*argv):
    return E.job_plan(E.build_parser().parse_args([str(a) for a in argv]))


def job_reference(job_argv, *, world, per_node, host_bytes, gpu_bytes, vocab=50257):
    """(plan, args) of training/prelaunch.job_plan for this command line; gpu_bytes None: a CPU device."""
    from zo_megatron.training import prelaunch
    from zo_megatron.training.arguments import check_batch_sizes, parse_args

    cuda = gpu_bytes is not None
    props = SimpleNamespace(total_memory=gpu_bytes)
    with mock.patch.object(torch.cuda, "is_available", return_value=cuda), \
            mock.patch.object(torch.cuda, "get_device_properties", return_value=props):
        args = parse_args(job_argv)
        dp = world // args.tensor_parallel
        check_batch_sizes(args, dp)
        p = prelaunch.job_plan(args, SimpleNamespace(local_world_size=per_node), dp, vocab, host_bytes)
    return p, args


# ------------------------------------------------------------------------------------------------
# the job's command line

def test_every_job_flag_is_accepted_with_the_jobs_definition():
    from zo_megatron.training.arguments import build_parser

    job = {o: a for a in build_parser()._actions for o in a.option_strings}
    tool = {o: a for a in E.build_parser()._actions for o in a.option_strings}
    missing = sorted(set(job) - set(tool))
    assert not missing, missing
    for o, a in job.items():
        b = tool[o]
        assert (b.dest, type(b), b.choices, b.nargs, b.const) == (a.dest, type(a), a.choices, a.nargs, a.const), o
        if a.dest not in ("seq_length",):       # the tool's only different default: documented
            assert b.default == a.default, o


def test_flags_that_do_not_change_memory_are_accepted_and_ignored(tmp_path):
    base = [*SHAPE, "--zero-offload", "--bf16", "--world-size", 8, "--gpus-per-node", 8, "--micro-batch-size", 2]
    noise = ["--train-iters", 100, "--lr", "3e-4", "--min-lr", "3e-5", "--lr-decay-style", "cosine",
             "--lr-warmup-iters", 10, "--weight-decay", 0.1, "--adam-beta2", 0.95, "--clip-grad", 1.0,
             "--seed", 7, "--data-path", tmp_path / "data", "--split", "949,50,1", "--save", tmp_path / "ck",
             "--load", tmp_path / "ck", "--save-interval", 50, "--eval-interval", 50, "--eval-iters", 2,
             "--log-interval", 1, "--log-jsonl", tmp_path / "log.jsonl", "--tensorboard-dir", tmp_path / "tb",
             "--no-pin-memory", "--cpu-adam-threads", 4, "--timeline", tmp_path / "t.jsonl",
             "--distributed-timeout-minutes", 3, "--initial-loss-scale", 65536, "--exit-signal-handler"]
    a, ai = plan(*base)
    b, bi = plan(*base, *noise)
    assert a.input == b.input and ai == bi
    assert not (tmp_path / "ck").exists()      # nothing created


def test_defaults_are_the_jobs_on_the_target_device():
    # no shape: the job's demo model (4 x 256 x 4, seq 256, micro-batch 8)
    p, _ = plan("--tensor-parallel", 2, "--world-size", 2, "--zero-offload", "--preset", "cpu",
                "--host-memory-gb", 16)
    i = p.input
    assert (i.num_layers, i.hidden_size, i.num_attention_heads, i.seq_length, i.micro_batch_size) == (4, 256, 4, 256, 8)
    assert i.device_is_host and i.gpu_memory_bytes == i.host_memory_bytes_per_node == 16 * GiB
    assert i.host_reserve_bytes == int(1.6 * GiB)                   # the job's: a tenth of the host
    from zo_megatron.training.cpu_precision import default_precision    # the job's own choice on this CPU
    with mock.patch.object(torch.cuda, "is_available", return_value=False):
        assert i.precision == default_precision()[0]
    # a GPU: bf16, Megatron's defaults with a shape (micro-batch 1), seq 1024 when not given
    p, _ = plan("--num-layers", 2, "--hidden-size", 256, "--num-attention-heads", 4, "--host-memory-gb", 100)
    i = p.input
    assert (i.precision, i.micro_batch_size, i.seq_length, i.device_is_host) == ("bf16", 1, 1024, False)
    assert i.reduces_in_fp32() and i.host_reserve_bytes == 10 * GiB
    assert plan("--model", "13b", "--host-memory-gb", 1000)[0].input.host_reserve_bytes == 32 * GiB
    assert plan("--model", "13b", "--preset", "dgx2")[0].input.precision == "fp16"     # the preset's V100


def _draw(rng):
    """A random job command line and machine (some combinations are refused by the job)."""
    heads = rng.choice([8, 16, 32])
    tp = rng.choice([1, 2, 4, 8])
    dp = rng.choice([1, 2, 4])
    mb = rng.choice([1, 2, 4])
    argv = ["--num-layers", rng.choice([8, 24, 40]), "--hidden-size", heads * rng.choice([64, 128]),
            "--num-attention-heads", heads, "--seq-length", rng.choice([1024, 2048, 4096]),
            "--train-iters", 10, "--lr", "1e-4", "--tensor-model-parallel-size", tp, "--micro-batch-size", mb,
            "--global-batch-size", mb * dp * rng.choice([1, 1, 2])]
    argv += [rng.choice(["--bf16", "--fp16", "--fp32"])] if rng.random() < 0.8 else []
    arch = rng.random()
    if arch < 0.4:
        argv += ["--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
                 "--group-query-attention", "--num-query-groups", 8, "--untie-embeddings-and-output-weights",
                 "--disable-bias-linear"]
    elif arch < 0.55:       # GPT-OSS's parts: quick GeGLU clamped and offset, biases, attention sinks
        argv += ["--quick-geglu", "--glu-linear-offset", 1.0, "--activation-func-clamp-value", 7.0,
                 "--softmax-type", rng.choice(["learnable", "off-by-one"]), "--normalization", "RMSNorm",
                 "--position-embedding-type", "rope", "--group-query-attention", "--num-query-groups", 8,
                 "--untie-embeddings-and-output-weights"]
    elif arch < 0.6:
        argv += ["--squared-relu"]
    argv += rng.choice([[], ["--recompute-granularity", "full"], ["--recompute-activations"]])
    argv += rng.choice([[], ["--use-flash-attn"], ["--use-flash-attn", "--sequence-parallel"]])
    if rng.random() < 0.85:
        argv += ["--zero-offload"]
        argv += rng.choice([[], [], ["--exp-avg-dtype", "bf16", "--exp-avg-sq-dtype", "bf16"]])
        argv += rng.choice([[], [], [], ["--overlap-cpu-step"], ["--overlap-cpu-step", "auto"],
                            ["--no-overlap-cpu-step"], ["--overlap-cpu-step-memory", f"{rng.choice([1, 8, 40])}GiB"],
                            ["--dpu"], ["--optimizer-offload-fraction", "auto"],
                            ["--optimizer-offload-fraction", "0.5"]])
    machine = dict(world=tp * dp, per_node=tp * dp if rng.random() < 0.7 else tp,
                   host_bytes=rng.choice([64, 256, 1024, 1536]) * GiB,
                   gpu_bytes=rng.choice([None, 16 * GiB, 32510 * P.MiB, int(79.1 * GiB)]))
    return [str(a) for a in argv], machine


def test_random_command_lines_plan_as_the_job(capsys):
    with capsys.disabled():                    # printed where run()'s captures do not take it
        seed = fresh_seed("estimate_memory vs job_plan")
    rng = random.Random(seed)
    compared = refused = 0
    for _ in range(40):
        argv, m = _draw(rng)
        hw = ["--world-size", m["world"], "--gpus-per-node", m["per_node"], "--host-memory-gb", m["host_bytes"] / GiB]
        hw += ["--preset", "cpu"] if m["gpu_bytes"] is None else ["--gpu-memory-gb", m["gpu_bytes"] / GiB]
        try:
            job, jargs = job_reference(argv, **m)
        except (UserError, ValueError) as e:       # the job refuses it: so does the tool, in one line
            rc, out, err = run(capsys, *argv, *hw)
            lines = err.strip().splitlines()      # the job's own warnings (SP off at TP 1), then one line
            assert rc == 2 and out == "" and lines[-1].startswith("estimate_memory.py: error: "), (seed, argv, e, err)
            assert all(ln.startswith("warning: ") for ln in lines[:-1]), (seed, err)
            refused += 1
            continue
        est, info = plan(*argv, *hw)
        assert est.input == job.input, (seed, argv, m)
        assert info["overlap_speculated_fraction"] == jargs.overlap_speculated_fraction, (seed, argv)
        assert info["overlap_reason"] == jargs.overlap_reason
        if "optimizer_offload_fraction_reason" in info:
            assert info["optimizer_offload_fraction_reason"] == jargs.offload_fraction_reason
        assert (est.fits, est.device_bytes_per_gpu, est.host_bytes_per_node) == \
            (job.fits, job.device_bytes_per_gpu, job.host_bytes_per_node)
        compared += 1
    assert compared >= 20, (seed, compared, refused)


def test_tokenizer_flags_give_the_jobs_vocabulary(capsys, hf_tokenizer_dir):
    tok = ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", hf_tokenizer_dir]
    assert plan(*SHAPE, *tok)[0].input.vocab_size == HF_VOCAB_SIZE
    assert plan(*SHAPE, *tok, "--vocab-size", 3000)[0].input.vocab_size == 3000
    assert plan(*SHAPE, "--model", "llama3-8b", *tok)[0].input.vocab_size == HF_VOCAB_SIZE   # the file, not the preset
    assert plan("--model", "llama3-8b")[0].input.vocab_size == 128256
    assert plan(*SHAPE)[0].input.vocab_size == 50257           # the bundled GPT-2 tokenizer
    for bad, words in ([[*tok, "--vocab-size", HF_VOCAB_SIZE - 1], "smaller than the tokenizer's"],
                       [["--tokenizer-type", "HuggingFaceTokenizer"], "needs --tokenizer-model"],
                       [["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", "/nonexistent/tok"],
                        "/nonexistent/tok"]):
        rc, out, err = run(capsys, *SHAPE, *bad)
        assert rc == 2 and out == "" and len(err.strip().splitlines()) == 1 and words in err, err


# ------------------------------------------------------------------------------------------------
# the CPU-step overlap: modes, --json and the table

H100 = ["--preset", "h100-80gb", "--gpus-per-node", 1, "--model", "llama3-8b", "--seq-length", 8192,
        "--recompute-granularity", "full", "--use-flash-attn", "--zero-offload", "--host-memory-gb", 192]


def test_overlap_modes_and_json(capsys):
    rc, out, _ = run(capsys, *H100, "--json")
    d = json.loads(out)
    keys = list(d)
    assert keys[keys.index("fits") + 1] == "overlap_speculated_fraction"     # beside fits
    for k in ("fits", "device_bytes_per_gpu", "host_bytes_per_node", "device_items", "host_items", "reasons",
              "suggestions", "input", "params_total", "architecture", "overlap_reason"):
        assert k in d, k
    pre = E.build_input(E.build_parser().parse_args([str(a) for a in H100]))
    want, reason = P.resolve_overlap(pre, None)
    assert 0 < d["overlap_speculated_fraction"] == want < 1 and d["overlap_reason"] == reason
    assert rc == 0 and d["fits"] and d["host_items"]["overlap_rollback"] > 0
    assert d["input"]["overlap_speculated_fraction"] == want and d["input"]["overlap_cpu_step"]

    off = json.loads(run(capsys, *H100, "--no-overlap-cpu-step", "--json")[1])
    assert off["overlap_speculated_fraction"] == 0.0 and "overlap_rollback" not in off["host_items"]
    rc, out, _ = run(capsys, *H100, "--overlap-cpu-step", "--json")       # alone: full
    full = json.loads(out)
    assert full["overlap_speculated_fraction"] == 1.0 and not full["fits"] and rc == 1
    assert json.loads(run(capsys, *H100, "--overlap-cpu-step", "auto", "--json")[1])[
        "overlap_speculated_fraction"] == want
    per_rank = P.overlap_full_bytes_per_rank(pre)
    mem = json.loads(run(capsys, *H100, "--overlap-cpu-step-memory", "20GiB", "--json")[1])
    assert mem["overlap_speculated_fraction"] == math.floor(min(1.0, 20 * GiB / per_rank) * 100) / 100 > 0
    # where the device is the host the default is off; without ZeRO-Offload there is nothing to overlap
    cpu = json.loads(run(capsys, "--preset", "cpu", "--world-size", 2, "--tensor-parallel", 2, "--zero-offload",
                         "--json")[1])
    assert cpu["overlap_speculated_fraction"] == 0.0 and cpu["overlap_reason"].startswith("CPU step overlap off")
    ddp = json.loads(run(capsys, "--model", "1.3b", "--json")[1])
    assert ddp["overlap_speculated_fraction"] == 0.0 and "no --zero-offload" in ddp["overlap_reason"]
    rc, out, err = run(capsys, *H100, "--overlap-cpu-step-memory", "8GiB", "--no-overlap-cpu-step")
    assert rc == 2 and out == "" and "drop one of them" in err and len(err.strip().splitlines()) == 1


def test_table_shows_the_overlap(capsys):
    rc, out, _ = run(capsys, *H100)
    pre = E.build_input(E.build_parser().parse_args([str(a) for a in H100]))
    f, reason = P.resolve_overlap(pre, None)
    assert f"  overlap    {reason}\n" in out
    assert f"  CPU step   overlapped with backward (--overlap-cpu-step): {f:.0%} of each rank's host partition" in out
    assert "overlap_rollback" in out
    rc, out, _ = run(capsys, *H100, "--no-overlap-cpu-step")
    assert "  CPU step   synchronous" in out and "  overlap    CPU step overlap off (--no-overlap-cpu-step)" in out
    assert "  CPU step   CPU Adam one step behind" in run(capsys, *H100, "--dpu")[1]


def test_max_model_is_not_shrunk_by_the_overlap(capsys):
    """Searched with the overlap off, then `auto` resolved on the result: the largest model is the
    one without the overlap, and its share is what `auto` leaves room for; an explicit `full`
    searches with the whole partition speculated (a smaller model)."""
    base = ["--preset", "v100-32gb", "--hidden-size", 4096, "--num-attention-heads", 32, "--recompute-granularity",
            "full", "--zero-offload", "--host-memory-gb", 384, "--max-model", "layers", "--json"]
    auto = json.loads(run(capsys, *base)[1])
    off = json.loads(run(capsys, *base, "--no-overlap-cpu-step")[1])
    assert auto["max_params"] == off["max_params"] > 0 and auto["max_shape"] == off["max_shape"]
    best = E.build_input(E.build_parser().parse_args([str(a) for a in base])).replace(**auto["max_shape"])
    assert auto["overlap_speculated_fraction"] == P.resolve_overlap(best, None)[0]
    assert auto["fits"] and off["overlap_speculated_fraction"] == 0.0
    full = json.loads(run(capsys, *base, "--overlap-cpu-step")[1])
    assert 0 < full["max_params"] < auto["max_params"] and full["fits"]
    assert full["overlap_speculated_fraction"] == 1.0
    mem = json.loads(run(capsys, *base, "--overlap-cpu-step-memory", "16GiB")[1])
    assert full["max_params"] <= mem["max_params"] <= auto["max_params"] and mem["fits"]


def test_cli_exit_status_and_one_line_errors():
    def cli(*args):
        return subprocess.run([sys.executable, str(CLI), *map(str, args)], capture_output=True, text=True,
                              timeout=120, cwd=ROOT)

    r = cli(*H100, "--overlap-cpu-step")          # the whole partition does not fit 192 GiB: the verdict
    assert r.returncode == 1 and "DOES NOT FIT" in r.stdout and "--overlap-cpu-step auto" in r.stdout
    r = cli("--model", "13b", "--overlap-cpu-step")    # the job's refusal, in one line
    assert r.returncode == 2 and r.stdout == "" and "add --zero-offload" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
