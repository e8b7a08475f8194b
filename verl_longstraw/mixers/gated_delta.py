"""Gated DeltaNet (qwen3_next, qwen3_5 linear-attention layers): a causal depthwise conv over q, k, v, then the
chunked gated delta rule (``ops.gated_delta.rule``; its CP form ``ops.gated_delta.cp``: the state flows through
the ranks by an affine merge).

State: conv state [1, conv_dim, kernel - 1] (the last inputs of the conv, model dtype) and recurrent state
[1, v_heads, k_dim, v_dim] (at least float32), both ``Fixed``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from ..ops.gated_delta.cp import sharded_gated_delta_rule
from ..ops.gated_delta.rule import FLA_CHUNK, gated_delta_rule, kernel_path
from ..state import Fixed, LayerState
from .base import LayerCall, MixerOp, Saves, SegmentContext, affine_merge_bytes, per_sequence, saved_row_bytes, summed
from .causal_conv import CausalConv

PROJECTION_SAVES = 2.0  # q/k/v projections and conv outputs, per token in units of the key and value widths
FLOAT32_SAVES = 8.0  # float32 q/k/v/decay intermediates of the chunked rule, per token in units of those widths
CHUNK_LEN = 64  # the chunked rule's chunk: each sequence is padded to whole chunks


class RuleSaves(NamedTuple):
    """Float32 tensors the chunked gated delta rule keeps per padded token and value head, in units of the key
    head dim, the value head dim and the chunk length (its [64 x 64] per-chunk matrices); counted from its saved
    tensors."""

    key: int
    value: int
    chunk: int


RULE = RuleSaves(key=6, value=3, chunk=5)  # a run whose output is used
SUMMARY = RuleSaves(key=4, value=3, chunk=3)  # the CP affine merge's summary run: its dropped output frees more


class GatedDelta(MixerOp):
    """Gated DeltaNet of a transformers ``*GatedDeltaNet`` module (``num_k_heads``, ``num_v_heads``,
    ``head_k_dim``, ``head_v_dim``, ``key_dim``, ``value_dim``, ``conv1d``, ``A_log``, ``dt_bias``, ``norm``,
    ``out_proj``; qwen3_next's packed ``in_proj_qkvz`` / ``in_proj_ba`` or qwen3_5's separate projections)."""

    kind = "gated_delta"

    def __init__(self, module: nn.Module):
        self.module, self.conv = module, CausalConv(module)
        self.heads, self.key_heads = module.num_v_heads, module.num_k_heads
        self.k_dim, self.v_dim = module.head_k_dim, module.head_v_dim

    @property
    def kinds(self) -> tuple[Fixed, Fixed]:
        return self.conv.kind, Fixed(shape=(1, self.heads, self.k_dim, self.v_dim), min_dtype=torch.float32)

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Input projections -> (qkv [B, S, conv_dim], z [B, S, v_heads, v_dim], b, a [B, S, v_heads])."""
        m = self.module
        if hasattr(m, "in_proj_qkvz"):  # qwen3_next packs q, k, v, z and b, a per key-head group
            q, k, v, z, b, a = m.fix_query_key_value_ordering(m.in_proj_qkvz(x), m.in_proj_ba(x))
            qkv = torch.cat([t.reshape(*t.shape[:2], -1) for t in (q, k, v)], dim=-1)
            return qkv, z, b, a
        z = m.in_proj_z(x).unflatten(-1, (-1, self.v_dim))
        return m.in_proj_qkv(x), z, m.in_proj_b(x), m.in_proj_a(x)

    def forward(self, x, ctx: SegmentContext, past: LayerState, need_output: bool):
        """Over segment ``x`` [B, S, hidden] continuing (conv_state, recurrent_state) [1, ...] (copied per sequence
        for B > 1). q, k [B, S, num_k_heads, k_dim] go to the rule as they are (it maps value head j to key head
        j // (num_v_heads // num_k_heads)), v [B, S, num_v_heads, v_dim], g, beta [B, S, num_v_heads]. The new conv
        state owns its storage; the recurrent state stays float32 whatever the model's dtype."""
        m = self.module
        conv_state, recurrent_state = past
        batch, seq_len = x.shape[:2]
        qkv, z, b, a = self._project(x)
        conv_in, new_conv_state = self.conv.inputs(ctx, qkv.transpose(1, 2), conv_state)
        mixed = F.silu(self.conv(conv_in)).transpose(1, 2)
        q, k, v = torch.split(mixed, [m.key_dim, m.key_dim, m.value_dim], dim=-1)
        q, k = q.unflatten(-1, (-1, self.k_dim)), k.unflatten(-1, (-1, self.k_dim))
        v = v.unflatten(-1, (-1, self.v_dim))
        beta = b.sigmoid()
        g = -m.A_log.float().exp() * F.softplus(a.float() + m.dt_bias)
        initial = per_sequence(recurrent_state, batch)
        if ctx.splits_sequence:
            out, new_recurrent_state = sharded_gated_delta_rule(q, k, v, g, beta, initial, ctx.group,
                                                                ctx.split.query_sizes, use_qk_l2norm=True)
        else:
            out, new_recurrent_state = gated_delta_rule(q, k, v, g, beta, initial_state=initial, use_qk_l2norm=True)
        if not need_output:  # the state is all that is needed: no gated norm, no output projection
            return None, (new_conv_state, new_recurrent_state)
        out = m.norm(out.reshape(-1, self.v_dim), z.reshape(-1, self.v_dim))
        return m.out_proj(out.reshape(batch, seq_len, -1)), (new_conv_state, new_recurrent_state)

    def _fla_path_token_bytes(self, call: LayerCall) -> float:
        """Bytes ``forward`` saves per token on flash-linear-attention's path, tensor by tensor: the input (the
        projections read it), the conv's input (after the past conv inputs), its pre-activation output and its
        activation (q, k, v are views of it), fla's saves (``_fla_token_bytes``, less v: a view), beta and the
        float32 decay's inputs; with ``need_output`` the gated norm's (``base.saved_row_bytes`` of the module's
        ``norm`` on each value head: its float32 copies in half precision) and the output projection's input."""
        m, act = self.module, call.act
        values = self.heads * self.v_dim
        total = act * (m.hidden_size + 3 * m.conv_dim) + self._fla_token_bytes(self.v_dim, act) - act * values
        total += self.heads * (2 * act + 3 * 4)
        if call.need_output:
            total += self.heads * saved_row_bytes(m.norm, self.v_dim, call.dtype, inputs=2) + act * values
        return total

    def _rule_token_bytes(self, value_dim: int, saves: RuleSaves, compute: int) -> float:
        """Bytes the plain chunked rule keeps per (padded) token for values of ``value_dim`` per head."""
        return self.heads * (saves.key * self.k_dim + saves.value * value_dim + saves.chunk * CHUNK_LEN) * compute

    def _fla_token_bytes(self, value_dim: int, act: int) -> int:
        """Bytes flash-linear-attention's kernel keeps per token for values of ``value_dim`` per head
        (``ops.gated_delta.rule.FlaShapes``): the L2-normed q, k, v, beta and the triangular solve [64] in the model
        dtype, the inverse norms and the cumulative decay in float32; no padding."""
        return (act * (2 * self.key_heads * self.k_dim + self.heads * (value_dim + FLA_CHUNK + 1))
                + 4 * (2 * self.key_heads + self.heads))

    def saves(self, call: LayerCall) -> Saves:
        """Per token, on flash-linear-attention's path (half CUDA inputs, ``kernel_path``) the forward's saves
        counted tensor by tensor (``_fla_path_token_bytes``); else the projections' (calibrated) and the plain
        chunked rule's (calibrated) with its padding to whole chunks; under
        CP for a prompt chunk the affine merge: the summary run of the rule on values [v | 0] (Dv + Dk per head)
        over the (padded) tokens, and the R gathered summaries [Dk, Dv + Dk] with the R start states [Dk, Dv]. The
        recurrence runs whether or not the output is needed."""
        widths = self.key_heads * self.k_dim + self.heads * self.v_dim
        compute = call.compute.itemsize
        fla = kernel_path(call.device_type, call.dtype) == "fla"
        if fla:
            per_token = self._fla_path_token_bytes(call)
        else:
            rule = 4 * (FLOAT32_SAVES * 2 * widths + RULE.chunk * self.heads * CHUNK_LEN)
            per_token = call.act * PROJECTION_SAVES * widths + rule
        total = call.batch * call.tokens * per_token
        padding = 0 if fla else -call.tokens % CHUNK_LEN
        total += call.batch * padding * self._rule_token_bytes(self.v_dim, RULE, compute)
        if call.consecutive and call.cp_size > 1:
            if fla:
                total += call.tokens * self._fla_token_bytes(self.v_dim + self.k_dim, call.act)
            else:
                total += (call.tokens + padding) * self._rule_token_bytes(self.v_dim + self.k_dim, SUMMARY, compute)
            total += call.cp_size * self.heads * self.k_dim * (2 * self.v_dim + self.k_dim) * compute
        return Saves(int(total))

    def collective_bytes(self, call: LayerCall, backward: bool) -> dict[str, int]:
        """The affine merge of a prompt chunk's summaries and the conv inputs before each rank's tokens
        (``mixers.base.affine_merge_bytes``, ``CausalConv.collective_bytes``)."""
        summary = self.heads * self.k_dim * (self.k_dim + self.v_dim)  # per sequence: [E | M] per head
        return summed(affine_merge_bytes(call, backward, summary), self.conv.collective_bytes(call, backward))

    def flops(self, tokens: int, prefix: int) -> float:
        """7 FLOPs per state element per token: the decay of S (1), k S (2), the rank-1 update
        S + k^T (beta (v - k S)) (2), q S (2)."""
        return 7 * self.heads * self.k_dim * self.v_dim * tokens
