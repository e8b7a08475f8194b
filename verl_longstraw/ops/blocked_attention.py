"""Memory-lean attention of a segment's queries over a long cached prefix plus the segment itself.

Same signature and semantics as ``prefix_causal_attention_reference`` in
``verl_longstraw.ops.attention`` (the reference this op is tested against): ``q`` [B, Hq, T, D];
``k_prefix`` [B, Hk, P, D], ``v_prefix`` [B, Hk, P, Dv]; ``k_self`` [B, Hk, T, D],
``v_self`` [B, Hk, T, Dv]; Hq a multiple of Hk; every query sees the whole prefix and the
segment causally; returns [B, Hq, T, Dv] in the dtype of ``q``. An optional ``key_mask``
[T, P + T] (bool, True = may attend) restricts that further, e.g. to a sparse top-k selection;
it is the only extra tensor saved (one byte per query x key, shared by all heads).

Flash-attention-2 style in plain torch: the forward walks the keys (prefix, then segment) in
blocks with an online softmax, so the largest temporary is one block of scores
[B, Hq, T, block_size], never [B, Hq, T, P]. Only the inputs, the output and the logsumexp
[B, Hq, T] are saved; the backward recomputes each block's probabilities from the logsumexp.
Query heads of a group are folded into the row dimension ([B, Hk, G*T, D] with G = Hq // Hk),
so grouped heads share their key head without repeating K/V. Arithmetic is float32 (float64
for float64 inputs).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch


def _key_blocks(prefix_len: int, seg_len: int, block_size: int) -> Iterator[tuple[bool, int, int]]:
    """(is_segment, start, end) over the prefix keys, then the segment keys."""
    for start in range(0, prefix_len, block_size):
        yield False, start, min(start + block_size, prefix_len)
    for start in range(0, seg_len, block_size):
        yield True, start, min(start + block_size, seg_len)


def _block_scores(
    q_scaled: torch.Tensor,
    k_block: torch.Tensor,
    is_segment: bool,
    start: int,
    groups: int,
    key_mask: torch.Tensor | None,
) -> torch.Tensor:
    """Scores [B, Hk, G*T, n] of scaled queries [B, Hk, G*T, D] against keys [B, Hk, n, D].

    Segment keys at positions after a query's own position get -inf, and so do keys that
    ``key_mask`` [T, P + T] hides (``start`` is relative to the prefix or the segment).
    """
    scores = q_scaled @ k_block.transpose(-1, -2)
    seg_len, n = q_scaled.shape[-2] // groups, k_block.shape[-2]
    hidden = None
    if is_segment:
        rows = torch.arange(seg_len, device=scores.device)
        cols = torch.arange(start, start + n, device=scores.device)
        hidden = cols.unsqueeze(0) > rows.unsqueeze(1)
    if key_mask is not None:
        offset = key_mask.shape[-1] - seg_len if is_segment else 0
        unselected = ~key_mask[:, offset + start : offset + start + n]
        hidden = unselected if hidden is None else hidden | unselected
    if hidden is not None:
        scores = scores.unflatten(-2, (groups, seg_len)).masked_fill(hidden, float("-inf")).flatten(-3, -2)
    return scores


class _PrefixCausalAttentionBlocked(torch.autograd.Function):
    """Autograd function behind ``prefix_causal_attention_blocked``."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        q: torch.Tensor,
        k_prefix: torch.Tensor,
        v_prefix: torch.Tensor,
        k_self: torch.Tensor,
        v_self: torch.Tensor,
        scale: float,
        block_size: int,
        key_mask: torch.Tensor | None,
    ) -> torch.Tensor:
        batch, q_heads, seg_len, _ = q.shape
        kv_heads = k_self.shape[1]
        groups = q_heads // kv_heads
        dtype = torch.promote_types(q.dtype, torch.float32)
        q_scaled = q.to(dtype).reshape(batch, kv_heads, groups * seg_len, -1) * scale
        keys, values = {False: k_prefix, True: k_self}, {False: v_prefix, True: v_self}

        row_max = q_scaled.new_full(q_scaled.shape[:-1], float("-inf"))
        row_sum = q_scaled.new_zeros(q_scaled.shape[:-1])
        acc = q_scaled.new_zeros(*q_scaled.shape[:-1], v_self.shape[-1])
        for is_segment, start, end in _key_blocks(k_prefix.shape[-2], seg_len, block_size):
            k_block = keys[is_segment][..., start:end, :].to(dtype)
            v_block = values[is_segment][..., start:end, :].to(dtype)
            scores = _block_scores(q_scaled, k_block, is_segment, start, groups, key_mask)
            new_max = torch.maximum(row_max, scores.amax(dim=-1))
            # rows with no visible key so far (sparse masks) keep max -inf: shift by 0 instead
            shift = new_max.masked_fill(new_max == float("-inf"), 0.0)
            probs = (scores - shift.unsqueeze(-1)).exp()
            correction = (row_max - shift).exp()
            row_sum = row_sum * correction + probs.sum(dim=-1)
            acc = acc * correction.unsqueeze(-1) + probs @ v_block
            row_max = new_max

        out = (acc / row_sum.unsqueeze(-1)).reshape(batch, q_heads, seg_len, -1).to(q.dtype)
        logsumexp = row_max + row_sum.log()
        ctx.save_for_backward(q, k_prefix, v_prefix, k_self, v_self, out, logsumexp, key_mask)
        ctx.scale, ctx.block_size = scale, block_size
        return out

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k_prefix, v_prefix, k_self, v_self, out, logsumexp, key_mask = ctx.saved_tensors
        batch, q_heads, seg_len, _ = q.shape
        kv_heads = k_self.shape[1]
        groups = q_heads // kv_heads
        dtype = logsumexp.dtype
        rows = (batch, kv_heads, groups * seg_len, -1)
        q_scaled = q.to(dtype).reshape(rows) * ctx.scale
        grad_out = grad_out.to(dtype).reshape(rows)
        delta = (grad_out * out.to(dtype).reshape(rows)).sum(dim=-1, keepdim=True)
        keys, values = {False: k_prefix, True: k_self}, {False: v_prefix, True: v_self}

        grad_q_scaled = torch.zeros_like(q_scaled)
        grad_k: dict[bool, list[torch.Tensor]] = {False: [], True: []}
        grad_v: dict[bool, list[torch.Tensor]] = {False: [], True: []}
        for is_segment, start, end in _key_blocks(k_prefix.shape[-2], seg_len, ctx.block_size):
            k_block = keys[is_segment][..., start:end, :].to(dtype)
            v_block = values[is_segment][..., start:end, :].to(dtype)
            scores = _block_scores(q_scaled, k_block, is_segment, start, groups, key_mask)
            probs = (scores - logsumexp.unsqueeze(-1)).exp()
            grad_v[is_segment].append(probs.transpose(-1, -2) @ grad_out)
            grad_scores = probs * (grad_out @ v_block.transpose(-1, -2) - delta)
            grad_q_scaled = grad_q_scaled + grad_scores @ k_block
            grad_k[is_segment].append(grad_scores.transpose(-1, -2) @ q_scaled)

        def gathered(blocks: list[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
            return torch.cat(blocks, dim=-2).to(like.dtype) if blocks else torch.zeros_like(like)

        grad_q = (grad_q_scaled * ctx.scale).reshape(q.shape).to(q.dtype)
        return (
            grad_q,
            gathered(grad_k[False], k_prefix),
            gathered(grad_v[False], v_prefix),
            gathered(grad_k[True], k_self),
            gathered(grad_v[True], v_self),
            None,
            None,
            None,
        )


def prefix_causal_attention_blocked(
    q: torch.Tensor,
    k_prefix: torch.Tensor,
    v_prefix: torch.Tensor,
    k_self: torch.Tensor,
    v_self: torch.Tensor,
    scale: float,
    block_size: int = 1024,
    key_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Blocked online-softmax attention over prefix + causal segment. Returns [B, Hq, T, Dv] in q's dtype.

    Arguments as ``prefix_causal_attention_reference``; ``block_size`` keys are scored at a time;
    ``key_mask`` [T, P + T] bool (True = visible) restricts which keys each query sees. Every
    query must see at least one key.
    """
    if key_mask is not None and key_mask.shape != (q.shape[-2], k_prefix.shape[-2] + q.shape[-2]):
        raise ValueError(f"key_mask must be [T, P + T] = [{q.shape[-2]}, {k_prefix.shape[-2] + q.shape[-2]}], "
                         f"got {list(key_mask.shape)}")
    return _PrefixCausalAttentionBlocked.apply(q, k_prefix, v_prefix, k_self, v_self, scale, block_size, key_mask)
