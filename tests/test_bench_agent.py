"""benchmarks/bench_agent.py runs end to end at toy size: the mini-batch tree's log-prob walk forwards the batch's
distinct tokens (the trie's positions), fewer than the micro-batches' own trees, and the engine's
``star_tokens_forwarded`` baseline is what the star engine really forwards."""

from pathlib import Path

import torch

from verl_longstraw.testing.scripts import run_benchmark

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
OPS = ("compute_log_prob", "update_actor")


def test_distinct_tokens_counts_the_trie(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    from bench_agent import distinct_tokens

    rows = [torch.tensor([1, 2, 3, 4]), torch.tensor([1, 2, 5]), torch.tensor([1, 2, 3, 6]), torch.tensor([7])]
    assert distinct_tokens(rows) == 7  # 1 2 3 4 | 5 | 6 | 7


def test_bench_agent_toy(tmp_path, monkeypatch):
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")  # bench_engine's environment: the script need not re-exec
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    args = ["--scale", "0.03", "--tasks", "3", "--trials", "2", "--turns", "2", "--out", str(tmp_path)]
    report = run_benchmark(BENCH / "bench_agent.py", args, tmp_path / "agent.json", timeout_s=600)
    rows = {(r["engine"], r["op"]): r for r in report["rows"]}
    assert set(rows) == {(e, op) for e in ("minibatch", "micro_batch_trees", "star") for op in OPS}
    log_probs = rows["minibatch", "compute_log_prob"]
    assert 0.95 * log_probs["distinct_tokens"] <= log_probs["tokens_forwarded"] <= log_probs["distinct_tokens"]
    assert log_probs["fragments"] == 1
    for op in OPS:
        ours, theirs, star = (rows[e, op] for e in ("minibatch", "micro_batch_trees", "star"))
        assert ours["tokens_forwarded"] < theirs["tokens_forwarded"]
        assert ours["star_tokens_forwarded"] == star["tokens_forwarded"]
