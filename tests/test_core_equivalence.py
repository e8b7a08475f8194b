"""Replay equals the standard full-sequence computation, for every family, chunked or not."""

import pytest
import torch
from models import FAMILIES, VOCAB, exact_linear_attention, tiny_model
from reference import full_log_probs, grads_of, make_group, relative_error, standard_grads, weighted_loss

from verl_longstraw import group_backward, group_log_probs

PROMPT_LEN = 301
RESPONSE_LENS = (17, 1, 40)
CHUNKINGS = (None, 64, 97)


@pytest.fixture(scope="module", params=FAMILIES)
def model(request):
    return tiny_model(request.param)


@pytest.fixture(scope="module")
def group():
    return make_group(VOCAB, PROMPT_LEN, RESPONSE_LENS)


@pytest.fixture(scope="module")
def reference_grads(model, group):
    return standard_grads(model, *group, weighted_loss)


@pytest.mark.parametrize("chunk_size", CHUNKINGS)
def test_log_probs_match_full_forward(model, group, chunk_size):
    prompt, responses = group
    log_probs, entropies = group_log_probs(model, prompt, responses, chunk_size=chunk_size, return_entropy=True)
    with torch.no_grad():
        for response, lp, ent in zip(responses, log_probs, entropies):
            ref_lp, ref_ent = full_log_probs(model, prompt, response)
            assert lp.dtype == torch.float32 and lp.shape == response.shape
            assert (lp - ref_lp).abs().max() < 1e-5
            assert (ent - ref_ent).abs().max() < 1e-5


def test_temperature(model, group):
    prompt, responses = group
    lp = group_log_probs(model, prompt, responses[:1], temperature=0.7)[0]
    with torch.no_grad():
        ref = full_log_probs(model, prompt, responses[0], temperature=0.7)[0]
    assert (lp - ref).abs().max() < 1e-5


@pytest.mark.parametrize("chunk_size", CHUNKINGS)
def test_exact_gradient_matches_standard(model, group, reference_grads, chunk_size):
    prompt, responses = group
    model.zero_grad(set_to_none=True)
    losses = group_backward(model, prompt, responses, weighted_loss, prompt_grad="exact", chunk_size=chunk_size)
    assert losses.shape == (len(responses),) and not losses.requires_grad
    assert relative_error(grads_of(model), reference_grads) < 1e-5


def test_detached_gradient_runs_and_is_biased(model, group, reference_grads, record_property):
    prompt, responses = group
    model.zero_grad(set_to_none=True)
    group_backward(model, prompt, responses, weighted_loss, prompt_grad="detached")
    error = relative_error(grads_of(model), reference_grads)
    record_property("detached_relative_error", error)
    print(f"{model.config.model_type}: detached gradient relative L2 error vs standard = {error:.3f}")
    assert 0.0 < error < float("inf")


def test_entropy_in_loss(model, group):
    """with_entropy passes the differentiable entropy to loss_fn (an entropy bonus)."""
    prompt, responses = group

    def loss(i, lp, ent):
        return weighted_loss(i, lp) - 0.01 * ent.mean()

    model.zero_grad(set_to_none=True)
    for i, r in enumerate(responses):
        lp, ent = full_log_probs(model, prompt, r)
        loss(i, lp, ent).backward()
    expected = grads_of(model)
    model.zero_grad(set_to_none=True)
    group_backward(model, prompt, responses, loss, chunk_size=97, with_entropy=True)
    assert relative_error(grads_of(model), expected) < 1e-5


@pytest.mark.parametrize("family", FAMILIES)
def test_exact_gradient_float64(family, monkeypatch):
    model = tiny_model(family, dtype=torch.float64)
    exact_linear_attention(model, monkeypatch)
    prompt, responses = make_group(VOCAB, 97, (9, 3))
    expected = standard_grads(model, prompt, responses, weighted_loss)
    model.zero_grad(set_to_none=True)
    group_backward(model, prompt, responses, weighted_loss, chunk_size=40)
    assert relative_error(grads_of(model), expected) < 1e-7
