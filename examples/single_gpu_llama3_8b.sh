#!/usr/bin/env bash
# Llama-3-8B on ONE 80 GB GPU with ZeRO-Offload: Megatron-LM's Llama-3 flags, plus --zero-offload.
#
# Hardware : 1x H100-80GB (or A100-80GB) and >= 192 GiB host RAM.
# Model    : Llama-3-8B (its Hugging Face config.json): 32 layers x 4096 hidden x 32 heads, 8 KV heads
#            (GQA), SwiGLU ffn 14336, RoPE theta 500000, RMSNorm eps 1e-5, no biases, untied output
#            layer, vocab 128256 = 8,030,261,248 parameters (the public count); seq 8192.
# Training : bf16, full activation recompute, micro-batch 1 x 8 accumulation steps = global batch 8
#            (accumulation keeps the gradients on the GPU, in fp32 as bf16 gradients are reduced
#            in fp32 by default: +29.92 GiB, which fits here).
# Attention: --use-flash-attn (torch SDPA, causal: FlashAttention on the H100, no s x s scores),
#            as Megatron-LM's Llama-3 scripts (examples/llama/train_llama3_8b_h100_fp8.sh:
#            --attention-backend fused). TP = 1: no --sequence-parallel (Megatron-LM turns it off).
# Planner  : python tools/estimate_memory.py --preset h100-80gb --gpus-per-node 1 \
#                --host-memory-gb 192 --tensor-model-parallel-size 1 --num-layers 32 \
#                --hidden-size 4096 --num-attention-heads 32 --group-query-attention \
#                --num-query-groups 8 --ffn-hidden-size 14336 --swiglu \
#                --position-embedding-type rope --rotary-base 500000 --normalization RMSNorm \
#                --norm-epsilon 1e-5 --disable-bias-linear --untie-embeddings-and-output-weights \
#                --seq-length 8192 --max-position-embeddings 8192 \
#                --make-vocab-size-divisible-by 128 --vocab-size 128256 --micro-batch-size 1 \
#                --global-batch-size 8 --train-iters 20000 --lr 3.0e-4 --min-lr 3.0e-5 \
#                --lr-decay-style cosine --lr-warmup-iters 2000 --lr-decay-iters 20000 \
#                --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --adam-eps 1e-8 \
#                --clip-grad 1.0 --bf16 --recompute-granularity full --use-flash-attn \
#                --zero-offload --seed 1234 --save checkpoints/llama3-8b \
#                --load checkpoints/llama3-8b --save-interval 1000 --eval-interval 1000 \
#                --eval-iters 10 --log-interval 1 --log-jsonl checkpoints/llama3-8b/train.jsonl
#            (this script's own pretrain_gpt.py flags, with 192 GiB of host RAM; --vocab-size
#            128256 stands for --tokenizer-type HuggingFaceTokenizer --tokenizer-model
#            "$TOKENIZER_MODEL": the Llama-3 tokenizer's size, which the job reads from it)
#   device per GPU : 60.75 GiB of 79.10 GiB  (params 14.96, grad buckets 0.30 + 3.62 because the
#                    buckets that hold the 525M-element embedding and untied output layer are
#                    fp32 and double-buffered + 1.96 fp32->bf16 narrowing scratch, gradients kept
#                    across micro-batches 29.92 (fp32, as the buckets), layer inputs 2.00, peak on
#                    top 6.18 = the logits phase: bf16 logits 1.96 + their fp32 copy in the
#                    cross-entropy 3.91 + final-norm/output-layer inputs 0.31 (the backward of one
#                    recomputed layer is smaller), fragmentation 0.82, CUDA context 1.00); without
#                    --use-flash-attn 69.94 GiB (one recomputed layer, 13.98 GiB, dominated by its
#                    32 x 8192^2 attention scores in fp32 + bf16)
#   host per node  : 183.44 GiB of 192 GiB (fp32 master + Adam m + v 89.8, 16-bit staging 15.0,
#                    the CPU-step overlap's rollback state 56.5, 3 GiB process, 19.2 GiB OS reserve
#                    (the job's: a tenth of the RAM)). --overlap-cpu-step auto (the default on a
#                    GPU) speculates 54% of the partition, what the host memory left free holds
#                    with the planner's 5% margin kept;
#                    all of it would take 104.70 GiB (the job refuses --overlap-cpu-step full
#                    here). --no-overlap-cpu-step: 126.90 GiB.
#   The same run WITHOUT --zero-offload needs 129.66 GiB on the GPU.
# Data     : DATA_PATH = prefix of a dataset preprocessed with the same tokenizer
#            (tools/preprocess_data.py --tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR);
#            TOKENIZER_MODEL = a local directory with tokenizer.json + tokenizer_config.json.
set -euo pipefail
cd "${ZO_ROOT:-$(dirname "$0")/..}"

: "${TOKENIZER_MODEL:?set TOKENIZER_MODEL to the Llama-3 tokenizer directory}"
DATA_ARGS=()
[[ -n "${DATA_PATH:-}" ]] && DATA_ARGS+=(--data-path "$DATA_PATH" --split 949,50,1)
CKPT_DIR="${CKPT_DIR:-checkpoints/llama3-8b}"

exec torchrun --standalone --nproc-per-node 1 pretrain/pretrain_gpt.py \
    --tensor-model-parallel-size 1 \
    --num-layers 32 --hidden-size 4096 --num-attention-heads 32 \
    --group-query-attention --num-query-groups 8 \
    --ffn-hidden-size 14336 --swiglu \
    --position-embedding-type rope --rotary-base 500000 \
    --normalization RMSNorm --norm-epsilon 1e-5 \
    --disable-bias-linear --untie-embeddings-and-output-weights \
    --seq-length 8192 --max-position-embeddings 8192 --make-vocab-size-divisible-by 128 \
    --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$TOKENIZER_MODEL" \
    --micro-batch-size 1 --global-batch-size 8 \
    --train-iters 20000 --lr 3.0e-4 --min-lr 3.0e-5 --lr-decay-style cosine \
    --lr-warmup-iters 2000 --lr-decay-iters 20000 --weight-decay 0.1 \
    --adam-beta1 0.9 --adam-beta2 0.95 --adam-eps 1e-8 --clip-grad 1.0 \
    --bf16 \
    --recompute-granularity full \
    --use-flash-attn \
    --zero-offload \
    --seed 1234 \
    ${DATA_ARGS[@]+"${DATA_ARGS[@]}"} \
    --save "$CKPT_DIR" --load "$CKPT_DIR" --save-interval 1000 \
    --eval-interval 1000 --eval-iters 10 --log-interval 1 \
    --log-jsonl "$CKPT_DIR/train.jsonl" \
    "$@"
