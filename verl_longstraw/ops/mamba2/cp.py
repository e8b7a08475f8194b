"""Mamba2's scan (``ops.mamba2.ssd``) over one sequence split across the ranks of a context-parallel group.

Rank r holds the ``sizes[r]`` consecutive tokens that follow those of ranks 0..r-1 (replicated metadata); the state
before rank 0's first token and the final state are replicated; gradients follow ``comm``'s partial-sum semantics
(``parallel.sequence`` has the contract every rank keeps).

The recurrence is affine in the state with a scalar per head: over rank j's tokens ``h_out = a_j h_in + E_j``
(``a_j = exp(sum dt A)`` [B, H], ``E_j`` the end state from zero). Each rank summarises its tokens as
``[E_j | a_j I]`` [B, H, P, N + P], ``parallel.sequence.AffineMerge`` all-gathers and composes the summaries into this
rank's start state and the final state, and the rank runs its tokens from its start, so its outputs round as the
single-process scan's.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ...parallel.comm import Group
from ...parallel.sequence import AffineMerge, check_sizes
from .ssd import ChunkScan, ssd_decay, ssd_scan


def sharded_ssd_scan(
    scan: ChunkScan,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    initial_state: torch.Tensor,
    chunk_size: int,
    group: Group,
    sizes: Sequence[int],
) -> tuple[torch.Tensor, torch.Tensor]:
    """``ops.mamba2.ssd.ssd_scan`` over this rank's ``sizes[rank]`` tokens (x [B, T_r, H, P], dt [B, T_r, H], B, C
    [B, T_r, G, N]) of a sequence split across ``group``, from the replicated ``initial_state`` [B, H, P, N]:
    (output [B, T_r, H, P], the final state after the last rank's last token, replicated). ``group=None``: one
    process."""
    if group is None:
        return ssd_scan(scan, x, dt, A, B, C, D, initial_state, chunk_size)
    check_sizes("x", x.shape[1], group, sizes)
    zeros = torch.zeros_like(initial_state)
    _, end_from_zero = scan(x, dt, A, B, C, chunk_size, D=None, initial_states=zeros, return_final_states=True)
    head_dim = x.shape[-1]
    identity = torch.eye(head_dim, dtype=end_from_zero.dtype, device=x.device)
    transition = ssd_decay(dt, A).to(end_from_zero.dtype)[..., None, None] * identity  # [B, H, P, P]
    summary = torch.cat([end_from_zero, transition], dim=-1)
    start, final = AffineMerge.apply(summary, initial_state.to(end_from_zero.dtype), group)
    out, _ = ssd_scan(scan, x, dt, A, B, C, D, start, chunk_size)
    return out, final
