"""longstraw engine == veRL's stock fsdp2 engine on veRL 0.9.1 batches (1 rank, gloo, CPU)."""

import pytest
import torch
from verl.utils.device import get_torch_device
from verl.workers.utils.padding import no_padding_2_padding

from verl_longstraw.testing.verl_harness import (
    actor_config,
    compute_log_prob,
    make_batch,
    make_engine,
    rel_diff,
    train_step,
)
from verl_longstraw.tiny import REPRESENTATIVES, tiny_config

FAMILIES = ("qwen3", "qwen3_next", "deepseek_v3")  # dense, hybrid Gated DeltaNet, MLA: the full matrix below
MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")
MBS = 4  # micro-batch size: shuffled groups of 4 split across micro-batches


@pytest.fixture(scope="module")
def engines(dist, model_dirs):
    """Per family: (stock fsdp2 engine, longstraw engine), built once from the same saved model."""
    cache = {}

    def get(family):
        if family not in cache:
            path = model_dirs[family]
            stock = make_engine("fsdp2", path, actor_config("fsdp2", "token-mean", False, 0.0, MBS), MBS)
            longstraw = make_engine("longstraw", path, actor_config("longstraw", "token-mean", False, 0.0, MBS), MBS)
            cache[family] = stock, longstraw
        return cache[family]

    return get


@pytest.mark.parametrize("family", FAMILIES)
def test_compute_log_prob_matches_fsdp2(engines, family):
    stock, longstraw = engines(family)
    td = make_batch(n_groups=3, group_size=4, seed=1, temperature=0.7)
    a = compute_log_prob(stock, td.clone(), MBS)
    b = compute_log_prob(longstraw, td.clone(), MBS)
    for key in ("log_probs", "entropy"):
        x, y = no_padding_2_padding(a[key], td), no_padding_2_padding(b[key], td)
        assert (x - y).abs().max().item() < 1e-5, key


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kl_entropy", [False, True], ids=["plain", "kl+entropy"])
def test_update_actor_matches_fsdp2(engines, family, mode, kl_entropy):
    stock, longstraw = engines(family)
    coeff = 0.01 if kl_entropy else 0.0
    td = make_batch(n_groups=2, group_size=4, seed=2)
    gs, ps, _ = train_step(stock, td.clone(), actor_config("fsdp2", mode, kl_entropy, coeff, MBS), MBS)
    gl, pl, metrics = train_step(longstraw, td.clone(), actor_config("longstraw", mode, kl_entropy, coeff, MBS), MBS)
    assert rel_diff(gl, gs) < 1e-5
    assert rel_diff(pl, ps) < 1e-5
    assert "longstraw/fragments" in metrics and "longstraw/prompt_state_bytes" in metrics


@pytest.mark.parametrize("family", [f for f in REPRESENTATIVES if f not in FAMILIES])
def test_every_other_adapter_matches_fsdp2(dist, model_dirs, family):
    """One family per adapter the tests above leave out (``tiny.REPRESENTATIVES``: gpt_oss's sliding windows of 8 and
    sinks, which prompts of 10-30 tokens outrun; Mamba2 with Nemotron-H's blocks, Granite 4.0's muP multipliers and
    Bamba's partial RoPE; Kimi Linear's KDA; LFM2's short convolutions; Jamba's Mamba1) through both engines:
    log-probs and entropies, then one update_actor step with KL loss and entropy. Both engines use the attention
    the tiny config sets (``tiny.use_reference_kernels``: eager for gpt_oss's sinks, which SDPA takes no logits
    of)."""
    attn = tiny_config(family)._attn_implementation
    path = model_dirs[family]
    stock = make_engine("fsdp2", path, actor_config("fsdp2", "token-mean", False, 0.0, MBS), MBS,
                        attn_implementation=attn)
    longstraw = make_engine("longstraw", path, actor_config("longstraw", "token-mean", False, 0.0, MBS), MBS,
                            attn_implementation=attn)
    td = make_batch(n_groups=3, group_size=4, seed=1, temperature=0.7, prompt_len=(10, 30))
    a, b = compute_log_prob(stock, td.clone(), MBS), compute_log_prob(longstraw, td.clone(), MBS)
    for key in ("log_probs", "entropy"):
        x, y = no_padding_2_padding(a[key], td), no_padding_2_padding(b[key], td)
        assert (x - y).abs().max().item() < 1e-5, key
    td = make_batch(n_groups=2, group_size=4, seed=2, prompt_len=(10, 30))
    gs, ps, _ = train_step(stock, td.clone(), actor_config("fsdp2", "token-mean", True, 0.01, MBS), MBS)
    gl, pl, _ = train_step(longstraw, td.clone(), actor_config("longstraw", "token-mean", True, 0.01, MBS), MBS)
    assert rel_diff(gl, gs) < 1e-5
    assert rel_diff(pl, ps) < 1e-5


def test_rows_without_response_tokens_match_fsdp2(engines):
    """Rows with a prompt and no response tokens (a whole group of them, and one more) get the
    values fsdp2 gives them and no loss term; the other rows train as in fsdp2."""
    stock, longstraw = engines("qwen3")
    td = make_batch(n_groups=3, group_size=4, seed=7, empty_responses=5)
    a, b = compute_log_prob(stock, td.clone(), MBS), compute_log_prob(longstraw, td.clone(), MBS)
    for key in ("log_probs", "entropy"):
        x, y = no_padding_2_padding(a[key], td), no_padding_2_padding(b[key], td)
        assert (x - y).abs().max().item() < 1e-5, key
    cfg_s, cfg_l = (actor_config(s, "seq-mean-token-mean", True, 0.01, MBS) for s in ("fsdp2", "longstraw"))
    gs, ps, _ = train_step(stock, td.clone(), cfg_s, MBS)
    gl, pl, _ = train_step(longstraw, td.clone(), cfg_l, MBS)
    assert rel_diff(gl, gs) < 1e-5
    assert rel_diff(pl, ps) < 1e-5


def test_peak_memory_metric_covers_the_step_only(engines):
    """`longstraw/peak_memory_gb` is this step's peak, not the process's lifetime peak."""
    _, longstraw = engines("qwen3")
    spike = torch.ones(2**27)  # 512 MiB resident, freed before the step
    lifetime_peak = get_torch_device().max_memory_allocated()
    del spike
    td = make_batch(n_groups=1, group_size=MBS, seed=6)
    _, _, metrics = train_step(longstraw, td, actor_config("longstraw", "token-mean", False, 0.0, MBS), MBS)
    step_peak = max(metrics["longstraw/peak_memory_gb"].values) * 2**30
    assert 0 < step_peak < lifetime_peak - 2**28


@pytest.mark.parametrize("single_forward", [True, False])
def test_training_captures_each_segment_once_per_walk(engines, monkeypatch, single_forward):
    """Training walks each micro-batch's prefix trees once (one replay per response), or twice (two passes:
    log-probs, then the backward); each walk captures every captured segment of its plan once (a prompt is
    forwarded two or three times per step: the captures and the recompute), and the metrics count what ran."""
    import verl_longstraw.api as api
    import verl_longstraw.execute as execute

    _, longstraw = engines("qwen3")
    previous = longstraw.longstraw.single_forward
    object.__setattr__(longstraw.longstraw, "single_forward", single_forward)
    captures: list[int] = []
    walks: list[tuple[str, int, int]] = []
    capture, walk = execute._Walk._capture, api.walk

    def counted_walk(adapter, plan, sequences, mode, *args, **kwargs):
        walks.append((mode, len(plan.captured), plan.tokens_forwarded(mode)))
        return walk(adapter, plan, sequences, mode, *args, **kwargs)

    monkeypatch.setattr(execute._Walk, "_capture", lambda self, step: captures.append(1) or capture(self, step))
    monkeypatch.setattr(api, "walk", counted_walk)
    td = make_batch(n_groups=2, group_size=4, seed=5)
    try:
        _, _, metrics = train_step(longstraw, td, actor_config("longstraw", "token-mean", False, 0.0, MBS), MBS)
    finally:
        object.__setattr__(longstraw.longstraw, "single_forward", previous)
    if single_forward:
        assert walks and all(mode == "exact" for mode, _, _ in walks)
    else:
        assert [mode for mode, _, _ in walks] == ["log_probs", "exact"] * (len(walks) // 2) and walks
        assert [n for _, n, _ in walks[::2]] == [n for _, n, _ in walks[1::2]]  # the same plan twice
    assert len(captures) == sum(n for _, n, _ in walks) > 0
    assert sum(metrics["longstraw/tokens_forwarded"].values) == sum(t for _, _, t in walks)


def test_detached_differs_from_exact(dist, model_dirs):
    """prompt_grad=detached is a different (biased) gradient; exact is the standard one."""
    stock_cfg = actor_config("fsdp2", "token-mean", False, 0.0, MBS)
    cfg = actor_config("longstraw", "token-mean", False, 0.0, MBS, prompt_grad="detached")
    stock = make_engine("fsdp2", model_dirs["qwen3"], stock_cfg, MBS)
    detached = make_engine("longstraw", model_dirs["qwen3"], cfg, MBS)
    td = make_batch(n_groups=2, group_size=4, seed=3)
    gs, _, _ = train_step(stock, td.clone(), stock_cfg, MBS)
    gd, _, _ = train_step(detached, td.clone(), cfg, MBS)
    assert rel_diff(gd, gs) > 1e-3


@pytest.mark.parametrize("family", FAMILIES)
def test_gradient_checkpointing_recomputes(engines, family):
    """veRL's default HF gradient checkpointing stays on, and longstraw's training replays run through it."""
    stock, longstraw = engines(family)
    for engine in (stock, longstraw):
        assert _checkpointed(engine) and all(m.gradient_checkpointing for m in _checkpointed(engine))
    calls: list[int] = []
    originals = {m: m._gradient_checkpointing_func for m in _checkpointed(longstraw)}
    for m, fn in originals.items():
        m._gradient_checkpointing_func = _counted(fn, calls)
    try:
        td = make_batch(n_groups=1, group_size=MBS, seed=4)
        train_step(longstraw, td, actor_config("longstraw", "token-mean", False, 0.0, MBS), MBS)
    finally:
        for m, fn in originals.items():
            m._gradient_checkpointing_func = fn
    assert calls


def _checkpointed(engine) -> list:
    return [m for m in engine.module.modules() if hasattr(m, "_gradient_checkpointing_func")]


def _counted(fn, calls: list):
    def wrapper(*args, **kwargs):
        calls.append(1)
        return fn(*args, **kwargs)

    return wrapper


def _steps_off_and_on(engines, knob: str) -> list:
    """``train_step``'s results of qwen3_next's engine with the boolean ``knob`` off, then on: the same batch, at
    learning rate 0 so both steps start from the same parameters (the engine's knobs and rate restored after)."""
    import dataclasses

    _, longstraw = engines("qwen3_next")
    td = make_batch(n_groups=1, group_size=MBS, seed=8)
    cfg = actor_config("longstraw", "token-mean", False, 0.0, MBS)
    knobs, lr = longstraw.longstraw, longstraw.optimizer.param_groups[0]["lr"]
    try:
        results = []
        for on in (False, True):
            longstraw.optimizer.param_groups[0]["lr"] = 0.0
            longstraw.longstraw = dataclasses.replace(knobs, **{knob: on})
            results.append(train_step(longstraw, td.clone(), cfg, MBS))
    finally:
        longstraw.longstraw = knobs
        longstraw.optimizer.param_groups[0]["lr"] = lr
    return results


def test_state_gradient_on_host_same_step_and_reported(engines):
    """longstraw.state_grad_on_host: the same gradients, the state-gradient bytes reported on the host (with their
    staging buffer) instead of the device; the estimate behind the pre-flight check is reported too."""
    (on_device, _, device_metrics), (on_host, _, host_metrics) = _steps_off_and_on(engines, "state_grad_on_host")
    _, longstraw = engines("qwen3_next")
    assert rel_diff(on_host, on_device) < 1e-6

    def held(metrics, where):
        return max(metrics[f"longstraw/state_grad_{where}_bytes"].values)

    assert held(device_metrics, "device") > 0 and held(device_metrics, "host") == 0
    assert held(host_metrics, "device") == 0
    # on the host: the sums and the staging buffer of one state tensor (tests/test_offload.py pins it to the byte)
    staging = held(host_metrics, "host") - held(device_metrics, "device")
    assert 0 < staging <= held(device_metrics, "device")
    # the pre-flight figure holds the whole model unsharded at R = 1: fp32 parameters and gradients, 8 B each
    whole_model = 8 * sum(p.numel() for p in longstraw.module.parameters())
    assert max(device_metrics["longstraw/estimated_peak_gb"].values) * 2**30 > whole_model
    assert sum(device_metrics["longstraw/cp_collective_bytes"].values) == 0  # no CP group


def test_state_on_host_same_step_and_reported(engines):
    """longstraw.state_on_host: the same step (its checkpointed replays and recomputes bring each layer's rows from
    the host), the rows reported on the host."""
    (resident, _, resident_metrics), (streamed, _, streamed_metrics) = _steps_off_and_on(engines, "state_on_host")
    assert rel_diff(streamed, resident) < 1e-6
    assert max(resident_metrics["longstraw/prompt_state_host_bytes"].values) == 0
    assert max(streamed_metrics["longstraw/prompt_state_host_bytes"].values) > 0


def test_preflight_fails_an_oversized_step_before_any_capture(engines, monkeypatch):
    import dataclasses

    import verl_longstraw.api as api

    _, longstraw = engines("qwen3")
    captures: list[int] = []
    monkeypatch.setattr(api, "capture", lambda *a, **k: captures.append(1))
    monkeypatch.setattr(longstraw, "longstraw", dataclasses.replace(longstraw.longstraw, memory_budget_gb=2**-20))
    td = make_batch(n_groups=2, group_size=4, seed=9)
    expected = r"pre-flight.*does not fit the budget \(longstraw.memory_budget_gb: .*unsharded"
    with pytest.raises(MemoryError, match=expected):
        train_step(longstraw, td, actor_config("longstraw", "token-mean", False, 0.0, MBS), MBS)
    assert captures == []
