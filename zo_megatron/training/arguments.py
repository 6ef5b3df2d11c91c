"""pretrain_gpt.py's flags: Megatron-LM's names and defaults, plus zo_megatron's own.

Without model-shape flags the job uses DEMO defaults (a 4 x 256 GPT-2 on the embedded State of
the Union corpus, sized to train on a 2-core CPU in minutes); Megatron requires those flags.
"""
from __future__ import annotations

import argparse
import sys

from zo_megatron.errors import ConfigError
from zo_megatron.planner.params import resolve_recompute
from zo_megatron.training.checkpoint_args import apply_checkpoint_args, given_dests
from zo_megatron.training.load_target import check_load_target, resumed_precision
from zo_megatron.training.megatron_compat import add_megatron_compat_flags, check_megatron_compat
from zo_megatron.training.megatron_flags import add_remaining_megatron_flags
from zo_megatron.training.model_flags import (add_architecture_flags, add_attention_flags, add_expert_parallel_flags,
                                               add_moe_flags, check_architecture_flags, check_attention_flags)
from zo_megatron.training.data_flags import add_data_flags, check_data_flags
from zo_megatron.training.nvme_flags import add_nvme_flags, check_nvme_flags
from zo_megatron.training.schedule import DECAY_STYLES, WSD_DECAY_STYLES


# What `pretrain_gpt.py --tensor-parallel 2 --zero-offload` trains when given no shape flags.
DEMO_DEFAULTS = dict(num_layers=4, hidden_size=256, num_attention_heads=4, seq_length=256,
                     micro_batch_size=8, train_iters=300, lr=1e-3, min_lr=1e-4, lr_warmup_iters=30,
                     lr_decay_style="cosine", eval_interval=100, eval_iters=10, log_interval=10,
                     weight_decay=0.1, adam_beta2=0.95)

# Megatron-LM's defaults for the flags DEMO_DEFAULTS fills when the shape flags are absent.
# --dpu-corrector's choices (docs/dpu.md): the paper's schedule, and the corrector measured best.
DPU_CORRECTORS = ("none", "weight-prediction")
MEGATRON_DEFAULTS = dict(micro_batch_size=1, train_iters=None, lr=None, min_lr=0.0, lr_warmup_iters=0,
                         lr_decay_style="linear", eval_interval=1000, eval_iters=100, log_interval=100,
                         weight_decay=0.01, adam_beta2=0.999)


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """--help shows the default that applies: "demo: X / Megatron: Y" for the flags whose default
    depends on whether a model shape is given, the real value otherwise, never "(default: None)"."""

    def _get_help_string(self, action):
        text = (action.help or "").strip()
        if text.startswith("(default:"):
            return text
        if action.dest in DEMO_DEFAULTS:
            meg = MEGATRON_DEFAULTS.get(action.dest)
            return f"{text} (demo: {DEMO_DEFAULTS[action.dest]} / Megatron: {'required' if meg is None else meg})".strip()
        if action.default is None or action.default is argparse.SUPPRESS or isinstance(action.default, bool) \
                or "default" in text:
            return text
        return f"{text} (default: %(default)s)".strip()


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad command line once per job (global rank 0), not once per rank."""

    def error(self, message):
        from zo_megatron.errors import is_first_rank, let_the_first_rank_report, record_error_line

        first = is_first_rank()
        if first:                  # one line (the usage of every Megatron flag would be ~100 lines)
            sys.stderr.write(f"{self.prog}: error: {message} ({self.prog} --help lists the flags)\n")
        record_error_line(f"{self.prog}: error: {message}")        # torchrun's root cause
        if not first:
            let_the_first_rank_report()   # the launcher ends the job at the first exit: rank 0's line first
        sys.exit(2)


def _size_flag(text: str) -> int:
    from zo_megatron.planner.units import parse_bytes

    try:
        return parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _add_model_flags(g) -> None:
    g.add_argument("--num-layers", type=int, default=None, help="transformer layers")
    g.add_argument("--hidden-size", type=int, default=None, help="hidden size")
    g.add_argument("--num-attention-heads", type=int, default=None, help="attention heads")
    g.add_argument("--ffn-hidden-size", type=int, default=None,
                   help="MLP size (default 4 x hidden; with --swiglu int(4 x hidden x 2/3 / 64) x 64, Megatron's rule)")
    g.add_argument("--seq-length", type=int, default=None, help="tokens per sample")
    g.add_argument("--max-position-embeddings", type=int, default=None, help="default: --seq-length")
    g.add_argument("--vocab-size", type=int, default=None, metavar="N",
                   help="the model's vocabulary before padding (Megatron-LM's flag; default: the tokenizer's size). "
                        "For checkpoints whose vocabulary is larger than their tokenizer (Qwen2: 151936 rows, "
                        "151646 tokens); smaller than the tokenizer is refused")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                   help="pad the vocab to a multiple of this x TP")
    add_architecture_flags(g)
    add_moe_flags(g)
    g.add_argument("--hidden-dropout", type=float, default=0.0)
    g.add_argument("--attention-dropout", type=float, default=0.0)
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--recompute-granularity", choices=["full", "selective"], default=None,
                   help="activation recompute: full layers, or the --recompute-modules of each layer")
    g.add_argument("--recompute-activations", action="store_true",
                   help="Megatron's shorthand for --recompute-granularity selective")
    g.add_argument("--recompute-modules", nargs="+", default=None, metavar="MODULE",
                   help="with --recompute-granularity selective: what each layer recomputes in backward instead of "
                        "keeping (megatron-core's): core_attn (the attention core; the default), layernorm (the two "
                        "norms' outputs), mlp (a dense layer's MLP), moe (a whole MoE layer), shared_experts, "
                        "mla_up_proj (multi-latent attention's query, key and value, from its latents)")
    g.add_argument("--moe-layer-recompute", action="store_true",
                   help="Megatron's older spelling of --recompute-granularity selective with moe added to "
                        "--recompute-modules")


def _add_parallelism_flags(g) -> None:
    g.add_argument("--tensor-model-parallel-size", "--tensor-parallel", dest="tensor_parallel", type=int,
                   default=1, help="TP size; DP = world size / TP")
    add_expert_parallel_flags(g)
    g.add_argument("--distributed-timeout-minutes", type=float, default=10.0,
                   help="how long a collective waits for a peer before the rank gives up and exits 1 "
                        "(Megatron's name and default: 10; fractions allowed)")


def _add_zero_offload_flags(g) -> None:
    g.add_argument("--zero-offload", action="store_true",
                   help="partition gradients/optimizer over DP and run Adam on the CPU (otherwise: plain DDP baseline)")
    g.add_argument("--bucket-size", type=int, default=40_000_000, help="gradient bucket size in elements")
    g.add_argument("--cpu-adam-threads", type=int, default=None,
                   help="OpenMP threads of the CPU Adam per rank (default: this rank's fair share of cores)")
    g.add_argument("--no-pin-memory", action="store_true",
                   help="CUDA: do not pin host buffers (host copies then block: backward serialises behind every "
                        "copy home; for when pinning fails)")
    g.add_argument("--accumulate-allreduce-grads-in-fp32", action=argparse.BooleanOptionalAction, default=None,
                   help="gradient buckets and their reduce-scatter in fp32 (Megatron's name; default: on for "
                        "bf16 as in Megatron, off for fp16; doubles the bytes on the wire)")
    g.add_argument("--grad-reduce-in-bf16", dest="accumulate_allreduce_grads_in_fp32", action="store_false", default=None,
                   help="bf16 gradient buckets reduce-scattered in bf16 (Megatron's name; = "
                        "--no-accumulate-allreduce-grads-in-fp32)")
    g.add_argument("--main-grads-dtype", choices=["fp32", "bf16", "fp16"], default=None,
                   help="ZeRO-Offload: dtype of the reduced gradients copied to the host for the CPU Adam "
                        "(default: the 16-bit parameter dtype, 2 bytes/param over PCIe; fp32 needs fp32 "
                        "reduction and 4 more host bytes/param/DP)")
    g.add_argument("--accumulate-grads-on-host", action="store_true",
                   help="ZeRO-Offload with gradient accumulation: reduce every micro-batch and add it into an "
                        "fp32 host accumulator, so the device keeps no gradient copy between micro-batches "
                        "(one reduce-scatter per micro-batch)")
    g.add_argument("--dpu", action="store_true",
                   help="ZeRO-Offload: delayed parameter update (docs/dpu.md): after the warm-up, the CPU Adam "
                        "of step t runs while the device computes step t+1 on parameters one update behind. "
                        "Measured best: with --dpu-corrector weight-prediction and --dpu-warmup-steps about a "
                        "tenth of --train-iters (0.4%% above exact updates' loss; at W=40 1.6%%)")
    g.add_argument("--dpu-warmup-steps", type=int, default=40,
                   help="exact (non-delayed) updates before DPU starts (default: 40, the paper's choice)")
    g.add_argument("--dpu-weight-prediction", action="store_true",
                   help="with --dpu: the device gets the delayed update's parameters extrapolated by that "
                        "update (w_t + (w_t - w_{t-1}), weight prediction) so its forward/backward run near the "
                        "parameters the next update is applied to; the master stays exact Adam "
                        "(docs/dpu.md: measured convergence; computed inside the CPU Adam kernel: no extra memory)")
    g.add_argument("--dpu-corrector", choices=DPU_CORRECTORS, default=None,
                   help="with --dpu: what corrects the one-update delay of the device's weights (docs/dpu.md, "
                        "measured per corrector): none (default: the paper's schedule, the device computes on "
                        "w_t) or weight-prediction (= --dpu-weight-prediction). The fresh-gradient look-ahead "
                        "and the NAdamW-form update of issue 37 are measured in tools/dpu_reproduction.py and "
                        "not offered: docs/dpu.md says why")
    g.add_argument("--dpu-adam-threads", type=int, default=None,
                   help="with --dpu: CPU Adam threads while it overlaps forward/backward (default: all but one "
                        "of --cpu-adam-threads on a GPU, the one left launches the device's kernels; half of them "
                        "on a CPU-only run, where torch keeps the rest)")
    g.add_argument("--overlap-cpu-step", dest="overlap_cpu_step", nargs="?", const="full", default=None,
                   choices=("auto", "full"), metavar="auto|full",
                   help="ZeRO-Offload: run each bucket's CPU Adam during backward, as soon as its gradients are "
                        "on the host, speculating the step is not clipped/skipped; validated after backward and "
                        "rolled back and redone where it was (bit-identical to the synchronous step; "
                        "docs/overlap.md). Keeping the state for a rollback costs host memory (up to 14 bytes per "
                        "partition element), so the speculated share is bounded: `auto` (the default on CUDA "
                        "devices) speculates what the host memory the planner leaves free holds, possibly "
                        "nothing; alone or `full`, the whole partition (refused where that does not fit). Off on "
                        "CPU devices by default (device and CPU Adam share the cores there)")
    g.add_argument("--no-overlap-cpu-step", dest="overlap_cpu_step", action="store_const", const="off",
                   help="ZeRO-Offload: the synchronous CPU step")
    g.add_argument("--overlap-cpu-step-memory", type=_size_flag, default=None, metavar="SIZE",
                   help="--overlap-cpu-step with this much host memory per rank for its rollback state (e.g. "
                        "64GiB): the speculated share is what it holds, at most all")
    g.add_argument("--optimizer-offload-fraction", default="1.0", metavar="F|auto",
                   help="ZeRO-Offload: share of each rank's optimizer partition updated by the CPU Adam on the "
                        "host (Megatron's name; default 1.0: all of it). The rest keeps fp32 master and moments "
                        "on the device (16 bytes/param) and is updated there by torch's fused Adam, "
                        "concurrently on a GPU. auto: the smallest share with which the memory planner says "
                        "the run fits")
    add_nvme_flags(g)
    g.add_argument("--timeline", default=None, metavar="FILE",
                   help="write per-step phase times (forward, backward, grad sync, CPU step, parameter "
                        "return) as JSON lines, one FILE per rank (FILE.rankN when world > 1); plot with "
                        "tools/plot_timeline.py")


def _add_training_flags(g) -> None:
    g.add_argument("--micro-batch-size", type=int, default=None, help="samples per rank per micro-batch")
    g.add_argument("--global-batch-size", type=int, default=None,
                   help="samples per step = micro x DP x accumulation (default: micro x DP)")
    g.add_argument("--train-iters", type=int, default=None, help="optimizer steps (or --train-samples)")
    g.add_argument("--rampup-batch-size", type=int, nargs=3, default=None, metavar=("START", "INCREMENT", "SAMPLES"),
                   help="Megatron-LM's batch-size ramp-up: the global batch starts at START and grows by INCREMENT "
                        "in equal shares of SAMPLES samples up to --global-batch-size (needs --train-samples)")
    g.add_argument("--calculate-per-token-loss", action="store_true",
                   help="the loss of a global batch is its masked tokens' mean (Megatron-LM's): each micro-batch's "
                        "loss sum over the batch's unmasked tokens (all DP ranks), instead of the mean of the "
                        "micro-batches' means; they differ where masks differ (--eod-mask-loss, an epoch's padded "
                        "last sample)")
    g.add_argument("--decrease-batch-size-if-needed", action="store_true",
                   help="round a global batch (or a ramp's batch) that is no multiple of micro x DP down to one "
                        "(Megatron-LM's), instead of refusing it")
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--skip-memory-check", action="store_true",
                   help="launch even when the memory planner predicts the run does not fit")
    g.add_argument("--exit-signal-handler", action="store_true",
                   help="on SIGTERM/SIGINT stop at the next iteration on every rank, save a checkpoint and "
                        "exit 0; a second signal exits at once (Megatron's name; default: on when --save is "
                        "set, off otherwise)")
    g.add_argument("--max-skipped-iters", type=int, default=10,
                   help="stop the run after this many consecutive steps skipped for a NaN/inf loss or "
                        "gradient (fp16: at the minimum loss scale), saving a checkpoint with --save; "
                        "0: never stop (default: 10)")


def _add_learning_rate_flags(g) -> None:
    g.add_argument("--lr", type=float, default=None, help="peak learning rate")
    g.add_argument("--min-lr", type=float, default=None, help="rate at the end of the decay")
    g.add_argument("--lr-decay-style", choices=DECAY_STYLES, default=None, help="shape of the decay")
    g.add_argument("--lr-warmup-iters", type=int, default=None, help="linear warmup iterations")
    g.add_argument("--lr-decay-iters", type=int, default=None, help="default: --train-iters")
    g.add_argument("--lr-warmup-samples", type=int, default=None,
                   help="with --train-samples: warmup in samples (Megatron-LM's; a multiple of the global batch)")
    g.add_argument("--lr-decay-samples", type=int, default=None,
                   help="with --train-samples: decay in samples (Megatron-LM's; a multiple of the global batch)")
    g.add_argument("--lr-wsd-decay-samples", type=int, default=None,
                   help="with --train-samples and --lr-decay-style WSD: the final anneal in samples (Megatron-LM's; "
                        "a multiple of the global batch)")
    g.add_argument("--context-parallel-size", type=int, default=1,
                   help="Megatron-LM's context parallelism: only 1 (none) is supported; long sequences: "
                        "--recompute-granularity, --use-flash-attn, --sequence-parallel")
    g.add_argument("--lr-warmup-fraction", type=float, default=None,
                   help="warmup as a fraction of the decay (Megatron's; instead of --lr-warmup-iters)")
    g.add_argument("--lr-warmup-init", type=float, default=0.0, help="rate of the first warmup update")
    g.add_argument("--lr-wsd-decay-iters", type=int, default=None,
                   help="WSD: iterations of the final anneal (required with --lr-decay-style WSD)")
    g.add_argument("--lr-wsd-decay-style", choices=WSD_DECAY_STYLES, default="exponential",
                   help="WSD: shape of the final anneal")
    g.add_argument("--decoupled-lr", type=float, default=None,
                   help="peak learning rate of the input and output layer (the word embedding and output layer "
                        "weights, one weight when tied), on the same warmup and decay as --lr (Megatron's "
                        "decoupled param group)")
    g.add_argument("--decoupled-min-lr", type=float, default=None,
                   help="with --decoupled-lr: where that rate decays to (default: --min-lr); without it, no "
                        "effect (as in Megatron-LM)")


def _add_optimizer_flags(g) -> None:
    g.add_argument("--optimizer", choices=["adam"], default="adam")
    g.add_argument("--weight-decay", type=float, default=None, help="AdamW decoupled weight decay")
    g.add_argument("--no-weight-decay-embeddings", action="store_true",
                   help="exclude embeddings from weight decay (biases and norms never decay)")
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=None, help="Adam's second-moment decay")
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--clip-grad", type=float, default=1.0, help="global grad-norm clip (0: off)")
    g.add_argument("--exp-avg-dtype", choices=["fp32", "bf16"], default="fp32",
                   help="ZeRO-Offload: dtype of Adam's first moment on the host (Megatron's name)")
    g.add_argument("--exp-avg-sq-dtype", choices=["fp32", "bf16"], default="fp32",
                   help="ZeRO-Offload: dtype of Adam's second moment on the host")


def _add_mixed_precision_flags(g) -> None:
    m = g.add_mutually_exclusive_group()
    m.add_argument("--bf16", dest="precision", action="store_const", const="bf16",
                   help="bf16 (default on GPUs, and on CPUs with native bf16 (AVX512_BF16 or AMX) where a cached "
                        "start-up measurement, best of three interleaved windows per dtype, finds it faster than "
                        "fp32; a resume keeps its checkpoint's precision)")
    m.add_argument("--fp16", dest="precision", action="store_const", const="fp16",
                   help="fp16 with dynamic loss scaling")
    m.add_argument("--fp32", dest="precision", action="store_const", const="fp32",
                   help="fp32 (default on CPUs without native bf16, where bf16 matmuls are emulated)")
    g.add_argument("--loss-scale", type=float, default=None, help="static loss scale (fp16); default dynamic")
    g.add_argument("--initial-loss-scale", type=float, default=2.0**32)
    g.add_argument("--min-loss-scale", type=float, default=1.0)
    g.add_argument("--loss-scale-window", type=int, default=1000)
    g.add_argument("--hysteresis", type=int, default=2)


def _add_data_flags(g) -> None:
    add_data_flags(g)
    g.add_argument("--eod-mask-loss", action="store_true",
                   help="leave the prediction after each end-of-document token out of the loss (Megatron-LM's: "
                        "the loss mask is 0 where the input token is the EOD id)")
    g.add_argument("--tokenizer-type", default="GPT2BPETokenizer",
                   choices=["GPT2BPETokenizer", "HuggingFaceTokenizer", "Llama2Tokenizer", "NullTokenizer", "SFTTokenizer"],
                   help="GPT2BPETokenizer: GPT-2's BPE (bundled files); HuggingFaceTokenizer: AutoTokenizer from "
                        "--tokenizer-model (offline, no remote code; eod = its eos, vocabulary = len(tokenizer)); "
                        "Llama2Tokenizer: the SentencePiece model file --tokenizer-model (ids = [bos] + pieces, "
                        "eod = its eos; Megatron-LM's Llama-2 / Mixtral recipes); "
                        "NullTokenizer (with --vocab-size N): data that is ids already, or --mock-data; id N is the "
                        "end of document, the vocabulary N + 1 (Megatron-LM's); SFTTokenizer: --sft's name for "
                        "HuggingFaceTokenizer (Megatron-LM's). "
                        "The data must be preprocessed with the same tokenizer")
    g.add_argument("--tokenizer-model", default=None, metavar="PATH",
                   help="HuggingFaceTokenizer: a local directory with tokenizer.json and tokenizer_config.json; "
                        "Llama2Tokenizer: a SentencePiece tokenizer.model file (either is copied into each "
                        "checkpoint's tokenizer/ folder)")
    g.add_argument("--vocab-file", default=None, help="GPT-2 vocab.json (default: bundled)")
    g.add_argument("--merge-file", default=None, help="GPT-2 merges.txt (default: bundled)")
    g.add_argument("--allow-custom-vocab", action="store_true", help="accept BPE files that are not GPT-2's")
    g.add_argument("--allow-other-tokenizer-data", action="store_true",
                   help="train on data preprocessed with another tokenizer whose ids fit the vocabulary (they "
                        "mean other text: refused without this flag)")
    g.add_argument("--data-cache-path", default=None, help="where dataset indices are cached")


def _add_checkpointing_flags(g) -> None:
    g.add_argument("--save", default=None, help="directory to save checkpoints to")
    g.add_argument("--load", default=None,
                   help="directory to resume from (its latest checkpoint); with no checkpoint there yet the "
                        "job warns and starts from random weights, as Megatron-LM (`--save X --load X` works "
                        "from the first launch); a Megatron-LM checkpoint (`torch_dist` or `torch`) or a Hugging "
                        "Face model there is refused in one line with its `tools/convert_checkpoint.py "
                        "from-megatron` / `from-hf` command")
    g.add_argument("--ckpt-step", type=int, default=None, metavar="N",
                   help="with --load: resume from iteration N's checkpoint instead of the latest (Megatron-LM's "
                        "flag; the directory must hold iter_N)")
    g.add_argument("--exit-on-missing-checkpoint", action="store_true",
                   help="with --load: stop with one error line instead of starting from random weights when "
                        "no checkpoint is there (Megatron-LM's flag)")
    g.add_argument("--save-interval", type=int, default=None, help="iterations between checkpoints")
    g.add_argument("--force-save-lock", action="store_true",
                   help="take over --save's lock (SAVE/zo_megatron.lock) even when its holder runs on another host "
                        "(a dead holder on this host is taken over without it)")
    g.add_argument("--keep-last", type=int, default=None, metavar="K",
                   help="keep only the K newest checkpoints (removed after the new one is committed; default: all)")
    g.add_argument("--no-load-optim", action="store_true",
                   help="--load without the optimizer state (fresh Adam; the LR schedule is not checked)")
    g.add_argument("--no-load-rng", action="store_true", help="--load without the random-number-generator states")
    g.add_argument("--finetune", action="store_true",
                   help="--load only the weights and start at iteration 0 (no optimizer, RNG or sample counts)")
    g.add_argument("--override-opt_param-scheduler", "--override-opt-param-scheduler", action="store_true",
                   help="on --load, use this run's LR-schedule flags even if they differ from the checkpoint's")
    g.add_argument("--use-checkpoint-opt_param-scheduler", "--use-checkpoint-opt-param-scheduler", action="store_true",
                   help="on --load, take the LR schedule (lr, min-lr, warmup, decay iters and style) from the checkpoint")
    g.add_argument("--use-checkpoint-args", action="store_true",
                   help="take the model shape, architecture, tokenizer, --seq-length and vocabulary padding from "
                        "--load's checkpoint (Megatron's); model flags given here must agree with it")


def _add_logging_flags(g) -> None:
    g.add_argument("--eval-interval", type=int, default=None, help="iterations between evaluations")
    g.add_argument("--eval-iters", type=int, default=None,
                   help="global batches per evaluation (0: no evaluation)")
    g.add_argument("--log-interval", type=int, default=None, help="iterations per log line")
    g.add_argument("--log-jsonl", default=None, help="write one JSON object per logged iteration/evaluation")
    g.add_argument("--tensorboard-dir", default=None, help="write TensorBoard events (needs tensorboard)")
    g.add_argument("--no-progress-bar", action="store_true")
    g.add_argument("--log-params-norm", action="store_true",
                   help="log the L2 norm of the model's parameters (Megatron-LM's; `params_norm`, each element "
                        "once over the world; a collective at each log line)")
    g.add_argument("--log-num-zeros-in-grad", action="store_true",
                   help="log how many of the gradient's elements are exactly zero (Megatron-LM's; "
                        "`num_zeros_in_grad`, each element once; counted on the logged steps only)")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="pretrain_gpt.py",
        allow_abbrev=False,     # as Megatron-LM: a typo must not select another flag
        description="Pretrain a GPT with Megatron tensor parallelism and ZeRO-Offload data parallelism. "
                    "Launch with torchrun, mpirun or srun; the world size is TP x DP.",
        formatter_class=_HelpFormatter)

    _add_model_flags(p.add_argument_group("model"))
    _add_parallelism_flags(p.add_argument_group("parallelism"))
    add_attention_flags(p.add_argument_group("attention and sequence parallelism (Megatron-LM's names)"))
    _add_zero_offload_flags(p.add_argument_group("ZeRO-Offload"))
    _add_training_flags(p.add_argument_group("training"))
    _add_learning_rate_flags(p.add_argument_group("learning rate"))
    _add_optimizer_flags(p.add_argument_group("optimizer"))
    _add_mixed_precision_flags(p.add_argument_group("mixed precision"))
    _add_data_flags(p.add_argument_group("data"))
    _add_checkpointing_flags(p.add_argument_group("checkpointing"))
    _add_logging_flags(p.add_argument_group("evaluation and logging"))
    add_megatron_compat_flags(p)
    for a in p._actions:          # argparse hides a flag's default when it has no help text
        if a.help is None and a.default is not None and not isinstance(a.default, bool):
            a.help = "(default: %(default)s)"
    add_remaining_megatron_flags(p)   # last: every other Megatron-LM flag, as a no-op or refused
    return p


_PARSER = None


def parse_args(argv=None) -> argparse.Namespace:
    global _PARSER
    if _PARSER is None:           # ~70 ms to build (every Megatron flag); parsing does not change it
        _PARSER = build_parser()
    parser = _PARSER
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    args.given = given_dests(parser, argv)
    args.argv = argv              # the command line as typed (error messages quote a working one)
    # --load with no checkpoint yet: start fresh with a warning, as Megatron-LM (before the
    # checkpoint's args are read); a wrong target gets its fix
    args.load_note = check_load_target(args)
    if args.use_checkpoint_args:
        apply_checkpoint_args(parser, args, args.given)
    finalize(args)
    return args


def origin(args: argparse.Namespace, dest: str) -> str:
    """Where a value the user did not type came from: ' (demo default)', ' (from the checkpoint)'."""
    if dest in getattr(args, "demo_filled", ()):
        return " (demo default)"
    if dest in getattr(args, "from_checkpoint", ()):
        return " (from the checkpoint)"
    return ""


def _megatron_position_aliases(args: argparse.Namespace) -> None:
    """Megatron-LM's older rope flags: --use-rotary-position-embeddings is rope; --no-position-embedding
    drops the learned table, which only rope can do without (positions must come from somewhere)."""
    if getattr(args, "use_rotary_position_embeddings", False):
        if "position_embedding_type" in getattr(args, "given", ()) and args.position_embedding_type != "rope":
            raise ConfigError(f"--use-rotary-position-embeddings and --position-embedding-type "
                              f"{args.position_embedding_type} disagree: give one")
        args.position_embedding_type = "rope"
    if getattr(args, "no_position_embedding", False) and args.position_embedding_type == "learned_absolute":
        raise ConfigError("--no-position-embedding without rope leaves the model no positions: add "
                          "--position-embedding-type rope (or --use-rotary-position-embeddings)")


def finalize(args: argparse.Namespace) -> None:
    """Fill demo or Megatron defaults, then reject inconsistent values (one line each)."""
    shape_given = any(getattr(args, k) is not None for k in ("num_layers", "hidden_size", "num_attention_heads"))
    # --use-checkpoint-args: the defaults the checkpoint's own run had (its shape is "given" now)
    args.demo = getattr(args, "checkpoint_demo", not shape_given)
    defaults = DEMO_DEFAULTS if args.demo else MEGATRON_DEFAULTS
    args.demo_filled = set()
    if args.lr_warmup_fraction is not None:
        if args.lr_warmup_iters:
            raise ConfigError("--lr-warmup-fraction and --lr-warmup-iters both set the warmup: give one")
        args.lr_warmup_iters = 0
    if args.train_samples is not None:
        if args.train_iters is not None:
            raise ConfigError("--train-samples and --train-iters both set the run's length: give one")
        args.train_iters = args.train_samples        # provisional: // global batch once DP is known
    for k in {**DEMO_DEFAULTS, **MEGATRON_DEFAULTS}:
        if getattr(args, k, None) is None:
            setattr(args, k, defaults.get(k))
            if args.demo and k in DEMO_DEFAULTS:
                args.demo_filled.add(k)
    for k in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "train_iters", "lr"):
        if getattr(args, k) is None:
            # why the demo's defaults do not apply: the user's shape flags, or the checkpoint's model
            typed = [f"--{s.replace('_', '-')}" for s in ("num_layers", "hidden_size", "num_attention_heads")
                     if s in getattr(args, "given", ())]
            why = ("the model comes from the checkpoint (--use-checkpoint-args), which does not record it"
                   if getattr(args, "use_checkpoint_args", False) and not typed else
                   "the model shape is given" + (f" ({' '.join(typed)})" if typed else ""))
            raise ConfigError(f"--{k.replace('_', '-')} is required: {why}; the demo's defaults apply only "
                              "without model flags")
    _megatron_position_aliases(args)
    if args.precision is None:
        from zo_megatron.training.cpu_precision import default_precision

        args.precision, args.precision_reason, args.precision_measured = default_precision(resumed_precision(args))
    else:
        args.precision_reason, args.precision_measured = "chosen by flag", False
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    if args.seq_length > args.max_position_embeddings:
        raise ConfigError(f"--seq-length {args.seq_length} exceeds --max-position-embeddings "
                          f"{args.max_position_embeddings}")
    try:
        args.recompute_granularity, args.recompute_modules = resolve_recompute(
            args.recompute_granularity, args.recompute_modules, recompute_activations=args.recompute_activations,
            moe_layer_recompute=args.moe_layer_recompute, experts=args.num_experts is not None)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    for unit in ("warmup", "decay", "wsd_decay"):     # Megatron's sample-based schedule: --train-samples only
        samples, flag = getattr(args, f"lr_{unit}_samples"), f"--lr-{unit.replace('_', '-')}"
        if samples is not None and args.train_samples is None:
            raise ConfigError(f"{flag}-samples is for sample-based runs (--train-samples); with "
                              f"--train-iters use {flag}-iters")
        if samples is not None and f"lr_{unit}_iters" in getattr(args, "given", ()):
            raise ConfigError(f"{flag}-samples and {flag}-iters both set the {unit.replace('_', ' ')}: give one")
    if args.lr_decay_iters is None and args.train_samples is None:
        args.lr_decay_iters = args.train_iters
    # every refused flag and every value out of range in ONE line (issue 35, item 9)
    check_megatron_compat(args, also=range_problems(args))
    check_data_flags(args)
    from zo_megatron.data.errors import DataError
    from zo_megatron.data.tokenizer import check_tokenizer_flags

    try:
        check_tokenizer_flags(args.tokenizer_type, args.tokenizer_model, args.vocab_file, args.merge_file,
                              args.allow_custom_vocab, args.vocab_size)
    except DataError as e:                       # a flag conflict, reported before any file is read
        raise ConfigError(str(e)) from None
    check_attention_flags(args)
    for k in ("micro_batch_size", "train_iters", "log_interval", "eval_interval", "tensor_parallel"):
        if getattr(args, k) < 1:
            raise ConfigError(f"--{k.replace('_', '-')} must be >= 1 (got {getattr(args, k)})")
    check_architecture_flags(args)
    if args.bucket_size < 1:
        raise ConfigError(f"--bucket-size must be >= 1 element (got {args.bucket_size})")
    if args.save_interval is not None and args.save_interval < 1:
        raise ConfigError(f"--save-interval must be >= 1 (got {args.save_interval})")
    if args.dpu and not args.zero_offload:
        raise ConfigError("--dpu delays the CPU optimizer's update: add --zero-offload")
    if args.overlap_cpu_step_memory is not None:
        if args.overlap_cpu_step == "off":
            raise ConfigError("--overlap-cpu-step-memory sets memory aside for --overlap-cpu-step, which "
                              "--no-overlap-cpu-step turns off: drop one of them")
        args.overlap_cpu_step = args.overlap_cpu_step or "memory"
    if args.overlap_cpu_step in ("full", "memory") and not args.zero_offload:
        raise ConfigError("--overlap-cpu-step overlaps the CPU optimizer with backward: add --zero-offload")
    if args.dpu_weight_prediction and not args.dpu:
        raise ConfigError("--dpu-weight-prediction extrapolates the delayed update's parameters: add --dpu")
    _resolve_dpu_corrector(args)
    if args.overlap_cpu_step in ("full", "memory") and args.dpu:
        raise ConfigError("--overlap-cpu-step cannot be combined with --dpu (DPU already takes the CPU step off "
                          "the critical path, one update late): use one or the other")
    _check_offload_fraction(args)
    check_nvme_flags(args)
    if args.keep_last is not None and args.keep_last < 1:
        raise ConfigError(f"--keep-last must be >= 1 (got {args.keep_last})")
    if args.override_opt_param_scheduler and args.use_checkpoint_opt_param_scheduler:
        raise ConfigError("--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler exclude each "
                          "other: pick one")
    if args.exp_avg_dtype != args.exp_avg_sq_dtype:
        raise ConfigError(f"--exp-avg-dtype {args.exp_avg_dtype} and --exp-avg-sq-dtype {args.exp_avg_sq_dtype} "
                          "must match (the CPU Adam kernel keeps both moments in one dtype)")
    if args.exp_avg_dtype != "fp32" and not args.zero_offload:
        raise ConfigError("--exp-avg-dtype bf16 applies to the CPU optimizer: add --zero-offload")
    if args.loss_scale is not None and args.precision != "fp16":
        raise ConfigError("--loss-scale only applies to --fp16")
    if args.accumulate_allreduce_grads_in_fp32 is None:
        args.accumulate_allreduce_grads_in_fp32 = args.precision == "bf16"
    if args.main_grads_dtype is not None and args.main_grads_dtype not in ("fp32", args.precision):
        raise ConfigError(f"--main-grads-dtype {args.main_grads_dtype} with --{args.precision} parameters: "
                          f"use fp32 or {args.precision}")
    if args.main_grads_dtype == "fp32" and args.precision != "fp32" and not args.accumulate_allreduce_grads_in_fp32:
        raise ConfigError("--main-grads-dtype fp32 needs gradients reduced in fp32: add "
                          "--accumulate-allreduce-grads-in-fp32")
    if (args.main_grads_dtype or args.accumulate_grads_on_host) and not args.zero_offload:
        raise ConfigError("--main-grads-dtype and --accumulate-grads-on-host apply to the offloaded optimizer: "
                          "add --zero-offload")


# (flag, test, what the value must be); None means "not given" and always passes.
_RANGES = [
    ("num_layers", lambda v: v >= 1, ">= 1"), ("hidden_size", lambda v: v >= 1, ">= 1"),
    ("num_attention_heads", lambda v: v >= 1, ">= 1"), ("ffn_hidden_size", lambda v: v >= 1, ">= 1"),
    ("num_query_groups", lambda v: v >= 1, ">= 1"), ("kv_channels", lambda v: v >= 1, ">= 1"),
    ("rotary_base", lambda v: v > 0, "> 0"), ("rotary_percent", lambda v: 0 < v <= 1, "in (0, 1]"),
    ("rope_scaling_factor", lambda v: v > 0, "> 0"), ("layernorm_epsilon", lambda v: v > 0, "> 0"),
    ("seq_length", lambda v: v >= 1, ">= 1"), ("make_vocab_size_divisible_by", lambda v: v >= 1, ">= 1"),
    ("vocab_size", lambda v: v >= 1, ">= 1 (drop it to use the tokenizer's size)"),
    ("hidden_dropout", lambda v: 0 <= v < 1, "in [0, 1)"), ("attention_dropout", lambda v: 0 <= v < 1, "in [0, 1)"),
    ("init_method_std", lambda v: v > 0, "> 0"), ("global_batch_size", lambda v: v >= 1, ">= 1"),
    ("eval_iters", lambda v: v >= 0, ">= 0 (0: no evaluation)"), ("seed", lambda v: v >= 0, ">= 0"),
    ("lr", lambda v: v > 0, "> 0"), ("min_lr", lambda v: v >= 0, ">= 0"),
    ("lr_warmup_iters", lambda v: v >= 0, ">= 0"), ("lr_decay_iters", lambda v: v >= 1, ">= 1"),
    ("lr_warmup_fraction", lambda v: 0 <= v < 1, "in [0, 1)"), ("lr_warmup_init", lambda v: v >= 0, ">= 0"),
    ("lr_wsd_decay_iters", lambda v: v >= 1, ">= 1"), ("lr_wsd_decay_samples", lambda v: v >= 1, ">= 1"),
    ("decoupled_lr", lambda v: v > 0, "> 0"), ("decoupled_min_lr", lambda v: v >= 0, ">= 0"),
    ("weight_decay", lambda v: v >= 0, ">= 0"), ("adam_beta1", lambda v: 0 <= v < 1, "in [0, 1)"),
    ("adam_beta2", lambda v: 0 <= v < 1, "in [0, 1)"), ("adam_eps", lambda v: v > 0, "> 0"),
    ("clip_grad", lambda v: v >= 0, ">= 0 (0: no clipping)"), ("loss_scale", lambda v: v > 0, "> 0"),
    ("initial_loss_scale", lambda v: v > 0, "> 0"), ("min_loss_scale", lambda v: v > 0, "> 0"),
    ("loss_scale_window", lambda v: v >= 1, ">= 1"), ("hysteresis", lambda v: v >= 1, ">= 1"),
    ("cpu_adam_threads", lambda v: v >= 1, ">= 1"), ("dpu_warmup_steps", lambda v: v >= 1, ">= 1"),
    ("dpu_adam_threads", lambda v: v >= 1, ">= 1"),
    ("distributed_timeout_minutes", lambda v: v > 0, "> 0"), ("max_skipped_iters", lambda v: v >= 0, ">= 0"),
]


def _check_offload_fraction(args: argparse.Namespace) -> None:
    """--optimizer-offload-fraction: a float in [0, 1] or "auto" (solved by the memory check)."""
    v = str(args.optimizer_offload_fraction).strip().lower()
    if v == "auto":
        args.optimizer_offload_fraction = "auto"
    else:
        try:
            f = float(v)
        except ValueError:
            f = float("nan")
        if not 0.0 <= f <= 1.0:
            raise ConfigError(f"--optimizer-offload-fraction {args.optimizer_offload_fraction} is not a number "
                              "in [0, 1] or 'auto': e.g. 0.5 keeps half of the optimizer on the device")
        args.optimizer_offload_fraction = f
    if args.optimizer_offload_fraction != 1.0:
        if not args.zero_offload:
            raise ConfigError("--optimizer-offload-fraction splits the CPU optimizer: add --zero-offload")
        if args.dpu:
            raise ConfigError("--optimizer-offload-fraction below 1 cannot be combined with --dpu (the device "
                              "part would not be delayed): use one or the other")
        if args.accumulate_grads_on_host:
            raise ConfigError("--optimizer-offload-fraction below 1 cannot be combined with "
                              "--accumulate-grads-on-host: use one or the other")
        if args.exp_avg_dtype != "fp32":
            raise ConfigError("--optimizer-offload-fraction below 1 keeps fp32 moments on the device: drop "
                              "--exp-avg-dtype/--exp-avg-sq-dtype bf16 or use --optimizer-offload-fraction 1")


def _resolve_dpu_corrector(args: argparse.Namespace) -> None:
    """--dpu-corrector and its alias --dpu-weight-prediction -> args.dpu_corrector (with --dpu: the
    corrector the engine runs; None without --dpu) and args.dpu_weight_prediction."""
    chosen = args.dpu_corrector
    if chosen is not None and not args.dpu:
        raise ConfigError(f"--dpu-corrector {chosen} corrects the delayed parameter update: add --dpu")
    if chosen == "none" and args.dpu_weight_prediction:
        raise ConfigError("--dpu-corrector none contradicts --dpu-weight-prediction (= --dpu-corrector "
                          "weight-prediction): drop one of them")
    if args.dpu:
        args.dpu_corrector = "weight-prediction" if args.dpu_weight_prediction else (chosen or "none")
        args.dpu_weight_prediction = args.dpu_corrector == "weight-prediction"


def range_problems(args: argparse.Namespace) -> list[str]:
    """Every numeric flag out of its range, and the learning-rate flags inconsistent: one clause
    each (check_megatron_compat reports them in one line with the refused flags)."""
    import math

    out = []
    for name, ok, want in _RANGES:
        v = getattr(args, name, None)
        if v is None:
            continue
        if isinstance(v, float) and not math.isfinite(v) or not ok(v):
            out.append(f"--{name.replace('_', '-')} {v}{origin(args, name)} is out of range: it must be {want}")
    if args.min_lr > args.lr and not any(p.startswith(("--lr ", "--min-lr ")) for p in out):   # not twice
        out.append(f"--min-lr {args.min_lr:g}{origin(args, 'min_lr')} exceeds --lr {args.lr:g}"
                   f"{origin(args, 'lr')}: the decay would climb; use --min-lr <= --lr")
    if args.lr_warmup_iters > args.train_iters:
        out.append(f"--lr-warmup-iters {args.lr_warmup_iters}{origin(args, 'lr_warmup_iters')} exceeds "
                   f"--train-iters {args.train_iters}{origin(args, 'train_iters')}: the run would end before "
                   "the warmup does; lower it")
    return out


def check_batch_sizes(args: argparse.Namespace, dp_size: int) -> None:
    """global = micro x DP x accumulation (or Megatron-LM's ramp-up of it: training/batch_schedule.py);
    sets args.grad_accum_steps (at the full batch), the run's iterations from --train-samples and the
    sample-based schedule's iterations."""
    from zo_megatron.training.batch_schedule import BatchSchedule

    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * dp_size
    ramp = getattr(args, "rampup_batch_size", None)
    if ramp is not None:
        _check_rampup_is_sample_based(args)
    batches = BatchSchedule.from_args(args, dp_size)
    args.grad_accum_steps = batches.full()[1]
    if ramp is not None:        # the schedule counts samples itself (schedule.py); iterations are for reports
        from zo_megatron.training.schedule import LRScheduler

        args.lr_warmup_iters = batches.iterations_to(LRScheduler.from_args(args).lr_warmup_steps)
    for unit in ("warmup", "decay", "wsd_decay"):   # the sample-based schedule in iterations: the same rates per step
        samples = getattr(args, f"lr_{unit}_samples", None)
        if samples is not None and ramp is None:
            if samples % args.global_batch_size:
                raise ConfigError(f"--lr-{unit.replace('_', '-')}-samples {samples} is not a multiple of the global "
                                  f"batch {args.global_batch_size}: use a multiple (the schedule steps once per batch)")
            setattr(args, f"lr_{unit}_iters", samples // args.global_batch_size)
    if args.train_samples is not None:                # Megatron: iterations = samples // global batch
        args.train_iters = batches.iterations(args.train_samples)
        if args.train_iters < 1:
            raise ConfigError(f"--train-samples {args.train_samples} is less than one global batch "
                              f"({args.global_batch_size}): raise it")


def _check_rampup_is_sample_based(args: argparse.Namespace) -> None:
    """Megatron-LM's rule: a ramp's iterations have different sizes, so the run and its schedule
    are counted in samples (it asserts 'expected no batch-size rampup for iteration-based training')."""
    given = getattr(args, "given", ())
    iteration_flags = [f"--{k.replace('_', '-')}" for k in ("lr_decay_iters", "lr_wsd_decay_iters")
                       if getattr(args, k, None) is not None]
    if args.lr_warmup_iters and "lr_warmup_iters" in given:
        iteration_flags.insert(0, "--lr-warmup-iters")
    if args.train_samples is None:
        raise ConfigError("--rampup-batch-size needs sample-based training, as in Megatron-LM: use --train-samples "
                          "(with --lr-decay-samples / --lr-warmup-samples) instead of --train-iters")
    if iteration_flags:
        swaps = ", ".join(f"{f.replace('-iters', '-samples')} instead of {f}" for f in iteration_flags)
        raise ConfigError(f"--rampup-batch-size counts the schedule in samples, as in Megatron-LM: use {swaps}")
    if args.lr_decay_style == "WSD" and getattr(args, "lr_wsd_decay_samples", None) is None:
        raise ConfigError("--lr-decay-style WSD with --rampup-batch-size needs the final anneal in samples: add "
                          "--lr-wsd-decay-samples N (Megatron-LM's flag)")
    if "lr_warmup_iters" in getattr(args, "demo_filled", ()) and args.lr_warmup_samples is None and \
            args.lr_warmup_fraction is None:        # the demo's warmup, in the samples a ramp counts
        args.lr_warmup_samples = args.lr_warmup_iters * args.global_batch_size
