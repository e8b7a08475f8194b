"""Softmax attention with grouped K/V heads (llama, mistral, qwen2, qwen3; qwen3_moe and glm4_moe, whose MoE blocks
the decoder layer runs as the model does), full or over a sliding window, optionally with attention sinks (gpt_oss).

State per layer: K (after norm and RoPE) and V. A full layer keeps every token's row (``Rows``, [1, kv_heads, S,
head_dim]); a sliding layer of window W the last W - 1 rows (``Window``), what a later token can still see.
"""

from __future__ import annotations

import torch
from torch import nn

from ..state import LayerState, Rows, Window
from .base import Adapter, Mixer, SegmentContext, apply_rope, register


def layer_window(config, idx: int) -> int | None:
    """The sliding window layer ``idx`` attends within as the model's attention applies it, None for full attention:
    ``config.sliding_window`` on the "sliding_attention" layers of ``config.layer_types`` (qwen2, qwen3, gpt_oss), and
    on every layer of a config without ``layer_types`` that sets one (mistral, qwen3_moe)."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return window if layer_types[idx] == "sliding_attention" else None
    return window


def kv_kinds(attn: nn.Module, window: int | None = None) -> tuple[Rows, Rows] | tuple[Window, Window]:
    """K and V, one token's row each [1, kv_heads, 1, head_dim]: every row, or the last ``window`` - 1."""
    row = (1, attn.k_proj.out_features // attn.head_dim, 1, attn.head_dim)
    kind = Rows(shape=row) if window is None else Window(shape=row, rows_kept=window - 1)
    return kind, kind


def attention_mixer(attn: nn.Module, window: int | None = None) -> Mixer:
    """The attention op's call shape in ``attention_mix``: query heads (o_proj's input over the head dim), key
    heads, head dims, whether q_proj packs the output gate (twice o_proj's input wide); "window_attention"
    (``ops.window_attention``) for a layer with a ``window`` or learned sinks (``attn.sinks``)."""
    q_heads = attn.o_proj.in_features // attn.head_dim
    sinks = getattr(attn, "sinks", None) is not None
    kind = "window_attention" if window is not None or sinks else "attention"
    return Mixer(kind, q_heads, attn.k_proj.out_features // attn.head_dim, attn.head_dim, attn.head_dim,
                 gated_output=attn.q_proj.out_features == 2 * attn.o_proj.in_features, window=window, sinks=sinks)


def attention_mix(
    attn: nn.Module, x: torch.Tensor, ctx: SegmentContext, past: LayerState, need_output: bool = True,
    window: int | None = None,
) -> tuple[torch.Tensor | None, LayerState]:
    """GQA attention of segment ``x`` [B, S, hidden] over past K/V [1, ...] plus itself, within ``window`` (None:
    full) and with the module's learned ``sinks`` where it has them; the state is the segment's own K/V rows, or
    for a window the window after the segment (``Window.extend``).

    Handles the optional per-head q/k RMSNorm (qwen3) and the sigmoid output gate packed
    into ``q_proj`` (qwen3_next / qwen3_5 full-attention layers).
    """
    head_dim = attn.head_dim
    shape = (*x.shape[:-1], -1, head_dim)
    k = attn.k_proj(x).view(shape)
    if hasattr(attn, "k_norm"):
        k = attn.k_norm(k)
    k = apply_rope(k.transpose(1, 2), ctx.cos, ctx.sin)
    v = attn.v_proj(x).view(shape).transpose(1, 2)
    if window is None:
        state = (k, v)
    else:
        kind = kv_kinds(attn, window)[0]
        state = (kind.extend(past[0], k), kind.extend(past[1], v))
    if not need_output:  # only the state is needed (last layer of a capture): no queries
        return None, state
    q = attn.q_proj(x)
    gated = q.shape[-1] == 2 * attn.o_proj.in_features
    if gated:
        q, gate = torch.chunk(q.view(*x.shape[:-1], -1, 2 * head_dim), 2, dim=-1)
        gate = gate.reshape(*x.shape[:-1], -1)
    q = q.reshape(shape)
    if hasattr(attn, "q_norm"):
        q = attn.q_norm(q)
    q = apply_rope(q.transpose(1, 2), ctx.cos, ctx.sin)
    sinks = getattr(attn, "sinks", None)
    if window is None and sinks is None:
        out = ctx.attention(q, past[0], past[1], k, v, attn.scaling)
    else:
        out = ctx.window_attention(q, past[0], past[1], k, v, attn.scaling, window, sinks)
    out = out.transpose(1, 2).reshape(*x.shape[:-1], -1)
    if gated:
        out = out * torch.sigmoid(gate)
    return attn.o_proj(out), state


@register
class DenseAttentionAdapter(Adapter):
    model_types = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "glm4_moe")
    layer_types = ("full_attention", "sliding_attention")

    def state_kinds(self, idx: int) -> tuple[Rows, Rows] | tuple[Window, Window]:
        return kv_kinds(self.layers[idx].self_attn, layer_window(self.config, idx))

    def mixer(self, idx: int) -> Mixer:
        return attention_mixer(self.layers[idx].self_attn, layer_window(self.config, idx))

    def mix(self, idx, x, ctx, past, need_output):
        return attention_mix(self.layers[idx].self_attn, x, ctx, past, need_output, layer_window(self.config, idx))
