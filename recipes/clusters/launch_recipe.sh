#!/usr/bin/env bash
# The cluster recipes' shared launcher, run by recipes/clusters/<name>/launch.sh with RECIPE (the
# configs/recipe overlay) and NNODES set. ROLE=worker joins the head's Ray cluster; the head (default)
# waits until NNODES x GPUS_PER_NODE GPUs have joined (with NNODES > 1 or USE_RAY_CLUSTER=1; otherwise
# main_ppo starts Ray in-process), then runs the stock trainer on `longstraw_grpo` + the overlay.
# LONGSTRAW_DRY_RUN=1 (head) prints the composed config (main_ppo --cfg job) without Ray or GPUs, then runs rank 0's
# training step of the recipe on MODEL_PATH's config.json on fake CUDA tensors (python -m verl_longstraw.dryrun
# --recipe: its peak beside the estimate; exit status 1 where it does not fit); LONGSTRAW_DRY_RUN_ARGS adds flags
# to it (e.g. "--gpu-gb 141", "--layers 4").
set -euo pipefail

RECIPE="${RECIPE:?set RECIPE (a configs/recipe overlay)}"
NNODES="${NNODES:?set NNODES}"
PYTHON="${PYTHON:-python}"
ROLE="${ROLE:-head}"
GPUS_PER_NODE="${GPUS_PER_NODE:-8}"
RAY_PORT="${RAY_PORT:-6379}"
# Long prompts: allocator fragmentation matters more than usual with multi-GiB state blocks.
export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"
# Ray turns token authentication on by default (2.59: local clusters, 2.61: every cluster), and a node whose
# setting differs from the head's is refused: token mode on every node, one token. The head uses (or makes)
# ~/.ray/auth_token; a worker needs the same token: RAY_AUTH_TOKEN (on the head: `ray get-auth-token`) or the
# file at RAY_AUTH_TOKEN_PATH / ~/.ray/auth_token (a shared home).
export RAY_AUTH_MODE="${RAY_AUTH_MODE:-token}"

if [[ "$ROLE" == worker ]]; then
  HEAD_IP="${HEAD_IP:?set HEAD_IP to the head node address}"
  if [[ "$RAY_AUTH_MODE" == token && -z "${RAY_AUTH_TOKEN:-}" && ! -s "${RAY_AUTH_TOKEN_PATH:-$HOME/.ray/auth_token}" ]]; then
    echo "RAY_AUTH_MODE=token and no token here: set RAY_AUTH_TOKEN to the head's (run \`ray get-auth-token\` there)" >&2
    exit 2
  fi
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
  [[ "$RAY_AUTH_MODE" != token ]] || ray get-auth-token --generate >/dev/null  # the workers' token
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
  trainer.nnodes="$NNODES" trainer.n_gpus_per_node="$GPUS_PER_NODE" \
  actor_rollout_ref.model.path="$MODEL_PATH" \
  data.train_files="$TRAIN_FILES" data.val_files="$VAL_FILES" \
  "${EXTRA[@]}" "$@"
if [[ "${LONGSTRAW_DRY_RUN:-0}" == 1 ]]; then
  # shellcheck disable=SC2086
  "$PYTHON" -m verl_longstraw.dryrun --config "$MODEL_PATH" --recipe "$RECIPE" ${LONGSTRAW_DRY_RUN_ARGS:-}
fi
