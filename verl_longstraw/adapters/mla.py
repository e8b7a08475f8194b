"""Multi-head latent attention (deepseek_v3, and glm_moe_dsa with its sparse indexer).

State per layer: the normalised KV latent and the rotated rope key, stored together as
one tensor [1, S, kv_lora_rank + rope_dim] (never the decompressed per-head K/V). For
DSA layers that run their own indexer, also the indexer keys [1, S, index_head_dim]
(selection only: no gradient flows through them, as in the model).

Attention runs in absorbed form: query heads are projected into latent space through the
key half of ``kv_b_proj``, attend to the latent (one shared key/value head), and the
result leaves latent space through the value half. ``absorbed=False`` decompresses K/V
per head instead (the reference the tests compare against).
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

from ..ops.attention import prefix_causal_attention_reference
from ..parallel.dsa import keeps_every_key, sharded_dsa_topk_mask
from ..state import LayerState, Rows
from .base import Adapter, Mixer, SegmentContext, apply_rope, register
from .lora import linear_weights


def rope_is_interleaved(config, module: nn.Module) -> bool:
    """Whether ``module`` rotates interleaved pairs: ``config.rope_interleave`` where the model reads it
    (deepseek_v3), else what the installed transformers release's forward calls (glm_moe_dsa changed
    from split-half to interleaved between releases)."""
    flag = getattr(config, "rope_interleave", None)
    if isinstance(flag, bool):
        return flag
    return "apply_rotary_pos_emb_interleave" in inspect.unwrap(type(module).forward).__code__.co_names


def _indexer_keys(indexer: nn.Module, x: torch.Tensor, ctx: SegmentContext, interleaved: bool) -> torch.Tensor:
    """DSA indexer keys [B, S, index_head_dim] (rope part first) of ``x`` [B, S, hidden]."""
    k = indexer.k_norm(indexer.wk(x))
    k_rope, k_pass = torch.split(k, [indexer.qk_rope_head_dim, indexer.head_dim - indexer.qk_rope_head_dim], dim=-1)
    return torch.cat([apply_rope(k_rope, ctx.cos, ctx.sin, interleaved), k_pass], dim=-1)


def _sparse_selection(
    indexer: nn.Module, x, q_resid, past_keys, keys, ctx: SegmentContext, interleaved: bool
) -> torch.Tensor | None:
    """Bool key mask of each query's top-k keys by indexer score (DSA), causal, or None where top-k keeps every
    key: [S, P + S] in one process, [sum(query_sizes), P_r + S] on a CP rank (``parallel.dsa``), [B, S, P + S]
    for B > 1 sequences of ``x`` after one prefix (each selected alone, as one sequence would be); ``past_keys``
    [1, P(_r), index_head_dim] and ``keys`` [B, S, index_head_dim] the indexer keys of the prefix and segment.
    Whether top-k keeps every key is asked first, before the query projection and the float32 copy of the prefix
    keys (at P = 1M about 0.5 GB per layer call)."""
    if keeps_every_key(past_keys.shape[1], x.shape[1], indexer.index_topk, ctx.split):
        return None
    q = indexer.wq_b(q_resid).unflatten(-1, (indexer.n_heads, indexer.head_dim))  # [B, S, H, D]
    q_rope, q_pass = torch.split(q, [indexer.qk_rope_head_dim, indexer.head_dim - indexer.qk_rope_head_dim], dim=-1)
    q_rope = apply_rope(q_rope.transpose(1, 2), ctx.cos, ctx.sin, interleaved).transpose(1, 2)
    q = torch.cat([q_rope, q_pass], dim=-1).float()
    weights = indexer.weights_proj(x).float() * indexer.n_heads**-0.5  # [B, S, H]
    prefix = past_keys[0].float()
    masks = [
        sharded_dsa_topk_mask(q[b], weights[b], prefix, keys[b].float(), indexer.softmax_scale, indexer.index_topk,
                              ctx.split, ctx.group)
        for b in range(len(x))
    ]
    return masks[0] if len(masks) == 1 or masks[0] is None else torch.stack(masks)


@register
class MultiHeadLatentAttentionAdapter(Adapter):
    model_types = ("deepseek_v3", "deepseek_v32", "glm_moe_dsa")
    absorbed = True

    def _runs_indexer(self, idx: int) -> bool:
        attn = self.layers[idx].self_attn
        return getattr(attn, "indexer", None) is not None and not getattr(attn, "skip_topk", False)  # v3.2: none

    def mixer(self, idx: int) -> Mixer:
        """The absorbed attention's call shape: every head's latent-space query over one key head of the latent
        plus rope dims, values the latent (``mix``)."""
        attn = self.layers[idx].self_attn
        rank = attn.kv_lora_rank
        return Mixer("mla", attn.num_heads, 1, rank + attn.qk_rope_head_dim, rank)

    def state_kinds(self, idx: int) -> tuple[Rows, ...]:
        attn = self.layers[idx].self_attn
        latent = Rows(shape=(1, 1, attn.kv_lora_rank + attn.qk_rope_head_dim))
        if not self._runs_indexer(idx):
            return (latent,)
        return latent, Rows(shape=(1, 1, attn.indexer.head_dim), differentiable=False)

    def _dsa_mask(self, idx, attn, x, q_resid, ctx: SegmentContext, past: LayerState):
        """(extra indexer-key state, bool key mask or None) for a DSA layer (``_sparse_selection``)."""
        if not hasattr(self.config, "index_topk"):
            return (), None
        if not self._runs_indexer(idx):  # shared layer: reuse the previous indexer layer's selection
            return (), ctx.scratch.get("dsa_mask")
        interleaved = rope_is_interleaved(self.config, attn.indexer)
        with torch.no_grad():  # selection only: the model's indexer gets no gradient either
            keys = _indexer_keys(attn.indexer, x, ctx, interleaved)
            mask = _sparse_selection(attn.indexer, x, q_resid, past[1], keys, ctx, interleaved)
        ctx.scratch["dsa_mask"] = mask
        return (keys,), mask

    def mix(self, idx, x, ctx, past, need_output):
        attn = self.layers[idx].self_attn
        heads, nope, rope_dim, rank = attn.num_heads, attn.qk_nope_head_dim, attn.qk_rope_head_dim, attn.kv_lora_rank
        interleaved = rope_is_interleaved(self.config, attn)
        if attn.q_lora_rank is None:
            q_resid, q = None, attn.q_proj(x)
        else:
            q_resid = attn.q_a_layernorm(attn.q_a_proj(x))
            q = attn.q_b_proj(q_resid)
        q = q.unflatten(-1, (heads, attn.qk_head_dim)).transpose(1, 2)  # [B, H, S, nope + rope]
        q_nope, q_rope = torch.split(q, [nope, rope_dim], dim=-1)
        q_rope = apply_rope(q_rope, ctx.cos, ctx.sin, interleaved)
        latent, k_rope = torch.split(attn.kv_a_proj_with_mqa(x), [rank, rope_dim], dim=-1)
        k_rope = apply_rope(k_rope, ctx.cos, ctx.sin, interleaved)
        segment = torch.cat([attn.kv_a_layernorm(latent), k_rope], dim=-1)  # [B, S, rank + rope]
        extra_state, mask = self._dsa_mask(idx, attn, x, q_resid, ctx, past)
        if not need_output:
            return None, (segment, *extra_state)

        w_kv = linear_weights(attn.kv_b_proj)[0].view(heads, nope + attn.v_head_dim, rank)  # LoRA's delta too
        w_k, w_v = w_kv[:, :nope], w_kv[:, nope:]
        if self.absorbed:
            query = torch.cat([torch.einsum("bhsn,hnr->bhsr", q_nope, w_k), q_rope], dim=-1)
            prefix, own = past[0][:, None], segment[:, None]  # one shared key head: [1, 1, P, .], [B, 1, S, .]
            out = ctx.attention(query, prefix, prefix[..., :rank], own, own[..., :rank], attn.scaling, key_mask=mask)
            out = torch.einsum("bhsr,hvr->bhsv", out, w_v)
        else:  # the reference, one sequence at a time
            masks = mask if mask is not None and mask.dim() == 3 else [mask] * len(x)
            out = torch.cat([
                self._decompressed_attention(attn, q_nope[b : b + 1], q_rope[b : b + 1],
                                             torch.cat([past[0], segment[b : b + 1]], dim=1), masks[b], w_k, w_v)
                for b in range(len(x))
            ])
        out = out.transpose(1, 2).reshape(*x.shape[:-1], -1)
        return attn.o_proj(out), (segment, *extra_state)

    @staticmethod
    def _decompressed_attention(attn, q_nope, q_rope, state, mask, w_k, w_v) -> torch.Tensor:
        """Reference: per-head K/V decompressed from the latent of every key [1, P + S, rank + rope]."""
        latent, k_rope = state[..., : attn.kv_lora_rank], state[..., attn.kv_lora_rank :]
        k_nope = torch.einsum("btr,hnr->bhtn", latent, w_k)
        v = torch.einsum("btr,hvr->bhtv", latent, w_v)
        k = torch.cat([k_nope, k_rope[:, None].expand(-1, k_nope.shape[1], -1, -1)], dim=-1)
        query = torch.cat([q_nope, q_rope], dim=-1)
        prefix_len = k.shape[2] - query.shape[2]
        return prefix_causal_attention_reference(
            query, k[:, :, :prefix_len], v[:, :, :prefix_len], k[:, :, prefix_len:], v[:, :, prefix_len:],
            attn.scaling, key_mask=mask,
        )
