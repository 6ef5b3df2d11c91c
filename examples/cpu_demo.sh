#!/usr/bin/env bash
# The README demo: TP=2 + ZeRO-Offload on a laptop CPU (gloo), two processes, no GPU.
#
#   torchrun --standalone --nproc-per-node 2 pretrain/pretrain_gpt.py --tensor-parallel 2 --zero-offload
#
# Hardware : any x86-64/ARM machine with >= 2 cores and >= 4 GB RAM (CPU Adam uses AVX-512/AVX2
#            when present). Extra arguments are passed through to pretrain_gpt.py.
# Model    : pretrain_gpt.py's demo defaults: GPT-2 4 layers x 256 hidden x 4 heads, seq 256,
#            micro-batch 8, bf16, no dropout, 300 iterations (16.1M parameters, 8.1M per TP rank).
# Planner  : python tools/estimate_memory.py --zero-offload --preset cpu --num-layers 4 --hidden-size 256 \
#                --num-attention-heads 4 --seq-length 256 --micro-batch-size 8 --tensor-parallel 2 \
#                --bf16 --attention-dropout 0 --hidden-dropout 0
#   "device" per rank : 0.54 GiB (0.62 GiB with --fp32): params 0.015, grad buckets 0.03, layer
#                       activations 0.06, logits phase 0.39 (the 50257-wide output layer
#                       dominates: 16-bit logits 0.10 + fp32 cross-entropy copy 0.19 + pad-column
#                       mask 0.10), fragmentation 0.04
#   host per machine  : 2.41 GiB (model states 2 x 108.2 MiB = 0.21 GiB, the engine reports the
#                       same 108.2 MiB per rank; 2 processes x 0.6 GiB; 1 GiB reserve);
#                       everything together 2 x 0.54 + 2.41 = ~3.5 GiB of RAM.
set -euo pipefail
cd "${ZO_ROOT:-$(dirname "$0")/..}"
TORCHRUN="${TORCHRUN:-torchrun}"
[[ -x .venv/bin/torchrun && "$TORCHRUN" == torchrun ]] && TORCHRUN=.venv/bin/torchrun

exec "$TORCHRUN" --standalone --nproc-per-node 2 pretrain/pretrain_gpt.py --tensor-parallel 2 --zero-offload "$@"
