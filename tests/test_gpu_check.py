"""benchmarks/gpu_check.py runs end to end at tiny size on CPU and writes its report."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

GPU_CHECK = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.py"


def test_gpu_check_tiny(tmp_path):
    spec = importlib.util.spec_from_file_location("gpu_check", GPU_CHECK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    result = module.main(["--tiny", "--out", str(tmp_path), "--equivalence-seconds", "30", "--scale-seconds", "15"])
    assert all(r["passed"] for r in result["equivalence"] if "skipped" not in r)
    assert any(r["fits"] for r in result["scale"])
    paths = {r["path"] for r in result["scale"]}
    assert paths == {"standard", "exact", "detached"}
    report = json.loads((tmp_path / "gpu_check_tiny.json").read_text())
    assert report["longest_fitting_P"] and (tmp_path / "gpu_check_tiny.md").read_text().startswith("# GPU check")
