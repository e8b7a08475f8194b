"""Kimi Delta Attention (kimi_linear's linear layers): a causal depthwise conv over q, k, v, then the chunked KDA
rule (``ops.kda.rule``; its CP form ``ops.kda.cp``: the state flows through the ranks by an affine merge).

State: conv state [1, 3 x heads x head_dim, kernel - 1] (the last inputs of the conv, model dtype) and recurrent
state [1, heads, head_dim, head_dim] (at least float32), both ``Fixed``.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.activations import ACT2FN

from ..ops.kda.cp import sharded_kda_rule
from ..ops.kda.rule import chunked_rule, kda_rule, kda_torch_saved_bytes
from ..state import Fixed, LayerState
from .base import LayerCall, MixerOp, Saves, SegmentContext, affine_merge_bytes, per_sequence, summed
from .causal_conv import CausalConv

PROJECTION_SAVES = 10.0  # q/k/v projections, conv output and activation, gate projections, per token per head x dim
FLOAT32_SAVES = 7.0  # the float32 forget gate and gated RMSNorm intermediates, per token per head x dim


class Kda(MixerOp):
    """KDA of transformers' ``KimiLinearDeltaAttention`` (``num_heads`` heads of ``head_dim`` keys and values,
    ``q_proj`` / ``k_proj`` / ``v_proj``, ``conv1d``, ``forget_gate``, ``b_proj``, ``g_a_proj`` / ``g_b_proj``,
    ``o_norm``, ``o_proj``)."""

    kind = "kda"

    def __init__(self, module: nn.Module):
        self.module, self.conv = module, CausalConv(module)
        self.heads, self.head_dim = module.num_heads, module.head_dim

    @property
    def kinds(self) -> tuple[Fixed, Fixed]:
        return self.conv.kind, Fixed(shape=(1, self.heads, self.head_dim, self.head_dim), min_dtype=torch.float32)

    def forward(self, x, ctx: SegmentContext, past: LayerState, need_output: bool):
        """Over segment ``x`` [B, S, hidden] continuing (conv_state, recurrent_state) [1, ...] (copied per sequence
        for B > 1), the ops of the model's module: q, k, v through the causal conv and its activation, the
        per-channel forget gate and sigmoid beta, the chunked rule with q, k L2-normalised
        (``ops.kda.rule.chunked_rule``), the sigmoid-gated RMSNorm, o_proj. The new conv state owns its storage; the
        recurrent state stays float32."""
        m = self.module
        conv_state, recurrent_state = past
        batch, seq_len = x.shape[:2]
        heads_shape = (batch, seq_len, -1, self.head_dim)
        qkv = torch.cat([m.q_proj(x), m.k_proj(x), m.v_proj(x)], dim=-1)
        conv_in, new_conv_state = self.conv.inputs(ctx, qkv.transpose(1, 2), conv_state)
        mixed = ACT2FN[m.activation](self.conv(conv_in))
        q, k, v = (t.reshape(heads_shape) for t in torch.split(mixed.transpose(1, 2), [m.qkv_dim] * 3, dim=-1))
        beta = torch.sigmoid(m.b_proj(x))
        rule, initial = chunked_rule(m, q.dtype), per_sequence(recurrent_state, batch)
        if ctx.splits_sequence:
            out, new_recurrent_state = sharded_kda_rule(rule, q, k, v, m.forget_gate(x), beta, initial, ctx.group,
                                                        ctx.split.query_sizes)
        else:
            out, new_recurrent_state = kda_rule(rule, q, k, v, m.forget_gate(x), beta, initial)
        if not need_output:  # the state is all that is needed: no gated norm, no output projection
            return None, (new_conv_state, new_recurrent_state)
        gate = m.g_b_proj(m.g_a_proj(x)).view(heads_shape)
        out = m.o_norm(out, gate).reshape(batch, seq_len, -1)
        return m.o_proj(out), (new_conv_state, new_recurrent_state)

    def saves(self, call: LayerCall) -> Saves:
        """The projections' per-token saves (calibrated), the torch chunked rule's (``kda_torch_saved_bytes``; with
        flash-linear-attention's ``chunk_kda`` on CUDA it saves less: this is the bound), and under CP for a prompt
        chunk the affine merge: the summary run on values [v | 0] (2 x head dim per head) and the R gathered
        summaries [D, 2D] with the R start states [D, D] per head. The recurrence runs whether or not the output is
        needed."""
        width, d = self.heads * self.head_dim, self.head_dim
        per_token = call.act * PROJECTION_SAVES * width + 4 * FLOAT32_SAVES * width
        total = call.batch * call.tokens * per_token
        total += kda_torch_saved_bytes(call.batch, call.tokens, self.heads, d, d)
        if call.consecutive and call.cp_size > 1:
            total += kda_torch_saved_bytes(1, call.tokens, self.heads, d, 2 * d)
            total += call.cp_size * self.heads * d * 3 * d * 4
        return Saves(int(total))

    def collective_bytes(self, call: LayerCall, backward: bool) -> dict[str, int]:
        """The affine merge of a prompt chunk's summaries and the conv inputs before each rank's tokens
        (``mixers.base.affine_merge_bytes``, ``CausalConv.collective_bytes``)."""
        summary = self.heads * self.head_dim * 2 * self.head_dim  # per sequence: [E | M] per head
        return summed(affine_merge_bytes(call, backward, summary), self.conv.collective_bytes(call, backward))

    def flops(self, tokens: int, prefix: int) -> float:
        """7 FLOPs per state element per token, as the gated delta rule (``mixers.gated_delta``)."""
        return 7 * self.heads * self.head_dim * self.head_dim * tokens
