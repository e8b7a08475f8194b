"""Multi-head latent attention (deepseek_v3, deepseek_v32, and glm_moe_dsa with its sparse indexer):
``mixers.LatentAttention`` on every layer."""

from __future__ import annotations

from ..errors import UnsupportedModelError
from ..mixers import LatentAttention, MixerOp
from .base import Adapter, register


@register
class MultiHeadLatentAttentionAdapter(Adapter):
    model_types = ("deepseek_v3", "deepseek_v32", "glm_moe_dsa")

    def op(self, idx: int) -> MixerOp:
        attn = self.layers[idx].self_attn
        sparse = hasattr(self.config, "index_topk")
        source = max((j for j in range(idx + 1) if self._runs_indexer(j)), default=None)
        if sparse and source is None:
            raise UnsupportedModelError(f"layer {idx} reuses a DSA selection (indexer_types 'shared') but no layer "
                                        f"before it runs an indexer; set indexer_types[0] to 'full'")
        return LatentAttention(attn, self.config, sparse=sparse, runs_indexer=self._runs_indexer(idx),
                               selection_source=source if sparse else idx)

    def _runs_indexer(self, idx: int) -> bool:
        """Whether layer ``idx`` runs its own DSA indexer (deepseek_v32, glm_moe_dsa's "full" layers); glm_moe_dsa's
        "shared" layers reuse the last one's selection."""
        attn = self.layers[idx].self_attn
        return getattr(attn, "indexer", None) is not None and not getattr(attn, "skip_topk", False)
