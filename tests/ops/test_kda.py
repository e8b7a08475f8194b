"""Kimi Delta Attention: the model's chunked rule (``ops.kda.rule``) against its token-by-token recurrence."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from verl_longstraw.memory import SavedTensorMeter
from verl_longstraw.ops.kda.rule import chunked_rule, kda_rule, kda_torch_saved_bytes, model_kda_rules
from verl_longstraw.tiny import tiny_model, unavailable

if unavailable("kimi_linear"):
    pytest.skip(unavailable("kimi_linear"), allow_module_level=True)

B, H, DK, DV = 2, 2, 16, 8
# relative L2 of the float32 chunked rule against the float32 recurrence, both against nothing finer (the model's
# rules compute in float32 whatever the inputs): measured 1e-7 to 6e-7 over these lengths; the bound is 40 eps
FLOAT32_TOL = 40 * torch.finfo(torch.float32).eps
NAMES = ("q", "k", "v", "g", "beta", "initial_state")


@pytest.fixture(scope="module")
def rules():
    return model_kda_rules(tiny_model("kimi_linear").model.layers[0].self_attn)


def make_inputs(seq_len: int, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    inputs = {"q": torch.randn(B, seq_len, H, DK, generator=gen), "k": torch.randn(B, seq_len, H, DK, generator=gen),
              "v": torch.randn(B, seq_len, H, DV, generator=gen),
              "g": F.logsigmoid(torch.randn(B, seq_len, H, DK, generator=gen)),
              "beta": torch.rand(B, seq_len, H, generator=gen),
              "initial_state": torch.randn(B, H, DK, DV, generator=gen)}
    return {name: x.requires_grad_() for name, x in inputs.items()}


def run_with_grads(rule, inputs: dict) -> list[torch.Tensor]:
    """[output, final state, gradient of each input] of a random linear functional of (output, final state)."""
    out, state = kda_rule(rule, *inputs.values())
    gen = torch.Generator().manual_seed(1)
    loss = sum((t * torch.randn(t.shape, generator=gen)).sum() for t in (out, state))
    return [out.detach(), state.detach(), *torch.autograd.grad(loss, list(inputs.values()))]


def test_model_kda_rules_are_the_models(rules) -> None:
    """The private globals ``model_kda_rules`` reads are the rules the kimi_linear mixer's module defines."""
    from transformers.models.kimi_linear import modeling_kimi_linear as hf

    assert rules.chunked is hf.chunk_kimi_delta_attention and rules.recurrent is hf.recurrent_kimi_delta_attention


def test_float32_replay_takes_the_plain_torch_form(rules) -> None:
    """``chunked_rule``: the model's bound rule for half precision (flash-linear-attention's ``chunk_kda`` where
    transformers bound it); for float32 / float64 the torch function the binding wraps, defined in the module."""
    from transformers.models.kimi_linear import modeling_kimi_linear as hf

    mixer = tiny_model("kimi_linear").model.layers[0].self_attn
    assert chunked_rule(mixer, torch.bfloat16) is chunked_rule(mixer, torch.float16) is rules.chunked
    for dtype in (torch.float32, torch.float64):
        plain = chunked_rule(mixer, dtype)
        assert plain.__module__ == hf.__name__ and plain.__name__ == "chunk_kimi_delta_attention"
        assert not hasattr(plain, "__wrapped__") and plain is not rules.chunked


@pytest.mark.parametrize("seq_len", [1, 37, 64, 130])
def test_chunked_matches_recurrence(rules, seq_len: int) -> None:
    """Output, final state (float32) and every gradient, the initial state's included, within FLOAT32_TOL."""
    inputs = make_inputs(seq_len)
    chunked, recurrent = run_with_grads(rules.chunked, inputs), run_with_grads(rules.recurrent, inputs)
    assert chunked[0].shape == (B, seq_len, H, DV) and chunked[1].shape == (B, H, DK, DV)
    assert chunked[1].dtype == torch.float32
    for name, ours, reference in zip(("out", "state", *NAMES), chunked, recurrent, strict=True):
        error = float((ours - reference).norm() / reference.norm())
        assert error < FLOAT32_TOL, (name, error)


@pytest.mark.parametrize("shape", [(1, 128, 2, 16, 16), (1, 200, 4, 16, 32), (2, 64, 2, 32, 16)])
def test_saved_bytes_as_counted(rules, shape: tuple[int, ...]) -> None:
    """``kda_torch_saved_bytes`` is what the torch chunked rule saves (inputs computed in the graph), within 1%."""
    batch, tokens, heads, k_dim, v_dim = shape
    leaves = [torch.randn(batch, tokens, heads, k_dim), torch.randn(batch, tokens, heads, k_dim),
              torch.randn(batch, tokens, heads, v_dim), F.logsigmoid(torch.randn(batch, tokens, heads, k_dim)),
              torch.rand(batch, tokens, heads), torch.randn(batch, heads, k_dim, v_dim)]
    for leaf in leaves:
        leaf.requires_grad_()
    with SavedTensorMeter(exclude=leaves) as meter:
        kda_rule(rules.chunked, *(t * 1.0 for t in leaves[:5]), leaves[5])
    counted = kda_torch_saved_bytes(batch, tokens, heads, k_dim, v_dim)
    assert abs(meter.peak / counted - 1) < 0.01, (meter.peak, counted)
