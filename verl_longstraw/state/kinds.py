"""State kinds: what one layer keeps for the tokens after it, and how that state is laid out along a tree path.

An adapter declares, per layer, a tuple of kinds (one per state tensor). Every other module (the path store,
the executor's gradient hand-off, the estimate) goes through the kind's methods, never through a test of which
kind it is, so a new kind (e.g. a sliding window of the last W rows) is one class here.

- ``Rows``: one row per token, tokens on dim -2 (attention K/V, an MLA latent, DSA indexer keys). Along a path
  the rows of the segments are one buffer in position order; a segment writes its rows after its parent's.
- ``Fixed``: a size independent of the tokens (Gated DeltaNet conv and recurrent state). Along a path each
  segment's value at its end is kept (its children start from it); a segment replaces its parent's.
- ``Window``: the rows of the last ``rows_kept`` tokens (a sliding-window attention layer's K/V: a window of W
  keys including the query's own leaves W - 1 earlier ones). Laid out as ``Fixed``: each segment's window at its
  end, which ``extend`` computes from its parent's window and its own rows (inside autograd, so the exact backward
  sends the window's gradient into both).

Storage protocol (per state tensor of a layer), used by ``store.PathState``:
``open(value, capacity, on_host)`` the storage at the first write (in host memory with ``on_host``: ``state_on_host``
keeps every kind's storage on the host, the chunk-boundary copies of the fixed-size states included, and
``state.stream`` brings a layer's to the device),
``write(storage, key, row_start, value)``, ``read(storage, parent, row_end)`` (the state a segment continues; a
root continues nothing), ``release(storage, key)``; the gradient sums mirror it (``add_grad``, ``grad_for``,
``release_grad``) in float32 (float64 for float64 state).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from . import host

Key = int  # a segment of the plan (``plan.Segment.index``)


def grad_dtype(dtype: torch.dtype) -> torch.dtype:
    """dtype of a gradient sum for state of ``dtype``: float32, float64 for float64 state."""
    return torch.promote_types(dtype, torch.float32)


def grad_zeros(shape: tuple[int, ...], like: torch.Tensor, on_host: bool) -> torch.Tensor:
    """Zeros of a gradient sum shaped ``shape``: on ``like``'s device, or in host memory of exactly their bytes
    (``host.host_zeros``: pinned where CUDA is available)."""
    dtype = grad_dtype(like.dtype)
    return host.host_zeros(shape, dtype) if on_host else like.new_zeros(shape, dtype=dtype)


@dataclass(frozen=True)
class StateKind:
    """One state tensor of a layer. ``shape``: see the subclass. ``min_dtype``: stored in
    ``promote_types(model dtype, min_dtype)`` (a float32 recurrent state); None: the model's dtype.
    ``differentiable``: the exact backward sends a gradient into it."""

    shape: tuple[int, ...]
    differentiable: bool = True
    min_dtype: torch.dtype | None = None

    def dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """dtype of the tensor in a model of ``model_dtype``."""
        return model_dtype if self.min_dtype is None else torch.promote_types(model_dtype, self.min_dtype)

    def nbytes(self, rows: int, model_dtype: torch.dtype) -> int:
        """Bytes of the tensor for ``rows`` tokens before it, in a model of ``model_dtype``."""
        raise NotImplementedError

    def row_nbytes(self, model_dtype: torch.dtype) -> int:
        """Bytes the tensor adds per token (0 for a size independent of the tokens)."""
        return self.nbytes(1, model_dtype) - self.nbytes(0, model_dtype)

    def empty(self, like: torch.Tensor) -> torch.Tensor:
        """The state before any token, on ``like``'s device in a model of ``like``'s dtype."""
        raise NotImplementedError

    # -- along a path (store.PathState) ------------------------------------------------
    def open(self, value: torch.Tensor, capacity: int, on_host: bool = False) -> Any:
        """The storage of a path of ``capacity`` rows, made at the first write of ``value``; in host memory with
        ``on_host``."""
        raise NotImplementedError

    def write(self, storage: Any, key: Key, row_start: int, value: torch.Tensor) -> None:
        raise NotImplementedError

    def read(self, storage: Any, parent: int, row_end: int) -> torch.Tensor:
        raise NotImplementedError

    def release(self, storage: Any, key: Key) -> None:
        raise NotImplementedError

    def tensors(self, storage: Any) -> list[torch.Tensor]:
        """The tensors a storage (or a gradient sum) holds; [] for None."""
        raise NotImplementedError

    def path_nbytes(self, rows: int, segments: int, model_dtype: torch.dtype) -> int:
        """Bytes held for a path of ``rows`` tokens whose ``segments`` segments each keep their state (what the
        memory estimate reads of a plan's ``held`` segments)."""
        raise NotImplementedError

    def add_grad(self, sums: Any, parent: int, row_end: int, grad: torch.Tensor, capacity: int, on_host: bool) -> Any:
        """Add ``grad`` (the gradient of ``read(storage, parent, row_end)``) into ``sums`` (None: none yet);
        returns the sums."""
        raise NotImplementedError

    def grad_for(self, sums: Any, key: Key, row_start: int, row_end: int) -> torch.Tensor | None:
        """The summed gradient of what segment ``key`` wrote (rows [row_start, row_end)); None if none."""
        raise NotImplementedError

    def release_grad(self, sums: Any, key: Key, row_start: int, row_end: int) -> None:
        raise NotImplementedError


@dataclass(frozen=True)
class Rows(StateKind):
    """One row per token: ``shape`` is one token's row, tokens on dim -2 (e.g. K [1, kv_heads, 1, head_dim]).
    Storage: one buffer [..., capacity, d] in position order (a path's rows are a view of its first rows); with
    ``on_host`` in host memory of exactly its bytes (``host.host_zeros``: pinned where CUDA is available)."""

    def nbytes(self, rows: int, model_dtype: torch.dtype) -> int:
        return math.prod(self.shape) * rows * self.dtype(model_dtype).itemsize

    def empty(self, like: torch.Tensor) -> torch.Tensor:
        return like.new_zeros(*self.shape[:-2], 0, self.shape[-1], dtype=self.dtype(like.dtype))

    def open(self, value: torch.Tensor, capacity: int, on_host: bool = False) -> torch.Tensor:
        shape = (*value.shape[:-2], capacity, value.shape[-1])
        return host.host_zeros(shape, value.dtype) if on_host else value.new_empty(shape)

    def write(self, storage: torch.Tensor, key: Key, row_start: int, value: torch.Tensor) -> None:
        storage[..., row_start : row_start + value.shape[-2], :] = value

    def read(self, storage: torch.Tensor, parent: int, row_end: int) -> torch.Tensor:
        return storage[..., :row_end, :]

    def release(self, storage: torch.Tensor, key: Key) -> None:
        """Nothing to free: a later segment overwrites the rows."""

    def tensors(self, storage: torch.Tensor | None) -> list[torch.Tensor]:
        return [] if storage is None else [storage]

    def path_nbytes(self, rows: int, segments: int, model_dtype: torch.dtype) -> int:
        """One buffer of the path's rows, however many segments wrote them."""
        return self.nbytes(rows, model_dtype)

    def add_grad(self, sums, parent, row_end, grad, capacity, on_host):
        if sums is None:
            sums = grad_zeros((*grad.shape[:-2], capacity, grad.shape[-1]), grad, on_host)
        sums[..., :row_end, :] += grad.to(sums.device)
        return sums

    def grad_for(self, sums, key, row_start, row_end):
        return None if sums is None else sums[..., row_start:row_end, :]

    def release_grad(self, sums, key, row_start, row_end) -> None:
        if sums is not None:
            sums[..., row_start:row_end, :] = 0  # a later segment's rows start from zero


class SegmentValues(dict):
    """A ``Fixed`` kind's storage: each segment's value at its end, by segment (``Key``); with ``on_host`` each value
    is a copy in host memory of exactly its bytes (``host.host_copy``), made as the segment is written."""

    def __init__(self, on_host: bool):
        super().__init__()
        self.on_host = on_host


@dataclass(frozen=True)
class Fixed(StateKind):
    """A size independent of the tokens: ``shape`` is the whole tensor's (e.g. a recurrent state [1, heads, k, v]).
    Storage: ``SegmentValues`` (the path's segments and nothing else: a chunked prompt's every chunk boundary)."""

    def nbytes(self, rows: int, model_dtype: torch.dtype) -> int:
        return math.prod(self.shape) * self.dtype(model_dtype).itemsize

    def empty(self, like: torch.Tensor) -> torch.Tensor:
        return like.new_zeros(self.shape, dtype=self.dtype(like.dtype))

    def open(self, value: torch.Tensor, capacity: int, on_host: bool = False) -> SegmentValues:
        return SegmentValues(on_host)

    def write(self, storage: SegmentValues, key: Key, row_start: int, value: torch.Tensor) -> None:
        storage[key] = host.host_copy(value) if storage.on_host else value

    def read(self, storage: dict, parent: int, row_end: int) -> torch.Tensor:
        return storage[parent]

    def release(self, storage: dict, key: Key) -> None:
        storage.pop(key, None)

    def tensors(self, storage: dict | None) -> list[torch.Tensor]:
        return [] if storage is None else list(storage.values())

    def path_nbytes(self, rows: int, segments: int, model_dtype: torch.dtype) -> int:
        """Each held segment's value at its end (at most ``nbytes(rows)`` each)."""
        return segments * self.nbytes(rows, model_dtype)

    def add_grad(self, sums, parent, row_end, grad, capacity, on_host):
        sums = {} if sums is None else sums
        if parent not in sums:
            sums[parent] = grad_zeros(tuple(grad.shape), grad, on_host)
        sums[parent] += grad.to(sums[parent].device)
        return sums

    def grad_for(self, sums, key, row_start, row_end):
        return None if sums is None else sums.get(key)

    def release_grad(self, sums, key, row_start, row_end) -> None:
        if sums is not None:
            sums.pop(key, None)


@dataclass(frozen=True)
class Window(Fixed):
    """The rows of the last ``rows_kept`` tokens: ``shape`` is one token's row, tokens on dim -2 (a sliding layer's
    K or V [1, kv_heads, 1, head_dim] with ``rows_kept`` = window - 1). Storage as ``Fixed``: each segment's window
    at its end [B, ..., min(tokens so far, rows_kept), d]."""

    rows_kept: int = 0

    def nbytes(self, rows: int, model_dtype: torch.dtype) -> int:
        return math.prod(self.shape) * min(rows, self.rows_kept) * self.dtype(model_dtype).itemsize

    def empty(self, like: torch.Tensor) -> torch.Tensor:
        return like.new_zeros(*self.shape[:-2], 0, self.shape[-1], dtype=self.dtype(like.dtype))

    def extend(self, past: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """The window after a segment: the last ``rows_kept`` of ``past`` [1 or B, ..., p, d] (the window before
        it, broadcast over the segment's B sequences) then ``rows`` [B, ..., t, d], in a tensor of its own (never a
        view of ``rows``, so the store keeps ``rows_kept`` rows alive, not the segment's t)."""
        from_past = max(0, self.rows_kept - rows.shape[-2])
        own = rows[..., rows.shape[-2] - min(rows.shape[-2], self.rows_kept) :, :]
        if not from_past or not past.shape[-2]:
            return own.clone()
        past = past[..., max(0, past.shape[-2] - from_past) :, :]
        return torch.cat([past.expand(rows.shape[0], *past.shape[1:]), own], dim=-2)
