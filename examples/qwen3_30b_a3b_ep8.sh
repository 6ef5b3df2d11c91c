#!/usr/bin/env bash
# Qwen3-30B-A3B on ONE 8-GPU node: expert parallel 8 x data parallel 8, ZeRO-Offload to the host.
#
# Hardware : 1 node of 8x H100-80GB (or A100-80GB), 2 TiB host RAM.
# Layout   : TP 1; EP 8 = 16 of the 128 experts of every layer per GPU, the 8 GPUs are also DP 8 for
#            the dense parameters (attention, norms, routers, embeddings): expert DP = 8 / 8 = 1. Two
#            engines (offload/expert_parallel.py): the dense parameters partitioned over DP 8, each
#            GPU's experts over its expert-DP group of 1, each with its own buckets and host
#            partition; one gradient norm. At EP 1 every GPU would hold all 128 experts: 179.26 GiB
#            per GPU (does not fit).
# Model    : Qwen3-30B-A3B (its Hugging Face config.json): 48 layers x 2048 hidden x 32 heads of
#            head_dim 128 (--kv-channels 128: heads x head_dim = 4096, not the hidden size), 4 KV
#            heads (GQA), q/k RMSNorm (--qk-layernorm), 128 experts of SwiGLU ffn 768 per layer, top-8
#            routing with norm_topk_prob true (megatron-core's default softmax over the chosen
#            logits), RoPE theta 1e6, RMSNorm eps 1e-6, no biases, untied output layer, vocab 151936
#            (the checkpoint's rows; its tokenizer has fewer ids, so --vocab-size 151936) = 30.53B
#            parameters (30,532,122,624), 3.35B active per token; seq 4096 (its context is 40960).
# Training : bf16, full activation recompute, micro-batch 1 x 16 accumulation steps x DP 8 = global
#            batch 128, aux loss 1e-3 (Qwen3-MoE's router_aux_loss_coef; megatron-core's aux loss is
#            per layer, docs/moe.md), alltoall dispatcher. The CPU step overlaps backward in both
#            engines (--overlap-cpu-step auto, the default on a GPU: here all of each engine's host
#            partition is speculated, see the host line).
# Attention: --use-flash-attn (torch SDPA, causal: FlashAttention on the H100, no s x s scores).
# Planner  : python tools/estimate_memory.py --preset h100-80gb --world-size 8 --host-memory-gb \
#                2048 --tensor-model-parallel-size 1 --num-layers 48 --hidden-size 2048 \
#                --num-attention-heads 32 --kv-channels 128 --group-query-attention \
#                --num-query-groups 4 --qk-layernorm --ffn-hidden-size 6144 --swiglu \
#                --position-embedding-type rope --rotary-base 1000000 --normalization RMSNorm \
#                --norm-epsilon 1e-6 --disable-bias-linear --untie-embeddings-and-output-weights \
#                --num-experts 128 --moe-router-topk 8 --moe-ffn-hidden-size 768 \
#                --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-3 \
#                --moe-token-dispatcher-type alltoall --expert-model-parallel-size 8 --seq-length \
#                4096 --max-position-embeddings 40960 --make-vocab-size-divisible-by 128 --vocab-size \
#                151936 --micro-batch-size 1 --global-batch-size 128 --train-iters 20000 --lr 1.0e-4 \
#                --min-lr 1.0e-5 --lr-decay-style cosine --lr-warmup-iters 500 --lr-decay-iters 20000 \
#                --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --adam-eps 1e-8 --clip-grad \
#                1.0 --bf16 --recompute-granularity full --use-flash-attn --zero-offload --seed 1234 \
#                --save checkpoints/qwen3-30b-a3b --load checkpoints/qwen3-30b-a3b --save-interval \
#                500 --eval-interval 500 --eval-iters 10 --log-interval 1 --log-jsonl \
#                checkpoints/qwen3-30b-a3b/train.jsonl
#            (this script's own pretrain_gpt.py flags on the node's 8 ranks; the tokenizer flags
#            --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$TOKENIZER_MODEL" left out:
#            --vocab-size 151936 sets the model's vocabulary either way)
#   params         : 5.16B per GPU: 3.62B of its 16 experts per layer + 1.54B dense
#   device per GPU : 37.75 GiB of 79.10 GiB  (16-bit params 2.87 dense + 6.75 expert, the two
#                    engines' fp32 gradient buckets and scratch 2.68 + 0.48 (a bucket holds its
#                    largest parameter whole: the 311M-element output layer), gradients kept across
#                    micro-batches in fp32 5.74 + 13.50, layer inputs 0.75, peak on top 3.56 = the
#                    logits phase: bf16 logits 1.16 + their fp32 copy in the cross-entropy 2.32 +
#                    final-norm/output-layer inputs 0.08 (one recomputed layer's backward with the
#                    alltoall's buffers is 1.32), fragmentation 0.43, CUDA context 1.00)
#   host per node  : 852.19 GiB of 2,048 GiB (the experts' fp32 master + Adam m + v 324.0 and
#                    16-bit staging 54.0, the dense ones' 17.2 + 2.9, the CPU-step overlap's rollback
#                    state 378.0 experts + 20.1 dense, 8 processes x 3 GiB, 32 GiB OS reserve).
#                    --overlap-cpu-step auto (the default on a GPU) speculates all of each engine's
#                    host partition: the whole of it takes 49.76 GiB/rank, which the memory the plan
#                    leaves free holds. --no-overlap-cpu-step: 454.09 GiB.
# Data     : DATA_PATH = prefix of a dataset preprocessed with the same tokenizer
#            (tools/preprocess_data.py --tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR);
#            TOKENIZER_MODEL = a local directory with tokenizer.json + tokenizer_config.json.
set -euo pipefail
cd "${ZO_ROOT:-$(dirname "$0")/..}"

: "${TOKENIZER_MODEL:?set TOKENIZER_MODEL to the Qwen3 tokenizer directory}"
DATA_ARGS=()
[[ -n "${DATA_PATH:-}" ]] && DATA_ARGS+=(--data-path "$DATA_PATH" --split 949,50,1)
CKPT_DIR="${CKPT_DIR:-checkpoints/qwen3-30b-a3b}"

exec torchrun --standalone --nproc-per-node 8 pretrain/pretrain_gpt.py \
    --tensor-model-parallel-size 1 \
    --num-layers 48 --hidden-size 2048 --num-attention-heads 32 --kv-channels 128 \
    --group-query-attention --num-query-groups 4 --qk-layernorm \
    --ffn-hidden-size 6144 --swiglu \
    --position-embedding-type rope --rotary-base 1000000 \
    --normalization RMSNorm --norm-epsilon 1e-6 \
    --disable-bias-linear --untie-embeddings-and-output-weights \
    --num-experts 128 --moe-router-topk 8 --moe-ffn-hidden-size 768 \
    --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-3 \
    --moe-token-dispatcher-type alltoall --moe-grouped-gemm \
    --expert-model-parallel-size 8 \
    --seq-length 4096 --max-position-embeddings 40960 --make-vocab-size-divisible-by 128 \
    --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$TOKENIZER_MODEL" --vocab-size 151936 \
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
