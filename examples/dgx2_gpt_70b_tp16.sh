#!/usr/bin/env bash
# A 70B GPT on ONE DGX-2: tensor parallel 16 inside the box, ZeRO-Offload to the host.
#
# Hardware : 1x DGX-2 = 16x V100-SXM3-32GB (NVSwitch), 1.5 TiB host RAM, 2x 24-core Xeon.
# Model    : 69 layers x 9216 hidden x 96 heads (head dim 96; 96 % 16 == 0), seq 1024,
#            GPT-2 vocab 50257 -> 51200 padded = 70.82B parameters (4.44B per TP rank).
# Training : fp16 (V100 has no bf16) with dynamic loss scaling, full activation recompute,
#            micro-batch 8 = global batch 8 (DP = 1, no accumulation: with ZeRO-Offload,
#            accumulation keeps 16-bit gradients on the GPU, +8.3 GiB here).
# Attention: --use-flash-attn (torch SDPA, causal: no s x s scores; on the V100 torch runs its
#            memory-efficient kernel, FlashAttention needs sm80+) and --sequence-parallel (norm,
#            dropout and layer-input activations split over the 16 TP ranks), as Megatron-LM's
#            reference scripts launch TP > 1 jobs (e.g. examples/llama/train_llama3_8b_h100_fp8.sh:
#            --attention-backend fused, --sequence-parallel).
# Planner  : python tools/estimate_memory.py --preset dgx2 --world-size 16 \
#                --tensor-model-parallel-size 16 --num-layers 69 --hidden-size 9216 \
#                --num-attention-heads 96 --seq-length 1024 --max-position-embeddings 1024 \
#                --make-vocab-size-divisible-by 128 --micro-batch-size 8 --global-batch-size 8 \
#                --train-iters 20000 --lr 1.0e-4 --min-lr 1.0e-5 --lr-decay-style cosine \
#                --lr-warmup-iters 500 --lr-decay-iters 20000 --weight-decay 0.1 --adam-beta1 0.9 \
#                --adam-beta2 0.95 --adam-eps 1e-8 --clip-grad 1.0 --fp16 \
#                --initial-loss-scale 65536 --recompute-granularity full --use-flash-attn \
#                --sequence-parallel --zero-offload --bucket-size 50000000 --seed 1234 \
#                --save checkpoints/gpt-70b-tp16 --load checkpoints/gpt-70b-tp16 \
#                --save-interval 1000 --eval-interval 1000 --eval-iters 10 --log-interval 1 \
#                --log-jsonl checkpoints/gpt-70b-tp16/train.jsonl \
#                --tensorboard-dir checkpoints/gpt-70b-tp16/tb
#            (this script's own pretrain_gpt.py flags, on the DGX-2's 16 ranks)
#   device per GPU : 10.64 GiB of 31.75 GiB  (params 8.27, grad buckets 0.19 + 0.05 for the
#                    word-embedding bucket, layer inputs 0.61 ([s/16, b, h] each), peak of backward
#                    on top 0.42 = sequence-parallel gather buffer 0.14 + recompute working set 0.14
#                    + layer gradients 0.09 + tied-embedding gradient 0.05, fragmentation 0.10,
#                    CUDA context 1.00); without the two flags 21.67 GiB (layer inputs 9.70).
#   host per node  : 1,459.63 GiB of 1,536 GiB (fp32 master + Adam m + v 793.6, 16-bit staging
#                    132.3, the CPU-step overlap's rollback state 453.7, 16 processes x 3 GiB,
#                    32 GiB OS reserve). --overlap-cpu-step auto (the default on a GPU) speculates
#                    49% of each rank's partition, what the host memory left free holds with the
#                    planner's 5% margin kept (docs/memory_planner.md, "The edge, measured"); all of it
#                    would take 57.87 GiB per rank, 1,931.85 GiB per node: over the 1.5 TiB (the
#                    job refuses --overlap-cpu-step full here). --no-overlap-cpu-step: 1,005.92 GiB.
#   The same model WITHOUT --zero-offload needs 68.27 GiB per GPU (does not fit).
#
# CPU Adam threads: zo_megatron divides the cores each rank may use among the 16 local ranks
# (96 hardware threads -> 6 per rank); override with --cpu-adam-threads or ZO_CPU_ADAM_THREADS.
# Data: DATA_PATH = prefix of a dataset made by `zo-preprocess-data` (omit it for the bundled
# demo corpus); VOCAB_FILE/MERGE_FILE default to the bundled GPT-2 BPE.
set -euo pipefail
cd "${ZO_ROOT:-$(dirname "$0")/..}"

DATA_ARGS=()
[[ -n "${DATA_PATH:-}" ]] && DATA_ARGS+=(--data-path "$DATA_PATH" --split 949,50,1)
[[ -n "${VOCAB_FILE:-}" ]] && DATA_ARGS+=(--vocab-file "$VOCAB_FILE")
[[ -n "${MERGE_FILE:-}" ]] && DATA_ARGS+=(--merge-file "$MERGE_FILE")
CKPT_DIR="${CKPT_DIR:-checkpoints/gpt-70b-tp16}"

exec torchrun --standalone --nproc-per-node 16 pretrain/pretrain_gpt.py \
    --tensor-model-parallel-size 16 \
    --num-layers 69 --hidden-size 9216 --num-attention-heads 96 \
    --seq-length 1024 --max-position-embeddings 1024 --make-vocab-size-divisible-by 128 \
    --micro-batch-size 8 --global-batch-size 8 \
    --train-iters 20000 --lr 1.0e-4 --min-lr 1.0e-5 --lr-decay-style cosine \
    --lr-warmup-iters 500 --lr-decay-iters 20000 --weight-decay 0.1 \
    --adam-beta1 0.9 --adam-beta2 0.95 --adam-eps 1e-8 --clip-grad 1.0 \
    --fp16 --initial-loss-scale 65536 \
    --recompute-granularity full \
    --use-flash-attn --sequence-parallel \
    --zero-offload --bucket-size 50000000 \
    --seed 1234 \
    ${DATA_ARGS[@]+"${DATA_ARGS[@]}"} \
    --save "$CKPT_DIR" --load "$CKPT_DIR" --save-interval 1000 \
    --eval-interval 1000 --eval-iters 10 --log-interval 1 \
    --log-jsonl "$CKPT_DIR/train.jsonl" --tensorboard-dir "$CKPT_DIR/tb" \
    "$@"
