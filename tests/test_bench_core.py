"""benchmarks/bench_core.py runs end to end at tiny size; its record names the machine and the versions that
change its numbers (verl_longstraw.machine)."""

from importlib.metadata import version
from pathlib import Path

from verl_longstraw.testing import run_benchmark

BENCH_CORE = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_core.py"


def test_bench_core_record_names_machine_and_versions(tmp_path):
    args = ["--families", "qwen3", "--prompt-lens", "32", "--group-sizes", "2", "--paths", "standard", "exact",
            "--error-prompt-len", "32", "--response-len", "4", "--out", str(tmp_path)]
    record = run_benchmark(BENCH_CORE, args, tmp_path / "core.json", timeout_s=600)
    assert {r["path"] for r in record["rows"]} == {"standard", "exact"}
    versions = record["machine"]["versions"]
    assert versions["torch"] == version("torch") and versions["transformers"] == version("transformers")
    assert record["machine"]["cpu"] and record["machine"]["torch_kernels"]
    md = (tmp_path / "core.md").read_text()
    assert f"Machine: {record['machine']['cpu']}" in md and f"transformers {version('transformers')}" in md
