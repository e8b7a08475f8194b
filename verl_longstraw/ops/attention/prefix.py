"""Attention of a segment's queries over a cached prefix plus the segment itself.

Shapes: ``q`` [B, Hq, T, D]; ``k_prefix`` [B, Hk, P, D], ``v_prefix`` [B, Hk, P, Dv] (or batch 1: one prefix
shared by the B sequences, never copied per sequence);
``k_self`` [B, Hk, T, D], ``v_self`` [B, Hk, T, Dv]; Hq is a multiple of Hk (grouped
queries share a key head). Every query sees the whole prefix and the segment causally.
Returns [B, Hq, T, Dv] in the dtype of ``q``. ``key_mask`` [T, P + T] (bool, True = may
attend) optionally restricts the keys further, e.g. DSA's sparse top-k selection.

``partial_attention`` is the general form the context-parallel op builds on: N query rows over
the prefix and the own keys an ``OwnKeyRule`` lets them see, returning the output and its
logsumexp (shapes in ``verl_longstraw.ops.attention.blocked``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F

from ...dtypes import compute_dtype
from .blocked import (
    OWN_SEGMENT,
    OwnKeyRule,
    check_key_mask,
    matmul_dtype,
    partial_attention_blocked,
    prefix_causal_attention_blocked,
)
from .fused import FUSED_PATHS, fused_dtype, prefix_causal_attention_fused


def prefix_causal_mask(
    prefix_len: int, seg_len: int, dtype: torch.dtype, device: torch.device, groups: int = 1, cache: dict | None = None
) -> torch.Tensor:
    """Additive float mask [groups * T, P + T]: 0 where visible, -inf above the segment's diagonal
    (the [T, P + T] pattern repeated ``groups`` times along rows, for folded query heads).

    Pass one segment's ``cache`` (a dict living as long as the segment) so every layer
    shares one mask (CPU SDPA would otherwise copy a bool mask per layer and save the copy
    for backward) and the mask is freed with the segment.
    """
    key = ("prefix_causal_mask", prefix_len, seg_len, dtype, device, groups)
    mask = cache.get(key) if cache is not None else None
    if mask is None:
        visible = torch.ones(seg_len, prefix_len + seg_len, dtype=torch.bool, device=device).tril(prefix_len)
        mask = torch.zeros(visible.shape, dtype=dtype, device=device).masked_fill(~visible, float("-inf"))
        mask = mask.repeat(groups, 1) if groups > 1 else mask
        if cache is not None:
            cache[key] = mask
    return mask


def folds_query_heads(q_heads: int, k_heads: int, qk_dim: int, v_dim: int) -> bool:
    """Whether the reference folds grouped query heads into rows: SDPA's fused CPU kernel shares
    key heads itself (``enable_gqa``) only when value and key dims match and there are several
    key heads; otherwise a backend would repeat K/V per query head."""
    return q_heads > k_heads and (v_dim != qk_dim or k_heads == 1)


def prefix_causal_attention_reference(
    q: torch.Tensor,
    k_prefix: torch.Tensor,
    v_prefix: torch.Tensor,
    k_self: torch.Tensor,
    v_self: torch.Tensor,
    scale: float,
    key_mask: torch.Tensor | None = None,
    cache: dict | None = None,
) -> torch.Tensor:
    """Plain path: concatenate prefix and segment keys, one SDPA call with an explicit mask.

    Where SDPA's fused CPU kernel cannot share key heads (value dim != key dim, as in MLA, or a
    single key head) the G = Hq // Hk query heads of a group are folded into rows
    ([B, Hk, G*T, D], mask tiled G times), so no backend repeats K/V per query head.
    """
    k = torch.cat([k_prefix, k_self], dim=-2)
    v = torch.cat([v_prefix, v_self], dim=-2)
    batch, q_heads, seg_len, _ = q.shape
    groups = q_heads // k.shape[1]
    fold = folds_query_heads(q_heads, k.shape[1], q.shape[-1], v.shape[-1])
    if key_mask is None:
        if k_prefix.shape[-2] == 0 and not fold:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=groups > 1)
        attn_mask = prefix_causal_mask(k_prefix.shape[-2], seg_len, q.dtype, q.device, groups if fold else 1, cache)
    else:
        attn_mask = prefix_causal_mask(k_prefix.shape[-2], seg_len, q.dtype, q.device)
        attn_mask = attn_mask.masked_fill(~key_mask, float("-inf"))
        attn_mask = attn_mask.repeat(groups, 1) if fold else attn_mask
    if not fold:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=scale, enable_gqa=groups > 1)
    rows = q.reshape(batch, k.shape[1], groups * seg_len, q.shape[-1])
    out = F.scaled_dot_product_attention(rows, k, v, attn_mask=attn_mask, scale=scale)
    return out.reshape(batch, q_heads, seg_len, v.shape[-1])


def lse_weight(logsumexp: torch.Tensor, logsumexps: Sequence[torch.Tensor]) -> torch.Tensor:
    """Weight [..., N, 1] of a partial attention output with ``logsumexp`` [..., N] (over one of several disjoint key
    sets) in their merge: exp(l - L), L the logsumexp over the sets' ``logsumexps`` (``logsumexp`` among them). The
    weighted partial outputs sum to the attention over the union of the sets; a row that sees no key of a set
    (l = -inf) gets weight 0 there."""
    return (logsumexp - torch.logsumexp(torch.stack(list(logsumexps)), dim=0)).exp().unsqueeze(-1)


def shared_prefix_attention(
    q: torch.Tensor,
    k_prefix: torch.Tensor,
    v_prefix: torch.Tensor,
    k_self: torch.Tensor,
    v_self: torch.Tensor,
    scale: float,
    key_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """``prefix_causal_attention`` of B sequences that follow one shared prefix, which is never copied per sequence.

    ``q`` [B, Hq, T, D], ``k_self`` [B, Hk, T, D], ``v_self`` [B, Hk, T, Dv]: the sequences (right-padded: a
    padded position is seen by later positions only); ``k_prefix`` [1, Hk, P, D], ``v_prefix`` [1, Hk, P, Dv]: the
    prefix, broadcast; ``key_mask`` bool [B, T, P + T] or None restricts each query's keys further (DSA).
    Returns [B, Hq, T, Dv] in q's dtype. Two partial attentions (``partial_attention``) merged
    by their logsumexps: the B*T queries as rows of one batch-1 query [1, Hq, B*T, D] over the prefix keys (all
    visible), and each sequence's queries causally over its own keys (batch B; one sequence at a time under a
    ``key_mask``, whose own-key part differs per sequence).
    """
    batch, heads, length, _ = q.shape
    prefix_len = k_prefix.shape[-2]
    rows = q.transpose(0, 1).reshape(1, heads, batch * length, -1)
    prefix_mask = None if key_mask is None else key_mask[..., :prefix_len].reshape(batch * length, prefix_len)
    out_prefix, lse_prefix = partial_attention(
        rows, k_prefix, v_prefix, k_prefix[..., :0, :], v_prefix[..., :0, :], scale, key_mask=prefix_mask
    )
    out_prefix = out_prefix.reshape(heads, batch, length, -1).transpose(0, 1)
    lse_prefix = lse_prefix.reshape(heads, batch, length).transpose(0, 1)
    if key_mask is None:
        out_own, lse_own = partial_attention(q, k_self[..., :0, :], v_self[..., :0, :], k_self, v_self, scale)
    else:
        parts = [
            partial_attention(q[b : b + 1], k_self[b : b + 1, :, :0], v_self[b : b + 1, :, :0], k_self[b : b + 1],
                              v_self[b : b + 1], scale, key_mask=key_mask[b, :, prefix_len:])
            for b in range(batch)
        ]
        out_own, lse_own = (torch.cat(t) for t in zip(*parts, strict=True))
    lses = (lse_prefix, lse_own)
    return (out_prefix * lse_weight(lse_prefix, lses) + out_own * lse_weight(lse_own, lses)).to(q.dtype)


MASK_BYTES_LIMIT = 16 * 2**20  # the explicit mask is saved for backward; beyond this the blocked op is leaner
SHARED_MERGE_FLOATS = 8  # per query row: shared_prefix_attention's merge weights, logsumexps and their exps


ATTENTION_PATHS: Counter[str] = Counter()  # calls of prefix_causal_attention per path it took (gpu_check, logs)


def blocked_path_name(q: torch.Tensor) -> str:
    """How ``ATTENTION_PATHS`` names the blocked op for queries like ``q``: ``blocked``, or ``blocked_half_matmul``
    where its matmuls take half operands (``ops.attention.blocked.matmul_dtype``: fp16/bf16 on CUDA)."""
    return "blocked" if matmul_dtype(q) == compute_dtype(q.dtype) else "blocked_half_matmul"


class AttentionCall(NamedTuple):
    """One ``prefix_causal_attention`` call by shape, all its dispatch reads: ``batch`` sequences of ``queries``
    tokens with ``q_heads`` query heads of dim ``qk_dim``, after ``prefix`` rows of ``kv_heads`` key heads
    (values of dim ``v_dim``); ``shared_prefix``: the prefix tensors have batch 1 and serve all ``batch``
    sequences; ``key_mask``: a key mask is given; inputs of ``dtype``; ``fused``: the dtype the fused kernels
    compute these inputs in (``ops.attention.fused.fused_kernel_dtype``), None where they do not take them."""

    batch: int
    q_heads: int
    kv_heads: int
    qk_dim: int
    v_dim: int
    queries: int
    prefix: int
    shared_prefix: bool
    key_mask: bool
    dtype: torch.dtype
    fused: torch.dtype | None

    @classmethod
    def of(cls, q, k_prefix, v_prefix, k_self, v_self, key_mask: torch.Tensor | None) -> AttentionCall:
        """The call of these tensors (shapes in the module docstring). An empty prefix is never shared."""
        batch, q_heads, queries, qk_dim = q.shape
        prefix = k_prefix.shape[-2]
        return cls(batch, q_heads, k_self.shape[1], qk_dim, v_self.shape[-1], queries, prefix,
                   prefix > 0 and k_prefix.shape[0] != batch, key_mask is not None, q.dtype,
                   fused_dtype(q, k_prefix, v_prefix, k_self, v_self))

    @property
    def folded(self) -> bool:
        """Whether the reference folds grouped query heads into rows (``folds_query_heads``)."""
        return folds_query_heads(self.q_heads, self.kv_heads, self.qk_dim, self.v_dim)

    @property
    def mask_rows(self) -> int:
        """Rows of the explicit mask: the queries, times the query heads of a key head where they are folded."""
        return self.queries * (self.q_heads // self.kv_heads if self.folded else 1)


def attention_path(call: AttentionCall) -> str:
    """The path ``prefix_causal_attention`` takes for ``call``: ``sdpa_is_causal``, ``fused``,
    ``shared_prefix_partial``, ``sdpa_mask`` or ``blocked`` (its docstring says when). The dispatch and the memory
    estimate (``attention_saved_bytes``) both ask this function."""
    if not call.key_mask and call.prefix == 0 and not call.folded:
        return "sdpa_is_causal"
    if not call.key_mask and call.fused is not None:
        return "fused"
    if call.shared_prefix:
        return "shared_prefix_partial"
    if call.mask_rows * (call.prefix + call.queries) * call.dtype.itemsize <= MASK_BYTES_LIMIT:
        return "sdpa_mask"
    return "blocked"


class AttentionSaves(NamedTuple):
    """Bytes one ``prefix_causal_attention`` call keeps for backward besides its query and output activations (the
    estimate's per-token coefficients count those): ``own`` this call's; ``shared`` one tensor that every call of
    a forward with the same sizes shares through ``cache`` (the additive mask), to be counted once per size."""

    own: int
    shared: int


def attention_saved_bytes(call: AttentionCall, prefix_buffer_bytes: int, own_kv_bytes: int) -> AttentionSaves:
    """What the path ``attention_path(call)`` saves for backward. ``prefix_buffer_bytes``: the state buffer whose
    views the prefix keys/values are (a saved view keeps all of it); ``own_kv_bytes``: the sequences' own
    keys/values as the caller holds them (MLA: one latent row per token, the values its view).

    - ``fused`` / ``blocked``: their inputs, i.e. the prefix buffer and the own keys/values;
    - ``sdpa_is_causal`` / ``sdpa_mask``: the concatenated keys and values [B, Hk, P + T, D + Dv]; ``sdpa_mask``
      also the additive mask [rows, P + T] (``shared``), or where value dim != key dim (SDPA's math backend)
      the probabilities [B, Hq, T, P + T], float32 for half inputs, instead;
    - ``shared_prefix_partial``: what ``partial_attention_saved_bytes`` gives for its two partial attentions (the
      first over a copy of the queries laid out as rows, the second over the caller's queries) and their
      logsumexp merge (``SHARED_MERGE_FLOATS`` per query row); its merged output is not saved by the op.
    Besides these, the op saves its output and float32 logsumexp [B, Hq, T] (neither on ``shared_prefix_partial``).
    Exact (``tests/ops/test_attention_paths.py``) apart from the dense partial op's and SDPA's math backend's
    intermediates (``shared_prefix_partial`` with dense partials, ``sdpa_mask`` with value dim != key dim).
    """
    path = attention_path(call)
    if path in ("fused", "blocked"):
        return AttentionSaves(prefix_buffer_bytes + own_kv_bytes, 0)
    if path == "shared_prefix_partial":
        rows = call.batch * call.queries
        over_prefix = partial_attention_saved_bytes(1, call.q_heads, call.kv_heads, call.qk_dim, call.v_dim, rows,
                                                    call.prefix, call.dtype, prefix_buffer_bytes, query_copy=True)
        over_own = partial_attention_saved_bytes(call.batch, call.q_heads, call.kv_heads, call.qk_dim, call.v_dim,
                                                 call.queries, call.queries, call.dtype, own_kv_bytes,
                                                 query_copy=False)
        merge = SHARED_MERGE_FLOATS * call.q_heads * rows * compute_dtype(call.dtype).itemsize
        return AttentionSaves(over_prefix + over_own + merge, 0)
    keys = call.prefix + call.queries
    own = call.batch * call.kv_heads * keys * (call.qk_dim + call.v_dim) * call.dtype.itemsize
    if path == "sdpa_is_causal":
        return AttentionSaves(own, 0)
    if call.v_dim != call.qk_dim:
        probabilities = call.batch * call.q_heads * call.queries * keys * max(call.dtype.itemsize, 4)
        return AttentionSaves(own + probabilities, 0)
    return AttentionSaves(own, call.mask_rows * keys * call.dtype.itemsize)


def prefix_causal_attention(
    q, k_prefix, v_prefix, k_self, v_self, scale: float, key_mask: torch.Tensor | None = None, cache: dict | None = None
) -> torch.Tensor:
    """Dispatch used by the adapters (``attention_path``); counts the path it takes in ``ATTENTION_PATHS``.

    - ``sdpa_is_causal``: no prefix, no key mask, unfolded heads: one SDPA call without a mask;
    - ``fused_flash_cpu`` / ``fused_flash_cuda``: otherwise without a key mask where the fused kernels take
      the inputs (``fused_dtype``: value dim == key dim, ...): two flash-attention calls merged by logsumexp;
      it also takes a prefix of batch 1 shared by B > 1 sequences of ``q``;
    - ``shared_prefix_partial``: else, for such a shared prefix (``key_mask`` [B, T, P + T]),
      ``shared_prefix_attention``;
    - ``sdpa_mask``: else one SDPA call while its explicit mask [G*T, P + T] stays within ``MASK_BYTES_LIMIT``;
    - ``blocked`` (``blocked_path_name``): else the blocked online-softmax op, which saves only inputs, output,
      logsumexp and ``key_mask``.
    """
    call = AttentionCall.of(q, k_prefix, v_prefix, k_self, v_self, key_mask)
    if q.shape[0] != k_prefix.shape[0] and not call.shared_prefix:  # nothing to share: an empty prefix is free
        k_prefix, v_prefix = (x.expand(q.shape[0], *x.shape[1:]) for x in (k_prefix, v_prefix))
    path = attention_path(call)
    if path == "fused":
        ATTENTION_PATHS[FUSED_PATHS[q.device.type]] += 1
        return prefix_causal_attention_fused(q, k_prefix, v_prefix, k_self, v_self, scale, call.fused)
    if path == "shared_prefix_partial":
        ATTENTION_PATHS[path] += 1
        return shared_prefix_attention(q, k_prefix, v_prefix, k_self, v_self, scale, key_mask)
    if path == "blocked":
        ATTENTION_PATHS[blocked_path_name(q)] += 1
        block = key_block_size(q.shape[:-1].numel(), compute_dtype(q.dtype).itemsize)
        return prefix_causal_attention_blocked(
            q, k_prefix, v_prefix, k_self, v_self, scale, key_mask=key_mask, block_size=block
        )
    ATTENTION_PATHS[path] += 1
    return prefix_causal_attention_reference(q, k_prefix, v_prefix, k_self, v_self, scale, key_mask, cache)


def partial_attention_reference(
    q: torch.Tensor,
    k_prefix: torch.Tensor,
    v_prefix: torch.Tensor,
    k_self: torch.Tensor,
    v_self: torch.Tensor,
    scale: float,
    own_keys: OwnKeyRule = OWN_SEGMENT,
    key_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain dense path of ``partial_attention_blocked`` (same arguments and results): the whole score
    matrix [B, Hk, G, N, P + T] at once, differentiated by autograd.

    Grouped query heads are folded into rows of their key head (no K/V repeat). Autocast is off inside: forward
    and backward run in the arithmetic dtype (float32 for half inputs). Rows that see no key get a finite
    stand-in for their logsumexp so that no NaN reaches autograd; their probabilities are exp(-inf) = 0, output 0,
    and the returned logsumexp is -inf.
    """
    with torch.autocast(q.device.type, enabled=False):  # the arithmetic dtype throughout, as the blocked op
        return _partial_attention_dense(q, k_prefix, v_prefix, k_self, v_self, scale, own_keys, key_mask)


def _partial_attention_dense(q, k_prefix, v_prefix, k_self, v_self, scale, own_keys, key_mask):
    batch, q_heads, rows, _ = q.shape
    kv_heads, prefix_len, own_len = k_self.shape[1], k_prefix.shape[-2], k_self.shape[-2]
    check_key_mask(key_mask, rows, prefix_len + own_len)
    dtype = compute_dtype(q.dtype)
    keys = torch.cat([k_prefix, k_self], dim=-2).to(dtype)
    values = torch.cat([v_prefix, v_self], dim=-2).to(dtype)
    own_visible = ~own_keys.hidden(rows, own_len, 0, own_len, q.device)
    visible = torch.cat([own_visible.new_ones(rows, prefix_len), own_visible], dim=-1)
    visible = visible & key_mask if key_mask is not None else visible
    q_rows = q.to(dtype).reshape(batch, kv_heads, q_heads // kv_heads * rows, -1) * scale
    scores = (q_rows @ keys.transpose(-1, -2)).unflatten(-2, (q_heads // kv_heads, rows))
    scores = scores.masked_fill(~visible, float("-inf"))
    sees_none = ~visible.any(dim=-1, keepdim=True)  # [N, 1]
    logsumexp = torch.logsumexp(scores.masked_fill(sees_none, 0.0), dim=-1, keepdim=True)
    out = (scores - logsumexp).exp().flatten(-3, -2) @ values
    logsumexp = logsumexp.masked_fill(sees_none, float("-inf"))
    return out.reshape(batch, q_heads, rows, -1), logsumexp.reshape(batch, q_heads, rows)


SCORES_BYTES_LIMIT = 16 * 2**20  # the dense partial path saves a few score-sized tensors; beyond this, blocked
PARTIAL_BLOCK_SIZE = 1024
SCORE_BLOCK_BYTES = 256 * 2**20  # the blocked op's scores and probabilities of one key block, at most
MIN_KEY_BLOCK = 16


def key_block_size(query_rows: int, itemsize: int) -> int:
    """Keys the blocked op scores at a time for ``query_rows`` rows (batch x query heads x queries) in an
    arithmetic dtype of ``itemsize`` bytes: ``PARTIAL_BLOCK_SIZE``, or fewer so that the block's scores and
    probabilities [query_rows, block] stay within ``SCORE_BLOCK_BYTES`` (e.g. 24 heads x a 131072-token
    chunk: 21 keys, 2 x 252 MiB, where 1024 keys would take 24 GiB), but never below ``MIN_KEY_BLOCK``."""
    return max(MIN_KEY_BLOCK, min(PARTIAL_BLOCK_SIZE, SCORE_BLOCK_BYTES // (2 * query_rows * itemsize)))


def partial_attention(
    q: torch.Tensor,
    k_prefix: torch.Tensor,
    v_prefix: torch.Tensor,
    k_self: torch.Tensor,
    v_self: torch.Tensor,
    scale: float,
    own_keys: OwnKeyRule = OWN_SEGMENT,
    key_mask: torch.Tensor | None = None,
    block_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(output [B, Hq, N, Dv], logsumexp [B, Hq, N]) in the arithmetic dtype, as ``partial_attention_blocked``.

    ``block_size`` None: the dense reference while its scores [B, Hq, N, P + T] fit in
    ``SCORES_BYTES_LIMIT``, else the blocked op with ``key_block_size`` keys per block; an
    int: the blocked op with that many keys per block.
    """
    if block_size is None:
        if partial_attention_is_dense(q.shape[:-1].numel(), k_prefix.shape[-2] + k_self.shape[-2], q.dtype):
            return partial_attention_reference(q, k_prefix, v_prefix, k_self, v_self, scale, own_keys, key_mask)
        block_size = key_block_size(q.shape[:-1].numel(), compute_dtype(q.dtype).itemsize)
    return partial_attention_blocked(q, k_prefix, v_prefix, k_self, v_self, scale, own_keys, key_mask, block_size)


def partial_attention_is_dense(query_rows: int, keys: int, dtype: torch.dtype) -> bool:
    """Whether ``partial_attention`` (``block_size`` None) takes the dense reference for ``query_rows`` rows
    (batch x query heads x queries) over ``keys`` keys of inputs of ``dtype``: while its scores fit in
    ``SCORES_BYTES_LIMIT``."""
    return query_rows * keys * compute_dtype(dtype).itemsize <= SCORES_BYTES_LIMIT


def partial_attention_saved_bytes(
    batch: int, q_heads: int, kv_heads: int, qk_dim: int, v_dim: int, queries: int, keys: int, dtype: torch.dtype,
    key_buffer_bytes: int, query_copy: bool,
) -> int:
    """Bytes ``partial_attention`` (``block_size`` None) saves for ``batch`` x ``q_heads`` x ``queries`` query rows
    over ``keys`` keys of ``kv_heads`` heads (``batch`` such sets) for inputs of ``dtype``: the dense op's two
    score-sized tensors, its keys/values, scaled queries and logsumexp in the arithmetic dtype and its visibility
    masks (bool [queries, keys] and [queries], shared by the batch and heads); the blocked op's output and
    logsumexp in it, its queries where they are a copy made for the call (``query_copy``; else the caller's
    activation, not counted here), and the key/value inputs, i.e. the buffer their views keep alive
    (``key_buffer_bytes``)."""
    rows = batch * q_heads * queries
    compute = compute_dtype(dtype).itemsize
    if partial_attention_is_dense(rows, keys, dtype):
        floats = 2 * rows * keys + batch * kv_heads * keys * (qk_dim + v_dim) + rows * (qk_dim + 1)
        return floats * compute + queries * (keys + 1)
    return rows * (v_dim + 1 + (qk_dim if query_copy else 0)) * compute + key_buffer_bytes
