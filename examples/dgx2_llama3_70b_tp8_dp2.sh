#!/usr/bin/env bash
# Llama-3-70B on ONE DGX-2: tensor parallel 8 x data parallel 2, ZeRO-Offload to the host.
#
# Hardware : 1x DGX-2 = 16x V100-SXM3-32GB (NVSwitch), 1.5 TiB host RAM, 2x 24-core Xeon.
# Layout   : the 8 KV heads (GQA) cap tensor parallelism at 8 (megatron-core's local attention
#            splits whole query groups: TP must divide 8), so the 16 GPUs are TP 8 x DP 2;
#            ZeRO-2 splits each TP rank's gradients and optimizer state over the 2 DP ranks.
# Model    : Llama-3-70B (its Hugging Face config.json): 80 layers x 8192 hidden x 64 heads, 8 KV
#            heads, SwiGLU ffn 28672, RoPE theta 500000, RMSNorm eps 1e-5, no biases, untied
#            output layer, vocab 128256 -> 129024 padded for TP 8 = 70.57B parameters (70,553,706,496
#            unpadded, the public count; 8.82B per TP rank); seq 8192, Llama-3's context (without
#            --use-flash-attn --sequence-parallel it needs 34.52 GiB per GPU: over the V100's 31.75).
# Training : fp16 (V100 has no bf16) with dynamic loss scaling, full activation recompute,
#            micro-batch 1 x DP 2 = global batch 2 (no accumulation: with ZeRO-Offload it would keep
#            16-bit gradients on the GPU, +16.4 GiB here, which does not fit).
# Attention: --use-flash-attn (torch SDPA, causal: no s x s scores; on the V100 torch runs its
#            memory-efficient kernel, FlashAttention needs sm80+) and
#            --sequence-parallel (norm, dropout and layer-input activations split over the 8 TP
#            ranks), as Megatron-LM's Llama-3 scripts launch (examples/llama/
#            train_llama3_8b_h100_fp8.sh: --attention-backend fused, --sequence-parallel).
# Planner  : python tools/estimate_memory.py --preset dgx2 --world-size 16 \
#                --tensor-model-parallel-size 8 --num-layers 80 --hidden-size 8192 \
#                --num-attention-heads 64 --group-query-attention --num-query-groups 8 \
#                --ffn-hidden-size 28672 --swiglu --position-embedding-type rope \
#                --rotary-base 500000 --normalization RMSNorm --norm-epsilon 1e-5 \
#                --disable-bias-linear --untie-embeddings-and-output-weights --seq-length 8192 \
#                --max-position-embeddings 8192 --make-vocab-size-divisible-by 128 \
#                --vocab-size 128256 --micro-batch-size 1 --global-batch-size 2 \
#                --train-iters 20000 --lr 1.5e-4 --min-lr 1.5e-5 --lr-decay-style cosine \
#                --lr-warmup-iters 2000 --lr-decay-iters 20000 --weight-decay 0.1 --adam-beta1 0.9 \
#                --adam-beta2 0.95 --adam-eps 1e-8 --clip-grad 1.0 --fp16 \
#                --initial-loss-scale 65536 --recompute-granularity full --use-flash-attn \
#                --sequence-parallel --zero-offload --seed 1234 --save checkpoints/llama3-70b \
#                --load checkpoints/llama3-70b --save-interval 1000 --eval-interval 1000 \
#                --eval-iters 10 --log-interval 1 --log-jsonl checkpoints/llama3-70b/train.jsonl
#            (this script's own pretrain_gpt.py flags, on the DGX-2's 16 ranks; --vocab-size 128256
#            stands for --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$TOKENIZER_MODEL":
#            the Llama-3 tokenizer's size, which the job reads from it; the planner accepts either)
#   device per GPU : 20.75 GiB of 31.75 GiB  (params 16.43, grad buckets 0.15 + 0.41 for the
#                    oversized embedding/output-layer buckets, reduce-scatter scratch 0.07, layer
#                    inputs 1.25 ([s/8, b, h] each), peak on top 1.19 = the logits phase: 16-bit
#                    logits 0.25 + their fp32 copy in the cross-entropy 0.49 + vocabulary-pad mask
#                    0.25 + final-norm/output-layer inputs 0.08 + sequence-parallel gather buffer
#                    0.12, fragmentation 0.24, CUDA context 1.00)
#   host per node  : 1,460.30 GiB of 1,536 GiB (fp32 master + Adam m + v 788.7, 16-bit staging
#                    131.5, the CPU-step overlap's rollback state 460.1, 16 processes x 3 GiB,
#                    32 GiB OS reserve). --overlap-cpu-step auto (the default on a GPU) speculates
#                    50% of each rank's partition, what the host memory left free holds with the
#                    planner's 5% margin kept (docs/memory_planner.md, "The edge, measured"); all of it
#                    would take 57.51 GiB per rank, 1,920.40 GiB per node: over the 1.5 TiB (the
#                    job refuses --overlap-cpu-step full here). --no-overlap-cpu-step: 1,000.20 GiB.
#   The same run WITHOUT --zero-offload needs 135.14 GiB per GPU (does not fit).
#
# CPU Adam threads: zo_megatron divides the cores each rank may use among the 16 local ranks
# (96 hardware threads -> 6 per rank); override with --cpu-adam-threads or ZO_CPU_ADAM_THREADS.
# Data     : DATA_PATH = prefix of a dataset preprocessed with the same tokenizer
#            (tools/preprocess_data.py --tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR);
#            TOKENIZER_MODEL = a local directory with tokenizer.json + tokenizer_config.json.
set -euo pipefail
cd "${ZO_ROOT:-$(dirname "$0")/..}"

: "${TOKENIZER_MODEL:?set TOKENIZER_MODEL to the Llama-3 tokenizer directory}"
DATA_ARGS=()
[[ -n "${DATA_PATH:-}" ]] && DATA_ARGS+=(--data-path "$DATA_PATH" --split 949,50,1)
CKPT_DIR="${CKPT_DIR:-checkpoints/llama3-70b}"

exec torchrun --standalone --nproc-per-node 16 pretrain/pretrain_gpt.py \
    --tensor-model-parallel-size 8 \
    --num-layers 80 --hidden-size 8192 --num-attention-heads 64 \
    --group-query-attention --num-query-groups 8 \
    --ffn-hidden-size 28672 --swiglu \
    --position-embedding-type rope --rotary-base 500000 \
    --normalization RMSNorm --norm-epsilon 1e-5 \
    --disable-bias-linear --untie-embeddings-and-output-weights \
    --seq-length 8192 --max-position-embeddings 8192 --make-vocab-size-divisible-by 128 \
    --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$TOKENIZER_MODEL" \
    --micro-batch-size 1 --global-batch-size 2 \
    --train-iters 20000 --lr 1.5e-4 --min-lr 1.5e-5 --lr-decay-style cosine \
    --lr-warmup-iters 2000 --lr-decay-iters 20000 --weight-decay 0.1 \
    --adam-beta1 0.9 --adam-beta2 0.95 --adam-eps 1e-8 --clip-grad 1.0 \
    --fp16 --initial-loss-scale 65536 \
    --recompute-granularity full \
    --use-flash-attn --sequence-parallel \
    --zero-offload \
    --seed 1234 \
    ${DATA_ARGS[@]+"${DATA_ARGS[@]}"} \
    --save "$CKPT_DIR" --load "$CKPT_DIR" --save-interval 1000 \
    --eval-interval 1000 --eval-iters 10 --log-interval 1 \
    --log-jsonl "$CKPT_DIR/train.jsonl" \
    "$@"
