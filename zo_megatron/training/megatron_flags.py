"""Every Megatron-LM flag, classified: implemented, accepted as a no-op, or refused with the reason.

The flag list is data (megatron_flag_list.py, generated once from Megatron-LM core_v0.16.1 by
tools/gen_megatron_flags.py). A flag this job's parser defines itself is "implemented" (its --help
says what it does) unless listed in NO_OP_OURS; every other flag is added to the parser here as a
hidden flag that is either a no-op (accepted and ignored, because it describes what the job
already does or only picks a kernel/performance path) or refused: all refused flags of one command
line are reported together in one line (megatron_compat.check_megatron_compat).

docs/megatron_compat.md carries the whole table (written by `python -m
zo_megatron.training.megatron_doc --write-doc`); tests/test_megatron_compat.py checks every row.

This module reads only the data below it (megatron_flag_list) and never the parser: megatron_compat
and arguments import it, not the other way round (tests/test_import_graph.py). The functions that
need the parser or megatron_compat.REFUSED take them as arguments.
"""
from __future__ import annotations

import argparse
import re

from zo_megatron.training.megatron_flag_list import FLAGS, MEGATRON_LM_COMMIT, MEGATRON_LM_VERSION

NOOP_DEST = "megatron_noop__"
REFUSED_DEST = "megatron_refused__"

# Megatron-LM flags a branch in flight implements, marked so the table test accepts them before its
# parser defines them (flag -> "issue N"). Empty: issues 24-26 landed and their parser defines them.
IMPLEMENTED_ELSEWHERE: dict[str, str] = {}

_FUSION = ("performance only: selects a fused kernel; this job runs megatron-core's unfused local "
           "path, with the same math")
_NCCL = ("performance only: a communication/overlap tuning of Megatron's DDP or NCCL; ZeRO-Offload "
         "buckets and overlaps its own reduce-scatter (--bucket-size)")
_PIN = "host buffers follow --no-pin-memory (host copies then block: backward serialises behind every copy home)"
_CKPT_IO = ("performance only: how Megatron's dist-checkpointing schedules its I/O; checkpoints here are "
            "DCP directories written in parallel by every rank, atomically")

# Flags this job's parser defines that are accepted without effect (they describe what it does).
NO_OP_OURS = {
    "--log-throughput": "tokens/s and TFLOP/s per rank are always in the log line and the JSONL",
    "--use-distributed-optimizer": "with --zero-offload the optimizer state is already partitioned over DP; "
                                   "without it the plain optimizer keeps whole replicas (the same updates; "
                                   "the memory plan counts them)",
}

# Megatron flags this parser does not define, accepted without effect: flag -> why.
NO_OP = {
    "--use-mcore-models": "the model is megatron-core's GPTModel (mcore), always",
    "--use-pytorch-profiler": "--profile always records with torch.profiler here (Megatron's other recorder is "
                              "an external nsys)",
    "--tiktoken-pattern": "read only by Megatron's TikTokenizer, which is not offered (--tokenizer-type)",
    "--tiktoken-num-special-tokens": "read only by Megatron's TikTokenizer, which is not offered (--tokenizer-type)",
    "--tiktoken-special-tokens": "read only by Megatron's TikTokenizer, which is not offered (--tokenizer-type)",
    "--no-persist-layer-norm": "the LayerNorm is torch's (no persistent Apex kernel is used)",
    "--attention-softmax-in-fp32": "the attention softmax runs in fp32 already",
    "--no-gradient-accumulation-fusion": "gradients accumulate through autograd (no fused wgrad kernel)",
    "--disable-jit-fuser": "no TorchScript/nvFuser fusions are used",
    "--use-dist-ckpt": "checkpoints are torch.distributed.checkpoint directories already",
    "--async-save": "the save is synchronous (the same checkpoint, written atomically): a background save needs a "
                    "second copy of the host-resident optimizer state while training goes on, and host memory is "
                    "what bounds the model (docs/checkpoints.md)",
    "--use-persistent-ckpt-worker": "the save is synchronous (see --async-save): there is no background writer",
    "--auto-detect-ckpt-format": "there is one checkpoint format (DCP, Megatron's torch_dist)",
    "--dist-ckpt-format": "there is one checkpoint format (DCP, Megatron's torch_dist)",
    "--ckpt-fully-parallel-save": "every rank writes its own shards already",
    "--ckpt-fully-parallel-load": "every rank reads only the boxes it needs already",
    "--ckpt-assume-constant-structure": _CKPT_IO,
    "--no-ckpt-fully-parallel-save": _CKPT_IO,
    "--disable-ckpt-fully-parallel-save": _CKPT_IO,
    "--dist-ckpt-optim-fully-reshardable": "optimizer states reshard to any TP x DP on load already",
    "--distrib-optim-fully-reshardable-mem-efficient": _CKPT_IO,
    "--log-validation-ppl-to-tensorboard": "validation perplexity is always written (eval/val_ppl)",
    "--log-memory-to-tensorboard": "model-state and RSS bytes are always written to TensorBoard and the JSONL",
    "--log-timers-to-tensorboard": "step time is always written (train/step_time_s); --timeline has phases",
    "--log-world-size-to-tensorboard": "the world layout is in the banner and the JSONL header record",
    "--log-loss-scale-to-tensorboard": "the loss scale is always written (train/loss_scale)",
    "--tensorboard-log-interval": "TensorBoard gets every logged iteration (--log-interval)",
    "--tensorboard-queue-size": "performance only: the event writer's queue",
    "--timing-log-level": "logging detail: step time is always logged; --timeline gives per-phase times",
    "--timing-log-option": "logging detail: step time is always logged; --timeline gives per-phase times",
    "--no-barrier-with-level-1-timing": "logging detail: no timer barriers are inserted",
    "--log-progress": "progress (iteration, elapsed, ETA) is in every log line",
    "--logging-level": "logging detail: the job's log is its log lines and error lines",
    "--num-workers": "performance only: batches are read in the training process (memory-mapped)",
    "--no-mmap-bin-files": "performance only: the .bin files are memory-mapped",
    "--dataloader-type": "batches are single-pass over the sample order Megatron's GPTDataset builds",
    "--num-dataset-builder-threads": "performance only: dataset index building",
    "--manual-gc": "performance only: Python's garbage collector settings",
    "--manual-gc-interval": "performance only: Python's garbage collector settings",
    "--no-manual-gc-eval": "performance only: Python's garbage collector settings",
    "--disable-manual-gc-eval": "performance only: Python's garbage collector settings",
    "--empty-unused-memory-level": "performance only: CUDA caching-allocator housekeeping",
    "--use-cpu-initialization": "the model is initialised on the host already (the device gets the 16-bit copy)",
    "--no-async-tensor-model-parallel-allreduce": _FUSION,
    "--disable-async-tensor-model-parallel-allreduce": _FUSION,
    "--distributed-timeout-seconds-after-init": "performance only: --distributed-timeout-minutes applies throughout",
    "--ddp-bucket-size": "ZeRO-Offload's bucket size is --bucket-size (elements)",
    "--no-pin-cpu-grads": _PIN,
    "--no-pin-cpu-params": _PIN,
    "--use-torch-optimizer-for-cpu-offload": "the CPU optimizer is the CPU Adam kernel (torch's fused AdamW "
                                             "when the kernel is not built)",
    "--optimizer-cpu-offload": "with --zero-offload the optimizer runs on the CPU already",
    "--overlap-cpu-optimizer-d2h-h2d": "with --zero-offload gradient and parameter copies are bucketed and "
                                       "overlapped already",
    "--overlap-grad-reduce": _NCCL, "--overlap-param-gather": _NCCL,
    "--overlap-param-gather-with-optimizer-step": _NCCL,
    "--no-align-grad-reduce": _NCCL, "--no-align-param-gather": _NCCL, "--ddp-average-in-collective": _NCCL,
    "--ddp-num-buckets": _NCCL, "--ddp-pad-buckets-for-high-nccl-busbw": _NCCL, "--no-gradient-reduce-div-fusion": _NCCL,
    "--ddp-reduce-scatter-with-fp32-accumulation": "bf16 gradients are reduced in fp32 already "
                                                   "(--accumulate-allreduce-grads-in-fp32, default on for bf16)",
    "--nccl-communicator-config-path": _NCCL, "--use-sharp": _NCCL, "--sharp-enabled-group": _NCCL,
    "--use-nccl-ub": _NCCL, "--disable-symmetric-registration": _NCCL, "--create-all-gather-group": _NCCL,
    "--high-priority-stream-groups": _NCCL, "--suggested-communication-unit-size": _NCCL,
    "--no-scatter-gather-tensors-in-pipeline": "one pipeline stage: nothing is sent between stages",
    "--no-overlap-p2p-communication": "one pipeline stage: nothing is sent between stages",
    "--overlap-p2p-communication-warmup-flush": "one pipeline stage: nothing is sent between stages",
    "--deterministic-mode": "the CPU/gloo path is deterministic; runs repeat bit for bit",
    "--check-for-large-grads": "monitoring: NaN/inf gradients are detected and skipped already (--max-skipped-iters)",
    "--no-check-for-nan-in-loss-and-grad": "NaN/inf steps are skipped and counted; --max-skipped-iters 0 never stops",
    "--use-tp-pp-dp-mapping": "rank order: TP groups are the adjacent ranks, as Megatron's default",
    "--legacy-tokenizer": "the GPT-2 BPE tokenizer is Megatron's legacy GPT2BPETokenizer",
    "--no-create-attention-mask-in-dataloader": "the causal mask is built in the model",
}

_GROUPED_GEMM = ("performance only: the local experts run one after another (megatron-core's SequentialMLP), "
                 "the same function as the grouped GEMM, which needs the CUDA-only grouped_gemm package or "
                 "Transformer Engine; from-megatron reads a grouped-GEMM run's expert weights")
NO_OP.update({
    "--moe-grouped-gemm": _GROUPED_GEMM,
    "--moe-use-legacy-grouped-gemm": _GROUPED_GEMM,
    "--openai-gelu": "megatron-core's GPT does not read it (only Megatron-LM's legacy models do); the GELU follows "
                     "Megatron-LM's rule here too: the tanh approximation with linear biases and the bias-GELU "
                     "fusion, the erf GELU with --no-bias-gelu-fusion or --disable-bias-linear",
    "--moe-shared-expert-overlap": "performance only: megatron-core runs the shared expert on a side CUDA stream "
                                   "beside the token dispatch, the same sum; here it runs in order",
    "--local-rank": "the local rank is read from the launcher's environment (LOCAL_RANK, OMPI_*, SLURM_*)",
})

# Refused with a specific reason and what to use instead.
REFUSED_WHY = {
    "--apply-query-key-layer-scaling": "attention scores are scaled by 1/sqrt(head_dim) with the softmax in fp32; "
                                       "the fp16 layer-scaling variant is not used",
    "--apply-residual-connection-post-layernorm": "post-norm residuals are not implemented (pre-norm, as GPT-2 "
                                                  "and Llama)",
    "--fp32-residual-connection": "residuals stay in the model's precision, as GPT-2",
    "--no-save-optim": "checkpoints always hold the optimizer and RNG states (resume is exact); load with "
                       "--no-load-optim instead",
    "--no-save-rng": "checkpoints always hold the RNG states; load with --no-load-rng instead",
    "--vocab-size": "the vocabulary comes from the tokenizer (padded by --make-vocab-size-divisible-by)",
    "--padded-vocab-size": "the padding follows --make-vocab-size-divisible-by x TP",
    "--checkpoint-activations": "Megatron's old name: use --recompute-granularity full",
    "--use-legacy-models": "the model is megatron-core's GPTModel (mcore)",
    "--batch-size": "Megatron's old name: use --micro-batch-size",
    "--warmup": "Megatron's old name: use --lr-warmup-iters or --lr-warmup-fraction",
    "--model-parallel-size": "Megatron's old name: use --tensor-model-parallel-size",
    "--exit-signal": "the handler catches SIGTERM and SIGINT (--exit-signal-handler)",
    "--test-mode": "evaluation runs during training (--eval-interval, --eval-iters)",
    "--full-validation": "use --eval-iters N (global batches per evaluation)",
    "--multiple-validation-sets": "one validation split (--split)",
    "--init-method-xavier-uniform": "weights start as normal(0, --init-method-std), as GPT-2",
    "--embedding-init-method-std": "all weights use --init-method-std, as GPT-2",
    "--start-weight-decay": "weight decay is constant (--weight-decay)",
    "--end-weight-decay": "weight decay is constant (--weight-decay)",
    "--weight-decay-incr-style": "weight decay is constant (--weight-decay)",
    "--data-parallel-random-init": "DP replicas start from the same weights (the ZeRO partitions need it)",
    "--cpu-offloading-num-layers": "activation offloading is not supported; use --recompute-granularity",
    "--fine-grained-activation-offloading": "activation offloading is not supported; use --recompute-granularity",
    "--offload-modules": "activation offloading is not supported; use --recompute-granularity",
    "--main-params-dtype": "the master weights are fp32 (on the host with --zero-offload)",
    "--use-precision-aware-optimizer": "use --exp-avg-dtype/--exp-avg-sq-dtype bf16 (CPU Adam states) instead",
    "--yaml-cfg": "give flags on the command line", "--spec": "the layer spec is megatron-core's local GPT spec",
}
for _flag in ("--rotary-interleaved", "--rotary-seq-len-interpolation-factor", "--no-rope-freq", "--mrope-section"):
    REFUSED_WHY[_flag] = ("positions are set by --position-embedding-type (learned_absolute or rope, with "
                          "--rotary-base, --rotary-percent, --use-rope-scaling); this variant is not supported")

# Pattern rules for the rest, first match wins: (regex, status, why).
PATTERNS = [
    (r"fusion|fused|^--no-rope-fusion$|^--disable-bias-swiglu", "no-op", _FUSION),
    (r"^--(no-)?tp-comm|^--disable-tp-comm|^--tp-comm", "no-op",
     "performance only: Transformer Engine's TP communication overlap (not used; TP all-reduces are megatron-core's)"),
    (r"^--moe-|^--expert-|^--num-experts|moe", "refused",
     "this mixture-of-experts option is not offered (docs/moe.md lists the MoE flags the job takes)"),
    (r"^--mtp-", "refused", "multi-token prediction is not supported"),
    (r"^--mamba|^--is-hybrid-model|^--hybrid-|^--linear-(conv|key|value|num)", "refused",
     "Mamba/hybrid models are not supported (the model is a transformer GPT)"),
    (r"^--fp8|^--fp4|fp8|mxfp8|^--te-|^--use-te-|^--kitchen|^--use-kitchen", "refused",
     "FP8/FP4 and Transformer Engine recipes are not supported; use --bf16 or --fp16"),
    (r"cuda-graph|^--external-cuda-graph", "refused", "CUDA graphs are not used"),
    (r"fsdp|^--data-parallel-sharding-strategy|^--outer-dp|^--enable-full-sharding|^--num-distributed-optimizer",
     "refused", "FSDP is not supported: ZeRO-Offload partitions gradients and optimizer states over DP "
                "(--zero-offload)"),
    (r"pipeline|virtual|^--decoder-(first|last)-pipeline|^--account-for-", "refused",
     "pipeline parallelism is not supported; use --tensor-model-parallel-size (and ZeRO-Offload for memory)"),
    (r"context-parallel|^--cp-comm-type|^--max-seqlen-per-dp-cp", "refused",
     "context parallelism is not supported; use --recompute-granularity for long sequences"),
    (r"^--fim-", "refused", "fill-in-the-middle data is not supported"),
    (r"^--muon|^--sgd-momentum", "refused", "only Adam is implemented (--optimizer adam)"),
    (r"^--tiktoken|^--tokenizer-(hf|sentencepiece|special|metadata)|^--vocab-extra-ids|^--trust-remote-code",
     "refused", "tokenizer option not supported: GPT-2 BPE (--vocab-file/--merge-file), or HuggingFaceTokenizer "
                "with --tokenizer-model DIR"),
    (r"^--log-|^--no-log-|^--disable-log-", "refused",
     "this quantity is not logged here (docs/logging.md lists what is); drop the flag"),
    (r"^--(record-memory-history|memory-snapshot-path)", "refused",
     "CUDA memory snapshots are not wired in; the log and JSONL carry every rank's host and device peaks, "
     "--profile records a torch.profiler trace"),
    (r"^--non-persistent|^--persistent-save|^--replication|^--save-(retain|dgrads|wgrads)",
     "refused", "local/non-persistent checkpointing is not supported: checkpoints go to --save every "
                "--save-interval, atomically (--keep-last K to bound them)"),
    (r"^--ckpt-convert|^--dist-ckpt|^--use-mp-args|^--load-main-params|"
     r"^--(no|disable)-use-tokenizer-model|strict-fsdp", "refused",
     "checkpoint conversion happens offline here: tools/convert_checkpoint.py (docs/checkpoints.md)"),
    (r"^--rl-|^--grpo|^--inference|^--langrl|^--perform-rl|^--refit|^--rl$", "refused",
     "reinforcement learning/inference is not part of this job (pretraining only)"),
]

# Whole Megatron argument groups that are about features this job does not have.
GROUP_REASONS = {
    "rl": "reinforcement learning is not part of this job (pretraining only)",
    "inference": "inference/generation settings: this job trains; serve a tools/convert_checkpoint.py to-hf "
                 "export with transformers",
    "vision": "vision models are not supported (the model is a GPT)",
    "biencoder": "BERT/biencoder models are not supported (the model is a GPT)",
    "moe": "this mixture-of-experts option is not offered (docs/moe.md lists the MoE flags the job takes)",
    "mla": "MLA inference caching (Flash MLA) is not part of this job, which trains (--multi-latent-attention is)",
    "experimental_attention_variant": "experimental attention variants are not supported",
    "heterogeneous architecture": "heterogeneous layer configurations are not supported",
    "In-process restart": "in-process restart (nvidia-resiliency-ext) is not integrated: relaunch with --load "
                          "(README: when things go wrong)",
    "ft_package": "fault-tolerance package integration is not supported: relaunch with --load",
    "rerun engine": "the rerun state machine is not integrated: NaN/inf steps are skipped (--max-skipped-iters)",
    "straggler": "straggler detection is not integrated",
    "one logger": "NVIDIA one-logger telemetry is not integrated",
    "workload inspector": "the workload inspector server is not integrated",
    "msc": "Multi-Storage Client paths are not supported: --save/--load take local or mounted directories",
    "autoresume": "ADLR autoresume is not integrated: --exit-signal-handler saves and exits 0 on SIGTERM",
    "profiling": "not wired in: --profile (torch.profiler) and --timeline FILE (per-phase times) are",
    "Transformer-Engine": "Transformer Engine is not used",
}
DEFAULT_REFUSED = "not implemented by this job (docs/megatron_compat.md)"


def classify_unimplemented(flag: str, group: str) -> tuple[str, str]:
    """(status, why) of a Megatron flag this job's parser does not define itself."""
    if flag in NO_OP:
        return "no-op", NO_OP[flag]
    if flag in REFUSED_WHY:
        return "refused", REFUSED_WHY[flag]
    for pattern, status, why in PATTERNS:
        if re.search(pattern, flag):
            return status, why
    if group in GROUP_REASONS:
        return "refused", GROUP_REASONS[group]
    return "refused", DEFAULT_REFUSED


def add_remaining_megatron_flags(p: argparse.ArgumentParser) -> None:
    """Add every Megatron flag the parser does not define as a hidden no-op or refused flag, so a
    copy-pasted launch script parses and gets one line for everything refused."""
    have = {o for a in p._actions for o in a.option_strings}
    g = p.add_argument_group("other Megatron-LM flags (docs/megatron_compat.md; hidden)")
    for flag, group, takes_value, _ in FLAGS:
        if flag in have:
            continue
        status, _why = classify_unimplemented(flag, group)
        if flag in IMPLEMENTED_ELSEWHERE:       # until that branch's parser defines it
            status = "refused"
        dest = (NOOP_DEST if status == "no-op" else REFUSED_DEST) + flag[2:].replace("-", "_")
        if takes_value:
            g.add_argument(flag, dest=dest, nargs="*", default=None, help=argparse.SUPPRESS)
        else:
            g.add_argument(flag, dest=dest, action="store_true", default=None, help=argparse.SUPPRESS)
        have.add(flag)


def refused_given(args: argparse.Namespace) -> list[str]:
    """'--flag: why' for every refused generic flag on the command line, in Megatron's order."""
    out = []
    for flag, group, _, _ in FLAGS:
        dest = REFUSED_DEST + flag[2:].replace("-", "_")
        if getattr(args, dest, None) not in (None, False):
            why = (f"not in this build of the job ({IMPLEMENTED_ELSEWHERE[flag]} adds it)"
                   if flag in IMPLEMENTED_ELSEWHERE else classify_unimplemented(flag, group)[1])
            out.append(f"{flag}: {why}")
    return out


def noops_given(args: argparse.Namespace) -> list[str]:
    """Every Megatron flag on the command line that is accepted without effect (NO_OP, NO_OP_OURS),
    in Megatron's order: what the banner lists, so a copied launch script shows what it asked for
    that does nothing here."""
    given = set(getattr(args, "given", ()))
    out = []
    for flag, _, _, _ in FLAGS:
        name = flag[2:].replace("-", "_")
        if getattr(args, NOOP_DEST + name, None) not in (None, False) or (flag in NO_OP_OURS and name in given):
            out.append(flag)
    return out


def table(parser: argparse.ArgumentParser, compat_refused: dict) -> list[tuple[str, str, str, str]]:
    """(flag, Megatron group, status, why) for every Megatron flag, against this parser."""
    actions = {o: a for a in parser._actions for o in a.option_strings}
    rows = []
    for flag, group, _, _ in FLAGS:
        a = actions.get(flag)
        if flag in IMPLEMENTED_ELSEWHERE:
            status, why = "implemented", f"implemented by {IMPLEMENTED_ELSEWHERE[flag]}"
        elif a is None or a.dest.startswith((NOOP_DEST, REFUSED_DEST)):
            status, why = classify_unimplemented(flag, group)
        elif flag in NO_OP_OURS:
            status, why = "no-op", NO_OP_OURS[flag]
        elif flag in compat_refused:
            status, why = "refused", compat_refused[flag][0]
        else:
            status, why = "implemented", _first_sentence(a.help)
        rows.append((flag, group, status, why))
    return rows


def _first_sentence(text) -> str:
    text = " ".join(str(text or "").replace("%(default)s", "").split())
    if not text or text == "==SUPPRESS==" or text.startswith("(default"):
        return "as in Megatron-LM"
    return text.replace("|", "/")


BEGIN, END = "<!-- megatron-flags:begin -->", "<!-- megatron-flags:end -->"


def markdown(parser: argparse.ArgumentParser, compat_refused: dict) -> str:
    rows = table(parser, compat_refused)
    counts = {s: sum(r[2] == s for r in rows) for s in ("implemented", "no-op", "refused")}
    lines = [BEGIN, "",
             f"All {len(rows)} flags of Megatron-LM {MEGATRON_LM_VERSION} (`{MEGATRON_LM_COMMIT[:12]}`, "
             f"`megatron/training/arguments.py` with its config-dataclass groups): {counts['implemented']} implemented, "
             f"{counts['no-op']} no-op, {counts['refused']} refused.", "",
             "| Megatron flag | Megatron group | Class | Why |", "|---|---|---|---|"]
    lines += [f"| {f} | {g} | **{s}** | {w} |" for f, g, s, w in rows]
    lines += ["", END]
    return "\n".join(lines)


def parse_doc_table(text: str) -> list[tuple[str, str, str, str]]:
    body = text.split(BEGIN, 1)[1].split(END, 1)[0]
    rows = []
    for line in body.splitlines():
        m = re.match(r"\|\s*(--\S+)\s*\|\s*(.*?)\s*\|\s*\*\*(implemented|no-op|refused)\*\*\s*\|\s*(.*?)\s*\|\s*$", line)
        if m:
            rows.append((m.group(1), m.group(2), m.group(3), m.group(4)))
    return rows

