"""Gated DeltaNet over one sequence split across the ranks of a context-parallel (CP) group (the contract every rank
keeps, on sizes, replicated states and gradients: ``parallel.sequence``).

Two exact forms of the recurrence (``gated_delta_rule``, see ``ops/gated_delta/rule.py``):

- ``mode="sequential"`` (the reference): the state goes from rank to rank by send/recv, the final
  state is broadcast from the last rank; the backward runs the chain in reverse. R-fold serial.
- ``mode="affine"`` (the default; the merge flash-linear-attention's CP uses): the recurrence is linear in the
  state, so over rank j's tokens ``S_out = M_j S_in + E_j`` (M_j [B, HV, Dk, Dk], E_j [B, HV, Dk, Dv]).
  Each rank summarises its tokens, the summaries are all-gathered and every rank composes them
  into its own start state and the replicated final state (``parallel.sequence.AffineMerge``), then runs its
  tokens from that start. ``affine_delta_rule`` serves any delta rule whose state columns evolve independently
  (Kimi Delta Attention's too, ``ops.kda.cp``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Literal

import torch

from ...parallel.comm import Group, all_reduce_sum, broadcast, group_rank, group_size, recv, send
from ...parallel.sequence import AffineMerge, check_sizes
from .rule import _value_groups, gated_delta_rule


class _SequentialChain(torch.autograd.Function):
    """Rank r: receive the start state from rank r-1, run its tokens, send the end state to rank r+1.

    Forward: recv, the local op (its graph kept), send, broadcast of the final state from the last
    rank. Backward: all-reduce of the final state's partial gradients, recv of the end state's
    gradient from rank r+1, the local backward, send of the start state's gradient to rank r-1.
    The initial state's gradient (the whole sum over ranks) lands on rank 0's copy, zeros on the others.
    """

    @staticmethod
    def forward(ctx, q, k, v, g, beta, initial_state, group, use_qk_l2norm):
        rank, world = group_rank(group), group_size(group)
        start = initial_state if rank == 0 else recv(initial_state, rank - 1, group)
        build_graph = any(ctx.needs_input_grad[:6])  # the same on every rank (module docstring)
        leaves = [x.detach().requires_grad_(build_graph) for x in (q, k, v, g, beta, start)]
        with torch.enable_grad():
            out, end = gated_delta_rule(*leaves, use_qk_l2norm=use_qk_l2norm)
        if rank < world - 1:
            send(end.detach(), rank + 1, group)
        final = end.detach().clone() if rank == world - 1 else torch.empty_like(end)
        broadcast(final, world - 1, group)
        ctx.group, ctx.leaves, ctx.out, ctx.end = group, leaves, out, end
        return out.detach(), final

    @staticmethod
    def backward(ctx, grad_out, grad_final):
        group = ctx.group
        rank, world = group_rank(group), group_size(group)
        grad_end = all_reduce_sum(grad_final.clone(memory_format=torch.contiguous_format), group)
        if rank < world - 1:
            grad_end = recv(grad_end, rank + 1, group)
        *grads, grad_start = torch.autograd.grad((ctx.out, ctx.end), ctx.leaves, (grad_out, grad_end))
        if rank > 0:
            send(grad_start, rank - 1, group)
        # zeros on ranks > 0, so every rank's copy of the initial state gets a gradient, as in affine mode
        grads.append(grad_start if rank == 0 else torch.zeros_like(grad_start))
        grads = [grad if needed else None for grad, needed in zip(grads, ctx.needs_input_grad[:6], strict=True)]
        return (*grads, None, None)


def affine_delta_rule(rule: Callable[..., tuple[torch.Tensor, torch.Tensor]], q, k, v, g, beta, initial_state,
                      group: Group) -> tuple[torch.Tensor, torch.Tensor]:
    """A delta rule over a sequence split across ``group`` in affine form: the summary run (values ``[v | 0]``
    from state ``[0 | I]`` ends in ``[E | M]``), the merge, the run from this rank's start state.
    ``rule(q, k, v, g, beta, initial_state) -> (out, final state)`` is the single-process op: the gated delta rule
    (g one decay per value head) or Kimi Delta Attention (g one decay per key channel, ``ops.kda.cp``).

    The columns of the state evolve independently (the decay and the delta update act on its key rows), so one
    run of width Dv + Dk gives both E (the end state from zero, columns of v) and M (the end state from I with
    zero values); q does not reach the state, so the summary uses it detached. The outputs come from a second run
    of the single-process op from the merged start state, so they round exactly as the single-process op.
    Grouped value heads (HV > H) pass through: the summary has one [E | M] per value head.
    """
    batch, tokens, v_heads, dv = v.shape
    dk = k.shape[-1]
    identity = torch.eye(dk, dtype=initial_state.dtype, device=k.device).expand(batch, v_heads, dk, dk)
    summary_start = torch.cat([initial_state.new_zeros(batch, v_heads, dk, dv), identity], dim=-1)
    values = torch.cat([v, v.new_zeros(batch, tokens, v_heads, dk)], dim=-1)
    _, summary = rule(q.detach(), k, values, g, beta, summary_start)
    # a float32 kernel (the model's KDA rule) returns a float32 summary of a float64 model's state: merge in its dtype
    start, final = AffineMerge.apply(summary.to(initial_state.dtype), initial_state, group)
    out, _ = rule(q, k, v, g, beta, start)
    return out, final


def sharded_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
    group: Group,
    sizes: Sequence[int],
    use_qk_l2norm: bool = True,
    mode: Literal["affine", "sequential"] = "affine",
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over this rank's ``sizes[rank]`` tokens of a sequence split across ``group``.

    Shapes (T_r = this rank's tokens): ``q``, ``k`` [B, T_r, H, Dk]; ``v`` [B, T_r, HV, Dv];
    ``g``, ``beta`` [B, T_r, HV]; ``initial_state`` [B, HV, Dk, Dv] (the state before rank 0's first
    token, replicated; None means zeros); HV a multiple of H, value head j reading key head
    j // (HV // H) as in ``gated_delta_rule``. Returns (output [B, T_r, HV, Dv] in v's dtype, the final
    state [B, HV, Dk, Dv] after the last rank's last token, replicated, in float32 (float64 for
    float64 inputs)). ``group=None`` is the single-process op. ``mode`` picks the exact form (see
    the module docstring): both agree to rounding.
    """
    if mode not in ("affine", "sequential"):
        raise ValueError(f"mode={mode!r}: use 'affine' (default) or 'sequential'")
    if group is None:
        return gated_delta_rule(q, k, v, g, beta, initial_state, use_qk_l2norm=use_qk_l2norm)
    check_sizes("q", q.shape[1], group, sizes)
    _value_groups(q, k, v)  # a bad head count raises on every rank, before any collective
    dtype = torch.promote_types(q.dtype, torch.float32)
    batch, _, v_heads, dv = v.shape
    if initial_state is None:
        initial_state = torch.zeros(batch, v_heads, k.shape[-1], dv, dtype=dtype, device=v.device)
    initial_state = initial_state.to(dtype)
    if mode == "sequential":
        return _SequentialChain.apply(q, k, v, g, beta, initial_state, group, use_qk_l2norm)
    rule = functools.partial(gated_delta_rule, use_qk_l2norm=use_qk_l2norm)
    return affine_delta_rule(rule, q, k, v, g, beta, initial_state, group)
