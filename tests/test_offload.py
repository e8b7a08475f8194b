"""State-gradient host offload: the float32 state-gradient sums of the exact backward in host memory
give the same gradients as on the device, and the sums are really created on the host."""

from __future__ import annotations

import pytest
import torch

from verl_longstraw import group_backward
from verl_longstraw.state import kinds
from verl_longstraw.tiny import VOCAB, tiny_model


def _loss(i: int, lp: torch.Tensor) -> torch.Tensor:
    return (torch.linspace(-1.0, 1.0, len(lp)) * (i + 1) * lp).sum()


@pytest.mark.parametrize("family", ["qwen3_5", "deepseek_v3"])
def test_state_grad_on_host_equals_device(family, monkeypatch):
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, VOCAB, (97,), generator=gen)
    responses = [torch.randint(0, VOCAB, (n,), generator=gen) for n in (5, 9, 3)]
    model = tiny_model(family)

    def grads(on_host: bool) -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        group_backward(model, prompt, responses, _loss, chunk_size=32, state_grad_on_host=on_host)
        return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])

    placements: list[bool] = []
    original = kinds.grad_zeros
    monkeypatch.setattr(kinds, "grad_zeros",
                        lambda shape, like, on_host: placements.append(on_host) or original(shape, like, on_host))
    on_device = grads(False)
    device_placements, placements[:] = list(placements), []
    on_host = grads(True)
    assert torch.equal(on_device, on_host)
    assert device_placements and not any(device_placements)
    assert placements and all(placements)
