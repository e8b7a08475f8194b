"""benchmarks/gpu_check.py runs end to end at tiny size on CPU and writes its report.

It runs with the default device set to ``meta``: every tensor the check (or the code it calls)
creates without naming a device lands on ``meta`` and fails as soon as it meets the CPU tensors
the check placed explicitly, as a CPU tensor would meet CUDA tensors on a GPU.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch

from verl_longstraw.testing import load_script

GPU_CHECK = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.py"
gpu_check = load_script(GPU_CHECK)


def _compared(row: dict) -> bool:
    return "skipped" not in row and all(math.isfinite(row[k]) for k in ("log_prob_error", "grad_rel_l2"))


def test_gpu_check_tiny(tmp_path):
    args = ["--tiny", "--out", str(tmp_path), "--equivalence-seconds", "60", "--fsdp2-seconds", "30",
            "--scale-seconds", "15", "--ops-seconds", "20"]
    with torch.device("meta"):
        result = gpu_check.main(args)
    rows = result["equivalence"]
    assert all(_compared(r) for r in rows), rows
    assert {r["dtype"] for r in rows} == {"float32", "bfloat16", gpu_check.AUTOCAST}
    # float32 and bfloat16-cast replay pass on every family; every glm_moe_dsa row (sparse top-k selection) passes.
    # The autocast rows of the dense families are reported, not required: on CPU their replay errs ~2x the standard
    # path under autocast (gradients of every parameter, lm_head's included), see the report for the GPU's.
    assert all(r["passed"] for r in rows if r["dtype"] != gpu_check.AUTOCAST or r["family"] == "glm_moe_dsa"), rows
    assert {r["family"] for r in rows} >= {"glm_moe_dsa"}
    assert gpu_check.OVERRIDES["glm_moe_dsa"]["index_topk"] < 64  # below the tiny prompt: selection runs
    fsdp = result["fsdp2"]
    assert [r["family"] for r in fsdp] == ["qwen3", "glm_moe_dsa"] and all(_compared(r) for r in fsdp), fsdp
    assert any(r["fits"] for r in result["scale"])
    assert {r["path"] for r in result["scale"]} == {"standard", "exact", "detached"}
    kernels = result["kernels"]
    assert set(kernels) == {"equivalence", "fsdp2", "ops", "scale"} and kernels["ops"]["attention"]
    assert all(k["attention"] for k in kernels.values())
    ops = result["ops"]  # the fused op and two-shard pass-Q at a GQA shape, and MLA's, within the standard's error
    assert [(r["shape"], r["op"]) for r in ops] == [("attention", "prefix_causal_attention"),
                                                    ("attention", "pass_q_two_ranks"),
                                                    ("mla absorbed", "prefix_causal_attention")], ops
    assert all(r["passed"] for r in ops) and ops[0]["paths"] == {"fused_flash_cpu": 1}, ops
    assert any("plain torch" in path for path in kernels["equivalence"]["gated_delta_rule"]), kernels
    assert result["versions"]["torch"] == torch.__version__ and result["versions"]["fla_kernel_importable"] is False
    report = json.loads((tmp_path / "gpu_check_tiny.json").read_text())
    assert report["longest_fitting_P"] and report["fsdp2"] and report["kernels"] == kernels
    markdown = (tmp_path / "gpu_check_tiny.md").read_text()
    assert markdown.startswith("# GPU check") and "## FSDP2" in markdown and "gated delta rule" in markdown


def test_a_case_past_its_time_is_interrupted():
    start = time.monotonic()

    def spin():
        while time.monotonic() < start + 30:
            torch.ones(64, 64) @ torch.ones(64, 64)

    assert gpu_check.attempt(time.monotonic() + 0.3, spin) == (None, "time limit")
    assert time.monotonic() - start < 5
    assert gpu_check.attempt(time.monotonic() + 5, lambda: 7) == (7, None)


def test_time_budget_skips_and_still_writes_the_report(tmp_path):
    start = time.monotonic()
    args = ["--tiny", "--out", str(tmp_path), "--equivalence-seconds", "0.5", "--fsdp2-seconds", "0",
            "--scale-seconds", "0"]
    with torch.device("meta"):
        result = gpu_check.main(args)
    assert time.monotonic() - start < 20
    assert {"skipped": "time limit"}.items() <= result["equivalence"][-1].items()
    assert all(r.get("skipped") == "time limit" for r in result["fsdp2"] + result["scale"])
    report = json.loads((tmp_path / "gpu_check_tiny.json").read_text())
    assert report["equivalence"][-1]["skipped"] == "time limit" and report["stage_seconds"]["scale"] < 5
