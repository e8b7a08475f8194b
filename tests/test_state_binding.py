"""A captured prompt state is bound to the prompt it was captured from: passing it with other
prompt_ids (same length, so every shape check passes) fails instead of replaying the wrong prompt."""

import pytest
import torch

from verl_longstraw import Knobs, capture_prompt, group_backward, group_log_probs
from verl_longstraw.tiny import VOCAB, tiny_model

PROMPT_LEN = 40


def _loss(i, log_probs):
    return -log_probs.sum()


@pytest.fixture(scope="module")
def group():
    model = tiny_model("qwen3")
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, VOCAB, (PROMPT_LEN,), generator=g)
    responses = [torch.randint(0, VOCAB, (5,), generator=g)]
    return model, prompt, responses


@pytest.mark.parametrize("position", [0, PROMPT_LEN // 2, PROMPT_LEN - 1])
def test_state_of_another_prompt_is_refused(group, position):
    """Another prompt of the same length, differing in one token (the last one included: the state
    belongs to the whole prompt), is refused by both entry points."""
    model, prompt, responses = group
    state = capture_prompt(model, prompt, for_backward=True, knobs=Knobs(chunk_size=16))
    other = prompt.clone()
    other[position] = (other[position] + 1) % VOCAB
    with pytest.raises(ValueError, match="state was captured from other prompt_ids"):
        group_log_probs(model, other, responses, state=state, knobs=Knobs(chunk_size=16))
    with pytest.raises(ValueError, match="state was captured from other prompt_ids"):
        group_backward(model, other, responses, _loss, state=state, knobs=Knobs(chunk_size=16))
    assert all(p.grad is None for p in model.parameters())


def test_state_of_the_same_prompt_is_accepted(group):
    """An equal prompt in another tensor (and dtype) is the same prompt."""
    model, prompt, responses = group
    state = capture_prompt(model, prompt, for_backward=False, knobs=Knobs(chunk_size=16))
    expected = group_log_probs(model, prompt, responses, knobs=Knobs(chunk_size=16))
    got = group_log_probs(model, prompt.clone().to(torch.int32), responses, state=state, knobs=Knobs(chunk_size=16))
    assert torch.equal(got.log_probs[0], expected.log_probs[0])


def test_state_is_bound_to_a_copy(group):
    """Changing the caller's prompt tensor in place after the capture does not move the binding."""
    model, prompt, responses = group
    ids = prompt.clone()
    state = capture_prompt(model, ids, for_backward=False)
    ids[3] = (ids[3] + 1) % VOCAB
    with pytest.raises(ValueError, match="state was captured from other prompt_ids"):
        group_log_probs(model, ids, responses, state=state)
