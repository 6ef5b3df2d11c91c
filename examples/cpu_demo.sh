#!/usr/bin/env bash
# The README demo: TP=2 + ZeRO-Offload on a laptop CPU (gloo), two processes, no GPU.
#
#   torchrun --standalone --nproc-per-node 2 pretrain/pretrain_gpt.py --tensor-parallel 2 --zero-offload
#
# Hardware : any x86-64/ARM machine with >= 2 cores and >= 4 GB RAM (CPU Adam uses AVX-512/AVX2
#            when present). Extra arguments are passed through to pretrain_gpt.py.
# Model    : pretrain_gpt.py's defaults. The numbers below assume the CPU yardstick shape
#            4 layers x 256 hidden x 4 heads, seq 256, micro-batch 8 (16.1M parameters, 8.1M
#            per TP rank); re-run the planner with the real defaults (pretrain_gpt.py --help):
# Planner  : python tools/estimate_memory.py --preset cpu --num-layers 4 --hidden-size 256 \
#                --num-attention-heads 4 --seq-length 256 --micro-batch-size 8 --tensor-parallel 2 --fp32
#   "device" per rank : 0.65 GiB fp32 (0.45 GiB with --bf16): params, buckets, activations,
#                       logits (0.38 GiB: the 50257-wide output layer dominates)
#   host per machine  : 3.24 GiB (model states 0.24 GiB; 2 processes x 1 GiB; 1 GiB reserve);
#                       everything together ~4.5 GiB of RAM.
set -euo pipefail
cd "${ZO_ROOT:-$(dirname "$0")/..}"
TORCHRUN="${TORCHRUN:-torchrun}"
[[ -x .venv/bin/torchrun && "$TORCHRUN" == torchrun ]] && TORCHRUN=.venv/bin/torchrun

exec "$TORCHRUN" --standalone --nproc-per-node 2 pretrain/pretrain_gpt.py --tensor-parallel 2 --zero-offload "$@"
