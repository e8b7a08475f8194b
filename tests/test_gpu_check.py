"""benchmarks/gpu_check.py runs end to end at tiny size on CPU and writes its report; how it survives failures.

The end-to-end run is a subprocess set up as the lent GPU machine is: no veRL, no flash-linear-attention (their
imports raise RuntimeError, as a broken install would, not ImportError), this package found by the script's own
sys.path entry alone (nothing on PYTHONPATH but the blocker, the editable install's finder removed, a temporary
cwd). Its default device is ``meta``, as for the in-process runs here: every tensor the check (or the code it
calls) creates without naming a device lands on ``meta`` and fails as soon as it meets the CPU tensors the
check placed explicitly, as a CPU tensor would meet CUDA tensors on a GPU.
"""

from __future__ import annotations

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
import transformers.models.qwen3_5.modeling_qwen3_5 as qwen3_5_modeling

from verl_longstraw.ops import gated_delta_rule as gdn
from verl_longstraw.testing import load_script
from verl_longstraw.tiny import tiny_model

ROOT = Path(__file__).resolve().parents[1]
GPU_CHECK = ROOT / "benchmarks" / "gpu_check.py"
gpu_check = load_script(GPU_CHECK)
# upper bounds (equivalence and fsdp2 take what they need: about a quarter of this on an idle 2-core CI machine)
TINY_STAGE_SECONDS = ["--equivalence-seconds", "150", "--fsdp2-seconds", "60", "--scale-seconds", "15",
                      "--ops-seconds", "20"]
# sitecustomize of the subprocess: what a bare GPU machine lacks raises on import; facts for the test at exit
BARE_MACHINE = '''
import atexit, importlib.util, json, os, sys

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
import torch

torch.set_default_device("meta")


@atexit.register
def facts():
    package = sys.modules.get("verl_longstraw")
    with open(os.environ["BARE_MACHINE_FACTS"], "w") as f:
        json.dump({"package": getattr(package, "__file__", None), "attempts": sorted(Blocked.attempts),
                   "imported": sorted(n for n in sys.modules if n.partition(".")[0] in BLOCKED),
                   "flash_attn": importlib.util.find_spec("flash_attn") is not None}, f)
'''


def _compared(row: dict) -> bool:
    return "skipped" not in row and all(math.isfinite(row[k]) for k in ("log_prob_error", "grad_rel_l2"))


def test_gpu_check_tiny_on_a_bare_machine(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(BARE_MACHINE)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP")}
    env.update(PYTHONPATH=str(site), PYTHONNOUSERSITE="1", PYTHONUNBUFFERED="1",
               BARE_MACHINE_FACTS=str(tmp_path / "facts.json"))
    out = tmp_path / "out"
    run = subprocess.run([sys.executable, str(GPU_CHECK), "--tiny", "--out", str(out), *TINY_STAGE_SECONDS],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-6000:]
    facts = json.loads((tmp_path / "facts.json").read_text())
    assert Path(facts["package"]).is_relative_to(ROOT / "verl_longstraw"), facts
    assert facts["imported"] == [] and not facts["flash_attn"], facts  # as on the lent image
    assert "fla" in facts["attempts"], facts  # transformers tried fla and took its torch path

    result = json.loads((out / "gpu_check_tiny.json").read_text())
    rows = result["equivalence"]
    assert all(_compared(r) for r in rows), rows
    assert {r["dtype"] for r in rows} == {"float32", "bfloat16", gpu_check.AUTOCAST}
    # float32 and bfloat16-cast replay pass on every family; every glm_moe_dsa row (sparse top-k selection), the
    # shared-indexer case's included, passes. The autocast rows of the dense families are reported, not required: on
    # CPU their replay errs ~2x the standard path under autocast (gradients of every parameter, lm_head's included),
    # see the report for the GPU's.
    dsa = [r for r in rows if gpu_check.case_config(r["family"])[0] == "glm_moe_dsa"]
    assert all(r["passed"] for r in rows if r["dtype"] != gpu_check.AUTOCAST or r in dsa), rows
    assert {r["family"] for r in dsa} == {"glm_moe_dsa", "glm_moe_dsa_shared_indexer"}
    assert gpu_check.OVERRIDES["glm_moe_dsa"]["index_topk"] < 64  # below the tiny prompt: selection runs
    fsdp = result["fsdp2"]  # the FSDP2 helpers run without veRL
    assert [r["family"] for r in fsdp] == ["qwen3", "glm_moe_dsa"] and all(_compared(r) for r in fsdp), fsdp
    assert any(r["fits"] for r in result["scale"])
    assert {r["path"] for r in result["scale"]} == {"standard", "exact", "detached"}
    kernels = result["kernels"]
    assert set(kernels) == {"equivalence", "fsdp2", "ops", "scale"} and all(k["attention"] for k in kernels.values())
    ops = result["ops"]  # the fused op and two-shard pass-Q at a GQA shape, and MLA's, within the standard's error
    assert [(r["shape"], r["op"]) for r in ops] == [("attention", "prefix_causal_attention"),
                                                    ("attention", "pass_q_two_ranks"),
                                                    ("mla absorbed", "prefix_causal_attention")], ops
    assert all(r["passed"] for r in ops) and ops[0]["paths"] == {"fused_flash_cpu": 1}, ops
    assert all(set(r["paths"]) <= set(kernels["ops"]["attention"]) for r in ops), kernels  # every case's kernels
    assert all(0 < r["error_ratio"] < math.inf for r in ops), ops
    assert any("plain torch" in path for path in kernels["equivalence"]["gated_delta_rule"]), kernels
    versions = result["versions"]
    assert versions["torch"] == torch.__version__ and versions["fla_kernel_importable"] is False, versions
    assert result["longest_fitting_P"] and result["stages_that_compared_nothing"] == [] and not result["stage_errors"]
    markdown = (out / "gpu_check_tiny.md").read_text()
    assert markdown.startswith("# GPU check") and "## FSDP2" in markdown and "gated delta rule" in markdown
    assert "## Peak memory" in run.stdout  # each stage's markdown is printed when it ends


def test_failing_cases_and_stages_are_recorded_and_a_lost_device_ends_the_run(tmp_path, monkeypatch, capsys):
    ok = gpu_check.error_row({"log_prob": 0.0, "grad": 0.0, "standard_log_prob": 0.0, "standard_grad": 0.0}, True)
    real_op_case = gpu_check.op_case

    def equivalence_case(models, family, name, *args):
        if (family, name) == ("qwen3_5", "bfloat16"):
            raise ValueError("injected case failure")
        return ok

    def process_group(device):
        raise RuntimeError("injected NCCL failure")

    def op_case(name, shape, op, *args):
        if op == "pass_q_two_ranks":
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return real_op_case(name, shape, op, *args)

    monkeypatch.setattr(gpu_check, "equivalence_case", equivalence_case)
    monkeypatch.setattr(gpu_check, "process_group", process_group)
    monkeypatch.setattr(gpu_check, "op_case", op_case)
    with torch.device("meta"):
        result = gpu_check.main(["--tiny", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "gpu_check_tiny.json").read_text())
    assert report["equivalence"] == result["equivalence"]
    failed = [r for r in report["equivalence"] if "skipped" in r]
    assert len(report["equivalence"]) == 15 and [(r["family"], r["dtype"]) for r in failed] == [("qwen3_5", "bfloat16")]
    assert failed[0]["skipped"] == "error: ValueError: injected case failure"
    assert "in equivalence_case" in failed[0]["traceback"], failed
    assert report["fsdp2"] == [] and "injected NCCL failure" in report["stage_errors"]["fsdp2"]
    assert [r["op"] for r in report["ops"]] == ["prefix_causal_attention", "pass_q_two_ranks"]  # then it is lost
    assert report["ops"][0]["passed"] and "illegal memory access" in report["ops"][1]["device_lost"], report["ops"]
    assert "illegal memory access" in report["stage_errors"]["ops"]
    assert report["scale"] == [] and "illegal memory access" in report["not_run"]["scale"]
    assert report["stages_that_compared_nothing"] == ["fsdp2", "scale"]
    assert "Not run" in (tmp_path / "gpu_check_tiny.md").read_text()
    capsys.readouterr()
    assert gpu_check.exit_status(result) == 1 and "fsdp2, scale" in capsys.readouterr().err
    assert gpu_check.exit_status({"stages_that_compared_nothing": []}) == 0


def test_the_shared_indexer_case_runs_glm_5_2s_layout():
    """The glm_moe_dsa_shared_indexer case is GLM-5.2's DSA layout at tiny size: the first of the 3 layers runs its
    indexer, the others reuse its top-k selection, which runs (index_topk below the tiny prompt); its rows compare
    the largest errors over the family's SELECTION_GROUPS groups, as glm_moe_dsa's do."""
    family, overrides = gpu_check.case_config("glm_moe_dsa_shared_indexer")
    assert family == "glm_moe_dsa" and overrides["index_topk"] < 64
    model = tiny_model(family, **overrides)
    assert [layer.self_attn.indexer is None for layer in model.model.layers] == [False, True, True]
    groups = gpu_check.row_groups("glm_moe_dsa_shared_indexer", 64, torch.device("cpu"))
    assert len(groups) == gpu_check.SELECTION_GROUPS["glm_moe_dsa"] > 1


def test_a_case_past_its_time_is_interrupted():
    start = time.monotonic()

    def spin():
        while time.monotonic() < start + 30:
            torch.ones(64, 64) @ torch.ones(64, 64)

    assert gpu_check.attempt(time.monotonic() + 0.3, spin) == (None, {"skipped": "time limit"})
    assert time.monotonic() - start < 5
    assert gpu_check.attempt(time.monotonic() + 5, lambda: 7) == (7, None)


def test_the_time_limit_fires_once_while_a_case_unwinds():
    unwound = []

    def case():
        try:
            while True:
                time.sleep(0.01)
        finally:  # as a context manager's __exit__ restoring autocast or a module's forward
            time.sleep(2 * gpu_check.REARM_SECONDS + 0.2)
            unwound.append(True)

    assert gpu_check.attempt(time.monotonic() + 0.2, case) == (None, {"skipped": "time limit"})
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

    assert gpu_check.attempt(start + 0.2, case) == (None, {"skipped": "time limit"})
    assert time.monotonic() - start < 5


@pytest.mark.parametrize("message", ["CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`",
                                     "cuDNN error: CUDNN_STATUS_ALLOC_FAILED"])
def test_cublas_and_cudnn_allocation_failures_are_out_of_memory(message):
    def case():
        raise RuntimeError(message)

    assert gpu_check.attempt(time.monotonic() + 5, case) == (None, {"skipped": "out of memory"})


def test_the_step_predictor_assumes_at_least_4x_per_doubling():
    assert gpu_check.next_step_seconds([]) == 0
    assert gpu_check.next_step_seconds([2.0]) == 8.0
    assert gpu_check.next_step_seconds([1.0, 2.0]) == 8.0  # measured 2x: attention's 4x assumed
    assert gpu_check.next_step_seconds([1.0, 5.0]) == 25.0  # measured 5x: fitted


def test_the_standard_path_does_not_run_the_kernel_transformers_picked(monkeypatch):
    """With fla importable, transformers binds fla's (TF32) kernel where its Gated DeltaNet looks the chunk rule up;
    the standard path of gpu_check's rows runs the reference recurrence instead."""
    calls = []
    torch_rule = qwen3_5_modeling.torch_chunk_gated_delta_rule

    def picked_kernel(*args, **kwargs):
        calls.append(1)
        return torch_rule(*args, **kwargs)

    monkeypatch.setattr(qwen3_5_modeling, "torch_chunk_gated_delta_rule", picked_kernel)
    prompt, responses = gpu_check.make_group(gpu_check.VOCAB, 24, (5, 3))
    row = gpu_check.equivalence_case({}, "qwen3_5", "float32", torch.device("cpu"), [(prompt, responses)], 8)
    assert calls == [] and row["passed"], row
    assert qwen3_5_modeling.torch_chunk_gated_delta_rule is picked_kernel  # restored after the case
    tiny_model("qwen3_5")(prompt[None])
    assert calls  # outside gpu_check's rows the model runs what transformers picked


def test_fla_is_warmed_once_per_shape(monkeypatch):
    seen = []
    rule = gdn.gated_delta_rule

    def recorded(q, k, v, g, beta, initial_state=None, **kwargs):
        seen.append((q.shape[2], v.shape[2], q.shape[3], v.shape[3], q.dtype, initial_state is None))
        return rule(q, k, v, g, beta, initial_state, **kwargs)

    monkeypatch.setattr(gdn, "gated_delta_rule", recorded)
    monkeypatch.setattr(gpu_check, "WARMED_FLA_SHAPES", set())
    shapes = gpu_check.fla_shapes("qwen3_5", torch.bfloat16)
    for _ in range(2):
        gpu_check.warm_fla(torch.device("cpu"), shapes)
    assert sorted(seen) == sorted((*shape, first) for shape in shapes for first in (False, True)), seen
    assert gpu_check.fla_shapes("qwen3", torch.bfloat16) == set()


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


def test_time_budget_skips_and_still_writes_the_report(tmp_path):
    start = time.monotonic()
    args = ["--tiny", "--out", str(tmp_path), "--equivalence-seconds", "0.5", "--fsdp2-seconds", "0",
            "--scale-seconds", "0"]
    with torch.device("meta"):
        result = gpu_check.main(args)
    assert time.monotonic() - start < 20
    assert {"skipped": "time limit"}.items() <= result["equivalence"][-1].items()
    assert all(r.get("skipped") == "time limit" for r in result["fsdp2"] + result["scale"])
    assert {"fsdp2", "scale"} <= set(result["stages_that_compared_nothing"])
    report = json.loads((tmp_path / "gpu_check_tiny.json").read_text())
    assert report["equivalence"][-1]["skipped"] == "time limit" and report["stage_seconds"]["scale"] < 5
