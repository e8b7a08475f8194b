"""Mamba1's selective scan (``scan.selective_scan``) over one sequence split across the ranks of a context-parallel
group.

Rank r holds the ``sizes[r]`` consecutive tokens that follow those of ranks 0..r-1 (replicated metadata); the state
before rank 0's first token and the final state are replicated; gradients follow ``parallel.comm``'s partial-sum
semantics (``parallel.sequence``'s module docstring has the contract every rank keeps).

The recurrence is affine in the state, elementwise: over rank j's tokens ``h_out = a_j * h_in + E_j`` per channel
and state element (``a_j = exp(sum dt A)`` [B, D, N], ``E_j`` the end state from zero). Each state element is a
1 x 1 state of ``parallel.sequence.AffineMerge``: the summary ``[E_j | a_j]`` [B, D, N, 1, 2] is all-gathered and
composed into this rank's start state and the final state, and the rank runs its tokens from its start, so its
outputs round as the single-process scan's.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ...parallel.comm import Group
from ...parallel.sequence import AffineMerge, check_sizes
from .scan import scan_decay, selective_scan


def sharded_selective_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor | None,
    D: torch.Tensor | None,
    z: torch.Tensor | None,
    initial_state: torch.Tensor,
    group: Group,
    sizes: Sequence[int],
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """``scan.selective_scan`` over this rank's ``sizes[rank]`` tokens (x, dt, z [B, T_r, D]; B, C [B, T_r, N]) of a
    sequence split across ``group``, from the replicated ``initial_state`` [B, D, N]: (output [B, T_r, D], None where
    ``C`` is None; the final state after the last rank's last token, replicated). ``group=None``: one process."""
    if group is None:
        return selective_scan(x, dt, A, B, C, D, z, initial_state)
    check_sizes("x", x.shape[1], group, sizes)
    _, end_from_zero = selective_scan(x, dt, A, B, None, None, None, torch.zeros_like(initial_state))
    summary = torch.stack([end_from_zero, scan_decay(dt, A).to(end_from_zero.dtype)], dim=-1)[..., None, :]
    start, final = AffineMerge.apply(summary, initial_state.to(end_from_zero.dtype)[..., None, None], group)
    if C is None:  # the final state is all that is needed
        return None, final[..., 0, 0]
    out, _ = selective_scan(x, dt, A, B, C, D, z, start[..., 0, 0])
    return out, final[..., 0, 0]
