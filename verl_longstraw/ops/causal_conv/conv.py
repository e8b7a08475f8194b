"""The causal depthwise convolution in one process: its input after the conv state, and the conv itself."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def conv_input(x: torch.Tensor, conv_state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Input of a causal depthwise conv of kernel K over ``x`` [B, C, S] after the K-1 inputs of ``conv_state``
    [B, C, K-1]: (conv_in [B, C, K-1+S], the next conv state [B, C, K-1]: the last K-1 inputs, owning its
    storage). Over a sequence split across ranks: ``ops.causal_conv.cp.sharded_conv_input``."""
    conv_in = torch.cat([conv_state, x], dim=-1)
    return conv_in, conv_in[..., -conv_state.shape[-1] :].clone()


def causal_conv(conv_in: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The depthwise conv of ``weight`` [C, 1, K] (and ``bias`` [C]) over ``conv_in`` [B, C, K-1+S] without padding:
    [B, C, S], token t reading inputs t .. t+K-1 of ``conv_in`` (its K-1 before and itself)."""
    return F.conv1d(conv_in, weight, bias, groups=weight.shape[0])
