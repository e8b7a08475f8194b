"""The parity study's report (recipes/parity/analyze.py) on synthetic veRL file-logger metrics."""

from __future__ import annotations

import json
from pathlib import Path

from verl_longstraw.testing.scripts import load_script

analyze = load_script(Path(__file__).resolve().parents[1] / "recipes" / "parity" / "analyze.py")


def write_run(folder: Path, rewards: list[float], grad_norm: float, step_s: float) -> None:
    (folder / "metrics").mkdir(parents=True)
    with open(folder / "metrics" / "attempt-1.jsonl", "w") as f:
        for step, reward in enumerate(rewards, 1):
            data = {"critic/score/mean": reward, "actor/grad_norm": grad_norm + step,
                    "timing_s/step": step_s, "timing_s/update_actor": step_s / 2}
            f.write(json.dumps({"step": step, "data": data}) + "\n")


def test_table_and_plot(tmp_path):
    rewards = {"fsdp2": [0.1] * 5 + [0.5] * 5, "exact": [0.2] * 5 + [0.6] * 5, "detached": [0.3] * 10}
    for arm, curve in rewards.items():
        for seed in (1, 2):
            write_run(tmp_path / "runs" / f"{arm}-seed{seed}", curve, grad_norm=seed, step_s=10.0 * seed)
    out = tmp_path / "results"
    assert analyze.main(["--runs", str(tmp_path / "runs"), "--seeds", "1", "2", "--results", str(out)]) == 0

    report = json.loads((out / "parity.json").read_text())
    table = {row["arm"]: row for row in report["table"]}
    assert table["exact"]["reward_start"] == [0.2, 0.2] and table["exact"]["reward_final"] == [0.6, 0.6]
    assert table["fsdp2"]["grad_norm_mean"] == [6.5, 7.5]  # mean over steps 1..10 of seed + step
    assert table["detached"]["step_s"] == [10.0, 20.0]  # step 1 excluded, the rest averaged
    md = (out / "parity.md").read_text()
    assert "| exact | 2 | 0.200 ± 0.000 | 0.600 ± 0.000 |" in md
    assert (out / "parity.png").stat().st_size > 0


def test_missing_runs_are_reported(tmp_path, capsys):
    assert analyze.main(["--runs", str(tmp_path), "--seeds", "1", "--results", str(tmp_path / "r")]) == 1
    assert "no metrics for fsdp2 seed 1" in capsys.readouterr().err
