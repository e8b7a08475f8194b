"""Attention over a sliding window of keys and/or with attention sinks (gpt-oss; sliding layers of mistral, qwen2,
qwen3, qwen3_moe), continuing the window of the tokens before a segment.

Shapes: ``q`` [B, Hq, T, D]; ``k_past`` [1 or B, Hk, P, D], ``v_past`` [1 or B, Hk, P, Dv]: the rows of the P
tokens right before the segment (a window's ``state.Window`` rows, or every earlier token for a full layer; batch
1: shared by the B sequences, never copied per sequence); ``k_self`` [B, Hk, T, D], ``v_self`` [B, Hk, T, Dv];
Hq a multiple of Hk. ``window`` W: query i sees the keys j with i - W < j <= i (W keys, its own included, as
transformers' sliding-window mask); None: every earlier key. ``sinks`` [Hq] (None: none): one learned logit per
head in the softmax denominator with no value, i.e. the attention output scaled by sigmoid(lse - sink).

The fast path, ``window_attention``: a layer over every earlier key (window None: gpt-oss's full layers) runs on the
fused flash kernels where they take its inputs (``window_attention_fused_dtype``; ``ops.attention.fused``, the sinks
one more key set of its logsumexp merge). Otherwise three disjoint key sets merged by their logsumexps
(``ops.attention.prefix.lse_weight``), the sinks a set of their own with output 0: the queries that can still see
the past (the first W - 1) over the past rows, as rows of one batch-1 query when the past is shared; and each block
of queries over the own keys of its window. Each part is ``ops.attention.prefix.partial_attention`` (dense while
small, else the blocked online-softmax op), so no mask or score matrix is larger than a query block x (block + W)
and the memory is linear in T. ``window_attention_reference`` is the plain form (one score matrix with an explicit
mask and a sink column, as the models' eager attention computes it); ``window_attention_saved_bytes`` what the fast
path saves.
"""

from __future__ import annotations

import torch

from ...dtypes import compute_dtype
from .fused import FUSED_PATHS, planned_fused_dtype, prefix_causal_attention_fused
from .prefix import ATTENTION_PATHS, lse_weight, partial_attention, partial_attention_saved_bytes

QUERY_BLOCK = 1024  # queries per own-key call of a windowed layer (at least the window)


def _visible(query_start: int, queries: int, key_start: int, keys: int, window: int | None,
             device: torch.device) -> torch.Tensor:
    """Bool [queries, keys]: query at position ``query_start + i`` may see the key at ``key_start + j`` (causal,
    within ``window``)."""
    offset = (torch.arange(query_start, query_start + queries, device=device)[:, None]
              - torch.arange(key_start, key_start + keys, device=device))
    visible = offset >= 0
    return visible & (offset < window) if window is not None else visible


def _query_block(window: int | None, length: int) -> int:
    return length if window is None else max(window, QUERY_BLOCK)


def _past_queries(window: int | None, length: int) -> int:
    """How many of a segment's first queries can see a key before it."""
    return length if window is None else min(length, window - 1)


def window_attention_fused_dtype(device_type: str, dtype: torch.dtype, q_heads: int, kv_heads: int, qk_dim: int,
                                 v_dim: int, window: int | None) -> torch.dtype | None:
    """The dtype the fused kernels run a layer of these inputs in, None where ``window_attention`` takes its
    partial-attention parts instead: a sliding window (the kernels' masks are causal only), or inputs the kernels do
    not take (``ops.attention.fused.planned_fused_dtype``, asked of the device where this process has one). The op
    and the estimate (``window_attention_saved_bytes``, the fused backward's transients) both ask this."""
    if window is not None:
        return None
    return planned_fused_dtype(device_type, dtype, q_heads, kv_heads, qk_dim, v_dim)


def window_attention(q, k_past, v_past, k_self, v_self, scale: float, window: int | None = None,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of segment ``q`` over the past rows and itself within ``window``, with ``sinks`` (module
    docstring). Returns [B, Hq, T, Dv] in q's dtype."""
    batch, heads, length, _ = q.shape
    past_len = k_past.shape[-2]
    fused = window_attention_fused_dtype(q.device.type, q.dtype, heads, k_self.shape[1], q.shape[-1],
                                         v_self.shape[-1], window)
    if fused is not None and length:
        ATTENTION_PATHS[FUSED_PATHS[q.device.type]] += 1
        return prefix_causal_attention_fused(q, k_past, v_past, k_self, v_self, scale, fused, sinks)
    parts: list[tuple[torch.Tensor, torch.Tensor]] = []  # (output [B, Hq, T, Dv], lse [B, Hq, T]) per key set
    seeing = _past_queries(window, length)
    if past_len and seeing:
        mask = None
        if window is not None:
            mask = _visible(past_len, seeing, 0, past_len, window, q.device)
        no_own = k_past[..., :0, :], v_past[..., :0, :]
        if k_past.shape[0] == 1 and batch > 1:  # the shared past: the B x seeing queries as rows of one query
            rows = q[:, :, :seeing].transpose(0, 1).reshape(1, heads, batch * seeing, -1)
            out, lse = partial_attention(rows, k_past, v_past, *no_own, scale,
                                         key_mask=None if mask is None else mask.repeat(batch, 1))
            out = out.reshape(heads, batch, seeing, -1).transpose(0, 1)
            lse = lse.reshape(heads, batch, seeing).transpose(0, 1)
        else:
            out, lse = partial_attention(q[:, :, :seeing], k_past, v_past, *no_own, scale, key_mask=mask)
        if seeing < length:  # later queries see no past row: output 0, weight 0
            out = torch.cat([out, out.new_zeros(batch, heads, length - seeing, out.shape[-1])], dim=-2)
            lse = torch.cat([lse, lse.new_full((batch, heads, length - seeing), float("-inf"))], dim=-1)
        parts.append((out, lse))
    block = _query_block(window, length)
    own = []
    for start in range(0, length, block):
        end = min(start + block, length)
        lo = start if window is None else max(0, start - window + 1)
        mask = None if window is None else _visible(start, end - start, lo, end - lo, window, q.device)
        own.append(partial_attention(q[:, :, start:end], k_self[:, :, lo:start], v_self[:, :, lo:start],
                                     k_self[:, :, start:end], v_self[:, :, start:end], scale, key_mask=mask))
    outs, own_lses = zip(*own, strict=True)
    parts.append((torch.cat(outs, dim=-2), torch.cat(own_lses, dim=-1)))
    lses = [lse for _, lse in parts]
    if sinks is not None:
        lses.append(sinks.to(lses[0].dtype)[None, :, None].expand_as(lses[0]))
    if len(lses) == 1:
        return parts[0][0].to(q.dtype)
    return sum(out * lse_weight(lse, lses) for out, lse in parts).to(q.dtype)


def window_attention_reference(q, k_past, v_past, k_self, v_self, scale: float, window: int | None = None,
                               sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Plain form of ``window_attention`` (same arguments and result): the keys concatenated, one score matrix
    with an explicit mask, the sinks a column of the softmax dropped after it, in the arithmetic dtype."""
    batch, heads, length, _ = q.shape
    dtype = compute_dtype(q.dtype)
    past = k_past.shape[-2]
    k = torch.cat([k_past.expand(batch, *k_past.shape[1:]), k_self], dim=-2).to(dtype)
    v = torch.cat([v_past.expand(batch, *v_past.shape[1:]), v_self], dim=-2).to(dtype)
    groups = heads // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = (q.to(dtype) @ k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~_visible(past, length, 0, past + length, window, q.device), float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks.to(dtype)[None, :, None, None].expand(batch, heads, length, 1)], dim=-1)
    probs = torch.softmax(scores, dim=-1)[..., : past + length]
    return (probs @ v).to(q.dtype)


def window_attention_saved_bytes(batch: int, q_heads: int, kv_heads: int, qk_dim: int, v_dim: int, queries: int,
                                 past: int, window: int | None, sinks: bool, dtype: torch.dtype,
                                 past_shared: bool, device_type: str) -> int:
    """Bytes ``window_attention`` saves for backward on a device of ``device_type`` for ``batch`` sequences of
    ``queries`` after ``past`` rows (``past_shared``: a batch-1 past serving the batch), inputs of ``dtype``, with
    ``sinks`` or not. On the fused kernels (``window_attention_fused_dtype``): the output (``dtype``) and its
    logsumexp (``compute_dtype``), the output also being the caller's next input. Otherwise each
    ``partial_attention`` call's (``ops.attention.prefix.partial_attention_saved_bytes``), and where there is more than
    one key set (the past, the own keys, the sinks) the merge's: each set's output and ``lse_weight``'s saves.
    The own keys/values are the caller's activations and the past rows the state, counted by their owners."""
    compute = compute_dtype(dtype).itemsize
    if queries and window_attention_fused_dtype(device_type, dtype, q_heads, kv_heads, qk_dim, v_dim,
                                                window) is not None:
        return batch * q_heads * queries * (v_dim * dtype.itemsize + compute)
    total, outputs = 0, 0
    seeing = _past_queries(window, queries)
    if past and seeing:
        rows_batch, rows = (1, batch * seeing) if past_shared and batch > 1 else (batch, seeing)
        total += partial_attention_saved_bytes(rows_batch, q_heads, kv_heads, qk_dim, v_dim, rows, past, dtype, 0,
                                               query_copy=rows_batch != batch)
        outputs += 1
    block = _query_block(window, queries)
    for start in range(0, queries, block):
        end = min(start + block, queries)
        lo = start if window is None else max(0, start - window + 1)
        total += partial_attention_saved_bytes(batch, q_heads, kv_heads, qk_dim, v_dim, end - start, end - lo,
                                               dtype, 0, query_copy=False)
    outputs += 1
    key_sets = outputs + sinks
    if key_sets > 1:  # per query row and output: the output, its logsumexps stacked, their logsumexp, its weight
        total += batch * q_heads * queries * outputs * (v_dim + key_sets + 2) * compute
    return total
