#!/usr/bin/env bash
# README command 1: from raw files to a trained, exported and sampled GPT-2, CPU or GPU.
#
#   bash examples/quickstart.sh            # re-runs skip finished steps
#   bash examples/quickstart.sh --redo     # redo every step (retrains from scratch)
#   CORPUS_DIR=~/src/myproject EXTENSIONS=".py .md" bash examples/quickstart.sh
#   TRAIN_ITERS=600 bash examples/quickstart.sh    # train longer (or any variable below)
#
# Steps: install -> build a JSON-lines corpus (default: this Python's standard library source,
# one document per file) -> tokenize it with the real GPT-2 vocabulary into Megatron's
# .bin/.idx format -> check the dataset -> pretrain a small GPT-2 with DeepSpeed (ZeRO-1 over 2
# CPU processes, or over every GPU), validating as it goes, with checkpoints -> export it to
# Hugging Face format -> complete a prompt with it -> plot the loss curves to a PNG.
# Everything goes under data/quickstart, checkpoints/quickstart and runs/quickstart.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"

redo=0
for arg in "$@"; do
  case "$arg" in
    --redo) redo=1 ;;
    -h|--help) sed -n '2,14p' "$0"; exit 0 ;;
    *) echo "error: unknown argument $arg (try --help)" >&2; exit 2 ;;
  esac
done

data_dir=${DATA_DIR:-$root/data/quickstart}
run_dir=${RUN_DIR:-$root/runs/quickstart}
checkpoint=${CHECKPOINT_PATH:-$root/checkpoints/quickstart}
workers=${WORKERS:-$(nproc 2>/dev/null || echo 2)}
extensions=${EXTENSIONS:-.py}
prompt=${PROMPT:-"def __init__(self"}
corpus="$data_dir/corpus.jsonl"
prefix="$data_dir/corpus"
dataset="${prefix}_content_document"
hf_dir="$run_dir/hf"
train_log="$run_dir/train.log"
loss_png="$run_dir/loss.png"

# The model and its run: a 4-layer, 128-wide GPT-2 (the real 50,257-token vocabulary) on
# 128-token sequences, micro-batches of 4, two per process per step, cosine LR decay.
export NUM_LAYERS=${NUM_LAYERS:-4} HIDDEN_SIZE=${HIDDEN_SIZE:-128}
export NUM_ATTENTION_HEADS=${NUM_ATTENTION_HEADS:-4} SEQ_LENGTH=${SEQ_LENGTH:-128}
export MICRO_BATCH_SIZE=${MICRO_BATCH_SIZE:-4} TRAIN_ITERS=${TRAIN_ITERS:-200}
export LR=${LR:-2e-3} MIN_LR=${MIN_LR:-2e-4} LR_WARMUP_FRACTION=${LR_WARMUP_FRACTION:-0.05}
export LOG_INTERVAL=${LOG_INTERVAL:-5} EVAL_INTERVAL=${EVAL_INTERVAL:-25}
export EVAL_ITERS=${EVAL_ITERS:-4} SAVE_INTERVAL=${SAVE_INTERVAL:-50} SPLIT=${SPLIT:-98,1,1}
start=$(date +%s)
step() { printf '\n==> [%s/8] %s (%ss so far)\n' "$1" "$2" "$(( $(date +%s) - start ))"; }

step 1 "installing the project (torch is pinned only if none is installed)"
python=$(bash scripts/setup_env.sh hf,plot | tail -n 1)
echo "using $python"
PATH="$(dirname "$python"):$PATH"   # its deepspeed launcher too
mkdir -p "$data_dir" "$run_dir"
if [ "$redo" = 1 ]; then rm -rf "$checkpoint" "$hf_dir" "$train_log" "$loss_png"; fi

source_desc="${CORPUS_DIR:-python-stdlib} ${extensions}"
step 2 "building the corpus from ${CORPUS_DIR:-the Python standard library} (${extensions})"
if [ "$redo" = 0 ] && [ -f "$corpus" ] && [ "$(cat "$corpus.source" 2>/dev/null)" = "$source_desc" ]; then
  echo "already built: $corpus (use --redo to rebuild)"
else
  input_args=()
  if [ -n "${CORPUS_DIR:-}" ]; then input_args=(--input-dir "$CORPUS_DIR"); fi
  # shellcheck disable=SC2086
  "$python" tools/files_to_jsonl.py "${input_args[@]}" --extensions $extensions --output "$corpus"
  echo "$source_desc" > "$corpus.source"
  rm -f "$dataset.bin" "$dataset.idx"
fi

step 3 "tokenizing with the GPT-2 vocabulary, $workers workers"
if [ "$redo" = 0 ] && [ -f "$dataset.idx" ] && [ "$dataset.idx" -nt "$corpus" ]; then
  echo "already tokenized: $dataset.{bin,idx} (use --redo to redo)"
else
  "$python" tools/preprocess_data.py --input "$corpus" --json-keys content \
    --output-prefix "$prefix" --tokenizer-type GPT2BPETokenizer \
    --vocab-file dataset/gpt2-vocab.json --merge-file dataset/gpt2-merges.txt \
    --append-eod --workers "$workers" --log-interval 500
fi

step 4 "checking the dataset: every document detokenizes to its text, GPT samples read back"
if [ "$redo" = 0 ] && [ -f "$dataset.checked" ] && [ "$dataset.checked" -nt "$dataset.idx" ]; then
  echo "already checked (use --redo to check again)"
else
  "$python" tools/check_dataset.py --prefix "$dataset" --input "$corpus" --json-key content \
    --seq-length "$SEQ_LENGTH" --log-interval 1000
  touch "$dataset.checked"
fi

# The iteration the trackers name, as training reads them (a save killed after its checkpoint
# was published counts: megatron.checkpointing.commit).
trained_iteration() {
  "$python" -c 'import sys; from megatron.checkpointing.commit import read_tracker
t = read_tracker(sys.argv[1]); print(t[0] if t else 0)' "$checkpoint"
}
# The checkpoint remembers which corpus it was trained on: a run on other data is never taken
# for finished (nor resumed on the new data, nor deleted).
data_stamp="$checkpoint/quickstart.corpus"
if [ "$(trained_iteration)" != 0 ] && [ "$(cat "$data_stamp" 2>/dev/null)" != "$source_desc" ]; then
  echo "error: $checkpoint holds a run on other data ($(cat "$data_stamp" 2>/dev/null ||
    echo 'unknown corpus')), not '$source_desc'; move it away, set CHECKPOINT_PATH and RUN_DIR, or pass --redo" >&2
  exit 1
fi
gpus=$(bash -c 'source scripts/common.sh; count_gpus')
export GPUS_PER_NODE=${GPUS_PER_NODE:-$([ "$gpus" -gt 0 ] && echo "$gpus" || echo 2)}
step 5 "pretraining GPT-2 (${NUM_LAYERS} layers, ${HIDDEN_SIZE} wide) for $TRAIN_ITERS iterations: DeepSpeed ZeRO-1, $GPUS_PER_NODE $([ "$gpus" -gt 0 ] && echo GPU || echo CPU) processes"
if [ "$(trained_iteration)" -ge "$TRAIN_ITERS" ]; then
  echo "already trained: $checkpoint at iteration $(trained_iteration) (use --redo to retrain)"
else
  # Resumes from the newest checkpoint when an earlier run was interrupted (or TRAIN_ITERS was
  # raised: --override-lr-scheduler stretches the LR schedule to it); the log grows.
  printf '\n# quickstart training run started %s\n' "$(date -u +%FT%TZ)" >> "$train_log"
  mkdir -p "$checkpoint" && echo "$source_desc" > "$data_stamp"
  DATA_PATH="$dataset" CHECKPOINT_PATH="$checkpoint" TENSORBOARD_DIR="$run_dir/tensorboard" \
    bash scripts/ds_pretrain_gpt2.sh --override-lr-scheduler 2>&1 | tee -a "$train_log"
  echo "training log: $train_log"
fi

step 6 "exporting the checkpoint to a Hugging Face GPT-2 folder"
if [ "$redo" = 0 ] && [ -f "$hf_dir/config.json" ] \
    && [ "$hf_dir/config.json" -nt "$checkpoint/latest_checkpointed_iteration.txt" ]; then
  echo "already exported: $hf_dir"
else
  "$python" tools/checkpoint/convert_to_hf.py --load "$checkpoint" --save "$hf_dir" --force
fi

step 7 "completing the prompt '$prompt': two samples, then the greedy check of the export"
# Sampled (nucleus 0.9, temperature 0.8; Megatron takes top-k or top-p, not both): what the
# model writes. Greedy decoding of a model this small soon repeats itself; it is here to check
# the export, token for token.
echo "--- sampled from the checkpoint (tools/generate_samples_gpt.py, top-p 0.9, temperature 0.8):"
"$python" tools/generate_samples_gpt.py --load "$checkpoint" --prompt "$prompt" \
  --num-samples 2 --top_p 0.9 --temperature 0.8 --seed 1234 \
  --out-seq-length 64 2>&1 | sed -n '/^Context:/,$p'
echo "--- greedy (48 tokens) from the checkpoint:"
"$python" tools/generate_samples_gpt.py --load "$checkpoint" \
  --prompt "$prompt" --greedy --out-seq-length 48 2>&1 | sed -n '/^Context:/,$p'
echo "--- greedy from the Hugging Face export, with transformers (the same tokens):"
"$python" tools/checkpoint/sample_hf.py --load "$hf_dir" --prompt "$prompt" --max-new-tokens 48

step 8 "plotting the training and validation loss"
"$python" tools/plot_loss.py --log "$train_log" --output "$loss_png" \
  --title "quickstart: GPT-2 ${NUM_LAYERS}x${HIDDEN_SIZE} on $(basename "${CORPUS_DIR:-python-stdlib}")"

printf '\ndone in %ss.\n' "$(( $(date +%s) - start ))"
echo "  data:        $dataset.{bin,idx}"
echo "  checkpoint:  $checkpoint (resume, extend, reshard: the README's "Resume, reshard, export, generate")"
echo "  log:         $train_log   (TensorBoard: tensorboard --logdir $run_dir/tensorboard)"
echo "  export:      $hf_dir"
echo "  loss curves: $loss_png"
