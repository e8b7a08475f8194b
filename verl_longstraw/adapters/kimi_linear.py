"""Kimi Linear (``kimi_linear``): Kimi Delta Attention layers (``mixers.Kda``) and multi-head latent attention
layers without positional embedding (NoPE, ``mixers.LatentAttention``), MLP or MoE blocks after each."""

from __future__ import annotations

from ..feed_forward import FeedForward, Mlp, Moe
from ..mixers import Kda, MixerOp
from .base import TINY_COMMON, TINY_MOE, ModelDoc, TinyModel, register
from .deepseek import MultiHeadLatentAttentionAdapter


@register
class KimiLinearAdapter(MultiHeadLatentAttentionAdapter):
    model_types = ("kimi_linear",)
    tiny = {"kimi_linear": TinyModel("KimiLinearConfig", dict(
        **TINY_COMMON, **TINY_MOE, num_hidden_layers=3,
        layer_types=["linear_attention", "full_attention", "linear_attention"],
        mlp_layer_types=["dense", "sparse", "sparse"], num_attention_heads=4, num_key_value_heads=4,
        kv_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, linear_num_heads=2,
        linear_head_dim=16, linear_conv_kernel_dim=4, num_local_experts=4, n_shared_experts=1, pad_token_id=0,
        bos_token_id=1, eos_token_id=2,
    ), "KDA : MLA (NoPE) = 2 : 1, a dense first MLP then MoE with a shared expert")}
    doc = ModelDoc(
        summary="hybrid Kimi Delta Attention + MLA",
        family="hybrid Kimi Delta Attention + MLA (NoPE)",
        state="KDA layers: conv state + fp32 recurrent state (fixed size); MLA layers: normalised latent + rope key",
        bytes_per_token="0 for KDA layers; (kv_lora_rank + rope_dim) x 2 for MLA",
        refused="LoRA on `conv1d`; tested from transformers 5.17 (5.10.4 has no `kimi_linear`)",
    )
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
