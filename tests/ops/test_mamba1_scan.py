"""Mamba1's selective scan (``ops.mamba1.scan``, the model's token loop) against the plain reference recurrence,
and what it saves against ``memory.SavedTensorMeter``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from verl_longstraw.memory import SavedTensorMeter
from verl_longstraw.ops.mamba1.scan import selective_scan, selective_scan_reference, selective_scan_saved_bytes
from verl_longstraw.testing.compare import float64_throughout

BATCH, TOKENS, D, N = 2, 9, 6, 4


def make_inputs(dtype: torch.dtype, seed: int = 0) -> list[torch.Tensor]:
    """x, dt, A, B, C, D, z, initial_state in the argument order, leaves that take gradients; the state at least
    float32, A and D float32 (as the mixer passes them) or float64."""
    gen = torch.Generator().manual_seed(seed)
    compute = torch.promote_types(dtype, torch.float32)

    def randn(*shape: int, dtype: torch.dtype = dtype) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype).requires_grad_()

    dt = F.softplus(torch.randn(BATCH, TOKENS, D, generator=gen)).to(dtype).requires_grad_()
    A = (-torch.rand(D, N, generator=gen) * 2).to(compute).requires_grad_()
    return [randn(BATCH, TOKENS, D), dt, A, randn(BATCH, TOKENS, N), randn(BATCH, TOKENS, N), randn(D, dtype=compute),
            randn(BATCH, TOKENS, D), randn(BATCH, D, N, dtype=compute)]


def test_scan_matches_the_reference_in_float64():
    """In float64 throughout (the model's ``.float()`` casts widened) the token loop is the recurrence: outputs, final
    state and every input's gradient to 1e-12; the state-only call (C None) ends in the same state."""
    inputs = make_inputs(torch.float64)
    with float64_throughout():
        results = []
        for op in (selective_scan, selective_scan_reference):
            out, final = op(*inputs)
            grads = torch.autograd.grad((out.square().sum() + final.sum()), inputs)
            results.append((out, final, *grads))
        _, state_only = selective_scan(*inputs[:4], None, None, None, inputs[7])
    for got, expected in zip(*results, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(state_only, results[1][1], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("need_output", [True, False])
def test_saved_bytes_match_meter(dtype, need_output):
    """``selective_scan_saved_bytes`` is what the loop saves beyond its inputs (computed in the graph: their storages
    are the mixer's), exactly, with and without the output."""
    leaves = make_inputs(dtype)
    x, dt, A, B, C, D_, z, initial = [t * 1 for t in leaves]  # computed in the graph, as the mixer's are
    with SavedTensorMeter(exclude=[x, dt, A, B, C, D_, z, initial, *leaves]) as meter:
        if need_output:
            selective_scan(x, dt, A, B, C, D_, z, initial)
        else:
            selective_scan(x, dt, A, B, None, None, None, initial)
    expected = selective_scan_saved_bytes(BATCH, TOKENS, D, N, dtype, need_output)
    assert meter.peak == expected - BATCH * D * N * 4  # less the initial state's copy per sequence (an input here)
