#!/usr/bin/env bash
# The multi-node job of slurm_multinode.sbatch, launched with Open MPI's mpirun (no SLURM needed).
#
# Hardware : NODES x DGX-2 (16x V100-32GB, 1.5 TiB host each); HOSTFILE lists them, e.g.
#                dgx2-01 slots=16
#                dgx2-02 slots=16   ...
# Model    : GPT-3 175B = 96 layers x 12288 hidden x 96 heads, seq 1024 (174.60B parameters).
# Parallel : TP 16 inside a node x DP = NODES; micro-batch 2, global batch 2 x NODES.
# Planner  : python tools/estimate_memory.py --preset dgx2 --world-size 64 \
#                --tensor-model-parallel-size 16 --num-layers 96 --hidden-size 12288 \
#                --num-attention-heads 96 --seq-length 1024 --max-position-embeddings 1024 \
#                --make-vocab-size-divisible-by 128 --micro-batch-size 2 --global-batch-size 8 \
#                --train-iters 50000 --lr 6.0e-5 --min-lr 6.0e-6 --lr-decay-style cosine \
#                --lr-warmup-iters 1000 --lr-decay-iters 50000 --weight-decay 0.1 --adam-beta1 0.9 \
#                --adam-beta2 0.95 --adam-eps 1e-8 --clip-grad 1.0 --fp16 \
#                --initial-loss-scale 65536 --recompute-granularity full --zero-offload \
#                --bucket-size 50000000 --seed 1234 --save checkpoints/gpt-175b \
#                --load checkpoints/gpt-175b --save-interval 500 --eval-interval 1000 \
#                --eval-iters 10 --log-interval 1 --log-jsonl checkpoints/gpt-175b/train.jsonl
#            (this script's own pretrain_gpt.py flags with NODES=4: 64 ranks)
#   4 nodes: device 27.25 GiB per GPU (of 31.75), host 1,220.21 GiB per node (of 1,536), of
#   which 570.1 GiB is the CPU-step overlap's rollback state: --overlap-cpu-step auto speculates
#   all of each rank's partition here (650.10 GiB with --no-overlap-cpu-step).
#
# Rendezvous: zo_megatron reads OMPI_COMM_WORLD_RANK/SIZE/LOCAL_RANK/LOCAL_SIZE; with MASTER_ADDR
# unset, rank 0 picks its address and a free port and broadcasts them with mpi4py
# (pip install 'zo_megatron[mpi]'). Without mpi4py, pass -x MASTER_ADDR=<first host>
# -x MASTER_PORT=29500.
# CPU cores: --map-by ppr:16:node:PE=3 --bind-to core gives each rank its own 3 cores (6 hardware
# threads on a DGX-2), and CPU Adam runs one thread per core of that mask: no oversubscription.
# MPICH / Intel MPI (mpiexec -n ... -ppn 16) work the same way through PMI_RANK / PMI_SIZE.
set -euo pipefail
cd "${ZO_ROOT:-$(dirname "$0")/..}"

HOSTFILE="${HOSTFILE:-hostfile}"
NODES="${NODES:-4}"
MICRO=2
GLOBAL=$((MICRO * NODES))
PYTHON="${PYTHON:-$(command -v python)}"
CKPT_DIR="${CKPT_DIR:-checkpoints/gpt-175b}"

DATA_ARGS=()
[[ -n "${DATA_PATH:-}" ]] && DATA_ARGS+=(--data-path "$DATA_PATH" --split 949,50,1)
[[ -n "${VOCAB_FILE:-}" ]] && DATA_ARGS+=(--vocab-file "$VOCAB_FILE")
[[ -n "${MERGE_FILE:-}" ]] && DATA_ARGS+=(--merge-file "$MERGE_FILE")

# as root add: --allow-run-as-root
exec mpirun -np $((16 * NODES)) --hostfile "$HOSTFILE" \
    --map-by ppr:16:node:PE=3 --bind-to core \
    -x PATH -x LD_LIBRARY_PATH -x PYTHONPATH -x NCCL_DEBUG=WARN \
    "$PYTHON" pretrain/pretrain_gpt.py \
    --tensor-model-parallel-size 16 \
    --num-layers 96 --hidden-size 12288 --num-attention-heads 96 \
    --seq-length 1024 --max-position-embeddings 1024 --make-vocab-size-divisible-by 128 \
    --micro-batch-size "$MICRO" --global-batch-size "$GLOBAL" \
    --train-iters 50000 --lr 6.0e-5 --min-lr 6.0e-6 --lr-decay-style cosine \
    --lr-warmup-iters 1000 --lr-decay-iters 50000 --weight-decay 0.1 \
    --adam-beta1 0.9 --adam-beta2 0.95 --adam-eps 1e-8 --clip-grad 1.0 \
    --fp16 --initial-loss-scale 65536 \
    --recompute-granularity full \
    --zero-offload --bucket-size 50000000 \
    --seed 1234 \
    ${DATA_ARGS[@]+"${DATA_ARGS[@]}"} \
    --save "$CKPT_DIR" --load "$CKPT_DIR" --save-interval 500 \
    --eval-interval 1000 --eval-iters 10 --log-interval 1 \
    --log-jsonl "$CKPT_DIR/train.jsonl" \
    "$@"
