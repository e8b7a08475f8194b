"""Per-layer state: its kinds (``kinds``: layout, gradient and bytes of each kind) and the path store (``store``)."""

from .kinds import Fixed, Rows, StateKind, Window
from .store import LayerState, PathState

__all__ = ["Fixed", "LayerState", "PathState", "Rows", "StateKind", "Window"]
