"""Full softmax attention with grouped K/V heads (llama, mistral, qwen2, qwen3; qwen3_moe and glm4_moe, whose MoE
blocks the decoder layer runs as the model does).

State per layer: K (after norm and RoPE) and V, each [1, kv_heads, S, head_dim].
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import UnsupportedModelError
from ..state import LayerState, Rows
from .base import Adapter, Mixer, SegmentContext, apply_rope, register


def kv_kinds(attn: nn.Module) -> tuple[Rows, Rows]:
    """K and V, one token's row each [1, kv_heads, 1, head_dim]."""
    row = Rows(shape=(1, attn.k_proj.out_features // attn.head_dim, 1, attn.head_dim))
    return row, row


def attention_mixer(attn: nn.Module) -> Mixer:
    """The attention op's call shape in ``attention_mix``: query heads (o_proj's input over the head dim), key
    heads, head dims, and whether q_proj packs the output gate (twice o_proj's input wide)."""
    q_heads = attn.o_proj.in_features // attn.head_dim
    return Mixer("attention", q_heads, attn.k_proj.out_features // attn.head_dim, attn.head_dim, attn.head_dim,
                 gated_output=attn.q_proj.out_features == 2 * attn.o_proj.in_features)


def attention_mix(
    attn: nn.Module, x: torch.Tensor, ctx: SegmentContext, past: LayerState, need_output: bool = True
) -> tuple[torch.Tensor | None, LayerState]:
    """GQA attention of segment ``x`` [B, S, hidden] over past K/V [1, ...] plus itself.

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
    if not need_output:  # only the state is needed (last layer of a capture): no queries
        return None, (k, v)
    q = attn.q_proj(x)
    gated = q.shape[-1] == 2 * attn.o_proj.in_features
    if gated:
        q, gate = torch.chunk(q.view(*x.shape[:-1], -1, 2 * head_dim), 2, dim=-1)
        gate = gate.reshape(*x.shape[:-1], -1)
    q = q.reshape(shape)
    if hasattr(attn, "q_norm"):
        q = attn.q_norm(q)
    q = apply_rope(q.transpose(1, 2), ctx.cos, ctx.sin)
    out = ctx.attention(q, past[0], past[1], k, v, attn.scaling)
    out = out.transpose(1, 2).reshape(*x.shape[:-1], -1)
    if gated:
        out = out * torch.sigmoid(gate)
    return attn.o_proj(out), (k, v)


@register
class DenseAttentionAdapter(Adapter):
    model_types = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "glm4_moe")
    layer_types = ("full_attention",)

    def check_supported(self) -> None:
        if "sliding_attention" in (getattr(self.config, "layer_types", None) or []):
            raise UnsupportedModelError(
                f"{self.config.model_type}: sliding-window layers (config.layer_types) are not supported; "
                "use a config without use_sliding_window."
            )
        super().check_supported()

    def check_length(self, total: int) -> None:
        """Mistral and Qwen3-MoE apply ``config.sliding_window`` to every layer (no ``layer_types``): exact only
        while a sequence fits in the window."""
        window = getattr(self.config, "sliding_window", None)
        model_type = self.config.model_type
        if model_type in ("mistral", "qwen3_moe") and window is not None and total > window:
            raise UnsupportedModelError(
                f"{model_type}: sequence of {total} tokens exceeds sliding_window={window}; sliding-window "
                "attention is not supported. Shorten the sequence or set config.sliding_window=None."
            )

    def state_kinds(self, idx: int) -> tuple[Rows, Rows]:
        return kv_kinds(self.layers[idx].self_attn)

    def mixer(self, idx: int) -> Mixer:
        return attention_mixer(self.layers[idx].self_attn)

    def mix(self, idx, x, ctx, past, need_output):
        return attention_mix(self.layers[idx].self_attn, x, ctx, past, need_output)
