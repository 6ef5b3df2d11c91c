#!/usr/bin/env bash
# GPT-OSS-20B fine-tuned on ONE 80 GB GPU with ZeRO-Offload: all 20.9B parameters trained, none frozen.
#
# Hardware : 1x H100-80GB (or A100-80GB) and >= 512 GiB host RAM.
# Model    : OpenAI's gpt-oss-20b (its Hugging Face config.json; docs/models.md, "GPT-OSS"): 24 layers x
#            2880 hidden x 64 heads of head_dim 64 (--kv-channels 64), 8 KV heads (GQA), q/k/v/o biases,
#            attention sinks (--softmax-type learnable), a 128-token sliding window on every other layer
#            (--window-size 127,0 --window-attn-skip-freq 2), YaRN x32 of 4096 (truncate false), RoPE
#            theta 150000, RMSNorm eps 1e-5, untied output layer, vocab 201088; every layer MoE: 32
#            experts of ffn 2880, top 4, the clamped quick GeGLU (--quick-geglu --glu-linear-offset 1.0
#            --activation-func-clamp-value 7.0), router and experts with biases = 20.91B parameters
#            (20,914,757,184: transformers' count), 4.19B active per token; seq 4096.
# Start    : python tools/convert_checkpoint.py from-hf --input DIR_OF_GPT_OSS_20B --output ckpt/gpt-oss-20b-hf
#            (OpenAI's MXFP4 expert files are read as they are), then PRETRAINED_CHECKPOINT=ckpt/gpt-oss-20b-hf:
#            the first launch fine-tunes those weights (--pretrained-checkpoint), a relaunch resumes
#            $CKPT_DIR. Without it the model starts from random weights.
# Training : bf16, full activation recompute, micro-batch 1 x 16 accumulation steps = global batch 16
#            (64K tokens), lr 1e-5 cosine. --accumulate-grads-on-host: the micro-batches' gradients
#            are summed on the host in fp32 (+77.9 GiB there), not kept on the GPU (+77.9 GiB there:
#            130.14 GiB per GPU, which does not fit). --moe-router-dtype fp32 as Megatron-LM's GPT-OSS
#            line (examples/post_training/modelopt/conf/openai/gpt-oss-20b.sh).
# Attention: --use-flash-attn (torch SDPA; the window and the sinks need it: the sinks through an extra
#            head-dim channel and a sink key, docs/models.md). TP = 1, EP 1: all 32 experts on the GPU.
# Planner  : python tools/estimate_memory.py --preset h100-80gb --gpus-per-node 1 \
#                --host-memory-gb 512 --tensor-model-parallel-size 1 --num-layers 24 \
#                --hidden-size 2880 --num-attention-heads 64 --group-query-attention \
#                --num-query-groups 8 --kv-channels 64 --ffn-hidden-size 2880 --normalization RMSNorm \
#                --norm-epsilon 1e-5 --untie-embeddings-and-output-weights --position-embedding-type \
#                yarn --rotary-base 150000 --rotary-scaling-factor 32 \
#                --yarn-original-max-position-embeddings 4096 --no-yarn-correction-range-round-to-int \
#                --window-size 127,0 --window-attn-skip-freq 2 --softmax-type learnable --num-experts 32 \
#                --moe-router-topk 4 --moe-ffn-hidden-size 2880 --quick-geglu --glu-linear-offset 1.0 \
#                --activation-func-clamp-value 7.0 --moe-router-dtype fp32 --seq-length 4096 \
#                --max-position-embeddings 131072 --make-vocab-size-divisible-by 128 --vocab-size 201088 \
#                --micro-batch-size 1 --global-batch-size 16 --train-iters 2000 --lr 1.0e-5 --min-lr \
#                1.0e-6 --lr-decay-style cosine --lr-warmup-iters 50 --lr-decay-iters 2000 \
#                --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --adam-eps 1e-8 --clip-grad 1.0 \
#                --bf16 --recompute-granularity full --use-flash-attn --zero-offload \
#                --accumulate-grads-on-host --seed 1234 --save checkpoints/gpt-oss-20b --load \
#                checkpoints/gpt-oss-20b --save-interval 200 --eval-interval 200 --eval-iters 10 \
#                --log-interval 1 --log-jsonl checkpoints/gpt-oss-20b/train.jsonl
#            (this script's own pretrain_gpt.py flags, with 512 GiB of host RAM; --vocab-size 201088
#            stands for --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$TOKENIZER_MODEL")
#   device per GPU : 52.23 GiB of 79.10 GiB  (16-bit params 38.96, the fp32 gradient buckets and
#                    scratch 6.48 (a bucket holds its largest parameter whole: the 579M-element output
#                    layer), activations 5.28 net (layer inputs 0.53; the logits phase: bf16 logits
#                    1.53 + their fp32 copy in the cross-entropy 3.07), fragmentation 0.53, CUDA
#                    context 1.00)
#   host per node  : 488.46 GiB of 512 GiB (fp32 master + Adam m + v 233.7, 16-bit staging 39.0,
#                    the fp32 gradient accumulator 77.9, the CPU-step overlap's rollback state 102.9,
#                    3 GiB process, 32 GiB OS reserve). --overlap-cpu-step auto (the default on a GPU)
#                    speculates 44% of the partition, what the host memory left free holds with the
#                    planner's 5% margin kept; all of it would take 233.74 GiB.
#                    --no-overlap-cpu-step: 385.61 GiB.
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
CKPT_DIR="${CKPT_DIR:-checkpoints/gpt-oss-20b}"

exec torchrun --standalone --nproc-per-node 1 pretrain/pretrain_gpt.py \
    --tensor-model-parallel-size 1 \
    --num-layers 24 --hidden-size 2880 --num-attention-heads 64 \
    --group-query-attention --num-query-groups 8 --kv-channels 64 \
    --ffn-hidden-size 2880 \
    --normalization RMSNorm --norm-epsilon 1e-5 \
    --untie-embeddings-and-output-weights \
    --position-embedding-type yarn --rotary-base 150000 --rotary-scaling-factor 32 \
    --yarn-original-max-position-embeddings 4096 --no-yarn-correction-range-round-to-int \
    --window-size 127,0 --window-attn-skip-freq 2 \
    --softmax-type learnable \
    --num-experts 32 --moe-router-topk 4 --moe-ffn-hidden-size 2880 \
    --quick-geglu --glu-linear-offset 1.0 --activation-func-clamp-value 7.0 \
    --moe-router-dtype fp32 \
    --seq-length 4096 --max-position-embeddings 131072 --make-vocab-size-divisible-by 128 \
    --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$TOKENIZER_MODEL" --vocab-size 201088 \
    --micro-batch-size 1 --global-batch-size 16 \
    --train-iters 2000 --lr 1.0e-5 --min-lr 1.0e-6 --lr-decay-style cosine \
    --lr-warmup-iters 50 --lr-decay-iters 2000 --weight-decay 0.1 \
    --adam-beta1 0.9 --adam-beta2 0.95 --adam-eps 1e-8 --clip-grad 1.0 \
    --bf16 \
    --recompute-granularity full \
    --use-flash-attn \
    --zero-offload --accumulate-grads-on-host \
    --seed 1234 \
    ${DATA_ARGS[@]+"${DATA_ARGS[@]}"} \
    --save "$CKPT_DIR" --load "$CKPT_DIR" --save-interval 200 \
    --eval-interval 200 --eval-iters 10 --log-interval 1 \
    --log-jsonl "$CKPT_DIR/train.jsonl" \
    "$@"
