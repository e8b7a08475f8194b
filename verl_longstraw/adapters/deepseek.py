"""Multi-head latent attention (deepseek_v3, deepseek_v32, and glm_moe_dsa with its sparse indexer):
``mixers.LatentAttention`` on every layer."""

from __future__ import annotations

from ..errors import UnsupportedModelError
from ..mixers import LatentAttention, MixerOp
from .base import TINY_COMMON, TINY_MOE, Adapter, ModelDoc, TinyModel, register

# the tiny models: MLA attention, a dense first layer, then MoE (DeepSeek-V3 and its DSA successors)
_MLA_MOE = dict(
    num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=24,
    qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=4, first_k_dense_replace=1, n_group=1,
    topk_group=1, **TINY_MOE,
)
_DSA_INDEXER = dict(index_topk=4096, index_n_heads=2, index_head_dim=16)


@register
class MultiHeadLatentAttentionAdapter(Adapter):
    model_types = ("deepseek_v3", "deepseek_v32", "glm_moe_dsa")
    tiny = {
        "deepseek_v3": TinyModel("DeepseekV3Config", dict(**TINY_COMMON, **_MLA_MOE)),
        "glm_moe_dsa": TinyModel("GlmMoeDsaConfig", dict(**TINY_COMMON, **_MLA_MOE, **_DSA_INDEXER)),
        "deepseek_v32": TinyModel("DeepseekV32Config", dict(**TINY_COMMON, **_MLA_MOE, **_DSA_INDEXER),
                                  "a DSA indexer on every layer (split-half rope in it)"),
    }
    doc = ModelDoc(
        summary="multi-head latent attention (+ DSA)",
        family="multi-head latent attention",
        state="normalised latent + rotated rope key (+ DSA indexer keys)",
        bytes_per_token="(kv_lora_rank + rope_dim [+ index_head_dim]) x 2",
        refused="- (DSA indexer LoRA adapters get no gradient on either path)",
    )

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
