#!/usr/bin/env bash
# A LLaMA-2-style model (RMSNorm, SwiGLU, grouped-query attention, rotary positions, no linear
# biases, untied output layer) on DeepSpeed: Megatron-DeepSpeed's
# examples_deepspeed/pretrain_llama2_distributed.sh, with the same flags, scaled down by default.
#
#   bash examples/pretrain_llama2_distributed.sh                  # tiny model, CPU ok
#   LAUNCHER=deepspeed bash examples/pretrain_llama2_distributed.sh  # deepspeed instead of torchrun
#   MODEL_SIZE=llama2-7B TP=2 PP=2 bash examples/pretrain_llama2_distributed.sh   # real sizes
#   bash examples/pretrain_llama2_distributed.sh --lr 1e-4         # extra flags go to pretrain_gpt.py
#
# Tokenizer and data: as shipped it reads the embedded default corpus with the GPT-2 BPE (build
# it once: bash examples/quickstart.sh), so it runs anywhere. For LLaMA's own vocabulary give a
# SentencePiece model and a dataset written with it:
#   python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/llama \
#     --tokenizer-type GPTSentencePieceTokenizer --tokenizer-model tokenizer.model \
#     --append-eod --workers 8
#   TOKENIZER_MODEL=tokenizer.model DATA_PATH=data/llama_text_document \
#     bash examples/pretrain_llama2_distributed.sh
# (TOKENIZER_TYPE=Llama2Tokenizer, SentencePieceTokenizer or HFTokenizer, whose TOKENIZER_MODEL
# is a Hugging Face tokenizer folder, work the same way.)
# Checkpoints: CHECKPOINT_PATH, every SAVE_INTERVAL iterations; a rerun resumes from the latest.
# Export to Hugging Face (LlamaForCausalLM):
#   python tools/checkpoint/convert_to_hf.py --load "$CHECKPOINT_PATH" --save hf/llama
#
# Sizes: MODEL_SIZE=llama-tiny (default, CPU), llama-1.3B (the shape of Megatron-DeepSpeed's
#   script: 24 layers, 2048 wide, 16 heads over 4 key/value heads), llama2-7B, llama2-13B,
#   llama2-70B (8 key/value heads), with LLaMA-2's recipe (4096 tokens, 4M tokens per step, LR
#   3e-4 to 3e-5 cosine, 2000 warmup iterations); see apply_llama_model_size in scripts/common.sh.
#   Any variable below still overrides. TP must divide the key/value heads.
# Real GPUs: GPUS_PER_NODE defaults to the node's GPU count; bf16 as the original script (fp16
#   on GPUs older than A100, fp32 on a CPU; PRECISION=bf16|fp16|fp32 forces one).
# Multi-node: run it on every node with the same NNODES, MASTER_ADDR and MASTER_PORT and that
#   node's NODE_RANK (torchrun), or LAUNCHER=deepspeed with HOSTFILE (see scripts/ds_pretrain_gpt2.sh).
set -euo pipefail
# shellcheck source=scripts/common.sh source-path=SCRIPTDIR/..
source "$(dirname "${BASH_SOURCE[0]}")/../scripts/common.sh"
apply_llama_model_size   # MODEL_SIZE=llama-tiny|llama-1.3B|llama2-7B|llama2-13B|llama2-70B

LAUNCHER=${LAUNCHER:-torchrun}
GPUS_PER_NODE=${GPUS_PER_NODE:-$(default_procs_per_node 2)}   # every GPU, else 2 CPU processes
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-6000}
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
WORLD_SIZE=$((GPUS_PER_NODE * NNODES))

CHECKPOINT_PATH=${CHECKPOINT_PATH:-$ROOT/checkpoints/llama2_example}
RUN_DIR=${RUN_DIR:-$ROOT/runs/llama2_example}
TOKENIZER_MODEL=${TOKENIZER_MODEL:-}
if [ -n "$TOKENIZER_MODEL" ]; then
  TOKENIZER_TYPE=${TOKENIZER_TYPE:-GPTSentencePieceTokenizer}
  TOKENIZER_ARGS=(--tokenizer-type "$TOKENIZER_TYPE" --tokenizer-model "$TOKENIZER_MODEL")
  DATA_PATH=${DATA_PATH:?"set DATA_PATH to a dataset written with $TOKENIZER_MODEL"}
else
  TOKENIZER_ARGS=(--tokenizer-type GPT2BPETokenizer
    --vocab-file "$ROOT/dataset/gpt2-vocab.json" --merge-file "$ROOT/dataset/gpt2-merges.txt")
  DATA_PATH=${DATA_PATH:-$ROOT/data/quickstart/corpus_content_document}
fi

TP=${TP:-1}
PP=${PP:-2}
ZERO_STAGE=${ZERO_STAGE:-0}
HIDDEN_SIZE=${HIDDEN_SIZE:-64}
FFN_HIDDEN_SIZE=${FFN_HIDDEN_SIZE:-176}
NUM_LAYERS=${NUM_LAYERS:-4}
NUM_HEADS=${NUM_HEADS:-8}
NUM_KV_HEADS=${NUM_KV_HEADS:-2}
SEQ_LENGTH=${SEQ_LENGTH:-128}
MICRO_BATCH_SIZE=${MICRO_BATCH_SIZE:-4}
GLOBAL_BATCH_SIZE=${GLOBAL_BATCH_SIZE:-$((MICRO_BATCH_SIZE * 2 * WORLD_SIZE / (TP * PP)))}
TRAIN_STEPS=${TRAIN_STEPS:-60}
LR=${LR:-3e-3}
MIN_LR=${MIN_LR:-3e-4}
LR_WARMUP_STEPS=${LR_WARMUP_STEPS:-6}
WEIGHT_DECAY=${WEIGHT_DECAY:-0.1}
GRAD_CLIP=${GRAD_CLIP:-1}
ROPE_THETA=${ROPE_THETA:-10000}
LOG_INTERVAL=${LOG_INTERVAL:-5}
SAVE_INTERVAL=${SAVE_INTERVAL:-30}
EVAL_INTERVAL=${EVAL_INTERVAL:-30}
EVAL_ITERS=${EVAL_ITERS:-2}
## Activation checkpointing saves GPU memory, but reduces training speed
ACTIVATION_CHECKPOINT=${ACTIVATION_CHECKPOINT:-false}

require_data "$DATA_PATH" "$@"
require_parallel_sizes "$WORLD_SIZE" "$TP" "$PP"
read -r -a DATA_PATHS <<< "$DATA_PATH"   # "PREFIX" or a blend "W1 PREFIX1 W2 PREFIX2"

# The DeepSpeed config, written as the original writes it unless DS_CONFIG names your own;
# the precision (bf16 on A100/H100-class GPUs) goes into it and onto the command line.
precision_args "$@"
mkdir -p "$RUN_DIR"
if [ -z "${DS_CONFIG:-}" ]; then
  DS_CONFIG=$RUN_DIR/deepspeed.json
  case "${PRECISION_ARGS[*]:-}" in
    --bf16) PRECISION_JSON='"bf16": {"enabled": true}' ;;
    --fp16) PRECISION_JSON='"fp16": {"enabled": true}' ;;
    *) PRECISION_JSON='"bf16": {"enabled": false}' ;;
  esac
  cat <<EOT > "$DS_CONFIG"
{
  "train_batch_size": $GLOBAL_BATCH_SIZE,
  "train_micro_batch_size_per_gpu": $MICRO_BATCH_SIZE,
  "steps_per_print": 1000000,
  "zero_optimization": {"stage": $ZERO_STAGE},
  $PRECISION_JSON
}
EOT
fi
DS_ARGS=(--deepspeed --deepspeed_config="$DS_CONFIG" --zero-stage="$ZERO_STAGE")
if [ "$ACTIVATION_CHECKPOINT" = true ]; then
  DS_ARGS+=(--deepspeed-activation-checkpointing --recompute-granularity full
    --recompute-method uniform)
fi

LLAMA_ARGS=(
  --tensor-model-parallel-size "$TP"
  --pipeline-model-parallel-size "$PP"
  --num-layers "$NUM_LAYERS"
  --hidden-size "$HIDDEN_SIZE"
  --ffn-hidden-size "$FFN_HIDDEN_SIZE"
  --num-attention-heads "$NUM_HEADS"
  --micro-batch-size "$MICRO_BATCH_SIZE"
  --global-batch-size "$GLOBAL_BATCH_SIZE"
  --seq-length "$SEQ_LENGTH"
  --max-position-embeddings "$SEQ_LENGTH"
  --train-iters "$TRAIN_STEPS"
  --save "$CHECKPOINT_PATH"
  --load "$CHECKPOINT_PATH"
  --data-path "${DATA_PATHS[@]}"
  --data-impl mmap
  "${TOKENIZER_ARGS[@]}"
  --split "949,50,1"
  --lr "$LR"
  --lr-decay-style cosine
  --min-lr "$MIN_LR"
  --weight-decay "$WEIGHT_DECAY"
  --clip-grad "$GRAD_CLIP"
  --lr-warmup-iters "$LR_WARMUP_STEPS"
  --optimizer adam
  --adam-beta1 0.9
  --adam-beta2 0.95
  --log-interval "$LOG_INTERVAL"
  --save-interval "$SAVE_INTERVAL"
  --eval-interval "$EVAL_INTERVAL"
  --eval-iters "$EVAL_ITERS"
  --tensorboard-dir "$RUN_DIR"
  --no-query-key-layer-scaling
  --attention-dropout 0
  --hidden-dropout 0
  --use-rotary-position-embeddings
  --rotary-position-embeddings-theta "$ROPE_THETA"
  --untie-embeddings-and-output-weights
  --swiglu
  --normalization rmsnorm
  --disable-bias-linear
  --num-key-value-heads "$NUM_KV_HEADS"
)

if [ "$LAUNCHER" = deepspeed ]; then
  deepspeed_launcher_args   # --num_gpus, --master_port, HOSTFILE/NNODES (scripts/common.sh)
  LAUNCH=(deepspeed "${DS_LAUNCHER_ARGS[@]}")
elif [ "$LAUNCHER" = torchrun ]; then
  LAUNCH=(torchrun --nproc_per_node "$GPUS_PER_NODE" --nnodes "$NNODES" --node_rank "$NODE_RANK"
    --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT")
else
  echo "error: LAUNCHER=$LAUNCHER is not one of torchrun, deepspeed" >&2
  exit 1
fi

run_command "${LAUNCH[@]}" "$ROOT/pretrain_gpt.py" "${LLAMA_ARGS[@]}" "${DS_ARGS[@]}" \
  "${PRECISION_ARGS[@]}" "$@"
