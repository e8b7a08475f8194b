"""Kimi Delta Attention (``ops.kda.rule``) over one sequence split across the ranks of a context-parallel group.

The rule is the gated delta rule with one decay per key channel; its state's columns still evolve independently,
so ``ops.gated_delta.cp.affine_delta_rule`` serves it unchanged: each rank summarises its tokens as ``[E_j | M_j]``,
the summaries are merged, and each rank runs its tokens from its start state (contract in ``parallel.sequence``).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from ...parallel.comm import Group
from ...parallel.sequence import check_sizes
from ..gated_delta.cp import affine_delta_rule
from .rule import DeltaRule, kda_rule


def sharded_kda_rule(
    rule: DeltaRule, q, k, v, g, beta, initial_state: torch.Tensor, group: Group, sizes: Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """``ops.kda.rule.kda_rule`` over this rank's ``sizes[rank]`` tokens (q, k, g [B, T_r, H, Dk], v [B, T_r, H, Dv],
    beta [B, T_r, H]) of a sequence split across ``group``, from the replicated ``initial_state`` [B, H, Dk, Dv]
    (float32, or float64 for a float64 rule): (output [B, T_r, H, Dv], the final state after the last rank's last
    token, replicated). ``group=None``: one process."""
    if group is None:
        return kda_rule(rule, q, k, v, g, beta, initial_state)
    check_sizes("q", q.shape[1], group, sizes)
    state = initial_state.to(torch.promote_types(initial_state.dtype, torch.float32))
    return affine_delta_rule(functools.partial(kda_rule, rule), q, k, v, g, beta, state, group)
