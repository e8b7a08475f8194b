"""MLA's reference: K/V decompressed per head from the latent of every key, then plain prefix-causal attention. The
layer (``mixers.mla.LatentAttention.attend_latent``) computes the same in absorbed form without ever materialising
per-head K/V; tests/test_scale_paths.py compares the two through the walk."""

from __future__ import annotations

import torch

from ..attention.prefix import prefix_causal_attention_reference


def decompressed_latent_attention(q_nope: torch.Tensor, q_rope: torch.Tensor, prefix: torch.Tensor,
                                  segment: torch.Tensor, w_k: torch.Tensor, w_v: torch.Tensor, scale: float,
                                  key_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of ``q_nope`` [B, H, S, nope] and rotated ``q_rope`` [B, H, S, rope] over the latent rows of the
    batch-1 ``prefix`` [1, P, rank + rope] then of each sequence's ``segment`` [B, S, rank + rope] (normalised
    latent, then rotated rope key), causally within the segment; the keys per head ``latent @ w_k^T`` (``w_k``
    [H, nope, rank]) beside the shared rope key, the values ``latent @ w_v^T`` (``w_v`` [H, v_dim, rank]).
    ``key_mask``: None, one bool [S, P + S] for every sequence, or [B, S, P + S]. Returns [B, H, S, v_dim]; one
    sequence at a time, in the inputs' dtype."""
    rank = w_k.shape[-1]
    masks = key_mask if key_mask is not None and key_mask.dim() == 3 else [key_mask] * len(segment)
    query = torch.cat([q_nope, q_rope], dim=-1)
    outputs = []
    for b in range(len(segment)):
        state = torch.cat([prefix, segment[b : b + 1]], dim=1)  # [1, P + S, rank + rope]
        latent, k_rope = state[..., :rank], state[..., rank:]
        k_nope = torch.einsum("btr,hnr->bhtn", latent, w_k)
        v = torch.einsum("btr,hvr->bhtv", latent, w_v)
        k = torch.cat([k_nope, k_rope[:, None].expand(-1, k_nope.shape[1], -1, -1)], dim=-1)
        p = prefix.shape[1]
        outputs.append(prefix_causal_attention_reference(query[b : b + 1], k[:, :, :p], v[:, :, :p], k[:, :, p:],
                                                         v[:, :, p:], scale, key_mask=masks[b]))
    return torch.cat(outputs)
