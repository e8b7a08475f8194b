#!/usr/bin/env bash
# GRPO with strategy=longstraw, exact, Qwen3.5-27B-class model, context parallel:
#   RECIPE=qwen35_27b_1m (default): 2^21-token prompts on ONE 8-GPU node (one 8-rank CP group);
#   RECIPE=qwen35_27b_4m: the 4.46M-position stress variant on TWO 8-GPU nodes (one 16-rank CP group).
# Composed and validated (tests/integration/test_cluster_recipes.py), NOT run on a cluster.
#
# One node:   MODEL_PATH=/models/Qwen3.5-27B TRAIN_FILES=/data/train.parquet bash launch.sh [overrides...]
# Two nodes:  ROLE=worker HEAD_IP=10.0.0.1 bash launch.sh                            # on the second node
#             RECIPE=qwen35_27b_4m MODEL_PATH=... TRAIN_FILES=... bash launch.sh     # on the head node
# The head waits until NNODES x 8 GPUs have joined Ray, then runs the trainer.
# LONGSTRAW_DRY_RUN=1 (head) prints the composed config (main_ppo --cfg job) without Ray or GPUs.
# USE_RAY_CLUSTER=1 starts a Ray head on a single node too (otherwise main_ppo starts Ray in-process).
set -euo pipefail

PYTHON="${PYTHON:-python}"
ROLE="${ROLE:-head}"
RECIPE="${RECIPE:-qwen35_27b_1m}"
case "$RECIPE" in
  qwen35_27b_1m) NNODES="${NNODES:-1}" ;;
  qwen35_27b_4m) NNODES="${NNODES:-2}" ;;
  *) echo "RECIPE must be qwen35_27b_1m or qwen35_27b_4m, got $RECIPE" >&2; exit 2 ;;
esac
GPUS_PER_NODE=8
RAY_PORT="${RAY_PORT:-6379}"
# Long prompts: allocator fragmentation matters more than usual with multi-GiB state blocks.
export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"

if [[ "$ROLE" == worker ]]; then
  HEAD_IP="${HEAD_IP:?set HEAD_IP to the head node address}"
  exec ray start --address="$HEAD_IP:$RAY_PORT" --num-gpus="$GPUS_PER_NODE" --block
fi
[[ "$ROLE" == head ]] || { echo "ROLE must be head or worker, got $ROLE" >&2; exit 2; }

MODEL_PATH="${MODEL_PATH:?set MODEL_PATH to the HF model folder (on every node)}"
TRAIN_FILES="${TRAIN_FILES:?set TRAIN_FILES (parquet)}"
VAL_FILES="${VAL_FILES:-$TRAIN_FILES}"

EXTRA=()
if [[ "${LONGSTRAW_DRY_RUN:-0}" == 1 ]]; then
  EXTRA+=(--cfg job)
elif (( NNODES > 1 )) || [[ "${USE_RAY_CLUSTER:-0}" == 1 ]]; then
  ray start --head --port="$RAY_PORT" --num-gpus="$GPUS_PER_NODE"
  trap 'ray stop' EXIT
  export RAY_ADDRESS="127.0.0.1:$RAY_PORT"
  want=$((NNODES * GPUS_PER_NODE))
  until have="$("$PYTHON" -c 'import ray; ray.init(address="auto", logging_level="ERROR"); print(int(ray.cluster_resources().get("GPU", 0)))')" \
        && (( have >= want )); do
    echo "waiting for GPUs: ${have:-0}/$want"; sleep 10
  done
fi

# longstraw_grpo is the primary config (it sets hydra.searchpath, which Hydra only allows in the
# primary config); configs/recipe/$RECIPE.yaml is appended to it as a @package _global_ overlay.
"$PYTHON" -m verl.trainer.main_ppo \
  --config-path "$("$PYTHON" -m verl_longstraw.configs)" --config-name longstraw_grpo \
  +recipe="$RECIPE" \
  trainer.nnodes="$NNODES" \
  actor_rollout_ref.model.path="$MODEL_PATH" \
  data.train_files="$TRAIN_FILES" data.val_files="$VAL_FILES" \
  "${EXTRA[@]}" "$@"
