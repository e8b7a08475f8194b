"""Prefix attention of a segment split over the ranks of a CP group, over a prompt prefix whose rows are split too.

Pass-Q (queries travel, keys stay) with a log-sum-exp merge. On every rank r:

1. all-gather the queries of every rank: [B, Hq, N, D], N = sum(query_sizes);
2. attend all N queries to the local keys only (rank r's prefix rows, then its own keys under the
   cross-rank causal rule), giving a partial output o_r [B, Hq, N, Dv] and its logsumexp l_r [B, Hq, N];
3. all-gather the logsumexps; L = logsumexp over ranks of l_j is every query's global logsumexp;
4. weight o_r by exp(l_r - L) and reduce-scatter the weighted partials to the query owners: the
   sum over ranks of exp(l_j - L) o_j is the softmax over all keys.

Two implementations of step 2 and of the backward, chosen from replicated facts only (dtype, head counts and
dims, device, whether a key mask is given) by ``sharded_attention_path``, which the layer's costs ask too
(``mixers.attention.RowAttention.pass_q_path``), so every rank takes the same one and the estimate prices it:

- fused (``_ShardedFusedAttention``; value dim == key dim, no key mask, where ``fused_kernel_dtype`` takes the
  inputs): flash-attention kernel calls (``ops.attention.fused``). Backward: all-gather of every rank's
  d(output) and output, the kernels' backward over the local keys given the global output and L, reduce-scatter
  of d(queries) in float32 (``compute_dtype``: the kernels' shares are summed in it on each rank, then over the
  ranks, and rounded to q's dtype once): five collectives per call. Transient bytes of that backward:
  ``sharded_fused_backward_transient_bytes``.
- blocked (MLA's value dim != key dim, DSA's key mask, or a ``block_size`` given): the blocked partial attention
  (``ops.attention.blocked.partial_attention_blocked``, whose backward takes d(output) and d(logsumexp)) between
  differentiable collectives (``parallel.comm``), so the backward is autograd's: all-gather of d(output),
  reduce-scatter of d(logsumexp), the partial attention's backward, reduce-scatter of d(queries): six
  collectives per call. The d(queries) reduce-scatter sums in float32 too (``comm.all_gather``'s backward), but
  each rank's share reaches it rounded once to q's dtype: autograd hands the gathered queries' gradient over in
  their dtype.

Key/value gradients of the local prefix rows and own keys stay on this rank (they are the local leaves'
gradients). Every rank issues the same collectives whatever the data: no branch depends on anything but
replicated values. A query that sees no local key on a rank has logsumexp -inf there and weight 0: zero output
and zero gradient from that rank, never NaN.

Bytes on the wire per call: forward N*Hq*D queries (input dtype), R*N*Hq logsumexps and
R*N*Hq*Dv weighted outputs (float32, float64 for float64 inputs); backward about the same, with the d(queries)
in float32.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, NamedTuple

import torch

from ...dtypes import compute_dtype
from ...parallel.comm import (
    Group,
    all_gather,
    gather_padded,
    group_rank,
    group_size,
    reduce_scatter,
    reduce_scatter_padded,
)
from .blocked import (
    OwnKeyRule,
    autocast_off,
    partial_attention_blocked,
    planned_matmul_dtype,
)
from .fused import (
    FUSED_PATHS,
    fused_backward_transient_bytes,
    fused_kernel_dtype,
    fused_partial_backward,
    fused_partial_forward,
)
from .prefix import ATTENTION_PATHS, blocked_path_name, key_block_size, lse_weight, prefix_causal_attention


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


PassQPath = Literal["fused", "blocked"]


def sharded_attention_path(fused_dtype: torch.dtype | None, queries: int, masked: bool = False,
                           block_size: int | None = None) -> PassQPath:
    """The path ``sharded_prefix_attention`` takes for ``queries`` gathered queries (all ranks') whose inputs the
    fused kernels compute in ``fused_dtype`` (``ops.attention.fused.fused_kernel_dtype``, or ``planned_fused_dtype``
    for a device this process need not have; None where they do not take them): "fused" unless a key mask is given
    (``masked``: DSA's selection), a ``block_size`` forces the blocked op, the kernels do not take the inputs, or
    there are no queries; else "blocked". Replicated facts only, so every rank decides alike."""
    fused = fused_dtype is not None and not masked and block_size is None and queries > 0
    return "fused" if fused else "blocked"


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
    ``block_size``: keys scored at a time by the blocked partial attention (None: the fused kernels where they
    take the inputs, else ``ops.attention.prefix.key_block_size``; an int forces the blocked op).
    Either way the partial attention is never the dense op, even for small inputs: the dense
    op saves score-sized tensors [B, Hq, N, P_r + T_r] for backward, and N holds the queries of all R ranks,
    so at P_r = P / R they are as large as one process's scores over the whole prefix (the memory context
    parallelism is there to divide); the fused and blocked ops save the inputs, output and logsumexp only. (Tiny qwen3,
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
    own_keys = OwnKeyRule(start=sum(query_sizes[:rank]), later_rows_see_all=causal_across_ranks)
    dtype = fused_kernel_dtype(q.device, q.dtype, q.shape[1], k_self.shape[1], q.shape[-1], v_self.shape[-1])
    if sharded_attention_path(dtype, sum(query_sizes), key_mask is not None, block_size) == "fused":
        ATTENTION_PATHS["sharded_" + FUSED_PATHS[q.device.type]] += 1
        return _ShardedFusedAttention.apply(
            q, k_prefix, v_prefix, k_self, v_self, scale, dtype, group, tuple(query_sizes), own_keys
        )
    ATTENTION_PATHS["sharded_" + blocked_path_name(q)] += 1
    queries = torch.cat(all_gather(q, group, query_sizes, dim=-2), dim=-2)
    block_size = block_size or key_block_size(queries.shape[:-1].numel(), compute_dtype(queries.dtype).itemsize)
    out, logsumexp = partial_attention_blocked(
        queries, k_prefix, v_prefix, k_self, v_self, scale, own_keys, key_mask, block_size
    )
    weight = lse_weight(logsumexp, all_gather(logsumexp, group))
    weighted = out.mul_(weight) if not torch.is_grad_enabled() else out * weight  # no autograd (a capture): in place
    return reduce_scatter(weighted.split(list(query_sizes), dim=-2), group, query_sizes, dim=-2).to(q.dtype)


class PassQSaves(NamedTuple):
    """Bytes ``sharded_prefix_attention`` keeps for backward on one rank, in one layer: ``local`` its inputs of this
    rank (the prefix buffer its key views keep alive, the own keys/values); ``gathered`` what grows with the
    gathered queries of all ranks."""

    local: int
    gathered: int


def sharded_attention_saved_bytes(
    dtype: torch.dtype,
    q_heads: int,
    qk_dim: int,
    v_dim: int,
    gathered_queries: int,
    world: int,
    fused: bool,
    prefix_buffer_bytes: int,
    own_kv_bytes: int,
) -> PassQSaves:
    """What ``sharded_prefix_attention`` saves on one of ``world`` ranks for ``gathered_queries`` queries of all
    ranks (one sequence, inputs of ``dtype``), ``fused``: on the fused kernels (``ops.attention.fused.
    fused_kernel_dtype`` takes the inputs), else the blocked op. Gathered: the queries [Hq, N, D] in ``dtype`` and
    the merged logsumexp L [Hq, N]; on the blocked path also the partial outputs [Hq, N, Dv], this rank's and
    the R gathered logsumexps and each rank's weight, in the arithmetic dtype. Local: ``prefix_buffer_bytes`` (the
    state buffer whose views the prefix keys/values are) and ``own_kv_bytes``."""
    floats = 1 if fused else v_dim + world + 3
    gathered = gathered_queries * q_heads * (qk_dim * dtype.itemsize + floats * compute_dtype(dtype).itemsize)
    return PassQSaves(prefix_buffer_bytes + own_kv_bytes, gathered)


class _ShardedFusedAttention(torch.autograd.Function):
    """Pass-Q over the fused kernels (``ops.attention.fused``), with the collectives written out.

    Forward: all-gather the queries, the local fused partial attention (output, logsumexp l_r), all-gather the
    logsumexps (L = their logsumexp over ranks), reduce-scatter exp(l_r - L) o_r to the query owners. Backward:
    all-gather every rank's d(output) and output (one collective, concatenated along the channels), the fused
    kernels' backward over the local keys given that global output and L (the ring-attention identity: exactly
    the local keys' dK/dV and their share of dQ, no logsumexp gradient needed), reduce-scatter d(queries) to their
    owners in float32 (cast to q's dtype after). Five collectives per call on every rank whatever the data. Saved:
    the gathered queries, the local keys/values, L [B, Hq, N] and this rank's output.
    """

    @staticmethod
    @autocast_off
    def forward(ctx, q, k_prefix, v_prefix, k_self, v_self, scale, dtype, group, query_sizes, own_keys):
        queries = torch.cat(gather_padded(q, query_sizes, -2, group), dim=-2)
        out, logsumexp, ctx.extras = fused_partial_forward(
            queries, k_prefix, v_prefix, k_self, v_self, scale, dtype, own_keys
        )
        total = torch.logsumexp(torch.stack(gather_padded(logsumexp, (logsumexp.shape[-1],) * group_size(group),
                                                          -1, group)), dim=0)
        weighted = out * (logsumexp - total).exp().unsqueeze(-1)
        mine = reduce_scatter_padded(weighted.split(list(query_sizes), dim=-2), query_sizes, -2, group).to(q.dtype)
        ctx.save_for_backward(queries, k_prefix, v_prefix, k_self, v_self, total, mine)
        ctx.scale, ctx.dtype, ctx.group, ctx.query_sizes, ctx.own_keys = scale, dtype, group, query_sizes, own_keys
        return mine

    @staticmethod
    @autocast_off
    def backward(ctx, grad_mine):
        grad_queries, *grads = _fused_local_backward(ctx, grad_mine)
        grad_q = reduce_scatter_padded(grad_queries.split(list(ctx.query_sizes), dim=-2), ctx.query_sizes, -2,
                                       ctx.group).to(grad_mine.dtype)
        return grad_q if ctx.needs_input_grad[0] else None, *grads, None, None, None, None, None


def _gathered_outputs(
    grad_mine: torch.Tensor, mine: torch.Tensor, query_sizes: tuple[int, ...], group: Group
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank's d(output) and output [B, Hq, N, D] (one all-gather of both), each laid out [B, N, Hq, D] in
    memory as the CUDA kernels read them (``ops.attention.fused._kernel_layout``): the ranks' rows are copied once,
    from the gather's buffer (which dies at return) into [2, B, N, Hq, D]."""
    both = torch.stack([grad_mine.to(mine.dtype), mine])  # [2, B, Hq, T_r, D]
    pieces = gather_padded(both, query_sizes, -2, group)
    grad_out, out = torch.cat([piece.transpose(-3, -2) for piece in pieces], dim=-3).transpose(-3, -2).unbind(0)
    return grad_out, out


def _fused_local_backward(ctx, grad_mine: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    """``fused_partial_backward`` over this rank's keys given every rank's d(output) and output: d(queries of all
    ranks) in float32 (always, so every rank issues the same reduce-scatter), the local K/V gradients (None where
    not needed). The gathered d(output) and output die at return, before the reduce-scatter."""
    queries, k_prefix, v_prefix, k_self, v_self, total, mine = ctx.saved_tensors
    grad_out, out = _gathered_outputs(grad_mine, mine, ctx.query_sizes, ctx.group)
    return fused_partial_backward(
        grad_out, queries, k_prefix, v_prefix, k_self, v_self, out, total, ctx.scale, ctx.dtype, ctx.own_keys,
        ctx.extras, (True, *ctx.needs_input_grad[1:5]),
    )


def sharded_fused_backward_transient_bytes(
    device_type: str,
    dtype: torch.dtype,
    batch: int,
    q_heads: int,
    kv_heads: int,
    dim: int,
    query_sizes: Sequence[int],
    rank: int,
    prefix_rows: int,
    causal_across_ranks: bool,
) -> int:
    """Peak bytes ``_ShardedFusedAttention.backward`` allocates on rank ``rank`` besides its local gradients, for
    inputs of ``dtype`` ([batch, q_heads, T_r, dim] queries, ``kv_heads`` key heads, ``prefix_rows`` local prefix
    rows; arguments as ``sharded_prefix_attention``), on a device of ``device_type``. The largest of its phases,
    with N = sum(query_sizes), L = max(query_sizes) and a row = B x Hq x D entries:
    - gathering d(output) and output: this rank's 2 x T_r rows stacked, the wire buffers (those rows padded to
      2 x L, and the 2 x R x L rows received) and the copy in the kernels' layout (2 x N rows), in ``dtype``;
    - the kernels' backward: that copy plus ``ops.attention.fused.fused_backward_transient_bytes`` of the N
      gathered queries over this rank's keys (its float32 d(queries) included);
    - the reduce-scatter of d(queries): the float32 d(queries) (N rows), the send buffer (R x L rows) and the
      received rows (L), in ``compute_dtype``.
    The gather's wire buffers (the padded rows sent and the buffer received) count in the two later phases too on a
    CPU: gloo's work object holds them until its worker thread lets go, which can be after the call returns. On CUDA
    they are free at return: NCCL's process group does not record the tensors of a synchronous
    ``all_gather_into_tensor`` or ``reduce_scatter_tensor`` (what ``parallel.comm`` issues) on its stream, it holds
    them until the work is waited on, which the call does before it returns (torch >= 2.2, pytorch#111431; since
    torch 2.8 such a collective runs on the caller's stream, pytorch#150398).
    """
    world, longest, queries, own = len(query_sizes), max(query_sizes), sum(query_sizes), query_sizes[rank]
    row = batch * q_heads * dim
    gathered = 2 * queries * row * dtype.itemsize
    stacked = 2 * own * row * dtype.itemsize
    gather_wire = 2 * (longest + world * longest) * row * dtype.itemsize
    own_keys = OwnKeyRule(start=sum(query_sizes[:rank]), later_rows_see_all=causal_across_ranks)
    kernels = gathered + fused_backward_transient_bytes(device_type, dtype, batch, q_heads, kv_heads, dim, queries,
                                                        prefix_rows, own, own_keys)
    scatter = (queries + (world + 1) * longest) * row * compute_dtype(dtype).itemsize
    held = gather_wire if device_type == "cpu" else 0
    return max(gather_wire + stacked + gathered, held + kernels, held + scatter)


ROW_STATS = 6  # float32 values per query row the blocked op holds beside its blocks: running max and sum, new max,
# shift, correction, delta


class BlockedPassQTransients(NamedTuple):
    """Peak bytes the blocked pass-Q (``sharded_prefix_attention`` off the fused kernels) allocates on one rank beyond
    its inputs and what it saves: ``forward`` a no-grad call's (a capture), ``backward`` its backward's."""

    forward: int
    backward: int


def sharded_blocked_transient_bytes(
    device_type: str,
    dtype: torch.dtype,
    batch: int,
    q_heads: int,
    kv_heads: int,
    qk_dim: int,
    v_dim: int,
    query_sizes: Sequence[int],
    rank: int,
    prefix_rows: int,
) -> BlockedPassQTransients:
    """``BlockedPassQTransients`` of one call on rank ``rank`` for inputs of ``dtype`` on a ``device_type`` device
    ([batch, q_heads, T_r, qk_dim] queries, ``kv_heads`` key heads, values of ``v_dim``, ``prefix_rows`` local prefix
    rows; arguments as ``sharded_prefix_attention``). With N = sum(query_sizes) gathered queries, W = R x
    max(query_sizes) wire rows,
    L = max(query_sizes), a row = batch x q_heads entries, b / f / o bytes of ``dtype``, the arithmetic dtype and the
    matmul operands (``planned_matmul_dtype``), and a block = one key block's float32 scores [N rows, keys]
    (``ops.attention.prefix.key_block_size`` keys, at most the longest local key set):

    - forward, the largest of: the gather (this rank's padded queries, the wire buffer, the concatenated queries:
      (L + W + N) D b); the online softmax (the queries N D b, their operand copy where o != b, the accumulator
      N Dv f, one block of probabilities (made in place from its scores), their operand copy where o != f, one
      block's P V product N Dv f, and ``ROW_STATS`` floats a row); the merge (queries, outputs weighted in place,
      the reduce-scatter's send buffer and received rows (W + L) Dv f);
    - backward, the largest of: the blocked kernel's (d(output) N Dv f, its operand copy N Dv o and the queries'
      N D o where the operands are not the arithmetic / input dtype, d(queries) N D f and one block's product with
      the keys N D f, a block of probabilities and one of their gradient, its operand copy, the row statistics, and
      the gradients of this rank's own keys and values T_r (D + Dv) b a key head);
      the merge's (d(weighted), d(output), the weight's gradient product and the gathered d(output) wire: 4 N Dv f);
      the d(queries) reduce-scatter (N D f, rounded N D b, the send buffer and received rows (W + L) D f).
    Pinned against the fake-CUDA meter (tests/parallel/test_cp_attention_memory.py).
    """
    longest, queries = max(query_sizes), sum(query_sizes)
    wire = len(query_sizes) * longest
    row = batch * q_heads
    b, f = dtype.itemsize, compute_dtype(dtype).itemsize
    operand = planned_matmul_dtype(device_type, dtype)
    o = operand.itemsize
    copy = o / f if operand != compute_dtype(dtype) else 0.0  # a half copy of each block's probabilities
    keys = max(prefix_rows, query_sizes[rank])
    block = queries * row * min(key_block_size(queries * row, f), keys) * f
    q = queries * row * qk_dim * b
    q_copy = queries * row * qk_dim * o if operand != dtype else 0
    out = queries * row * v_dim * f
    stats = ROW_STATS * queries * row * f
    forward = max(
        (longest + wire + queries) * row * qk_dim * b,
        q + q_copy + 2 * out + (1 + copy) * block + stats,
        q + out + (wire + longest) * row * v_dim * f,
    )
    grad_out_copy = queries * row * v_dim * o if operand != compute_dtype(dtype) else 0
    own_grads = batch * kv_heads * query_sizes[rank] * (qk_dim + v_dim) * b
    kernel = out + grad_out_copy + q_copy + 2 * queries * row * qk_dim * f + (2 + copy) * block + stats + own_grads
    backward = max(kernel, 4 * out, queries * row * qk_dim * (f + b) + (wire + longest) * row * qk_dim * f)
    return BlockedPassQTransients(int(forward), int(backward))
