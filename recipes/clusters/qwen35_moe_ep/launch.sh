#!/usr/bin/env bash
# GRPO with strategy=longstraw on 2 x 8 GPUs with Ray: Qwen3.5 MoE models, 2^21-token prompts, exact, one
# 16-rank context-parallel group over the 2 nodes with expert parallelism over the same 16.
#   RECIPE=qwen35_397b_ep_lora (default): Qwen3.5-397B-A17B with LoRA, the experts resident in bf16
#   RECIPE=qwen35_122b_ep:                Qwen3.5-122B-A10B full-parameter, the experts resident in fp32
# Composed and validated (tests/integration/test_cluster_recipes.py), NOT run; per-GPU tables in README.md.
#
# On the worker node:  ROLE=worker HEAD_IP=10.0.0.1 bash launch.sh
# On the head node:    ROLE=head MODEL_PATH=... TRAIN_FILES=... bash launch.sh [overrides...]
# Roles, Ray and dry runs (LONGSTRAW_DRY_RUN=1): recipes/clusters/launch_recipe.sh.
set -euo pipefail

# The overlays' CP group of 16 assumes 2 nodes.
export RECIPE="${RECIPE:-qwen35_397b_ep_lora}" NNODES="${NNODES:-2}"
case "$RECIPE" in
  qwen35_397b_ep_lora | qwen35_122b_ep) ;;
  *) echo "RECIPE must be qwen35_397b_ep_lora or qwen35_122b_ep, got $RECIPE" >&2; exit 2 ;;
esac
exec bash "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/../launch_recipe.sh" "$@"
