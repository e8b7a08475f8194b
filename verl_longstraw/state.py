"""Prompt state: what later tokens read from the prompt, per layer, in the adapter's own format.

Each layer keeps a tuple of tensors described by a ``StateSpec``:
- growing tensors hold one row per prompt token, shape [1, ..., S, d] (tokens on dim -2),
  e.g. attention K/V or an MLA latent; a segment's rows are appended;
- fixed tensors have a size independent of the length, e.g. a Gated DeltaNet conv and
  recurrent state; each segment replaces them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

LayerState = tuple[torch.Tensor, ...]


@dataclass(frozen=True)
class StateSpec:
    growing: bool
    differentiable: bool = True


class PromptState:
    """Per-layer state of a prompt of ``length`` tokens, filled segment by segment.

    Growing tensors live in buffers preallocated for the whole prompt, so reading the
    state of the first ``s`` tokens is a view, never a copy. With ``keep_boundaries`` the
    fixed tensors at the start of every segment are kept (the reverse sweep of the
    chunked exact backward restarts each chunk from them).
    """

    def __init__(
        self, specs: list[tuple[StateSpec, ...]], length: int, keep_boundaries: bool, chunk_size: int | None = None
    ):
        self.specs = specs
        self.length = length
        self.chunk_size = chunk_size  # segment length of the capture (None: one segment)
        self.filled = 0
        self.layers: list[list[torch.Tensor]] = []  # allocated by the first segment, in its dtype
        self.boundaries: list[list[LayerState] | None] | None = [] if keep_boundaries else None

    def current(self) -> list[LayerState] | None:
        """State after the ``filled`` tokens captured so far (views of the growing buffers); None when empty."""
        if not self.layers:
            return None
        return [
            tuple(t[..., : self.filled, :] if s.growing else t for s, t in zip(spec, row))
            for spec, row in zip(self.specs, self.layers)
        ]

    def append(self, segment: list[LayerState], seg_len: int) -> None:
        """Add the state a segment of ``seg_len`` tokens produced (rows for growing tensors, values for fixed)."""
        if self.boundaries is not None:
            self.boundaries.append(self.fixed() if self.layers else None)
        if not self.layers:
            self.layers = [
                [t.new_empty(*t.shape[:-2], self.length, t.shape[-1]) if s.growing else t for s, t in zip(spec, seg)]
                for spec, seg in zip(self.specs, segment)
            ]
        for spec, row, seg in zip(self.specs, self.layers, segment):
            for j, (s, t) in enumerate(zip(spec, seg)):
                if s.growing:
                    row[j][..., self.filled : self.filled + seg_len, :] = t
                else:
                    row[j] = t
        self.filled += seg_len

    def at_boundary(self, index: int, start: int) -> list[LayerState] | None:
        """State at the start of segment ``index`` (token ``start``); needs ``keep_boundaries``. None before the first."""
        fixed = self.boundaries[index]
        if fixed is None:
            return None
        out = []
        for spec, row, kept in zip(self.specs, self.layers, fixed):
            kept_iter = iter(kept)
            out.append(tuple(t[..., :start, :] if s.growing else next(kept_iter) for s, t in zip(spec, row)))
        return out

    def fixed(self) -> list[LayerState]:
        """The fixed-size tensors as they stand now (growing ones omitted)."""
        return [tuple(t for s, t in zip(spec, row) if not s.growing) for spec, row in zip(self.specs, self.layers)]

    def tensors(self) -> list[torch.Tensor]:
        return [t for row in self.layers for t in row]

    def nbytes(self) -> int:
        """Bytes held by the state (growing buffers at full prompt length)."""
        return sum(t.numel() * t.element_size() for t in self.tensors())
