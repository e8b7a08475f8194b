"""One sequence split across the ranks of a context-parallel (CP) group: the contract every sharded op keeps, the
check of its sizes, and the affine merge of a state linear in the one before (the recurrences' CP forms:
``ops.gated_delta.cp``, ``ops.kda.cp``, ``ops.mamba2.cp``; the causal conv's tails, ``ops.causal_conv.cp``).

Rank r holds the ``sizes[r]`` consecutive tokens that follow those of ranks 0..r-1 (``sizes`` is replicated
metadata: every rank passes the same). The state before rank 0's first token (a recurrent ``initial_state``, a
convolution's ``conv_state``) is replicated; so is the final state every op returns. Gradients follow ``comm``'s
partial-sum semantics: a replicated input gets on each rank the gradient of that rank's use, and the sum over ranks
is the single-process gradient.

Each op puts all of a call's communication into ONE autograd Function, so each rank runs the call's collectives at
the same node of its graph (no ordering deadlock in the autograd engine), and its backward runs whenever any of the
call's outputs is used on that rank. Every rank must build the same graph: the same calls, with the same inputs
requiring gradients, and a loss that uses the outputs or the final state of every call. Which collectives run
depends only on ``sizes`` and shapes, never on data.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .comm import Group, all_gather, group_rank, group_size, reduce_scatter


def check_sizes(name: str, length: int, group: Group, sizes: Sequence[int]) -> None:
    """Raise a ValueError unless ``sizes`` has one entry >= 1 per rank and this rank's is ``length``."""
    world, rank = group_size(group), group_rank(group)
    if len(sizes) != world or min(sizes) < 1:
        raise ValueError(f"sizes={list(sizes)} must give every one of the {world} ranks at least one token")
    if sizes[rank] != length:
        raise ValueError(f"{name} has {length} tokens on rank {rank}, sizes[{rank}] says {sizes[rank]}: pass this "
                         f"rank's own tokens and the same sizes on every rank")


class AffineMerge(torch.autograd.Function):
    """Every rank's summary ``[E_j | M_j]`` [B, HV, Dk, Dv + Dk] composed from the initial state [B, HV, Dk, Dv]
    (any state linear in the one before: ``ops.mamba2.cp`` composes Mamba2's [B, H, P, N] with M_j = a_j I).

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


