#!/usr/bin/env bash
# Multi-node pretraining under SLURM: one task per node, each starting one process per GPU
# through a launch script of this repository. Submit it from the repository root:
#
#   sbatch --nodes 4 examples/pretrain_gpt_slurm.sh                      # DeepSpeed, ZeRO-1
#   MODEL_SIZE=345M sbatch --nodes 4 examples/pretrain_gpt_slurm.sh --bf16   # flags go through
#   LAUNCH_SCRIPT=examples/pretrain_gpt_distributed.sh sbatch --nodes 2 examples/pretrain_gpt_slurm.sh
#
# LAUNCH_SCRIPT (default scripts/ds_pretrain_gpt2.sh) is any of scripts/*.sh or
# examples/pretrain_gpt_distributed.sh; every variable they read (MODEL_SIZE, DATA_PATH,
# CHECKPOINT_PATH, TP, PP, ...) is passed on from the environment (sbatch exports it). This
# script sets, for each node, NNODES, NODE_RANK (SLURM_NODEID), MASTER_ADDR (the first node),
# MASTER_PORT and GPUS_PER_NODE; for the DeepSpeed scripts it writes a hostfile of the job's
# nodes and starts each node's launcher itself (DS_NO_SSH=1), so no ssh between nodes is needed.
# The #SBATCH lines below are defaults; sbatch's command-line options override them.
# --signal=TERM@300 sends SIGTERM 5 minutes before the time limit; with --exit-signal-handler
# (added below) the run saves a checkpoint and exits, and resubmitting the job resumes it.
#SBATCH --job-name=gpt2-pretrain
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --exclusive
#SBATCH --signal=TERM@300
#SBATCH --output=slurm-%j.out
set -euo pipefail
ROOT=${SLURM_SUBMIT_DIR:-$(pwd)}   # sbatch runs a copy of this file: the repository is the cwd
if [ ! -f "$ROOT/pretrain_gpt.py" ]; then
  echo "error: submit from the repository root (no pretrain_gpt.py in $ROOT)" >&2
  exit 1
fi
# shellcheck source=scripts/common.sh
source "$ROOT/scripts/common.sh"
if [ -z "${SLURM_JOB_NODELIST:-}" ]; then
  echo "error: SLURM_JOB_NODELIST is not set: run this through sbatch (or salloc)" >&2
  exit 1
fi

LAUNCH_SCRIPT=${LAUNCH_SCRIPT:-scripts/ds_pretrain_gpt2.sh}
if [ ! -f "$ROOT/$LAUNCH_SCRIPT" ]; then
  echo "error: LAUNCH_SCRIPT=$LAUNCH_SCRIPT: no such script in $ROOT" >&2
  exit 1
fi
mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
export NNODES=${SLURM_NNODES:-${#NODES[@]}}
export MASTER_ADDR=${MASTER_ADDR:-${NODES[0]}}
export MASTER_PORT=${MASTER_PORT:-6000}
export GPUS_PER_NODE=${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-$(default_procs_per_node 1)}}
export HOSTFILE=${HOSTFILE:-$ROOT/runs/slurm-${SLURM_JOB_ID:-job}.hostfile}
export DS_NO_SSH=1
mkdir -p "$(dirname "$HOSTFILE")"
for node in "${NODES[@]}"; do echo "$node slots=$GPUS_PER_NODE"; done > "$HOSTFILE"
echo "==> $NNODES node(s) x $GPUS_PER_NODE process(es): ${NODES[*]}; master $MASTER_ADDR:$MASTER_PORT"

# One task per node; each reads its own SLURM_NODEID as NODE_RANK (hence the single quotes).
# shellcheck disable=SC2016
srun --ntasks="$NNODES" --ntasks-per-node=1 --kill-on-bad-exit=1 \
  bash -c 'NODE_RANK=$SLURM_NODEID exec bash "$0" "$@"' "$ROOT/$LAUNCH_SCRIPT" \
  --exit-signal-handler "$@"
