"""Bamba (``bamba``): Mamba2 layers and attention layers (partial RoPE) at ``config.attn_layer_indices``, each
followed by a gated MLP, every sublayer ``h + sublayer(norm(h))``.

Mixers: ``mixers.Mamba2`` (Bamba's gated norm gates first, then normalises the whole width: the module's own
``norm``, which the op calls) and ``mixers.Attention``.
"""

from __future__ import annotations

from ..mixers import Attention, Mamba2, MixerOp
from .base import TINY_COMMON, Adapter, ModelDoc, TinyModel, register


@register
class BambaAdapter(Adapter):
    model_types = ("bamba",)
    tiny = {"bamba": TinyModel("BambaConfig", dict(
        **TINY_COMMON, num_hidden_layers=3, attn_layer_indices=[1], num_attention_heads=4, num_key_value_heads=2,
        mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=4, mamba_chunk_size=16,
        mamba_expand=1,
    ), "Mamba2 : attention = 2 : 1, partial RoPE")}
    doc = ModelDoc(
        summary="hybrid Mamba2 + attention",
        family="hybrid Mamba2 + attention (partial RoPE), gated MLP after each",
        state="Mamba2 layers: conv state + fp32 SSM state (fixed size); attention layers: K, V",
        bytes_per_token="0 for Mamba2 layers",
        refused="LoRA on `conv1d`; the replay runs the mixer's torch path, whose gated norm spans the whole width: "
                "mamba_ssm's fused GPU kernel normalises per group, so with `mamba_n_groups` > 1 stock GPU training "
                "with that kernel computes another function",
    )
    layer_types = ("linear_attention", "full_attention")
    post_norm, mlp, final_norm = "pre_ff_layernorm", "feed_forward", "final_layernorm"

    def op(self, idx: int) -> MixerOp:
        layer = self.layers[idx]
        return Mamba2(layer.mamba) if self.config.layer_types[idx] == "linear_attention" else Attention(layer.self_attn)
