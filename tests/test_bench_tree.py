"""benchmarks/bench_tree.py runs end to end at toy size: every engine on every shape, the star engine really runs the
GRPO groups (its tokens forwarded are the star plan's), the tree engine shares what the rows have in common (fewer
tokens than the star path, at most the trie's positions), shape c's chunked response runs more segments, and the
report's ratios and targets are computed from its rows."""

from pathlib import Path

from verl_longstraw.testing.scripts import run_benchmark

BENCH_TREE = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_tree.py"
OPS = ("compute_log_prob", "update_actor")


def test_bench_tree_toy(tmp_path, monkeypatch):
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")  # bench_engine's environment: the script need not re-exec
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    args = ["--models", "qwen3", "--scale", "0.015625", "--groups", "2", "--group-size", "2", "--trajectories", "2",
            "--repeats", "2", "--out", str(tmp_path)]
    report = run_benchmark(BENCH_TREE, args, tmp_path / "tree.json", timeout_s=600)
    rows = {(r["shape"], r["engine"], r["op"]): r for r in report["rows"]}
    engines = {"a": ("fsdp2", "star", "tree"), "b": ("fsdp2", "star", "tree"),
               "c": ("fsdp2", "star", "tree", "tree_unsegmented")}
    assert set(rows) == {(shape, e, op) for shape, names in engines.items() for e in names for op in OPS}
    assert all(r["seconds"] > 0 and r["peak_rss_delta_mib"] >= 0 for r in rows.values())
    for r in rows.values():
        assert r["seconds"] == min(r["seconds_runs"]) and r["cpu_seconds"] == min(r["cpu_seconds_runs"]) > 0
        assert len(r["seconds_runs"]) == len(r["cpu_seconds_runs"]) == (1 if r["engine"] == "fsdp2" else 2)

    n = report["lengths"]
    prompt = n["system"] + n["group_prompt"]
    fsdp2 = rows["a", "fsdp2", "compute_log_prob"]
    assert fsdp2["tokens_forwarded"] == n["groups"] * n["group_size"] * (prompt + n["response"])
    star = rows["a", "star", "compute_log_prob"]  # each group's prompt positions once, then every response
    assert star["tokens_forwarded"] == n["groups"] * (prompt - 1 + n["group_size"] * n["response"])
    tree = rows["a", "tree", "compute_log_prob"]  # the system prompt once: at most the trie's positions
    trie = n["system"] - 1 + n["groups"] * n["group_prompt"] + n["groups"] * n["group_size"] * n["response"]
    assert tree["tokens_forwarded"] <= trie < star["tokens_forwarded"]
    for op in OPS:
        assert rows["b", "tree", op]["tokens_forwarded"] < rows["b", "star", op]["tokens_forwarded"]
    chunked, whole = rows["c", "tree", "update_actor"], rows["c", "tree_unsegmented", "update_actor"]
    assert chunked["tree_segments"] > whole["tree_segments"]

    for q in report["ratios"]:
        tree, other = rows[q["shape"], "tree", q["op"]], rows[q["shape"], q["against"], q["op"]]
        assert q["tokens"] == other["tokens_forwarded"] / tree["tokens_forwarded"]
        assert q["speedup"] == other["seconds"] / tree["seconds"]
        assert q["cpu_speedup"] == other["cpu_seconds"] / tree["cpu_seconds"]
    assert {(t["shape"], t["what"]) for t in report["targets"]} == {("a", "tokens"), ("a", "speedup"),
                                                                    ("b", "speedup"), ("c", "memory")}
    assert all(t["met"] == (t["value"] <= t["bound"] if t["what"] == "memory" else t["value"] >= t["bound"])
               for t in report["targets"])
    md = (tmp_path / "tree.md").read_text()
    assert f"Machine at the start: {report['machine']['cpu']}" in md and "Scale 0.015625" in md
    assert "| qwen3 | a | update_actor | speedup vs star >= 2.0 |" in md
