"""Hybrid Gated DeltaNet + full attention (qwen3_next, qwen3_5): ``mixers.GatedDelta`` on the linear-attention
layers, ``mixers.Attention`` (with its output gate) on the others."""

from __future__ import annotations

from ..mixers import Attention, GatedDelta, MixerOp
from .base import Adapter, register


@register
class HybridGatedDeltaNetAdapter(Adapter):
    model_types = ("qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")
    layer_types = ("full_attention", "linear_attention")

    def op(self, idx: int) -> MixerOp:
        layer = self.layers[idx]
        if self.config.layer_types[idx] == "linear_attention":
            return GatedDelta(layer.linear_attn)
        return Attention(layer.self_attn)
