"""LoRA through veRL's own model building (``lora_rank > 0``) with strategy=longstraw == stock fsdp2 with the same
LoRA settings on identical veRL 0.9.1 batches (1 rank, gloo, CPU): the LoRA parameters after one update_actor
step, the base parameters unchanged, the log-probs, and the reference log-probs veRL computes with the adapters
disabled."""

import pytest
import torch
from verl.workers.utils.padding import no_padding_2_padding

from verl_longstraw.testing.verl_harness import (
    actor_config,
    compute_log_prob,
    full,
    make_batch,
    make_engine,
    rel_diff,
    train_step,
)

LORA = {"lora_rank": 4, "lora_alpha": 8, "target_modules": "all-linear"}
MBS = 4
TOL = 1e-5


@pytest.fixture(scope="module")
def engines(dist, model_dirs):
    """Per family: (stock fsdp2, longstraw) engines of the same saved model under the same LoRA settings."""
    cache = {}

    def build(strategy: str, path: str):
        torch.manual_seed(0)  # peft draws the LoRA A matrices from the global generator: the same in both
        return make_engine(strategy, path, actor_config(strategy, "token-mean", False, 0.0, MBS), MBS, lora=LORA)

    def get(family):
        if family not in cache:
            cache[family] = tuple(build(s, model_dirs[family]) for s in ("fsdp2", "longstraw"))
        return cache[family]

    return get


def max_difference(a, b, td) -> float:
    return (no_padding_2_padding(a, td) - no_padding_2_padding(b, td)).abs().max().item()


@pytest.mark.parametrize("family", ["qwen3", "qwen3_next"])
def test_lora_update_actor_matches_fsdp2(engines, family):
    stock, longstraw = engines(family)
    before = {n: full(p.detach()).clone() for n, p in longstraw.module.named_parameters()}
    assert rel_diff(before, {n: full(p.detach()) for n, p in stock.module.named_parameters()}) == 0
    assert any(".lora_" in n for n in before) and all(
        p.requires_grad == (".lora_" in n) for n, p in longstraw.module.named_parameters()
    )
    td = make_batch(n_groups=2, group_size=4, seed=3)
    a = compute_log_prob(stock, td.clone(), MBS)
    b = compute_log_prob(longstraw, td.clone(), MBS)
    assert max_difference(a["log_probs"], b["log_probs"], td) <= TOL
    cfg_s, cfg_l = (actor_config(s, "seq-mean-token-mean", True, 0.01, MBS) for s in ("fsdp2", "longstraw"))
    gs, ps, _ = train_step(stock, td.clone(), cfg_s, MBS)
    gl, pl, _ = train_step(longstraw, td.clone(), cfg_l, MBS)
    assert set(gl) == set(gs) and all(".lora_" in n for n in gl)
    assert rel_diff(gl, gs) <= TOL
    lora = [n for n in pl if ".lora_" in n]
    assert rel_diff({n: pl[n] for n in lora}, {n: ps[n] for n in lora}) <= TOL
    assert any((pl[n] - before[n]).abs().max() > 0 for n in lora)  # the step moved them
    assert all((pl[n] == before[n]).all() for n in pl if n not in lora)  # the base is frozen


def test_lora_reference_log_probs_with_adapters_disabled(engines):
    """veRL's ref log-probs of a LoRA actor (``no_lora_adapter``: the engine's ``disable_adapter()``) equal
    stock fsdp2's under the same context, after a step that made the adapters matter."""
    stock, longstraw = engines("qwen3")
    td = make_batch(n_groups=2, group_size=4, seed=5)
    cfg_s, cfg_l = (actor_config(s, "token-mean", False, 0.0, MBS) for s in ("fsdp2", "longstraw"))
    train_step(stock, td.clone(), cfg_s, MBS)
    train_step(longstraw, td.clone(), cfg_l, MBS)
    with stock.disable_adapter(), longstraw.disable_adapter():
        a = compute_log_prob(stock, td.clone(), MBS)
        b = compute_log_prob(longstraw, td.clone(), MBS)
    adapted = compute_log_prob(longstraw, td.clone(), MBS)
    assert max_difference(a["log_probs"], b["log_probs"], td) <= TOL
    assert max_difference(adapted["log_probs"], b["log_probs"], td) > 1e-4  # the adapters change the values


@pytest.mark.parametrize("base_sync_done", [False, True], ids=["first_sync", "adapters_only"])
def test_lora_weight_sync_is_verls(engines, base_sync_done):
    """What veRL sends vLLM after a step (``get_per_tensor_param``: the base weights at the first sync, then the
    LoRA weights with their peft config) is stock fsdp2's, name for name."""
    stock, longstraw = engines("qwen3")
    td = make_batch(n_groups=2, group_size=4, seed=6)
    cfg_s, cfg_l = (actor_config(s, "token-mean", False, 0.0, MBS) for s in ("fsdp2", "longstraw"))
    train_step(stock, td.clone(), cfg_s, MBS)
    train_step(longstraw, td.clone(), cfg_l, MBS)
    (sent_s, config_s), (sent_l, config_l) = (
        e.get_per_tensor_param(base_sync_done=base_sync_done) for e in (stock, longstraw)
    )
    sent_s, sent_l = dict(sent_s), dict(sent_l)
    assert config_l == config_s and config_l is not None
    assert rel_diff({n: t.float() for n, t in sent_l.items()}, {n: t.float() for n, t in sent_s.items()}) <= TOL
    assert any("lora_" in n for n in sent_l) == base_sync_done
