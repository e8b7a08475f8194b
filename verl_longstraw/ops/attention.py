"""Attention of a segment's queries over a cached prefix plus the segment itself.

Shapes: ``q`` [B, Hq, T, D]; ``k_prefix`` [B, Hk, P, D], ``v_prefix`` [B, Hk, P, Dv];
``k_self`` [B, Hk, T, D], ``v_self`` [B, Hk, T, Dv]; Hq is a multiple of Hk (grouped
queries share a key head). Every query sees the whole prefix and the segment causally.
Returns [B, Hq, T, Dv] in the dtype of ``q``. ``key_mask`` [T, P + T] (bool, True = may
attend) optionally restricts the keys further, e.g. DSA's sparse top-k selection.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .blocked_attention import prefix_causal_attention_blocked

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
        attn_mask = prefix_causal_mask(k_prefix.shape[-2], seg_len, q.dtype, q.device).masked_fill(~key_mask, float("-inf"))
        attn_mask = attn_mask.repeat(groups, 1) if fold else attn_mask
    if not fold:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=scale, enable_gqa=groups > 1)
    rows = q.reshape(batch, k.shape[1], groups * seg_len, q.shape[-1])
    out = F.scaled_dot_product_attention(rows, k, v, attn_mask=attn_mask, scale=scale)
    return out.reshape(batch, q_heads, seg_len, v.shape[-1])


MASK_BYTES_LIMIT = 16 * 2**20  # the explicit mask is saved for backward; beyond this the blocked op is leaner


def prefix_causal_attention(
    q, k_prefix, v_prefix, k_self, v_self, scale: float, key_mask: torch.Tensor | None = None, cache: dict | None = None
) -> torch.Tensor:
    """Dispatch used by the adapters: one SDPA call while its explicit mask [G*T, P + T] stays small
    (or, with no prefix and unfolded heads, needs no mask at all), else the blocked online-softmax
    op, which saves only inputs, output, logsumexp and ``key_mask``."""
    q_heads, k_heads = q.shape[-3], k_prefix.shape[-3]
    folded = folds_query_heads(q_heads, k_heads, q.shape[-1], v_prefix.shape[-1])
    rows, total = q.shape[-2] * (q_heads // k_heads if folded else 1), k_prefix.shape[-2] + q.shape[-2]
    needs_mask = k_prefix.shape[-2] > 0 or folded or key_mask is not None
    if needs_mask and rows * total * q.element_size() > MASK_BYTES_LIMIT:
        return prefix_causal_attention_blocked(q, k_prefix, v_prefix, k_self, v_self, scale, key_mask=key_mask)
    return prefix_causal_attention_reference(q, k_prefix, v_prefix, k_self, v_self, scale, key_mask, cache)
