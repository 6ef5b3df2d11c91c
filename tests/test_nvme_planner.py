"""The planner with --optimizer-nvme-path (issue 38): the moments (and with --optimizer-nvme-master the
fp32 master) leave the host lines, the I/O ring joins them, the disk bytes per node get their own
line, all against the byte arithmetic written out here; the job's flags reach the plan,
tools/estimate_memory.py prints the lines, the launch check refuses a disk short of the disk line
(the planner's ring against the engine's accounting is tests/test_nvme_engine.py's)."""
import json
import os
import random
from types import SimpleNamespace

import pytest

from tests.cli import run_tool
from tests.seeds import fresh_seed
from zo_megatron.planner import PlanInput, plan


def _round4k(n):
    return -(-n // 4096) * 4096


def test_the_states_move_from_the_host_lines_to_the_ring_and_the_disk_line():
    rng = random.Random(fresh_seed("nvme planner"))
    base = PlanInput(num_layers=rng.choice([24, 32, 48]), hidden_size=rng.choice([2048, 4096, 5120]),
                     num_attention_heads=32, vocab_size=50257, seq_length=2048, tensor_parallel=rng.choice([1, 2]),
                     data_parallel=rng.choice([2, 4]), micro_batch_size=1, precision="bf16",
                     bf16_optimizer_states=rng.random() < 0.5, gpus_per_node=8)
    before = plan(base)
    part = before.params_per_tp_rank_padded // base.data_parallel
    opt_b = 2 if base.bf16_optimizer_states else 4
    count, size = rng.randint(1, 8), 64 * rng.randint(1 << 10, 1 << 16)
    for master in (False, True):
        p = plan(base.replace(nvme_states=True, nvme_master=master, nvme_buffer_count=count, nvme_buffer_size=size))
        per_node = p.ranks_per_node
        kinds = [opt_b, opt_b] + ([4] if master else [])
        slot = sum(_round4k(size * b) for b in kinds)            # part >> size here: full chunks
        assert part > count * size
        ring, disk = count * slot, -(-part // size) * slot
        gone = {"adam_exp_avg", "adam_exp_avg_sq"} | ({"master_fp32"} if master else set())
        assert set(before.host_items) - set(p.host_items) == gone
        assert p.host_items["nvme_io_ring"] == ring * per_node
        moved = sum(before.host_items[k] for k in gone)
        assert before.host_bytes_per_node - p.host_bytes_per_node == moved - ring * per_node
        assert p.device_items == before.device_items
        assert p.disk_bytes_per_node == disk * per_node
        assert any(r.startswith("disk (--optimizer-nvme-path): ") for r in p.reasons)
        assert before.disk_bytes_per_node == 0


def test_estimate_memory_takes_the_jobs_nvme_flags(tmp_path):
    argv = ["--num-layers", "32", "--hidden-size", "4096", "--num-attention-heads", "32", "--seq-length", "2048",
            "--micro-batch-size", "1", "--zero-offload", "--bf16", "--world-size", "8", "--gpus-per-node", "8",
            "--preset", "h100-80gb", "--json"]
    plain = run_tool("estimate_memory", *argv)
    tier = run_tool("estimate_memory", *argv, "--optimizer-nvme-path", tmp_path / "not-made-yet",
                    "--optimizer-nvme-master", "--optimizer-nvme-buffer-count", "2")
    assert plain.returncode == tier.returncode == 0, tier.stderr
    a, b = json.loads(plain.stdout), json.loads(tier.stdout)
    assert b["input"]["nvme_states"] and b["input"]["nvme_master"] and b["input"]["nvme_buffer_count"] == 2
    assert "nvme_io_ring" in b["host_items"] and "master_fp32" not in b["host_items"]
    assert b["disk_bytes_per_node"] > 0 and a["disk_bytes_per_node"] == 0
    assert b["host_bytes_per_node"] < a["host_bytes_per_node"]
    assert not (tmp_path / "not-made-yet").exists()           # planning creates nothing


def test_the_launch_check_refuses_a_disk_short_of_the_plans_line_in_one_line(tmp_path):
    from zo_megatron.errors import UserError
    from zo_megatron.training.arguments import parse_args
    from zo_megatron.training.nvme_flags import check_nvme_space

    args = parse_args(["--zero-offload", "--optimizer-nvme-path", str(tmp_path)])
    st = os.statvfs(tmp_path)
    free = st.f_bavail * st.f_frsize
    args.memory_plan = SimpleNamespace(disk_bytes_per_node=free // 2)
    check_nvme_space(args)                                      # room: nothing to say
    args.memory_plan = SimpleNamespace(disk_bytes_per_node=free + (64 << 30))
    with pytest.raises(UserError, match=r"free on its filesystem, the optimizer states of this node's ranks need") as e:
        check_nvme_space(args)
    assert "\n" not in str(e.value)


def test_the_overlaps_rollback_state_of_the_states_on_disk_is_on_disk():
    """--overlap-cpu-step with the tier: its host line keeps only what lives in memory (the master's
    backup unless it is on disk, the speculated 16-bit parameters where they would overwrite the
    gradient), the disk line grows by a second place per speculated chunk, and `auto` speculates all
    of it when that costs no host memory, less when the disk the job measured is short, none when the
    states alone do not fit that disk."""
    import math

    from zo_megatron.planner import resolve_overlap

    rng = random.Random(fresh_seed("nvme overlap planner"))
    base = PlanInput(num_layers=rng.choice([24, 32]), hidden_size=rng.choice([2048, 4096]), num_attention_heads=32,
                     vocab_size=50257, seq_length=2048, data_parallel=rng.choice([1, 2, 4]), micro_batch_size=1,
                     precision="bf16", gpus_per_node=8, zero_offload=True, nvme_states=True,
                     nvme_buffer_size=64 * rng.randint(1 << 12, 1 << 16), gpu_memory_bytes=80 << 30,
                     host_memory_bytes_per_node=2 << 40, recompute=True)
    for master, host_grad_fp32 in ((False, False), (True, False), (True, True)):
        inp = base.replace(nvme_master=master, host_grad_fp32=host_grad_fp32, grad_reduce_fp32=True)
        f = rng.randint(10, 100) / 100
        off, on = plan(inp), plan(inp.replace(overlap_cpu_step=True, overlap_speculated_fraction=f))
        part = off.params_per_tp_rank_padded // inp.data_parallel
        n = math.floor(f * part)
        per_rank = n * (0 if master else 4) + (0 if host_grad_fp32 else 2 * n)   # master backup, parameters
        assert on.host_items.get("overlap_rollback", 0) == per_rank * on.ranks_per_node, (master, host_grad_fp32)
        kinds = [4, 4] + ([4] if master else [])
        slot = sum(_round4k(inp.nvme_buffer_size * b) for b in kinds)
        assert on.disk_bytes_per_node - off.disk_bytes_per_node == n // inp.nvme_buffer_size * slot * on.ranks_per_node
        assert {k: v for k, v in on.host_items.items() if k != "overlap_rollback"} == off.host_items
    free_host = base.replace(nvme_master=True, host_grad_fp32=True, grad_reduce_fp32=True)
    f, why = resolve_overlap(free_host, "auto")
    assert f == 1.0 and "0.00 GiB/rank" in why and "of disk per node" in why, why
    full = plan(free_host.replace(overlap_cpu_step=True, overlap_speculated_fraction=1.0)).disk_bytes_per_node
    none = plan(free_host).disk_bytes_per_node
    assert full > none
    short = none + (full - none) // 2                              # the disk holds about half the second places
    f, _ = resolve_overlap(free_host.replace(nvme_disk_free_bytes=short), "auto")
    assert 0 < f < 1
    assert plan(free_host.replace(overlap_cpu_step=True, overlap_speculated_fraction=f)).disk_bytes_per_node <= short
    assert plan(free_host.replace(overlap_cpu_step=True, overlap_speculated_fraction=round(f + 0.01, 2))
                ).disk_bytes_per_node > short
    f, why = resolve_overlap(free_host.replace(nvme_disk_free_bytes=none - 1), "auto")
    assert f == 0.0, why


def test_the_set_up_peak_is_planned_where_it_binds():
    """Each rank builds its model on the host in fp32 and the engine places it while the master, the
    ring and (on a GPU) the pinned staging exist: with the master on disk that is above training's
    host lines. Written out here: ranks x (4 B x the rank's parameters + those lines) + the process and
    OS lines; a host that holds training but not the set-up is refused, naming the set-up. In memory at
    DP 1 the set-up stays below training (no extra line)."""
    rng = random.Random(fresh_seed("nvme set-up peak"))
    base = PlanInput(num_layers=rng.choice([24, 32]), hidden_size=rng.choice([2048, 4096]), num_attention_heads=32,
                     vocab_size=50257, seq_length=2048, data_parallel=1, micro_batch_size=1, precision="bf16",
                     gpus_per_node=1, zero_offload=True, gpu_memory_bytes=80 << 30, host_memory_bytes_per_node=2 << 40,
                     recompute=True)
    mem = plan(base)
    assert mem.host_setup_bytes_per_node < mem.host_bytes_per_node           # in memory: training binds
    assert not any(r.startswith("host at set-up") for r in mem.reasons)
    tier = base.replace(nvme_states=True, nvme_master=True)
    p = plan(tier)
    psi = p.params_per_tp_rank
    held = p.host_items["grad_param_staging_16bit"] + p.host_items["nvme_io_ring"]
    other = p.host_items["process_overhead"] + p.host_items["os_reserve"]
    assert p.host_setup_bytes_per_node == 4 * psi + held + other > p.host_bytes_per_node
    line = next(r for r in p.reasons if r.startswith("host at set-up"))
    assert "(OK)" in line and p.fits
    between = (p.host_bytes_per_node + p.host_setup_bytes_per_node) // 2      # holds training, not the set-up
    short = plan(tier.replace(host_memory_bytes_per_node=between, host_reserve_bytes=p.host_items["os_reserve"]))
    assert not short.fits and not short.fits_host and short.host_bytes_per_node <= between
    assert any(r.startswith("host at set-up") and "OVER" in r for r in short.reasons), short.reasons


def test_estimate_memorys_max_model_with_the_tier_is_find_max_models(tmp_path):
    """estimate_memory.py --max-model with --optimizer-nvme-path (-master) finds the size that
    tools/find_max_model.py's plan (the job's own pre-launch computation) finds for the same rule (the
    12 GiB edge of docs/nvme.md: GPT-2, hidden 2048, 16 heads, bf16, seq 32, micro-batch 1, the CPU), and
    the tier grows it: in memory < moments on disk < the master too."""
    rule = ["--hidden-size", "2048", "--num-attention-heads", "16", "--seq-length", "32", "--micro-batch-size", "1"]
    sizes = []
    for tier in ([], ["--optimizer-nvme-path", str(tmp_path)],
                 ["--optimizer-nvme-path", str(tmp_path), "--optimizer-nvme-master"]):
        est = run_tool("estimate_memory", "--preset", "cpu", "--host-memory-gb", "12", *rule, "--bf16", "--zero-offload",
                       "--max-model", "layers", "--json", *tier)
        assert est.returncode == 0, est.stderr
        got = json.loads(est.stdout)
        out = tmp_path / "fmm.json"
        fmm = run_tool("find_max_model", "--host-memory", "12GiB", *rule, "--skip-run", "--json", str(out), *tier)
        assert fmm.returncode == 0, fmm.stderr
        ours = json.loads(out.read_text())["ours"]
        out.unlink()
        assert got["fits"] and got["max_shape"]["num_layers"] == ours["size"], (tier, got["max_shape"], ours["size"])
        assert got["max_params"] == ours["params"]
        sizes.append(ours["size"])
    assert sizes[0] < sizes[1] < sizes[2], sizes
    assert os.listdir(tmp_path) == []                          # planning wrote nothing into DIR
