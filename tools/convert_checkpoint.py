#!/usr/bin/env python
"""Convert checkpoints: Hugging Face and Megatron-LM both ways, consolidated fp32, offline reshard.

    python tools/convert_checkpoint.py to-hf --load CKPT [--iteration N] --output DIR [--dtype fp32|bf16|fp16]
                                             [--architecture NAME] [--tokenizer-model DIR]
    python tools/convert_checkpoint.py from-hf --input DIR --output CKPT --tensor-parallel N
    python tools/convert_checkpoint.py to-megatron --load CKPT --output DIR [--tensor-parallel N]
                                                   [--expert-model-parallel-size M]
                                                   [--expert-tensor-parallel-size K] [--moe-grouped-gemm]
                                                   [--ckpt-format torch|torch_dist]
                                                   [--transformer-impl local|transformer_engine]
    python tools/convert_checkpoint.py from-megatron --input DIR --output CKPT --tensor-parallel N
                                                     [--iteration N] [--vocab-size N] [--tokenizer-model DIR]
    python tools/convert_checkpoint.py to-fp32 --load CKPT --output PATH [--max-shard-size 5GB]
    python tools/convert_checkpoint.py reshard --load CKPT --output CKPT2 --target-tensor-parallel-size N
                                               [--target-data-parallel-size M]

Hugging Face architectures: GPT2LMHeadModel, LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM,
Qwen3ForCausalLM, MixtralForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM, DeepseekV3ForCausalLM,
DeepseekV2ForCausalLM (a sliding window: trained at --seq-length up to it; the mixtures of experts at any TP x EP
with to-megatron / from-megatron; DeepSeek's multi-token-prediction layers are left out, its FP8 weights refused).
from-megatron reads Megatron-LM's torch_dist format (its default --ckpt-format, saved at any TP x EP x PP) and its torch format. CKPT is a `pretrain_gpt.py --save` directory. Outputs are written under a temporary name and
renamed when complete; an existing non-empty output is refused unless --force. Wrong input gets
one `error:` line and exit 2. See docs/checkpoints.md.
"""
from __future__ import annotations

import argparse
import os
import sys

try:
    from zo_megatron.checkpoint import convert, hf
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from zo_megatron.checkpoint import convert, hf

from zo_megatron.errors import UserError  # noqa: E402

PROG = "convert_checkpoint.py"


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2 (argparse would print the usage too)
        raise UserError(f"{message} (see {PROG} {{to-hf,from-hf,to-megatron,from-megatron,to-fp32,reshard}} --help)")


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(prog=PROG, description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True, parser_class=_Parser)

    def common(p, source: str):
        if source == "load":
            p.add_argument("--load", required=True, help="zo_megatron checkpoint directory (pretrain_gpt.py --save)")
            p.add_argument("--iteration", type=int, default=None, help="default: the one latest_checkpointed_iteration.txt names")
        else:
            p.add_argument("--input", required=True, help="directory to convert")
        p.add_argument("--output", required=True)
        p.add_argument("--force", action="store_true", help="replace an existing non-empty output")

    p = sub.add_parser("to-hf", help="a Hugging Face model directory (GPT-2, Llama, Mistral, Qwen2, Qwen3, Nemotron, "
                                     "StarCoder2, Mixtral, Qwen-MoE or DeepSeek-V2/V3) with its tokenizer")
    common(p, "load")
    p.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32")
    p.add_argument("--architecture", choices=list(hf.SUPPORTED),
                   help="the Hugging Face class to write (default: the one the checkpoint was converted from, else "
                        "the first that expresses the model: GPT-2, Llama, Mistral, Qwen2, Qwen3, ...; "
                        "multi-latent attention: DeepseekV3, or DeepseekV2 for a softmax router)")
    p.add_argument("--tokenizer-model", help="Hugging Face tokenizer directory to ship (default: the checkpoint's "
                                             "tokenizer/ folder, else GPT-2's BPE files)")
    p.add_argument("--vocab-file", help="the tokenizer's vocab.json, for a checkpoint trained with --allow-custom-vocab")
    p.add_argument("--merge-file", help="the tokenizer's merges.txt (with --vocab-file)")
    p.add_argument("--max-shard-size", default="5GB", help="largest safetensors file (default 5GB)")

    p = sub.add_parser("from-hf", help="a weights-only zo_megatron checkpoint (+ tokenizer/) from a Hugging Face "
                                       "model directory of a supported architecture (--architecture's list)")
    common(p, "input")
    p.add_argument("--tensor-parallel", "--tensor-model-parallel-size", dest="tensor_parallel", type=int, required=True)

    p = sub.add_parser("to-megatron", help="Megatron-LM's checkpoint: its torch format (mp_rank_XX[_EEE]/"
                                           "model_optim_rng.pt) or, with --ckpt-format torch_dist, its default one")
    common(p, "load")
    p.add_argument("--tensor-parallel", "--tensor-model-parallel-size", dest="tensor_parallel", type=int,
                   help="TP ranks to write (default: the checkpoint's)")
    p.add_argument("--expert-parallel", "--expert-model-parallel-size", dest="expert_parallel", type=int,
                   help="EP ranks to write for a mixture of experts (mp_rank_TT_EEE; default: the checkpoint's)")
    p.add_argument("--expert-tensor-parallel-size", dest="expert_tensor_parallel", type=int,
                   help="the experts' TP for a mixture of experts (Megatron-LM's flag; default: the checkpoint's "
                        "at its TP, else --tensor-parallel)")
    p.add_argument("--moe-grouped-gemm", dest="grouped_gemm", action="store_true",
                   help="the experts as a Megatron-LM --moe-grouped-gemm run holds them (--transformer-impl local: "
                        "GroupedMLP's weight1 / weight2; transformer_engine: TEGroupedMLP's linear_fc1.weight{J}; "
                        "default: SequentialMLP's local_experts.J)")
    p.add_argument("--ckpt-format", dest="ckpt_format", choices=("torch", "torch_dist"), default="torch",
                   help="Megatron-LM's checkpoint format: torch (one file per TP x EP rank, loaded with "
                        "--ckpt-format torch at that layout) or torch_dist (its default: global tensors that its "
                        "run loads at any TP x EP x PP)")
    p.add_argument("--transformer-impl", dest="transformer_impl", choices=("local", "transformer_engine"),
                   default=None,
                   help="the Megatron-LM --transformer-impl whose layer names and layout are written: local "
                        "(megatron-core's local spec) or transformer_engine (Transformer Engine's spec: norms fused "
                        "into the linear layers, TE's extra states, MLA's down projections whole on every TP rank); "
                        "default: transformer_engine for multi-latent attention (Megatron-LM builds it only with "
                        "Transformer Engine), else local")

    p = sub.add_parser("from-megatron", help="a weights-only zo_megatron checkpoint from a Megatron-LM checkpoint "
                                            "(--ckpt-format torch_dist, its default, or torch)")
    common(p, "input")
    p.add_argument("--tensor-parallel", "--tensor-model-parallel-size", dest="tensor_parallel", type=int, required=True)
    p.add_argument("--iteration", "--ckpt-step", dest="iteration", type=int, default=None,
                   help="the iteration to convert (default: the one latest_checkpointed_iteration.txt names)")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="the model's real vocabulary, when the run's args have none (it was run without --vocab-size)")
    p.add_argument("--tokenizer-model", default=None,
                   help="the run's Hugging Face tokenizer directory, when the path in its args is not here (gives "
                        "the vocabulary, len(tokenizer), and is copied into the checkpoint)")

    p = sub.add_parser("to-fp32", help="consolidated fp32 master weights as safetensors (zero_to_fp32's job)")
    common(p, "load")
    p.add_argument("--max-shard-size", default="5GB",
                   help="largest file when PATH is a directory (default 5GB); PATH.safetensors is always one file")

    p = sub.add_parser("reshard", help="the checkpoint laid out for another TP x DP, optimizer state included")
    common(p, "load")
    p.add_argument("--target-tensor-parallel-size", type=int, required=True)
    p.add_argument("--target-data-parallel-size", type=int, default=None, help="default: the checkpoint's")
    return ap


def run(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    if a.command == "to-hf":
        convert.to_hf(a.load, a.output, iteration=a.iteration, dtype=a.dtype, vocab_file=a.vocab_file,
                      merge_file=a.merge_file, tokenizer_model=a.tokenizer_model, architecture=a.architecture,
                      max_shard_size=a.max_shard_size, force=a.force)
    elif a.command == "from-hf":
        convert.from_hf(a.input, a.output, tensor_parallel=a.tensor_parallel, force=a.force)
    elif a.command == "to-megatron":
        convert.to_megatron(a.load, a.output, iteration=a.iteration, tensor_parallel=a.tensor_parallel,
                            expert_parallel=a.expert_parallel, expert_tensor_parallel=a.expert_tensor_parallel,
                            grouped_gemm=a.grouped_gemm, ckpt_format=a.ckpt_format,
                            transformer_impl=a.transformer_impl, force=a.force)
    elif a.command == "from-megatron":
        convert.from_megatron(a.input, a.output, tensor_parallel=a.tensor_parallel, iteration=a.iteration,
                              vocab_size=a.vocab_size,
                              tokenizer_model=a.tokenizer_model, force=a.force)
    elif a.command == "to-fp32":
        convert.to_fp32(a.load, a.output, iteration=a.iteration, max_shard_size=a.max_shard_size, force=a.force)
    elif a.command == "reshard":
        convert.reshard(a.load, a.output, target_tp=a.target_tensor_parallel_size,
                        target_dp=a.target_data_parallel_size, iteration=a.iteration, force=a.force)
    return 0


def main(argv: list[str] | None = None) -> int:
    try:
        return run(argv)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("error: interrupted; nothing was written (outputs appear only when complete)", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
