"""What a run reports: readable log lines, a progress bar on a terminal, JSONL, TensorBoard."""
from __future__ import annotations

import contextlib
import json
import math
import os
import resource
import sys
import time

# a mixture of experts' router losses in a train row (training/moe_losses.py: megatron-core's names)
MOE_LOSS_KEYS = ("load_balancing_loss", "seq_load_balancing_loss", "z_loss")


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


def human_time(s: float) -> str:
    s = int(max(0, s))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def flops_per_token(num_layers: int, hidden: int, seq: int, vocab: int, recompute: str | None,
                    ffn_hidden_size: int | None = None, recomputed_layers: int | None = None, *,
                    num_attention_heads: int | None = None, num_query_groups: int | None = None,
                    kv_channels: int | None = None, swiglu: bool = False, moe_layers: list[bool] | None = None,
                    moe_ffn_hidden_size: int | None = None, moe_router_topk: int = 2,
                    moe_shared_expert_intermediate_size: int | None = None,
                    recompute_modules: frozenset | tuple = (), multi_latent_attention: bool = False,
                    q_lora_rank: int | None = None, kv_lora_rank: int = 32, qk_head_dim: int = 128,
                    qk_pos_emb_head_dim: int = 64, v_head_dim: int = 128) -> int:
    """Model FLOPs per trained token (forward + backward): Megatron-LM's count
    (`num_floating_point_operations`, megatron/training/training.py at core_v0.16.1, GPT with or
    without experts), divided by batch x seq. Per layer forward, with q = kv_channels x heads (= h by
    default) and k = v = kv_channels x G (GQA; = q without it): the QKV projection 2h(q + 2k), causal
    attention scores and values 2qs (Megatron counts half of the s x s products since 2025-03: QK^T
    and (QK^T)V are 2·q·s/2 each), the output projection 2qh, the MLP 4hf (6hf with SwiGLU: fc1 is
    h -> 2f); the LM head 2Vh (V padded). A mixture of experts' layer (`moe_layers`: which layers)
    counts only the experts a token uses: its top-k routed experts of `moe_ffn_hidden_size` (default
    the dense FFN size) and the shared expert, each 4h·f_e (6h·f_e with SwiGLU); the router's
    h x E product is not counted (Megatron's formula leaves it out). Backward is twice the forward;
    full recompute adds one more forward of the layers it recomputes (`recomputed_layers`, default
    all; --recompute-method block N: the first N), selective recompute one more forward of its
    `recompute_modules` (core_attn: the scores and values, 2qs; mlp: a dense layer's MLP; moe: an
    MoE layer's experts a token uses and its shared expert; shared_experts: the shared expert; the
    norms are not counted, as nowhere here) -- Megatron's own count leaves recompute out.

    Multi-latent attention (`multi_latent_attention`, GPTConfig's MLA fields; n heads, d_qk =
    qk_head_dim + qk_pos_emb_head_dim, r_q / r_kv the latent ranks), Megatron-LM's MLA branch per layer
    forward: queries 2h·n·d_qk (r_q None) or 2·r_q·(h + n·d_qk + 1), keys and values 2·r_kv·(h +
    n·(qk_head_dim + v_head_dim) + 1) + 2h·qk_pos_emb_head_dim, the output projection 2·n·v_head_dim·h,
    the causal core s·n·(d_qk + v_head_dim) (half of QK^T and of (QK^T)V); the +1s are Megatron's count
    of the two latent norms, whether --qk-layernorm builds them or not. Selective recompute of core_attn
    adds that core once more per layer, of mla_up_proj the up projections (2·n·d_qk·(r_q or h) +
    2·r_kv·n·(qk_head_dim + v_head_dim))."""
    h = hidden
    f = (int(4 * h * 2 / 3 / 64) * 64 if swiglu else 4 * h) if ffn_hidden_size is None else ffn_hidden_size
    if num_attention_heads is None:
        if num_query_groups is not None or kv_channels is not None:
            raise ValueError("flops_per_token needs num_attention_heads with num_query_groups or kv_channels")
        q = kv = h
    else:
        d = kv_channels or h // num_attention_heads
        q, kv = d * num_attention_heads, d * (num_query_groups or num_attention_heads)
    attention = 2 * h * (q + 2 * kv) + 2 * q * seq + 2 * q * h
    core = 2 * q * seq                          # the causal QK^T and (QK^T)V, half of each s x s product
    up_again = 0
    if multi_latent_attention:
        if num_attention_heads is None:
            raise ValueError("flops_per_token needs num_attention_heads with multi-latent attention")
        n, d_qk = num_attention_heads, qk_head_dim + qk_pos_emb_head_dim
        queries = h * n * d_qk if q_lora_rank is None else q_lora_rank * (h + n * d_qk + 1)
        keys_values = kv_lora_rank * (h + n * (qk_head_dim + v_head_dim) + 1) + h * qk_pos_emb_head_dim
        core = seq * n * (d_qk + v_head_dim)
        attention = 2 * (queries + keys_values + n * v_head_dim * h) + core
        # --recompute-modules mla_up_proj: the up projections (queries from their latent or the hidden state,
        # keys and values from theirs) run again
        up_again = 2 * n * (d_qk * (h if q_lora_rank is None else q_lora_rank) + kv_lora_rank * (qk_head_dim + v_head_dim))
    gemms = 3 if swiglu else 2                  # h -> f (-> 2f with SwiGLU) and f -> h, 2 FLOPs per product
    dense_layer = attention + 2 * h * f * gemms
    moe_ffn = (moe_ffn_hidden_size or f) * moe_router_topk + (moe_shared_expert_intermediate_size or 0)
    moe_layer = attention + 2 * h * moe_ffn * gemms
    kinds = list(moe_layers) if moe_layers is not None else [False] * num_layers
    if len(kinds) != num_layers:
        raise ValueError(f"moe_layers names {len(kinds)} layers, the model has {num_layers}")
    per_layer = [moe_layer if kind else dense_layer for kind in kinds]
    head_fwd = 2 * vocab * h
    again = 0 if recompute != "full" else (num_layers if recomputed_layers is None else recomputed_layers)
    selective = 0
    if recompute == "selective":
        mods = set(recompute_modules or ("core_attn",))
        for kind in kinds:
            selective += core if "core_attn" in mods else 0
            selective += up_again if "mla_up_proj" in mods and multi_latent_attention else 0
            if kind and "moe" in mods:
                selective += 2 * h * moe_ffn * gemms
            elif kind and "shared_experts" in mods:
                selective += 2 * h * (moe_shared_expert_intermediate_size or 0) * gemms
            elif not kind and "mlp" in mods:
                selective += 2 * h * f * gemms
    return 3 * sum(per_layer) + sum(per_layer[:again]) + selective + 3 * head_fwd


# GPTConfig's MLA fields that flops_per_token reads (model/config.py MLA_FIELDS less the rope type)
MLA_FLOP_FIELDS = ("multi_latent_attention", "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim",
                   "v_head_dim")


def model_flops_per_token(cfg, seq_length: int, padded_vocab_size: int, recompute: str | None,
                          recomputed_layers: int | None = None) -> int:
    """`flops_per_token` of a GPTConfig (its architecture and MoE fields; GPT-2 where a field is absent)."""
    experts = getattr(cfg, "num_experts", None) is not None
    return flops_per_token(cfg.num_layers, cfg.hidden_size, seq_length, padded_vocab_size, recompute,
                           cfg.ffn_size, recomputed_layers, num_attention_heads=cfg.num_attention_heads,
                           num_query_groups=getattr(cfg, "num_query_groups", None),
                           kv_channels=getattr(cfg, "kv_channels", None),
                           swiglu=getattr(cfg, "swiglu", False) or getattr(cfg, "quick_geglu", False),   # gated: 3 GEMMs
                           moe_layers=cfg.moe_layers() if experts else None,
                           moe_ffn_hidden_size=cfg.moe_ffn_size if experts else None,
                           moe_router_topk=cfg.moe_router_topk if experts else 2,
                           moe_shared_expert_intermediate_size=cfg.moe_shared_expert_intermediate_size
                           if experts else None, recompute_modules=getattr(cfg, "recompute_modules", None) or (),
                           **{name: getattr(cfg, name) for name in MLA_FLOP_FIELDS
                              if getattr(cfg, "multi_latent_attention", False)})


class Metrics:
    """Rank 0 writes; every other rank's calls are no-ops."""

    def __init__(self, *, enabled: bool, total_iters: int, jsonl_path: str | None = None,
                 tensorboard_dir: str | None = None, progress_bar: bool = True, wandb: dict | None = None):
        self.enabled = enabled
        self.total_iters = total_iters
        self.start = time.monotonic()
        self._jsonl = None
        self._tb = None
        self._header = None
        self._bar = None
        self._wandb = None
        if not enabled:
            return
        if wandb:
            self._wandb = _start_wandb(**wandb)
        # JSONL and TensorBoard files are opened at the first record, not here: a run that fails
        # during set-up (bad data, a refused checkpoint) leaves no empty log or event file behind.
        self._jsonl_path, self._tb_dir = jsonl_path, tensorboard_dir
        if tensorboard_dir:
            try:
                import torch.utils.tensorboard  # noqa: F401
            except ImportError as exc:
                from zo_megatron.errors import UserError

                raise UserError("--tensorboard-dir needs the tensorboard package: pip install tensorboard "
                                f"(or 'zo_megatron[tensorboard]') ({exc})") from None
        if progress_bar and sys.stdout.isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=total_iters, unit="it", dynamic_ncols=True)

    def print(self, msg: str) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(msg)
        else:
            print(msg, flush=True)

    def advance(self, n: int = 1) -> None:
        if self._bar is not None:
            self._bar.update(n)

    def log_train(self, row: dict) -> None:
        if not self.enabled:
            return
        it = row["iteration"]
        elapsed = time.monotonic() - self.start
        row.setdefault("elapsed_s", elapsed)
        done = row.pop("_iters_done_this_run", it)
        eta = elapsed / max(done, 1) * (self.total_iters - it)
        gn = row["grad_norm"]
        when = f"[{row['time'].replace('T', ' ').replace('+00:00', ' UTC')}] " if row.get("time") else ""
        line = (f" {when}iter {it:>6}/{self.total_iters} | loss {row['loss']:.4f} | "
                + "".join(f"{k} {row[k]:.4e} | " for k in MOE_LOSS_KEYS if k in row)
                + (f"tokens/expert min {row['tokens_per_expert_min']:,.0f} max {row['tokens_per_expert_max']:,.0f} | "
                   if "tokens_per_expert_min" in row else "")
                + f"lr {row['lr']:.3e} | "
                + (f"decoupled lr {row['decoupled_lr']:.3e} | " if row.get("decoupled_lr") is not None else "")
                + f"grad norm {gn:.3f} | "
                + (f"num zeros {row['num_zeros_in_grad']:.1f} | " if row.get("num_zeros_in_grad") is not None else "")
                + (f"params norm {row['params_norm']:.3f} | " if "params_norm" in row else "")
                + f"loss scale {row['loss_scale']:.0f} | "
                f"skipped {row['skipped']} nan {row['nan_iterations']} | "
                + (f"speculated {row['speculated_buckets']} rolled back {row['rolled_back_buckets']} | "
                   if row.get("overlap_cpu_step") else "")
                + (f"consumed {row['consumed_samples']:,} samples | " if "consumed_samples" in row else "")
                + (f"global batch size {row['global_batch_size']:,} | " if "global_batch_size" in row else "")
                + f"{row['tokens_per_s']:,.0f} tok/s | "
                f"{row['tflops_per_rank']:.3f} TFLOP/s/rank | "
                + (f"MFU {row['mfu']:.1%} | " if row.get("mfu") is not None else "")
                + f"{row['step_time_s'] * 1000:.0f} ms/it | "
                + _disk_words(row)
                + f"model states dev {human_bytes(row['device_model_state_bytes'])} "
                f"host {human_bytes(row['host_model_state_bytes'])} | " + _peak_words(row)
                + f"elapsed {human_time(elapsed)} eta {human_time(eta)}")
        if self._bar is not None:
            self._bar.set_postfix(loss=f"{row['loss']:.3f}", refresh=False)
        self.print(line)
        self._write({k: v for k, v in row.items() if not k.startswith("_")}, "train")

    def log_eval(self, iteration: int, val_loss: float, split: str = "validation", eval_samples: int | None = None,
                 consumed_tokens: int | None = None) -> None:
        if not self.enabled:
            return
        ppl = math.exp(min(val_loss, 50.0))
        self.print(f" {split} loss at iteration {iteration} | lm loss {val_loss:.4f} | lm loss PPL {ppl:.3f}"
                   + (f" | {eval_samples} samples" if eval_samples is not None else ""))
        # the test data (--test-data-path, evaluated once at the end) is a record of its own kind and keys, so
        # no reader or logger takes it for the validation loss logged at the same iteration
        kind, key = ("eval", "val") if split == "validation" else (split, split)
        row = {"iteration": iteration, f"{key}_loss": val_loss, f"{key}_ppl": ppl, "split": split}
        if consumed_tokens is not None:          # training tokens so far: plot_loss.py's token axis
            row["consumed_tokens"] = consumed_tokens
        if eval_samples is not None:
            row["eval_samples"] = eval_samples
        self._write(row, kind)

    def _sink_failed(self, flag: str, where: str, exc: BaseException) -> None:
        """A log file that cannot be written (a full disk, a gone NFS mount) stops that log, not the
        run: only rank 0 writes logs, and a rank 0 raising here would leave the other ranks in their
        next collective until they lost contact. The checkpoints are what a resume needs, and their
        own failure ends the run on every rank with one line."""
        print(f"warning: {flag} {where}: writing failed ({type(exc).__name__}: {exc}); that log stops here, "
              "training goes on", file=sys.stderr, flush=True)
        if flag == "--log-jsonl":
            self._jsonl_path = None
            with contextlib.suppress(OSError):
                if self._jsonl is not None:
                    self._jsonl.close()
            self._jsonl = None
        else:
            self._tb_dir = None
            with contextlib.suppress(Exception):
                if self._tb is not None:
                    self._tb.close()
            self._tb = None

    def _open(self) -> None:
        if self._jsonl_path and self._jsonl is None:
            try:
                os.makedirs(os.path.dirname(os.path.abspath(self._jsonl_path)), exist_ok=True)
                self._jsonl = open(self._jsonl_path, "a", buffering=1)
                if self._header is not None:
                    self._jsonl.write(json.dumps(self._header) + "\n")
            except OSError as exc:
                self._sink_failed("--log-jsonl", self._jsonl_path, exc)
        if self._tb_dir and self._tb is None:
            from torch.utils.tensorboard import SummaryWriter

            try:
                self._tb = SummaryWriter(self._tb_dir)
            except OSError as exc:
                self._sink_failed("--tensorboard-dir", self._tb_dir, exc)
                return
            if self._header is not None:
                self._tb.add_text("run/header", "```\n" + json.dumps(self._header, indent=1) + "\n```", 0)
                flat = {k: v for k, v in self._header.get("args", {}).items() if isinstance(v, (int, float, str, bool))}
                try:
                    self._tb.add_hparams(flat, {}, run_name=".")
                except Exception:  # noqa: BLE001 - hparams are a convenience; text above holds them all
                    pass

    def header(self, record: dict) -> None:
        """The run's header record (arguments, versions, git commit, world layout): the first line
        of this run in the JSONL (appended runs stay apart) and TensorBoard text + hparams."""
        if self.enabled:
            self._header = {"kind": "header", **record}

    def log_setup_memory(self, phases: dict[str, dict[str, int]], accounting: dict | None = None) -> None:
        """One `"kind": "setup_memory"` JSONL record: this rank's resident set (rss) and its peak
        so far (hwm) after each set-up phase (process start, data, model built, optimizer built, and
        with --load the checkpoint read), and
        the optimizer's own byte accounting by component (offload/accounting.py): what
        tools/find_max_model.py compares with the planner's process overhead and model states."""
        if self.enabled:
            self._write_jsonl({"kind": "setup_memory", "iteration": 0, "phases": phases, "accounting": accounting})

    def log_save(self, iteration: int, path: str, seconds: float, before: dict[str, int], after: dict[str, int]) -> None:
        """The save's line, and a `"kind": "save"` JSONL record with its duration and this rank's
        resident set and peak (rss, hwm) before and after it: a save must not hold a second copy of
        the model states (tests/test_load_peak.py)."""
        self.print(f" saved checkpoint {path} in {seconds:.2f}s")
        if self.enabled:
            self._write_jsonl({"kind": "save", "iteration": iteration, "path": path, "seconds": seconds,
                               "memory_before": before, "memory_after": after})

    def _write_jsonl(self, record: dict) -> None:
        self._open()
        if self._jsonl is not None:
            try:
                self._jsonl.write(json.dumps(record) + "\n")
            except OSError as exc:
                self._sink_failed("--log-jsonl", self._jsonl_path, exc)

    def _write(self, row: dict, kind: str) -> None:
        self._write_jsonl({"kind": kind, **row})
        if self._tb is not None:
            it = row["iteration"]
            try:                        # (TensorBoard writes on a thread: its error surfaces at a later call)
                for k, v in row.items():
                    if k != "iteration" and isinstance(v, (int, float)) and not isinstance(v, bool):
                        self._tb.add_scalar(f"{kind}/{k}", v, it)
            except OSError as exc:
                self._sink_failed("--tensorboard-dir", self._tb_dir, exc)
        if self._wandb is not None:
            self._wandb.log({f"{kind}/{k}": v for k, v in row.items() if k != "iteration"
                             and isinstance(v, (int, float)) and not isinstance(v, bool)}, step=row["iteration"])

    def close(self) -> None:
        for f in (self._bar, self._jsonl, self._tb):
            if f is not None:
                f.close()
        if self._wandb is not None:
            self._wandb.finish()


def _disk_words(row: dict) -> str:
    """--optimizer-nvme-path: the states' disk traffic per iteration and the CPU step's wait for it (the
    I/O the ring did not hide behind the CPU Adam); nothing without the tier."""
    if row.get("nvme_read_bytes_per_step") is None:
        return ""
    return (f"disk read {human_bytes(row['nvme_read_bytes_per_step'])} written "
            f"{human_bytes(row['nvme_written_bytes_per_step'])} /it, waited "
            f"{row['nvme_io_wait_s_per_step'] * 1000:.0f} ms/it | ")


def _peak_words(row: dict) -> str:
    """The log line's memory peaks: every rank's maximum and which rank, or rank 0's own."""
    if row.get("host_peak_bytes_max") is None:
        return f"rss {human_bytes(row['host_rss_bytes'])} | " + (
            f"device peak {human_bytes(row['device_peak_bytes'])} | " if row.get("device_peak_bytes") else "")
    words = f"host peak {human_bytes(row['host_peak_bytes_max'])} (rank {row['host_peak_rank']}) | "
    if row.get("device_peak_bytes_max") is not None:
        words += f"device peak {human_bytes(row['device_peak_bytes_max'])} (rank {row['device_peak_rank']}) | "
    return words


# Dense 16-bit tensor-core peak (no sparsity) per GPU, TFLOP/s, from the vendors' data sheets: the
# denominator of MFU. The most specific name first (an "H100 PCIe" is not an SXM H100).
PEAK_BF16_TFLOPS = {"H100 PCIe": 756.0, "H100 NVL": 835.0, "H100": 989.4, "GH200": 989.4, "H200": 989.4,
                    "A100": 312.0, "B200": 2250.0}


def device_peak_tflops(device) -> float | None:
    """The device's dense bf16 peak (PEAK_BF16_TFLOPS), None where unknown: every CPU, unlisted GPUs."""
    import torch

    if getattr(device, "type", device) != "cuda" or not torch.cuda.is_available():
        return None
    return peak_tflops_of(torch.cuda.get_device_name(device))


def peak_tflops_of(name: str) -> float | None:
    return next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)


def _start_wandb(*, project: str, name: str | None, dir: str | None, config: dict, entity: str | None = None):
    """Megatron's --wandb-project/--wandb-exp-name/--wandb-save-dir/--wandb-entity. wandb itself honours
    WANDB_MODE=offline (and WANDB_API_KEY); nothing here needs a network."""
    try:
        import wandb
    except ImportError:
        from zo_megatron.errors import UserError

        raise UserError("--wandb-project needs the wandb package: pip install wandb "
                        "(WANDB_MODE=offline logs without an account)") from None
    from zo_megatron.errors import UserError

    plain = {k: v for k, v in config.items() if isinstance(v, (int, float, str, bool, type(None)))}
    try:
        if dir:
            os.makedirs(dir, exist_ok=True)
        return wandb.init(project=project, name=name, dir=dir, config=plain, entity=entity)
    except Exception as exc:  # noqa: BLE001 - wandb's own errors (no API key, no network, a bad dir): one line
        first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ""
        raise UserError(f"--wandb-project {project}: starting Weights & Biases failed ({type(exc).__name__}: "
                        f"{first}); log in (`wandb login` or WANDB_API_KEY), or set WANDB_MODE=offline to log "
                        "without a network") from None


def proc_memory_bytes(pid: int | str = "self") -> dict[str, int]:
    """A process's resident set now (VmRSS) and its peak so far (VmHWM), from /proc/<pid>/status
    (default: this process; Linux; empty elsewhere or when the process is gone)."""
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(("VmRSS:", "VmHWM:")):
                    out[line[:5].lower()] = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return out


def host_rss_bytes() -> int:
    """Peak resident set of this process's own memory so far (VmHWM).

    Not getrusage's ru_maxrss: Linux carries it across exec, so a process started by a large parent
    (torchrun's launcher, a benchmark driver, a test runner) would report at least the parent's
    resident set at the time of the spawn. Where /proc is missing, ru_maxrss is all there is
    (KiB on Linux, bytes on macOS)."""
    hwm = proc_memory_bytes().get("vmhwm")
    if hwm is not None:
        return hwm
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return maxrss if sys.platform == "darwin" else maxrss * 1024
