"""Attention of a segment's queries over a cached prefix plus the segment itself.

Shapes: ``q`` [B, Hq, T, D]; ``k_prefix`` [B, Hk, P, D], ``v_prefix`` [B, Hk, P, Dv];
``k_self`` [B, Hk, T, D], ``v_self`` [B, Hk, T, Dv]; Hq is a multiple of Hk (grouped
queries share a key head). Every query sees the whole prefix and the segment causally.
Returns [B, Hq, T, Dv] in the dtype of ``q``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .blocked_attention import prefix_causal_attention_blocked

_MASK_CACHE: dict[tuple, torch.Tensor] = {}


def prefix_causal_mask(prefix_len: int, seg_len: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Additive float mask [T, P + T]: 0 where visible, -inf above the segment's diagonal.

    One mask is shared by every layer (CPU SDPA would otherwise copy a bool mask per layer
    and save the copy for backward).
    """
    key = (prefix_len, seg_len, dtype, device)
    mask = _MASK_CACHE.get(key)
    if mask is None:
        if len(_MASK_CACHE) > 8:
            _MASK_CACHE.clear()
        visible = torch.ones(seg_len, prefix_len + seg_len, dtype=torch.bool, device=device).tril(prefix_len)
        mask = torch.zeros(visible.shape, dtype=dtype, device=device).masked_fill(~visible, float("-inf"))
        _MASK_CACHE[key] = mask
    return mask


def prefix_causal_attention_reference(
    q: torch.Tensor,
    k_prefix: torch.Tensor,
    v_prefix: torch.Tensor,
    k_self: torch.Tensor,
    v_self: torch.Tensor,
    scale: float,
    attn_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain path: concatenate prefix and segment keys, one SDPA call with an explicit mask.

    ``attn_mask`` [T, P + T] (additive) replaces the prefix-causal mask, e.g. for sparse selection.
    """
    k = torch.cat([k_prefix, k_self], dim=-2)
    v = torch.cat([v_prefix, v_self], dim=-2)
    prefix_len, seg_len = k_prefix.shape[-2], q.shape[-2]
    if attn_mask is not None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=scale, enable_gqa=True)
    if prefix_len == 0:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    mask = prefix_causal_mask(prefix_len, seg_len, q.dtype, q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)


MASK_BYTES_LIMIT = 64 * 2**20


def prefix_causal_attention(q, k_prefix, v_prefix, k_self, v_self, scale: float) -> torch.Tensor:
    """Dispatch used by the adapters: one SDPA call while its explicit mask [T, P + T] stays small,
    else the blocked online-softmax op, which saves only inputs, output and logsumexp."""
    seg_len, total = q.shape[-2], k_prefix.shape[-2] + q.shape[-2]
    if k_prefix.shape[-2] and seg_len * total * q.element_size() > MASK_BYTES_LIMIT:
        return prefix_causal_attention_blocked(q, k_prefix, v_prefix, k_self, v_self, scale)
    return prefix_causal_attention_reference(q, k_prefix, v_prefix, k_self, v_self, scale)
