"""Prompt state: what later tokens read from the prompt, per layer, in the adapter's own format.

Each layer keeps a tuple of tensors described by a ``StateSpec``:
- growing tensors hold one row per prompt token, shape [1, ..., S, d] (tokens on dim -2),
  e.g. attention K/V or an MLA latent; a segment's rows are appended;
- fixed tensors have a size independent of the length, e.g. a Gated DeltaNet conv and
  recurrent state; each segment replaces them.

A state is bound to the prompt it was captured from (``bind``), so it cannot be replayed
against another prompt of the same length.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .memory import storage_nbytes

LayerState = tuple[torch.Tensor, ...]


@dataclass(frozen=True)
class StateSpec:
    """Layout of one state tensor of a layer.

    ``shape``: for a growing tensor the shape of one token's row, tokens on dim -2 (e.g. K
    [1, kv_heads, 1, head_dim]); for a fixed tensor its whole shape. ``min_dtype``: the tensor
    is stored in ``promote_types(model dtype, min_dtype)`` (a float32 recurrent state); None:
    in the model's dtype. ``differentiable``: the exact backward sends a gradient into it.
    """

    growing: bool
    shape: tuple[int, ...]
    differentiable: bool = True
    min_dtype: torch.dtype | None = None

    def dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """dtype of the tensor in a model of ``model_dtype``."""
        return model_dtype if self.min_dtype is None else torch.promote_types(model_dtype, self.min_dtype)

    def numel(self, length: int) -> int:
        """Elements of the tensor for ``length`` prompt tokens."""
        return math.prod(self.shape) * (length if self.growing else 1)


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
        self.prompt_ids: torch.Tensor | None = None  # the whole prompt this state belongs to (``bind``)
        self.layers: list[list[torch.Tensor]] = []  # allocated by the first segment, in its dtype
        self.boundaries: list[list[LayerState] | None] | None = [] if keep_boundaries else None

    def current(self) -> list[LayerState] | None:
        """State after the ``filled`` tokens captured so far (views of the growing buffers); None when empty."""
        if not self.layers:
            return None
        return [
            tuple(t[..., : self.filled, :] if s.growing else t for s, t in zip(spec, row, strict=True))
            for spec, row in zip(self.specs, self.layers, strict=True)
        ]

    def append(self, segment: list[LayerState], seg_len: int) -> None:
        """Add the state a segment of ``seg_len`` tokens produced (rows for growing tensors, values for fixed)."""
        if self.boundaries is not None:
            self.boundaries.append(self.fixed() if self.layers else None)
        if not self.layers:
            self.layers = [
                [
                    t.new_empty(*t.shape[:-2], self.length, t.shape[-1]) if s.growing else t
                    for s, t in zip(spec, seg, strict=True)
                ]
                for spec, seg in zip(self.specs, segment, strict=True)
            ]
        for spec, row, seg in zip(self.specs, self.layers, segment, strict=True):
            for j, (s, t) in enumerate(zip(spec, seg, strict=True)):
                if s.growing:
                    row[j][..., self.filled : self.filled + seg_len, :] = t
                else:
                    row[j] = t
        self.filled += seg_len

    def at_boundary(self, index: int, start: int) -> list[LayerState] | None:
        """State at the start of segment ``index`` (token ``start``); needs ``keep_boundaries``.
        None before the first."""
        fixed = self.boundaries[index]
        if fixed is None:
            return None
        out = []
        for spec, row, kept in zip(self.specs, self.layers, fixed, strict=True):
            kept_iter = iter(kept)
            out.append(
                tuple(t[..., :start, :] if s.growing else next(kept_iter) for s, t in zip(spec, row, strict=True))
            )
        return out

    def fixed(self) -> list[LayerState]:
        """The fixed-size tensors as they stand now (growing ones omitted)."""
        return [
            tuple(t for s, t in zip(spec, row, strict=True) if not s.growing)
            for spec, row in zip(self.specs, self.layers, strict=True)
        ]

    def tensors(self) -> list[torch.Tensor]:
        return [t for row in self.layers for t in row]

    def nbytes(self) -> int:
        """Bytes of the storages the state keeps alive: growing buffers at full prompt length, fixed
        tensors and the kept boundary states, each storage counted once and whole (a view keeps
        its base alive). The prompt ids are not counted."""
        kept = [t for fixed in self.boundaries or () if fixed is not None for layer in fixed for t in layer]
        return storage_nbytes(self.tensors() + kept)

    def bind(self, prompt_ids: torch.Tensor) -> None:
        """Record the whole prompt ``prompt_ids`` [P] (a copy) this state was captured from."""
        self.prompt_ids = prompt_ids.clone()

    def check_prompt(self, prompt_ids: torch.Tensor) -> None:
        """Raise ValueError naming ``state`` unless this state is complete and was captured from ``prompt_ids`` [P]."""
        if self.filled != self.length:
            raise ValueError(f"state holds {self.filled} of its {self.length} rows; pass a state from capture_prompt")
        if self.prompt_ids is None or not torch.equal(self.prompt_ids, prompt_ids.to(self.prompt_ids)):
            raise ValueError("state was captured from other prompt_ids; pass the one capture_prompt returned for these")
