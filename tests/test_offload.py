"""State-gradient host offload (``state_grad_on_host``): the float32 state-gradient sums of the exact backward in
host memory give the same gradients as on the device, are really created on the host, and ask for exactly the bytes
the estimate counts (``state.host``: pinned at that size on CUDA; here the bytes each allocation asks for); each
gradient reaches its sum through one staging buffer, added when the next one arrives or the sums are read."""

from __future__ import annotations

import gc

import pytest
import torch

from verl_longstraw import GroupStats, Knobs, group_backward, tree_backward
from verl_longstraw.estimate import estimate_memory, estimate_plan
from verl_longstraw.plan import tree_plan
from verl_longstraw.state import kinds
from verl_longstraw.state.host import StagedCopies, host_memory, host_zeros
from verl_longstraw.testing.compare import make_group
from verl_longstraw.tiny import VOCAB, tiny_model


def _loss(i: int, lp: torch.Tensor) -> torch.Tensor:
    return (torch.linspace(-1.0, 1.0, len(lp)) * (i + 1) * lp).sum()


def _grads(model) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def _shared_rows(prefix_len: int = 40) -> tuple[list[torch.Tensor], list[int]]:
    """Two groups of two rows under one shared prefix: a tree of depth 3 (a root, two group prompts, four leaves)."""
    gen = torch.Generator().manual_seed(3)
    shared = torch.randint(0, VOCAB, (prefix_len,), generator=gen)
    rows, starts = [], []
    for group in range(2):
        prompt = torch.cat([shared, torch.tensor([group]), torch.randint(0, VOCAB, (9,), generator=gen)])
        for response in range(2):
            head = torch.tensor([10 + response])
            rows.append(torch.cat([prompt, head, torch.randint(0, VOCAB, (6,), generator=gen)]))
            starts.append(len(prompt))
    return rows, starts


@pytest.mark.parametrize("family", ["qwen3_5", "deepseek_v3"])
def test_state_grad_on_host_equals_device(family, monkeypatch):
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, VOCAB, (97,), generator=gen)
    responses = [torch.randint(0, VOCAB, (n,), generator=gen) for n in (5, 9, 3)]
    model = tiny_model(family)

    def grads(on_host: bool) -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        group_backward(model, prompt, responses, _loss, knobs=Knobs(chunk_size=32, state_grad_on_host=on_host))
        return _grads(model)

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


@pytest.mark.parametrize("family", ["qwen3_5", "deepseek_v3", "gpt_oss"])
def test_host_sums_ask_for_the_bytes_the_estimate_counts(family):
    """A chunked star and a tree: the host memory the walk asks for at its peak (sums and staging buffer) is the
    estimate's ``host_bytes`` to the byte, what ``GroupStats`` records, and all of it is freed with the walk; the
    gradients equal the on-device sums' (Rows, Fixed and Window state kinds)."""
    model = tiny_model(family)
    prompt, responses = make_group(VOCAB, 120, (9, 9))
    rows, starts = _shared_rows()
    walks = {
        "star": (lambda on_host, stats: group_backward(model, prompt, responses, _loss, stats=stats,
                                                       knobs=Knobs(chunk_size=32, state_grad_on_host=on_host)),
                 estimate_memory(model.config, 120, 2, 9, 32, "exact", torch.float32, state_grad_on_host=True,
                                 device_type="cpu")),
        "tree": (lambda on_host, stats: tree_backward(model, rows, starts, _loss, stats=stats,
                                                      knobs=Knobs(chunk_size=16, state_grad_on_host=on_host)),
                 estimate_plan(model.config, tree_plan(rows, starts, Knobs(chunk_size=16)), "exact", torch.float32,
                               state_grad_on_host=True, device_type="cpu")),
    }
    for name, (walk, estimate) in walks.items():
        model.zero_grad(set_to_none=True)
        walk(False, GroupStats())
        on_device = _grads(model)
        gc.collect()
        before = host_memory.live
        host_memory.reset_peak()
        model.zero_grad(set_to_none=True)
        stats = GroupStats()
        walk(True, stats)
        assert host_memory.peak - before == estimate.host_bytes == stats.state_grad_host_bytes > 0, name
        assert estimate.staging_bytes > 0 and estimate.host_bytes > estimate.state_grad_bytes, name
        gc.collect()
        assert host_memory.live == before, name
        assert torch.equal(_grads(model), on_device), name


def test_host_zeros_asks_for_its_bytes_and_frees_them_with_its_last_view():
    gc.collect()
    before = host_memory.live
    sums = host_zeros((3, 5, 7), torch.float32)
    view = sums[1:, :2]
    assert sums.shape == (3, 5, 7) and not sums.any() and host_memory.live - before == 3 * 5 * 7 * 4
    view += 1
    del sums
    gc.collect()
    assert host_memory.live - before == 3 * 5 * 7 * 4 and float(view.sum()) == 2 * 2 * 7
    del view
    gc.collect()
    assert host_memory.live == before
    assert host_zeros((0, 4), torch.float32).shape == (0, 4) and host_memory.live == before


def test_a_staged_copy_is_added_when_the_next_one_needs_the_buffer():
    staged = StagedCopies(nbytes=4 * 6)
    added: list[tuple[str, list[float]]] = []

    def then(name):
        return lambda host: added.append((name, host.flatten().tolist()))

    staged.add(torch.arange(6.0).view(2, 3), then("a"))
    assert added == []  # in flight until the buffer is needed again
    staged.add(torch.ones(4), then("b"))
    assert added == [("a", [0.0, 1.0, 2.0, 3.0, 4.0, 5.0])]
    staged.flush()
    staged.flush()
    assert added[1:] == [("b", [1.0] * 4)] and staged.tensors()[0].numel() == 4 * 6
    with pytest.raises(ValueError, match="exceeds the 24-byte staging buffer"):
        staged.add(torch.ones(7), then("c"))
