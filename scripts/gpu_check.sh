#!/usr/bin/env bash
# Check the GPU code paths on a CUDA machine in one command, with everything tee'd to a log.
#
#   bash scripts/gpu_check.sh [LOG]     # LOG: benchmarks/results/<device>-<date>.txt by default
#   WHEELS=.whl bash scripts/gpu_check.sh "$OUT/gpu_check.log"   # no DeepSpeed/torchao yet
#
# Steps, in order (STEPS="..." runs a subset or adds the opt-in ones; each is PASS or FAIL (fp8:
# or SKIP) in the summary; a failed step does not stop the later ones). The default ones,
# env deps build doctor tests data train bench fp8, are sized for one lent GPU's 15 minutes,
# machine start included (estimated from the H100/H200 runs in benchmarks/results/: about
# 1 min of set-up, 1.5 of tests, 2 of training, 5 of benchmarks, 3 of FP8); tests-more,
# quickstart and sweep run when named:
#   env     the GPU (nvidia-smi), Python, torch, the checkout
#   deps    DeepSpeed and torchao importable; where one is not and WHEELS names a folder of
#           wheels (DeepSpeed, pydantic, ..., torchao), installs the missing one's wheels with no
#           index into SITE (default /tmp/gpu_check_site) and puts that on PYTHONPATH (for a
#           machine with no network). DeepSpeed is required; without torchao the fp8 step skips.
#           Such a folder, made where there is network, for a Python 3.12 x86_64 machine (the
#           git checkout ignores .whl/ through .git/info/exclude: carry it to the GPU machine):
#             pip wheel --no-deps --no-build-isolation deepspeed==0.19.8 -w .whl
#             pip download --no-deps --only-binary=:all: --python-version 3.12 \
#               --platform manylinux_2_17_x86_64 -d .whl pydantic==2.14.3 \
#               pydantic-core==2.50.4 annotated-types typing-inspection typing-extensions hjson
#             pip download torchao==0.18.0 --no-deps -d .whl   # its FP8 needs torch >= 2.11
#   build   the two pybind11 extensions, in place (python setup.py build_ext --inplace)
#   doctor  python -m megatron.doctor
#   tests   pytest -m gpu over the suite (every GPU-only branch has a gpu-marked test)
#   tests-more  (opt-in) the tests that touch CUDA, and tests/model, on the GPU
#   data    a small real corpus as examples/quickstart.sh builds it (this Python's standard
#           library, tools/files_to_jsonl.py), tokenized with the real GPT-2 vocabulary
#   train   pretrain_gpt.py --deepspeed, ZeRO-1, a small GPT-2: the PRECISION:ENGINE runs in
#           TRAIN_RUNS (default "bf16:pipe fp16:nopipe": DeepSpeed's pipeline engine, the
#           --deepspeed default, and --no-pipeline-parallel), or every precision in PRECISIONS
#           on every engine in ENGINES where either is set; the training loss must stay finite
#           and fall by at least MIN_LOSS_DROP (default 2.0)
#   quickstart  (opt-in) bash examples/quickstart.sh (README command 1) on the GPU, in bf16
#           (its default there), with its own data, checkpoints and run under WORK
#   bench   benchmarks/gpu_throughput.py, compiled (8 micro-batches of 8 x 1024, bf16): at 124M
#           the plain engine, DeepSpeed's engine and its pipeline engine at PP=1, their ratios
#           to the plain engine, the planner's peak against max_memory_allocated; at 350M the
#           plain engine; each size against a compiled nanoGPT
#   sweep   (opt-in) the compiled plain engine at 124M under inductor's CUDA
#           graphs and autotuned matmuls, and at micro-batch 16: what each adds to its MFU
#   fp8     benchmarks/fp8_throughput.py: pretrain_gpt.py --torch-compile on a 1B-class LLaMA,
#           --bf16 and then --bf16 --fp8-format hybrid, 200 iterations each on the data step's
#           corpus (built here if that step did not run): tokens/s of each, their ratio, and the
#           loss agreement (about 3 minutes on an H100, two cold compiles included). SKIP, in
#           one line, where FP8 cannot run: no torchao, or a GPU before sm_89 (Ada, Hopper)
# Everything but the log goes to WORK (default: a new /tmp/gpu_check.XXXXXX, kept afterwards:
# the corpus, each training run's log and its final checkpoint, about 0.6 GB per run).
# Each step runs under a time limit. Exit status: 0 when every step passed, else 1.
# Needs a C++ compiler (build) and PYTHON (default python3) with a CUDA build of torch.
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root" || exit 1

export PYTHONUNBUFFERED=1
python=${PYTHON:-python3}
site=${SITE:-/tmp/gpu_check_site}
train_iters=${TRAIN_ITERS:-100}
min_loss_drop=${MIN_LOSS_DROP:-2.0}
micro_batch_size=${MICRO_BATCH_SIZE:-8}
model_args=${MODEL_ARGS:-"--num-layers 6 --hidden-size 512 --num-attention-heads 8
  --seq-length 512 --max-position-embeddings 512"}
model_args+=" --micro-batch-size $micro_batch_size"
vocab=(--vocab-file dataset/gpt2-vocab.json --merge-file dataset/gpt2-merges.txt)

# Install into $site the wheels in $WHEELS of what does not import: torchao's wheel where torchao
# does not, all the others (DeepSpeed and its dependencies) where DeepSpeed does not.
install_wheels() {
  local missing="" wheels=() wheel
  "$python" -c 'import deepspeed' 2>/dev/null || missing+=" deepspeed"
  "$python" -c 'import torchao' 2>/dev/null || missing+=" torchao"
  if [ -z "$missing" ]; then
    echo "deepspeed and torchao already importable: nothing to install"
  elif [ -n "${WHEELS:-}" ] && compgen -G "$WHEELS/*.whl" >/dev/null; then
    for wheel in "$WHEELS"/*.whl; do
      case $(basename "$wheel") in
        torchao-*) [[ $missing == *torchao* ]] && wheels+=("$wheel") ;;
        *) [[ $missing == *deepspeed* ]] && wheels+=("$wheel") ;;
      esac
    done
    echo "not importable:$missing; installing ${#wheels[@]} wheel(s) from $WHEELS into $site" \
      "(no index)"
    if [ "${#wheels[@]}" -gt 0 ]; then
      "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$site" "${wheels[@]}" || return 1
    fi
  else
    echo "not importable:$missing; WHEELS names no folder of wheels"
  fi
  "$python" -c 'import torchao; print("torchao", torchao.__version__, "from", torchao.__file__)' \
    2>/dev/null || echo "torchao not importable: the fp8 step will skip"
  "$python" -c 'import deepspeed, pydantic
print("deepspeed", deepspeed.__version__, "from", deepspeed.__file__, "| pydantic", pydantic.__version__)'
}

# The quickstart's corpus (this Python's standard library .py files), tokenized into $1.
build_data() {
  "$python" tools/files_to_jsonl.py --extensions .py --output "$1/corpus.jsonl" &&
    "$python" tools/preprocess_data.py --input "$1/corpus.jsonl" --json-keys content \
      --output-prefix "$1/corpus" --tokenizer-type GPT2BPETokenizer "${vocab[@]}" \
      --append-eod --workers "$(nproc)" --log-interval 1000
}

# Read the iteration lines of training log $1: fail on a NaN iteration, a missing or
# non-finite loss (an interval of only skipped fp16 steps has none, rightly), or a loss that
# fell by less than $2 from the first logged value to the last.
check_loss() {
  "$python" - "$1" "$2" <<'EOF'
import math
import sys

from megatron.training.monitor import parse_iteration_log

log, min_drop = sys.argv[1], float(sys.argv[2])
losses, problems, all_skipped = [], [], 0
with open(log, errors="replace") as file:
    for line in file:
        try:
            fields = parse_iteration_log(line)
        except ValueError:
            continue
        iteration = fields["iteration"]
        if fields.get("number of nan iterations", 0):
            problems.append(f"iteration {iteration}: {fields['number of nan iterations']} NaN")
        if "lm loss" in fields:
            losses.append((iteration, float(fields["lm loss"])))
        elif fields.get("number of skipped iterations", 0):
            # fp16: while the loss scale backs off, every step of the interval can be skipped;
            # Megatron then averages no loss and prints none.
            all_skipped += 1
        else:  # Megatron prints only a positive average: NaN, infinite or missing is broken
            problems.append(f"iteration {iteration}: no lm loss and no skipped iterations")
losses_text = " ".join(f"{loss:.3f}" for _, loss in losses)
print(f"loss check: {len(losses)} logged losses ({losses_text}); "
      f"{all_skipped} interval(s) with every step skipped (fp16 loss-scale back-off)")
problems += [f"iteration {it}: loss {loss}" for it, loss in losses if not math.isfinite(loss)]
if problems:
    sys.exit("loss check: FAIL, " + "; ".join(problems))
if len(losses) < 2:
    sys.exit(f"loss check: FAIL, {len(losses)} logged loss(es) in {log}, need at least 2")
(first_it, first), (last_it, last) = losses[0], losses[-1]
if first - last < min_drop:
    sys.exit(f"loss check: FAIL, the loss fell by {first - last:.3f} < {min_drop}")
print(f"loss check: OK, finite; {first:.3f} at iteration {first_it} -> {last:.3f} at "
      f"{last_it} (fell by {first - last:.3f} >= {min_drop})")
EOF
}

# Train a small GPT-2 (MODEL_ARGS, default 6 layers, 512 wide, 8 heads, 512 tokens; the real
# vocabulary) with DeepSpeed ZeRO-1 in precision $1 (bf16, fp16 or fp32) on engine $2 (pipe or
# nopipe) on the dataset in $3: 2 micro-batches of MICRO_BATCH_SIZE (8) per iteration, cosine
# decay, validation twice, one checkpoint at the end. Then check the loss.
train() {
  local precision=$1 engine=$2 work=$3 name="$1-$2" extra=()
  if [ "$engine" = nopipe ]; then extra+=(--no-pipeline-parallel); fi
  if [ "$precision" != fp32 ]; then extra+=("--$precision"); fi
  local ds_config="$work/ds_zero1.json" train_log="$work/train-$name.log" launcher=("$python")
  echo '{"zero_optimization": {"stage": 1}}' > "$ds_config"
  if command -v deepspeed >/dev/null 2>&1; then launcher=(deepspeed --num_gpus 1); fi
  # shellcheck disable=SC2086
  "${launcher[@]}" pretrain_gpt.py --deepspeed --deepspeed_config "$ds_config" --zero-stage 1 \
    $model_args --global-batch-size $((2 * micro_batch_size)) --train-iters "$train_iters" \
    --lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine \
    --lr-warmup-fraction 0.1 --weight-decay 0.1 --clip-grad 1.0 --seed 1234 \
    --data-path "$work/corpus_content_document" --split 98,1,1 "${vocab[@]}" \
    --log-interval 10 --eval-interval "$((train_iters / 2))" --eval-iters 5 \
    --save "$work/checkpoints-$name" --save-interval "$train_iters" \
    "${extra[@]}" 2>&1 | tee "$train_log"
  local rc=${PIPESTATUS[0]}
  if [ "$rc" -ne 0 ]; then
    echo "training exited with status $rc"
    return "$rc"
  fi
  check_loss "$train_log" "$min_loss_drop"
}

# FP8 against bf16 on a 1B-class LLaMA (benchmarks/fp8_throughput.py) on the data step's corpus
# in $1, which it builds first where that step did not run; each run's whole log in $1/fp8.
fp8_bench() {
  if [ ! -f "$1/corpus_content_document.idx" ]; then build_data "$1" || return 1; fi
  "$python" benchmarks/fp8_throughput.py --data-path "$1/corpus_content_document" \
    --work-dir "$1/fp8"
}

# A step runs as `bash gpu_check.sh --internal COMMAND...` under `timeout`, so that functions
# above can be time-limited too and a timeout ends the whole process tree of the step.
if [ "${1:-}" = --internal ]; then
  shift
  "$@"
  exit
fi

device=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1 |
  tr '[:upper:] ' '[:lower:]-' | tr -cd 'a-z0-9-')
log=$(realpath -m "${1:-benchmarks/results/${device:-no-gpu}-$(date -u +%F).txt}")
mkdir -p "$(dirname "$log")" && : > "$log"
exec > >(tee -a "$log") 2>&1
steps=${STEPS:-env deps build doctor tests data train bench fp8}
work=${WORK:-$(mktemp -d /tmp/gpu_check.XXXXXX)}
mkdir -p "$work"
start=$(date +%s)
results=()

wants() { [[ " $steps " == *" $1 "* ]]; }

# run_step NAME TIMEOUT_S COMMAND...: run with a time limit; record PASS/FAIL and the time.
run_step() {
  local name=$1 limit=$2 began rc took
  shift 2
  began=$(date +%s)
  printf '\n==> [%s] %s (limit %ss, %ss so far)\n' "$name" "$*" "$limit" "$((began - start))"
  timeout --kill-after=10 "$limit" bash "${BASH_SOURCE[0]}" --internal "$@"
  rc=$?
  took=$(($(date +%s) - began))
  if [ "$rc" -eq 0 ]; then
    results+=("PASS  $name (${took}s)")
  else
    if [ "$rc" -eq 124 ]; then echo "timed out after ${limit}s"; fi
    results+=("FAIL  $name (exit $rc, ${took}s)")
  fi
  return "$rc"
}

echo "gpu_check: $(date -u +%FT%TZ); log $log; work dir $work"
if wants env; then
  echo "== env"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 || echo "no nvidia-smi"
  echo "host: $(uname -srm), $(nproc) cores; c++: $(command -v g++ || command -v c++ || echo none)"
  echo "git: $(git rev-parse --short HEAD 2>/dev/null || echo 'no git checkout')," \
    "$(git status --porcelain 2>/dev/null | wc -l) changed or untracked path(s)"
  "$python" -c 'import sys, torch
print(f"python {sys.version.split()[0]} ({sys.executable}); torch {torch.__version__}, "
      f"CUDA {torch.version.cuda}, GPU available: {torch.cuda.is_available()}")
import os, sysconfig
include = sysconfig.get_paths()["include"]
header = os.path.join(include, "Python.h")
print(f"{header} exists: {os.path.isfile(header)}")' ||
    results+=("FAIL  env (torch does not import)")
fi

if wants deps; then
  if ! "$python" -c 'import deepspeed, torchao' 2>/dev/null; then
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" PATH="$site/bin:$PATH"
  fi
  run_step deps 300 install_wheels
fi

if wants build; then
  run_step build 300 "$python" setup.py -q build_ext --inplace
fi

if wants doctor; then
  run_step doctor 120 "$python" -m megatron.doctor
fi

if wants tests; then
  xdist=()   # where pytest-xdist is installed, the larger set runs in parallel processes
  if "$python" -c 'import xdist' 2>/dev/null; then xdist=(-n "${XDIST_WORKERS:-8}"); fi
  # Each module's GPU tests on one worker (their fixtures' runs shared), modules side by side.
  gpu_xdist=()
  if [ "${#xdist[@]}" -gt 0 ]; then gpu_xdist=(-n "${GPU_XDIST_WORKERS:-4}" --dist loadfile); fi
  run_step "pytest -m gpu" 420 "$python" -m pytest -q -p no:cacheprovider "${gpu_xdist[@]}" \
    -m gpu tests
fi

if wants tests-more; then
  xdist=()   # where pytest-xdist is installed, the larger set runs in parallel processes
  if "$python" -c 'import xdist' 2>/dev/null; then xdist=(-n "${XDIST_WORKERS:-8}"); fi
  run_step "pytest CUDA-touching tests + tests/model" 420 "$python" -m pytest -q \
    -p no:cacheprovider "${xdist[@]}" tests/training/test_optimizer.py tests/test_doctor.py \
    tests/training/test_monitor.py tests/core/test_random.py tests/core/test_deepspeed_mpu.py tests/model
fi

if wants data; then
  run_step data 300 build_data "$work"
fi

if wants train; then
  # Two runs unless PRECISIONS or ENGINES ask for their product: bf16 on the pipeline engine
  # (the --deepspeed default), fp16 on the other (its loss scaling).
  runs=${TRAIN_RUNS:-bf16:pipe fp16:nopipe}
  if [ -n "${PRECISIONS:-}${ENGINES:-}" ]; then
    runs=""
    for precision in ${PRECISIONS:-bf16 fp16}; do
      for engine in ${ENGINES:-pipe nopipe}; do runs+=" $precision:$engine"; done
    done
  fi
  for run in $runs; do
    precision=${run%%:*} engine=${run##*:}
    run_step "train $precision ZeRO-1 $engine" 240 train "$precision" "$engine" "$work"
  done
fi

if wants quickstart; then
  run_step quickstart 600 env DATA_DIR="$work/quickstart/data" RUN_DIR="$work/quickstart/run" \
    CHECKPOINT_PATH="$work/quickstart/checkpoints" bash examples/quickstart.sh
fi

if wants bench; then
  # Compiled, as the GPU runs train: at 124M the three engines (issue 56: DeepSpeed's engine
  # >= 0.95x and its pipeline engine at PP=1 >= 0.9x the plain engine) and the baseline; at
  # 350M the plain engine and the baseline. One inductor cache for all: the plain and the
  # DeepSpeed engine compile the same whole-model graph. About 5 minutes on an H200.
  export TORCHINDUCTOR_CACHE_DIR="$work/inductor"
  run_step "bench 124M" 330 "$python" benchmarks/gpu_throughput.py --model 124M --modes compile \
    --engines plain nopipe pipe --iters 8 --warmup 3 --plan
  run_step "bench 350M" 180 "$python" benchmarks/gpu_throughput.py --model 350M --modes compile \
    --engines plain --iters 8 --warmup 3
fi

if wants sweep; then
  # Not in the default steps (about 6 minutes more): what the plain engine's MFU at 124M gets
  # from CUDA graphs and autotuned matmuls (inductor's own settings), and from micro-batch 16.
  export TORCHINDUCTOR_CACHE_DIR="$work/inductor"
  run_step "sweep inductor" 420 "$python" benchmarks/gpu_throughput.py --model 124M \
    --modes compile --engines plain --inductor default cudagraphs autotune-gemm --no-baseline
  run_step "sweep micro-batch 16" 180 "$python" benchmarks/gpu_throughput.py --model 124M \
    --modes compile --engines plain --micro-batch-size 16 --no-baseline
fi

if wants fp8; then
  # Where FP8 cannot run (no torchao, or a GPU before sm_89), one line: the one pretrain_gpt.py
  # --fp8-format would stop with. Any other failure of the check shows in the step's own run.
  why=$("$python" benchmarks/fp8_throughput.py --check 2>/dev/null)
  if [ $? -eq 3 ]; then
    printf '\n==> [fp8] skipped: %s\n' "$why"
    results+=("SKIP  fp8 ($why)")
  else
    run_step fp8 420 fp8_bench "$work"
  fi
fi

printf '\n== summary (%ss in all; log %s)\n' "$(($(date +%s) - start))" "$log"
failed=0 skipped=0
for result in "${results[@]}"; do
  echo "  $result"
  if [[ $result == FAIL* ]]; then failed=$((failed + 1)); fi
  if [[ $result == SKIP* ]]; then skipped=$((skipped + 1)); fi
done
summary="$((${#results[@]} - failed - skipped)) passed, $failed failed"
if [ "$skipped" -gt 0 ]; then summary+=", $skipped skipped"; fi
echo "$summary"
[ "$failed" -eq 0 ]
