"""Granite 4.0 hybrids (``granitemoehybrid``): Mamba2 and attention layers, each followed by a MoE block with a
shared MLP (or the shared MLP alone when ``num_local_experts`` is 0), with Granite's muP multipliers.

The Mamba2 mixer is Nemotron-H's (``mixers.Mamba2``: the same transformers ops and ``mamba2_chunk_scan``), the
attention the dense GQA op (``mixers.Attention``) with ``attention_multiplier`` as its scale and RoPE only where
``position_embedding_type`` is "rope". The multipliers are applied where the model applies them: the embeddings
times ``embedding_multiplier``, each sublayer's output times ``residual_multiplier`` before the residual add, the
logits divided by ``logits_scaling`` (here: the final norm's output, what the bias-free LM head reads).
"""

from __future__ import annotations

import torch

from ..errors import UnsupportedModelError
from ..feed_forward import ExpertPlan, FeedForward, Mlp, Moe, register_expert_plan
from ..mixers import Attention, Mamba2, MixerOp
from .base import TINY_COMMON, Adapter, ModelDoc, TinyModel, register

_MAMBA = "linear_attention"


@register
class GraniteMoeHybridAdapter(Adapter):
    model_types = ("granitemoehybrid",)
    tiny = {"granitemoehybrid": TinyModel("GraniteMoeHybridConfig", dict(
        **TINY_COMMON, num_hidden_layers=3, layer_types=["linear_attention", "full_attention", "linear_attention"],
        num_attention_heads=4, num_key_value_heads=2, mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=2,
        mamba_d_state=16, mamba_d_conv=4, mamba_chunk_size=16, mamba_expand=1, num_local_experts=4,
        num_experts_per_tok=2, shared_intermediate_size=32, position_embedding_type="rope",
        embedding_multiplier=4.0, residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=2.0,
    ), "Granite 4.0: Mamba2 and RoPE attention layers, MoE + shared MLP, multipliers")}
    doc = ModelDoc(
        summary="hybrid Mamba2 + attention",
        family="hybrid Mamba2 + attention, MoE + shared MLP after each, muP multipliers (Granite 4.0)",
        state="Mamba2 layers: conv state + fp32 SSM state (fixed size); attention layers (RoPE or none): K, V",
        bytes_per_token="0 for Mamba2 layers",
        refused="LoRA on `conv1d`; an LM head with a bias (`lm_head.bias`); tested from transformers 5.17 (5.10.4's "
                "model is refused)",
    )
    layer_types = (_MAMBA, "full_attention")

    def check_supported(self) -> None:
        super().check_supported()
        if getattr(self.lm_head, "bias", None) is not None:  # logits_scaling is applied before the head
            raise UnsupportedModelError("granitemoehybrid: an LM head with a bias is not supported (lm_head.bias)")
        for idx, layer in enumerate(self.layers):
            if self._is_mamba(idx) and layer.mamba is None:  # releases before 5.17 build Mamba2 from "mamba" types
                raise UnsupportedModelError(
                    f"granitemoehybrid: config.layer_types[{idx}] is {_MAMBA!r} but this transformers release built "
                    "no Mamba2 mixer there (transformers>=5.17 names the layer types linear_attention / "
                    "full_attention)"
                )

    def _is_mamba(self, idx: int) -> bool:
        return self.config.layer_types[idx] == _MAMBA

    def op(self, idx: int) -> MixerOp:
        layer = self.layers[idx]
        return Mamba2(layer.mamba) if self._is_mamba(idx) else Attention(layer.self_attn)

    def feed_forward(self, idx: int) -> FeedForward:
        """Routed experts of ``intermediate_size`` beside the shared MLP, or the shared MLP alone where
        ``num_local_experts`` is 0."""
        c = self.config
        if not c.num_local_experts:
            return Mlp(c.hidden_size, c.shared_intermediate_size)
        return Moe(c.hidden_size, c.num_local_experts, c.num_experts_per_tok, c.intermediate_size,
                   c.shared_intermediate_size)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return super().embed(ids) * self.config.embedding_multiplier

    def layer(self, idx, h, ctx, past, need_output):
        """``h + r * mixer(norm(h))``, then ``h + r * (moe(norm(h)) + shared_mlp(norm(h)))``, r the residual
        multiplier (the model's ``GraniteMoeHybridDecoderLayer``)."""
        layer, scale = self.layers[idx], self.config.residual_multiplier
        mixed, state = self.ops[idx].forward(layer.input_layernorm(h), ctx, past, need_output)
        if not need_output:
            return (None, *state)
        h = h + mixed * scale
        x = layer.post_attention_layernorm(h)
        out = layer.shared_mlp(x)
        if layer.block_sparse_moe is not None:
            out = layer.block_sparse_moe(x) + out
        return (h + out * scale, *state)

    def final_hidden(self, h: torch.Tensor) -> torch.Tensor:
        """The final norm's output over ``logits_scaling``: the LM head is linear without a bias, so it then yields
        the model's logits / logits_scaling."""
        return super().final_hidden(h) / self.config.logits_scaling


register_expert_plan(GraniteMoeHybridAdapter.model_types,  # transformers 5.19 ships none
                     ExpertPlan("layers.*.block_sparse_moe.experts", ("gate_up_proj", "down_proj")))
