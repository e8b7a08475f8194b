"""benchmarks/bench_core.py runs end to end at tiny size; its record names the machine and the versions that
change its numbers (verl_longstraw.machine)."""

import json
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

BENCH_CORE = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_core.py"


def test_bench_core_record_names_machine_and_versions(tmp_path):
    args = ["--families", "qwen3", "--prompt-lens", "32", "--group-sizes", "2", "--paths", "standard", "exact",
            "--error-prompt-len", "32", "--response-len", "4", "--out", str(tmp_path)]
    subprocess.run([sys.executable, str(BENCH_CORE), *args], check=True, capture_output=True, timeout=600)
    record = json.loads((tmp_path / "core.json").read_text())
    assert {r["path"] for r in record["rows"]} == {"standard", "exact"}
    versions = record["machine"]["versions"]
    assert versions["torch"] == version("torch") and versions["transformers"] == version("transformers")
    assert record["machine"]["cpu"] and record["machine"]["torch_kernels"]
    md = (tmp_path / "core.md").read_text()
    assert f"Machine: {record['machine']['cpu']}" in md and f"transformers {version('transformers')}" in md
