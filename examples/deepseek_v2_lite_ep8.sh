#!/usr/bin/env bash
# DeepSeek-V2-Lite on ONE 8-GPU node: multi-latent attention + DeepSeekMoE, expert parallel 8 x data
# parallel 8, ZeRO-Offload to the host. Megatron-LM's DeepSeek-V2-Lite flags, plus --zero-offload.
#
# Hardware : 1 node of 8x H100-80GB (or A100-80GB), 1 TiB host RAM.
# Layout   : TP 1; EP 8 = 8 of the 64 routed experts of every MoE layer per GPU, the 8 GPUs are also DP 8
#            for the dense parameters (attention, norms, routers, shared experts, the first layer's MLP,
#            embeddings): expert DP = 8 / 8 = 1. Two engines (offload/expert_parallel.py), one gradient
#            norm.
# Model    : DeepSeek-V2-Lite (its Hugging Face config.json; tools/convert_checkpoint.py from-hf converts
#            it, docs/checkpoints.md): 27 layers x 2048 hidden x 16 heads of multi-latent attention
#            (queries projected directly, a 512-channel key/value latent with its RMSNorm, per head 128
#            query/key channels + 64 rotated ones, 128 value channels; YaRN x40 of 4096 with mscale and
#            mscale-all-dim 0.707, which also scales the softmax), the first layer dense (SwiGLU ffn
#            10944), the other 26 DeepSeekMoE (64 routed experts of SwiGLU ffn 1408, top 6 by a softmax
#            over all 64, not renormalised = --moe-router-pre-softmax, + 2 shared experts = one of 2816),
#            RMSNorm eps 1e-6, no biases, untied output layer, vocab 102400 = 15.71B parameters, 2.66B
#            active per token; seq 4096 (its context is 163840).
# Training : bf16, full activation recompute, micro-batch 1 x 16 accumulation steps x DP 8 = global
#            batch 128, the sequence-wise aux loss 1e-3 (its seq_aux, aux_loss_alpha), alltoall
#            dispatcher. The CPU step overlaps backward in both engines (--overlap-cpu-step auto, the
#            default on a GPU: all of each engine's host partition is speculated, see the host line).
# Attention: torch SDPA (MLA's query/key and value head dims differ: the memory-efficient kernel on
#            the H100, no s x s scores); --use-flash-attn says so (MLA takes SDPA without it too).
# Planner  : python tools/estimate_memory.py --preset h100-80gb --world-size 8 --host-memory-gb 1024 \
#                --tensor-model-parallel-size 1 --num-layers 27 --hidden-size 2048 --num-attention-heads \
#                16 --multi-latent-attention --kv-lora-rank 512 --qk-head-dim 128 --qk-pos-emb-head-dim \
#                64 --v-head-dim 128 --qk-layernorm --position-embedding-type rope --rotary-base 10000 \
#                --rotary-scaling-factor 40 --mscale 0.707 --mscale-all-dim 0.707 --ffn-hidden-size 10944 \
#                --swiglu --normalization RMSNorm --norm-epsilon 1e-6 --disable-bias-linear \
#                --untie-embeddings-and-output-weights --num-experts 64 --moe-router-topk 6 \
#                --moe-ffn-hidden-size 1408 --moe-shared-expert-intermediate-size 2816 --moe-layer-freq \
#                '[0]*1+[1]*26' --moe-router-pre-softmax --moe-router-load-balancing-type seq_aux_loss \
#                --moe-aux-loss-coeff 1e-3 --moe-token-dispatcher-type alltoall \
#                --expert-model-parallel-size 8 --seq-length 4096 --max-position-embeddings 163840 \
#                --make-vocab-size-divisible-by 128 --vocab-size 102400 --micro-batch-size 1 \
#                --global-batch-size 128 --train-iters 20000 --lr 4.2e-4 --min-lr 4.2e-5 --lr-decay-style \
#                cosine --lr-warmup-iters 2000 --lr-decay-iters 20000 --weight-decay 0.1 --adam-beta1 0.9 \
#                --adam-beta2 0.95 --adam-eps 1e-8 --clip-grad 1.0 --bf16 --recompute-granularity full \
#                --use-flash-attn --zero-offload --seed 1234 --save checkpoints/deepseek-v2-lite --load \
#                checkpoints/deepseek-v2-lite --save-interval 500 --eval-interval 500 --eval-iters 10 \
#                --log-interval 1 --log-jsonl checkpoints/deepseek-v2-lite/train.jsonl
#            (this script's own pretrain_gpt.py flags on the node's 8 ranks; the tokenizer flags
#            --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$TOKENIZER_MODEL" left out:
#            --vocab-size 102400 sets the model's vocabulary either way)
#   params         : 3.11B per GPU: 1.80B of its 8 experts per MoE layer + 1.31B dense
#   device per GPU : 23.91 GiB of 79.10 GiB  (16-bit params 2.44 dense + 3.35 expert, gradients kept
#                    across micro-batches in fp32 4.89 + 6.70, the fp32 logits of the cross-entropy
#                    1.56, CUDA context 1.00, ...: tools/estimate_memory.py itemises it)
#   host per node  : 465.58 GiB of 1,024 GiB (the experts' fp32 master + Adam m + v 160.9 and 16-bit
#                    staging 26.8, the dense ones' 14.7 + 2.4, the CPU-step overlap's rollback state
#                    187.7 experts + 17.1 dense, 8 processes x 3 GiB, 32 GiB OS reserve).
# Data     : DATA_PATH = prefix of a dataset preprocessed with the same tokenizer
#            (tools/preprocess_data.py --tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR);
#            TOKENIZER_MODEL = a local directory with tokenizer.json + tokenizer_config.json.
set -euo pipefail
cd "${ZO_ROOT:-$(dirname "$0")/..}"

: "${TOKENIZER_MODEL:?set TOKENIZER_MODEL to the DeepSeek-V2-Lite tokenizer directory}"
DATA_ARGS=()
[[ -n "${DATA_PATH:-}" ]] && DATA_ARGS+=(--data-path "$DATA_PATH" --split 949,50,1)
CKPT_DIR="${CKPT_DIR:-checkpoints/deepseek-v2-lite}"

exec torchrun --standalone --nproc-per-node 8 pretrain/pretrain_gpt.py \
    --tensor-model-parallel-size 1 \
    --num-layers 27 --hidden-size 2048 --num-attention-heads 16 \
    --multi-latent-attention --kv-lora-rank 512 --qk-head-dim 128 --qk-pos-emb-head-dim 64 --v-head-dim 128 \
    --qk-layernorm \
    --position-embedding-type rope --rotary-base 10000 \
    --rotary-scaling-factor 40 --mscale 0.707 --mscale-all-dim 0.707 \
    --ffn-hidden-size 10944 --swiglu \
    --normalization RMSNorm --norm-epsilon 1e-6 \
    --disable-bias-linear --untie-embeddings-and-output-weights \
    --num-experts 64 --moe-router-topk 6 --moe-ffn-hidden-size 1408 \
    --moe-shared-expert-intermediate-size 2816 --moe-layer-freq '[0]*1+[1]*26' \
    --moe-router-pre-softmax \
    --moe-router-load-balancing-type seq_aux_loss --moe-aux-loss-coeff 1e-3 \
    --moe-token-dispatcher-type alltoall --moe-grouped-gemm \
    --expert-model-parallel-size 8 \
    --seq-length 4096 --max-position-embeddings 163840 --make-vocab-size-divisible-by 128 \
    --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$TOKENIZER_MODEL" --vocab-size 102400 \
    --micro-batch-size 1 --global-batch-size 128 \
    --train-iters 20000 --lr 4.2e-4 --min-lr 4.2e-5 --lr-decay-style cosine \
    --lr-warmup-iters 2000 --lr-decay-iters 20000 --weight-decay 0.1 \
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
