#!/usr/bin/env bash
# The README demo: TP=2 + ZeRO-Offload on a laptop CPU (gloo), two processes, no GPU.
#
#   torchrun --standalone --nproc-per-node 2 pretrain/pretrain_gpt.py --tensor-parallel 2 --zero-offload
#
# Hardware : any x86-64/ARM machine with >= 2 cores and >= 4 GiB RAM (CPU Adam uses AVX-512/AVX2
#            when present). Extra arguments are passed through to pretrain_gpt.py.
# Model    : pretrain_gpt.py's demo defaults: GPT-2 4 layers x 256 hidden x 4 heads, seq 256,
#            micro-batch 8, no dropout, 300 iterations (16.1M parameters, 8.1M per TP rank); bf16 on
#            CPUs with native bf16 (AVX512_BF16 or AMX), fp32 on the others (the job's default).
# Planner  : python tools/estimate_memory.py --preset cpu --host-memory-gb 4 --world-size 2 --fp32 \
#                --tensor-parallel 2 --zero-offload
#            (this script's flags on 2 ranks and 4 GiB; --fp32 pins the CPU-dependent default,
#            --bf16 gives the numbers in brackets)
#   "device" per rank : 0.62 GiB (0.54 with --bf16): params 0.03, grad buckets 0.03, layer
#                       activations 0.09, logits phase 0.38 (the 50257-wide output layer
#                       dominates: fp32 logits 0.19 + the cross-entropy's fp32 copy 0.19; with bf16
#                       16-bit logits 0.10 + fp32 copy 0.19 + pad-column mask 0.10),
#                       fragmentation 0.05
#   host per machine  : 1.84 GiB (1.81): model states 2 x 123.7 MiB (2 x 108.2 MiB with bf16),
#                       2 processes x 0.49 GiB + 0.22 GiB for the launcher, 0.4 GiB reserve (the
#                       job's: a tenth of the RAM);
#                       the CPU step is synchronous (the --overlap-cpu-step default is off where
#                       the device is the host: nothing speculated, no rollback state).
#                       Everything together 2 x 0.62 + 1.84 = 3.08 GiB of the 4 GiB (2.89).
set -euo pipefail
cd "${ZO_ROOT:-$(dirname "$0")/..}"
TORCHRUN="${TORCHRUN:-torchrun}"
[[ -x .venv/bin/torchrun && "$TORCHRUN" == torchrun ]] && TORCHRUN=.venv/bin/torchrun

exec "$TORCHRUN" --standalone --nproc-per-node 2 pretrain/pretrain_gpt.py --tensor-parallel 2 --zero-offload "$@"
