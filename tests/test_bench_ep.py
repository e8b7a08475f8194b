"""benchmarks/bench_ep.py --smoke runs the `longstraw` engine with and without expert parallelism on 2 spawned gloo
ranks (context_parallel_size 2, a qwen3_moe of 8 experts) and writes its report: both engines' rows for both ops,
per-rank figures for every rank, the same MoE-layer calls in both, EP's all-to-all bytes per call below the FSDP2
all-gather of one layer's experts (which EP never all-gathers nor reduce-scatters), ratios, and the machine."""

from __future__ import annotations

from pathlib import Path

import pytest
import transformers
from packaging.version import Version

from verl_longstraw.parallel.transformers_ep import MIN_TRANSFORMERS
from verl_longstraw.testing.scripts import run_benchmark

BENCH_EP = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_ep.py"


@pytest.mark.skipif(Version(transformers.__version__) < MIN_TRANSFORMERS,
                    reason=f"transformers {transformers.__version__} has no ep_dispatch_experts plan")
def test_bench_ep_smoke(tmp_path):
    report = run_benchmark(BENCH_EP, ["--smoke", "--timeout-s", "400", "--out", str(tmp_path)],
                           tmp_path / "ep_smoke.json", timeout_s=900)
    rows = {(r["engine"], r["op"]): r for r in report["rows"]}
    ops = ("compute_log_prob", "update_actor")
    assert set(rows) == {(engine, op) for engine in ("fsdp2_only", "expert_parallel") for op in ops}
    for (engine, op), row in rows.items():
        assert row["R"] == 2 and row["seconds"] > 0 and row["peak_rss_delta_mib"] >= 0, (engine, op)
        assert len(row["seconds_per_rank"]) == len(row["ep_bytes_per_call_per_rank"]) == 2, (engine, op)
    for op in ops:
        fsdp2, ep = rows["fsdp2_only", op], rows["expert_parallel", op]
        assert fsdp2["moe_calls"] == ep["moe_calls"] > 0, op
        assert fsdp2["expert_all_gather_bytes_per_unshard"] == fsdp2["layer_expert_bytes"], op  # E experts, fp32
        assert fsdp2["ep_all_to_all_bytes"] == 0 and ep["expert_all_gather_bytes"] == 0, op
        assert all(0 < b < fsdp2["expert_all_gather_bytes_per_unshard"] for b in ep["ep_bytes_per_call_per_rank"])
        assert ep["ep_all_to_all_bytes"] == ep["ep_collective_bytes"], op  # the trace and the engine's metric agree
    assert rows["fsdp2_only", "update_actor"]["expert_reduce_scatter_bytes"] > 0
    assert rows["expert_parallel", "update_actor"]["expert_reduce_scatter_bytes"] == 0
    assert {(q["R"], q["op"]) for q in report["ratios"]} == {(2, op) for op in ops}
    for q in report["ratios"]:
        assert 0 < q["bytes_ratio_per_unshard"] < q["bytes_ratio_received"] < 1, q
        assert q["time_ratio"] > 0 and q["mem_ratio"] >= 0, q
    assert report["machine"]["cpu"] and report["machine"]["versions"]["transformers"]
    md = (tmp_path / "ep_smoke.md").read_text()
    assert md.startswith("# Expert parallelism") and report["machine"]["cpu"] in md
    assert "| EP / FSDP2 s |" in md and "| EP / all-gather per unshard |" in md
