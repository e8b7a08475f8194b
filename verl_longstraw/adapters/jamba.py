"""AI21 Jamba (``jamba``): Mamba1 layers and attention layers (no positional embedding), one attention layer in every
``attn_layer_period`` at ``attn_layer_offset`` (``config.layers_block_type``); each followed by a MoE block (one in
every ``expert_layer_period`` at ``expert_layer_offset``: ``config.layers_num_experts``) or a gated MLP, every sublayer
``h + sublayer(norm(h))``.

Mixers: ``mixers.Mamba1`` (the module's torch path: its dt, B and C RMSNorms included) and ``mixers.Attention``.
"""

from __future__ import annotations

from ..feed_forward import FeedForward, Mlp, Moe
from ..mixers import Attention, Mamba1, MixerOp
from .base import TINY_COMMON, Adapter, ModelDoc, TinyModel, register


@register
class JambaAdapter(Adapter):
    model_types = ("jamba",)
    tiny = {"jamba": TinyModel("JambaConfig", dict(
        **TINY_COMMON, num_hidden_layers=4, attn_layer_period=4, attn_layer_offset=2, expert_layer_period=2,
        expert_layer_offset=1, num_experts=4, num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2,
        mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=8, use_mamba_kernels=False,
    ), "Jamba's pattern, scaled: Mamba1 layers and an attention layer (no positional embedding) at 2 of every 4, MoE "
       "(4 experts, top 2) on the odd layers and a gated MLP on the rest (so Mamba layers have both; the last is "
       "Mamba)")}
    doc = ModelDoc(
        summary="hybrid Mamba1 + attention, MoE",
        family="hybrid Mamba1 + attention (no positional embedding), MoE every other layer and gated MLPs (AI21 "
               "Jamba, 256K context)",
        state="Mamba layers: conv state + fp32 SSM state [d_inner, d_state] (fixed size); attention layers: K, V",
        bytes_per_token="0 for Mamba layers",
        refused="LoRA on `conv1d` and `dt_proj` (the model reads their weights); expert parallelism (no expert plan)",
    )
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
