#!/usr/bin/env python
"""The DeepSpeed side of tools/find_max_model.py: the largest model of the same family that
DeepSpeed ZeRO-2 with `offload_optimizer: cpu` trains on the same memory. DeepSpeed is the benchmark
peer, never a dependency: it is imported only here, and only when `--deepspeed` is given.

1. **DeepSpeed's own estimator** (`deepspeed.runtime.zero.stage_1_and_2.estimate_zero2_model_states_mem_needs`,
   the function behind `estimate_zero2_model_states_mem_needs_all_cold`/`_all_live`, with its default
   additional_buffer_factor 1.5 and cpu_offload=True): the largest size k whose model states fit
   (per node: host + device x ranks on a CPU run, where the device is host memory; host and device
   apart on CUDA). The parameter count of size k is the Hugging Face model's own, built on the meta device.
2. **Runs** (3 iterations each, the same sequence length and micro-batch, the demo corpus's tokens):
   the same model as the job's (HF GPT2LMHeadModel / LlamaForCausalLM of that shape, built in fp32 as
   DeepSpeed expects, its bf16/fp16 section for 16-bit training, fp32 master and Adam on the CPU)
   under torchrun, its process tree's peak RSS sampled as for ours. A run *fits* when it trains and its
   peak stays within the budget the planner gives our processes (host memory minus the planner's OS
   reserve, min(32 GiB, max(256 MiB, host/10))). The search starts at the estimator's size and brackets the edge
   by runs: a linear model of the peak in parameters (fixed cost + bytes/param from the runs so far)
   and bisection (doubling while no size fails) take turns proposing the next size (the peak is
   noisy by tens of MiB: the model alone creeps), at most --deepspeed-max-runs runs. DeepSpeed's CPU
   Adam op (and, for several ranks, its shared-memory comm op) is compiled before the first run, so
   no run's tree includes the compiler.

Run as a worker (`--worker`, under torchrun) it trains one size and writes rank 0's JSON result.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for p in (ROOT, os.path.dirname(os.path.abspath(__file__))):
    if p not in sys.path:
        sys.path.insert(0, p)

from find_max_model_common import largest, run_command  # noqa: E402
from zo_megatron.planner.inputs import os_reserve_bytes  # noqa: E402
from zo_megatron.planner.units import GiB, MiB, format_bytes  # noqa: E402


def hf_config(shape: dict, family: str, vocab: int, seq: int, ffn: int | None, groups: int | None):
    import transformers

    h, L, a = shape["hidden_size"], shape["num_layers"], shape["num_attention_heads"]
    if family == "gpt2":
        return transformers.GPT2Config(vocab_size=vocab, n_positions=seq, n_embd=h, n_layer=L, n_head=a,
                                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                       activation_function="gelu_new", layer_norm_epsilon=1e-5)
    return transformers.LlamaConfig(vocab_size=vocab, hidden_size=h, intermediate_size=ffn, num_hidden_layers=L,
                                    num_attention_heads=a, num_key_value_heads=groups or a,
                                    max_position_embeddings=seq, rope_theta=500000.0, rms_norm_eps=1e-5,
                                    tie_word_embeddings=False, attention_bias=False, mlp_bias=False)


def hf_model(cfg, meta: bool = False):
    import torch
    import transformers

    cls = transformers.GPT2LMHeadModel if cfg.model_type == "gpt2" else transformers.LlamaForCausalLM
    if meta:
        with torch.device("meta"):
            return cls(cfg)
    return cls(cfg).float()


def _model_fields(rule, k: int) -> dict:
    """The HF shape of the job's size k (its ffn and KV groups read from the job's own flags)."""
    flags = rule.job_flags(k)

    def flag(name):
        return int(flags[flags.index(name) + 1]) if name in flags else None
    return dict(shape=rule.shape(k), family=rule.family, vocab=rule.vocab, seq=rule.a.seq_length,
                ffn=flag("--ffn-hidden-size"), groups=flag("--num-query-groups"))


def hf_params(fields: dict) -> int:
    m = hf_model(hf_config(fields["shape"], fields["family"], fields["vocab"], fields["seq"], fields["ffn"],
                           fields["groups"]), meta=True)
    return sum(dict((id(p), p.numel()) for p in m.parameters()).values())   # tied weights once


class ParamCounter:
    """HF parameter count of size k. Exact and cheap: the count is linear in k when layers grow and
    quadratic when hidden grows (hidden, ffn and vocab rows all scale with k), so three meta-device
    models (k = 1, 2, 3) give every k; `check` builds the model of one k to confirm it."""

    def __init__(self, rule):
        self.rule = rule
        self.c = [hf_params(_model_fields(rule, k)) for k in (1, 2, 3)]

    def __call__(self, k: int) -> int:
        c1, c2, c3 = self.c              # Lagrange through k = 1, 2, 3 (exact for degree <= 2)
        return (c1 * (k - 2) * (k - 3) - 2 * c2 * (k - 1) * (k - 3) + c3 * (k - 1) * (k - 2)) // 2

    def check(self, k: int) -> int:
        n = hf_params(_model_fields(self.rule, k))
        if n != self(k):
            raise AssertionError(f"parameter count of size {k}: {n} built, {self(k)} interpolated")
        return n


def estimator_bytes(params: int, ranks: int) -> tuple[int, int]:
    """(host bytes per node, device bytes per GPU) of DeepSpeed's ZeRO-2 offload estimator."""
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    return estimate_zero2_model_states_mem_needs(params, num_gpus_per_node=ranks, num_nodes=1, cpu_offload=True)


# ------------------------------------------------------------------------------------------------
# the worker: one size, 3 iterations

def worker(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--worker", action="store_true")
    p.add_argument("--fields", required=True)
    p.add_argument("--precision", required=True)
    p.add_argument("--micro-batch-size", type=int, default=1)
    p.add_argument("--train-iters", type=int, default=3)
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    fields = json.loads(a.fields)
    import warnings

    warnings.filterwarnings("ignore")
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import logging

    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    from zo_megatron.training.metrics import proc_memory_bytes

    phases = {"start": proc_memory_bytes()}
    import deepspeed
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from zo_megatron.data.corpus import default_data_prefix
    from zo_megatron.parallel import init_parallel

    shape = fields["shape"]
    ps = init_parallel(1, seed=1234, num_attention_heads=shape["num_attention_heads"],
                       hidden_size=shape["hidden_size"])
    seq, mb = fields["seq"], a.micro_batch_size
    docs = IndexedDataset(default_data_prefix())
    stream = torch.cat([torch.from_numpy(docs[i].astype("int64")) for i in range(min(len(docs), 40))])
    phases["data"] = proc_memory_bytes()
    torch.manual_seed(1234)
    model = hf_model(hf_config(shape, fields["family"], fields["vocab"], seq, fields["ffn"], fields["groups"]))
    phases["model"] = proc_memory_bytes()
    config = {
        "train_micro_batch_size_per_gpu": mb, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
        "bf16": {"enabled": a.precision == "bf16"}, "fp16": {"enabled": a.precision == "fp16"},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "betas": [0.9, 0.95], "eps": 1e-8,
                                                  "weight_decay": 0.1}},
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": ps.device.type == "cuda"},
                              "overlap_comm": False, "contiguous_gradients": True},
        "steps_per_print": 1 << 30, "wall_clock_breakdown": False,
    }
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    phases["optimizer"] = proc_memory_bytes()
    losses = []
    for it in range(a.train_iters):
        off = (ps.dp_rank * a.train_iters + it) * mb * (seq + 1)
        batch = torch.stack([stream[off + j * (seq + 1): off + (j + 1) * (seq + 1)] for j in range(mb)]).to(ps.device)
        logits = engine(input_ids=batch[:, :-1], use_cache=False).logits
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                                 batch[:, 1:].reshape(-1))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if ps.rank == 0:
            print(f" iter {it + 1}/{a.train_iters} | loss {losses[-1]:.4f} | rss {proc_memory_bytes().get('vmrss', 0) / MiB:.0f} MiB",
                  flush=True)
    end = proc_memory_bytes()
    if ps.rank == 0:
        with open(a.out, "w") as f:
            json.dump(dict(losses=losses, iterations=len(losses), phases=phases, end=end,
                           device_peak_bytes=torch.cuda.max_memory_allocated() if ps.device.type == "cuda" else None,
                           params=sum(dict((id(q), q.numel()) for q in model.parameters()).values())), f)
    return 0


# ------------------------------------------------------------------------------------------------
# the search

def run_size(a, rule, k: int, host: int, tmp: str) -> dict:
    fields = _model_fields(rule, k)
    out = os.path.join(tmp, f"ds_{k}.json")
    cmd_tail = [os.path.abspath(__file__), "--worker", "--fields", json.dumps(fields), "--precision", a.precision,
                "--micro-batch-size", str(a.micro_batch_size), "--train-iters", str(a.train_iters), "--out", out]
    run = run_command(cmd_tail, a.tensor_parallel * a.data_parallel, host, timeout=a.timeout, tag=f"ds k={k}")
    res = json.load(open(out)) if os.path.exists(out) else {}
    run.update(size=k, shape=fields["shape"], params=res.get("params") or hf_params(fields),
               trained=run["rc"] == 0 and res.get("iterations") == a.train_iters, worker=res)
    return run


def find(a, rule, host: int, run_proofs: bool = True) -> dict:
    """DeepSpeed's largest of `rule`'s family on `host` bytes: its estimator, then runs."""
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")      # DeepSpeed's CPU accelerator, explicitly
    try:
        import deepspeed
    except Exception as exc:   # noqa: BLE001 - any broken install: the DeepSpeed side is skipped, said why
        msg = f"DeepSpeed not importable ({type(exc).__name__}: {str(exc).splitlines()[0][:100]})"
        print(f"  deepspeed: skipped: {msg}")
        return dict(skipped=msg)
    cuda = torch.cuda.is_available()
    ranks = a.tensor_parallel * a.data_parallel
    if a.tensor_parallel > 1:
        msg = "HF models under DeepSpeed have no tensor parallelism: the DeepSpeed side runs with TP 1 only"
        print(f"  deepspeed: skipped: {msg}")
        return dict(skipped=msg)
    device = a.device_memory or (torch.cuda.get_device_properties(0).total_memory if cuda else host)

    count = ParamCounter(rule)

    def est_fits(k):                     # a GPU plan also from a CPU-only host (--skip-run --device-memory)
        cpu, gpu = estimator_bytes(count(k), ranks)
        return (cpu + gpu * ranks <= host) if not (cuda or a.device_memory) else (cpu <= host and gpu <= device)

    t0 = time.monotonic()
    lo = largest(est_fits, a.max_size)
    k_est = lo
    out = dict(deepspeed=deepspeed.__version__, estimator="estimate_zero2_model_states_mem_needs(cpu_offload=True, "
               "additional_buffer_factor=1.5)", estimator_size=k_est)
    if k_est == 0:
        print("  deepspeed: its estimator says not even size 1 fits")
        return out
    fields = _model_fields(rule, k_est)
    out["estimator_params"] = n = count.check(k_est)
    cpu, gpu = estimator_bytes(n, ranks)
    out.update(estimator_host_bytes=cpu, estimator_device_bytes=gpu)
    print(f"  deepspeed {deepspeed.__version__}: its estimator's largest k = {k_est}: {fields['shape']} = "
          f"{n / 1e6:.1f}M params (host {format_bytes(cpu)}, device {format_bytes(gpu)}; "
          f"{time.monotonic() - t0:.1f}s)", flush=True)
    if not run_proofs:
        return out
    if not cuda:
        # DeepSpeedCPUAdam is compiled on first use: build it now, so no run's memory includes the compiler
        from deepspeed.ops.op_builder import CPUAdamBuilder

        t1 = time.monotonic()
        CPUAdamBuilder().load(verbose=False)
        if ranks > 1:          # and its shared-memory collectives (built at the first multi-rank init)
            from deepspeed.accelerator import get_accelerator

            builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
            if builder is not None and builder.is_compatible():
                builder.load(verbose=False)
        print(f"  deepspeed: CPU Adam op{' and shared-memory comm op' if ranks > 1 else ''} ready "
              f"({time.monotonic() - t1:.1f}s)", flush=True)
    budget = host - os_reserve_bytes(host)
    out["run_budget_bytes"] = budget
    runs: dict[int, dict] = {}
    with tempfile.TemporaryDirectory(prefix="find_max_model_ds_") as tmp:
        def fits(k):
            if k not in runs:
                print(f"  deepspeed run: k = {k} ...", flush=True)
                r = run_size(a, rule, k, host, tmp)
                r["fits"] = r["trained"] and r["peak_tree_rss_bytes"] <= budget
                runs[k] = r
                print(f"  deepspeed run: k = {k} ({r['params'] / 1e6:.1f}M): "
                      f"{'trained' if r['trained'] else 'FAILED'}, tree peak RSS {format_bytes(r['peak_tree_rss_bytes'])} "
                      f"of {format_bytes(budget)}: {'fits' if r['fits'] else 'does not fit'}", flush=True)
            return runs[k]["fits"]

        def guess(lo, hi, use_model):
            """Next size between lo (fits) and hi (does not; None: not found yet): the largest whose
            parameters a linear model of the peak RSS (fixed + bytes/param, from the runs) fits in
            the budget, clamped into (lo, hi); bisection when that proposes a size already run."""
            pts = sorted((r["params"], r["peak_tree_rss_bytes"]) for r in runs.values() if r["trained"])
            if len(pts) >= 2 and pts[-1][0] > pts[0][0]:
                slope = (pts[-1][1] - pts[0][1]) / (pts[-1][0] - pts[0][0])
                fixed = pts[-1][1] - slope * pts[-1][0]
            elif pts:
                fixed = min(r["launcher_hwm_bytes"] + r["worker"].get("phases", {}).get("data", {}).get("vmrss", 0)
                            * ranks for r in runs.values() if r["trained"])
                slope = (pts[0][1] - fixed) / pts[0][0]
            else:
                slope = 0
            if slope > 0 and use_model:
                target = (budget - fixed) / slope
                g = largest(lambda j: count(j) <= target, a.max_size)
            else:
                g = (lo + hi) // 2 if hi is not None else 2 * max(lo, 1)
            k = max(g, lo + 1) if hi is None else min(max(g, lo + 1), hi - 1)
            if k in runs:
                k = (lo + hi) // 2 if hi is not None else 2 * max(lo, 1)
            return k

        lo, hi, k = 0, None, k_est
        for _ in range(a.deepspeed_max_runs):
            if fits(k):
                lo = max(lo, k)
            else:
                hi = k if hi is None else min(hi, k)
            if hi is not None and hi - lo <= 1:
                break
            k = guess(lo, hi, use_model=len(runs) % 2 == 1)   # the model and bisection/doubling take turns
            if k in runs or k < 1 or k > a.max_size:
                break
        out["runs"] = {str(s): {x: r[x] for x in ("params", "shape", "trained", "fits", "rc", "peak_tree_rss_bytes",
                                                  "sum_process_hwm_bytes", "launcher_hwm_bytes", "wall_s", "worker")}
                       for s, r in sorted(runs.items())}
    out["proven_size"] = lo
    out["bracketed"] = hi is not None and hi - lo <= 1
    if lo:
        out["proven_params"] = runs[lo]["params"]
        out["proven_shape"] = runs[lo]["shape"]
        out["proven_peak_tree_rss_bytes"] = runs[lo]["peak_tree_rss_bytes"]
    print(f"  deepspeed: largest trained within {format_bytes(budget)}: k = {lo}"
          + (f" ({out['proven_params'] / 1e6:.1f}M params)" if lo else "")
          + ("" if out["bracketed"] else f" (not bracketed in {a.deepspeed_max_runs} runs)"), flush=True)
    return out


if __name__ == "__main__":
    sys.exit(worker())
