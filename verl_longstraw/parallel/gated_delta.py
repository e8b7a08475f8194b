"""Gated DeltaNet over one sequence split across the ranks of a context-parallel (CP) group.

Rank r holds the ``sizes[r]`` consecutive tokens that follow those of ranks 0..r-1 (``sizes`` is
replicated metadata: every rank passes the same). The state before rank 0's first token (the
recurrent ``initial_state``, the convolution's ``conv_state``) is replicated; so is the final state
every op returns. Gradients follow ``comm``'s partial-sum semantics: a replicated input gets on
each rank the gradient of that rank's use, and the sum over ranks is the single-process gradient.

Two exact forms of the recurrence (``gated_delta_rule``, see ``ops/gated_delta_rule.py``):

- ``mode="sequential"`` (the reference): the state goes from rank to rank by send/recv, the final
  state is broadcast from the last rank; the backward runs the chain in reverse. R-fold serial.
- ``mode="affine"`` (the default; the merge flash-linear-attention's CP uses): the recurrence is linear in the
  state, so over rank j's tokens ``S_out = M_j S_in + E_j`` (M_j [B, HV, Dk, Dk], E_j [B, HV, Dk, Dv]).
  Each rank summarises its tokens, the summaries are all-gathered and every rank composes them
  into its own start state and the replicated final state, then runs its tokens from that start.

Both put all of a call's communication into ONE autograd Function, so each rank runs the call's
collectives at the same node of its graph (no ordering deadlock in the autograd engine), and its
backward runs whenever any of the call's outputs is used on that rank. Every rank must build the
same graph: the same calls, with the same inputs requiring gradients, and a loss that uses the
outputs or the final state of every call. Which collectives run depends only on ``sizes`` and
shapes, never on data.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Literal

import torch

from ..ops.gated_delta_rule import _value_groups, gated_delta_rule
from .comm import Group, all_gather, all_reduce_sum, broadcast, group_rank, group_size, recv, reduce_scatter, send


def check_sizes(name: str, length: int, group: Group, sizes: Sequence[int]) -> None:
    """Raise a ValueError unless ``sizes`` has one entry >= 1 per rank and this rank's is ``length``."""
    world, rank = group_size(group), group_rank(group)
    if len(sizes) != world or min(sizes) < 1:
        raise ValueError(f"sizes={list(sizes)} must give every one of the {world} ranks at least one token")
    if sizes[rank] != length:
        raise ValueError(f"{name} has {length} tokens on rank {rank}, sizes[{rank}] says {sizes[rank]}: pass this "
                         f"rank's own tokens and the same sizes on every rank")


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


class AffineMerge(torch.autograd.Function):
    """Every rank's summary ``[E_j | M_j]`` [B, HV, Dk, Dv + Dk] composed from the initial state [B, HV, Dk, Dv]
    (any state linear in the one before: ``parallel.ssd`` composes Mamba2's [B, H, P, N] with M_j = a_j I).

    Forward: all-gather of the summaries; ``S_{j+1} = M_j S_j + E_j`` from ``S_0 = initial_state``;
    returns (this rank's start state S_r, the final state S_R). Backward: this rank's gradients of
    every summary (from its uses of S_r and S_R) are reduce-scattered to their owners, so rank j
    gets the sum over ranks for its own summary; the initial state gets this rank's partial.
    """

    @staticmethod
    def forward(ctx, summary, initial_state, group):
        dv = initial_state.shape[-1]
        summaries = all_gather(summary, group)
        states = [initial_state]
        for packed in summaries:
            states.append(packed[..., dv:] @ states[-1] + packed[..., :dv])
        ctx.group, ctx.dv = group, dv
        ctx.save_for_backward(*summaries, *states[:-1])
        return states[group_rank(group)].clone(), states[-1]

    @staticmethod
    def backward(ctx, grad_start, grad_final):
        world, rank, dv = group_size(ctx.group), group_rank(ctx.group), ctx.dv
        saved = ctx.saved_tensors  # unpacked once: activation checkpointing allows a single unpack
        summaries, states = saved[:world], saved[world:]
        grad_state = grad_final
        grad_summaries = [None] * world
        for j in reversed(range(world)):
            transition = summaries[j][..., dv:]
            grad_summaries[j] = torch.cat([grad_state, grad_state @ states[j].transpose(-1, -2)], dim=-1)
            grad_state = transition.transpose(-1, -2) @ grad_state
            if j == rank:
                grad_state = grad_state + grad_start
        return reduce_scatter(grad_summaries, ctx.group), grad_state, None


def affine_delta_rule(rule: Callable[..., tuple[torch.Tensor, torch.Tensor]], q, k, v, g, beta, initial_state,
                      group: Group) -> tuple[torch.Tensor, torch.Tensor]:
    """A delta rule over a sequence split across ``group`` in affine form: the summary run (values ``[v | 0]``
    from state ``[0 | I]`` ends in ``[E | M]``), the merge, the run from this rank's start state.
    ``rule(q, k, v, g, beta, initial_state) -> (out, final state)`` is the single-process op: the gated delta rule
    (g one decay per value head) or Kimi Delta Attention (g one decay per key channel, ``parallel.kda``).

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


def sharded_conv_input(
    x: torch.Tensor, conv_state: torch.Tensor, group: Group, sizes: Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Input of a causal depthwise conv over this rank's tokens of a sequence split across ``group``.

    ``x`` [B, C, T_r]: this rank's inputs; ``conv_state`` [B, C, K-1]: the K-1 inputs before rank
    0's first token, replicated. Returns (conv_in [B, C, K-1+T_r]: the K-1 inputs before this rank's
    first token, then its own; the final conv state [B, C, K-1]: the last K-1 inputs of the whole
    sequence, replicated, in its own storage), both in x's dtype. Each rank contributes its last
    min(K-1, T_r) inputs to one all-gather. ``group=None`` is one process: ``[conv_state | x]``.
    """
    history = conv_state.shape[-1]
    if history < 1:
        raise ValueError(f"conv_state has {history} entries on its last dim: it must hold the K-1 >= 1 inputs before "
                         f"the first token")
    sizes = [x.shape[-1]] if group is None else sizes
    check_sizes("x", x.shape[-1], group, sizes)
    tails = all_gather(x[..., -min(history, x.shape[-1]):], group, [min(history, n) for n in sizes], dim=-1)
    rank = group_rank(group)
    before = torch.cat([conv_state.to(x.dtype), *tails[:rank]], dim=-1)[..., -history:]
    final = torch.cat([conv_state.to(x.dtype), *tails], dim=-1)[..., -history:].clone()
    return torch.cat([before, x], dim=-1), final
