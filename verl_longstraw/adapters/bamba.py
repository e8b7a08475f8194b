"""Bamba (``bamba``): Mamba2 layers and attention layers (partial RoPE) at ``config.attn_layer_indices``, each
followed by a gated MLP, every sublayer ``h + sublayer(norm(h))``.

Mixers: ``mixers.Mamba2`` (Bamba's gated norm gates first, then normalises the whole width: the module's own
``norm``, which the op calls) and ``mixers.Attention``.
"""

from __future__ import annotations

from ..mixers import Attention, Mamba2, MixerOp
from .base import Adapter, register


@register
class BambaAdapter(Adapter):
    model_types = ("bamba",)
    layer_types = ("linear_attention", "full_attention")
    post_norm, mlp, final_norm = "pre_ff_layernorm", "feed_forward", "final_layernorm"

    def op(self, idx: int) -> MixerOp:
        layer = self.layers[idx]
        return Mamba2(layer.mamba) if self.config.layer_types[idx] == "linear_attention" else Attention(layer.self_attn)
