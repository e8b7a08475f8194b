#!/usr/bin/env bash
# GRPO with strategy=longstraw on NNODES x 8 GPUs with Ray: GLM-5-class MLA MoE model, 2^21-token
# prompts, exact, one 8-rank context-parallel group per node (4 nodes: 4 data-parallel replicas).
# Composed and validated (tests/integration/test_cluster_recipes.py), NOT run, and it does NOT fit:
# FSDP2 alone (no expert parallelism) puts 1/8 of all 744B parameters on every rank; see README.md.
#
# On every worker node (3):  ROLE=worker HEAD_IP=10.0.0.1 bash launch.sh
# On the head node:          ROLE=head MODEL_PATH=... TRAIN_FILES=... bash launch.sh [overrides...]
# Roles, Ray and dry runs (LONGSTRAW_DRY_RUN=1): recipes/clusters/launch_recipe.sh.
set -euo pipefail

# RECIPE=glm5_lora: the LoRA variant (one 32-rank CP group over the 4 nodes; its trainer fits, README.md).
# The overlays' rollout DP 4 / EP 32 assume 4 nodes.
export RECIPE="${RECIPE:-glm5_mla_multinode}" NNODES="${NNODES:-4}"
case "$RECIPE" in
  glm5_mla_multinode | glm5_lora) ;;
  *) echo "RECIPE must be glm5_mla_multinode or glm5_lora, got $RECIPE" >&2; exit 2 ;;
esac
exec bash "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/../launch_recipe.sh" "$@"
