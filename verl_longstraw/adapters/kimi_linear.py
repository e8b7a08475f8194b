"""Kimi Linear (``kimi_linear``): Kimi Delta Attention layers (``mixers.Kda``) and multi-head latent attention
layers without positional embedding (NoPE, ``mixers.LatentAttention``), MLP or MoE blocks after each."""

from __future__ import annotations

from ..feed_forward import FeedForward, Mlp, Moe
from ..mixers import Kda, MixerOp
from .base import register
from .deepseek import MultiHeadLatentAttentionAdapter


@register
class KimiLinearAdapter(MultiHeadLatentAttentionAdapter):
    model_types = ("kimi_linear",)
    layer_types = ("full_attention", "linear_attention")

    def op(self, idx: int) -> MixerOp:
        if self.config.layer_types[idx] == "linear_attention":
            return Kda(self.layers[idx].self_attn)
        return super().op(idx)

    def feed_forward(self, idx: int) -> FeedForward:
        """A dense MLP or, on the "sparse" layers of ``config.mlp_layer_types``, routed experts with shared experts
        of the experts' width."""
        c = self.config
        if c.mlp_layer_types[idx] != "sparse":
            return Mlp(c.hidden_size, c.intermediate_size)
        return Moe(c.hidden_size, c.num_local_experts, c.num_experts_per_tok, c.moe_intermediate_size,
                   c.n_shared_experts * c.moe_intermediate_size)
