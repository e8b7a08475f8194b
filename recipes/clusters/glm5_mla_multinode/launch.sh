#!/usr/bin/env bash
# GRPO with strategy=longstraw on NNODES x 8 GPUs with Ray: GLM-5-class MLA MoE model, 2^21-token
# prompts, exact, one 8-rank context-parallel group per node (4 nodes: 4 data-parallel replicas).
# Composed and validated (tests/integration/test_cluster_recipes.py), NOT run, and it does NOT fit:
# FSDP2 alone (no expert parallelism) puts 1/8 of all 744B parameters on every rank; see README.md.
#
# On every worker node (3):  ROLE=worker HEAD_IP=10.0.0.1 bash launch.sh
# On the head node:          ROLE=head MODEL_PATH=... TRAIN_FILES=... bash launch.sh [overrides...]
# The head waits until NNODES x 8 GPUs have joined, then runs the trainer on the Ray cluster.
# LONGSTRAW_DRY_RUN=1 (head) prints the composed config without Ray or GPUs.
set -euo pipefail

PYTHON="${PYTHON:-python}"
ROLE="${ROLE:-head}"
NNODES="${NNODES:-4}"  # the overlay's rollout DP 4 / EP 32 assume 4 nodes (one CP group each)
GPUS_PER_NODE="${GPUS_PER_NODE:-8}"
RAY_PORT="${RAY_PORT:-6379}"
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
else
  ray start --head --port="$RAY_PORT" --num-gpus="$GPUS_PER_NODE"
  trap 'ray stop' EXIT
  export RAY_ADDRESS="127.0.0.1:$RAY_PORT"
  want=$((NNODES * GPUS_PER_NODE))
  until have="$("$PYTHON" -c 'import ray; ray.init(address="auto", logging_level="ERROR"); print(int(ray.cluster_resources().get("GPU", 0)))')" \
        && (( have >= want )); do
    echo "waiting for GPUs: ${have:-0}/$want"; sleep 10
  done
fi

"$PYTHON" -m verl.trainer.main_ppo \
  --config-path "$("$PYTHON" -m verl_longstraw.configs)" --config-name longstraw_grpo \
  +recipe=glm5_mla_multinode \
  trainer.nnodes="$NNODES" trainer.n_gpus_per_node="$GPUS_PER_NODE" \
  actor_rollout_ref.model.path="$MODEL_PATH" \
  data.train_files="$TRAIN_FILES" data.val_files="$VAL_FILES" \
  "${EXTRA[@]}" "$@"
