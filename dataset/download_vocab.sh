#!/usr/bin/env bash
# Fetch the GPT-2 vocabulary and merges files (as Megatron's script does) and verify them.
# Usage: bash dataset/download_vocab.sh [DIR]   (default: this folder)
set -euo pipefail
dir=${1:-$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)}
base=https://s3.amazonaws.com/models.huggingface.co/bert
mkdir -p "$dir"
for pair in "gpt2-vocab.json 196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783" \
            "gpt2-merges.txt 1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"; do
  set -- $pair
  name=$1 sum=$2
  tmp="$dir/$name.partial"
  if ! curl -fsSL "$base/$name" -o "$tmp" && ! wget -q "$base/$name" -O "$tmp"; then
    rm -f "$tmp"
    echo "error: could not download $base/$name (no network?); the vendored copy in dataset/ works offline" >&2
    exit 1
  fi
  if [ "$(sha256sum "$tmp" | cut -d' ' -f1)" != "$sum" ]; then
    rm -f "$tmp"
    echo "error: $name from $base does not match sha256 $sum" >&2
    exit 1
  fi
  mv "$tmp" "$dir/$name"
  echo "fetched $dir/$name (sha256 ok)"
done
