#!/usr/bin/env bash
# GPT-OSS-120B fine-tuned on ONE 8-GPU node: expert parallel 8 x data parallel 8, ZeRO-Offload to the host.
# Every one of its 116.8B parameters is trained (no adapter, nothing frozen).
#
# Hardware : 1 node of 8x H100-80GB (or A100-80GB), 2 TiB host RAM.
# Layout   : TP 1; EP 8 = 16 of the 128 experts of every layer per GPU, the 8 GPUs are also DP 8 for
#            the dense parameters (attention, sinks, norms, routers, embeddings): expert DP 1. Two engines
#            (offload/expert_parallel.py), one gradient norm.
# Model    : OpenAI's gpt-oss-120b (its Hugging Face config.json; docs/models.md, "GPT-OSS"): 36 layers x
#            2880 hidden x 64 heads of head_dim 64, 8 KV heads (GQA), q/k/v/o biases, attention sinks
#            (--softmax-type learnable), a 128-token sliding window on every other layer (--window-size
#            127,0 --window-attn-skip-freq 2), YaRN x32 of 4096 (truncate false), RoPE theta 150000,
#            RMSNorm eps 1e-5, untied output layer, vocab 201088; every layer MoE: 128 experts of ffn
#            2880, top 4, the clamped quick GeGLU, router and experts with biases = 116.83B parameters
#            (116,829,156,672: transformers' count), 5.71B active per token; seq 4096.
# Start    : python tools/convert_checkpoint.py from-hf --input DIR_OF_GPT_OSS_120B --output
#            ckpt/gpt-oss-120b-hf (OpenAI's MXFP4 expert files are read as they are), then
#            PRETRAINED_CHECKPOINT=ckpt/gpt-oss-120b-hf: the first launch fine-tunes those weights
#            (--pretrained-checkpoint), a relaunch resumes $CKPT_DIR. Without it: random weights.
# Training : bf16, full activation recompute, micro-batch 2 x DP 8 = global batch 16 (64K tokens), no
#            accumulation (micro-batch 1 with accumulation keeps the experts' fp32 gradients on the GPUs:
#            104.48 GiB each, does not fit; with --accumulate-grads-on-host on the host instead: 2,014.50
#            GiB of the 2,048, inside the planner's 5% margin), lr 1e-5 cosine, alltoall
#            dispatcher, --moe-router-dtype fp32 as Megatron-LM's GPT-OSS line. The CPU step overlaps
#            backward in both engines (--overlap-cpu-step auto, the default on a GPU).
# Attention: --use-flash-attn (torch SDPA; the window and the sinks need it).
# Planner  : python tools/estimate_memory.py --preset h100-80gb --world-size 8 --host-memory-gb 2048 \
#                --tensor-model-parallel-size 1 --num-layers 36 --hidden-size 2880 --num-attention-heads \
#                64 --group-query-attention --num-query-groups 8 --kv-channels 64 --ffn-hidden-size 2880 \
#                --normalization RMSNorm --norm-epsilon 1e-5 --untie-embeddings-and-output-weights \
#                --position-embedding-type yarn --rotary-base 150000 --rotary-scaling-factor 32 \
#                --yarn-original-max-position-embeddings 4096 --no-yarn-correction-range-round-to-int \
#                --window-size 127,0 --window-attn-skip-freq 2 --softmax-type learnable --num-experts \
#                128 --moe-router-topk 4 --moe-ffn-hidden-size 2880 --quick-geglu --glu-linear-offset \
#                1.0 --activation-func-clamp-value 7.0 --moe-router-dtype fp32 \
#                --moe-token-dispatcher-type alltoall --expert-model-parallel-size 8 --seq-length 4096 \
#                --max-position-embeddings 131072 --make-vocab-size-divisible-by 128 --vocab-size 201088 \
#                --micro-batch-size 2 --global-batch-size 16 --train-iters 2000 --lr 1.0e-5 --min-lr \
#                1.0e-6 --lr-decay-style cosine --lr-warmup-iters 50 --lr-decay-iters 2000 \
#                --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --adam-eps 1e-8 --clip-grad 1.0 \
#                --bf16 --recompute-granularity full --use-flash-attn --zero-offload --seed 1234 --save \
#                checkpoints/gpt-oss-120b --load checkpoints/gpt-oss-120b --save-interval 200 \
#                --eval-interval 200 --eval-iters 10 --log-interval 1 --log-jsonl \
#                checkpoints/gpt-oss-120b/train.jsonl
#            (this script's own pretrain_gpt.py flags on the node's 8 ranks; the tokenizer flags
#            --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$TOKENIZER_MODEL" left out:
#            --vocab-size 201088 sets the model's vocabulary either way)
#   params         : 16.47B per GPU: 14.34B of its 16 experts per layer + 2.13B dense
#   device per GPU : 49.19 GiB of 79.10 GiB  (16-bit params 3.96 dense + 26.71 expert, the two
#                    engines' fp32 gradient buckets and scratch 4.83 + 0.56 (a bucket holds its largest
#                    parameter whole: the 579M-element output layer), activations 11.05 net (layer
#                    inputs 1.58; the logits phase: bf16 logits 3.07 + their fp32 copy in the
#                    cross-entropy 6.14), fragmentation 1.10, CUDA context 1.00)
#   host per node  : 1,944.87 GiB of 2,048 GiB (the experts' fp32 master + Adam m + v 1,281.9 and
#                    16-bit staging 213.7, the dense ones' 23.8 + 4.0, the CPU-step overlap's rollback
#                    state 358.9 experts + 6.7 dense, 8 processes x 3 GiB, 32 GiB OS reserve).
#                    --overlap-cpu-step auto (the default on a GPU) speculates 24% of each engine's
#                    partition, what the host memory left free holds with the planner's 5% margin kept;
#                    all of it would take 190.41 GiB/rank. --no-overlap-cpu-step: 1,579.28 GiB.
# Data     : DATA_PATH = prefix of a dataset preprocessed with the same tokenizer
#            (tools/preprocess_data.py --tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR), or
#            conversations: add --sft --sft-tokenizer-prompt-format chat-template --data-path FILE.jsonl
#            (docs/data.md); TOKENIZER_MODEL = a local directory with tokenizer.json + tokenizer_config.json.
set -euo pipefail
cd "${ZO_ROOT:-$(dirname "$0")/..}"

: "${TOKENIZER_MODEL:?set TOKENIZER_MODEL to the gpt-oss tokenizer directory}"
DATA_ARGS=()
[[ -n "${DATA_PATH:-}" ]] && DATA_ARGS+=(--data-path "$DATA_PATH" --split 949,50,1)
[[ -n "${PRETRAINED_CHECKPOINT:-}" ]] && DATA_ARGS+=(--pretrained-checkpoint "$PRETRAINED_CHECKPOINT")
CKPT_DIR="${CKPT_DIR:-checkpoints/gpt-oss-120b}"

exec torchrun --standalone --nproc-per-node 8 pretrain/pretrain_gpt.py \
    --tensor-model-parallel-size 1 \
    --num-layers 36 --hidden-size 2880 --num-attention-heads 64 \
    --group-query-attention --num-query-groups 8 --kv-channels 64 \
    --ffn-hidden-size 2880 \
    --normalization RMSNorm --norm-epsilon 1e-5 \
    --untie-embeddings-and-output-weights \
    --position-embedding-type yarn --rotary-base 150000 --rotary-scaling-factor 32 \
    --yarn-original-max-position-embeddings 4096 --no-yarn-correction-range-round-to-int \
    --window-size 127,0 --window-attn-skip-freq 2 \
    --softmax-type learnable \
    --num-experts 128 --moe-router-topk 4 --moe-ffn-hidden-size 2880 \
    --quick-geglu --glu-linear-offset 1.0 --activation-func-clamp-value 7.0 \
    --moe-router-dtype fp32 --moe-token-dispatcher-type alltoall \
    --expert-model-parallel-size 8 \
    --seq-length 4096 --max-position-embeddings 131072 --make-vocab-size-divisible-by 128 \
    --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$TOKENIZER_MODEL" --vocab-size 201088 \
    --micro-batch-size 2 --global-batch-size 16 \
    --train-iters 2000 --lr 1.0e-5 --min-lr 1.0e-6 --lr-decay-style cosine \
    --lr-warmup-iters 50 --lr-decay-iters 2000 --weight-decay 0.1 \
    --adam-beta1 0.9 --adam-beta2 0.95 --adam-eps 1e-8 --clip-grad 1.0 \
    --bf16 \
    --recompute-granularity full \
    --use-flash-attn \
    --zero-offload \
    --seed 1234 \
    ${DATA_ARGS[@]+"${DATA_ARGS[@]}"} \
    --save "$CKPT_DIR" --load "$CKPT_DIR" --save-interval 200 \
    --eval-interval 200 --eval-iters 10 --log-interval 1 \
    --log-jsonl "$CKPT_DIR/train.jsonl" \
    "$@"
