"""Softmax attention with grouped K/V heads (llama, mistral, qwen2, qwen3; qwen3_moe and glm4_moe, whose MoE blocks
the decoder layer runs as the model does), full or over a sliding window (``mixers.attention``).
"""

from __future__ import annotations

from torch import nn

from ..mixers import Attention, WindowAttention
from .base import Adapter, register


def layer_window(config, idx: int) -> int | None:
    """The sliding window layer ``idx`` attends within as the model's attention applies it, None for full attention:
    ``config.sliding_window`` on the "sliding_attention" layers of ``config.layer_types`` (qwen2, qwen3, gpt_oss), and
    on every layer of a config without ``layer_types`` that sets one (mistral, qwen3_moe)."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return window if layer_types[idx] == "sliding_attention" else None
    return window


def attention_op(attn: nn.Module, window: int | None = None) -> Attention:
    """``WindowAttention`` for a layer with a ``window`` or learned sinks (``attn.sinks``), else ``Attention``."""
    if window is not None or getattr(attn, "sinks", None) is not None:
        return WindowAttention(attn, window)
    return Attention(attn)


@register
class DenseAttentionAdapter(Adapter):
    model_types = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "glm4_moe")
    layer_types = ("full_attention", "sliding_attention")

    def op(self, idx: int) -> Attention:
        return attention_op(self.layers[idx].self_attn, layer_window(self.config, idx))
