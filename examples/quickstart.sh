#!/usr/bin/env bash
# README command 1: the pipeline end to end on the embedded default corpus, CPU or GPU.
#
#   bash examples/quickstart.sh            # re-runs skip finished steps
#   bash examples/quickstart.sh --redo     # redo every step
#   CORPUS_DIR=~/src/myproject EXTENSIONS=".py .md" bash examples/quickstart.sh
#
# Steps: install -> build a JSON-lines corpus (default: this Python's standard library source,
# one document per file) -> tokenize it with the real GPT-2 vocabulary into Megatron's
# .bin/.idx format -> check that every document reads back and GPT samples can be cut.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"

redo=0
for arg in "$@"; do
  case "$arg" in
    --redo) redo=1 ;;
    -h|--help) sed -n '2,11p' "$0"; exit 0 ;;
    *) echo "error: unknown argument $arg (try --help)" >&2; exit 2 ;;
  esac
done

data_dir=${DATA_DIR:-$root/data/quickstart}
workers=${WORKERS:-$(nproc 2>/dev/null || echo 2)}
extensions=${EXTENSIONS:-.py}
corpus="$data_dir/corpus.jsonl"
prefix="$data_dir/corpus"
dataset="${prefix}_content_document"
start=$(date +%s)
step() { printf '\n==> [%s/4] %s\n' "$1" "$2"; }

step 1 "installing the project (torch is pinned only if none is installed)"
python=$(bash scripts/setup_env.sh | tail -n 1)
echo "using $python"
mkdir -p "$data_dir"

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
"$python" tools/check_dataset.py --prefix "$dataset" --input "$corpus" --json-key content \
  --seq-length 1024 --log-interval 1000

printf '\ndone in %ss. Data: %s.{bin,idx}\n' "$(( $(date +%s) - start ))" "$dataset"
echo "Pretrain a small GPT-2 on it: bash scripts/ds_pretrain_gpt2.sh (DeepSpeed, ZeRO-1), or"
echo "bash scripts/pretrain_gpt2.sh (plain torch); see the README's Pretrain section."
