#!/usr/bin/env bash
# The whole test suite once per kernel variation: other OpenMP thread counts and other ATen
# CPU kernels sum in other orders, as another machine's CPU does. A check whose outcome
# changes between them has a tolerance fitted to one machine (see tests/tolerances.py).
#
#   bash scripts/run_tests_variations.sh              # OMP 1, 2, 4; ATen default and avx2
#   VARIATIONS="OMP_NUM_THREADS=1" bash scripts/run_tests_variations.sh tests/core
#
# Extra arguments go to pytest. Run it before a release and whenever a test's tolerance
# changes; each variation takes as long as `bash scripts/run_tests.sh` (15-25 min on 2 cores).
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
variations=${VARIATIONS:-"OMP_NUM_THREADS=1 OMP_NUM_THREADS=2 OMP_NUM_THREADS=4 ATEN_CPU_CAPABILITY=default ATEN_CPU_CAPABILITY=avx2"}
for variation in $variations; do
  if [[ ! "$variation" =~ ^[A-Za-z_][A-Za-z0-9_]*=[^=]*$ ]]; then
    echo "[variations] error: VARIATIONS entry '$variation' is not NAME=VALUE" >&2
    exit 2
  fi
done
python=$(bash scripts/setup_env.sh test | tail -n 1) || exit 1
PATH="$(dirname "$python"):$PATH"
export PATH
failed=()
summary=()
for variation in $variations; do
  echo "[variations] $variation: pytest $*"
  started=$(date +%s)
  # Inductor's cache does not key on ATEN_CPU_CAPABILITY: kernels compiled under another
  # variation can crash a compiled test, so each variation compiles into its own folder.
  env "$variation" TORCHINDUCTOR_CACHE_DIR="$root/.cache/inductor-$variation" \
    "$python" -m pytest -q "$@"
  status=$?
  seconds=$(( $(date +%s) - started ))
  summary+=("$variation: exit $status, $((seconds / 60)) min $((seconds % 60)) s")
  [ "$status" -eq 0 ] || failed+=("$variation")
done
printf '[variations] %s\n' "${summary[@]}"
if [ "${#failed[@]}" -gt 0 ]; then
  echo "[variations] error: failed under ${failed[*]}" >&2
  exit 1
fi
