"""Prefix attention of a segment split over the ranks of a CP group, over a prompt prefix whose rows are split too.

Pass-Q with a log-sum-exp merge (design study §3.3). On every rank r:

1. all-gather the queries of every rank (differentiable): [B, Hq, N, D], N = sum(query_sizes);
2. attend all N queries to the local keys only (rank r's prefix rows, then its own keys under the
   cross-rank causal rule), giving a partial output o_r [B, Hq, N, Dv] and its logsumexp l_r
   [B, Hq, N] (``ops.blocked_attention.partial_attention_blocked``);
3. all-gather the logsumexps; L = logsumexp over ranks of l_j is every query's global logsumexp;
4. weight o_r by exp(l_r - L) and reduce-scatter the weighted partials to the query owners: the
   sum over ranks of exp(l_j - L) o_j is the softmax over all keys.

Everything is built from differentiable collectives (``parallel.comm``) and the partial
attention's autograd function (backward takes d(output) and d(logsumexp)), so the backward is
autograd's: all-gather of d(output), reduce-scatter of d(logsumexp), the partial attention's
backward (key/value gradients of the local prefix rows and own keys stay on this rank: they are
the local leaves' gradients), reduce-scatter of d(queries) to their owners. Every rank issues the
same six collectives per call (three forward, three backward) whatever the data: no branch
depends on anything but the replicated sizes. A query that sees no local key on a rank has
logsumexp -inf there and weight 0: zero output and zero gradient from that rank, never NaN.

Bytes on the wire per call: forward N*Hq*D queries (input dtype), R*N*Hq logsumexps and
R*N*Hq*Dv weighted outputs (float32, float64 for float64 inputs); backward the same three.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..ops.attention import key_block_size, lse_weight, prefix_causal_attention
from ..ops.blocked_attention import OwnKeyRule, compute_dtype, partial_attention_blocked
from .comm import Group, all_gather, group_rank, group_size, reduce_scatter


def _check_sizes(
    q: torch.Tensor,
    k_prefix: torch.Tensor,
    k_self: torch.Tensor,
    group: Group,
    query_sizes: Sequence[int],
    prefix_sizes: Sequence[int],
) -> None:
    rank, world = group_rank(group), group_size(group)
    if len(query_sizes) != world or len(prefix_sizes) != world:
        raise ValueError(
            f"query_sizes ({len(query_sizes)} entries) and prefix_sizes ({len(prefix_sizes)} entries) need one entry "
            f"per rank of the group ({world} ranks)"
        )
    if q.shape[-2] != query_sizes[rank] or k_self.shape[-2] != query_sizes[rank]:
        raise ValueError(
            f"rank {rank}: q has {q.shape[-2]} and k_self {k_self.shape[-2]} tokens, query_sizes[{rank}] says "
            f"{query_sizes[rank]}; pass this rank's segment and the same query_sizes on every rank"
        )
    if k_prefix.shape[-2] != prefix_sizes[rank]:
        raise ValueError(
            f"rank {rank}: k_prefix has {k_prefix.shape[-2]} rows, prefix_sizes[{rank}] says {prefix_sizes[rank]}; "
            f"pass this rank's prefix rows and the same prefix_sizes on every rank"
        )


def sharded_prefix_attention(
    q: torch.Tensor,
    k_prefix: torch.Tensor,
    v_prefix: torch.Tensor,
    k_self: torch.Tensor,
    v_self: torch.Tensor,
    scale: float,
    group: Group,
    query_sizes: Sequence[int],
    prefix_sizes: Sequence[int],
    causal_across_ranks: bool,
    key_mask: torch.Tensor | None = None,
    block_size: int | None = None,
) -> torch.Tensor:
    """``prefix_causal_attention`` of every rank's segment over the prefix rows of all ranks. Returns [B, Hq, T_r, Dv].

    On rank r: ``q`` [B, Hq, T_r, D], ``k_self`` [B, Hk, T_r, D], ``v_self`` [B, Hk, T_r, Dv] are its
    segment (T_r = ``query_sizes[r]``); ``k_prefix`` [B, Hk, P_r, D], ``v_prefix`` [B, Hk, P_r, Dv] its
    rows of the prefix (P_r = ``prefix_sizes[r]``, may be 0). Every query sees every prefix row of
    every rank. ``causal_across_ranks``: the segments are consecutive sub-slices of one sequence in
    rank order (rank j's own keys are visible to rank r's queries if j < r, causally if j == r);
    otherwise each segment is a sequence of its own (own keys visible only to its own queries,
    causally). ``key_mask`` bool [sum(query_sizes), P_r + T_r]: which of this rank's keys (prefix
    rows, then own keys) each query of every rank (in rank order) may see, on top of those rules.
    ``block_size``: keys scored at a time by the blocked partial attention (None: ``ops.attention.key_block_size``).
    The partial attention is always the blocked op, never the dense one, even for small inputs: the dense
    op saves score-sized tensors [B, Hq, N, P_r + T_r] for backward, and N holds the queries of all R ranks,
    so at P_r = P / R they are as large as one process's scores over the whole prefix (the memory context
    parallelism is there to divide); the blocked op saves the inputs, output and logsumexp only. (Tiny qwen3,
    P = 4096, R = 4: peak saved bytes per rank 2.9x one process's with the dense op, 0.33x with the blocked
    one; ``tests/parallel/test_cp_memory.py``.)
    ``group`` None: exactly ``prefix_causal_attention`` (one process).

    Sizes must be the same on every rank (they decide the collectives' shapes). Gradients of all
    inputs are local: each rank gets the full gradient of its own tensors.
    """
    if group is None:
        return prefix_causal_attention(q, k_prefix, v_prefix, k_self, v_self, scale, key_mask=key_mask)
    _check_sizes(q, k_prefix, k_self, group, query_sizes, prefix_sizes)
    rank = group_rank(group)
    queries = torch.cat(all_gather(q, group, query_sizes, dim=-2), dim=-2)
    own_keys = OwnKeyRule(start=sum(query_sizes[:rank]), later_rows_see_all=causal_across_ranks)
    block_size = block_size or key_block_size(queries.shape[:-1].numel(), compute_dtype(queries.dtype).itemsize)
    out, logsumexp = partial_attention_blocked(
        queries, k_prefix, v_prefix, k_self, v_self, scale, own_keys, key_mask, block_size
    )
    weighted = out * lse_weight(logsumexp, all_gather(logsumexp, group))
    return reduce_scatter(weighted.split(list(query_sizes), dim=-2), group, query_sizes, dim=-2).to(q.dtype)
