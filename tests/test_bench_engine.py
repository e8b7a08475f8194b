"""benchmarks/bench_engine.py --smoke runs both engines at R = 1 (this process) and R = 2 (two spawned
gloo ranks, longstraw with context_parallel_size 2) on a tiny dense model and writes its report: per-rank
figures for every rank, fsdp2 splitting the group over the ranks while every CP rank gets all of it,
about half the prompt state per rank at R = 2, CP collectives only at R = 2, and the machine."""

from __future__ import annotations

from pathlib import Path

from verl_longstraw.testing.scripts import run_benchmark

BENCH_ENGINE = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_engine.py"


def test_bench_engine_smoke_r1_r2(tmp_path):
    report = run_benchmark(BENCH_ENGINE, ["--smoke", "--timeout-s", "400", "--out", str(tmp_path)],
                           tmp_path / "engine_smoke.json", timeout_s=900)
    rows = {(r["engine"], r["op"], r["R"]): r for r in report["rows"]}
    group = report["G"][0]
    assert set(rows) == {(e, op, world) for e in ("fsdp2", "longstraw", "longstraw_two_pass")
                         for op in ("compute_log_prob", "update_actor") for world in (1, 2)}
    for (engine, op, world), row in rows.items():
        assert row["seconds"] > 0 and row["peak_rss_delta_mib"] >= 0, (engine, op, world)
        assert row["rows_per_rank"] == (group // world if engine == "fsdp2" else group)
        if world == 2:
            assert len(row["seconds_per_rank"]) == len(row["peak_rss_delta_mib_per_rank"]) == 2
            assert row["seconds"] == max(row["seconds_per_rank"])
    for op in ("compute_log_prob", "update_actor"):
        single, cp = rows["longstraw", op, 1], rows["longstraw", op, 2]
        assert single["cp_collective_bytes"] == 0 and single["state_grad_host_bytes"] == 0
        assert all(b > 0 for b in cp["cp_collective_bytes_per_rank"]), op
        for held in cp["prompt_state_bytes_per_rank"]:  # qwen3: token rows only, split over the 2 ranks
            assert 0.45 < held / single["prompt_state_bytes"] < 0.56, (op, held, single["prompt_state_bytes"])
    assert rows["longstraw", "update_actor", 2]["state_grad_device_bytes"] > 0
    assert all(q["speedup"] == q["baseline_s"] / q["longstraw_s"] for q in report["ratios"])
    assert {(q["op"], q["R"]) for q in report["ratios"]} == {(op, w) for op in ("compute_log_prob", "update_actor")
                                                              for w in (1, 2)}
    assert {(q["engine"], q["op"]) for q in report["rank_ratios"]} == {(e, op) for e in
                                                                       ("fsdp2", "longstraw", "longstraw_two_pass")
                                                                       for op in ("compute_log_prob", "update_actor")}
    assert report["machine"]["cpu"] and report["machine"]["versions"]["verl"]
    assert report["machine"]["overrides"].get("OMP_WAIT_POLICY") == "PASSIVE"
    assert report["code_start"]["commit"] and isinstance(report["code_end"]["modified"], list)
    md = (tmp_path / "engine_smoke.md").read_text()
    assert f"Machine at the start: {report['machine']['cpu']}" in md and report["code_start"]["commit"] in md
    assert "| qwen3 | update_actor | 64 | 2 | 2 | 1 |" in md  # the R = 2 row: fsdp2 with one row per rank
    assert "| two-pass s | longstraw s | speed-up |" in md
    assert (tmp_path / "engine_smoke.png").stat().st_size > 0
