#!/usr/bin/env bash
# GRPO with strategy=longstraw, exact, Qwen3.5-27B-class model, context parallel:
#   RECIPE=qwen35_27b_1m (default): 2^21-token prompts on ONE 8-GPU node (one 8-rank CP group);
#   RECIPE=qwen35_27b_4m: the 4.46M-position stress variant on TWO 8-GPU nodes (one 16-rank CP group);
#   RECIPE=qwen35_27b_1m_lora: the 2^21-token recipe with LoRA adapters (rank 64), ONE node;
#   RECIPE=qwen35_27b_8m_host: 2^23-token prompts on ONE 8-GPU node, the prompt state in host memory;
#   RECIPE=qwen35_27b_2m_4gpu_host: 2^21-token prompts on FOUR GPUs, the prompt state in host memory.
# Composed and validated (tests/integration/test_cluster_recipes.py), NOT run on a cluster.
#
# One node:   MODEL_PATH=/models/Qwen3.5-27B TRAIN_FILES=/data/train.parquet bash launch.sh [overrides...]
# Two nodes:  ROLE=worker HEAD_IP=10.0.0.1 bash launch.sh                            # on the second node
#             RECIPE=qwen35_27b_4m MODEL_PATH=... TRAIN_FILES=... bash launch.sh     # on the head node
# Roles, Ray and dry runs (LONGSTRAW_DRY_RUN=1): recipes/clusters/launch_recipe.sh.
set -euo pipefail

export RECIPE="${RECIPE:-qwen35_27b_1m}"
case "$RECIPE" in
  qwen35_27b_1m | qwen35_27b_1m_lora | qwen35_27b_8m_host | qwen35_27b_2m_4gpu_host) export NNODES="${NNODES:-1}" ;;
  qwen35_27b_4m) export NNODES="${NNODES:-2}" ;;
  *) echo "RECIPE must be qwen35_27b_1m, qwen35_27b_4m, qwen35_27b_1m_lora, qwen35_27b_8m_host or" \
          "qwen35_27b_2m_4gpu_host, got $RECIPE" >&2; exit 2 ;;
esac
exec bash "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/../launch_recipe.sh" "$@"
