"""Mamba2's chunked scan (the model's own, ``ops.mamba2.ssd``) against the token-by-token reference recurrence."""

from __future__ import annotations

import importlib

import pytest
import torch

from verl_longstraw.memory import SavedTensorMeter
from verl_longstraw.ops.mamba2.ssd import (
    model_chunk_scan,
    ssd_scan,
    ssd_scan_reference,
    ssd_torch_saved_bytes,
    step_sizes,
)
from verl_longstraw.tiny import tiny_model, unavailable

if unavailable("nemotron_h"):
    pytest.skip(unavailable("nemotron_h"), allow_module_level=True)

B, H, P, G, N = 2, 4, 8, 2, 16
DT_LIMIT = (1e-3, float("inf"))
# relative L2 of the float32 chunked scan against the float64 recurrence: measured 4e-8 to 1.5e-6 (the A gradient
# at T = 37) over these lengths and chunks; the bound is 40 float32 eps
FLOAT32_TOL = 40 * torch.finfo(torch.float32).eps
NAMES = ("x", "dt", "A", "B", "C", "D", "initial_state")


def nemotron_h_scan():
    return importlib.import_module("transformers.models.nemotron_h.modeling_nemotron_h").mamba2_chunk_scan


def make_inputs(seq_len: int, dtype: torch.dtype, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random leaves (requires_grad) in the argument order of the ops; ``dt`` the raw projection."""
    gen = torch.Generator().manual_seed(seed)
    inputs = {"x": torch.randn(B, seq_len, H, P, generator=gen), "dt": torch.randn(B, seq_len, H, generator=gen),
              "A": -2 * torch.rand(H, generator=gen), "B": torch.randn(B, seq_len, G, N, generator=gen),
              "C": torch.randn(B, seq_len, G, N, generator=gen), "D": torch.randn(H, generator=gen),
              "initial_state": torch.randn(B, H, P, N, generator=gen)}
    return {name: x.to(dtype).requires_grad_() for name, x in inputs.items()}


def run_with_grads(fn, inputs: dict, dt_bias: torch.Tensor) -> list[torch.Tensor]:
    """[output, final state, gradient of each input] of a random linear functional of (output, final state)."""
    dt = step_sizes(inputs["dt"], dt_bias.to(inputs["dt"].dtype), DT_LIMIT)
    args = [inputs["x"], dt, *(inputs[n] for n in NAMES[2:])]
    out, state = fn(*args)
    gen = torch.Generator().manual_seed(1)
    loss = sum((t * torch.randn(t.shape, generator=gen, dtype=torch.float64).to(t)).sum() for t in (out, state))
    return [out.detach(), state.detach(), *torch.autograd.grad(loss, list(inputs.values()))]


def test_model_chunk_scan_is_the_models() -> None:
    """The private global ``model_chunk_scan`` reads is the scan the nemotron_h mixer calls."""
    model = tiny_model("nemotron_h")
    mixer = model.model.layers[0].mixer
    assert model_chunk_scan(mixer) is nemotron_h_scan()


@pytest.mark.parametrize("seq_len", [1, 37, 64, 130])
@pytest.mark.parametrize("chunk_size", [16, 64])
def test_chunked_matches_reference(seq_len: int, chunk_size: int) -> None:
    """Output, final state and every gradient of the float32 chunked scan within FLOAT32_TOL of the float64
    recurrence (relative L2), the final state in its own storage."""
    dt_bias = torch.randn(H, generator=torch.Generator().manual_seed(2))
    inputs = make_inputs(seq_len, torch.float32)
    chunked = run_with_grads(lambda *a: ssd_scan(nemotron_h_scan(), *a, chunk_size), inputs, dt_bias)
    exact_inputs = {n: x.detach().double().requires_grad_() for n, x in inputs.items()}
    exact = run_with_grads(ssd_scan_reference, exact_inputs, dt_bias)
    assert chunked[0].shape == (B, seq_len, H, P) and chunked[1].shape == (B, H, P, N)
    for name, ours, reference in zip(("out", "state", *NAMES), chunked, exact, strict=True):
        error = float((ours.double() - reference).norm() / reference.norm())
        assert error < FLOAT32_TOL, (name, error)
    _, state = ssd_scan(nemotron_h_scan(), *(x.detach() for x in list(inputs.values())[:-1]),
                        inputs["initial_state"].detach(), chunk_size)
    assert state.untyped_storage().nbytes() == state.numel() * state.element_size()


def test_step_sizes_are_the_scans() -> None:
    """The scan given ``step_sizes`` equals the scan applying dt_bias, softplus and the limits itself (bitwise)."""
    inputs = {n: x.detach() for n, x in make_inputs(37, torch.float32).items()}
    dt_bias = torch.randn(H)
    scan = nemotron_h_scan()
    ours, _ = ssd_scan(scan, inputs["x"], step_sizes(inputs["dt"], dt_bias, DT_LIMIT), inputs["A"], inputs["B"],
                       inputs["C"], inputs["D"], inputs["initial_state"], 16)
    model_way = scan(inputs["x"], inputs["dt"], inputs["A"], inputs["B"], inputs["C"], 16, D=inputs["D"],
                     dt_bias=dt_bias, dt_softplus=True, dt_limit=DT_LIMIT, initial_states=inputs["initial_state"])
    assert torch.equal(ours, model_way)


@pytest.mark.parametrize("shape", [(1, 256, 8, 16, 2, 32, 64), (2, 100, 8, 16, 2, 32, 64), (3, 130, 4, 32, 4, 16, 32)])
def test_saved_bytes_as_counted(shape: tuple[int, ...]) -> None:
    """``ssd_torch_saved_bytes`` is what the torch scan saves (inputs computed in the graph), within 2%."""
    batch, tokens, heads, head_dim, groups, state_size, chunk = shape
    leaves = [torch.randn(batch, tokens, heads, head_dim), torch.rand(batch, tokens, heads), -torch.rand(heads),
              torch.randn(batch, tokens, groups, state_size), torch.randn(batch, tokens, groups, state_size),
              torch.randn(heads), torch.randn(batch, heads, head_dim, state_size)]
    for leaf in leaves:
        leaf.requires_grad_()
    with SavedTensorMeter(exclude=leaves) as meter:
        x, dt, b, c = (t * 1.0 for t in (leaves[0], leaves[1], leaves[3], leaves[4]))
        ssd_scan(nemotron_h_scan(), x, dt, leaves[2], b, c, leaves[5], leaves[6], chunk)
    counted = ssd_torch_saved_bytes(batch, tokens, heads, head_dim, state_size, chunk, torch.float32)
    assert abs(meter.peak / counted - 1) < 0.02, (meter.peak, counted)
