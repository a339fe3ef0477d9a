#!/usr/bin/env bash
# Install this project (and, with an argument such as "test", its extras) into a Python
# environment, then print that environment's python path as the last line of stdout.
#
# Which environment: $PYTHON if set; else the active virtualenv or conda env; else a .venv
# created in the repository (never the system Python). torch is pinned (TORCH_VERSION,
# default 2.13.0) only when the environment has no torch: an unpinned torch would pull
# gigabytes of CUDA wheels onto CPU-only machines, and an existing torch (CUDA or not) is kept.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
extras=${1:-}

if [ -n "${PYTHON:-}" ]; then
  python=$PYTHON
elif [ -n "${VIRTUAL_ENV:-}" ] || [ -n "${CONDA_PREFIX:-}" ]; then
  python=$(command -v python)
else
  if [ ! -x "$root/.venv/bin/python" ]; then
    echo "[setup] creating $root/.venv" >&2
    python3 -m venv "$root/.venv" >&2
  fi
  python="$root/.venv/bin/python"
fi

# Re-install only when the build inputs changed (re-runs of the quickstart stay fast).
stamp_dir=$("$python" -c 'import sys; print(sys.prefix)')
stamp="$stamp_dir/.megatron-ds-setup-${extras:-base}"
fingerprint=$(cat "$root/pyproject.toml" "$root/setup.py" "$root"/megatron/*/*.cpp "$root"/megatron/*/*.h | cksum)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$fingerprint" ] \
    && "$python" -c "import megatron.data.helpers, megatron.tokenizer.bpe_engine, torch, deepspeed" 2>/dev/null; then
  echo "[setup] $python is up to date" >&2
  echo "$python"
  exit 0
fi

if ! "$python" -c "import torch" 2>/dev/null; then
  echo "[setup] no torch in this environment: installing torch==${TORCH_VERSION:-2.13.0}" >&2
  "$python" -m pip install "torch==${TORCH_VERSION:-2.13.0}" >&2
fi
echo "[setup] installing the project${extras:+ with [$extras]} (builds the C++ helpers)" >&2
"$python" -m pip install -e "$root${extras:+[$extras]}" >&2
"$python" -c "import megatron.data.helpers, megatron.tokenizer.bpe_engine" >&2
echo "$fingerprint" > "$stamp"
echo "$python"
