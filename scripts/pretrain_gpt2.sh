#!/usr/bin/env bash
# GPT-2 pretraining in plain PyTorch (no DeepSpeed), one process: `python pretrain_gpt.py`.
#
#   bash scripts/pretrain_gpt2.sh                          # tiny GPT-2, 40 iterations, CPU ok
#   TRAIN_ITERS=80 bash scripts/pretrain_gpt2.sh           # any variable below, from the env
#   bash scripts/pretrain_gpt2.sh --lr 3e-4 --bf16         # extra flags go to pretrain_gpt.py
#
# As shipped it trains a 2-layer, 64-wide GPT-2 for 40 iterations on the embedded default data
# (build it once: bash examples/quickstart.sh), on the first GPU if there is one, else on the
# CPU.
# Checkpoints: CHECKPOINT_PATH, every SAVE_INTERVAL iterations; a rerun resumes from the latest.
# To train past TRAIN_ITERS, raise it and pass --override-lr-scheduler (the LR and weight-decay
# schedules stretch to the new length; a checkpoint's schedule must otherwise match the flags).
# Delete CHECKPOINT_PATH to start over.
#
# Real GPUs: this uses one GPU, in --bf16 (A100/H100) or --fp16 (V100). For several GPUs or
#   nodes use scripts/pretrain_gpt2_model_parallel.sh (torchrun, tensor parallel) or
#   examples/pretrain_gpt_distributed.sh (torchrun, data parallel), or the DeepSpeed scripts.
# GPT-2 sizes: MODEL_SIZE=124M or 345M sets the shape and Megatron's recipe (see
#   apply_model_size in scripts/common.sh); 345M fits one 16 GB GPU with --fp16
#   --checkpoint-activations. 1.5B needs several GPUs: scripts/ds_zero2_pretrain_gpt2_model_parallel.sh.
# Multi-node: not with one process; see scripts/pretrain_gpt2_model_parallel.sh.
set -euo pipefail
# shellcheck source=scripts/common.sh source-path=SCRIPTDIR/..
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
apply_model_size   # MODEL_SIZE=124M|345M|1.5B presets (scripts/common.sh)

DATA_PATH=${DATA_PATH:-$ROOT/data/quickstart/corpus_content_document}
VOCAB_FILE=${VOCAB_FILE:-$ROOT/dataset/gpt2-vocab.json}
MERGE_FILE=${MERGE_FILE:-$ROOT/dataset/gpt2-merges.txt}
CHECKPOINT_PATH=${CHECKPOINT_PATH:-$ROOT/checkpoints/gpt2}
TENSORBOARD_DIR=${TENSORBOARD_DIR:-$ROOT/runs/gpt2}

NUM_LAYERS=${NUM_LAYERS:-2}
HIDDEN_SIZE=${HIDDEN_SIZE:-64}
NUM_ATTENTION_HEADS=${NUM_ATTENTION_HEADS:-4}
SEQ_LENGTH=${SEQ_LENGTH:-128}
MICRO_BATCH_SIZE=${MICRO_BATCH_SIZE:-4}
GLOBAL_BATCH_SIZE=${GLOBAL_BATCH_SIZE:-$((MICRO_BATCH_SIZE * 2))}   # gradient accumulation 2
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
read -r -a DATA_PATHS <<< "$DATA_PATH"   # "PREFIX" or a blend "W1 PREFIX1 W2 PREFIX2"

GPT_ARGS=(
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

run_command "$PYTHON" "$ROOT/pretrain_gpt.py" \
  "${GPT_ARGS[@]}" "${DATA_ARGS[@]}" "${OUTPUT_ARGS[@]}" "${PRECISION_ARGS[@]}" "$@"
