"""The time model (verl_longstraw.timemodel): its work is the walk's own FLOP count split by phase and class, its
fit recovers known rates, and its command line prices a named model's step. Its accuracy against measured phases is
benchmarks/bench_time_model.py's (results in benchmarks/results/time_model/)."""

from __future__ import annotations

import math

import pytest
import torch

from verl_longstraw import GroupStats, Knobs, tree_backward
from verl_longstraw.adapters import adapter_for
from verl_longstraw.plan import star_plan, tree_plan
from verl_longstraw.testing.compare import make_group, weighted_loss
from verl_longstraw.timemodel import (
    ASSUMED,
    DEVICES,
    FLOP_WORK,
    PHASES,
    WORK,
    calibrate,
    main,
    phase_work,
    seconds,
    stream_overlap,
)
from verl_longstraw.tiny import tiny_model


def _tree(vocab: int) -> tuple[list[torch.Tensor], list[int]]:
    system, rest = make_group(vocab, 24, [6, 6, 5, 7, 4, 6], seed=3)
    rows = [torch.cat([system, rest[i // 3], r]) for i, r in enumerate(rest[2:])]
    return rows, [30] * len(rows)


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
@pytest.mark.parametrize("mode", ["exact", "detached"])
def test_the_work_is_the_walks_flops_by_phase(family, mode):
    """Summed over phases and classes, the FLOPs are what the walk itself counted (``GroupStats.model_flops``); a
    capture runs forward only, the backward of a replay or recompute is BACKWARD x its forward."""
    model = tiny_model(family, torch.float32)
    rows, starts = _tree(model.config.vocab_size)
    knobs = Knobs(chunk_size=8, prompt_grad=mode)
    plan = tree_plan(rows, starts, knobs)
    stats = GroupStats()
    tree_backward(model, rows, starts, weighted_loss, stats=stats, knobs=knobs, plan=plan)
    work = phase_work(model.config, plan, mode, torch.float32)
    total = sum(work[p][name] for p in PHASES for name in FLOP_WORK)
    assert math.isclose(total, stats.model_flops, rel_tol=1e-9), (total, stats.model_flops)
    assert work["capture"]["attention_backward"] == 0 and work["capture"]["matmul"] > 0
    assert (work["recompute"]["matmul"] > 0) == (mode == "exact")
    if family == "qwen3_5":  # the hybrid's Gated DeltaNet layers
        assert all(work[p]["scan"] > 0 for p in ("capture", "replay"))
    assert all(work[p]["collective"] == work[p]["host_copy"] == 0 for p in PHASES)  # one process, sums on device
    assert work["capture"]["layer_calls"] == len(plan.captured) * model.config.num_hidden_layers


def test_collectives_and_host_copies_appear_where_they_run():
    """Under CP the layer calls' collectives and FSDP2's gathers count; the host copies only with the state's
    gradient sums on the host in exact mode."""
    model = tiny_model("qwen3_5", torch.float32)
    plan = star_plan(64, [8, 8], Knobs(chunk_size=16), 2, 0)
    cp = phase_work(model.config, plan, "exact", torch.float32, state_grad_on_host=True)
    assert all(cp[p]["collective"] > 0 for p in PHASES) and cp["recompute"]["host_copy"] > 0
    fsdp = phase_work(model.config, plan, "exact", torch.float32, fsdp_param_bytes=1000)
    model_calls = cp["capture"]["layer_calls"] / model.config.num_hidden_layers  # a chunk per step
    assert fsdp["capture"]["collective"] - cp["capture"]["collective"] == pytest.approx(500 * model_calls)
    detached = phase_work(model.config, plan, "detached", torch.float32, state_grad_on_host=True)
    assert all(detached[p]["host_copy"] == 0 for p in PHASES)
    # a frozen base (LoRA): the matmuls' backward is their input gradient only, no gradient is reduce-scattered
    lora = phase_work(model.config, plan, "exact", torch.float32, fsdp_param_bytes=1000, frozen_base=True)
    forward = cp["capture"]["matmul"]  # the recompute runs the captured chunks' forward again, then its backward
    assert (cp["recompute"]["matmul"], lora["recompute"]["matmul"]) == pytest.approx((3 * forward, 2 * forward))
    assert fsdp["recompute"]["collective"] - lora["recompute"]["collective"] == pytest.approx(500 * model_calls)


def test_streamed_state_copies_and_their_overlap():
    """With ``state_on_host`` a step copies the prefix rows it reads to the device: a detached one-chunk star's
    replays each read the prompt's rows, forward and backward; its capture reads none. The copies hide behind the
    phase's other seconds up to those seconds."""
    model = tiny_model("qwen3", torch.float32)
    prompt_len, group = 33, 3
    plan = star_plan(prompt_len, [8] * group, Knobs(replay_tokens=8), 1, 0)
    off = phase_work(model.config, plan, "detached", torch.float32)
    on = phase_work(model.config, plan, "detached", torch.float32, state_on_host=True)
    rows = sum(s.nbytes(prompt_len - 1, torch.float32) for layer in adapter_for(model).specs() for s in layer)
    assert on["replay"]["state_stream"] == group * 2 * rows and on["capture"]["state_stream"] == 0
    assert all(off[p]["state_stream"] == 0 for p in PHASES)
    assert all(on[p][name] == off[p][name] for p in PHASES for name in WORK if name != "state_stream")
    copied, other = on["replay"]["state_stream"], seconds(off["replay"], dict.fromkeys(WORK, 1.0))
    for rate, hidden in ((1e30, None), (copied / (other / 2), None), (copied / (2 * other), other)):
        copy, hid = stream_overlap(on["replay"], dict.fromkeys(WORK, 1.0) | {"state_stream": rate})
        assert copy == pytest.approx(on["replay"]["state_stream"] / rate)
        assert hid == pytest.approx(copy if hidden is None else hidden)  # all hidden, or the compute's seconds


def test_calibrate_recovers_the_rates_of_consistent_phases():
    truth = {"matmul": 2e9, "attention_forward": 5e8, "attention_backward": 2.5e8, "scan": 1e8, "layer_calls": 1e3}
    works = [dict.fromkeys(WORK, 0.0) | {"matmul": m, "attention_forward": a, "scan": s, "layer_calls": c}
             for m, a, s, c in ((4e9, 1e8, 5e7, 10), (8e9, 9e8, 1e8, 40), (1e9, 4e9, 2e7, 8), (3e9, 2e8, 9e8, 16))]
    works.append(dict.fromkeys(WORK, 0.0) | {"matmul": 6e9, "attention_backward": 3e9, "layer_calls": 30})
    measured = [seconds(w, truth) for w in works]
    rates = calibrate(works, measured)
    for name, rate in truth.items():
        assert rates[name] == pytest.approx(rate, rel=1e-6), name
    assert rates["collective"] == rates["host_copy"] == math.inf  # no phase ran any: free


def test_the_command_line_prices_a_named_models_step(capsys):
    text = main(["--model", "Qwen3.5-27B", "--prompt-len", "131072", "--cp-size", "2", "--gpu", "H20",
                 "--prompt-grad", "detached", "exact", "--reference-seconds", "600", "--lora",
                 "--reference-phase", "capture=400"])
    assert "a model, not a measurement" in text and "## detached: predicted step" in text and "## exact:" in text
    assert text.count("| recompute |") == 2 and "Beside the reference 600 s" in text and "LoRA" in text
    assert text.count("- capture in the reference's 400 s: MFU") == 2
    assert "CP 2 (NVLink collectives)" in text
    wide = main(["--model", "Qwen3.5-27B", "--prompt-len", "131072", "--cp-size", "16", "--prompt-grad", "detached"])
    assert "CP 16 (inter-node collectives)" in wide
    rates = ASSUMED.rates(DEVICES["H20"])
    assert rates["matmul"] == pytest.approx(0.6 * 148e12) and rates["collective"] == pytest.approx(0.7 * 450e9)


def test_the_cpu_validation_bench_fits_two_settings_and_predicts_the_rest(tmp_path, monkeypatch):
    """benchmarks/bench_time_model.py on tiny settings: rates fitted on the calibration settings, a row per setting
    with its error, the held-out count (its exit status says whether all are within 25%: not asserted, the box's
    speed decides it)."""
    from pathlib import Path

    from verl_longstraw.testing.scripts import load_script

    bench = load_script(Path(__file__).resolve().parents[1] / "benchmarks" / "bench_time_model.py")
    setting = bench.Setting
    monkeypatch.setattr(bench, "MODEL", {"max_position_embeddings": 512})
    monkeypatch.setattr(bench, "CALIBRATION", (setting("A", 64, 2, 8, 16, "exact"), setting("B", 128, 2, 16, 32,
                                                                                             "exact")))
    monkeypatch.setattr(bench, "PREDICTED", (setting("C", 96, 3, 8, 32, "detached"),
                                             setting("T", 32, 2, 8, 16, "exact", tree=True, question=8)))
    monkeypatch.setattr("sys.argv", ["bench", "--repeats", "1", "--out", str(tmp_path), "--name", "tiny"])
    with pytest.raises(SystemExit):
        bench.main()
    text = (tmp_path / "tiny.md").read_text()
    assert all(f"| {name} |" in text for name in "ABCT") and "Held-out settings: 2" in text
    assert any(line.startswith("| matmul |") or line.startswith("| scan |") for line in text.splitlines())
