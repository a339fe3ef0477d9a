#!/usr/bin/env bash
# Runs a tiny GPT-2 on one process, in plain PyTorch: Megatron-LM's examples/pretrain_gpt.sh.
#
#   bash examples/pretrain_gpt.sh                       # 40 iterations, CPU or one GPU
#   TRAIN_ITERS=80 bash examples/pretrain_gpt.sh        # any variable below, from the env
#   bash examples/pretrain_gpt.sh --bf16                # extra flags go to pretrain_gpt.py
#
# Data: the embedded default corpus (build it once: bash examples/quickstart.sh), or any
# DATA_PATH prefix written by tools/preprocess_data.py.
# Checkpoints: CHECKPOINT_PATH, every SAVE_INTERVAL iterations; a rerun resumes from the latest.
# To train past TRAIN_ITERS, raise it and pass --override-lr-scheduler (the LR and weight-decay
# schedules stretch to the new length; a checkpoint's schedule must otherwise match the flags).
# Delete CHECKPOINT_PATH to start over.
#
# Real GPU: one GPU is used, in --bf16 (--fp16 before A100). More GPUs or nodes:
#   examples/pretrain_gpt_distributed.sh (torchrun; NNODES, NODE_RANK, MASTER_ADDR there).
# GPT-2 sizes: MODEL_SIZE=345M is Megatron-LM's original example (one 16 GB GPU with --fp16);
#   124M and 1.5B too (see apply_model_size in scripts/common.sh). 1.5B does not fit one GPU:
#   use scripts/ds_zero2_pretrain_gpt2_model_parallel.sh.
set -euo pipefail
# shellcheck source=scripts/common.sh source-path=SCRIPTDIR/..
source "$(dirname "${BASH_SOURCE[0]}")/../scripts/common.sh"
apply_model_size   # MODEL_SIZE=124M|345M|1.5B presets (scripts/common.sh)

CHECKPOINT_PATH=${CHECKPOINT_PATH:-$ROOT/checkpoints/gpt_example}
TENSORBOARD_DIR=${TENSORBOARD_DIR:-$ROOT/runs/gpt_example}
VOCAB_FILE=${VOCAB_FILE:-$ROOT/dataset/gpt2-vocab.json}
MERGE_FILE=${MERGE_FILE:-$ROOT/dataset/gpt2-merges.txt}
DATA_PATH=${DATA_PATH:-$ROOT/data/quickstart/corpus_content_document}

NUM_LAYERS=${NUM_LAYERS:-2}
HIDDEN_SIZE=${HIDDEN_SIZE:-64}
NUM_ATTENTION_HEADS=${NUM_ATTENTION_HEADS:-4}
SEQ_LENGTH=${SEQ_LENGTH:-128}
MICRO_BATCH_SIZE=${MICRO_BATCH_SIZE:-4}
GLOBAL_BATCH_SIZE=${GLOBAL_BATCH_SIZE:-8}
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
read -r -a DATA_PATHS <<< "$DATA_PATH"   # "PREFIX" or a blend "W1 PREFIX1 W2 PREFIX2"

GPT_ARGS=(
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

run_command "$PYTHON" "$ROOT/pretrain_gpt.py" \
  "${GPT_ARGS[@]}" "${DATA_ARGS[@]}" "${OUTPUT_ARGS[@]}" \
  --save "$CHECKPOINT_PATH" --load "$CHECKPOINT_PATH" "${PRECISION_ARGS[@]}" "$@"
