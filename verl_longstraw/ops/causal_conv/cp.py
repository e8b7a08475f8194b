"""The causal depthwise convolution's input over one sequence split across the ranks of a context-parallel group
(the contract every rank keeps: ``parallel.sequence``): each rank reads the last inputs of the ranks before it."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ...parallel.comm import Group, all_gather, group_rank
from ...parallel.sequence import check_sizes


def sharded_conv_input(
    x: torch.Tensor, conv_state: torch.Tensor, group: Group, sizes: Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Input of a causal depthwise conv over this rank's tokens of a sequence split across ``group``.

    ``x`` [B, C, T_r]: this rank's inputs; ``conv_state`` [B, C, K-1]: the K-1 inputs before rank
    0's first token, replicated. Returns (conv_in [B, C, K-1+T_r]: the K-1 inputs before this rank's
    first token, then its own; the final conv state [B, C, K-1]: the last K-1 inputs of the whole
    sequence, replicated, in its own storage), both in x's dtype. Each rank contributes its last
    min(K-1, T_r) inputs to one all-gather. ``group=None`` is one process: ``[conv_state | x]``.
    """
    history = conv_state.shape[-1]
    if history < 1:
        raise ValueError(f"conv_state has {history} entries on its last dim: it must hold the K-1 >= 1 inputs before "
                         f"the first token")
    sizes = [x.shape[-1]] if group is None else sizes
    check_sizes("x", x.shape[-1], group, sizes)
    tails = all_gather(x[..., -min(history, x.shape[-1]):], group, [min(history, n) for n in sizes], dim=-1)
    rank = group_rank(group)
    before = torch.cat([conv_state.to(x.dtype), *tails[:rank]], dim=-1)[..., -history:]
    final = torch.cat([conv_state.to(x.dtype), *tails], dim=-1)[..., -history:].clone()
    return torch.cat([before, x], dim=-1), final
