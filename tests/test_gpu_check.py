"""benchmarks/gpu_check.py runs end to end at tiny size on CPU and writes its report.

It runs with the default device set to ``meta``: every tensor the check (or the code it calls)
creates without naming a device lands on ``meta`` and fails as soon as it meets the CPU tensors
the check placed explicitly, as a CPU tensor would meet CUDA tensors on a GPU.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from verl_longstraw.testing import load_script

GPU_CHECK = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.py"


def test_gpu_check_tiny(tmp_path):
    gpu_check = load_script(GPU_CHECK)
    args = ["--tiny", "--out", str(tmp_path), "--equivalence-seconds", "30", "--scale-seconds", "15"]
    with torch.device("meta"):
        result = gpu_check.main(args)
    compared = [r for r in result["equivalence"] if "skipped" not in r]
    assert {r["dtype"] for r in compared} == {"float32", "bfloat16"}, f"dtype never compared: {result['equivalence']}"
    assert all(r["passed"] for r in compared), compared
    assert any(r["fits"] for r in result["scale"])
    paths = {r["path"] for r in result["scale"]}
    assert paths == {"standard", "exact", "detached"}
    report = json.loads((tmp_path / "gpu_check_tiny.json").read_text())
    assert report["longest_fitting_P"] and (tmp_path / "gpu_check_tiny.md").read_text().startswith("# GPU check")
