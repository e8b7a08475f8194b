"""gpt-oss (``gpt_oss``): alternating sliding-window (``config.sliding_window``, 128) and full attention layers, both
with learned attention sinks and biased projections, each followed by a MoE block (top-k router, SwiGLU experts with
clamped gates, as the model computes them).

Both layer kinds are ``mixers.WindowAttention`` (the sinks merged by log-sum-exp by ``ops.attention.window``): over
every earlier key on a full layer, the last W - 1 rows on a sliding one.
"""

from __future__ import annotations

import torch

from ..feed_forward import Moe
from .base import TINY_COMMON, Adapter, ModelDoc, SegmentContext, TinyModel, register
from .dense import DenseAttentionAdapter


@register
class GptOssAdapter(DenseAttentionAdapter):
    model_types = ("gpt_oss",)
    tiny = {"gpt_oss": TinyModel("GptOssConfig", dict(
        **TINY_COMMON, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        sliding_window=8, num_local_experts=4, num_experts_per_tok=2,
    ), "sliding (window 8, so prompts span several windows) and full layers, sinks, MoE")}
    doc = ModelDoc(
        summary="sliding-window + full attention with sinks",
        family="sliding-window + full attention with learned sinks (MoE blocks)",
        state="full layers: K, V; sliding layers: the last W - 1 rows of K, V (fixed size)",
        bytes_per_token="2 x kv_heads x head_dim x 2 for full layers, 0 for sliding layers",
        refused="CP (`context_parallel_size` > 1: no sharded window form)",
    )

    def context(self, h: torch.Tensor, start: int, split=None, group=None) -> SegmentContext:
        """The rotary tables in the split-half layout ``apply_rope`` reads: gpt-oss's rotary module returns one
        half [S, head_dim / 2] (its rotation pairs channel i with i + head_dim / 2, as rotate_half does)."""
        ctx = Adapter.context(self, h, start, split, group)
        ctx.cos, ctx.sin = torch.cat([ctx.cos, ctx.cos], dim=-1), torch.cat([ctx.sin, ctx.sin], dim=-1)
        return ctx

    def feed_forward(self, idx: int) -> Moe:
        """Routed experts on every layer, each counted at its gate/up width (2 x intermediate, gate and up
        interleaved)."""
        c = self.config
        return Moe(c.hidden_size, c.num_local_experts, c.num_experts_per_tok, 2 * c.intermediate_size)
