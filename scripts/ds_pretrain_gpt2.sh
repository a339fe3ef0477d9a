#!/usr/bin/env bash
# GPT-2 pretraining on DeepSpeed: ZeRO-1 data parallelism on DeepSpeed's pipeline engine (the
# Megatron-DeepSpeed default under --deepspeed; one stage unless PP>1). On a CPU machine it is
# one process (deepspeed --num_gpus 1); where there are GPUs, one process per GPU.
#
#   bash scripts/ds_pretrain_gpt2.sh                          # tiny GPT-2, 40 iterations, CPU ok
#   TRAIN_ITERS=80 bash scripts/ds_pretrain_gpt2.sh           # any variable below, from the env
#   bash scripts/ds_pretrain_gpt2.sh --lr 3e-4 --bf16         # extra flags go to pretrain_gpt.py
#
# As shipped it trains a 2-layer, 64-wide GPT-2 for 40 iterations on the embedded default data
# (build it once: bash examples/quickstart.sh).
# Checkpoints: CHECKPOINT_PATH, every SAVE_INTERVAL iterations; a rerun resumes from the latest.
# To train past TRAIN_ITERS, raise it and pass --override-lr-scheduler (the LR and weight-decay
# schedules stretch to the new length; a checkpoint's schedule must otherwise match the flags).
# Delete CHECKPOINT_PATH to start over.
# The ZeRO stage and other engine settings come from DS_CONFIG (JSON cannot hold comments):
#   examples/ds_configs/ds_zero1.json        ZeRO-1: optimizer states partitioned over data ranks
#   examples/ds_configs/ds_zero2.json        ZeRO-2: gradients too (needs --no-pipeline-parallel
#                                            or PP=1: then the non-pipeline engine is used)
#   examples/ds_configs/ds_zero2_fp16.json   ZeRO-2 with the fp16 section (GPUs only)
# Batch sizes, precision, gradient clipping and the ZeRO stage may be left out of the JSON: the
# flags fill them in, and a flag that contradicts the JSON is an error naming both.
#
# Real GPUs: GPUS_PER_NODE defaults to the node's GPU count: data parallelism over all of them,
#   ZeRO-1 partitioning the optimizer states (GPUS_PER_NODE=1 for one GPU). Precision: --bf16
#   on A100/H100-class GPUs, --fp16 on older ones (V100), unless the extra flags or DS_CONFIG
#   choose one (PRECISION=bf16|fp16|fp32 to force it; fp32 matmuls use TF32 on GPUs).
#   PP=2 splits the layers into 2 pipeline stages, TP=2 each layer over 2 GPUs.
# GPT-2 sizes: MODEL_SIZE=124M, 345M or 1.5B sets the shape and Megatron's recipe (see
#   apply_model_size in scripts/common.sh; any variable still overrides), e.g.
#   MODEL_SIZE=345M bash scripts/ds_pretrain_gpt2.sh --bf16 --checkpoint-activations
#   1.5B has 25 heads, so TP must divide 25: TP=1 with ZeRO-2 data parallelism over all GPUs
#   (scripts/ds_zero2_pretrain_gpt2_model_parallel.sh with TP=1; by estimate ~12 GB per GPU on
#   8 GPUs with --bf16 --checkpoint-activations) or TP=5 (GPU count a multiple of 5).
# Multi-node: list the nodes in a hostfile, one "worker-1 slots=8" line per node, and run this
#   once on the first node: NNODES=2 HOSTFILE=hostfile MASTER_ADDR=worker-1 GPUS_PER_NODE=8 bash
#   scripts/ds_pretrain_gpt2.sh (DeepSpeed starts the other nodes over passwordless ssh). Without
#   ssh, run it on every node with DS_NO_SSH=1 and that node's NODE_RANK (0..NNODES-1).
set -euo pipefail
# shellcheck source=scripts/common.sh source-path=SCRIPTDIR/..
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
apply_model_size   # MODEL_SIZE=124M|345M|1.5B presets (scripts/common.sh)

GPUS_PER_NODE=${GPUS_PER_NODE:-$(default_procs_per_node 1)}   # every GPU, else 1 CPU process
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-6000}
HOSTFILE=${HOSTFILE:-}              # DeepSpeed hostfile; needed when NNODES > 1
WORLD_SIZE=$((GPUS_PER_NODE * NNODES))

DATA_PATH=${DATA_PATH:-$ROOT/data/quickstart/corpus_content_document}
VOCAB_FILE=${VOCAB_FILE:-$ROOT/dataset/gpt2-vocab.json}
MERGE_FILE=${MERGE_FILE:-$ROOT/dataset/gpt2-merges.txt}
CHECKPOINT_PATH=${CHECKPOINT_PATH:-$ROOT/checkpoints/ds_gpt2}
TENSORBOARD_DIR=${TENSORBOARD_DIR:-$ROOT/runs/ds_gpt2}
DS_CONFIG=${DS_CONFIG:-$ROOT/examples/ds_configs/ds_zero1.json}

TP=${TP:-1}
PP=${PP:-1}
NUM_LAYERS=${NUM_LAYERS:-2}
HIDDEN_SIZE=${HIDDEN_SIZE:-64}
NUM_ATTENTION_HEADS=${NUM_ATTENTION_HEADS:-4}
SEQ_LENGTH=${SEQ_LENGTH:-128}
MICRO_BATCH_SIZE=${MICRO_BATCH_SIZE:-4}
# Default: 2 micro-batches per data-parallel rank per iteration (gradient accumulation 2).
GLOBAL_BATCH_SIZE=${GLOBAL_BATCH_SIZE:-$((MICRO_BATCH_SIZE * 2 * WORLD_SIZE / (TP * PP)))}
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
require_parallel_sizes "$WORLD_SIZE" "$TP" "$PP"
deepspeed_launcher_args
read -r -a DATA_PATHS <<< "$DATA_PATH"   # "PREFIX" or a blend "W1 PREFIX1 W2 PREFIX2"

GPT_ARGS=(
  --tensor-model-parallel-size "$TP"
  --pipeline-model-parallel-size "$PP"
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
DS_ARGS=(
  --deepspeed
  --deepspeed_config "$DS_CONFIG"
)

run_command deepspeed "${DS_LAUNCHER_ARGS[@]}" "$ROOT/pretrain_gpt.py" \
  "${GPT_ARGS[@]}" "${DATA_ARGS[@]}" "${OUTPUT_ARGS[@]}" "${DS_ARGS[@]}" "${PRECISION_ARGS[@]}" "$@"
