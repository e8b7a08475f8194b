"""Nemotron-H: Mamba2, attention, MLP and MoE blocks (``nemotron_h``), each block ``h + sublayer(norm(h))`` with one
token mixer or one MLP/MoE.

Mixers: ``mixers.Mamba2``, ``mixers.Attention`` (no positional embedding), ``mixers.NoMixer`` for an MLP or MoE
block (no state).
"""

from __future__ import annotations

import torch
from torch import nn

from ..feed_forward import ExpertPlan, FeedForward, Mlp, Moe, NoFeedForward, register_expert_plan
from ..mixers import Attention, Mamba2, MixerOp, NoMixer
from .base import TINY_COMMON, TINY_MOE, Adapter, ModelDoc, TinyModel, register

_MLP_BLOCKS = ("mlp", "moe")


@register
class NemotronHAdapter(Adapter):
    model_types = ("nemotron_h",)
    tiny = {"nemotron_h": TinyModel("NemotronHConfig", dict(
        **TINY_COMMON, **TINY_MOE,
        layers_block_type=["linear_attention", "moe", "full_attention", "linear_attention", "mlp"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, mamba_num_heads=4, mamba_head_dim=16,
        n_groups=2, ssm_state_size=16, conv_kernel=4, chunk_size=16, n_routed_experts=4,
        moe_shared_expert_intermediate_size=32,
    ), "Mamba2, attention, MoE and MLP blocks; scan chunks of 16 so prompts span several")}
    doc = ModelDoc(
        summary="hybrid Mamba2 + attention",
        family="hybrid Mamba2 + attention + MLP/MoE blocks",
        state="Mamba2 layers: conv state + fp32 SSM state (fixed size); attention layers (no RoPE): K, V; MLP/MoE "
              "blocks: none",
        bytes_per_token="0 for Mamba2 and MLP/MoE layers",
        refused="LoRA on `conv1d` (and peft refuses `all-linear`: give `target_modules`); tested from transformers "
                "5.17 (5.10.4's `nemotron_h` is refused)",
    )
    layer_types = ("linear_attention", "full_attention", *_MLP_BLOCKS)
    final_norm = "norm_f"

    def _block(self, idx: int) -> str:
        return self.config.layer_types[idx]

    def op(self, idx: int) -> MixerOp:
        block = self._block(idx)
        if block == "linear_attention":
            return Mamba2(self.layers[idx].mixer)
        return NoMixer() if block in _MLP_BLOCKS else Attention(self.layers[idx].mixer)

    def feed_forward(self, idx: int) -> FeedForward:
        """None for a token mixer's block; an MLP block's MLP; a MoE block's routed experts and shared expert."""
        c, block = self.config, self._block(idx)
        if block == "mlp":
            return Mlp(c.hidden_size, c.intermediate_size)
        if block == "moe":
            return Moe(c.hidden_size, c.n_routed_experts, c.num_experts_per_tok, c.moe_intermediate_size,
                       c.moe_shared_expert_intermediate_size)
        return NoFeedForward(c.hidden_size)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.backbone.embeddings(ids if ids.dim() == 2 else ids[None])

    def layer_norms(self, idx: int, need_output: bool) -> tuple[nn.Module, ...]:
        """A block's one norm, which runs whether or not its output is needed."""
        return (self.layers[idx].norm,)

    def layer(self, idx, h, ctx, past, need_output):
        """One block: ``h + sublayer(norm(h))``; an MLP or MoE block keeps no state."""
        block = self.layers[idx]
        x = block.norm(h.to(block.norm.weight.dtype))
        if self._block(idx) in _MLP_BLOCKS:
            return (h + block.mixer(x),) if need_output else (None,)
        mixed, state = self.ops[idx].forward(x, ctx, past, need_output)
        return (h + mixed if need_output else None, *state)


register_expert_plan(NemotronHAdapter.model_types,  # transformers 5.19 ships none
                     ExpertPlan("layers.*.mixer.experts", ("up_proj", "down_proj")))
