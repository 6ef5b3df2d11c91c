#!/usr/bin/env bash
# A 13B GPT on ONE 32 GB GPU with ZeRO-Offload (the paper's headline: PyTorch alone fits 1.4B).
#
# Hardware : 1x V100-32GB (the paper used one V100 of a DGX-2) and >= 256 GiB host RAM.
# Model    : 65 layers x 4096 hidden x 32 heads, seq 1024, GPT-2 vocab 50257 -> 50304 padded
#            = 13.30B parameters.
# Training : fp16 (use --bf16 instead on A100/H100), full activation recompute,
#            micro-batch 4 = global batch 4 (no gradient accumulation: with ZeRO-Offload,
#            accumulation keeps 16-bit gradients on the GPU, +24.8 GiB here, which does not fit).
# Attention: --use-flash-attn (torch SDPA, causal: no s x s scores; on the V100 torch runs its
#            memory-efficient kernel, FlashAttention needs sm80+), as Megatron-LM's reference scripts
#            do (examples/llama/train_llama3_8b_h100_fp8.sh: --attention-backend fused). TP = 1:
#            no --sequence-parallel (Megatron-LM turns it off there).
# Planner  : python tools/estimate_memory.py --preset v100-32gb --host-memory-gb 256 \
#                --tensor-model-parallel-size 1 --num-layers 65 --hidden-size 4096 \
#                --num-attention-heads 32 --seq-length 1024 --max-position-embeddings 1024 \
#                --make-vocab-size-divisible-by 128 --micro-batch-size 4 --global-batch-size 4 \
#                --train-iters 20000 --lr 1.0e-4 --min-lr 1.0e-5 --lr-decay-style cosine \
#                --lr-warmup-iters 500 --lr-decay-iters 20000 --weight-decay 0.1 --adam-beta1 0.9 \
#                --adam-beta2 0.95 --adam-eps 1e-8 --clip-grad 1.0 --fp16 \
#                --initial-loss-scale 65536 --recompute-granularity full --use-flash-attn \
#                --zero-offload --bucket-size 50000000 --seed 1234 --save checkpoints/gpt-13b \
#                --load checkpoints/gpt-13b --save-interval 1000 --eval-interval 1000 \
#                --eval-iters 10 --log-interval 1 --log-jsonl checkpoints/gpt-13b/train.jsonl
#            (this script's own pretrain_gpt.py flags, with 256 GiB of host RAM)
#   device per GPU : 30.61 GiB of 31.75 GiB  (params 24.77, grad buckets 0.19 + 0.66 for the
#                    oversized bucket that holds the word embedding, layer inputs 2.03, peak on
#                    top 1.59 = the logits phase: 16-bit logits 0.38 + their fp32 copy in the
#                    cross-entropy 0.77 + vocabulary-pad mask 0.38 + final-norm/output-layer inputs
#                    0.06 (the backward of one recomputed layer is smaller),
#                    fragmentation 0.36, CUDA context 1.00; without --use-flash-attn 30.99) --
#                    tight: if it OOMs, use --micro-batch-size 2 --global-batch-size 2 (28.61 GiB).
#   host per node  : 243.63 GiB of 256 GiB (fp32 master + Adam m + v 148.6, 16-bit staging 24.8,
#                    the CPU-step overlap's rollback state 41.6, 3 GiB process, 25.6 GiB OS reserve
#                    (the job's: a tenth of the RAM)). --overlap-cpu-step auto (the default on a
#                    GPU) speculates 24% of the partition, what the host memory left free holds
#                    with the planner's 5% margin kept;
#                    all of it would take 173.41 GiB (373.66 GiB per node: the job refuses
#                    --overlap-cpu-step full here). --no-overlap-cpu-step: 202.01 GiB.
#   The same model WITHOUT --zero-offload needs 203.18 GiB on the GPU.
set -euo pipefail
cd "${ZO_ROOT:-$(dirname "$0")/..}"

DATA_ARGS=()
[[ -n "${DATA_PATH:-}" ]] && DATA_ARGS+=(--data-path "$DATA_PATH" --split 949,50,1)
[[ -n "${VOCAB_FILE:-}" ]] && DATA_ARGS+=(--vocab-file "$VOCAB_FILE")
[[ -n "${MERGE_FILE:-}" ]] && DATA_ARGS+=(--merge-file "$MERGE_FILE")
CKPT_DIR="${CKPT_DIR:-checkpoints/gpt-13b}"

exec torchrun --standalone --nproc-per-node 1 pretrain/pretrain_gpt.py \
    --tensor-model-parallel-size 1 \
    --num-layers 65 --hidden-size 4096 --num-attention-heads 32 \
    --seq-length 1024 --max-position-embeddings 1024 --make-vocab-size-divisible-by 128 \
    --micro-batch-size 4 --global-batch-size 4 \
    --train-iters 20000 --lr 1.0e-4 --min-lr 1.0e-5 --lr-decay-style cosine \
    --lr-warmup-iters 500 --lr-decay-iters 20000 --weight-decay 0.1 \
    --adam-beta1 0.9 --adam-beta2 0.95 --adam-eps 1e-8 --clip-grad 1.0 \
    --fp16 --initial-loss-scale 65536 \
    --recompute-granularity full \
    --use-flash-attn \
    --zero-offload --bucket-size 50000000 \
    --seed 1234 \
    ${DATA_ARGS[@]+"${DATA_ARGS[@]}"} \
    --save "$CKPT_DIR" --load "$CKPT_DIR" --save-interval 1000 \
    --eval-interval 1000 --eval-iters 10 --log-interval 1 \
    --log-jsonl "$CKPT_DIR/train.jsonl" \
    "$@"
