"""Batched replay (``replay_tokens``): k responses in one forward against the broadcast prompt state equal the
one-at-a-time replay (``replay_tokens=1``) for every family, chunked or not, with groups split unevenly; memory
follows the budget, not G, and the prompt state is never copied per response.

Equal means within float32 rounding, on every CPU: the relative L2 difference of log-probs, entropies, losses and
gradients (each over the whole group or model) is below BATCHING_ERROR_EPS float32 eps. Each path is a float32
evaluation within 3.1 eps (relative L2) of the float64 one-at-a-time replay of the same inputs, so they differ by at
most ~6 eps; measured differences are 0-2.0 eps with AVX-512 and AVX2 alike (BATCHING_ERROR_EPS: 4x headroom).
Absolute bounds on the largest log-prob and entropy difference (1e-6, 4e-6: 1-3 ulps of one token's value) held
on one CPU's summation order only: AVX2 and AVX-512 round the batched and single replays' matmuls differently.
"""

from __future__ import annotations

import pytest
import torch

import verl_longstraw.ops.attention.prefix as attention_ops
from verl_longstraw import Knobs, group_backward, group_log_probs
from verl_longstraw.memory import parameter_meter
from verl_longstraw.plan import replay_batches
from verl_longstraw.testing.compare import grads_of, make_group, max_abs_error, relative_error, weighted_loss
from verl_longstraw.tiny import FAMILIES, VOCAB, tiny_model

PROMPT_LEN = 70
LENGTHS = (3, 4, 5, 6, 7, 8, 9, 5)
BUDGETS = (18, 24)  # batches of sizes (3, 2, 2, 1) and (4, 2, 2)
OVERRIDES = {"glm_moe_dsa": {"index_topk": 48}}  # sparse selection active: fewer keys than visible
BATCHING_ERROR_EPS = 8  # see the module docstring


def test_replay_batches_pack_in_order_within_budget():
    assert replay_batches(LENGTHS, 18) == [[0, 1, 2], [3, 4], [5, 6], [7]]
    assert replay_batches(LENGTHS, 24) == [[0, 1, 2, 3], [4, 5], [6, 7]]
    assert replay_batches(LENGTHS, 1) == [[i] for i in range(len(LENGTHS))]
    assert replay_batches((3, 20, 3), 10) == [[0], [1], [2]]  # longer than the budget: alone


def _replay(model, prompt, responses, chunk_size, budget, mode="exact"):
    values = group_log_probs(model, prompt, responses, return_entropy=True,
                             knobs=Knobs(chunk_size=chunk_size, replay_tokens=budget))
    model.zero_grad(set_to_none=True)
    trained = group_backward(model, prompt, responses, weighted_loss,
                             knobs=Knobs(prompt_grad=mode, chunk_size=chunk_size, replay_tokens=budget))
    assert max_abs_error(trained.log_probs, values.log_probs) == 0
    return values.log_probs, values.entropies, trained.losses, grads_of(model)


def _outputs(log_probs, entropies, losses, grads) -> dict[str, torch.Tensor]:
    """``_replay``'s outputs as flat tensors by name: log-probs and entropies of all responses, the losses [G] and
    every parameter's gradient, concatenated (one relative L2 over the model, as ``relative_error``)."""
    return {"log_probs": torch.cat(log_probs), "entropies": torch.cat(entropies), "losses": losses,
            "grads": torch.cat([grad.flatten() for grad in grads.values()])}


@pytest.mark.parametrize("family", FAMILIES)
def test_batched_equals_one_at_a_time(family):
    model = tiny_model(family, **OVERRIDES.get(family, {}))
    prompt, responses = make_group(VOCAB, PROMPT_LEN, LENGTHS, seed=1)
    modes = ("exact", "detached") if family == "qwen3_5" else ("exact",)
    bound = BATCHING_ERROR_EPS * torch.finfo(torch.float32).eps
    for mode in modes:
        for chunk_size, budget in zip((None, 32), BUDGETS, strict=True):  # unchunked, and chunks splitting P
            one = _outputs(*_replay(model, prompt, responses, chunk_size, 1, mode))
            batched = _outputs(*_replay(model, prompt, responses, chunk_size, budget, mode))
            errors = {name: relative_error({name: batched[name]}, {name: one[name]}) for name in one}
            assert max(errors.values()) < bound, (mode, chunk_size, budget, errors)


def test_replay_tokens_must_be_a_positive_int():
    model = tiny_model("qwen3")
    prompt, responses = make_group(VOCAB, 8, (3,))
    for bad in (0, -5, 2.0, True, None):
        with pytest.raises(ValueError, match="replay_tokens"):
            group_log_probs(model, prompt, responses, knobs=Knobs(replay_tokens=bad))
        with pytest.raises(ValueError, match="replay_tokens"):
            group_backward(model, prompt, responses, weighted_loss, knobs=Knobs(replay_tokens=bad))


def _saved_peak(model, prompt, responses, budget, chunk_size=None) -> int:
    model.zero_grad(set_to_none=True)
    with parameter_meter(model) as meter:
        group_backward(model, prompt, responses, weighted_loss,
                       knobs=Knobs(prompt_grad="exact", chunk_size=chunk_size, replay_tokens=budget))
    return meter.peak


@pytest.mark.parametrize("family", ["qwen3", "qwen3_next"])
def test_saved_peak_follows_the_budget_not_the_group(family):
    """At a budget of two responses' tokens, 8 responses save as much at the peak as 2."""
    model = tiny_model(family)
    length = 16
    prompt, responses = make_group(VOCAB, 256, (length,) * 8)
    two, eight = (_saved_peak(model, prompt, responses[:g], 2 * length) for g in (2, 8))
    assert abs(eight - two) <= 0.05 * two, (two, eight)


def _saved_shapes(model, prompt, responses, budget) -> list[tuple[int, ...]]:
    shapes = []

    def pack(t):
        shapes.append(tuple(t.shape))
        return t

    model.zero_grad(set_to_none=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):  # detached: the replay's saves only
        group_backward(model, prompt, responses, weighted_loss,
                       knobs=Knobs(prompt_grad="detached", replay_tokens=budget))
    return shapes


@pytest.mark.parametrize("family", FAMILIES)
def test_prompt_state_is_not_copied_per_response(family, monkeypatch):
    """No tensor the replay saves for backward holds the prompt's rows per response: none of batch k has a dim of
    the P - 1 prompt-state rows (151 - 1: no model dim), none has k x (P - 1) rows; and with the memory-lean
    (blocked) attention the saved peak grows with k x response tokens, the same at P = 512 as at P = 128."""
    k, length = 3, 8
    model = tiny_model(family, **OVERRIDES.get(family, {}))
    prompt, responses = make_group(VOCAB, 151, (length,) * k)
    rows = len(prompt) - 1
    for shape in _saved_shapes(model, prompt, responses, k * length):
        assert not (len(shape) > 1 and shape[0] == k and rows in shape[1:]) and k * rows not in shape, shape

    monkeypatch.setattr(attention_ops, "SCORES_BYTES_LIMIT", 0)  # partial attention: the blocked op
    growth = []
    for prompt_len in (128, 512):
        prompt, responses = make_group(VOCAB, prompt_len, (length,) * k)
        one = _saved_peak(model, prompt, responses[:1], 1)
        batch = _saved_peak(model, prompt, responses, k * length)
        growth.append(batch - one)
    assert abs(growth[1] - growth[0]) <= 0.05 * growth[0], growth
