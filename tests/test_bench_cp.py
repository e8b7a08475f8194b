"""benchmarks/bench_cp.py --quick runs end to end (hybrid family, R = 1 and 2, tiny P) and writes its report;
its collective bytes equal its formulas exactly and every rank issued the same collectives."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH_CP = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_cp.py"


def test_bench_cp_quick(tmp_path):
    run = subprocess.run([sys.executable, str(BENCH_CP), "--quick", "--timeout-s", "300", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    report = json.loads((tmp_path / "cp.json").read_text())
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
