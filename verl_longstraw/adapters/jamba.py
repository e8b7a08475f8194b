"""AI21 Jamba (``jamba``): Mamba1 layers and attention layers (no positional embedding), one attention layer in every
``attn_layer_period`` at ``attn_layer_offset`` (``config.layers_block_type``); each followed by a MoE block (one in
every ``expert_layer_period`` at ``expert_layer_offset``: ``config.layers_num_experts``) or a gated MLP, every sublayer
``h + sublayer(norm(h))``.

Mixers: ``mixers.Mamba1`` (the module's torch path: its dt, B and C RMSNorms included) and ``mixers.Attention``.
"""

from __future__ import annotations

from ..feed_forward import FeedForward, Mlp, Moe
from ..mixers import Attention, Mamba1, MixerOp
from .base import Adapter, register


@register
class JambaAdapter(Adapter):
    model_types = ("jamba",)
    layer_types = ("linear_attention", "full_attention")
    post_norm, mlp, final_norm = "pre_ff_layernorm", "feed_forward", "final_layernorm"

    def op(self, idx: int) -> MixerOp:
        layer = self.layers[idx]
        return Mamba1(layer.mamba) if self.config.layers_block_type[idx] == "mamba" else Attention(layer.self_attn)

    def feed_forward(self, idx: int) -> FeedForward:
        """A MoE block where ``layers_num_experts`` > 1 (one in every ``expert_layer_period`` at
        ``expert_layer_offset``: routed experts of ``intermediate_size``, ``num_experts_per_tok`` of them per token,
        no shared expert); else a gated MLP of ``intermediate_size``."""
        c = self.config
        if c.layers_num_experts[idx] > 1:
            return Moe(c.hidden_size, c.num_experts, c.num_experts_per_tok, c.intermediate_size)
        return Mlp(c.hidden_size, c.intermediate_size)
