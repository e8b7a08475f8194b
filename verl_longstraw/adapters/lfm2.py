"""LiquidAI LFM2 (``lfm2``): gated short-convolution layers (``mixers.ShortConv``) and GQA attention layers with
per-head q/k norms (``mixers.Attention`` under lfm2's module names), each followed by a SwiGLU MLP (``w1``, ``w3``,
``w2``).

A layer is ``h + mixer(operator_norm(h))``, then ``h + feed_forward(ffn_norm(h))``; the final norm is
``embedding_norm`` (after the layers, despite its name). ``config.layer_types`` ("conv" / "full_attention") is always
set: the config builds it from ``full_attn_idxs`` where it is not given (every layer attends where neither is); the
model builds each layer's mixer from it, and the adapter reads the mixer the layer has.
"""

from __future__ import annotations

from ..feed_forward import Mlp
from ..mixers import Attention, MixerOp, ShortConv
from .base import TINY_COMMON, Adapter, ModelDoc, TinyModel, register


class Lfm2Attention(Attention):
    """``mixers.Attention`` of an ``Lfm2Attention`` module: ``out_proj``, ``q_layernorm``, ``k_layernorm``."""

    out_proj, q_norm, k_norm = "out_proj", "q_layernorm", "k_layernorm"


@register
class Lfm2Adapter(Adapter):
    model_types = ("lfm2",)
    tiny = {"lfm2": TinyModel("Lfm2Config", dict(
        **TINY_COMMON, num_hidden_layers=3, layer_types=["conv", "full_attention", "conv"], num_attention_heads=4,
        num_key_value_heads=2, conv_L_cache=3, conv_bias=True, block_auto_adjust_ff_dim=False,
    ), "short-conv and attention (q/k norms) layers, conv biases; the MLP at intermediate_size (no 2/3 and "
       "multiple-of-256 adjustment)")}
    doc = ModelDoc(
        summary="hybrid gated short convolution + attention",
        family="hybrid gated short convolution + attention (q/k norms), SwiGLU MLP after each (LiquidAI LFM2)",
        state="conv layers: conv state, the last `conv_L_cache` - 1 conv inputs B x x (fixed size); attention "
              "layers: K, V",
        bytes_per_token="0 for conv layers",
        refused="LoRA on the short conv's depthwise `conv` (its `in_proj` / `out_proj` are fine)",
    )
    layer_types = ("conv", "full_attention")
    input_norm, post_norm, mlp, final_norm = "operator_norm", "ffn_norm", "feed_forward", "embedding_norm"

    def op(self, idx: int) -> MixerOp:
        layer = self.layers[idx]
        return Lfm2Attention(layer.self_attn) if layer.is_attention_layer else ShortConv(layer.conv)

    def feed_forward(self, idx: int) -> Mlp:
        """The MLP at its built width (``w1``'s outputs): the config's ``intermediate_size`` where
        ``block_auto_adjust_ff_dim`` is off, else 2/3 of it times ``block_ffn_dim_multiplier`` rounded up to
        ``block_multiple_of``."""
        return Mlp(self.config.hidden_size, self.layers[idx].feed_forward.w1.out_features)
