#!/usr/bin/env bash
# README command 2: install what the tests need, check style, run the whole test suite.
#
#   bash scripts/run_tests.sh                  # everything (what CI runs)
#   bash scripts/run_tests.sh --quick          # the inner loop: no launched training runs
#   bash scripts/run_tests.sh tests/data -k gpt  # extra arguments go to pytest, as given
#
# The suite keeps every core busy (pytest-xdist, TEST_WORKERS of them, 2 by default): each test
# file runs on one worker, the longest first (tests/durations.json); tests marked `serial`
# run afterwards, alone. Then the distributed checks again under other CPU kernels, and the
# slowest 30 tests of the whole run.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
quick=0
if [ "${1:-}" = "--quick" ]; then
  quick=1
  shift
fi
# The full run's base-install check (tests/test_base_install.py) needs an environment of its
# own, with the base dependencies only: it builds here, beside this one's install (pip keeps one
# core busy) and below its priority, and the check finds it ready. Its log:
# .cache/base-install.log.
base_build=
if [ "$quick" = 0 ] && [ "$#" -eq 0 ]; then
  if [ -n "${PYTHON:-}" ]; then interpreter=$PYTHON
  elif [ -n "${VIRTUAL_ENV:-}" ] || [ -n "${CONDA_PREFIX:-}" ]; then interpreter=$(command -v python)
  else interpreter=$(command -v python3)
  fi
  mkdir -p "$root/.cache"
  nice -n 10 "$interpreter" -m tests.base_env > "$root/.cache/base-install.log" 2>&1 &
  base_build=$!
fi
python=$(bash scripts/setup_env.sh test | tail -n 1)
# The environment's own tools first (deepspeed, torchrun, ninja): DeepSpeed's JIT-built ops
# are rebuilt whenever a different ninja touches their shared build directory.
PATH="$(dirname "$python"):$PATH"
export PATH

echo "[tests] ruff check and format check"
"$python" -m ruff check .
"$python" -m ruff format --check .

# JUnit reports of the last run, kept: `python scripts/test_durations.py .cache/test-reports/*.xml`
# refreshes tests/durations.json from them.
reports="$root/.cache/test-reports"
rm -rf "$reports"
mkdir -p "$reports"
workers=${TEST_WORKERS:-2}
parallel=(-n "$workers" --dist loadfile --no-loadscope-reorder)
status=0
# pytest's exit 5 is "no tests collected": a filter that matched nothing, or a broken tree.
run_pytest() {
  local code=0
  "$python" -m pytest "$@" || code=$?
  if [ "$code" -eq 5 ]; then
    echo "[tests] error: pytest collected no tests (exit 5); check the paths or -k filter" >&2
    code=1
  fi
  if [ "$code" -ne 0 ]; then status=$code; fi
}

if [ "$#" -gt 0 ]; then
  echo "[tests] pytest $*"
  run_pytest "$@"
  exit "$status"
fi
if [ "$quick" = 1 ]; then
  echo "[tests] pytest, quick tier: every test but the launched runs (marked slow)"
  run_pytest "${parallel[@]}" -m "not slow and not serial" --durations=30
  exit "$status"
fi

echo "[tests] pytest on $workers workers"
run_pytest "${parallel[@]}" -m "not serial" --junitxml="$reports/parallel.xml"
# (Collecting the suite again costs 10 s: only when a test is marked so.)
if grep -rqs --include='*.py' "mark.serial" tests; then
  echo "[tests] pytest, the tests that run alone"
  serial=0
  "$python" -m pytest -m serial -q --junitxml="$reports/serial.xml" || serial=$?
  if [ "$serial" -ne 0 ] && [ "$serial" -ne 5 ]; then status=$serial; fi
fi
# Another machine's CPU sums in other orders: the distributed and layout-equivalence checks
# again with one OpenMP thread and ATen's unvectorised kernels (the whole suite under each
# variation, the Hugging Face comparisons too: scripts/run_tests_variations.sh).
echo "[tests] distributed checks again with OMP_NUM_THREADS=1 ATEN_CPU_CAPABILITY=default"
OMP_NUM_THREADS=1 ATEN_CPU_CAPABILITY=default TORCHINDUCTOR_CACHE_DIR="$root/.cache/inductor-default" \
  run_pytest "${parallel[@]}" -q -p no:cacheprovider --junitxml="$reports/one_thread.xml" \
  --ignore tests/core/test_spawn_checks.py \
  tests/core tests/model/test_gpt_parallel.py tests/model/test_pipeline.py tests/model/test_llama.py
if [ -n "$base_build" ]; then wait "$base_build" || true; fi  # the check reported its failure
echo "[tests] the slowest 30 tests of this run"
"$python" scripts/test_durations.py --slowest 30 "$reports"/*.xml
exit "$status"
