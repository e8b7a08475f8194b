"""``python -m verl_longstraw.profile``: a tiny CPU sweep writes a row per setting, its Pareto front and its plot."""

import csv

import torch

from verl_longstraw.estimate import estimate_memory
from verl_longstraw.profile import load_model, main
from verl_longstraw.tiny import tiny_config, tiny_model

PROMPT_LEN, RESPONSE_LEN, REPLAY_TOKENS = 64, 8, 16


def test_tiny_sweep_writes_rows_front_and_plot(tmp_path):
    """Four LongStraw settings (G 1 and 2, one prompt chunk or chunks of 16; exact) and the standard path per G:
    each row has positive seconds and peak bytes, the rows marked Pareto are the ones no other row of the same G
    beats in both (exact and standard compute the same gradient), the estimate column is ``estimate_memory``'s total
    of the row's knobs, and the PNG exists."""
    main(["--model", "tiny:qwen3", "--prompt-len", str(PROMPT_LEN), "--response-len", str(RESPONSE_LEN),
          "--group-sizes", "1", "2", "--chunk-sizes", "none", "16", "--replay-tokens", str(REPLAY_TOKENS),
          "--standard", "--device", "cpu", "--out", str(tmp_path), "--name", "sweep"])
    with open(tmp_path / "sweep.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["path"], r["G"], r["chunk_size"]) for r in rows] == [
        ("longstraw", "1", "none"), ("longstraw", "1", "16"), ("longstraw", "2", "none"), ("longstraw", "2", "16"),
        ("standard", "1", "none"), ("standard", "2", "none"),
    ]
    points = [(r["G"], float(r["step_s"]), int(r["peak_bytes"])) for r in rows]
    assert all(seconds > 0 and peak > 0 for _, seconds, peak in points), points
    for point, row in zip(points, rows, strict=True):
        dominated = any(o[0] == point[0] and o[1] <= point[1] and o[2] <= point[2] and o != point for o in points)
        assert (row["pareto"] == "True") == (not dominated), (point, points)
    for r in rows[:4]:
        chunk_size = None if r["chunk_size"] == "none" else int(r["chunk_size"])
        expected = estimate_memory(tiny_config("qwen3"), PROMPT_LEN, int(r["G"]), RESPONSE_LEN, chunk_size, "exact",
                                   torch.float32, replay_tokens=REPLAY_TOKENS, device_type="cpu")
        assert int(r["estimate_bytes"]) == expected.total_bytes
        assert float(r["capture_s"]) > 0 and float(r["replay_s"]) > 0 and float(r["prompt_backward_s"]) > 0
    assert all(r["estimate_bytes"] == "" and r["capture_s"] == "" for r in rows[4:])
    assert (tmp_path / "sweep.png").stat().st_size > 0


def test_a_checkpoint_path_loads_with_its_overrides(tmp_path):
    """A Hugging Face checkpoint folder (``save_pretrained``) loads through transformers' ``from_pretrained`` with the
    config overrides applied, in train mode, with the weights saved."""
    saved = tiny_model("qwen3_moe")
    saved.save_pretrained(tmp_path)
    model = load_model(str(tmp_path), {"num_experts_per_tok": 1}, torch.float32, torch.device("cpu"), 0)
    assert model.training and model.config.num_experts_per_tok == 1
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), saved.state_dict().values(),
                                                 strict=True))
