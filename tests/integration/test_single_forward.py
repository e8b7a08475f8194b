"""One replay per response in training (longstraw.single_forward) == the two-pass path, and the fallback."""

import functools

import pytest
import torch
from verl.utils import tensordict_utils as tu
from verl.workers.config import PolicyLossConfig
from verl.workers.utils.losses import ppo_loss

from verl_longstraw.integration.losses import PER_RESPONSE_POLICY_LOSSES, splits_by_response
from verl_longstraw.testing.verl_harness import actor_config, full, make_batch, make_engine, rel_diff

MBS = 4


@pytest.fixture(scope="module")
def engine(dist, model_dirs):
    return {}, lambda family: make_engine(
        "longstraw", model_dirs[family], actor_config("longstraw", "token-mean", False, 0.0, MBS), MBS
    )


def gradients(engine, td, config, single_forward: bool) -> tuple[dict, dict]:
    """Parameter gradients of one update_actor step's forward/backward (no optimizer step) and its metrics."""
    object.__setattr__(engine.longstraw, "single_forward", single_forward)
    tu.assign_non_tensor(td, calculate_entropy=config.entropy_coeff != 0, compute_loss=True,
                         micro_batch_size_per_gpu=MBS)
    with engine.train_mode():
        engine.optimizer_zero_grad()
        out = engine.forward_backward_batch(td, functools.partial(ppo_loss, config=config), forward_only=False)
        grads = {n: full(p.grad).clone() for n, p in engine.module.named_parameters() if p.grad is not None}
        engine.optimizer_zero_grad()
    return grads, out["metrics"]


def loss_config(loss_mode: str, agg: str = "token-mean", kl_entropy: bool = True):
    config = actor_config("longstraw", agg, kl_entropy, 0.01 if kl_entropy else 0.0, MBS)
    object.__setattr__(config, "policy_loss", PolicyLossConfig(loss_mode=loss_mode))
    return config


def cached_engine(engine, family):
    cache, build = engine
    if family not in cache:
        cache[family] = build(family)
    return cache[family]


CASES = [(mode, "token-mean") for mode in sorted(PER_RESPONSE_POLICY_LOSSES)] + [
    ("vanilla", "seq-mean-token-mean"), ("gspo", "seq-mean-token-mean"), ("vanilla", "seq-mean-token-sum-norm"),
]


@pytest.mark.parametrize(("loss_mode", "agg"), CASES)
def test_single_forward_equals_two_pass(engine, loss_mode, agg):
    """For every loss it claims, one replay per response gives the two-pass gradient (fp32, relative < 1e-6),
    with KL loss and entropy on, groups split across micro-batches; the loss value and metrics agree too."""
    longstraw = cached_engine(engine, "qwen3")
    config = loss_config(loss_mode, agg)
    assert splits_by_response(functools.partial(ppo_loss, config=config))
    td = make_batch(n_groups=3, group_size=4, seed=11)
    single, m_single = gradients(longstraw, td.clone(), config, single_forward=True)
    two_pass, m_two = gradients(longstraw, td.clone(), config, single_forward=False)
    assert m_single["longstraw/single_forward"].values == [1.0] * len(m_single["longstraw/single_forward"].values)
    assert set(m_two["longstraw/single_forward"].values) == {0.0}
    assert rel_diff(single, two_pass) < 1e-6
    keys = {k for k in m_two if not k.startswith("longstraw/") and k != "kl_coef"}
    assert {"actor/pg_loss", "kl_loss", "actor/entropy_loss"} <= keys <= set(m_single)
    for key in keys:
        a, b = (torch.tensor([float(v) for v in m[key].values]) for m in (m_single, m_two))
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-7), key


def test_single_forward_hybrid_family(engine):
    """Gated DeltaNet + attention (qwen3_next) with the exact prompt gradient: same gradient both ways."""
    longstraw = cached_engine(engine, "qwen3_next")
    config = loss_config("vanilla")
    td = make_batch(n_groups=2, group_size=4, seed=12)
    single, _ = gradients(longstraw, td.clone(), config, single_forward=True)
    two_pass, _ = gradients(longstraw, td.clone(), config, single_forward=False)
    assert rel_diff(single, two_pass) < 1e-6


@pytest.mark.parametrize("loss_mode", ["clip_cov", "kl_cov"])
def test_batch_statistic_losses_fall_back_to_two_passes(engine, loss_mode):
    """Losses that read batch statistics of the log-probs keep the two-pass path (metric 0), whatever the knob."""
    longstraw = cached_engine(engine, "qwen3")
    config = loss_config(loss_mode)
    assert not splits_by_response(functools.partial(ppo_loss, config=config))
    td = make_batch(n_groups=2, group_size=4, seed=13)
    grads, metrics = gradients(longstraw, td.clone(), config, single_forward=True)
    assert set(metrics["longstraw/single_forward"].values) == {0.0}
    assert grads and all(torch.isfinite(g).all() for g in grads.values())


def test_unknown_losses_do_not_split():
    """Only veRL's ppo_loss with a listed policy loss splits; any other callable takes the two-pass path."""
    config = loss_config("vanilla")
    assert not splits_by_response(lambda **kwargs: None)
    assert not splits_by_response(functools.partial(lambda config, **kw: None, config=config))
    assert not splits_by_response(functools.partial(ppo_loss, config=loss_config("dro")))
