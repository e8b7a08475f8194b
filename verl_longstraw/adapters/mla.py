"""Multi-head latent attention (deepseek_v3, deepseek_v32, and glm_moe_dsa with its sparse indexer):
``mixers.LatentAttention`` on every layer."""

from __future__ import annotations

from ..mixers import LatentAttention, MixerOp
from .base import Adapter, register


@register
class MultiHeadLatentAttentionAdapter(Adapter):
    model_types = ("deepseek_v3", "deepseek_v32", "glm_moe_dsa")

    def op(self, idx: int) -> MixerOp:
        attn = self.layers[idx].self_attn
        runs_indexer = getattr(attn, "indexer", None) is not None and not getattr(attn, "skip_topk", False)
        return LatentAttention(attn, self.config, sparse=hasattr(self.config, "index_topk"),
                               runs_indexer=runs_indexer)  # v3.2: no indexer; glm5.2: shared layers skip it
