"""Token mixer ops, one per kind of layer mixer (``base.MixerOp``): each owns its layer's state kinds, its forward
in one process and on a context-parallel group, and its costs (saved bytes, transients, FLOPs) for one call of a
plan step. An adapter declares one per layer; the memory estimate and the FLOP count sum them."""

from .attention import Attention, RowAttention, WindowAttention
from .base import (
    LayerCall,
    MixerOp,
    NoMixer,
    Saves,
    SegmentContext,
    apply_rope,
    layer_calls,
    layer_needs_output,
    per_sequence,
)
from .causal_conv import CausalConv, ShortConv
from .gated_delta import GatedDelta
from .kda import Kda
from .mamba1 import Mamba1
from .mamba2 import Mamba2
from .mla import LatentAttention

__all__ = [
    "Attention", "CausalConv", "GatedDelta", "Kda", "LatentAttention", "LayerCall", "Mamba1", "Mamba2", "MixerOp",
    "NoMixer", "RowAttention", "Saves", "SegmentContext", "ShortConv", "WindowAttention", "apply_rope", "layer_calls",
    "layer_needs_output", "per_sequence",
]
