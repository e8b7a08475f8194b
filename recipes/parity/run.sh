#!/usr/bin/env bash
# Parity study: does longstraw train like standard GRPO?
#
# The kv_retrieval task of the main job, one warm-started model and one data set, trained
# with veRL's stock `fsdp2` actor, `longstraw` exact and `longstraw` detached, once per
# seed (the seed sets the data order and vLLM's sampling). Everything else is identical.
#
#   bash recipes/parity/run.sh                  # SEEDS="1 2 3" STEPS=20: 9 runs, ~1 h on 2 cores
#
# Knobs (environment): SEEDS, ARMS (subset of "fsdp2 exact detached"), STEPS, OUT, VENV,
# WARMUP_SECONDS. A finished run is skipped on a re-run (its final checkpoint marks it done),
# so an interrupted study continues where it stopped. Results: recipes/parity/results/.
set -euo pipefail

PARITY="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$PARITY/../.." && pwd)"
KV="$REPO/recipes/kv_retrieval"
VENV="${VENV:-$REPO/.venv-cpu}"
OUT="${OUT:-$REPO/runs/parity}"
SEEDS="${SEEDS:-1 2 3}"
ARMS="${ARMS:-fsdp2 exact detached}"
STEPS="${STEPS:-20}"
export VENV

bash "$REPO/scripts/setup_cpu_env.sh"
"$VENV/bin/python" "$KV/prepare.py" --workdir "$OUT/base" --warmup-time-budget "${WARMUP_SECONDS:-600}"

for seed in $SEEDS; do
    for arm in $ARMS; do
        case "$arm" in
            fsdp2) strategy=fsdp2; extra=() ;;
            exact|detached) strategy=longstraw; extra=("actor_rollout_ref.actor.longstraw.prompt_grad=$arm") ;;
            *) echo "ARMS: unknown arm '$arm' (use fsdp2, exact, detached)" >&2; exit 2 ;;
        esac
        wd="$OUT/$arm-seed$seed"
        mkdir -p "$wd"
        ln -sfn "$OUT/base/data" "$wd/data"
        ln -sfn "$OUT/base/model" "$wd/model"
        printf '\n######## parity: %s, seed %s, %s steps -> %s\n' "$arm" "$seed" "$STEPS" "$wd"
        WORKDIR="$wd" STRATEGY="$strategy" STEPS="$STEPS" SAVE_FREQ="$STEPS" \
            bash "$KV/run.sh" data.seed="$seed" actor_rollout_ref.rollout.seed="$seed" "${extra[@]}"
    done
done

"$VENV/bin/python" "$PARITY/analyze.py" --runs "$OUT" --seeds $SEEDS --arms $ARMS \
    --results "$PARITY/results" --command "bash recipes/parity/run.sh (SEEDS=\"$SEEDS\" STEPS=$STEPS)"
