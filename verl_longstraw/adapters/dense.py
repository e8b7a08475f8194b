"""Softmax attention with grouped K/V heads (llama, mistral, qwen2, qwen3; qwen3_moe and glm4_moe, whose MoE blocks
the decoder layer runs as the model does), full or over a sliding window (``mixers.attention``).
"""

from __future__ import annotations

from torch import nn

from ..mixers import Attention, WindowAttention
from .base import TINY_COMMON, TINY_MOE, Adapter, ModelDoc, TinyModel, register

_GQA = dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


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
    tiny = {
        "qwen3": TinyModel("Qwen3Config", dict(**TINY_COMMON, **_GQA, head_dim=16)),
        "llama": TinyModel("LlamaConfig", dict(**TINY_COMMON, **_GQA)),
        "qwen2": TinyModel("Qwen2Config", dict(**TINY_COMMON, **_GQA)),
        "mistral": TinyModel("MistralConfig", dict(**TINY_COMMON, **_GQA, sliding_window=None),
                             "Mistral-Nemo/Small-3 (full layers)"),
        "qwen3_moe": TinyModel("Qwen3MoeConfig", dict(
            **TINY_COMMON, **TINY_MOE, **_GQA, head_dim=16, num_experts=4, decoder_sparse_step=2, norm_topk_prob=True,
        ), "every other layer sparse (decoder_sparse_step 2): a dense and a MoE layer"),
        "glm4_moe": TinyModel("Glm4MoeConfig", dict(
            **TINY_COMMON, **TINY_MOE, **_GQA, head_dim=16, n_routed_experts=4, n_shared_experts=1,
            first_k_dense_replace=1, use_qk_norm=True, attention_bias=True,
        ), "a dense first layer, then MoE with a shared expert; partial rotary, q/k norm, biases"),
    }
    doc = ModelDoc(
        summary="dense GQA attention (dense MLP, or the model's MoE blocks)",
        family="dense GQA attention (dense MLP, or the model's MoE blocks)",
        state="K (after norm + RoPE), V",
        bytes_per_token="2 x kv_heads x head_dim x 2",
        refused="sliding-window layers under CP (`context_parallel_size` > 1)",
    )
    layer_types = ("full_attention", "sliding_attention")

    def op(self, idx: int) -> Attention:
        return attention_op(self.layers[idx].self_attn, layer_window(self.config, idx))
