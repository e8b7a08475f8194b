"""benchmarks/bench_cp.py --quick runs end to end (hybrid family, R = 1 and 2, tiny P) and writes its report;
its collective bytes equal its formulas exactly and every rank issued the same collectives."""

from __future__ import annotations

from pathlib import Path

from verl_longstraw.testing.scripts import run_benchmark

BENCH_CP = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_cp.py"


def test_bench_cp_quick(tmp_path):
    report = run_benchmark(BENCH_CP, ["--quick", "--timeout-s", "300", "--out", str(tmp_path)],
                           tmp_path / "cp.json", timeout_s=600)
    rows = report["rows"]
    assert {r["R"] for r in rows} == {1, 2}
    for row in rows:
        assert row["lockstep"], row["R"]
        measured = {phase: {op: v["bytes"] for op, v in ops.items()} for phase, ops in row["collectives"].items()}
        assert measured == row["formula_bytes"], row["R"]
        assert all(seconds > 0 for seconds in row["seconds"].values())
    assert any(row["collectives"]["prompt_backward"] for row in rows)  # R = 2 communicates in every phase
    assert report["machine"]["cpu"] and report["machine"]["versions"]["transformers"]
    assert (tmp_path / "cp.md").read_text().startswith("# Context-parallel benchmark")
    assert (tmp_path / "cp.png").stat().st_size > 0
