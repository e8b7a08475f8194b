"""Mamba2's selective state-space scan (SSD) with an initial state in and the final state out.

Shapes: ``x`` [B, S, H, P] (H heads of P channels); ``dt`` [B, S, H] the step sizes, already discretised
(``step_sizes``: softplus of the projection plus ``dt_bias``, clamped to the model's limits); ``A`` [H] the
(negative) decay rates; ``B``, ``C`` [B, S, G, N] (G groups of the H heads, N the state size); ``D`` [H];
states [B, H, P, N]. Per head (group g = head // (H // G)) and token::

    h_t = exp(dt_t * A) * h_{t-1} + dt_t * x_t B_t^T
    y_t = h_t C_t + D * x_t

The model's scan computes in float32 whatever its inputs (transformers' torch form casts them, the final state is
float32); the reference computes in float32, or float64 for float64 inputs.

``ssd_scan`` runs the model's own chunked scan (``model_chunk_scan``: transformers' ``mamba2_chunk_scan`` of the
model's module, which transformers binds to mamba_ssm's ``mamba_chunk_scan_combined`` where that is installed,
and is the plain torch chunked form otherwise), differentiable in every input including the initial state.
``ssd_scan_reference`` is the token-by-token recurrence the tests compare it with.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F
import transformers
from packaging.version import Version
from torch import nn

from ...errors import UnsupportedModelError

ChunkScan = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def model_chunk_scan(mixer: nn.Module) -> ChunkScan:
    """The chunked scan the module of ``mixer`` (a transformers Mamba2 mixer) calls in its forward: its module's
    ``mamba2_chunk_scan`` global (transformers >= 5.10; the test ``test_model_chunk_scan_is_the_models`` pins it)."""
    scan = getattr(sys.modules[type(mixer).__module__], "mamba2_chunk_scan", None)
    if scan is None:
        raise UnsupportedModelError(
            f"{type(mixer).__module__} has no mamba2_chunk_scan: this transformers release's Mamba2 mixer is not "
            "supported (transformers>=5.10 has it)"
        )
    return scan


def step_sizes(dt: torch.Tensor, dt_bias: torch.Tensor, dt_limit: tuple[float, float]) -> torch.Tensor:
    """Discretised step sizes [B, S, H] of the projection ``dt`` [B, S, H]: ``clamp(softplus(dt + dt_bias))``, the
    ops of transformers' ``mamba2_chunk_scan`` (so the scan sees the same values whether it or this applies them)."""
    return torch.clamp(F.softplus(dt + dt_bias.to(dt.dtype)), min=dt_limit[0], max=dt_limit[1])


def ssd_scan(
    scan: ChunkScan,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    initial_state: torch.Tensor,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``scan`` (``model_chunk_scan``) over a segment continuing ``initial_state`` [B, H, P, N]: (output [B, S, H, P],
    final state [B, H, P, N] in its own storage: transformers' torch scan returns a view of every chunk's state),
    shapes and dtypes in the module docstring. ``D`` None: no skip term."""
    out, final = scan(x, dt, A, B, C, chunk_size, D=D, initial_states=initial_state, return_final_states=True)
    return out, final.clone()


def ssd_decay(dt: torch.Tensor, A: torch.Tensor) -> torch.Tensor:
    """exp(sum_t dt_t * A) [B, H]: the factor a segment applies to the state it starts from (float32 or float64)."""
    compute = torch.promote_types(dt.dtype, torch.float32)
    return torch.exp((dt.to(compute) * A.to(compute)).sum(dim=1))


def ssd_scan_reference(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    initial_state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence of the module docstring, one token at a time: (output [B, S, H, P], final state)."""
    compute = torch.promote_types(x.dtype, torch.float32)
    heads = x.shape[2]
    per_group = heads // B.shape[2]
    x, dt, A = x.to(compute), dt.to(compute), A.to(compute)
    B = B.to(compute).repeat_interleave(per_group, dim=2)
    C = C.to(compute).repeat_interleave(per_group, dim=2)
    state = initial_state.to(compute)
    outputs = []
    for t in range(x.shape[1]):
        decay = torch.exp(dt[:, t] * A)[..., None, None]  # [B, H, 1, 1]
        state = decay * state + (dt[:, t, :, None] * x[:, t])[..., None] * B[:, t, :, None, :]
        y = (state * C[:, t, :, None, :]).sum(-1)
        outputs.append(y if D is None else y + D.to(compute)[:, None] * x[:, t])
    return torch.stack(outputs, dim=1), state


def reference_chunk_scan(
    hidden_states: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    chunk_size: int,
    D: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    initial_states: torch.Tensor | None = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
    return_final_states: bool = False,
    **_: object,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``ssd_scan_reference`` under the signature of transformers' ``mamba2_chunk_scan`` (its step-size ops first;
    ``chunk_size`` unused): what a test puts in the model's place to compare a sharded scan with a recurrence
    independent of the model's chunked one (the model's own scan computes in float32 whatever its inputs)."""
    if dt_bias is not None:
        dt = dt + dt_bias.to(dt.dtype)
    if dt_softplus:
        dt = F.softplus(dt)
    dt = torch.clamp(dt, min=dt_limit[0], max=dt_limit[1])
    if initial_states is None:
        batch, _, heads, head_dim = hidden_states.shape
        compute = torch.promote_types(hidden_states.dtype, torch.float32)
        initial_states = hidden_states.new_zeros(batch, heads, head_dim, B.shape[-1], dtype=compute)
    out, final = ssd_scan_reference(hidden_states, dt, A, B, C, D, initial_states)
    return (out, final) if return_final_states else out


# transformers' torch mamba2_chunk_scan contracts with einsums since 5.18.0; before, with broadcast products summed
# (fewer copies saved; 5.17, the GPU image's release). ``tests/ops/test_ssd_scan.py`` measures the count of the
# installed release: 5.17.0 through scripts/test_core.sh, 5.19 in CI (5.10's nemotron_h has no mamba2_chunk_scan).
EINSUM_SCAN = Version(transformers.__version__) >= Version("5.18.0")


def ssd_torch_saved_bytes(batch: int, tokens: int, heads: int, head_dim: int, state_size: int, chunk_size: int,
                          compute: torch.dtype) -> int:
    """Bytes the installed transformers' torch ``mamba2_chunk_scan`` saves for the backward over ``batch`` sequences
    of ``tokens`` (each padded to whole chunks of ``chunk_size``), arithmetic in ``compute``, its inputs computed in
    the graph (not leaves). Measured by ``tests/ops/test_ssd_scan.py``.

    Einsum form (transformers >= 5.18): per padded token the chunk-local decay, score and masked-score matrices (3
    of [chunk, heads]), the inputs, the discretised inputs and their per-chunk layouts (5 of [heads, head_dim]), B
    and C per head in their einsum layouts (5 of [heads, state_size]) and the step sizes and decays (4 of [heads]);
    per sequence its chunk states twice (the start states and the states with the initial one); the two masks.

    Broadcast form (5.17): per padded token the same 3 of [chunk, heads], the padded and the discretised inputs
    and the inter-chunk output (3 of [heads, head_dim]), B, C and the decayed B (3 of [heads, state_size]) and two
    decays (2 of [heads]); per token the unpadded inputs and both step sizes (1 of [heads, head_dim], 2 of [heads]);
    per sequence the chunk states twice with the final one and the chunk-to-chunk decays; four masks."""
    padded = tokens + (-tokens % chunk_size)
    chunks = padded // chunk_size
    if EINSUM_SCAN:
        per_token = 3 * chunk_size * heads + 5 * heads * head_dim + 5 * heads * state_size + 4 * heads
        states = (2 * chunks + 1) * heads * head_dim * state_size
        return batch * (padded * per_token + states) * compute.itemsize + 2 * chunk_size * chunk_size
    per_padded = 3 * chunk_size * heads + 3 * heads * head_dim + 3 * heads * state_size + 2 * heads
    per_sequence = (padded * per_padded + tokens * (heads * head_dim + 2 * heads)
                    + 2 * (chunks + 1) * heads * head_dim * state_size + heads * (chunks + 1) ** 2)
    return batch * per_sequence * compute.itemsize + 2 * chunk_size * chunk_size + 2 * (chunks + 1) ** 2
