#!/usr/bin/env bash
# The kv_retrieval job on two Ray nodes of one machine: the multi-node path of the cluster recipes
# (recipes/clusters/launch_recipe.sh), on CPU. A Ray head and a second node (separate raylets, each with one
# logical GPU = one CPU trainer rank) form a cluster; run.sh's main_ppo joins it (RAY_ADDRESS) with
# trainer.nnodes=2 trainer.n_gpus_per_node=1 and one context-parallel group spanning both nodes
# (context_parallel_size=2). Both nodes are stopped on exit, also on failure or interruption.
#
#   bash recipes/kv_retrieval/two_nodes.sh [Hydra overrides]
#   MODEL_FAMILY=qwen3_moe EXPERT_PARALLEL=1 bash recipes/kv_retrieval/two_nodes.sh
#
# Knobs (environment): run.sh's (STEPS, BATCH, NUM_PAIRS, SAVE_FREQ, WARMUP_STEPS, WORKDIR, VENV, ...), and
# MODEL_FAMILY: qwen3_next (default: the recipe's warm-started hybrid) or qwen3_moe (tiny_moe.py: a tiny
#   random-init MoE, 4 routed experts, warm-started for WARMUP_STEPS (default 40 here); its own default WORKDIR);
# EXPERT_PARALLEL=1: longstraw.expert_parallel=true (the routed experts split over the CP pair; MoE models only);
# CPUS_PER_NODE: Ray CPU slots per node (default 8, as run.sh's one node: a trainer bundle takes 3, the
#   TaskRunner and the transfer-queue actors land on either node);
# RAY_NODE_TIMEOUT: seconds to wait for the two nodes (default 180).
# Re-running resumes from the last checkpoint, as run.sh does. The nodes and the job run in sessions of their own,
# whose ids are in $WORKDIR/logs/two_nodes_sessions while they run (a caller that must SIGKILL this script can
# stop them from it).
set -euo pipefail

RECIPE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$RECIPE/../.." && pwd)"
export VENV="${VENV:-$REPO/.venv-cpu}"
PY="$VENV/bin/python"
MODEL_FAMILY="${MODEL_FAMILY:-qwen3_next}"
EXPERT_PARALLEL="${EXPERT_PARALLEL:-0}"
CPUS_PER_NODE="${CPUS_PER_NODE:-8}"
RAY_NODE_TIMEOUT="${RAY_NODE_TIMEOUT:-180}"

case "$MODEL_FAMILY" in
    qwen3_next) export WORKDIR="${WORKDIR:-$REPO/runs/kv_retrieval_two_nodes}" ;;
    qwen3_moe) export WORKDIR="${WORKDIR:-$REPO/runs/kv_retrieval_two_nodes_moe}" ;;
    *) echo "MODEL_FAMILY=$MODEL_FAMILY: use qwen3_next (the recipe's model) or qwen3_moe (tiny MoE)" >&2; exit 2 ;;
esac
JOB=(trainer.nnodes=2 trainer.n_gpus_per_node=1 actor_rollout_ref.actor.longstraw.context_parallel_size=2
     # connecting to a running cluster, ray.init takes no resource counts (the nodes declare them)
     ray_kwargs.ray_init.num_cpus=null ray_kwargs.ray_init.num_gpus=null)
if [[ "$EXPERT_PARALLEL" == 1 ]]; then
    [[ "$MODEL_FAMILY" == qwen3_moe ]] || { echo "EXPERT_PARALLEL=1 needs MODEL_FAMILY=qwen3_moe" >&2; exit 2; }
    JOB+=(++actor_rollout_ref.actor.longstraw.expert_parallel=true)
fi

mkdir -p "$WORKDIR/logs" "$WORKDIR/metrics"
if [[ "$MODEL_FAMILY" == qwen3_moe ]]; then  # before run.sh: its prepare step then builds the data only
    "$PY" "$RECIPE/tiny_moe.py" --model-dir "$WORKDIR/model" --num-pairs "${NUM_PAIRS:-400}" \
        --warmup-steps "${WARMUP_STEPS:-40}" --warmup-time-budget "${WARMUP_SECONDS:-600}"
fi

# Ray's workers inherit the environment of `ray start`, not main_ppo's: run.sh's job environment is set here,
# before the nodes start (run.sh sets it again for the driver; the driver's metrics file stays unused).
STAMP="$(date +%Y%m%d-%H%M%S)"
export VLLM_CPU_OMP_THREADS_BIND=auto VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-2}"
export PYTHONPATH="$RECIPE${PYTHONPATH:+:$PYTHONPATH}" VERL_USE_EXTERNAL_MODULES=cpu_compat
export VERL_FILE_LOGGER_PATH="$WORKDIR/metrics/attempt-$STAMP-two-nodes.jsonl"
export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 RAY_DEDUP_LOGS=0 PYTHONWARNINGS=ignore
# Ray 2.60 turns token authentication on for a new head by default, and a node joining without this setting is
# refused (InvalidAuthToken): token mode everywhere (the token is ~/.ray/auth_token, created by the head if missing).
export RAY_AUTH_MODE=token
# On SIGTERM `ray start --block` stops its node's processes; without this it first drains the node for up to 30 s
# through the GCS, which the head may already have stopped.
export RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S=0

SESSIONS_FILE="$WORKDIR/logs/two_nodes_sessions"
NODE_PIDS=() JOB_PID="" RAY_TMP=""

start_node() {  # start_node NAME ARGS...: `ray start --block` as the leader of a new session
    local name="$1"; shift
    # a temp dir per node, as on two machines (with a shared one, each node's log monitor forwards every log twice)
    setsid "$VENV/bin/ray" start --block --temp-dir "$RAY_TMP/$name" --node-ip-address 127.0.0.1 --disable-usage-stats \
        --num-cpus "$CPUS_PER_NODE" --num-gpus 1 "$@" >"$WORKDIR/logs/ray-$name-$STAMP.log" 2>&1 &
    NODE_PIDS+=($!)
    disown $!  # stopped by stop_nodes, not reported by bash when killed
    echo "${NODE_PIDS[*]}" >"$SESSIONS_FILE"
}

session_pids() {  # session_pids SID...: the live processes of these sessions
    ps -e -o pid=,sid= | awk -v sessions=" $* " 'index(sessions, " " $2 " ") { print $1 }'
}

wait_sessions() {  # wait_sessions SECONDS SID...: wait for these sessions to end, then SIGKILL what is left
    local grace="$1" pids waited=0; shift
    while pids="$(session_pids "$@")" && [[ -n "$pids" ]] && (( waited < grace )); do sleep 1; waited=$((waited + 1)); done
    if [[ -n "$pids" ]]; then
        echo "    killing what is left: $(echo $pids)"
        # shellcheck disable=SC2086
        kill -KILL $pids 2>/dev/null || true
    fi
}

stop_nodes() {  # on exit: the job if it still runs, then the nodes (`ray start --block` stops its node on SIGTERM)
    local rc=$?
    trap - EXIT INT TERM
    if [[ -n "$JOB_PID" && -n "$(session_pids "$JOB_PID")" ]]; then
        echo "==> stopping the job (session $JOB_PID)"
        # shellcheck disable=SC2046
        kill -TERM $(session_pids "$JOB_PID") 2>/dev/null || true
        wait_sessions 15 "$JOB_PID"
    fi
    if (( ${#NODE_PIDS[@]} )); then
        echo "==> stopping the Ray nodes (sessions ${NODE_PIDS[*]})"
        kill -TERM "${NODE_PIDS[@]}" 2>/dev/null || true
        wait_sessions 30 "${NODE_PIDS[@]}"
    fi
    rm -f "$SESSIONS_FILE"
    if (( rc == 0 )) && [[ -n "$RAY_TMP" ]]; then rm -rf "$RAY_TMP"
    elif [[ -n "$RAY_TMP" ]]; then echo "Ray's logs: $RAY_TMP/{head,worker}/session_*/logs" >&2; fi
    exit "$rc"
}
trap stop_nodes EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# This cluster's own temp dir (short: Ray's socket paths) and ports, so other Ray clusters on the machine are
# untouched; `ray stop` is not used: it kills every Ray process of the machine.
RAY_TMP="$(mktemp -d /tmp/ls2n-XXXXXX)"
read -r GCS_PORT CLIENT_PORT DASHBOARD_PORT HEAD_AGENT_PORT WORKER_AGENT_PORT < <("$PY" -c '
import socket
socks = [socket.socket() for _ in range(5)]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(*(s.getsockname()[1] for s in socks))')
export RAY_ADDRESS="127.0.0.1:$GCS_PORT"

echo "==> Ray head (127.0.0.1:$GCS_PORT) and a second node, $CPUS_PER_NODE CPUs + 1 logical GPU each, in $RAY_TMP"
start_node head --head --port "$GCS_PORT" --include-dashboard false --dashboard-port "$DASHBOARD_PORT" \
    --ray-client-server-port "$CLIENT_PORT" --dashboard-agent-listen-port "$HEAD_AGENT_PORT"
# the second node joins once the head's GCS answers (`ray start --address` gives up if it does not)
"$PY" - "$RAY_NODE_TIMEOUT" <<'EOF'
import os, socket, sys, time
host, port = os.environ["RAY_ADDRESS"].split(":")
deadline = time.time() + float(sys.argv[1])
while True:
    try:
        socket.create_connection((host, int(port)), timeout=2).close()
        break
    except OSError:
        if time.time() > deadline:
            sys.exit(f"the Ray head did not open {host}:{port}")
        time.sleep(1)
EOF
start_node worker --address "$RAY_ADDRESS" --dashboard-agent-listen-port "$WORKER_AGENT_PORT"
"$PY" - "$RAY_NODE_TIMEOUT" <<'EOF'
import sys, time
import ray
ray.init(logging_level="ERROR")  # RAY_ADDRESS
deadline = time.time() + float(sys.argv[1])
while (nodes := [n for n in ray.nodes() if n["Alive"]]) and sum(n["Resources"].get("GPU", 0) for n in nodes) < 2:
    if time.time() > deadline:
        sys.exit(f"the second Ray node did not join: {len(nodes)} node(s) alive")
    time.sleep(2)
print(f"    {len(nodes)} nodes up: " + ", ".join(f"{n['NodeID'][:8]} ({n['Resources'].get('GPU', 0):g} GPU)" for n in nodes))
EOF

# run.sh in a session of its own, waited for in the background: a signal to this script runs the trap at once,
# which stops the job (main_ppo) before the nodes.
setsid bash "$RECIPE/run.sh" "${JOB[@]}" "$@" &
JOB_PID=$!
echo "${NODE_PIDS[*]} $JOB_PID" >"$SESSIONS_FILE"
wait "$JOB_PID"
