"""recipes/kv_retrieval/two_nodes.sh: the stock main_ppo on two Ray nodes of one machine (a head and a second
raylet, one logical GPU = one CPU trainer rank each; trainer.nnodes=2, one context-parallel group spanning both
nodes), on a tiny random-init MoE with its experts split over the CP pair (expert_parallel). Two steps and a
checkpoint, the context-parallel and expert-parallel metrics of every step, and no process of the nodes left.
Resuming is the single-node job's test (tests/test_main_job.py); an expert-parallel checkpoint's round trip is
tests/integration/test_ep_engine.py's. Minutes, needs .venv-cpu; LONGSTRAW_E2E=0 skips it.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from verl_longstraw.testing.scripts import load_script

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "recipes" / "kv_retrieval"
summarize = load_script(RECIPE / "summarize.py")

E2E = pytest.mark.skipif(os.environ.get("LONGSTRAW_E2E") == "0", reason="end-to-end run switched off (LONGSTRAW_E2E=0)")
# tests/test_main_job.py's small job: 2 prompts x 8 responses, 100 pairs (~400-token prompts), a 40-step warm start
E2E_ENV = {"BATCH": "2", "NUM_PAIRS": "100", "WARMUP_STEPS": "40"}


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Path:
    """Data, tokenizer and warm-started model, built once (run.sh skips its prepare step on a copy)."""
    wd = tmp_path_factory.mktemp("prepared")
    p = subprocess.run([sys.executable, str(RECIPE / "prepare.py"), "--workdir", str(wd), "--num-pairs",
                        E2E_ENV["NUM_PAIRS"], "--warmup-steps", E2E_ENV["WARMUP_STEPS"]],
                       text=True, capture_output=True, timeout=600)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    return wd


def _session_pids(sessions: list[int]) -> list[int]:
    out = subprocess.run(["ps", "-e", "-o", "pid=,sid="], text=True, capture_output=True).stdout
    return [int(pid) for pid, sid in (line.split() for line in out.splitlines()) if int(sid) in sessions]


def _run_two_nodes(env: dict, timeout: float) -> str:
    """two_nodes.sh in its own session; returns its output. Past ``timeout``: SIGTERM (its trap stops the job and
    the nodes), SIGKILL a minute later, then SIGKILL to whatever is left in the sessions it recorded."""
    env = {key: value for key, value in env.items() if key != "ONEDNN_MAX_CPU_ISA"}  # see test_main_job._run_recipe
    sessions_file = Path(env["WORKDIR"]) / "logs" / "two_nodes_sessions"
    proc = subprocess.Popen(["bash", str(RECIPE / "two_nodes.sh")], env=env, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            out, _ = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
        pytest.fail(f"two_nodes.sh ran past {timeout}s:\n{out[-6000:]}")
    finally:
        if sessions_file.exists():  # the script was killed before its trap ran
            for pid in _session_pids([int(sid) for sid in sessions_file.read_text().split()]):
                os.kill(pid, signal.SIGKILL)
    assert proc.returncode == 0, out[-6000:]
    assert "2 nodes up" in out
    # the script's trap stopped both nodes: nothing is left in their sessions
    sessions = [int(sid) for sid in re.search(r"stopping the Ray nodes \(sessions ([\d ]+)\)", out).group(1).split()]
    time.sleep(1)
    assert len(sessions) == 2 and _session_pids(sessions) == []
    return out


def _workdir(prepared: Path, tmp_path: Path, *names: str) -> dict:
    wd = tmp_path / "wd"
    for name in names:
        shutil.copytree(prepared / name, wd / name)
    return dict(os.environ, WORKDIR=str(wd), **E2E_ENV)


def _assert_cp_steps(workdir: str, steps: list[int]) -> None:
    """Each step's tracking output carries the CP path's metrics: both ranks ran each group together, across the
    two nodes."""
    metrics = summarize.load_metrics(workdir)
    assert sorted(metrics) == steps
    for data in metrics.values():
        for key in ("cp_collective_bytes", "prompt_state_bytes", "state_grad_device_bytes", "capture_seconds"):
            assert data[f"actor/longstraw/{key}"] > 0, key
        # dispatch by CP group: both ranks get the whole batch, one micro-batch per group (2 groups)
        assert data["actor/longstraw/groups"] == 2
        assert data["actor/longstraw/single_forward"] == 1  # veRL's ppo_loss (vanilla) trains in one replay
        for key in ("critic/score/mean", "critic/rewards/mean", "actor/pg_loss", "actor/grad_norm"):
            assert math.isfinite(data[key]), key


@E2E
def test_two_nodes_moe_expert_parallel(prepared, tmp_path):
    """A tiny Qwen3-MoE (tiny_moe.py: random init, 4 routed experts, 2 per rank; a 40-step warm start, so rewards
    differ within a group and the gradient is not zero) with expert_parallel=true: two steps and a checkpoint."""
    env = dict(_workdir(prepared, tmp_path, "data"), STEPS="2", SAVE_FREQ="2", MODEL_FAMILY="qwen3_moe",
               EXPERT_PARALLEL="1")
    out = _run_two_nodes(env, timeout=900)
    assert "[tiny_moe] qwen3_moe" in out
    assert summarize.checkpoint_state(env["WORKDIR"], 2) == ("done", 2)
    _assert_cp_steps(env["WORKDIR"], [1, 2])
    metrics = summarize.load_metrics(env["WORKDIR"]).values()
    assert all(data["actor/longstraw/ep_collective_bytes"] > 0 for data in metrics)  # tokens went to the experts
    assert any(data["actor/grad_norm"] > 0 for data in metrics)
