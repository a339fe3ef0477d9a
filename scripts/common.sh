# shellcheck shell=bash
# Helpers sourced by the pretraining scripts in scripts/ and examples/ (not run on its own).
#
#   source "$(dirname "${BASH_SOURCE[0]}")/common.sh"      # sets ROOT, the repository root
#
# Each script keeps its own settings (sizes, paths, launcher) at its top, Megatron style; the
# checks and chores they all share live here: finding the launcher commands, counting GPUs,
# checking that the dataset exists, checking the parallel sizes, printing the command run.

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

# The launchers (python, torchrun, deepspeed) come from PATH; when the active environment has
# none, fall back to the repository's .venv (what scripts/setup_env.sh creates).
if ! command -v deepspeed >/dev/null 2>&1 && [ -x "$ROOT/.venv/bin/deepspeed" ]; then
  PATH="$ROOT/.venv/bin:$PATH"
fi
PYTHON=${PYTHON:-$(command -v python || command -v python3 || echo python)}

# Number of visible CUDA (or ROCm) GPUs on this node; 0 on a CPU-only machine, and where
# CUDA_VISIBLE_DEVICES is set but empty (torch sees no GPU then; asking it costs a 2 s import).
count_gpus() {
  local count=0
  if [ -n "${CUDA_VISIBLE_DEVICES+set}" ] && [ -z "${CUDA_VISIBLE_DEVICES//[[:space:],]/}" ]; then
    echo 0
    return 0
  fi
  if command -v nvidia-smi >/dev/null 2>&1; then
    count=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
    if [ "${count:-0}" -gt 0 ] && [ -n "${CUDA_VISIBLE_DEVICES+set}" ]; then
      count=$(tr ',' '\n' <<< "$CUDA_VISIBLE_DEVICES" | grep -c '[^[:space:]]' || true)
    fi
  fi
  if [ "${count:-0}" -eq 0 ]; then
    count=$("$PYTHON" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
  fi
  echo "${count:-0}"
}

# Processes per node: the GPU count where there are GPUs, else $1 CPU processes (over gloo).
default_procs_per_node() {
  local gpus
  gpus=$(count_gpus)
  if [ "$gpus" -gt 0 ]; then echo "$gpus"; else echo "$1"; fi
}

# The precision flag in the array PRECISION_ARGS: PRECISION=bf16|fp16|fp32|auto (default
# auto: --bf16 on GPUs that compute in bf16 (compute capability 8.0+: A100, H100, L40S, ...;
# AMD's ROCm GPUs), --fp16 on older ones (V100, T4), fp32 on a CPU). Nothing is added when the
# script's extra arguments (the rest) pass --fp16 or --bf16, or when DS_CONFIG enables an fp16
# or bf16 section: the user's own choice stands, and there is no second flag to contradict it.
# shellcheck disable=SC2034  # PRECISION_ARGS is read by the script that sources this file
precision_args() {
  local choice=${PRECISION:-auto} arg
  PRECISION_ARGS=()
  for arg in "$@"; do
    case "$arg" in --fp16|--bf16) return 0 ;; esac
  done
  if [ -n "${DS_CONFIG:-}" ] && [ -f "$DS_CONFIG" ] && "$PYTHON" -c 'import json, sys
config = json.load(open(sys.argv[1]))
on = [str(config.get(key, {}).get("enabled")).lower() for key in ("fp16", "bf16", "bfloat16")]
sys.exit(0 if "true" in on else 1)' "$DS_CONFIG" 2>/dev/null; then
    return 0
  fi
  if [ "$choice" = auto ]; then
    choice=fp32
    if [ "$(count_gpus)" -gt 0 ]; then choice=$(gpu_half_precision); fi
  fi
  case "$choice" in
    bf16) PRECISION_ARGS=(--bf16) ;;
    fp16) PRECISION_ARGS=(--fp16) ;;
    fp32) ;;
    *)
      echo "error: PRECISION=$choice is not one of bf16, fp16, fp32, auto" >&2
      exit 1
      ;;
  esac
}

# bf16 where the first visible GPU computes in it (compute capability 8.0+, or ROCm), else fp16.
gpu_half_precision() {
  local capability
  capability=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -n 1)
  if [ -z "$capability" ]; then
    capability=$("$PYTHON" -c 'import torch
print("9.0" if torch.version.hip else "%d.%d" % torch.cuda.get_device_capability())' \
      2>/dev/null || echo 0.0)
  fi
  if [ "${capability%%.*}" -ge 8 ] 2>/dev/null; then echo bf16; else echo fp16; fi
}

# MODEL_SIZE=124M|345M|1.5B: GPT-2's published shapes (small, medium, XL) on 1024-token
# sequences, with Megatron-LM's GPT-2 recipe (512 sequences per step, 500k iterations, cosine
# decay over 320k after 1% warmup, split 949,50,1) and the GPT-3 paper's learning rate for each
# size. Only variables the environment leaves unset are filled in, so any one can be overridden
# (MODEL_SIZE=345M LR=1e-4 ...). Unset or "tiny": the script's own small defaults.
apply_model_size() {
  case "${MODEL_SIZE:-tiny}" in
    tiny) return 0 ;;
    124M) : "${NUM_LAYERS:=12}" "${HIDDEN_SIZE:=768}" "${NUM_ATTENTION_HEADS:=12}" \
            "${LR:=6e-4}" "${MIN_LR:=6e-5}" "${MICRO_BATCH_SIZE:=8}" ;;
    345M) : "${NUM_LAYERS:=24}" "${HIDDEN_SIZE:=1024}" "${NUM_ATTENTION_HEADS:=16}" \
            "${LR:=3e-4}" "${MIN_LR:=3e-5}" "${MICRO_BATCH_SIZE:=8}" ;;
    1.5B) : "${NUM_LAYERS:=48}" "${HIDDEN_SIZE:=1600}" "${NUM_ATTENTION_HEADS:=25}" \
            "${LR:=2e-4}" "${MIN_LR:=2e-5}" "${MICRO_BATCH_SIZE:=4}" ;;
    *)
      echo "error: MODEL_SIZE=$MODEL_SIZE is not one of 124M, 345M, 1.5B, tiny" >&2
      exit 1
      ;;
  esac
  : "${SEQ_LENGTH:=1024}" "${GLOBAL_BATCH_SIZE:=512}" "${TRAIN_ITERS:=500000}"
  : "${LR_DECAY_ITERS:=320000}" "${LR_WARMUP_FRACTION:=0.01}" "${SPLIT:=949,50,1}"
  : "${LOG_INTERVAL:=100}" "${EVAL_INTERVAL:=1000}" "${EVAL_ITERS:=10}" "${SAVE_INTERVAL:=10000}"
}

# MODEL_SIZE for examples/pretrain_llama2_distributed.sh: LLaMA-2's shapes and recipe (4096
# tokens, 1024 sequences = 4M tokens per step, 250k steps = 1T tokens, LR 3e-4 -> 3e-5 cosine
# after 2000 warmup steps, as Megatron-DeepSpeed's script). llama-1.3B is that script's own
# shape (16 query heads over 4 key/value heads); llama2-70B has 8 key/value heads (GQA), 7B and
# 13B one per query head. Unset or "llama-tiny": the script's small CPU defaults. Only
# variables the environment leaves unset are filled in.
apply_llama_model_size() {
  case "${MODEL_SIZE:-llama-tiny}" in
    llama-tiny) return 0 ;;
    llama-1.3B) : "${NUM_LAYERS:=24}" "${HIDDEN_SIZE:=2048}" "${FFN_HIDDEN_SIZE:=5504}"                   "${NUM_HEADS:=16}" "${NUM_KV_HEADS:=4}" "${SEQ_LENGTH:=2048}" ;;
    llama2-7B) : "${NUM_LAYERS:=32}" "${HIDDEN_SIZE:=4096}" "${FFN_HIDDEN_SIZE:=11008}"                  "${NUM_HEADS:=32}" "${NUM_KV_HEADS:=32}" ;;
    llama2-13B) : "${NUM_LAYERS:=40}" "${HIDDEN_SIZE:=5120}" "${FFN_HIDDEN_SIZE:=13824}"                   "${NUM_HEADS:=40}" "${NUM_KV_HEADS:=40}" ;;
    llama2-70B) : "${NUM_LAYERS:=80}" "${HIDDEN_SIZE:=8192}" "${FFN_HIDDEN_SIZE:=28672}"                   "${NUM_HEADS:=64}" "${NUM_KV_HEADS:=8}" ;;
    *)
      echo "error: MODEL_SIZE=$MODEL_SIZE is not one of llama-tiny, llama-1.3B, llama2-7B," \
        "llama2-13B, llama2-70B" >&2
      exit 1
      ;;
  esac
  : "${SEQ_LENGTH:=4096}" "${MICRO_BATCH_SIZE:=1}" "${GLOBAL_BATCH_SIZE:=1024}"
  : "${TRAIN_STEPS:=250000}" "${LR:=3e-4}" "${MIN_LR:=3e-5}" "${LR_WARMUP_STEPS:=2000}"
  : "${LOG_INTERVAL:=10}" "${EVAL_INTERVAL:=1000}" "${EVAL_ITERS:=10}" "${SAVE_INTERVAL:=10000}"
  : "${ACTIVATION_CHECKPOINT:=true}"
}

# Say what to do and exit 1 unless every prefix in the --data-path words ($1: "PREFIX" or
# "W1 PREFIX1 W2 PREFIX2 ...") has its .bin and .idx. Skipped when the script's extra
# arguments (the rest) give their own --data-path.
require_data() {
  local data_path=$1 word missing=()
  shift
  for word in "$@"; do
    if [ "$word" = "--data-path" ]; then return 0; fi
  done
  for word in $data_path; do
    if [[ $word =~ ^[0-9]*\.?[0-9]+([eE][-+]?[0-9]+)?$ ]]; then continue; fi  # a blend weight
    if [ ! -f "$word.bin" ] || [ ! -f "$word.idx" ]; then missing+=("$word"); fi
  done
  if [ -z "$data_path" ] || [ "${#missing[@]}" -gt 0 ]; then
    {
      echo "error: no dataset at DATA_PATH=${missing[*]:-(empty)}" \
        "(expected PREFIX.bin and PREFIX.idx)."
      echo "Build the default one (the Python standard library, GPT-2 tokens) with:"
      echo "    bash examples/quickstart.sh"
      echo "or point DATA_PATH at a prefix written by tools/preprocess_data.py, e.g."
      echo "    DATA_PATH=data/myrepo_content_document bash $0"
    } >&2
    exit 1
  fi
}

# Exit 1 unless $1 processes split into TP ($2) x PP ($3) x DP.
require_parallel_sizes() {
  local world=$1 tp=$2 pp=$3
  if [ "$world" -lt 1 ] || [ $(( world % (tp * pp) )) -ne 0 ]; then
    echo "error: $world process(es) (GPUS_PER_NODE x NNODES) cannot be split into" \
      "tensor-parallel $tp x pipeline-parallel $pp x data-parallel; set GPUS_PER_NODE, TP or PP" >&2
    exit 1
  fi
}

# The `deepspeed` launcher's own arguments, in the array DS_LAUNCHER_ARGS, from GPUS_PER_NODE,
# NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT, HOSTFILE and DS_NO_SSH.
#   one node: starts GPUS_PER_NODE local processes (CPU processes over gloo where no GPU).
#   NNODES>1: HOSTFILE lists the nodes ("worker-1 slots=8" per line); run once, on the first
#     node, and DeepSpeed starts the others over passwordless ssh (pdsh). With DS_NO_SSH=1,
#     run the script on every node instead, each with its own NODE_RANK.
deepspeed_launcher_args() {
  DS_LAUNCHER_ARGS=(--num_gpus "$GPUS_PER_NODE" --master_port "$MASTER_PORT")
  if [ "$NNODES" -gt 1 ] && [ ! -f "${HOSTFILE:-}" ]; then
    echo "error: NNODES=$NNODES needs HOSTFILE, a file listing the nodes as 'worker-1 slots=8'" \
      "lines (got HOSTFILE='${HOSTFILE:-}')" >&2
    exit 1
  fi
  if [ -n "${HOSTFILE:-}" ]; then
    DS_LAUNCHER_ARGS+=(--hostfile "$HOSTFILE" --num_nodes "$NNODES" --master_addr "$MASTER_ADDR")
  fi
  if [ "${DS_NO_SSH:-0}" = 1 ]; then
    DS_LAUNCHER_ARGS+=(--no_ssh --node_rank "$NODE_RANK")
  fi
}

# Print the command (shell-quoted, so it can be copied), then replace this shell with it.
run_command() {
  local arg
  printf '==>'
  for arg in "$@"; do
    if [[ $arg =~ ^[A-Za-z0-9_./:=,+@%-]+$ ]]; then printf ' %s' "$arg"; else printf ' %q' "$arg"; fi
  done
  printf '\n'
  exec "$@"
}
