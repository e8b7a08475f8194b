"""Gated short convolution (lfm2's conv layers): in_proj -> (B, C, x), a causal depthwise conv over B * x without an
activation, the output C * conv, out_proj. No recurrence and no attention: the conv's last inputs are all a later
token reads.

State: conv state [1, channels, kernel - 1] (the last inputs of the conv, B * x, model dtype), ``Fixed``. Its CP
form is the conv's (``base.conv_input``: each rank reads the last inputs of the ranks before it).
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import nn

from ..state import Fixed, LayerState
from .base import LayerCall, MixerOp, Saves, SegmentContext, affine_merge_bytes, conv_input, per_sequence

PROJECTION_SAVES = 6  # in_proj output (B, C, x: 3), conv input, conv output and out_proj input, per token per channel
STATE_ONLY_SAVES = 3  # without the output: the in_proj output B * x reads, per token per channel


class ShortConv(MixerOp):
    """The short convolution of a transformers ``Lfm2ShortConv`` module (``in_proj`` [hidden -> 3 x channels],
    ``conv`` a depthwise ``nn.Conv1d`` over ``channels`` = hidden with kernel ``conv_kernel_size``, ``out_proj``;
    biases where the config has ``conv_bias``)."""

    kind = "short_conv"

    def __init__(self, module: nn.Module):
        self.module = module
        self.channels, self.kernel = module.conv.weight.shape[0], module.conv_kernel_size

    @property
    def kinds(self) -> tuple[Fixed]:
        return (Fixed(shape=(1, self.channels, self.kernel - 1)),)

    def forward(self, x, ctx: SegmentContext, past: LayerState, need_output: bool):
        """Over segment ``x`` [B, S, hidden] continuing the conv state [1, channels, kernel - 1] (copied per
        sequence for B > 1): B, C, x [B, channels, S] from in_proj, the conv over the state then B * x, the
        output out_proj(C * conv) [B, S, hidden]. The new conv state owns its storage."""
        m = self.module
        (conv_state,) = past
        b, c, xx = m.in_proj(x).transpose(1, 2).chunk(3, dim=1)
        bx = b * xx
        conv_in, new_conv_state = conv_input(ctx, bx, per_sequence(conv_state.to(bx.dtype), x.shape[0]))
        if not need_output:  # the state is all that is needed: no conv, no output projection
            return None, (new_conv_state,)
        weight = m.conv.weight
        y = c * F.conv1d(conv_in, weight, m.conv.bias, groups=weight.shape[0])
        return m.out_proj(y.transpose(1, 2).contiguous()), (new_conv_state,)

    def saves(self, call: LayerCall) -> Saves:
        """``PROJECTION_SAVES`` per token in units of the channels (``STATE_ONLY_SAVES`` without the output, when
        the conv does not run), and with the output the kernel - 1 state columns the conv reads before each
        sequence's tokens."""
        if not call.need_output:
            return Saves(call.batch * call.tokens * STATE_ONLY_SAVES * self.channels * call.act)
        columns = call.batch * (call.tokens * PROJECTION_SAVES + self.kernel - 1)
        return Saves(columns * self.channels * call.act)

    def collective_bytes(self, call: LayerCall, backward: bool) -> dict[str, int]:
        """For a prompt chunk under CP the all-gather of every rank's last kernel - 1 conv inputs, their gradients
        reduce-scattered in float32 in backward (``mixers.base.affine_merge_bytes``'s conv tails; no recurrent
        summary)."""
        return affine_merge_bytes(call, backward, 0, self.channels, self.kernel - 1)

    def flops(self, tokens: int, prefix: int) -> float:
        """0: the depthwise conv's 2 x channels x kernel FLOPs per token are its weight's, which ``flops.
        active_params`` counts with the layer's weights (as for Mamba2's and Gated DeltaNet's convs); the products
        B * x and C * conv are elementwise (not counted)."""
        return 0.0
