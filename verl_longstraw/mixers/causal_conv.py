"""The causal depthwise conv a layer runs on its module's ``nn.Conv1d`` (``CausalConv``: the part Gated DeltaNet, KDA
and Mamba2 put in front of their recurrence, ``ops.causal_conv``), and lfm2's gated short convolution, that conv
alone between gates (``ShortConv``).

``ShortConv``: in_proj -> (B, C, x), the causal conv over B * x without an activation, the output C * conv, out_proj.
No recurrence and no attention: the conv's last inputs are all a later token reads. State: conv state
[1, channels, kernel - 1] (the last inputs of the conv, B * x, model dtype), ``Fixed``. Its CP form is the conv's
(each rank reads the last inputs of the ranks before it).
"""

from __future__ import annotations

import torch
from torch import nn

from ..ops.causal_conv.conv import causal_conv, conv_input
from ..ops.causal_conv.cp import sharded_conv_input
from ..state import Fixed, LayerState
from .base import LayerCall, MixerOp, Saves, SegmentContext, per_sequence

PROJECTION_SAVES = 6  # in_proj output (B, C, x: 3), conv input, conv output and out_proj input, per token per channel
STATE_ONLY_SAVES = 3  # without the output: the in_proj output B * x reads, per token per channel


class CausalConv:
    """The causal depthwise conv of a layer's ``nn.Conv1d`` submodule ``name`` (weight [channels, 1, K]):
    its state kind (the last K - 1 inputs, model dtype), its input after that state in one process or on a CP group,
    the conv, its collectives under CP, and the weight it reads (``weights_read``)."""

    def __init__(self, module: nn.Module, name: str = "conv1d"):
        self.module, self.name = module, name
        channels, _, kernel = getattr(module, name).weight.shape
        self.channels, self.history = channels, kernel - 1

    @property
    def kind(self) -> Fixed:
        """The conv state [1, channels, K - 1]."""
        return Fixed(shape=(1, self.channels, self.history))

    @property
    def weights_read(self) -> tuple[str]:
        """The conv module's name: its weight is read, the module never called (LoRA there is refused)."""
        return (self.name,)

    def inputs(self, ctx: SegmentContext, x: torch.Tensor,
               conv_state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(conv input [B, C, K - 1 + S], the next conv state [B, C, K - 1] in its own storage) of ``x`` [B, C, S]
        after ``conv_state`` [1, C, K - 1] (copied per sequence for B > 1, in ``x``'s dtype): under CP with a split
        sequence the inputs before come from the previous ranks (``ops.causal_conv.cp.sharded_conv_input``)."""
        conv_state = per_sequence(conv_state.to(x.dtype), x.shape[0])
        if ctx.splits_sequence:
            return sharded_conv_input(x, conv_state, ctx.group, ctx.split.query_sizes)
        return conv_input(x, conv_state)

    def __call__(self, conv_in: torch.Tensor) -> torch.Tensor:
        """The conv over ``inputs``' conv input: [B, C, S] (no activation)."""
        conv = getattr(self.module, self.name)
        return causal_conv(conv_in, conv.weight, conv.bias)

    def collective_bytes(self, call: LayerCall, backward: bool) -> dict[str, int]:
        """For a prompt chunk under CP (``call.consecutive``; none otherwise) the all-gather of every rank's last
        K - 1 inputs (model dtype); the backward reduce-scatters their gradients, summed in float32."""
        if call.cp_size == 1 or not call.consecutive:
            return {}
        tails = call.cp_size * min(self.history, max(call.sizes)) * self.channels * call.act
        out = {"all_gather": tails}
        if backward:
            out["reduce_scatter"] = tails * call.compute.itemsize // call.act
        return out


class ShortConv(MixerOp):
    """The short convolution of a transformers ``Lfm2ShortConv`` module (``in_proj`` [hidden -> 3 x channels],
    ``conv`` a depthwise ``nn.Conv1d`` over ``channels`` = hidden with kernel ``conv_kernel_size``, ``out_proj``;
    biases where the config has ``conv_bias``)."""

    kind = "short_conv"

    def __init__(self, module: nn.Module):
        self.module = module
        self.conv = CausalConv(module, "conv")
        self.channels, self.kernel = self.conv.channels, self.conv.history + 1

    @property
    def kinds(self) -> tuple[Fixed]:
        return (self.conv.kind,)

    def forward(self, x, ctx: SegmentContext, past: LayerState, need_output: bool):
        """Over segment ``x`` [B, S, hidden] continuing the conv state [1, channels, kernel - 1] (copied per
        sequence for B > 1): B, C, x [B, channels, S] from in_proj, the conv over the state then B * x, the
        output out_proj(C * conv) [B, S, hidden]. The new conv state owns its storage."""
        m = self.module
        (conv_state,) = past
        b, c, xx = m.in_proj(x).transpose(1, 2).chunk(3, dim=1)
        conv_in, new_conv_state = self.conv.inputs(ctx, b * xx, conv_state)
        if not need_output:  # the state is all that is needed: no conv, no output projection
            return None, (new_conv_state,)
        y = c * self.conv(conv_in)
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
        """The conv's (``CausalConv.collective_bytes``): no recurrent summary."""
        return self.conv.collective_bytes(call, backward)

    def flops(self, tokens: int, prefix: int) -> float:
        """0: the depthwise conv's 2 x channels x kernel FLOPs per token are its weight's, which ``flops.
        active_params`` counts with the layer's weights (as for Mamba2's and Gated DeltaNet's convs); the products
        B * x and C * conv are elementwise (not counted)."""
        return 0.0
