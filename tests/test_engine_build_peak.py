"""The engine's set-up adds no host peak above the model it takes in (issue 38's edge at 12 GiB).

With the fp32 master and moments on disk (--optimizer-nvme-master) training holds about 2 B/param on
the host (16-bit staging) plus the I/O ring. The set-up zeroed the whole 16-bit flat buffer (2 B/param
on a CPU device) while the whole fp32 model (4 B/param) was still resident, before placement copied
the model into it: a 2 B/param peak above anything training needs, which took the 2.17B edge run over
its 12 GiB budget (docs/nvme.md). Placement writes every parameter's range, so only the gaps between
parameters (bucket padding) need zeroing.

Measured in a forked rank: the peak resident set (VmHWM, reset through /proc/self/clear_refs just
before the engine is built, the model already resident) above the resident set at that moment, less
the I/O ring the store allocates: at most the largest parameter's placement copy (+ 0.05 B/param).
The old set-up peaked 2.2 B/param above the model here. The engine's flat buffer must still be zero wherever
no parameter lives (bucket padding) and hold every parameter's 16-bit value.
"""
from __future__ import annotations

import os

import pytest
import torch

from tests.harness import run_world
from tests.seeds import fresh_seed


def _vm(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def _build(rank, seed, nvme_dir):
    from zo_megatron.model import GPTConfig, build_gpt_model
    from zo_megatron.offload.engine import AdamConfig, ZeroOffloadEngine
    from zo_megatron.offload.nvme_store import NvmeConfig
    from zo_megatron.parallel import init_parallel
    from zo_megatron.training.host_allocator import pin_mmap_threshold

    pin_mmap_threshold()        # as the job on a CPU: freed tensors leave the resident set at once
    ps = init_parallel(1, seed=seed)
    cfg = GPTConfig(num_layers=3, hidden_size=1000, num_attention_heads=8, vocab_size=4096,
                    max_position_embeddings=64, precision="bf16")
    model = build_gpt_model(cfg, ps.tp_rank, ps.tp_size, seed)
    expect = {n: p.detach().to(torch.bfloat16).clone() for n, p in model.named_parameters()}
    n = sum(p.numel() for p in model.parameters())
    largest = max(p.numel() for p in model.parameters())
    nvme = NvmeConfig(nvme_dir, master=True, buffer_count=2, buffer_size=1 << 18)
    with open("/proc/self/clear_refs", "w") as f:        # VmHWM := VmRSS from here on
        f.write("5")
    before = _vm("VmRSS")
    engine = ZeroOffloadEngine(model, precision="bf16", adam=AdamConfig(lr=1e-3), clip_grad=1.0,
                               bucket_size=3_000_000, dp_group=ps.dp_group, tp_rank=ps.tp_rank, device=ps.device,
                               nvme=nvme)
    peak, after = _vm("VmHWM"), _vm("VmRSS")
    ring = engine._nvme.buffer_bytes
    flat = engine.flat.clone()
    placed = torch.zeros(flat.numel(), dtype=torch.bool)
    same = True
    for name, p in model.named_parameters():
        off = (p.data_ptr() - engine.flat.data_ptr()) // p.element_size()
        placed[off:off + p.numel()] = True
        same &= torch.equal(flat[off:off + p.numel()].view(p.shape), expect[name])
    engine.close()
    return dict(n=n, largest=largest, before=before, peak=peak, after=after, ring=ring, same=bool(same),
                gaps=int((~placed).sum()), gaps_nonzero=int(flat[~placed].count_nonzero()))


def test_build_peak_with_the_master_on_disk_is_one_parameter_s_copy(tmp_path):
    if not os.path.exists("/proc/self/clear_refs"):
        pytest.skip("needs Linux's /proc/self/clear_refs to reset the peak resident set")
    seed = fresh_seed("engine build peak")
    (r,) = run_world(_build, 1, seed, str(tmp_path), timeout=300)
    over = r["peak"] - r["before"] - r["ring"]
    # placement's transient: one parameter at a time, its fp32 source still resident while its 16-bit
    # copy is made and written (4 + 2 B/element of the largest parameter, the embedding here)
    allowed = 6 * r["largest"] + 0.05 * r["n"]
    print(f"[build peak] {r['n'] / 1e6:.1f}M params: peak {over / 2**20:.1f} MiB above the model (ring "
          f"{r['ring'] / 2**20:.0f} MiB aside; allowed {allowed / 2**20:.1f} MiB: the largest parameter's copy); "
          f"resident after the build {(r['after'] - r['before']) / r['n']:+.2f} B/param")
    assert r["same"], "a parameter's 16-bit value differs from the model's"
    assert r["gaps"] > 0 and r["gaps_nonzero"] == 0, r     # bucket padding exists and is zero
    assert over < allowed, f"the set-up peaks {over / r['n']:.2f} B/param above the model it takes in"
