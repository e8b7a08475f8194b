"""benchmarks/bench_core.py runs end to end at tiny size; its record names the machine and the versions that
change its numbers (verl_longstraw.machine) and, for gpt_oss, each layer's state against full attention."""

from importlib.metadata import version
from pathlib import Path

from verl_longstraw.testing.scripts import run_benchmark

BENCH_CORE = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_core.py"


def test_bench_core_record_names_machine_and_versions(tmp_path):
    args = ["--families", "qwen3", "gpt_oss", "--prompt-lens", "32", "--group-sizes", "2", "--paths", "standard",
            "exact", "--error-prompt-len", "32", "--response-len", "4", "--out", str(tmp_path)]
    record = run_benchmark(BENCH_CORE, args, tmp_path / "core.json", timeout_s=600)
    assert {r["path"] for r in record["rows"]} == {"standard", "exact"}
    windows = record["window_state"]  # gpt_oss's sliding layers keep W - 1 rows of the 31 captured, full ones all
    assert {w["family"] for w in windows} == {"gpt_oss"} and {w["window"] for w in windows} == {8, None}
    assert all(abs(w["state_bytes"] / w["full_attention_bytes"] - w["expected_ratio"]) < 1e-9 for w in windows)
    versions = record["machine"]["versions"]
    assert versions["torch"] == version("torch") and versions["transformers"] == version("transformers")
    assert record["machine"]["cpu"] and record["machine"]["torch_kernels"]
    md = (tmp_path / "core.md").read_text()
    assert f"Machine: {record['machine']['cpu']}" in md and f"transformers {version('transformers')}" in md
