"""Mamba1's selective scan (Jamba's Mamba layers) with an initial state in and the final state out.

Shapes: ``x`` [B, S, D] (D channels, the conv's activated output); ``dt`` [B, S, D] the step sizes, already
discretised (softplus of the projection plus its bias); ``A`` [D, N] the (negative) decay rates, one per channel and
state element; ``B``, ``C`` [B, S, N] (shared by the channels); ``D`` [D] the skip term; ``z`` [B, S, D] the gate;
states [B, D, N]. Per channel d, state element n and token t::

    h_t = exp(dt_t A) * h_{t-1} + dt_t B_t x_t
    y_t = (h_t C_t + D x_t) * silu(z_t)

Unlike Mamba2 (``ops.ssd_scan``) the decay is per channel and state element, not a scalar per head, so there is no
chunked matrix form: ``selective_scan`` is the token loop of transformers' ``JambaMambaMixer`` torch path
(``mamba_selective_scan``), op for op and dtype for dtype (its discretised A and B x for the whole segment in float32,
the output contracted with C in the model dtype), so it rounds as the model does, and it takes an initial state.
``selective_scan_reference`` is the plain recurrence in float32 (float64 for float64 inputs) the tests compare it
with. ``selective_scan_saved_bytes`` counts what the loop saves for backward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def selective_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor | None,
    D: torch.Tensor | None,
    z: torch.Tensor | None,
    initial_state: torch.Tensor,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The scan over a segment continuing ``initial_state`` [B, D, N] (shapes in the module docstring): (output
    [B, S, D], at least float32; the final state [B, D, N], at least float32). ``C`` None: the final state alone
    (no output, ``D`` and ``z`` unused); ``D`` or ``z`` None: no skip term, no gate.

    The ops of transformers' ``mamba_selective_scan``: ``exp(A dt)`` and ``(dt B.float()) x.float()`` for every
    token at once, then per token ``h = decay h + input`` (one fused ``addcmul``: the loop's Python cost is its op
    count) and ``h.to(x.dtype) @ C``; the skip term ``y + x D`` and the gate ``y silu(z)`` after the loop."""
    decays = torch.exp(A[None, None] * dt[..., None]).unbind(1)  # per token [B, D, N]
    inputs = (dt[..., None] * B[:, :, None, :].float() * x[..., None].float()).unbind(1)
    state = initial_state
    if C is None:
        for decay, update in zip(decays, inputs, strict=True):
            state = torch.addcmul(update, decay, state)
        return None, state
    outputs = []
    for decay, update, readout in zip(decays, inputs, C[..., None].unbind(1), strict=True):
        state = torch.addcmul(update, decay, state)
        outputs.append(torch.matmul(state.to(x.dtype), readout))  # [B, D, 1]
    y = torch.cat(outputs, dim=-1).transpose(1, 2)  # [B, S, D]
    if D is not None:
        y = y + x * D
    if z is not None:
        y = y * F.silu(z)
    return y, state


def scan_decay(dt: torch.Tensor, A: torch.Tensor) -> torch.Tensor:
    """exp(sum_t dt_t A) [B, D, N]: the factor a segment applies to the state it starts from (float32 or float64)."""
    compute = torch.promote_types(dt.dtype, torch.float32)
    return torch.exp(dt.to(compute).sum(dim=1)[..., None] * A.to(compute))


def selective_scan_reference(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    z: torch.Tensor | None,
    initial_state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence of the module docstring one token at a time, every input in float32 (float64 for float64
    inputs): (output [B, S, D], final state [B, D, N])."""
    compute = torch.promote_types(x.dtype, torch.float32)
    x, dt, A, B, C = (t.to(compute) for t in (x, dt, A, B, C))
    state = initial_state.to(compute)
    outputs = []
    for t in range(x.shape[1]):
        state = torch.exp(dt[:, t, :, None] * A) * state + (dt[:, t] * x[:, t])[..., None] * B[:, t, None, :]
        y = (state * C[:, t, None, :]).sum(-1)
        if D is not None:
            y = y + D.to(compute) * x[:, t]
        if z is not None:
            y = y * F.silu(z[:, t].to(compute))
        outputs.append(y)
    return torch.stack(outputs, dim=1), state


def selective_scan_saved_bytes(batch: int, tokens: int, channels: int, state_size: int, dtype: torch.dtype,
                               need_output: bool) -> int:
    """Bytes ``selective_scan`` saves for backward over ``batch`` sequences of ``tokens`` with ``channels`` x
    ``state_size`` states, its inputs in the model ``dtype`` computed in the graph (not leaves), its arithmetic in
    ``compute`` = at least float32. Pinned against ``memory.SavedTensorMeter`` by ``tests/mixers``.

    Per token of [channels, state_size] in ``compute``: the decays and the discretised B (read by the products
    after them) and the state after the token, read by the next token's update, but the last token's only with the
    output and in ``compute`` (below float32 C meets its copy); with the output the state in ``dtype`` (a copy below
    float32) that meets C, the output before the gate (``compute``) and the gate's silu (``dtype``). Below float32
    the float32 copies of B and x, per token. Per sequence, for ``batch`` > 1, the copy of the initial state each
    sequence starts from (``mixers.base.per_sequence``)."""
    compute = torch.promote_types(dtype, torch.float32)
    c, act = compute.itemsize, dtype.itemsize
    grid = channels * state_size
    per_token = 2 * grid * c
    if need_output:
        per_token += channels * (c + act) + (grid * act if act < c else 0)
    if act < 4:
        per_token += (channels + state_size) * 4
    states = tokens if need_output and act == c else tokens - 1
    initial = grid * c if batch > 1 else 0
    return batch * (tokens * per_token + states * grid * c + initial)
