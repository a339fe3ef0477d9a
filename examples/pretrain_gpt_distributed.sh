#!/usr/bin/env bash
# Runs a tiny GPT-2 data parallel over several processes with torchrun, in plain PyTorch
# (DistributedDataParallel): Megatron-LM's examples/pretrain_gpt_distributed.sh.
#
#   bash examples/pretrain_gpt_distributed.sh                  # every GPU, else 2 CPU processes
#   TRAIN_ITERS=80 bash examples/pretrain_gpt_distributed.sh   # any variable below, from the env
#   bash examples/pretrain_gpt_distributed.sh --bf16           # extra flags go to pretrain_gpt.py
#
# Data: the embedded default corpus (build it once: bash examples/quickstart.sh), or any
# DATA_PATH prefix written by tools/preprocess_data.py.
# Checkpoints: CHECKPOINT_PATH, every SAVE_INTERVAL iterations; a rerun resumes from the latest.
# To train past TRAIN_ITERS, raise it and pass --override-lr-scheduler (the LR and weight-decay
# schedules stretch to the new length; a checkpoint's schedule must otherwise match the flags).
# Delete CHECKPOINT_PATH to start over.
#
# Real GPUs: GPUS_PER_NODE defaults to the node's GPU count (NCCL is picked automatically);
#   in --bf16 (--fp16 before A100). TP=2 splits each layer over 2 GPUs (data parallel over the rest).
# GPT-2 sizes: MODEL_SIZE=124M, 345M or 1.5B sets the shape and Megatron's recipe (see
#   apply_model_size in scripts/common.sh; any variable still overrides), e.g. Megatron-LM's
#   original 8-GPU example: MODEL_SIZE=345M bash examples/pretrain_gpt_distributed.sh --fp16
#   1.5B has 25 heads: TP must divide 25 (TP=5), else use ZeRO-2
#   (scripts/ds_zero2_pretrain_gpt2_model_parallel.sh with TP=1).
# Multi-node ("Change for multinode config"): run this on every node with the same NNODES,
#   MASTER_ADDR (node 0's address) and MASTER_PORT and that node's NODE_RANK, e.g. on the
#   second of two nodes: NNODES=2 NODE_RANK=1 MASTER_ADDR=worker-1 bash examples/pretrain_gpt_distributed.sh
#   which runs torchrun --nproc_per_node 8 --nnodes 2 --node_rank 1 --master_addr worker-1 ...
set -euo pipefail
# shellcheck source=scripts/common.sh source-path=SCRIPTDIR/..
source "$(dirname "${BASH_SOURCE[0]}")/../scripts/common.sh"
apply_model_size   # MODEL_SIZE=124M|345M|1.5B presets (scripts/common.sh)

GPUS_PER_NODE=${GPUS_PER_NODE:-$(default_procs_per_node 2)}   # every GPU, else 2 CPU processes
# Change for multinode config
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-6000}
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
# Restart every rank from the last checkpoint this many times when one fails or stalls
# (--distributed-timeout-minutes ends a stalled job; see README "When a rank stalls or dies").
MAX_RESTARTS=${MAX_RESTARTS:-0}
WORLD_SIZE=$((GPUS_PER_NODE * NNODES))

CHECKPOINT_PATH=${CHECKPOINT_PATH:-$ROOT/checkpoints/gpt_distributed_example}
TENSORBOARD_DIR=${TENSORBOARD_DIR:-$ROOT/runs/gpt_distributed_example}
VOCAB_FILE=${VOCAB_FILE:-$ROOT/dataset/gpt2-vocab.json}
MERGE_FILE=${MERGE_FILE:-$ROOT/dataset/gpt2-merges.txt}
DATA_PATH=${DATA_PATH:-$ROOT/data/quickstart/corpus_content_document}

TP=${TP:-1}
NUM_LAYERS=${NUM_LAYERS:-2}
HIDDEN_SIZE=${HIDDEN_SIZE:-64}
NUM_ATTENTION_HEADS=${NUM_ATTENTION_HEADS:-4}
SEQ_LENGTH=${SEQ_LENGTH:-128}
MICRO_BATCH_SIZE=${MICRO_BATCH_SIZE:-4}
# Default: one micro-batch per data-parallel rank per iteration.
GLOBAL_BATCH_SIZE=${GLOBAL_BATCH_SIZE:-$((MICRO_BATCH_SIZE * WORLD_SIZE / TP))}
TRAIN_ITERS=${TRAIN_ITERS:-40}
LR_DECAY_ITERS=${LR_DECAY_ITERS:-$TRAIN_ITERS}
LR=${LR:-1e-3}
MIN_LR=${MIN_LR:-1e-5}
LR_WARMUP_FRACTION=${LR_WARMUP_FRACTION:-.1}
SPLIT=${SPLIT:-98,1,1}
LOG_INTERVAL=${LOG_INTERVAL:-5}
SAVE_INTERVAL=${SAVE_INTERVAL:-20}
EVAL_INTERVAL=${EVAL_INTERVAL:-20}
EVAL_ITERS=${EVAL_ITERS:-2}

require_data "$DATA_PATH" "$@"
precision_args "$@"   # --bf16 on A100/H100-class GPUs, --fp16 on older ones, fp32 on CPU
require_parallel_sizes "$WORLD_SIZE" "$TP" 1
read -r -a DATA_PATHS <<< "$DATA_PATH"   # "PREFIX" or a blend "W1 PREFIX1 W2 PREFIX2"

DISTRIBUTED_ARGS=(
  --nproc_per_node "$GPUS_PER_NODE"
  --nnodes "$NNODES"
  --node_rank "$NODE_RANK"
  --master_addr "$MASTER_ADDR"
  --master_port "$MASTER_PORT"
)
if [ "$MAX_RESTARTS" != 0 ]; then
  DISTRIBUTED_ARGS+=(--max-restarts "$MAX_RESTARTS")
fi
GPT_ARGS=(
  --tensor-model-parallel-size "$TP"
  --num-layers "$NUM_LAYERS"
  --hidden-size "$HIDDEN_SIZE"
  --num-attention-heads "$NUM_ATTENTION_HEADS"
  --seq-length "$SEQ_LENGTH"
  --max-position-embeddings "$SEQ_LENGTH"
  --micro-batch-size "$MICRO_BATCH_SIZE"
  --global-batch-size "$GLOBAL_BATCH_SIZE"
  --lr "$LR"
  --train-iters "$TRAIN_ITERS"
  --lr-decay-iters "$LR_DECAY_ITERS"
  --lr-decay-style cosine
  --min-lr "$MIN_LR"
  --weight-decay 1e-2
  --lr-warmup-fraction "$LR_WARMUP_FRACTION"
  --clip-grad 1.0
)
DATA_ARGS=(
  --data-path "${DATA_PATHS[@]}"
  --vocab-file "$VOCAB_FILE"
  --merge-file "$MERGE_FILE"
  --data-impl mmap
  --split "$SPLIT"
)
OUTPUT_ARGS=(
  --log-interval "$LOG_INTERVAL"
  --save-interval "$SAVE_INTERVAL"
  --eval-interval "$EVAL_INTERVAL"
  --eval-iters "$EVAL_ITERS"
  --tensorboard-dir "$TENSORBOARD_DIR"
)

run_command torchrun "${DISTRIBUTED_ARGS[@]}" "$ROOT/pretrain_gpt.py" \
  "${GPT_ARGS[@]}" "${DATA_ARGS[@]}" "${OUTPUT_ARGS[@]}" \
  --save "$CHECKPOINT_PATH" --load "$CHECKPOINT_PATH" "${PRECISION_ARGS[@]}" "$@"
