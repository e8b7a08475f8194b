#!/usr/bin/env bash
# GRPO with strategy=longstraw on 4 x 8 GPUs with Ray: GLM-5.2 (MLA + DSA MoE, ~744B) with LoRA, 2^21-token
# prompts, exact, one 32-rank context-parallel group over the 4 nodes with expert parallelism over the same 32
# (configs/recipe/glm52_ep_lora.yaml). Composed and validated (tests/integration/test_cluster_recipes.py), NOT
# run; per-GPU tables in README.md.
#
# On every worker node (3):  ROLE=worker HEAD_IP=10.0.0.1 bash launch.sh
# On the head node:          ROLE=head MODEL_PATH=... TRAIN_FILES=... bash launch.sh [overrides...]
# Roles, Ray and dry runs (LONGSTRAW_DRY_RUN=1): recipes/clusters/launch_recipe.sh.
set -euo pipefail

# The overlay's rollout DP 4 / EP 32 and its CP group of 32 assume 4 nodes.
export RECIPE="${RECIPE:-glm52_ep_lora}" NNODES="${NNODES:-4}"
case "$RECIPE" in
  glm52_ep_lora) ;;
  *) echo "RECIPE must be glm52_ep_lora, got $RECIPE" >&2; exit 2 ;;
esac
exec bash "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/../launch_recipe.sh" "$@"
