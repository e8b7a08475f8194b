"""Replay equals the standard full-sequence computation, for every family and MoE variant, chunked or not."""

import pytest
import torch

from verl_longstraw import Knobs, group_backward, group_log_probs
from verl_longstraw.testing.compare import (
    float64_throughout,
    full_log_probs,
    grads_of,
    make_group,
    max_abs_error,
    relative_error,
    standard_grads,
    weighted_loss,
)
from verl_longstraw.tiny import FAMILIES, VARIANTS, VOCAB, tiny_model

PROMPT_LEN = 301
RESPONSE_LENS = (17, 1, 40)
CHUNKINGS = (None, 64, 97)
FLOAT64_TOL = 1e-10  # test_exact_gradient_float64: measured <= 1e-15 (AMD EPYC Zen 4; passes with its AVX2 kernels too)
DETACHED_ERROR_MIN = 0.05  # detached vs standard gradient, relative L2: measured 0.19-0.41 on these models


@pytest.fixture(scope="module", params=FAMILIES + VARIANTS)
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
    result = group_log_probs(model, prompt, responses, return_entropy=True, knobs=Knobs(chunk_size=chunk_size))
    log_probs, entropies = result.log_probs, result.entropies
    with torch.no_grad():
        for response, lp, ent in zip(responses, log_probs, entropies, strict=True):
            ref_lp, ref_ent = full_log_probs(model, prompt, response)
            assert lp.dtype == torch.float32 and lp.shape == response.shape
            assert (lp - ref_lp).abs().max() < 1e-5
            assert (ent - ref_ent).abs().max() < 1e-5


def test_temperature(model, group):
    prompt, responses = group
    lp = group_log_probs(model, prompt, responses[:1], temperature=0.7).log_probs[0]
    with torch.no_grad():
        ref = full_log_probs(model, prompt, responses[0], temperature=0.7)[0]
    assert (lp - ref).abs().max() < 1e-5


@pytest.mark.parametrize("chunk_size", CHUNKINGS)
def test_exact_gradient_matches_standard(model, group, reference_grads, chunk_size):
    prompt, responses = group
    model.zero_grad(set_to_none=True)
    losses = group_backward(model, prompt, responses, weighted_loss,
                            knobs=Knobs(prompt_grad="exact", chunk_size=chunk_size)).losses
    assert losses.shape == (len(responses),) and not losses.requires_grad
    assert relative_error(grads_of(model), reference_grads) < 1e-5


def test_detached_gradient_runs_and_is_biased(model, group, reference_grads, record_property):
    """Detached mode drops the gradient through the prompt state: its relative L2 error against the
    standard gradient is far above float rounding (DETACHED_ERROR_MIN) and finite."""
    prompt, responses = group
    model.zero_grad(set_to_none=True)
    group_backward(model, prompt, responses, weighted_loss, knobs=Knobs(prompt_grad="detached"))
    error = relative_error(grads_of(model), reference_grads)
    record_property("detached_relative_error", error)
    assert DETACHED_ERROR_MIN < error < 1.0, f"{model.config.model_type}: detached error {error:.3g}"


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
    group_backward(model, prompt, responses, loss, with_entropy=True, knobs=Knobs(chunk_size=97))
    assert relative_error(grads_of(model), expected) < 1e-5


def test_float64_throughout_keeps_float64():
    """``float64_throughout`` turns the float32 that transformers' RMSNorm asks for into float64 (the norm equals
    its float64 formula to 1e-15; outside, it is rounded through float32) and restores the default dtype."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    norm = Qwen3RMSNorm(64).double()
    x = torch.randn(5, 64, dtype=torch.float64)
    exact = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    with float64_throughout():
        inside = norm(x)
        assert torch.ones(1).dtype == torch.ones(1, dtype=torch.float32).dtype == torch.float64
    assert float((inside.detach() - exact).abs().max()) < 1e-15
    assert float((norm(x).detach() - exact).abs().max()) > 1e-9
    assert torch.get_default_dtype() == torch.float32


def test_float64_throughout_widens_float32_buffers_and_keeps_views():
    """A float32 tensor made before the mode (transformers 5.17 keeps a float64 model's rotary ``inv_freq`` in
    float32) is read as float64 by a functional operator, while a write through a view of it still lands in it."""
    buffer = torch.arange(4, dtype=torch.float32)
    with float64_throughout():
        product = buffer[None, :, None].float() @ torch.ones(1, 1, 3, dtype=torch.float64)
        buffer[1:3] = torch.tensor([7.0, 8.0])
        buffer.mul_(2)
    assert product.dtype == torch.float64 and buffer.dtype == torch.float32
    assert buffer.tolist() == [0.0, 14.0, 16.0, 6.0]


@pytest.mark.parametrize("family", FAMILIES + VARIANTS)
def test_exact_gradient_float64(family):
    """Float64 models computing in float64 throughout (``testing.compare.float64_throughout``; transformers' norms,
    routers and kernels ask for float32 otherwise): the exact gradient and log-probs within FLOAT64_TOL of the
    standard path's, chunked."""
    model = tiny_model(family, dtype=torch.float64)
    prompt, responses = make_group(VOCAB, 97, (9, 3))
    with float64_throughout():
        expected = standard_grads(model, prompt, responses, weighted_loss)
        with torch.no_grad():
            expected_lp = [full_log_probs(model, prompt, r)[0] for r in responses]
        model.zero_grad(set_to_none=True)
        result = group_backward(model, prompt, responses, weighted_loss, knobs=Knobs(chunk_size=40))
    assert relative_error(grads_of(model), expected) < FLOAT64_TOL
    assert max_abs_error(result.log_probs, expected_lp) < FLOAT64_TOL
