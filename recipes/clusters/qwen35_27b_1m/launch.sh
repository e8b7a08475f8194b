#!/usr/bin/env bash
# GRPO with strategy=longstraw on ONE 8-GPU node: Qwen3.5-27B-class model, ~1M-token prompts.
# Composed and validated (tests/integration/test_cluster_recipes.py), NOT run on a cluster.
#
#   MODEL_PATH=/models/Qwen3.5-27B TRAIN_FILES=/data/train.parquet VAL_FILES=/data/val.parquet \
#     bash recipes/clusters/qwen35_27b_1m/launch.sh [extra Hydra overrides...]
#
# LONGSTRAW_DRY_RUN=1 prints the composed config (main_ppo --cfg job) without Ray or GPUs.
# USE_RAY_CLUSTER=1 starts a local Ray head first (otherwise main_ppo starts Ray in-process).
set -euo pipefail

PYTHON="${PYTHON:-python}"
MODEL_PATH="${MODEL_PATH:?set MODEL_PATH to the HF model folder}"
TRAIN_FILES="${TRAIN_FILES:?set TRAIN_FILES (parquet)}"
VAL_FILES="${VAL_FILES:-$TRAIN_FILES}"

EXTRA=()
if [[ "${LONGSTRAW_DRY_RUN:-0}" == 1 ]]; then
  EXTRA+=(--cfg job)
elif [[ "${USE_RAY_CLUSTER:-0}" == 1 ]]; then
  ray start --head --port="${RAY_PORT:-6379}" --num-gpus=8
  trap 'ray stop' EXIT
  export RAY_ADDRESS="127.0.0.1:${RAY_PORT:-6379}"
fi

# Long prompts: allocator fragmentation matters more than usual with 64 GiB state blocks.
export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"

# longstraw_grpo is the primary config (it sets hydra.searchpath, which Hydra only allows in the
# primary config); configs/recipe/qwen35_27b_1m.yaml is appended to it as a @package _global_ overlay.
"$PYTHON" -m verl.trainer.main_ppo \
  --config-path "$("$PYTHON" -m verl_longstraw.configs)" --config-name longstraw_grpo \
  +recipe=qwen35_27b_1m \
  actor_rollout_ref.model.path="$MODEL_PATH" \
  data.train_files="$TRAIN_FILES" data.val_files="$VAL_FILES" \
  "${EXTRA[@]}" "$@"
