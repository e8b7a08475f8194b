"""Kimi Linear (``kimi_linear``): Kimi Delta Attention layers (``mixers.Kda``) and multi-head latent attention
layers without positional embedding (NoPE, ``mixers.LatentAttention``), MLP or MoE blocks after each."""

from __future__ import annotations

from ..mixers import Kda, MixerOp
from .base import register
from .mla import MultiHeadLatentAttentionAdapter


@register
class KimiLinearAdapter(MultiHeadLatentAttentionAdapter):
    model_types = ("kimi_linear",)
    layer_types = ("full_attention", "linear_attention")

    def op(self, idx: int) -> MixerOp:
        if self.config.layer_types[idx] == "linear_attention":
            return Kda(self.layers[idx].self_attn)
        return super().op(idx)

    def mlp_width(self, idx: int) -> int:
        """A dense layer's intermediate width; a sparse one's routed experts x top-k, its shared experts and its
        router's logits (``config.mlp_layer_types``)."""
        c = self.config
        if c.mlp_layer_types[idx] != "sparse":
            return c.intermediate_size
        return (c.num_experts_per_tok + c.n_shared_experts) * c.moe_intermediate_size + c.num_local_experts
