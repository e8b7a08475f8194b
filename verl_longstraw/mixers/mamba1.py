"""Mamba1 (Jamba's Mamba layers): in_proj -> (x, gate z), a causal depthwise conv over x and its activation, x_proj
-> (dt, B, C) each through its RMSNorm (Jamba's ``dt_layernorm``, ``b_layernorm``, ``c_layernorm``), dt_proj and
softplus, the selective scan with the skip term D gated by silu(z) (``ops.mamba1.scan``; its CP form
``ops.mamba1.cp``: the state flows through the ranks by an affine merge), out_proj.

State: conv state [1, channels, kernel - 1] (the last inputs of the conv, model dtype) and SSM state
[1, channels, state_size] (at least float32), both ``Fixed``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..ops.mamba1.cp import sharded_selective_scan
from ..ops.mamba1.scan import selective_scan, selective_scan_saved_bytes
from ..state import Fixed, LayerState
from .base import LayerCall, MixerOp, Saves, SegmentContext, affine_merge_bytes, per_sequence, saved_row_bytes, summed
from .causal_conv import CausalConv

PROJECTION_SAVES = 8  # in_proj output (x, z), conv input, conv output and activation, dt before and after softplus,
# out_proj input: per token per channel, model dtype
STATE_ONLY_SAVES = 5  # without the output: no in_proj output (the gate's), no out_proj input


class Mamba1(MixerOp):
    """Mamba1 of a transformers ``JambaMambaMixer`` with its torch path (``in_proj``, ``conv1d``, ``act``,
    ``x_proj``, ``dt_layernorm``, ``b_layernorm``, ``c_layernorm``, ``dt_proj``, ``A_log``, ``D``, ``out_proj``;
    ``intermediate_size`` channels, ``ssm_state_size`` state elements per channel, dt of ``time_step_rank``)."""

    kind = "mamba1"

    def __init__(self, module: nn.Module):
        self.module, self.conv = module, CausalConv(module)
        self.channels, self.state_size = module.intermediate_size, module.ssm_state_size
        self.kernel, self.dt_rank = module.conv_kernel_size, module.time_step_rank

    @property
    def weights_read(self) -> tuple[str, ...]:
        """The conv's, and ``dt_proj``: the model's forward multiplies by its weight without calling it."""
        return (*self.conv.weights_read, "dt_proj")

    @property
    def kinds(self) -> tuple[Fixed, Fixed]:
        return self.conv.kind, Fixed(shape=(1, self.channels, self.state_size), min_dtype=torch.float32)

    def forward(self, x, ctx: SegmentContext, past: LayerState, need_output: bool):
        """Over segment ``x`` [B, S, hidden] continuing (conv_state, ssm_state) [1, ...] (copied per sequence for
        B > 1), the ops of the module's torch forward. The new conv state owns its storage; the SSM state stays
        float32 (float64 in a float64 model)."""
        m = self.module
        conv_state, ssm_state = past
        batch = x.shape[0]
        hidden, gate = m.in_proj(x).transpose(1, 2).chunk(2, dim=1)  # [B, channels, S] each
        conv_in, new_conv_state = self.conv.inputs(ctx, hidden, conv_state)
        # [B, S, channels], contiguous: x_proj would save a copy of the transposed view besides it for B > 1
        hidden = m.act(self.conv(conv_in)).transpose(1, 2).contiguous()
        dt, B, C = m.x_proj(hidden).split([self.dt_rank, self.state_size, self.state_size], dim=-1)
        dt = (m.dt_proj.weight @ m.dt_layernorm(dt).transpose(1, 2)).transpose(1, 2)  # [B, S, channels]
        args = (
            hidden,
            F.softplus(dt + m.dt_proj.bias.to(dt.dtype)),
            -torch.exp(m.A_log.float()),
            m.b_layernorm(B),
            m.c_layernorm(C) if need_output else None,  # without the output: the state alone
            m.D.float(),
            gate.transpose(1, 2),
            per_sequence(ssm_state, batch),
        )
        if ctx.splits_sequence:
            out, new_ssm_state = sharded_selective_scan(*args, ctx.group, ctx.split.query_sizes)
        else:
            out, new_ssm_state = selective_scan(*args)
        new_ssm_state = new_ssm_state.to(torch.promote_types(x.dtype, torch.float32))
        if not need_output:  # the state is all that is needed: no output projection
            return None, (new_conv_state, new_ssm_state)
        return m.out_proj(out.to(x.dtype)), (new_conv_state, new_ssm_state)

    def saves(self, call: LayerCall) -> Saves:
        """The projections' per-token saves (``PROJECTION_SAVES`` channels, ``STATE_ONLY_SAVES`` without the
        output; x_proj's outputs dt, B, C; the outputs of the dt, B and with the output C norms), those norms' saves
        beyond their inputs and outputs (``saved_row_bytes``: counted from what they save), the conv's kernel - 1
        state columns per sequence, the decay rates A and exp(A_log) once per call, the scan's
        (``selective_scan_saved_bytes``), and under CP for a prompt chunk the affine merge: the summary scan from zero
        over the rank's tokens (its state chain) and the R gathered summaries [E | a] with the R start states per
        channel and state element. The scan runs whether or not the output is needed. Measured equal to
        ``memory.SavedTensorMeter`` in float32 and within 0.2% in bf16 (``tests/mixers`` pins it)."""
        m, act = self.module, call.act
        coefficient = PROJECTION_SAVES if call.need_output else STATE_ONLY_SAVES
        norms = [(m.dt_layernorm, self.dt_rank), (m.b_layernorm, self.state_size)]
        norms += [(m.c_layernorm, self.state_size)] if call.need_output else []
        norm_outputs = sum(width for _, width in norms)  # read by dt_proj, the scan's dt B, C's contraction
        projections = coefficient * self.channels + self.dt_rank + 2 * self.state_size + norm_outputs
        per_token = act * projections + sum(saved_row_bytes(norm, width, call.dtype) - width * act
                                            for norm, width in norms)  # its input is x_proj's output
        total = call.batch * (call.tokens * per_token + (self.kernel - 1) * self.channels * act)
        total += 2 * self.channels * self.state_size * call.compute.itemsize
        total += selective_scan_saved_bytes(call.batch, call.tokens, self.channels, self.state_size, call.dtype,
                                            call.need_output)
        if call.consecutive and call.cp_size > 1:
            total += selective_scan_saved_bytes(1, call.tokens, self.channels, self.state_size, call.dtype, False)
            total += call.cp_size * 3 * self.channels * self.state_size * call.compute.itemsize
        return Saves(int(total))

    def collective_bytes(self, call: LayerCall, backward: bool) -> dict[str, int]:
        """The affine merge of a prompt chunk's summaries [E | a] (2 per channel and state element) and the conv
        inputs before each rank's tokens (``mixers.base.affine_merge_bytes``, ``CausalConv.collective_bytes``)."""
        return summed(affine_merge_bytes(call, backward, 2 * self.channels * self.state_size),
                      self.conv.collective_bytes(call, backward))

    def flops(self, tokens: int, prefix: int) -> float:
        """7 FLOPs per state element per token: the discretisation dt A and dt B (2), the decay of h (1), the update
        h + (dt B) x (2), h C (2)."""
        return 7 * self.channels * self.state_size * tokens
