"""Hybrid Gated DeltaNet + full attention (qwen3_next, qwen3_5): ``mixers.GatedDelta`` on the linear-attention
layers, ``mixers.Attention`` (with its output gate) on the others."""

from __future__ import annotations

from ..mixers import Attention, GatedDelta, MixerOp
from .base import TINY_COMMON, TINY_MOE, Adapter, ModelDoc, TinyModel, register

# Gated DeltaNet : attention = 1 : 1 (Qwen3-Next, Qwen3.5), the tiny models' layers
_HYBRID = dict(
    num_hidden_layers=4, layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
    linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
)


@register
class HybridGatedDeltaNetAdapter(Adapter):
    model_types = ("qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")
    tiny = {
        "qwen3_next": TinyModel("Qwen3NextConfig", dict(
            **TINY_COMMON, **TINY_MOE, **_HYBRID, num_experts=4, shared_expert_intermediate_size=32,
            decoder_sparse_step=2,
        )),
        "qwen3_5": TinyModel("Qwen3_5TextConfig", dict(**TINY_COMMON, **_HYBRID)),
        "qwen3_5_moe": TinyModel("Qwen3_5MoeTextConfig", dict(
            **{k: v for k, v in TINY_COMMON.items() if k != "intermediate_size"}, **TINY_MOE, **_HYBRID,
            num_experts=4, shared_expert_intermediate_size=32,
        )),
    }
    doc = ModelDoc(
        summary="hybrid Gated DeltaNet + attention",
        family="hybrid Gated DeltaNet + attention (MoE blocks included)",
        state="linear layers: conv state + fp32 recurrent state (fixed size); attention layers: K, V",
        bytes_per_token="0 for linear layers",
        refused="LoRA on `conv1d`",
        notes={"qwen3_5": "text input", "qwen3_5_moe": "text input"},
    )
    layer_types = ("full_attention", "linear_attention")

    def op(self, idx: int) -> MixerOp:
        layer = self.layers[idx]
        if self.config.layer_types[idx] == "linear_attention":
            return GatedDelta(layer.linear_attn)
        return Attention(layer.self_attn)
