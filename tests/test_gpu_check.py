"""benchmarks/gpu_check.py runs end to end at tiny size on CPU and writes its report; how it survives failures.

The end-to-end runs are subprocesses set up as the lent GPU machine is: no veRL, no flash-linear-attention (their
imports raise RuntimeError, as a broken install would, not ImportError), this package found by the scripts' own
sys.path entries alone (nothing on PYTHONPATH but the blocker, the editable install's finder removed, a temporary
cwd). Their default device is ``meta``: every tensor the check (or the code it calls) creates without naming a device
lands on ``meta`` and fails as soon as it meets the CPU tensors the check placed explicitly, as a CPU tensor would
meet CUDA tensors on a GPU. The supervisor runs each stage in a process of its own; the faults injected here (a stage
that hangs, a row that overruns its stage) act in those processes, through the same sitecustomize.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import transformers.models.kimi_linear.modeling_kimi_linear as kimi_modeling
import transformers.models.qwen3_5.modeling_qwen3_5 as qwen3_5_modeling

from verl_longstraw.ops.gated_delta import rule as gdn
from verl_longstraw.testing.scripts import load_script
from verl_longstraw.tiny import FAMILIES, VARIANTS, tiny_config, tiny_model

ROOT = Path(__file__).resolve().parents[1]
GPU_CHECK = ROOT / "benchmarks" / "gpu_check.py"
sys.path.insert(0, str(GPU_CHECK.parent))  # the stages import the supervisor's constants
gpu_check = load_script(GPU_CHECK)
stages = load_script(GPU_CHECK.parent / "gpu_check_stages.py")
# Ceilings, not budgets: a stage ends when its rows are done (the tiny scale series stop at P = 1024, every case's
# rows run), which takes a few percent of this on an idle 2-core machine, so the end-to-end tests assert row counts
# and hold on a box many times slower or busier. What a budget does when it runs out is tested with stages that
# overrun or hang on purpose (``faulty_run``), whatever the box's speed.
CEILINGS = {"ops": 300, "scale": 300, "equivalence": 1200, "fsdp2": 300}  # equivalence took 578 s on a box running
# three other CPU-bound jobs (2026-12-07), one row short of its 600
BUDGET = ["--budget-seconds", str(sum(CEILINGS.values()) + 120)]  # the whole run's, which caps every stage's
TINY_STAGE_SECONDS = [*BUDGET, *(arg for stage, seconds in CEILINGS.items() for arg in (f"--{stage}-seconds",
                                                                                       str(seconds)))]
RUN_TIMEOUT = sum(CEILINGS.values()) + 4 * 30 + 240  # the ceilings, each stage's overrun, the imports
FAULTY_STAGE_SECONDS = 45  # a faulty stage's time: its imports and first row start well within it on a busy box
# the newest cases of each kind: a Mamba2 hybrid, KDA, GLM-5.2's shared indexer (DSA top-k), Gated DeltaNet
SUITE_CASES = ["granitemoehybrid", "kimi_linear", "glm_moe_dsa_shared_indexer", "qwen3_5"]
# sitecustomize of the subprocesses: what a bare GPU machine lacks raises on import; the faults GPU_CHECK_FAULTS
# names ("stage:model_type:hang|slow", comma-separated) act in the standard path's first log-prob of a row of that
# model type in that stage's process (hang: never returns, the time-limit signal blocked as a CUDA call blocks it;
# slow: the row runs past the stage's deadline, on a controllable clock: the stage's time.monotonic jumps a second
# past it and the row's timer fires, so no wall time is spent); facts for the test at exit, one file per process
BARE_MACHINE = '''
import atexit, importlib.util, json, os, signal, sys, time

BLOCKED = ("verl", "fla")


class Blocked:
    attempts = set()

    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            cls.attempts.add(name)
            raise RuntimeError(f"{name} is blocked: installed but broken, as far as this process can tell")
        return None


sys.meta_path[:] = [Blocked] + [f for f in sys.meta_path if not getattr(f, "__module__", "").startswith("__editable")]
STAGE = sys.argv[sys.argv.index("--stage") + 1] if "--stage" in sys.argv else None
FAULTS = dict(f.rsplit(":", 1) for f in os.environ.get("GPU_CHECK_FAULTS", "").split(",") if f)
if STAGE is not None:
    import torch

    torch.set_default_device("meta")
if STAGE is not None and FAULTS:  # the checkout on sys.path now, as the stage script puts it there later
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(sys.argv[0]))))
    import verl_longstraw.testing.compare as testing

    full_log_probs = testing.full_log_probs
    wall_clock, skipped_seconds = time.monotonic, [0.0]
    time.monotonic = lambda: wall_clock() + skipped_seconds[0]

    def faulty_full_log_probs(model, *args, **kwargs):
        fault = FAULTS.pop(f"{STAGE}:{model.config.model_type}", None)
        if fault == "hang":
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
            time.sleep(3600)
        elif fault == "slow":
            until = float(sys.argv[sys.argv.index("--until") + 1])
            skipped_seconds[0] += max(until - time.monotonic() + 1.0, 0.0)
            os.kill(os.getpid(), signal.SIGALRM)  # the row's timer, as if its time had passed
        return full_log_probs(model, *args, **kwargs)

    testing.full_log_probs = faulty_full_log_probs


@atexit.register
def facts():
    package = sys.modules.get("verl_longstraw")
    with open(os.path.join(os.environ["BARE_MACHINE_FACTS"], f"{os.getpid()}.json"), "w") as f:
        json.dump({"stage": STAGE, "package": getattr(package, "__file__", None),
                   "attempts": sorted(Blocked.attempts),
                   "imported": sorted(n for n in sys.modules if n.partition(".")[0] in BLOCKED),
                   "flash_attn": importlib.util.find_spec("flash_attn") is not None}, f)
'''


def run_gpu_check(folder: Path, args: list[str], faults: str = "") -> subprocess.CompletedProcess:
    """``python benchmarks/gpu_check.py --tiny --out folder/out *args`` as on a bare machine (module docstring)."""
    site, facts = folder / "site", folder / "facts"
    site.mkdir(exist_ok=True)
    facts.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(BARE_MACHINE)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP")}
    env.update(PYTHONPATH=str(site), PYTHONNOUSERSITE="1", PYTHONUNBUFFERED="1", BARE_MACHINE_FACTS=str(facts),
               GPU_CHECK_FAULTS=faults)
    return subprocess.run([sys.executable, str(GPU_CHECK), "--tiny", "--out", str(folder / "out"), *args],
                          cwd=folder, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT)


def _compared(row: dict) -> bool:
    return "skipped" not in row and all(math.isfinite(row[k]) for k in ("log_prob_error", "grad_rel_l2"))


def test_gpu_check_tiny_on_a_bare_machine(tmp_path):
    run = run_gpu_check(tmp_path, ["--families", *SUITE_CASES, *TINY_STAGE_SECONDS])
    assert run.returncode == 0, run.stderr[-6000:]
    facts = [json.loads(p.read_text()) for p in (tmp_path / "facts").iterdir()]
    assert sorted(f["stage"] for f in facts if f["stage"]) == sorted(gpu_check.STAGES)  # a process per stage
    for f in facts:
        assert f["imported"] == [] and not f["flash_attn"], f  # as on the lent image
        if f["stage"]:
            assert Path(f["package"]).is_relative_to(ROOT / "verl_longstraw"), f
        else:
            assert f["package"] is None, f  # the supervisor needs the standard library only
    assert any("fla" in f["attempts"] for f in facts if f["stage"] == "equivalence"), facts  # transformers tried fla

    result = json.loads((tmp_path / "out" / "gpu_check_tiny.json").read_text())
    assert result["stage_order"] == ["ops", "scale", "equivalence", "fsdp2"]
    rows = result["equivalence"]
    # newest case first, bfloat16 -> autocast -> float32 within a case
    assert [r["key"] for r in rows] == [f"{case} {dtype}" for case in SUITE_CASES
                                        for dtype in gpu_check.EQUIVALENCE_DTYPES]
    assert all(_compared(r) and r["passed"] for r in rows), rows
    dsa = [r for r in rows if r["family"] == "glm_moe_dsa_shared_indexer"]
    assert all(r["groups"] == stages.SELECTION_GROUPS["glm_moe_dsa"] for r in dsa)
    fsdp = result["fsdp2"]  # the FSDP2 helpers run without veRL
    assert [r["family"] for r in fsdp] == SUITE_CASES and all(_compared(r) for r in fsdp), fsdp
    assert any(r["fits"] for r in result["scale"])
    assert {r["path"] for r in result["scale"]} == {"standard", "exact", "detached", "exact_host", "exact_streamed"}
    for path in stages.HOST_PATHS:  # the host bytes asked are the estimate's, the whole prompt state's when streamed
        host = [r for r in result["scale"] if r["path"] == path and r["fits"]]
        assert host and all(r["host_peak_bytes"] == r["estimated_host_bytes"] > 0 for r in host), host
    streamed = gpu_check.streamed_against_resident(result["scale"])
    assert streamed and all(r["seconds"] > 0 and r["peak"] > 0 for r in streamed), streamed  # the device row's pairs
    kernels = result["kernels"]
    assert set(kernels) == set(gpu_check.STAGES) and all(k["attention"] for k in kernels.values())
    ops = result["ops"]  # the fused op, two-shard pass-Q, MLA's and gpt-oss's sinks, within the standard's error
    assert [(r["shape"], r["op"], r["window"]) for r in ops] == [
        ("attention", "prefix_causal_attention", None), ("attention", "pass_q_two_ranks", None),
        ("mla absorbed", "prefix_causal_attention", None), ("gpt-oss full + sinks", "window_attention", None),
        ("gpt-oss window 8 + sinks", "window_attention", 8)], ops
    assert all(r["passed"] for r in ops) and ops[0]["paths"] == ops[3]["paths"] == {"fused_flash_cpu": 1}, ops
    assert [r["standard"].split()[0] for r in ops] == ["sdpa", "sdpa", "sdpa", "gpt_oss", "gpt_oss"], ops
    assert all("sinks" in r["errors"] and "standard_sinks" in r["abs_errors"] for r in ops[3:]), ops
    assert all(set(r["paths"]) <= set(kernels["ops"]["attention"]) for r in ops), kernels  # every row's kernels
    assert all(0 < r["error_ratio"] < math.inf for r in ops), ops
    assert any("plain torch" in path for path in kernels["equivalence"]["gated_delta_rule"]), kernels
    versions = result["versions"]
    assert versions["torch"] == torch.__version__ and versions["fla_kernel_importable"] is False, versions
    assert all(keys == [] for keys in (*result["never_compared"].values(), *result["failed"].values())), result
    assert result["longest_fitting_P"] and not result["stage_errors"]
    markdown = (tmp_path / "out" / "gpu_check_tiny.md").read_text()
    assert markdown.startswith("# GPU check") and "## Summary" in markdown and "## FSDP2" in markdown
    assert "## Peak memory" in run.stdout  # each stage's markdown is printed when it ends


@pytest.fixture(scope="module")
def faulty_run(tmp_path_factory):
    """A run whose equivalence stage's first row overruns the stage and whose fsdp2 stage hangs in its first row (its
    fault sleeps an hour): (its folder, the completed process, its report). The faulty stages must reach their first
    row (imports, the model) within their time on any box, so they get FAULTY_STAGE_SECONDS: the overrun costs none
    of it (its clock jumps), the hang all of it plus the overrun. ops and scale get their ceilings."""
    folder = tmp_path_factory.mktemp("faulty")
    args = ["--families", "qwen3", *BUDGET, "--ops-seconds", str(CEILINGS["ops"]), "--scale-seconds",
            str(CEILINGS["scale"]), "--equivalence-seconds", str(FAULTY_STAGE_SECONDS), "--fsdp2-seconds",
            str(FAULTY_STAGE_SECONDS), "--overrun-seconds", "4"]
    run = run_gpu_check(folder, args, faults="equivalence:qwen3:slow,fsdp2:qwen3:hang")
    return folder, run, json.loads((folder / "out" / "gpu_check_tiny.json").read_text())


def test_a_row_past_its_stage_leaves_the_later_rows_skipped_and_the_exit_non_zero(faulty_run):
    folder, run, report = faulty_run
    assert run.returncode == 1, run.stderr[-4000:]
    assert [(r["key"], r["skipped"]) for r in report["equivalence"]] == [
        ("qwen3 bfloat16", "time limit"), ("qwen3 autocast_bfloat16", "time limit"), ("qwen3 float32", "time limit")]
    keys = [r["key"] for r in report["equivalence"]]
    assert report["never_compared"]["equivalence"] == keys
    assert f"equivalence: 3 of 3 planned rows never compared: {', '.join(keys)}" in run.stderr
    markdown = (folder / "out" / "gpu_check_tiny.md").read_text()
    assert f"| equivalence | 3 | 0 | 0 | 3: {', '.join(keys)} |" in markdown
    assert "**Never compared** (3 of 3 planned)" in markdown


def test_a_hung_stage_is_killed_and_the_other_stages_keep_their_rows(faulty_run):
    folder, run, report = faulty_run
    assert "hung" in report["stage_errors"]["fsdp2"] and report["fsdp2"] == []
    assert report["never_compared"]["fsdp2"] == ["qwen3"]
    assert len(report["ops"]) == 5 and all(r["passed"] for r in report["ops"])
    assert report["scale"] and not report["never_compared"]["scale"]
    assert len(report["equivalence"]) == 3  # every stage's rows in the report, the hung one's end included
    # killed at its deadline + overrun, not after the hour its fault sleeps (the run itself ends within RUN_TIMEOUT)
    assert report["stage_seconds"]["fsdp2"] < RUN_TIMEOUT


def test_a_rerun_runs_only_the_rows_never_compared(faulty_run, tmp_path):
    folder, _, old = faulty_run
    run = run_gpu_check(tmp_path, ["--rerun-failed", str(folder / "out" / "gpu_check_tiny.json"), "--families",
                                   "qwen3", *TINY_STAGE_SECONDS])
    assert run.returncode == 0, run.stderr[-4000:]
    report = json.loads((tmp_path / "out" / "gpu_check_tiny.json").read_text())
    facts = [json.loads(p.read_text())["stage"] for p in (tmp_path / "facts").iterdir()]
    assert sorted(s for s in facts if s) == ["equivalence", "fsdp2"]  # ops and scale passed: carried, not run
    assert report["ops"] == old["ops"] and report["scale"] == old["scale"]
    assert set(report["not_run"]) == {"ops", "scale"}
    assert [r["key"] for r in report["equivalence"]] == old["never_compared"]["equivalence"]
    assert [r["key"] for r in report["fsdp2"]] == ["qwen3"]
    assert all(not keys for keys in report["never_compared"].values()) and report["rerun_of"]


def test_only_the_rows_a_rerun_lacks_are_run(tmp_path):
    """In one stage process: the rows named in the skip set are not planned or run; the merge keeps the old passed
    rows in the planned order."""
    old_part = stages.run_stage("ops", tmp_path / "old.json", time.monotonic() + 60, tiny=True)
    old = {"planned": {"ops": old_part.planned}, "ops": old_part.rows[:2] + [{**old_part.rows[2], "passed": False}]}
    skip = frozenset(r["key"] for r in gpu_check._passed_rows(old, "ops"))
    assert len(skip) == 2
    new_part = stages.run_stage("ops", tmp_path / "new.json", time.monotonic() + 60, tiny=True, skip=skip)
    assert new_part.planned == old_part.planned[2:]
    result = {"planned": {}, "stage_errors": {}, "kernels": {}, "device": None, "ops": []}
    gpu_check.merge(result, "ops", json.loads((tmp_path / "new.json").read_text()), None, old)
    assert [r["key"] for r in result["ops"]] == old_part.planned
    assert result["ops"][:2] == old["ops"][:2]


def test_failing_rows_and_stages_are_recorded_and_a_lost_device_ends_the_stage(tmp_path, monkeypatch, capsys):
    ok = stages.error_row({"log_prob": 0.0, "grad": 0.0, "standard_log_prob": 0.0, "standard_grad": 0.0}, True)
    real_op_case = stages.op_case

    def equivalence_case(models, case, name, *args):
        if (case, name) == ("qwen3_5", "bfloat16"):
            raise ValueError("injected case failure")
        return ok

    def process_group(device):
        raise RuntimeError("injected NCCL failure")

    def op_case(case, *args):
        if case.op == "pass_q_two_ranks":
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return real_op_case(case, *args)

    monkeypatch.setattr(stages, "equivalence_case", equivalence_case)
    monkeypatch.setattr(stages, "process_group", process_group)
    monkeypatch.setattr(stages, "op_case", op_case)
    parts = {}
    with torch.device("meta"):
        for stage in ("ops", "equivalence", "fsdp2"):
            stages.run_stage(stage, tmp_path / f"{stage}.json", time.monotonic() + 60, tiny=True,
                             cases=("qwen3_5", "qwen3"))
            parts[stage] = json.loads((tmp_path / f"{stage}.json").read_text())
    failed = [r for r in parts["equivalence"]["rows"] if "skipped" in r]
    assert len(parts["equivalence"]["rows"]) == 6 and [r["key"] for r in failed] == ["qwen3_5 bfloat16"]
    assert failed[0]["skipped"] == "error: ValueError: injected case failure"
    assert "in equivalence_case" in failed[0]["traceback"], failed
    assert parts["fsdp2"]["rows"] == [] and "injected NCCL failure" in parts["fsdp2"]["stage_error"]
    assert [r["op"] for r in parts["ops"]["rows"]] == ["prefix_causal_attention", "pass_q_two_ranks"]  # then lost
    assert "illegal memory access" in parts["ops"]["stage_error"]

    result = {"device": None, "machine": None, "versions": None, "budget_seconds": 60.0, "rerun_of": None,
              "stage_order": ["ops", "equivalence", "fsdp2"], "stage_seconds": {}, "kernels": {}, "stage_errors": {},
              "not_run": {}, "planned": {}, "never_compared": {}, "failed": {},
              **{stage: [] for stage in gpu_check.STAGES}}
    for stage, part in parts.items():
        gpu_check.merge(result, stage, part, None, None)
    gpu_check.merge(result, "scale", None, "its process exited with status 1", None)
    gpu_check.Report(result, tmp_path, "report", time.monotonic())
    assert result["never_compared"] == {"ops": ["attention pass_q_two_ranks", "mla absorbed prefix_causal_attention",
                                                "gpt-oss full + sinks window_attention",
                                                "gpt-oss window 8 + sinks window_attention"],
                                        "equivalence": ["qwen3_5 bfloat16"], "fsdp2": ["qwen3_5", "qwen3"],
                                        "scale": ["every scale row (the stage ended before planning them)"]}
    assert "Stopped by an error outside its rows" in (tmp_path / "report.md").read_text()
    capsys.readouterr()
    assert gpu_check.exit_status(result) == 1 and "ops: 4 of 5 planned rows never compared" in capsys.readouterr().err
    assert result["stage_errors"]["scale"] == "its process exited with status 1"
    assert gpu_check.exit_status({"never_compared": {"ops": []}}) == 0


def test_a_stage_past_its_time_skips_its_rows(tmp_path):
    start = time.monotonic()
    with torch.device("meta"):
        part = stages.run_stage("equivalence", tmp_path / "part.json", time.monotonic() + 0.5, tiny=True)
    assert time.monotonic() - start < 30
    assert {"skipped": "time limit"}.items() <= part.rows[-1].items()
    assert len(part.rows) == len(part.planned) == 3 * len(stages.CASES_NEWEST_FIRST)


def test_the_cases_are_every_model_type_newest_first():
    assert sorted(stages.CASES_NEWEST_FIRST) == sorted((*FAMILIES, *VARIANTS, *stages.CONFIG_VARIANTS))
    assert stages.CASES_NEWEST_FIRST[-1] == "qwen3"  # the first family served


@pytest.mark.parametrize("case", stages.CASES_NEWEST_FIRST)
def test_half_precision_rows_route_every_expert(case):
    """The bfloat16, autocast and FSDP2 rows route every token to every expert of a MoE case (routing near-ties
    flip under half-precision rounding on either path); the float32 rows keep the model's routing."""
    family, routed = stages.case_config(case, half=False)
    _, every = stages.case_config(case, half=True)
    config = tiny_config(family, **routed)
    if getattr(config, "num_experts_per_tok", None) is None:
        assert every == routed
        return
    experts = next(getattr(config, name) for name in stages.EXPERT_COUNT_FIELDS if getattr(config, name, None))
    assert config.num_experts_per_tok < experts and every == {**routed, "num_experts_per_tok": experts}
    tiny_model(family, **every)  # builds


def test_an_unknown_expert_count_is_refused():
    config = tiny_config("qwen3")
    config.num_experts_per_tok = 2
    with pytest.raises(ValueError, match="num_experts_per_tok without an expert count"):
        stages.every_expert(config)


def test_the_shared_indexer_case_runs_glm_5_2s_layout():
    """The glm_moe_dsa_shared_indexer case is GLM-5.2's DSA layout at tiny size: the first of the 3 layers runs its
    indexer, the others reuse its top-k selection, which runs (index_topk below the prompt); its rows compare
    the largest errors over the family's SELECTION_GROUPS groups, as glm_moe_dsa's do."""
    family, overrides = stages.case_config("glm_moe_dsa_shared_indexer", half=False)
    assert family == "glm_moe_dsa" and overrides["index_topk"] < stages.PROMPT_LEN
    model = tiny_model(family, **overrides)
    assert [layer.self_attn.indexer is None for layer in model.model.layers] == [False, True, True]
    groups = stages.row_groups("glm_moe_dsa_shared_indexer", 64, torch.device("cpu"))
    assert len(groups) == stages.SELECTION_GROUPS["glm_moe_dsa"] > 1


def test_a_row_past_its_time_is_interrupted():
    start = time.monotonic()

    def spin():
        while time.monotonic() < start + 30:
            torch.ones(64, 64) @ torch.ones(64, 64)

    assert stages.attempt(time.monotonic() + 0.3, spin) == (None, {"skipped": "time limit"})
    assert time.monotonic() - start < 5
    assert stages.attempt(time.monotonic() + 5, lambda: 7) == (7, None)


def test_the_time_limit_fires_once_while_a_row_unwinds():
    unwound = []

    def case():
        try:
            while True:
                time.sleep(0.01)
        finally:  # as a context manager's __exit__ restoring autocast or a module's forward
            time.sleep(2 * stages.REARM_SECONDS + 0.2)
            unwound.append(True)

    assert stages.attempt(time.monotonic() + 0.2, case) == (None, {"skipped": "time limit"})
    assert unwound == [True]


def test_a_time_limit_swallowed_by_a_del_is_raised_again():
    start = time.monotonic()

    class SlowToDelete:
        def __del__(self):  # the alarm lands here, and an exception cannot leave a __del__
            while time.monotonic() < start + 1:
                pass

    def case():
        SlowToDelete()
        while time.monotonic() < start + 15:
            pass
        return "ran to the end"

    assert stages.attempt(start + 0.2, case) == (None, {"skipped": "time limit"})
    assert time.monotonic() - start < 5


@pytest.mark.parametrize("message", ["CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`",
                                     "cuDNN error: CUDNN_STATUS_ALLOC_FAILED"])
def test_cublas_and_cudnn_allocation_failures_are_out_of_memory(message):
    def case():
        raise RuntimeError(message)

    assert stages.attempt(time.monotonic() + 5, case) == (None, {"skipped": "out of memory"})


def test_the_step_predictor_assumes_at_least_4x_per_doubling():
    assert stages.next_step_seconds([]) == 0
    assert stages.next_step_seconds([2.0]) == 8.0
    assert stages.next_step_seconds([1.0, 2.0]) == 8.0  # measured 2x: attention's 4x assumed
    assert stages.next_step_seconds([1.0, 5.0]) == 25.0  # measured 5x: fitted


def counted(calls: list, rule):
    """``rule`` counting its calls, wrapped as transformers wraps a kernel binding (``__wrapped__``)."""

    @functools.wraps(rule)
    def kernel(*args, **kwargs):
        calls.append(1)
        return rule(*args, **kwargs)

    return kernel


@pytest.mark.parametrize("case, module, name", [
    ("qwen3_5", qwen3_5_modeling, "torch_chunk_gated_delta_rule"),
    ("kimi_linear", kimi_modeling, "chunk_kimi_delta_attention")])
def test_the_standard_path_does_not_run_the_kernel_transformers_picked(monkeypatch, case, module, name):
    """With fla importable, transformers binds fla's (TF32) kernels where its Gated DeltaNet and Kimi Delta Attention
    look their chunked rule up; the standard path of gpu_check's rows runs the reference recurrence instead, and a
    float32 replay runs the plain torch rule."""
    calls = []
    monkeypatch.setattr(module, name, counted(calls, getattr(module, name)))
    picked = getattr(module, name)
    prompt, responses = stages.make_group(stages.VOCAB, 24, (5, 3))
    row = stages.equivalence_case({}, case, "float32", torch.device("cpu"), [(prompt, responses)], 8)
    assert calls == [] and row["passed"], row
    assert getattr(module, name) is picked  # restored after the row
    tiny_model(case)(prompt[None])
    assert calls  # outside gpu_check's rows the model runs what transformers picked


def test_fla_is_warmed_once_per_shape(monkeypatch):
    seen = []
    rule = gdn.gated_delta_rule
    kda_rules = []

    def recorded(q, k, v, g, beta, initial_state=None, **kwargs):
        seen.append((q.shape[2], v.shape[2], q.shape[3], v.shape[3], q.dtype, initial_state is None))
        return rule(q, k, v, g, beta, initial_state, **kwargs)

    monkeypatch.setattr(gdn, "gated_delta_rule", recorded)
    monkeypatch.setattr(kimi_modeling, "chunk_kimi_delta_attention",
                        counted(kda_rules, kimi_modeling.chunk_kimi_delta_attention))
    monkeypatch.setattr(stages, "WARMED_FLA", set())
    warmups = stages.fla_warmups("qwen3_5", torch.bfloat16) | stages.fla_warmups("kimi_linear", torch.bfloat16)
    for _ in range(2):
        stages.warm_fla(torch.device("cpu"), warmups)
    gated = {w[1:] for w in warmups if w[0] == "gated_delta"}
    assert sorted(seen) == sorted((*shape, first) for shape in gated for first in (False, True)), seen
    assert len(kda_rules) == 1 and {w[0] for w in warmups} == {"gated_delta", "kda"}
    assert stages.fla_warmups("qwen3", torch.bfloat16) == set()


def test_a_broken_fla_install_is_treated_as_absent(monkeypatch, caplog):
    class Broken:
        @staticmethod
        def find_spec(name, path=None, target=None):
            if name.partition(".")[0] == "fla":
                raise RuntimeError("triton driver mismatch")
            return None

    monkeypatch.setattr(sys, "meta_path", [Broken, *sys.meta_path])
    for name in [n for n in sys.modules if n.partition(".")[0] == "fla"]:
        monkeypatch.delitem(sys.modules, name)
    gdn._fla_chunk_gated_delta_rule.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger=gdn.logger.name):
            assert gdn._fla_chunk_gated_delta_rule() is None and gdn._fla_chunk_gated_delta_rule() is None
    finally:
        gdn._fla_chunk_gated_delta_rule.cache_clear()
    warnings = [r.getMessage() for r in caplog.records if "failed to import" in r.getMessage()]
    assert len(warnings) == 1 and "triton driver mismatch" in warnings[0], warnings


def test_the_sdpa_baseline_runs_on_a_named_backend():
    """``PinnedSdpa`` takes the first backend of its list that runs the inputs, keeps it, and names it."""
    q, k, v = (torch.randn(1, 2, 5, 8, requires_grad=True) for _ in range(3))
    mask = torch.ones(5, 5, dtype=torch.bool).tril()

    def run(xs, weight):
        out = torch.nn.functional.scaled_dot_product_attention(*xs, attn_mask=mask)
        return out.detach(), torch.autograd.grad((out * weight).sum(), xs)

    pinned = stages.PinnedSdpa(run, torch.device("cpu"))
    out, _ = pinned([q, k, v], torch.ones(1, 2, 5, 8))
    assert pinned.backend in stages.SDPA_BACKENDS["cpu"] and out.shape == (1, 2, 5, 8)
