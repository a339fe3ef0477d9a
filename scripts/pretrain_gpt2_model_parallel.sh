#!/usr/bin/env bash
# GPT-2 pretraining in plain PyTorch (no DeepSpeed) with tensor parallelism (TP=2), launched by
# torchrun; the data-parallel size is what is left: GPUS_PER_NODE x NNODES / TP.
#
#   bash scripts/pretrain_gpt2_model_parallel.sh                   # tiny GPT-2, 40 iterations
#   TRAIN_ITERS=80 bash scripts/pretrain_gpt2_model_parallel.sh    # any variable below
#   bash scripts/pretrain_gpt2_model_parallel.sh --sequence-parallel   # extra flags
#
# As shipped it starts one process per GPU, or 2 CPU processes over gloo where there is no GPU
# (TP 2 x DP 1; on 8 GPUs TP 2 x DP 4), and trains a 2-layer, 64-wide GPT-2 on the embedded
# default data (build it once: bash examples/quickstart.sh). Pipeline parallelism needs
# DeepSpeed (scripts/ds_pretrain_gpt2.sh with PP=2).
# Checkpoints: CHECKPOINT_PATH, every SAVE_INTERVAL iterations; a rerun resumes from the latest.
# To train past TRAIN_ITERS, raise it and pass --override-lr-scheduler (the LR and weight-decay
# schedules stretch to the new length; a checkpoint's schedule must otherwise match the flags).
# Delete CHECKPOINT_PATH to start over.
#
# Real GPUs: the defaults use every GPU of the node at TP=2 over NCCL, in --bf16
#   (A100/H100) or --fp16 (V100) unless the flags choose (PRECISION=bf16|fp16|fp32 forces). Keep TP within a node (TP <= GPUS_PER_NODE).
# GPT-2 sizes: MODEL_SIZE=124M, 345M or 1.5B sets the shape and Megatron's recipe (see
#   apply_model_size in scripts/common.sh; any variable still overrides). 1.5B has 25 heads:
#   TP must divide 25 (TP=5, or TP=1 with ZeRO-2 in scripts/ds_zero2_pretrain_gpt2_model_parallel.sh).
# Multi-node: run this on every node with the same NNODES, MASTER_ADDR (node 0's address) and
#   MASTER_PORT and that node's NODE_RANK (0..NNODES-1), e.g. on the second of two nodes:
#   NNODES=2 NODE_RANK=1 MASTER_ADDR=worker-1 GPUS_PER_NODE=8 bash scripts/pretrain_gpt2_model_parallel.sh
#   (torchrun --nnodes 2 --node_rank 1 --master_addr worker-1 ...).
set -euo pipefail
# shellcheck source=scripts/common.sh source-path=SCRIPTDIR/..
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
apply_model_size   # MODEL_SIZE=124M|345M|1.5B presets (scripts/common.sh)

GPUS_PER_NODE=${GPUS_PER_NODE:-$(default_procs_per_node 2)}   # every GPU, else 2 CPU processes
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-6000}
WORLD_SIZE=$((GPUS_PER_NODE * NNODES))

DATA_PATH=${DATA_PATH:-$ROOT/data/quickstart/corpus_content_document}
VOCAB_FILE=${VOCAB_FILE:-$ROOT/dataset/gpt2-vocab.json}
MERGE_FILE=${MERGE_FILE:-$ROOT/dataset/gpt2-merges.txt}
CHECKPOINT_PATH=${CHECKPOINT_PATH:-$ROOT/checkpoints/gpt2_tp}
TENSORBOARD_DIR=${TENSORBOARD_DIR:-$ROOT/runs/gpt2_tp}

TP=${TP:-2}
NUM_LAYERS=${NUM_LAYERS:-2}
HIDDEN_SIZE=${HIDDEN_SIZE:-64}
NUM_ATTENTION_HEADS=${NUM_ATTENTION_HEADS:-4}
SEQ_LENGTH=${SEQ_LENGTH:-128}
MICRO_BATCH_SIZE=${MICRO_BATCH_SIZE:-4}
# Default: 2 micro-batches per data-parallel rank per iteration (gradient accumulation 2).
GLOBAL_BATCH_SIZE=${GLOBAL_BATCH_SIZE:-$((MICRO_BATCH_SIZE * 2 * WORLD_SIZE / TP))}
TRAIN_ITERS=${TRAIN_ITERS:-40}
LR=${LR:-1e-3}
MIN_LR=${MIN_LR:-1e-5}
LR_DECAY_ITERS=${LR_DECAY_ITERS:-$TRAIN_ITERS}
LR_WARMUP_FRACTION=${LR_WARMUP_FRACTION:-0.1}   # of LR_DECAY_ITERS
SPLIT=${SPLIT:-98,1,1}
LOG_INTERVAL=${LOG_INTERVAL:-5}
EVAL_INTERVAL=${EVAL_INTERVAL:-20}
EVAL_ITERS=${EVAL_ITERS:-2}
SAVE_INTERVAL=${SAVE_INTERVAL:-20}

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
GPT_ARGS=(
  --tensor-model-parallel-size "$TP"
  --num-layers "$NUM_LAYERS"
  --hidden-size "$HIDDEN_SIZE"
  --num-attention-heads "$NUM_ATTENTION_HEADS"
  --seq-length "$SEQ_LENGTH"
  --max-position-embeddings "$SEQ_LENGTH"
  --micro-batch-size "$MICRO_BATCH_SIZE"
  --global-batch-size "$GLOBAL_BATCH_SIZE"
  --train-iters "$TRAIN_ITERS"
  --lr "$LR"
  --min-lr "$MIN_LR"
  --lr-decay-style cosine
  --lr-decay-iters "$LR_DECAY_ITERS"
  --lr-warmup-fraction "$LR_WARMUP_FRACTION"
  --weight-decay 1e-2
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
  --eval-interval "$EVAL_INTERVAL"
  --eval-iters "$EVAL_ITERS"
  --save "$CHECKPOINT_PATH"
  --load "$CHECKPOINT_PATH"
  --save-interval "$SAVE_INTERVAL"
  --tensorboard-dir "$TENSORBOARD_DIR"
)

run_command torchrun "${DISTRIBUTED_ARGS[@]}" "$ROOT/pretrain_gpt.py" \
  "${GPT_ARGS[@]}" "${DATA_ARGS[@]}" "${OUTPUT_ARGS[@]}" "${PRECISION_ARGS[@]}" "$@"
