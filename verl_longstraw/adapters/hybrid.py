"""Hybrid Gated DeltaNet + full attention (qwen3_next, qwen3_5).

State per layer:
- full attention: K, V [1, kv_heads, S, head_dim] (``Rows``);
- Gated DeltaNet: conv state [1, conv_dim, kernel - 1] (the last inputs of the causal
  depthwise conv) and recurrent state [1, heads, k_dim, v_dim] in float32 (both ``Fixed``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..state import Fixed, LayerState, StateKind
from .base import Adapter, Mixer, SegmentContext, per_sequence, register
from .dense import attention_mix, attention_mixer, kv_kinds


def recurrent_kinds(mixer: nn.Module) -> tuple[Fixed, Fixed]:
    """Conv state [1, conv_dim, kernel - 1] (model dtype), recurrent state [1, v_heads, k_dim, v_dim]
    (at least float32); both start at zero."""
    conv = Fixed(shape=(1, mixer.conv_dim, mixer.conv_kernel_size - 1))
    shape = (1, mixer.num_v_heads, mixer.head_k_dim, mixer.head_v_dim)
    return conv, Fixed(shape=shape, min_dtype=torch.float32)


def _project(mixer: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Input projections -> (qkv [1, S, conv_dim], z [1, S, v_heads, v_dim], b, a [1, S, v_heads])."""
    if hasattr(mixer, "in_proj_qkvz"):  # qwen3_next packs q, k, v, z and b, a per key-head group
        q, k, v, z, b, a = mixer.fix_query_key_value_ordering(mixer.in_proj_qkvz(x), mixer.in_proj_ba(x))
        qkv = torch.cat([t.reshape(*t.shape[:2], -1) for t in (q, k, v)], dim=-1)
        return qkv, z, b, a
    z = mixer.in_proj_z(x).unflatten(-1, (-1, mixer.head_v_dim))
    return mixer.in_proj_qkv(x), z, mixer.in_proj_b(x), mixer.in_proj_a(x)


def gated_deltanet_mix(
    mixer: nn.Module, x: torch.Tensor, ctx: SegmentContext, past: LayerState
) -> tuple[torch.Tensor, LayerState]:
    """Gated DeltaNet over segment ``x`` [B, S, hidden] continuing from (conv_state, recurrent_state) [1, ...]
    (copied per sequence for B > 1: fixed-size, and each sequence's state evolves on its own).

    q, k [B, S, num_k_heads, k_dim] go to the delta rule as they are, v [B, S, num_v_heads, v_dim],
    g, beta [B, S, num_v_heads]: the rule takes the grouped value heads (transformers repeat_interleaves
    q, k to num_v_heads first; the same values).

    The new conv state owns its storage (a view would keep the segment's whole conv input alive
    in every kept chunk boundary); the recurrent state stays float32 whatever the model's dtype.
    """
    conv_state, recurrent_state = past
    batch, seq_len = x.shape[:2]
    qkv, z, b, a = _project(mixer, x)
    conv_state = per_sequence(conv_state.to(qkv.dtype), batch)
    conv_in, new_conv_state = ctx.conv_input(qkv.transpose(1, 2), conv_state)  # [B, conv_dim, K-1+S]
    weight = mixer.conv1d.weight
    mixed = F.silu(F.conv1d(conv_in, weight, mixer.conv1d.bias, groups=weight.shape[0])).transpose(1, 2)
    q, k, v = torch.split(mixed, [mixer.key_dim, mixer.key_dim, mixer.value_dim], dim=-1)
    q = q.unflatten(-1, (-1, mixer.head_k_dim))
    k = k.unflatten(-1, (-1, mixer.head_k_dim))
    v = v.unflatten(-1, (-1, mixer.head_v_dim))
    beta = b.sigmoid()
    g = -mixer.A_log.float().exp() * F.softplus(a.float() + mixer.dt_bias)
    # q, k keep their num_k_heads heads: the rule maps value head j to key head j // (num_v_heads // num_k_heads)
    out, new_recurrent_state = ctx.delta_rule(q, k, v, g, beta, per_sequence(recurrent_state, batch))
    out = mixer.norm(out.reshape(-1, mixer.head_v_dim), z.reshape(-1, mixer.head_v_dim))
    return mixer.out_proj(out.reshape(batch, seq_len, -1)), (new_conv_state, new_recurrent_state)


@register
class HybridGatedDeltaNetAdapter(Adapter):
    model_types = ("qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")
    weights_read = (*Adapter.weights_read, "conv1d")  # the causal conv runs on its weight (gated_deltanet_mix)
    layer_types = ("full_attention", "linear_attention")

    def _is_linear(self, idx: int) -> bool:
        return self.config.layer_types[idx] == "linear_attention"

    def mixer(self, idx: int) -> Mixer:
        return Mixer("gated_delta") if self._is_linear(idx) else attention_mixer(self.layers[idx].self_attn)

    def state_kinds(self, idx: int) -> tuple[StateKind, ...]:
        layer = self.layers[idx]
        return recurrent_kinds(layer.linear_attn) if self._is_linear(idx) else kv_kinds(layer.self_attn)

    def mix(self, idx, x, ctx, past, need_output):
        layer = self.layers[idx]
        if self._is_linear(idx):
            return gated_deltanet_mix(layer.linear_attn, x, ctx, past)
        return attention_mix(layer.self_attn, x, ctx, past, need_output)
