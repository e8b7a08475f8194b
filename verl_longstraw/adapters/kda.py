"""Kimi Linear (``kimi_linear``): Kimi Delta Attention (KDA) layers and multi-head latent attention layers without
positional embedding (NoPE), MLP or MoE blocks after each.

State per layer:
- KDA: conv state [1, 3 x heads x head_dim, kernel - 1] (the last inputs of the causal depthwise conv over q, k, v;
  model dtype) and recurrent state [1, heads, head_dim, head_dim] (float32), both ``Fixed``;
- MLA: the normalised KV latent and the (unrotated) rope key, [1, S, kv_lora_rank + rope_dim] (``Rows``), as the
  MLA adapter keeps them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN

from ..ops.kda import chunked_rule
from ..state import Fixed, LayerState, StateKind
from .base import Adapter, Mixer, SegmentContext, per_sequence, register
from .mla import MultiHeadLatentAttentionAdapter


def kda_kinds(mixer: nn.Module) -> tuple[Fixed, Fixed]:
    """Conv state [1, conv_dim, kernel - 1] (model dtype), recurrent state [1, heads, head_dim, head_dim] (at least
    float32); both start at zero."""
    conv = Fixed(shape=(1, mixer.conv_dim, mixer.conv_kernel_size - 1))
    recurrent = Fixed(shape=(1, mixer.num_heads, mixer.head_dim, mixer.head_dim), min_dtype=torch.float32)
    return conv, recurrent


def kda_mix(mixer: nn.Module, x: torch.Tensor, ctx: SegmentContext, past: LayerState) -> tuple[torch.Tensor,
                                                                                               LayerState]:
    """KDA over segment ``x`` [B, S, hidden] continuing (conv_state, recurrent_state) [1, ...] (copied per sequence
    for B > 1), the ops of transformers' ``KimiLinearDeltaAttention``: q, k, v projections through the causal conv
    and its activation, the model's per-channel forget gate and sigmoid beta, the chunked rule with q, k
    L2-normalised (``ops.kda.chunked_rule``: the model's own, flash-linear-attention's ``chunk_kda`` where installed,
    for half-precision inputs; its plain torch form otherwise), the sigmoid-gated RMSNorm, o_proj. The new conv
    state owns its storage; the recurrent state stays float32."""
    conv_state, recurrent_state = past
    batch, seq_len = x.shape[:2]
    heads_shape = (batch, seq_len, -1, mixer.head_dim)
    qkv = torch.cat([mixer.q_proj(x), mixer.k_proj(x), mixer.v_proj(x)], dim=-1)
    conv_in, new_conv_state = ctx.conv_input(qkv.transpose(1, 2), per_sequence(conv_state.to(qkv.dtype), batch))
    weight = mixer.conv1d.weight
    mixed = ACT2FN[mixer.activation](F.conv1d(conv_in, weight, mixer.conv1d.bias, groups=weight.shape[0]))
    q, k, v = (t.reshape(heads_shape) for t in torch.split(mixed.transpose(1, 2), [mixer.qkv_dim] * 3, dim=-1))
    beta = torch.sigmoid(mixer.b_proj(x))
    out, new_recurrent_state = ctx.kda_rule(chunked_rule(mixer, q.dtype), q, k, v, mixer.forget_gate(x), beta,
                                            per_sequence(recurrent_state, batch))
    gate = mixer.g_b_proj(mixer.g_a_proj(x)).view(heads_shape)
    out = mixer.o_norm(out, gate).reshape(batch, seq_len, -1)
    return mixer.o_proj(out), (new_conv_state, new_recurrent_state)


@register
class KimiLinearAdapter(MultiHeadLatentAttentionAdapter):
    model_types = ("kimi_linear",)
    weights_read = (*Adapter.weights_read, "conv1d")  # the causal conv runs on its weight (kda_mix)
    layer_types = ("full_attention", "linear_attention")

    def _is_linear(self, idx: int) -> bool:
        return self.config.layer_types[idx] == "linear_attention"

    def mixer(self, idx: int) -> Mixer:
        if self._is_linear(idx):  # the rule's shape: heads of head_dim keys and values
            kda = self.layers[idx].self_attn
            return Mixer("kda", q_heads=kda.num_heads, qk_dim=kda.head_dim, v_dim=kda.head_dim)
        return super().mixer(idx)

    def state_kinds(self, idx: int) -> tuple[StateKind, ...]:
        return kda_kinds(self.layers[idx].self_attn) if self._is_linear(idx) else super().state_kinds(idx)

    def mlp_width(self, idx: int) -> int:
        """A dense layer's intermediate width; a sparse one's routed experts x top-k, its shared experts and its
        router's logits (``config.mlp_layer_types``)."""
        c = self.config
        if c.mlp_layer_types[idx] != "sparse":
            return c.intermediate_size
        return (c.num_experts_per_tok + c.n_shared_experts) * c.moe_intermediate_size + c.num_local_experts

    def mix(self, idx, x, ctx, past, need_output):
        if self._is_linear(idx):
            return kda_mix(self.layers[idx].self_attn, x, ctx, past)
        return super().mix(idx, x, ctx, past, need_output)
