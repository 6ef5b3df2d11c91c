"""The planner's advice and its edges (issue 35, item 16): suggestions never need more devices than
the job has and include `--accumulate-grads-on-host` and a shorter `--seq-length` where those are
what helps; a plan within the planner's measured error of its budget says so; the OS reserve
scales with the host; `--max-model hidden` grows a Llama into a Llama. Planner only: milliseconds
(estimate_memory.py's --max-model in-process, about a second)."""
from __future__ import annotations

import math
import random
import re

from tests.cli import run_tool
from tests.seeds import fresh_seed
from zo_megatron import planner as P
from zo_megatron.planner import GiB, MiB, PlanInput, plan

TP_OFFER = re.compile(r"raise tensor parallel to (\d+) .*?launched on (?:the same )?(\d+) ranks")


def _activation_bytes(p: P.Plan) -> int:
    return sum(v for k, v in p.device_items.items() if k.startswith(("activations", "logits"))
               or k == "allocator_fragmentation")


def test_tp_offers_never_need_more_devices_than_the_job_has():
    # the case: one GPU (a one-GPU node, or the job's one rank) gets no TP 2/4 offer
    one_gpu = plan(PlanInput(**P.model_preset("13b"), micro_batch_size=4, precision="fp16", zero_offload=False,
                             recompute="full", gpus_per_node=1, host_memory_bytes_per_node=1536 * GiB))
    assert not one_gpu.fits_device and one_gpu.suggestions
    assert not [s for s in one_gpu.suggestions if "tensor parallel" in s], one_gpu.suggestions
    rng = random.Random(fresh_seed("planner TP offers"))
    offered = 0
    for _ in range(60):
        heads = rng.choice([16, 32, 64])
        tp, dp = rng.choice([1, 2]), rng.choice([1, 2, 4])
        per_node = rng.choice([None, 1, 2, 4, 8, 16])
        mb = rng.choice([1, 2, 8])
        inp = PlanInput(num_layers=rng.randint(8, 48), hidden_size=heads * 128, num_attention_heads=heads,
                        seq_length=rng.choice([1024, 4096]), micro_batch_size=mb, tensor_parallel=tp,
                        data_parallel=dp, grad_accum_steps=rng.choice([1, 4]), gpus_per_node=per_node,
                        gpu_memory_bytes=rng.choice([16, 40, 80]) * GiB, precision="bf16")
        p = plan(inp)
        world = tp * dp
        # the devices the job occupies: its ranks, or the whole nodes they sit on
        devices = world if per_node is None else max(world, math.ceil(world / per_node) * per_node)
        global_batch = mb * inp.grad_accum_steps * dp
        for s in p.suggestions:
            m = TP_OFFER.search(s)
            if "tensor parallel" not in s:
                continue
            assert m, s
            t, ranks = int(m.group(1)), int(m.group(2))
            offered += 1
            assert ranks <= devices and ranks % t == 0 and t <= (per_node or devices), (s, inp)
            if "the same" in s:          # a re-layout keeps the global batch
                assert f"--global-batch-size {global_batch}" in s and ranks == world, s
    assert offered > 0


def test_accumulating_on_the_host_is_offered_where_it_lowers_the_need():
    base = PlanInput(num_layers=40, hidden_size=5120, num_attention_heads=40, seq_length=1024, micro_batch_size=1,
                     grad_accum_steps=8, precision="bf16", recompute="full", gpus_per_node=1,
                     gpu_memory_bytes=40 * GiB, host_memory_bytes_per_node=1024 * GiB)
    p = plan(base)
    kept = p.device_items["grads_kept_across_microbatches"]
    assert not p.fits_device and p.device_bytes_per_gpu - kept <= base.gpu_memory_bytes
    offer = [s for s in p.suggestions if "`--accumulate-grads-on-host`" in s]
    assert len(offer) == 1 and offer[0].endswith("-> fits"), p.suggestions
    # without accumulation there is nothing to move, and on a CPU (device = host RAM) moving the fp32
    # gradients into an fp32 host accumulator lowers nothing: not offered
    assert not [s for s in plan(base.replace(grad_accum_steps=1, gpu_memory_bytes=20 * GiB)).suggestions
                if "accumulate-grads-on-host" in s]
    cpu = P.apply_hardware_preset(PlanInput(num_layers=24, hidden_size=2048, num_attention_heads=16, seq_length=256,
                                            grad_accum_steps=4, precision="fp32"), "cpu")
    cpu = plan(cpu.replace(gpu_memory_bytes=12 * GiB, host_memory_bytes_per_node=12 * GiB))
    assert not cpu.fits and cpu.suggestions
    assert not [s for s in cpu.suggestions if "accumulate-grads-on-host" in s], cpu.suggestions


def test_a_shorter_sequence_is_offered_where_the_activations_bind():
    rng = random.Random(fresh_seed("planner shorter sequence"))
    seen = 0
    for _ in range(30):
        heads = rng.choice([8, 16, 32])
        inp = PlanInput(num_layers=rng.randint(4, 24), hidden_size=heads * 128, num_attention_heads=heads,
                        seq_length=rng.choice([4096, 8192, 16384]), micro_batch_size=rng.choice([1, 2]),
                        precision="bf16", gpus_per_node=1, gpu_memory_bytes=rng.choice([16, 24, 40]) * GiB,
                        recompute=rng.choice([None, "selective", "full"]))
        p = plan(inp)
        offer = [s for s in p.suggestions if "`--seq-length" in s]
        over = p.device_bytes_per_gpu - inp.gpu_memory_bytes
        binds = not p.fits and p.fits_host and over <= _activation_bytes(p)
        assert bool(offer) == (binds and any(plan(inp.replace(seq_length=inp.seq_length >> i)).fits
                                             for i in range(1, 14) if inp.seq_length >> i)), (inp, p.suggestions)
        if offer:
            seen += 1
            s = int(re.search(r"--seq-length (\d+)", offer[0]).group(1))
            # the longest halving that fits: it fits, twice it does not
            assert s < inp.seq_length and plan(inp.replace(seq_length=s)).fits and offer[0].endswith("-> fits")
            assert 2 * s == inp.seq_length or not plan(inp.replace(seq_length=2 * s)).fits
    assert seen > 0


def test_margin_warning_near_the_edge():
    """Within PLAN_ERROR_MARGIN (5%: how far measured peaks have been from the plan) of a budget the
    plan fits but warns, naming the margin; with room to spare it does not."""
    assert P.PLAN_ERROR_MARGIN == 0.05
    rng = random.Random(fresh_seed("planner margin"))
    for _ in range(20):
        host = rng.randrange(3 * 1024, 24 * 1024) * MiB
        tmpl = P.apply_hardware_preset(PlanInput(num_layers=1, hidden_size=rng.choice([512, 1024, 2048]),
                                                 num_attention_heads=16, seq_length=32), "cpu")
        tmpl = tmpl.replace(gpu_memory_bytes=host, host_memory_bytes_per_node=host)
        _, shape = P.max_model(tmpl, "layers")
        for k in ((shape["num_layers"], 1) if shape else ()):
            p = plan(tmpl.replace(num_layers=k))
            reserve = p.host_items["os_reserve"]
            planned = p.device_bytes_per_gpu * p.ranks_per_node + p.host_bytes_per_node - reserve
            free = host - reserve - planned
            near = [w for w in p.warnings if w.startswith("near the edge")]
            assert p.fits and bool(near) == (free < 0.05 * planned), (k, free / planned, p.warnings)
            if near:
                assert "5%" in near[0] and "unified" in near[0] and "docs/memory_planner.md" in near[0]
    # a GPU: the device check has its own line
    gpu = PlanInput(num_layers=1, hidden_size=4096, num_attention_heads=32, gpus_per_node=1, recompute="full",
                    precision="fp16")
    for k in (P.max_model(gpu, "layers")[1]["num_layers"], 1):
        p = plan(gpu.replace(num_layers=k))
        free = gpu.gpu_memory_bytes - p.device_bytes_per_gpu
        near = any(w.startswith("near the edge: the device plan") for w in p.warnings)
        assert p.fits and near == (free < 0.05 * p.device_bytes_per_gpu), (k, p.warnings)


def test_the_jobs_banner_carries_the_margin_warning():
    """The job prints the plan's 'near the edge' line in its banner (user_report.plan_warnings)."""
    from types import SimpleNamespace

    from zo_megatron.training import user_report

    tmpl = P.apply_hardware_preset(PlanInput(num_layers=1, hidden_size=512, num_attention_heads=16,
                                             seq_length=32), "cpu").replace(gpu_memory_bytes=6 * GiB,
                                                                            host_memory_bytes_per_node=6 * GiB)
    edge = plan(tmpl.replace(num_layers=P.max_model(tmpl, "layers")[1]["num_layers"]))
    roomy = plan(tmpl.replace(num_layers=1))
    near = [w for w in edge.warnings if w.startswith("near the edge")]
    assert near and not [w for w in roomy.warnings if w.startswith("near the edge")]
    assert user_report.plan_warnings(SimpleNamespace(memory_plan=edge)) == [f" warning: memory plan {near[0]}"]
    assert user_report.plan_warnings(SimpleNamespace(memory_plan=roomy)) == []
    assert user_report.plan_warnings(SimpleNamespace(memory_plan=None)) == []


def test_os_reserve_scales_with_the_host():
    def reserve(**hw):
        return plan(PlanInput(num_layers=2, hidden_size=64, num_attention_heads=4, **hw)).host_items["os_reserve"]

    # a tenth of the host, at least 256 MiB (Linux's own free-memory floor), at most 32 GiB
    assert reserve(host_memory_bytes_per_node=64 * GiB) == 64 * GiB // 10      # 6.4 GiB, not 32
    assert reserve(host_memory_bytes_per_node=1536 * GiB) == 32 * GiB
    assert reserve(host_memory_bytes_per_node=2 * GiB) == 256 * MiB
    assert reserve(host_memory_bytes_per_node=64 * GiB, host_reserve_bytes=GiB) == GiB      # explicit wins
    # the CPU preset follows the same rule (it was a fixed 1 GiB)
    cpu = P.apply_hardware_preset(PlanInput(num_layers=2, hidden_size=64, num_attention_heads=4), "cpu")
    assert plan(cpu.replace(host_memory_bytes_per_node=64 * GiB, gpu_memory_bytes=64 * GiB)) \
        .host_items["os_reserve"] == 64 * GiB // 10
    # estimate_memory.py and the job use it: a 1 GiB CPU machine keeps 256 MiB
    r = run_tool("estimate_memory", "--preset", "cpu", "--host-memory-gb", "1", "--num-layers", "1",
                 "--hidden-size", "64", "--num-attention-heads", "4", "--json")
    assert r.returncode in (0, 1), r.stderr
    import json

    assert json.loads(r.stdout)["host_items"]["os_reserve"] == 256 * MiB


def test_max_model_hidden_keeps_a_llama_a_llama():
    for preset in ("llama3-8b", "llama3-70b", "qwen2-7b"):
        tmpl = PlanInput(**P.model_preset(preset))
        ratio = tmpl.num_attention_heads // tmpl.num_query_groups
        # the family passes through the preset itself at k = its query groups
        own = P.family_member(tmpl, "hidden", tmpl.num_query_groups)
        assert (own.hidden_size, own.num_attention_heads, own.num_query_groups, own.ffn()) == \
            (tmpl.hidden_size, tmpl.num_attention_heads, tmpl.num_query_groups, tmpl.ffn()), preset
        for k in (1, 3, 5, 12):
            m = P.family_member(tmpl, "hidden", k)
            assert m.head_dim() == 128 and m.num_attention_heads == ratio * m.num_query_groups
            assert m.hidden_size == 128 * m.num_attention_heads and m.ffn() % 512 == 0
            # Meta's rounding of the template's ffn/hidden ratio: up to the multiple, never below
            assert 0 <= m.ffn() - tmpl.ffn() * m.hidden_size / tmpl.hidden_size < 1024
    # the tool, on the case: the grown Llama-3-8B is a Llama shape (head dim 128, GQA 4, ffn 3.5h)
    r = run_tool("estimate_memory", "--preset", "v100-32gb", "--model", "llama3-8b", "--zero-offload",
                 "--recompute-granularity", "full", "--seq-length", "2048", "--max-model", "hidden", "--json")
    assert r.returncode == 0, r.stderr
    import json

    d = json.loads(r.stdout)
    i, shape = d["input"], d["max_shape"]
    assert shape["hidden_size"] == i["hidden_size"] == 128 * i["num_attention_heads"]
    assert i["num_attention_heads"] == 4 * i["num_query_groups"] and i["ffn_hidden_size"] % 1024 == 0
    assert i["ffn_hidden_size"] == math.ceil(3.5 * i["hidden_size"] / 1024) * 1024
    # GPT-2 keeps its rule: heads fixed, hidden in steps of lcm(128, heads)
    g = P.family_member(PlanInput(num_layers=4, hidden_size=768, num_attention_heads=12), "hidden", 3)
    assert (g.hidden_size, g.num_attention_heads, g.ffn_hidden_size) == (3 * 384, 12, None)
