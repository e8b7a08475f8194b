"""``ops.attention.window`` (sliding windows and sinks) against its plain reference, and its saved-bytes count."""

from __future__ import annotations

import pytest
import torch

from verl_longstraw.memory import SavedTensorMeter
from verl_longstraw.ops.attention import window as window_ops
from verl_longstraw.ops.attention.prefix import ATTENTION_PATHS
from verl_longstraw.ops.attention.window import (
    window_attention,
    window_attention_reference,
    window_attention_saved_bytes,
)

HQ, HK, D, DV = 4, 2, 16, 8  # value dim != key dim: the partial-attention parts; DV = D: full layers go fused


def make_inputs(batch: int, past: int, queries: int, past_batch: int, sinks: bool, dtype: torch.dtype,
                seed: int = 0, dv: int = DV) -> list[torch.Tensor | None]:
    """Leaves (requires_grad) q, k_past, v_past, k_self, v_self, sinks (or None); values of ``dv``."""
    gen = torch.Generator().manual_seed(seed)
    shapes = [(batch, HQ, queries, D), (past_batch, HK, past, D), (past_batch, HK, past, dv),
              (batch, HK, queries, D), (batch, HK, queries, dv)]
    leaves = [torch.randn(s, generator=gen) for s in shapes]
    leaves.append(3 * torch.randn(HQ, generator=gen) if sinks else None)
    return [None if t is None else t.to(dtype).requires_grad_() for t in leaves]


def output_and_grads(fn, inputs: list, window: int | None) -> list[torch.Tensor]:
    out = fn(*inputs[:5], D ** -0.5, window=window, sinks=inputs[5])
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(out)
    leaves = [t for t in inputs if t is not None]
    return [out.detach(), *torch.autograd.grad((out * weights).sum(), leaves, allow_unused=True,
                                                     materialize_grads=True)]


@pytest.mark.parametrize("window", [None, 1, 5, 8])
@pytest.mark.parametrize("batch, past, queries, past_batch", [(1, 0, 9, 1), (3, 0, 9, 1), (3, 7, 12, 1), (2, 3, 20, 2),
                                                              (3, 20, 4, 1), (2, 7, 1, 2)])
@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.parametrize("dv", [DV, D])
def test_matches_reference_float64(window, batch, past, queries, past_batch, sinks, dv, monkeypatch) -> None:
    """Output and the gradient of every input (sinks included) equal the plain masked softmax to float64
    rounding, with query blocks of 6 so that the own keys of a window cross block ends; window None with dv = D
    runs on the fused kernels (the CPU flash kernel computes float64 in float64)."""
    monkeypatch.setattr(window_ops, "QUERY_BLOCK", 6)
    inputs = make_inputs(batch, past, queries, past_batch, sinks, torch.float64, dv=dv)
    fast = output_and_grads(window_attention, inputs, window)
    plain = output_and_grads(window_attention_reference, inputs, window)
    for a, b in zip(fast, plain, strict=True):
        assert a.shape == b.shape and (a.numel() == 0 or (a - b).abs().max().item() < 1e-12)


@pytest.mark.parametrize("window, dv", [(8, DV), (None, D)])
def test_float32_within_reference_error(window, dv) -> None:
    """In float32 the fast path's error against the float64 reference is of the order of the float32 reference's
    (window None, dv = D: the fused kernels)."""
    inputs64 = make_inputs(3, 7, 30, 1, True, torch.float64, dv=dv)
    inputs32 = [None if t is None else t.detach().float().requires_grad_() for t in inputs64]
    exact = output_and_grads(window_attention_reference, inputs64, window)
    fast = output_and_grads(window_attention, inputs32, window)
    plain = output_and_grads(window_attention_reference, inputs32, window)
    for e, f, p in zip(exact, fast, plain, strict=True):
        assert (f.double() - e).abs().max() <= 4 * (p.double() - e).abs().max() + 1e-6


@pytest.mark.parametrize("batch, past, queries, window, sinks, past_batch, dv",
                         [(3, 7, 40, 8, True, 1, DV), (2, 7, 40, 8, False, 2, DV), (2, 30, 17, None, True, 1, DV),
                          (1, 0, 33, 4, True, 1, DV), (2, 30, 17, None, True, 1, D), (3, 0, 9, None, False, 1, D),
                          (2, 12, 5, 4, True, 1, D)])
def test_saved_bytes_as_counted(batch, past, queries, window, sinks, past_batch, dv, monkeypatch) -> None:
    """``window_attention_saved_bytes`` is what the fast path saves, the inputs (activations and state, counted
    by their owners) excluded: to the byte, on the partial parts and on the fused kernels (window None, dv = D),
    whose path is the one counted."""
    monkeypatch.setattr(window_ops, "QUERY_BLOCK", 16)
    inputs = make_inputs(batch, past, queries, past_batch, sinks, torch.float32, dv=dv)
    leaves = [t for t in inputs if t is not None]
    before = dict(ATTENTION_PATHS)
    with SavedTensorMeter(exclude=leaves) as meter:
        window_attention(*inputs[:5], D ** -0.5, window=window, sinks=inputs[5])
    fused = ATTENTION_PATHS["fused_flash_cpu"] - before.get("fused_flash_cpu", 0)
    assert fused == (window is None and dv == D)
    counted = window_attention_saved_bytes(batch, HQ, HK, D, dv, queries, past, window, sinks, torch.float32,
                                           past_shared=past_batch == 1, device_type="cpu")
    assert meter.peak == counted
