#!/usr/bin/env bash
# README command 2: install what the tests need, check style, run the whole test suite.
# Extra arguments go to pytest (e.g. `bash scripts/run_tests.sh tests/data -k gpt`).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
python=$(bash scripts/setup_env.sh test | tail -n 1)
# The environment's own tools first (deepspeed, torchrun, ninja): DeepSpeed's JIT-built ops
# are rebuilt whenever a different ninja touches their shared build directory.
PATH="$(dirname "$python"):$PATH"
export PATH

echo "[tests] ruff check and format check"
"$python" -m ruff check .
"$python" -m ruff format --check .

echo "[tests] pytest"
status=0
"$python" -m pytest "$@" || status=$?
if [ "$status" -eq 5 ]; then
  # pytest's "no tests collected": a filter that matched nothing, or a broken test tree.
  echo "[tests] error: pytest collected no tests (exit 5); check the paths or -k filter" >&2
  exit 1
fi
if [ "$#" -eq 0 ]; then
  # Another machine's CPU sums in other orders: the distributed and layout-equivalence checks
  # again with one OpenMP thread and ATen's unvectorised kernels (about a minute; context
  # parallelism's spawned worlds, the compiled checks, DeepSpeed's mpu and LLaMA's layouts are
  # left to the variations script for the CI budget). The whole suite under each variation (the
  # Hugging Face comparisons too): scripts/run_tests_variations.sh.
  echo "[tests] distributed checks again with OMP_NUM_THREADS=1 ATEN_CPU_CAPABILITY=default"
  OMP_NUM_THREADS=1 ATEN_CPU_CAPABILITY=default TORCHINDUCTOR_CACHE_DIR="$root/.cache/inductor-default" \
    "$python" -m pytest -q \
    -p no:cacheprovider --ignore tests/core/test_spawn_checks.py \
    --ignore tests/core/test_context_parallel.py --ignore tests/core/test_deepspeed_mpu.py \
    tests/core tests/model/test_gpt_parallel.py tests/model/test_pipeline.py \
    -k "not compiled" || status=$?
fi
exit "$status"
