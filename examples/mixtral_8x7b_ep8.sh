#!/usr/bin/env bash
# Mixtral-8x7B on ONE 8-GPU node: expert parallel 8 x data parallel 8, ZeRO-Offload to the host.
#
# Hardware : 1 node of 8x H100-80GB (or A100-80GB), 2 TiB host RAM.
# Layout   : TP 1; EP 8 = one of the 8 experts of every layer per GPU, the 8 GPUs are also DP 8 for
#            the dense parameters (attention, norms, routers, embeddings): expert DP = 8 / 8 = 1. Two
#            engines (offload/expert_parallel.py): the dense parameters partitioned over DP 8, each
#            GPU's expert over its expert-DP group of 1, each with its own buckets and host
#            partition; one gradient norm. At EP 1 every GPU would hold all 8 experts: 267.01 GiB
#            per GPU (does not fit).
# Model    : Mixtral-8x7B (its Hugging Face config.json): 32 layers x 4096 hidden x 32 heads, 8 KV
#            heads (GQA), 8 experts of SwiGLU ffn 14336 per layer, top-2 routing (softmax over the
#            two chosen logits: Mixtral's renormalised top-2), RoPE theta 1e6, RMSNorm eps 1e-5, no
#            biases, untied output layer, vocab 32000 = 46.70B parameters (46,702,792,704), 12.88B
#            active per token; seq 4096 (its context is 32768).
# Training : bf16, full activation recompute, micro-batch 1 x 16 accumulation steps x DP 8 = global
#            batch 128, aux loss 1e-2, alltoall dispatcher, --moe-grouped-gemm (Megatron-LM's Mixtral
#            recipe; accepted as a no-op: the experts run one after another, the same function).
#            The CPU step overlaps backward in both engines (--overlap-cpu-step auto, the default on
#            a GPU: here all of each engine's host partition is speculated, see the host line).
# Attention: --use-flash-attn (torch SDPA, causal: FlashAttention on the H100, no s x s scores).
# Planner  : python tools/estimate_memory.py --preset h100-80gb --world-size 8 --host-memory-gb \
#                2048 --tensor-model-parallel-size 1 --num-layers 32 --hidden-size 4096 \
#                --num-attention-heads 32 --group-query-attention --num-query-groups 8 \
#                --ffn-hidden-size 14336 --swiglu --position-embedding-type rope --rotary-base \
#                1000000 --normalization RMSNorm --norm-epsilon 1e-5 --disable-bias-linear \
#                --untie-embeddings-and-output-weights --num-experts 8 --moe-router-topk 2 \
#                --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-2 \
#                --moe-token-dispatcher-type alltoall --expert-model-parallel-size 8 --seq-length \
#                4096 --max-position-embeddings 32768 --make-vocab-size-divisible-by 128 --vocab-size \
#                32000 --micro-batch-size 1 --global-batch-size 128 --train-iters 20000 --lr 1.0e-4 \
#                --min-lr 1.0e-5 --lr-decay-style cosine --lr-warmup-iters 500 --lr-decay-iters 20000 \
#                --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --adam-eps 1e-8 --clip-grad \
#                1.0 --bf16 --recompute-granularity full --use-flash-attn --zero-offload --seed 1234 \
#                --save checkpoints/mixtral-8x7b --load checkpoints/mixtral-8x7b --save-interval 500 \
#                --eval-interval 500 --eval-iters 10 --log-interval 1 --log-jsonl \
#                checkpoints/mixtral-8x7b/train.jsonl
#            (this script's own pretrain_gpt.py flags on the node's 8 ranks; --vocab-size 32000
#            stands for --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$TOKENIZER_MODEL",
#            the Mixtral tokenizer's size, which the job reads from it)
#   params         : 7.24B per GPU: 5.64B of its expert (1 of 8 per layer) + 1.61B dense
#   device per GPU : 47.82 GiB of 79.10 GiB  (16-bit params 2.99 dense + 10.50 expert, gradient
#                    buckets 1.98 over both engines (each holds its largest parameter whole: the
#                    embedding / output layer, an expert's fc1), gradients kept across micro-batches
#                    in fp32 5.98 + 21.00, layer inputs 1.00, one recomputed layer's backward 2.37 +
#                    the alltoall's buffers 0.12, fragmentation 0.35, CUDA context 1.00)
#   host per node  : 1,273.87 GiB of 2,048 GiB (the experts' fp32 master + Adam m + v 504.0 and
#                    16-bit staging 84.0, the dense ones' 17.9 + 3.0, the CPU-step overlap's rollback
#                    state 588.0 experts + 20.9 dense, 8 processes x 3 GiB, 32 GiB OS reserve).
#                    --overlap-cpu-step auto (the default on a GPU) speculates all of each engine's
#                    host partition: the whole of it takes 76.12 GiB/rank, which the memory the plan
#                    leaves free holds. --no-overlap-cpu-step: 664.94 GiB.
# Data     : DATA_PATH = prefix of a dataset preprocessed with the same tokenizer
#            (tools/preprocess_data.py --tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR);
#            TOKENIZER_MODEL = a local directory with tokenizer.json + tokenizer_config.json.
set -euo pipefail
cd "${ZO_ROOT:-$(dirname "$0")/..}"

: "${TOKENIZER_MODEL:?set TOKENIZER_MODEL to the Mixtral tokenizer directory}"
DATA_ARGS=()
[[ -n "${DATA_PATH:-}" ]] && DATA_ARGS+=(--data-path "$DATA_PATH" --split 949,50,1)
CKPT_DIR="${CKPT_DIR:-checkpoints/mixtral-8x7b}"

exec torchrun --standalone --nproc-per-node 8 pretrain/pretrain_gpt.py \
    --tensor-model-parallel-size 1 \
    --num-layers 32 --hidden-size 4096 --num-attention-heads 32 \
    --group-query-attention --num-query-groups 8 \
    --ffn-hidden-size 14336 --swiglu \
    --position-embedding-type rope --rotary-base 1000000 \
    --normalization RMSNorm --norm-epsilon 1e-5 \
    --disable-bias-linear --untie-embeddings-and-output-weights \
    --num-experts 8 --moe-router-topk 2 \
    --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-2 \
    --moe-token-dispatcher-type alltoall --moe-grouped-gemm \
    --expert-model-parallel-size 8 \
    --seq-length 4096 --max-position-embeddings 32768 --make-vocab-size-divisible-by 128 \
    --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$TOKENIZER_MODEL" \
    --micro-batch-size 1 --global-batch-size 128 \
    --train-iters 20000 --lr 1.0e-4 --min-lr 1.0e-5 --lr-decay-style cosine \
    --lr-warmup-iters 500 --lr-decay-iters 20000 --weight-decay 0.1 \
    --adam-beta1 0.9 --adam-beta2 0.95 --adam-eps 1e-8 --clip-grad 1.0 \
    --bf16 \
    --recompute-granularity full \
    --use-flash-attn \
    --zero-offload \
    --seed 1234 \
    ${DATA_ARGS[@]+"${DATA_ARGS[@]}"} \
    --save "$CKPT_DIR" --load "$CKPT_DIR" --save-interval 500 \
    --eval-interval 500 --eval-iters 10 --log-interval 1 \
    --log-jsonl "$CKPT_DIR/train.jsonl" \
    "$@"
