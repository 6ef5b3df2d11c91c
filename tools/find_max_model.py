#!/usr/bin/env python
"""The biggest model this machine can train: asked of the planner, then proven by a run.

    python tools/find_max_model.py                                  # this machine, GPT-2 family, bf16
    python tools/find_max_model.py --family llama --grow hidden --num-layers 8 --json out.json --png out.png
    python tools/find_max_model.py --host-memory 1400MiB --hidden-size 128 --num-attention-heads 4 --fp32
    python tools/find_max_model.py --skip-run                        # the planner's answer only
    python tools/find_max_model.py --deepspeed                       # also DeepSpeed ZeRO-2 + CPU offload
    python tools/find_max_model.py --family llama --multi-latent-attention --q-lora-rank 384 --kv-lora-rank 128 \
        --qk-head-dim 64 --qk-pos-emb-head-dim 32 --v-head-dim 64 --qk-layernorm --skip-run   # DeepSeek-style MLA

Steps (each prints a progress line):

1. **Plan.** A shape rule gives one model per size k: `--grow layers` (hidden and heads fixed, k
   layers) or `--grow hidden` (layers and heads fixed, hidden = k x lcm(128, heads)). The search
   (exponential, then binary, over k) asks, for each k, the very function the job's pre-launch
   check runs (`training.prelaunch.job_plan`: the job's flags parsed by the job's parser, the planner's
   one builder, the job's overlap / offload-fraction defaults) with this machine's memory, and
   prints the largest k that fits.
2. **Prove it.** `pretrain/pretrain_gpt.py` under torchrun (`python -m torch.distributed.run`)
   trains that model for 3 iterations on the bundled demo corpus (what `make demo` trains on),
   while this tool samples the resident set of every process of the job (/proc/<pid>/status:
   VmRSS summed over the tree, and each process's VmHWM) every 50 ms. The job writes its own
   set-up phases (`"kind": "setup_memory"`: resident set after start, data, model, optimizer) and,
   on CUDA, its device peak (`torch.cuda.max_memory_allocated`) to its --log-jsonl; both go into
   the comparison with the planner's line items.
3. **Refuse the next size.** Size k+1 is launched the same way: the job's pre-launch check must
   refuse it with its one `error:` line and exit status 2 (torchrun, as always, exits 1 and names
   the rank's exit code 2 in its summary), not be killed for memory.
4. `--deepspeed`: the same family, precision and layout under DeepSpeed ZeRO-2 with
   `offload_optimizer: cpu` (tools/find_max_model_deepspeed.py; DeepSpeed is never a dependency).

The job sees the memory given here: `--host-memory` reaches it as SLURM_MEM_PER_NODE (MiB), one of
the limits the job reads (parallel/launch_env.memory_limit_bytes), so the tool and the job plan with
the same number. Default: MemAvailable of /proc/meminfo (what is free now, not MemTotal). On a CPU
run the "device" is host memory (one RAM for both: the planner's unified check), so there is no
separate device peak. `--device-memory` plans for a GPU of that memory (the job's plan on CUDA,
without asking CUDA): with `--skip-run` also from a CPU-only host; a run still needs the GPU (the job
checks the one it sees).

Exit status: 0 the largest model trained within the memory given and the next size was refused by
the pre-launch check (or, with --skip-run, a model fits), 1 a step did not behave as planned (the
run failed, its process tree's peak went over the memory given, or the next size was not refused),
2 bad input (one line).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import tempfile
import time
from types import SimpleNamespace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _p in (ROOT, os.path.dirname(os.path.abspath(__file__))):
    if _p not in sys.path:
        sys.path.insert(0, _p)

# what this tool and tools/find_max_model_deepspeed.py both use lives in find_max_model_common (issue 36:
# no import cycle); the names stay importable from here
from find_max_model_common import TreeSampler, largest, run_command  # noqa: E402,F401
from zo_megatron.planner.units import GiB, MiB, format_bytes  # noqa: E402

# Llama-3's ratios (the llama3-8b preset: 32 heads / 8 KV groups, ffn 14336 = 3.5 x 4096, vocab 128256)
LLAMA_KV_RATIO = 4
LLAMA_FFN_RATIO = 3.5
LLAMA_VOCAB = 128256
GPT2_VOCAB = 50257
REFUSAL = "the memory planner predicts this run does not fit"


# ------------------------------------------------------------------------------------------------
# input

def parse_bytes(text: str) -> int:
    """'1400MiB', '20GiB', '2.5GB' (GiB: 1024-based as everywhere here) or a plain byte count."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]i?B?|B)?\s*", text, re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size like 1400MiB, 20GiB or 123456789")
    unit = (m.group(2) or "B").upper().rstrip("B").rstrip("I")
    n = float(m.group(1)) * {"": 1, "K": 1024, "M": MiB, "G": GiB, "T": 1024 * GiB}[unit]
    if n < MiB:
        raise argparse.ArgumentTypeError(f"{text!r}: at least 1 MiB")
    return int(n)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="find_max_model.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("model family and shape rule")
    g.add_argument("--family", choices=["gpt2", "llama"], default="gpt2",
                   help="gpt2: learned positions, LayerNorm, GELU, tied; llama: the llama3 presets' ratios "
                        "(rope, RMSNorm, SwiGLU, KV groups = heads/4, ffn 3.5h, untied, no biases, vocab 128256)")
    g.add_argument("--grow", choices=["layers", "hidden"], default="layers",
                   help="layers: fixed hidden, k layers; hidden: fixed layers, hidden = k x lcm(128, heads)")
    g.add_argument("--hidden-size", type=int, default=None, help="fixed hidden with --grow layers (default 2048)")
    g.add_argument("--num-layers", type=int, default=None, help="fixed layers with --grow hidden (default 8)")
    g.add_argument("--num-attention-heads", type=int, default=16)
    g.add_argument("--vocab-size", type=int, default=None,
                   help=f"model vocabulary (default: gpt2 {GPT2_VOCAB}, llama {LLAMA_VOCAB}; the data is the demo "
                        "corpus in GPT-2 tokens either way)")
    g.add_argument("--max-size", type=int, default=100_000, help="search limit on k")
    g = p.add_argument_group("multi-latent attention (DeepSeek-V2/V3; pretrain_gpt.py's flags, its defaults where "
                             "not given)")
    g.add_argument("--multi-latent-attention", action="store_true",
                   help="the family's attention as MLA (--family llama: no query groups, MLA has none)")
    for flag, kind, what in (("--q-lora-rank", int, "the query latent's rank (default: none, queries direct)"),
                             ("--kv-lora-rank", int, "the key/value latent's rank"),
                             ("--qk-head-dim", int, "query/key channels per head without position"),
                             ("--qk-pos-emb-head-dim", int, "rotated query/key channels per head"),
                             ("--v-head-dim", int, "value channels per head"),
                             ("--rope-type", str, "yarn (MLA's default) or rope")):
        g.add_argument(flag, type=kind, default=None, help=f"MLA: {what}")
    g.add_argument("--qk-layernorm", action="store_true",
                   help="the job's --qk-layernorm: with MLA the q and kv latents' norms (DeepSeek's), else per-head "
                        "q/k norms")
    g = p.add_argument_group("layout, precision, options (pretrain_gpt.py's flags)")
    g.add_argument("--tensor-parallel", "--tensor-model-parallel-size", dest="tensor_parallel", type=int, default=1)
    g.add_argument("--data-parallel", type=int, default=1)
    prec = g.add_mutually_exclusive_group()
    prec.add_argument("--bf16", dest="precision", action="store_const", const="bf16")
    prec.add_argument("--fp16", dest="precision", action="store_const", const="fp16")
    prec.add_argument("--fp32", dest="precision", action="store_const", const="fp32")
    g.add_argument("--optimizer-offload-fraction", default="1.0", metavar="F|auto")
    g.add_argument("--exp-avg-dtype", choices=["fp32", "bf16"], default="fp32",
                   help="bf16: Adam's moments in bf16 on the host (with --exp-avg-sq-dtype bf16)")
    g.add_argument("--exp-avg-sq-dtype", choices=["fp32", "bf16"], default="fp32")
    g.add_argument("--accumulate-grads-on-host", action="store_true")
    g.add_argument("--recompute-activations", action="store_true", help="selective recompute (Megatron)")
    g.add_argument("--recompute-granularity", choices=["full", "selective"], default=None)
    g.add_argument("--recompute-modules", nargs="+", default=None, metavar="MODULE",
                   help="with selective recompute: megatron-core's modules to recompute (core_attn, layernorm, mlp; "
                        "docs/memory_planner.md); the plan counts what each keeps")
    g.add_argument("--seq-length", type=int, default=32)
    g.add_argument("--micro-batch-size", type=int, default=1)
    g.add_argument("--train-iters", type=int, default=3)
    g.add_argument("--optimizer-nvme-path", default=None, metavar="DIR",
                   help="the job's NVMe tier (docs/nvme.md): Adam's moments in files under DIR (a directory on the "
                        "disk; the runs write up to 12 bytes/param there); the plan drops them from host memory")
    g.add_argument("--optimizer-nvme-master", action="store_true",
                   help="with --optimizer-nvme-path: the fp32 master on disk too")
    g.add_argument("--optimizer-nvme-buffer-count", type=int, default=None, metavar="N",
                   help="with --optimizer-nvme-path: the job's I/O ring depth (default: the job's)")
    g.add_argument("--optimizer-nvme-buffer-size", type=int, default=None, metavar="ELEMENTS",
                   help="with --optimizer-nvme-path: elements per ring buffer (default: the job's)")
    g = p.add_argument_group("memory (default: what the job sees)")
    g.add_argument("--host-memory", type=parse_bytes, default=None,
                   help="host memory for the plan and the job (default: MemAvailable of /proc/meminfo)")
    g.add_argument("--device-memory", type=parse_bytes, default=None,
                   help="GPU memory for the plan (with --skip-run also on a host without a GPU; on a CPU run "
                        "device = host memory)")
    g = p.add_argument_group("what to do")
    g.add_argument("--skip-run", action="store_true", help="plan only")
    g.add_argument("--deepspeed", action="store_true", help="also find DeepSpeed ZeRO-2 + CPU offload's largest")
    g.add_argument("--json", metavar="OUT.json", default=None)
    g.add_argument("--png", metavar="OUT.png", default=None)
    g.add_argument("--deepspeed-max-runs", type=int, default=6, help="runs the DeepSpeed search may take")
    g.add_argument("--deepspeed-from", metavar="EARLIER.json", default=None,
                   help="take the DeepSpeed side from an earlier --deepspeed JSON of the same rule, layout, "
                        "precision and memory instead of re-running it (it does not depend on our planner)")
    g.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    return p


def mem_available_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise OSError("no MemAvailable in /proc/meminfo")


class Rule:
    """One model per size k: its pretrain_gpt.py flags."""

    def __init__(self, a):
        self.a = a
        self.family, self.grow = a.family, a.grow
        self.heads = a.num_attention_heads
        self.hidden = a.hidden_size or 2048
        self.layers = a.num_layers or 8
        self.step = math.lcm(128, self.heads)
        self.vocab = a.vocab_size or (LLAMA_VOCAB if a.family == "llama" else GPT2_VOCAB)
        if self.family == "llama" and self.heads % LLAMA_KV_RATIO and self.heads > 1 and not a.multi_latent_attention:
            raise ValueError(f"--family llama groups heads by {LLAMA_KV_RATIO} (Llama-3's 32/8): "
                             f"--num-attention-heads {self.heads} is not a multiple of {LLAMA_KV_RATIO}")
        if self.grow == "layers" and self.hidden % self.heads:
            raise ValueError(f"--hidden-size {self.hidden} is not a multiple of --num-attention-heads {self.heads}")

    def shape(self, k: int) -> dict:
        if self.grow == "layers":
            return dict(num_layers=k, hidden_size=self.hidden, num_attention_heads=self.heads)
        return dict(num_layers=self.layers, hidden_size=k * self.step, num_attention_heads=self.heads)

    def describe(self) -> str:
        fixed = f"hidden {self.hidden}, k layers" if self.grow == "layers" else \
            f"{self.layers} layers, hidden k x {self.step}"
        mla = f", MLA {' '.join(self.mla_flags()[1:]) or '(the job defaults)'}" if self.a.multi_latent_attention else ""
        return f"{self.family} ({fixed}, {self.heads} heads{mla})"

    def mla_flags(self) -> list[str]:
        """The multi-latent attention flags as given (the job applies its defaults and checks)."""
        a = self.a
        flags = ["--multi-latent-attention"] if a.multi_latent_attention else []
        for name in ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim", "rope_type"):
            if getattr(a, name) is not None:
                flags += [f"--{name.replace('_', '-')}", str(getattr(a, name))]
        return flags + (["--qk-layernorm"] if a.qk_layernorm else [])

    def job_flags(self, k: int) -> list[str]:
        a, s = self.a, self.shape(k)
        flags = ["--num-layers", str(s["num_layers"]), "--hidden-size", str(s["hidden_size"]),
                 "--num-attention-heads", str(s["num_attention_heads"]), "--seq-length", str(a.seq_length),
                 "--max-position-embeddings", str(a.seq_length), "--micro-batch-size", str(a.micro_batch_size),
                 "--global-batch-size", str(a.micro_batch_size * a.data_parallel),
                 "--train-iters", str(a.train_iters), "--lr", "1e-4", "--min-lr", "0",
                 "--tensor-parallel", str(a.tensor_parallel), "--zero-offload",
                 f"--{a.precision}", "--eval-iters", "0", "--log-interval", "1",
                 "--optimizer-offload-fraction", str(a.optimizer_offload_fraction),
                 "--exp-avg-dtype", a.exp_avg_dtype, "--exp-avg-sq-dtype", a.exp_avg_sq_dtype]
        if self.vocab != GPT2_VOCAB:
            flags += ["--vocab-size", str(self.vocab)]
        if a.accumulate_grads_on_host:
            flags.append("--accumulate-grads-on-host")
        if a.recompute_activations:
            flags.append("--recompute-activations")
        if a.recompute_granularity:
            flags += ["--recompute-granularity", a.recompute_granularity]
        if a.recompute_modules:
            flags += ["--recompute-modules", *a.recompute_modules]
        flags += nvme_flags(a)
        flags += self.mla_flags()
        if self.family == "llama":
            h = s["hidden_size"]
            flags += ["--position-embedding-type", "rope", "--rotary-base", "500000", "--normalization", "RMSNorm",
                      "--norm-epsilon", "1e-5", "--swiglu", "--untie-embeddings-and-output-weights",
                      "--disable-bias-linear", "--ffn-hidden-size", str(max(64, round(LLAMA_FFN_RATIO * h / 64) * 64))]
            if self.heads >= LLAMA_KV_RATIO and not a.multi_latent_attention:
                flags += ["--group-query-attention", "--num-query-groups", str(self.heads // LLAMA_KV_RATIO)]
        return flags


def nvme_flags(a) -> list[str]:
    """The job's --optimizer-nvme-* flags as this tool was given them (the job checks them)."""
    flags = []
    if a.optimizer_nvme_path is not None:
        flags += ["--optimizer-nvme-path", a.optimizer_nvme_path]
    if a.optimizer_nvme_master:
        flags.append("--optimizer-nvme-master")
    for name in ("buffer_count", "buffer_size"):
        if getattr(a, f"optimizer_nvme_{name}") is not None:
            flags += [f"--optimizer-nvme-{name.replace('_', '-')}", str(getattr(a, f"optimizer_nvme_{name}"))]
    return flags


def without_tier(a):
    """The same tool arguments with the optimizer states in memory (the in-memory edge to compare with)."""
    return SimpleNamespace(**{**vars(a), "optimizer_nvme_path": None, "optimizer_nvme_master": False,
                              "optimizer_nvme_buffer_count": None, "optimizer_nvme_buffer_size": None})


def tier_name(a) -> str:
    if a.optimizer_nvme_path is None:
        return "optimizer states in memory"
    return f"{'moments + master' if a.optimizer_nvme_master else 'moments'} on disk ({a.optimizer_nvme_path})"


# ------------------------------------------------------------------------------------------------
# the planner: the job's own pre-launch computation, for size k

class JobPlanner:
    def __init__(self, rule: Rule, host_bytes: int, ranks: int, device_bytes: int | None = None):
        from zo_megatron.training.arguments import parse_args

        self.rule, self.host, self.ranks, self.device = rule, host_bytes, ranks, device_bytes
        self._parse = parse_args
        self._vocab = None
        self.probes: dict[int, bool] = {}       # fits(k)
        self.may_probes: dict[int, bool] = {}   # may_fit(k), the monotone bound the search bisects on

    def vocab(self, args) -> int:
        if self._vocab is None:
            from zo_megatron.data import build_tokenizer
            from zo_megatron.training.prelaunch import model_vocab_size

            tok = build_tokenizer(None, None)
            self._vocab = model_vocab_size(args, tok)
        return self._vocab

    def plan(self, k: int):
        from zo_megatron.training.prelaunch import job_plan

        args = self._parse(self.rule.job_flags(k))
        env = SimpleNamespace(local_world_size=self.ranks)
        # with --device-memory: the job's plan on a GPU of that memory (CUDA is not asked: a CPU-only
        # host can plan for one with --skip-run)
        return job_plan(args, env, self.ranks // args.tensor_parallel, self.vocab(args), self.host, self.device)

    def fits(self, k: int) -> bool:
        if k not in self.probes:
            self.probes[k] = self.plan(k).fits
        return self.probes[k]

    def may_fit(self, k: int) -> bool:
        """Monotone in k and true wherever fits(k) is (the planner's may_fit: `fits` is not
        monotone, the bucket that takes the word embedding overfills by a varying amount)."""
        from zo_megatron.planner import may_fit

        if k not in self.may_probes:
            self.may_probes[k] = may_fit(self.plan(k).input)
        return self.may_probes[k]

    def largest(self, limit: int) -> int:
        """Largest k in [1, limit] that fits (0: none), exact although `fits` is not monotone."""
        from zo_megatron.planner import largest_fitting

        return largest_fitting(self.fits, self.may_fit, limit)


def tier_edge(a, rule: Rule, p, host: int, ranks: int) -> dict:
    """With --optimizer-nvme-path: the disk the plan needs and the in-memory edge of the same rule,
    layout and memory (planned the same way, the tier off), for the ratio the tier buys."""
    mem = JobPlanner(Rule(without_tier(a)), host, ranks, a.device_memory)
    k_mem = mem.largest(a.max_size)
    mem_params = mem.plan(k_mem).params_total if k_mem else 0
    out = dict(path=a.optimizer_nvme_path, master=a.optimizer_nvme_master, disk_bytes_per_node=p.disk_bytes_per_node,
               in_memory_size=k_mem, in_memory_params=mem_params,
               over_in_memory=p.params_total / mem_params if mem_params else None)
    print(f"  planner: {p.disk_bytes_per_node / 1e9:.2f} GB of state files on disk; in memory the largest is "
          f"k = {k_mem} = {mem_params / 1e6:.1f}M params: the tier plans "
          + (f"{out['over_in_memory']:.2f}x the parameters" if mem_params else "a model where none fit"), flush=True)
    return out


# ------------------------------------------------------------------------------------------------
# running a job and sampling its memory

def run_job(flags: list[str], nproc: int, host_bytes: int, log_jsonl: str, *, timeout: float,
            tag: str) -> dict:
    """pretrain_gpt.py under torchrun with `flags` (+ its JSONL records)."""
    run = run_command([os.path.join(ROOT, "pretrain", "pretrain_gpt.py"), *flags, "--log-jsonl", log_jsonl,
                       "--no-progress-bar"], nproc, host_bytes, timeout=timeout, tag=tag)
    records = []
    if os.path.exists(log_jsonl):
        with open(log_jsonl) as f:
            records = [json.loads(x) for x in f if x.strip()]
    run["records"] = records
    return run


# ------------------------------------------------------------------------------------------------
# planned vs measured

def compare(p, run: dict) -> dict:
    """Planned bytes by component (the job's plan, per node) next to what the run measured."""
    ranks = p.ranks_per_node
    dev, host = p.device_items, p.host_items
    act_keys = [k for k in dev if k.startswith(("activations", "logits")) or k == "allocator_fragmentation"]
    dev_state = sum(v for k, v in dev.items() if k not in act_keys and k != "framework_overhead")
    host_state = sum(v for k, v in host.items() if k not in ("process_overhead", "os_reserve"))
    planned = {"process_overhead": host.get("process_overhead", 0),
               "device_model_states": dev_state * ranks, "host_model_states": host_state,
               "activations": sum(dev[k] for k in act_keys) * ranks,
               "framework_overhead": dev.get("framework_overhead", 0) * ranks}
    planned_total = sum(planned.values()) if p.input.device_is_host else host_state + planned["process_overhead"]
    recs = run["records"]
    setup = next((r["phases"] for r in recs if r.get("kind") == "setup_memory"), None)
    train = [r for r in recs if r.get("kind") == "train"]
    measured = {}
    last = train[-1] if train else None
    if last:
        measured["engine_model_states"] = (last["device_model_state_bytes"] + last["host_model_state_bytes"]) * ranks
        measured["rank0_peak_rss"] = last["host_rss_bytes"]
        if last.get("device_peak_bytes") is not None:
            measured["device_peak_allocated"] = last["device_peak_bytes"]
    if setup:
        rss = {k: v.get("vmrss", 0) for k, v in setup.items()}
        # rank 0's figures x ranks (every rank holds the same shapes)
        measured["process_overhead"] = rss["data"] * ranks          # imports, process group, data
        measured["model_build_fp32"] = (rss["model"] - rss["data"]) * ranks
        measured["optimizer_build"] = (rss["optimizer"] - rss["model"]) * ranks
        measured["build_peak_over_resident"] = (setup["optimizer"].get("vmhwm", 0) - rss["optimizer"]) * ranks
        if last:
            grown = (last["host_rss_bytes"] - rss["data"]) * ranks  # everything the model and training added
            measured["model_states_and_activations"] = grown
            measured["activations_and_transients"] = grown - measured["engine_model_states"]
    measured["launcher_peak_rss"] = run["launcher_hwm_bytes"]
    measured["tree_peak_rss"] = run["peak_tree_rss_bytes"]
    measured["tree_sum_of_process_peaks"] = run["sum_process_hwm_bytes"]
    acc = next((r.get("accounting") for r in recs if r.get("kind") == "setup_memory"), None)
    if acc:
        measured["engine_accounting_rank0"] = {k: v for k, v in acc.items() if k.endswith("_bytes")
                                               and not k.startswith(("sent", "received", "d2h", "h2d"))}
    out = dict(planned=planned, planned_total_bytes=planned_total, measured=measured,
               planned_device_items=dev, planned_host_items=host)
    if planned_total:
        out["tree_peak_over_planned"] = measured["tree_peak_rss"] / planned_total - 1
    return out


def within_budget(run: dict, host: int) -> bool:
    """A run holds its plan only if its process tree's peak stayed within the memory the job was
    given (`host`: SLURM_MEM_PER_NODE, the limit a real allocation enforces); over it is a failed
    plan, however well it trained here."""
    return run["peak_tree_rss_bytes"] <= host


def run_verdict(run: dict, cmp_: dict, host: int, within: bool) -> str:
    """The run's memory line: its peak against the plan and against the budget."""
    over = cmp_.get("tree_peak_over_planned", 0)
    from zo_megatron.planner import PLAN_ERROR_MARGIN

    return (f"tree peak RSS {format_bytes(run['peak_tree_rss_bytes'])} vs planned "
            f"{format_bytes(cmp_['planned_total_bytes'])} ({100 * over:+.1f}%"
            + (f", outside the planner's {PLAN_ERROR_MARGIN:.0%}" if abs(over) > PLAN_ERROR_MARGIN else "") + "); "
            + (f"within the {format_bytes(host)} budget" if within else
               f"OVER the {format_bytes(host)} budget by {format_bytes(run['peak_tree_rss_bytes'] - host)}: "
               "the plan failed (a job held to that limit would be killed)"))


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    c = result["ours"]["comparison"]
    pl, me = c["planned"], c["measured"]
    rows = [("process overhead\n(ranks + launcher)", pl["process_overhead"],
             me["process_overhead"] + me["launcher_peak_rss"] if "process_overhead" in me else None),
            ("model states\n(device + host)", pl["device_model_states"] + pl["host_model_states"],
             me.get("engine_model_states")),
            ("activations\n+ transients", pl["activations"] + pl["framework_overhead"],
             me.get("activations_and_transients")),
            ("total\n(tree peak RSS)", c["planned_total_bytes"], me.get("tree_peak_rss"))]
    ds_runs = (result.get("deepspeed") or {}).get("runs")
    if ds_runs:
        fig, (ax, ax2) = plt.subplots(1, 2, figsize=(14, 4.6), gridspec_kw=dict(width_ratios=[1.25, 1]))
        _plot_against_deepspeed(ax2, result)
    else:
        fig, ax = plt.subplots(figsize=(8, 4.2))
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r[1] / GiB for r in rows], 0.4, label="planned")
    ax.bar([x + 0.2 for x in xs], [(r[2] or 0) / GiB for r in rows], 0.4, label="measured")
    ax.set_xticks(list(xs), [r[0] for r in rows])
    ax.set_ylabel("GiB")
    o = result["ours"]
    ax.set_title(f"{o['rule']}: largest {o['params'] / 1e6:.1f}M params ({o['shape']['num_layers']} x "
                 f"{o['shape']['hidden_size']}), {result['precision']}, TP{result['tensor_parallel']} x "
                 f"DP{result['data_parallel']}, {format_bytes(result['host_memory_bytes'])}"
                 + (f"\n{'moments + master' if result['nvme']['master'] else 'Adam moments'} on disk "
                    f"({result['nvme']['disk_bytes_per_node'] / 1e9:.1f} GB); in memory the largest is "
                    f"{result['nvme']['in_memory_params'] / 1e6:.1f}M" if result.get("nvme") else ""), fontsize=9)
    ax.legend()
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_against_deepspeed(ax, result: dict) -> None:
    """Tree peak RSS against parameters: our largest model's run, each DeepSpeed run, the budget."""
    d = result["deepspeed"]
    budget = d["run_budget_bytes"] / GiB
    ax.axhline(budget, color="gray", ls="--", lw=1)
    ax.text(0.01, budget, f" budget {budget:.2f} GiB (host less the OS reserve)", va="bottom", fontsize=8,
            transform=ax.get_yaxis_transform())
    for k, r in sorted(d["runs"].items(), key=lambda kv: int(kv[0])):
        fit = r["fits"]
        ax.plot(r["params"] / 1e6, r["peak_tree_rss_bytes"] / GiB, "s", ms=8, color="tab:red",
                mfc="tab:red" if fit else "none")
        ax.annotate(f"DS k={k}: {'fits' if fit else 'over'}", (r["params"] / 1e6, r["peak_tree_rss_bytes"] / GiB),
                    textcoords="offset points", xytext=(6, -10), fontsize=8)
    o = result["ours"]
    if o.get("run"):
        ax.plot(o["params"] / 1e6, o["run"]["peak_tree_rss_bytes"] / GiB, "o", ms=9, color="tab:blue")
        ax.annotate(f"ours k={o['size']}: trained", (o["params"] / 1e6, o["run"]["peak_tree_rss_bytes"] / GiB),
                    textcoords="offset points", xytext=(6, 4), fontsize=8)
    ratio = result.get("ours_over_deepspeed")
    ax.set_title("largest trained: ours vs DeepSpeed ZeRO-2 offload (filled: fits)"
                 + (f"; ours / DeepSpeed = {ratio:.2f}x" if ratio else ""), fontsize=9)
    ax.margins(x=0.2, y=0.15)
    ax.set_xlabel("parameters (M)")
    ax.set_ylabel("process tree peak RSS (GiB)")
    ax.grid(alpha=0.3)


# ------------------------------------------------------------------------------------------------

def earlier_deepspeed_side(path: str, job: dict, rule: str) -> dict:
    """The DeepSpeed side of an earlier run of this tool, if it measured the same job (`job`: the
    fields this run writes at the top of its JSON; `rule`: its shape rule)."""
    try:
        with open(path) as f:
            old = json.load(f)
    except (OSError, ValueError) as exc:
        raise ValueError(f"--deepspeed-from {path}: not a JSON file this tool wrote ({exc})") from None
    if "deepspeed" not in old:
        raise ValueError(f"--deepspeed-from {path}: it has no DeepSpeed side (run that one with --deepspeed)")
    differ = [k for k in job if old.get(k) != job[k]]
    if old.get("ours", {}).get("rule") != rule:
        differ.append("rule")
    if differ:
        raise ValueError(f"--deepspeed-from {path}: it measured a different job ({', '.join(differ)} differ); "
                         "give the same rule, layout, precision and --host-memory")
    return old["deepspeed"]


def main(argv=None) -> int:
    parser = build_parser()
    a = parser.parse_args(argv)
    a.precision = a.precision or "bf16"
    try:
        import torch

        cuda = torch.cuda.is_available()
        if a.multi_latent_attention and (a.deepspeed or a.deepspeed_from):
            raise ValueError("--deepspeed with --multi-latent-attention: DeepSpeed's side builds Hugging Face GPT-2 / "
                             "Llama models, which have no MLA; drop --deepspeed")
        rule = Rule(a)
        if a.device_memory is not None and not cuda and not a.skip_run:
            raise ValueError("--device-memory: no GPU here to run on (a CPU run's device is host memory); add "
                             "--skip-run to plan for a GPU of that memory, or give --host-memory")
        host = a.host_memory if a.host_memory is not None else mem_available_bytes()
        host = host // MiB * MiB                     # the job gets it in MiB (SLURM_MEM_PER_NODE)
        ranks = a.tensor_parallel * a.data_parallel
        planner = JobPlanner(rule, host, ranks, a.device_memory)
        planner.plan(1)                              # the job's own one-line checks of these flags, now
        job = dict(family=a.family, grow=a.grow, precision=a.precision, tensor_parallel=a.tensor_parallel,
                   data_parallel=a.data_parallel, seq_length=a.seq_length, micro_batch_size=a.micro_batch_size,
                   host_memory_bytes=host, **({"mla_flags": rule.mla_flags()} if a.multi_latent_attention else {}))
        earlier_ds = earlier_deepspeed_side(a.deepspeed_from, job, rule.describe()) if a.deepspeed_from else None
        if a.optimizer_nvme_path is not None and not a.skip_run and not os.path.isdir(a.optimizer_nvme_path):
            raise ValueError(f"--optimizer-nvme-path {a.optimizer_nvme_path} is not a directory: create it on the disk "
                             "the runs should use (or add --skip-run to plan only)")
    except (ValueError, SystemExit) as exc:
        if isinstance(exc, SystemExit) and exc.code in (0, None):
            raise
        msg = str(exc) if isinstance(exc, ValueError) else "the flags above are not valid for pretrain_gpt.py"
        print(f"find_max_model.py: error: {msg}", file=sys.stderr)
        return 2
    gpu = cuda or a.device_memory is not None
    where = "CPU run: device = host memory" if not gpu else \
        f"planned for a GPU of {format_bytes(a.device_memory)} (none here: --skip-run)" if not cuda else \
        f"CUDA: {torch.cuda.get_device_name(0)}, device {format_bytes(a.device_memory or torch.cuda.get_device_properties(0).total_memory)}"
    print(f"find_max_model: {rule.describe()}, {a.precision}, TP {a.tensor_parallel} x DP {a.data_parallel}, "
          f"seq {a.seq_length}, micro-batch {a.micro_batch_size}; host memory {format_bytes(host)}"
          f"{' (given)' if a.host_memory else ' (MemAvailable)'}; {where}; {tier_name(a)}", flush=True)
    t0 = time.monotonic()
    k = planner.largest(a.max_size)
    if k == 0:
        print(f"  planner: not even size 1 fits: {'; '.join(planner.plan(1).reasons)}")
        return 1
    p, p_next = planner.plan(k), planner.plan(k + 1)
    print(f"  planner: largest k = {k}: {rule.shape(k)} = {p.params_total / 1e6:.1f}M params "
          f"({len(planner.probes) + len(planner.may_probes)} plans, {time.monotonic() - t0:.1f}s); k+1 = {p_next.params_total / 1e6:.1f}M "
          f"does not fit", flush=True)
    for r in p.reasons:
        print(f"    {r}")
    for w in p.warnings:
        print(f"    ! {w}")
    tier = tier_edge(a, rule, p, host, ranks) if a.optimizer_nvme_path is not None else None
    result = dict(tool="tools/find_max_model.py", argv=sys.argv[1:] if argv is None else list(argv),
                  **job, device_is_host=not gpu, machine=machine(),
                  ours=dict(rule=rule.describe(), size=k, shape=rule.shape(k), params=p.params_total,
                            job_flags=rule.job_flags(k), planned_fits=True, next_size_params=p_next.params_total,
                            plan_reasons=p.reasons, next_size_plan_reasons=p_next.reasons,
                            probes={str(x): f for x, f in sorted(planner.probes.items())}))
    if tier:
        result["nvme"] = tier
    ok = True
    if not a.skip_run:
        with tempfile.TemporaryDirectory(prefix="find_max_model_") as tmp:
            print(f"  run: training k = {k} ({p.params_total / 1e6:.1f}M params) for {a.train_iters} iterations "
                  f"under torchrun ({ranks} rank(s)) ...", flush=True)
            run = run_job(rule.job_flags(k), ranks, host, os.path.join(tmp, "fit.jsonl"), timeout=a.timeout, tag=f"k={k}")
            trained = run["rc"] == 0 and any(r.get("kind") == "train" and r["iteration"] == a.train_iters
                                             for r in run["records"])
            cmp_ = compare(p, run)
            within = within_budget(run, host)
            print(f"  run: {'trained' if trained else 'FAILED (exit ' + str(run['rc']) + ')'} in {run['wall_s']}s; "
                  f"{run_verdict(run, cmp_, host, within)}", flush=True)
            print(f"  run: next size k = {k + 1} ({p_next.params_total / 1e6:.1f}M params): expecting the "
                  f"pre-launch check to refuse it ...", flush=True)
            nxt = run_job(rule.job_flags(k + 1), ranks, host, os.path.join(tmp, "next.jsonl"), timeout=a.timeout,
                          tag=f"k={k + 1}")
            refused = 2 in nxt["rank_exit_codes"] and len(nxt["error_lines"]) == 1 and \
                REFUSAL in nxt["error_lines"][0] and not any(r.get("kind") == "train" for r in nxt["records"])
            print(f"  run: k = {k + 1} {'refused by the pre-launch check (rank exit 2, one line)' if refused else 'NOT refused as expected'}"
                  f" in {nxt['wall_s']}s", flush=True)
        for r in (run, nxt):
            r.pop("records")
        result["ours"].update(trained=trained, run=run, comparison=cmp_, next_size_refused=refused, next_run=nxt,
                              budget_bytes=host, within_budget=within)
        ok = trained and within and refused
    if a.json and a.deepspeed and not a.deepspeed_from:   # ours is known: keep it even if the DeepSpeed side is interrupted
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1, default=str)
    if a.deepspeed_from:
        result["deepspeed"] = dict(earlier_ds, taken_from=a.deepspeed_from)
        print(f"  deepspeed: taken from {a.deepspeed_from} (largest k = {result['deepspeed'].get('proven_size')})")
    elif a.deepspeed:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import find_max_model_deepspeed as fmd

        result["deepspeed"] = fmd.find(a, rule, host, run_proofs=not a.skip_run)
    if "deepspeed" in result:
        ratio_to_deepspeed(result, p.params_total, a.skip_run)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1, default=str)
        print(f"  json: {a.json}")
    if a.png and not a.skip_run:
        plot(result, a.png)
        print(f"  png: {a.png}")
    return 0 if ok else 1


def ratio_to_deepspeed(result: dict, params: int, skip_run: bool) -> None:
    """Ours over DeepSpeed's largest model into `result` (under the key that says on what basis), printed."""
    d = result["deepspeed"]
    if d.get("proven_params"):          # proven by a run (a lower bound on DeepSpeed when not bracketed)
        result["ours_over_deepspeed"] = params / d["proven_params"]
        basis = "proven by a run" + ("" if d.get("bracketed") else "; not bracketed: DeepSpeed's edge may be higher")
    elif d.get("runs"):                 # runs made, none fit: DeepSpeed's edge is below its estimator's size
        result["ours_over_deepspeed_lower_bound"] = params / d["estimator_params"]
        basis = "DeepSpeed's estimator size did not fit by a run: its edge is smaller, the ratio a lower bound"
    elif d.get("estimator_params"):
        result["ours_over_deepspeed_estimator"] = params / d["estimator_params"]
        basis = "DeepSpeed's estimator only, not run"
    else:
        return
    if skip_run:
        basis = "DeepSpeed: " + basis + "; ours: planned only, --skip-run"
    ds = d.get("proven_params") or d["estimator_params"]
    print(f"  ours / DeepSpeed: {params / 1e6:.1f}M / {ds / 1e6:.1f}M = {params / ds:.2f}x"
          f"{' or more' if 'lower bound' in basis else ''} ({basis})", flush=True)


def machine() -> str:
    model = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
            f.seek(0)
            avx2 = " AVX2" if " avx2" in f.read() else ""
    except OSError:
        avx2 = ""
    return f"{model}{avx2}, {os.cpu_count()} CPUs"


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    sys.exit(main())
