"""Mamba2 (nemotron_h, granitemoehybrid): in_proj -> (gate, xBC, dt), a causal depthwise conv over xBC, the chunked
SSD scan with the skip term D (``ops.mamba2.ssd``; its CP form ``ops.mamba2.cp``: the state flows through the ranks by
an affine merge), the gated RMSNorm and out_proj.

State: conv state [1, conv_dim, kernel - 1] (the last inputs of the conv, model dtype) and SSM state
[1, heads, head_dim, state_size] (at least float32), both ``Fixed``.
"""

from __future__ import annotations

import torch
from torch import nn

from ..ops.mamba2.cp import sharded_ssd_scan
from ..ops.mamba2.ssd import model_chunk_scan, ssd_scan, ssd_torch_saved_bytes, step_sizes
from ..state import Fixed, LayerState
from .base import LayerCall, MixerOp, Saves, SegmentContext, affine_merge_bytes, per_sequence, summed
from .causal_conv import CausalConv

PROJECTION_SAVES = 6.0  # in_proj output, conv output and activation, the gated norm's saves, per token per head x dim
SUMMARY_SAVES = 0.4  # of the chunked scan's saves, what the CP summary scan keeps once its output is dropped


class Mamba2(MixerOp):
    """Mamba2 of a transformers ``*Mamba2Mixer`` with Nemotron-H's torch path (``in_proj``, ``conv1d``, ``act``,
    ``A_log``, ``D``, ``dt_bias``, ``time_step_limit``, ``norm`` (gated), ``out_proj``; ``num_heads`` heads of
    ``head_dim`` channels, ``n_groups`` B/C groups of ``ssm_state_size``, chunks of ``chunk_size``)."""

    kind = "mamba2"

    def __init__(self, module: nn.Module):
        self.module, self.conv = module, CausalConv(module)
        self.heads, self.head_dim = module.num_heads, module.head_dim
        self.groups, self.state_size, self.scan_chunk = module.n_groups, module.ssm_state_size, module.chunk_size
        self.scan = model_chunk_scan(module)  # raises for a release whose mixer has no chunk scan

    @property
    def kinds(self) -> tuple[Fixed, Fixed]:
        return self.conv.kind, Fixed(shape=(1, self.heads, self.head_dim, self.state_size), min_dtype=torch.float32)

    def forward(self, x, ctx: SegmentContext, past: LayerState, need_output: bool):
        """Over segment ``x`` [B, S, hidden] continuing (conv_state, ssm_state) [1, ...] (copied per sequence for
        B > 1). The new conv state owns its storage; the SSM state stays float32 (float64 in a float64 model)."""
        m = self.module
        conv_state, ssm_state = past
        batch, seq_len = x.shape[:2]
        gate, xbc, dt = m.in_proj(x).split([m.intermediate_size, m.conv_dim, self.heads], dim=-1)
        conv_in, new_conv_state = self.conv.inputs(ctx, xbc.transpose(1, 2), conv_state)
        xbc = m.act(self.conv(conv_in)).transpose(1, 2)
        group_width = self.groups * self.state_size
        hidden, B, C = torch.split(xbc, [m.intermediate_size, group_width, group_width], dim=-1)
        args = (
            self.scan,
            hidden.view(batch, seq_len, self.heads, self.head_dim),
            step_sizes(dt, m.dt_bias, m.time_step_limit),
            -torch.exp(m.A_log.float()),
            B.view(batch, seq_len, self.groups, self.state_size),
            C.view(batch, seq_len, self.groups, self.state_size),
            m.D,
            per_sequence(ssm_state, batch),
            self.scan_chunk,
        )
        if ctx.splits_sequence:
            out, new_ssm_state = sharded_ssd_scan(*args, ctx.group, ctx.split.query_sizes)
        else:
            out, new_ssm_state = ssd_scan(*args)
        new_ssm_state = new_ssm_state.to(torch.promote_types(x.dtype, torch.float32))
        if not need_output:  # the state is all that is needed: no gated norm, no output projection
            return None, (new_conv_state, new_ssm_state)
        out = m.norm(out.reshape(batch, seq_len, -1), gate)
        return m.out_proj(out.to(x.dtype)), (new_conv_state, new_ssm_state)

    def saves(self, call: LayerCall) -> Saves:
        """The projections' per-token saves (calibrated), the torch chunked scan's (``ssd_torch_saved_bytes``, each
        sequence padded to whole chunks), and under CP for a prompt chunk the affine merge: the summary scan from zero
        over the rank's tokens (``SUMMARY_SAVES`` of a scan's saves: only its final state is kept) and the R gathered
        summaries [P, N + P] with the R start states [P, N] per head. The scan runs whether or not the output is
        needed."""
        p, n = self.head_dim, self.state_size
        total = call.batch * call.tokens * call.act * PROJECTION_SAVES * self.heads * p
        total += ssd_torch_saved_bytes(call.batch, call.tokens, self.heads, p, n, self.scan_chunk, call.compute)
        if call.consecutive and call.cp_size > 1:
            total += SUMMARY_SAVES * ssd_torch_saved_bytes(1, call.tokens, self.heads, p, n, self.scan_chunk,
                                                           call.compute)
            total += call.cp_size * self.heads * p * (2 * n + p) * call.compute.itemsize
        return Saves(int(total))

    def collective_bytes(self, call: LayerCall, backward: bool) -> dict[str, int]:
        """The affine merge of a prompt chunk's summaries and the conv inputs before each rank's tokens
        (``mixers.base.affine_merge_bytes``, ``CausalConv.collective_bytes``)."""
        summary = self.heads * self.head_dim * (self.state_size + self.head_dim)  # per sequence: [E | M] per head
        return summed(affine_merge_bytes(call, backward, summary), self.conv.collective_bytes(call, backward))

    def flops(self, tokens: int, prefix: int) -> float:
        """5 FLOPs per state element per token: the decay of h (1), the update h + dt x B^T (2), h C (2)."""
        return 5 * self.heads * self.head_dim * self.state_size * tokens
