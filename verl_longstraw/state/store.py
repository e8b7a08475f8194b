"""The state along one root-to-segment path of a plan, and its gradient sums.

A depth-first walk of the plan (``execute``) writes each segment's state after its parent's, reads the state a
segment continues (its parent's path), and releases a segment once it and its subtree are done; its rows are
then overwritten by the next sibling. So what is held at any time is one path's state: for ``Rows`` kinds one
buffer of the plan's longest path (``Plan.capacity`` rows on this rank), for ``Fixed`` kinds the value at the end
of each segment on the path. The exact backward sums d(loss)/d(state) the same way, in float32 (float64 for
float64 state), on the device or in host memory (``state.host``: pinned at its exact size, each gradient staged
through one pinned buffer of ``staging_nbytes`` and added on the host while the backward goes on).

``state_on_host``: every kind keeps its storage in host memory (the rows buffers, and each held segment's fixed-size
values: a chunked prompt's chunk-boundary copies), written as the captures produce it, and ``read``/``leaves`` give a
``stream.StreamedPath`` that brings one layer's state to the device at a time.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from ..memory import storage_nbytes
from .host import StagedCopies
from .kinds import Key, StateKind
from .stream import HostRows, StreamedPath, copies_landed

LayerState = tuple[torch.Tensor, ...]


def staging_nbytes(kinds: list[tuple[StateKind, ...]], capacity: int, model_dtype: torch.dtype) -> int:
    """Bytes of the pinned buffer host-side sums stage each state gradient through: the largest differentiable state
    tensor of ``capacity`` rows in a model of ``model_dtype`` (what the estimate counts, and ``PathState`` makes)."""
    return max((s.nbytes(capacity, model_dtype) for layer in kinds for s in layer if s.differentiable), default=0)


class PathState:
    """Per-layer state (``kinds[layer][j]`` describes tensor j of a layer) along a path of at most ``capacity``
    rows on this rank; ``on_host``: the gradient sums live in host memory; ``state_on_host``: the state does (module
    docstring)."""

    def __init__(self, kinds: list[tuple[StateKind, ...]], capacity: int, on_host: bool = False,
                 state_on_host: bool = False):
        self.kinds = kinds
        self.capacity = capacity
        self.on_host = on_host
        self.state_on_host = state_on_host
        self.device: torch.device | None = None  # where the layers run: the first write's
        self.storage: list[list[Any]] | None = None  # opened by the first write, in its dtype
        self.sums: list[list[Any]] = [[None] * len(layer) for layer in kinds]
        self.staged: StagedCopies | None = None  # on_host: made at the first write, sized for the model's dtype

    def write(self, key: Key, row_start: int, state: list[LayerState]) -> None:
        """Store segment ``key``'s state (rows for ``Rows`` kinds from ``row_start``, end values otherwise)."""
        if self.storage is None:
            self.device = state[0][0].device
            self.storage = [
                [kind.open(value, self.capacity, self.state_on_host) for kind, value in zip(layer, values, strict=True)]
                for layer, values in zip(self.kinds, state, strict=True)
            ]
            if self.on_host:  # the model's dtype: a state tensor's without a minimum dtype of its own
                pairs = [(kind, value) for layer, values in zip(self.kinds, state, strict=True)
                         for kind, value in zip(layer, values, strict=True)]
                model_dtype = next((v.dtype for k, v in pairs if k.min_dtype is None), pairs[0][1].dtype)
                self.staged = StagedCopies(staging_nbytes(self.kinds, self.capacity, model_dtype))
        elif self.state_on_host:
            copies_landed(self.device)
        for layer, storages, values in zip(self.kinds, self.storage, state, strict=True):
            for kind, storage, value in zip(layer, storages, values, strict=True):
                kind.write(storage, key, row_start, value)

    def _read(self, parent: Key, row_end: int) -> list[LayerState]:
        return [
            tuple(kind.read(storage, parent, row_end) for kind, storage in zip(layer, storages, strict=True))
            for layer, storages in zip(self.kinds, self.storage, strict=True)
        ]

    def read(self, parent: Key | None, row_end: int) -> list[LayerState] | StreamedPath | None:
        """The state after segment ``parent`` (its path's ``row_end`` rows on this rank); None before a root. With
        ``state_on_host`` a ``StreamedPath`` (the host rows brought to the device a layer at a time)."""
        if parent is None:
            return None
        past = self._read(parent, row_end)
        if not self.state_on_host:
            return past
        return StreamedPath([tuple(HostRows(value) for value in values) for values in past], self.device)

    def leaves(self, parent: Key | None, row_end: int, requires_grad: bool) -> list[LayerState] | StreamedPath | None:
        """``read(parent, row_end)`` as autograd leaves. With ``requires_grad`` the differentiable ones require
        grad and hand it straight into the sums as the backward produces it (a post-accumulate-grad hook adds a
        leaf's ``.grad`` and drops it): only the layers whose backward is running hold a state gradient in the
        model's dtype, never every layer's at once. With ``state_on_host`` the host rows are ``HostRows`` of a
        ``StreamedPath`` handing their gradient to the sums the same way (``HostRows.hand_grad``)."""
        if parent is None:
            return None
        out = []
        for j_layer, (layer, values) in enumerate(zip(self.kinds, self._read(parent, row_end), strict=True)):
            leaves = []
            for j, (kind, value) in enumerate(zip(layer, values, strict=True)):
                hand_grad = None
                if requires_grad and kind.differentiable:
                    hand_grad = functools.partial(self._hand_grad, j_layer, j, parent, row_end)
                if self.state_on_host:
                    leaves.append(HostRows(value, hand_grad))
                    continue
                leaf = value.detach()
                if hand_grad is not None:
                    leaf.requires_grad_()
                    leaf.register_post_accumulate_grad_hook(functools.partial(self._add_grad, hand_grad))
                leaves.append(leaf)
            out.append(tuple(leaves))
        return StreamedPath(out, self.device) if self.state_on_host else out

    @staticmethod
    def _add_grad(hand_grad, leaf: torch.Tensor) -> None:
        """Hand ``leaf.grad`` to ``hand_grad`` (``_hand_grad`` of the leaf's tensor); clears it."""
        hand_grad(leaf.grad)
        leaf.grad = None

    def _hand_grad(self, layer: int, j: int, parent: Key, row_end: int, grad: torch.Tensor) -> None:
        """Add ``grad`` (of tensor ``j`` of ``layer`` read by ``leaves(parent, row_end, True)``) into the sums, on
        the host once its staged copy has landed (``StagedCopies``)."""
        add = functools.partial(self._add_to_sums, layer, j, parent, row_end)
        if self.on_host:
            self.staged.add(grad, add)
        else:
            add(grad)

    def _add_to_sums(self, layer: int, j: int, parent: Key, row_end: int, grad: torch.Tensor) -> None:
        self.sums[layer][j] = self.kinds[layer][j].add_grad(self.sums[layer][j], parent, row_end, grad,
                                                            self.capacity, self.on_host)

    def flush(self) -> None:
        """Add the gradient still in flight to the host, if any, into its sum."""
        if self.staged is not None:
            self.staged.flush()

    def grads_for(self, key: Key, row_start: int, row_end: int) -> list[list[torch.Tensor | None]]:
        """The summed gradient of everything segment ``key`` wrote (rows [row_start, row_end)), per tensor."""
        self.flush()
        return [
            [kind.grad_for(sums, key, row_start, row_end) for kind, sums in zip(layer, layer_sums, strict=True)]
            for layer, layer_sums in zip(self.kinds, self.sums, strict=True)
        ]

    def release(self, key: Key, row_start: int, row_end: int) -> None:
        """Forget segment ``key``'s state and gradient sums (its subtree and its own backward are done)."""
        self.flush()
        if self.state_on_host and self.device is not None:
            copies_landed(self.device)  # a prefetch may still be reading the host values freed here
        for layer, storages, layer_sums in zip(self.kinds, self.storage or [[None] * len(k) for k in self.kinds],
                                               self.sums, strict=True):
            for kind, storage, sums in zip(layer, storages, layer_sums, strict=True):
                if storage is not None:
                    kind.release(storage, key)
                kind.release_grad(sums, key, row_start, row_end)

    def layer_tensors(self, layer: int) -> list[torch.Tensor]:
        """The tensors layer ``layer``'s state holds (buffers and kept end values); [] before the first write."""
        if self.storage is None:
            return []
        return [t for kind, storage in zip(self.kinds[layer], self.storage[layer], strict=True)
                for t in kind.tensors(storage)]

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor the state holds (buffers and kept end values)."""
        return [t for layer in range(len(self.kinds)) for t in self.layer_tensors(layer)]

    def grad_tensors(self) -> list[torch.Tensor]:
        """Every gradient sum the state holds, and the host staging buffer."""
        return [t for layer, layer_sums in zip(self.kinds, self.sums, strict=True)
                for kind, sums in zip(layer, layer_sums, strict=True) for t in kind.tensors(sums)] + (
            self.staged.tensors() if self.staged is not None else [])

    def nbytes(self) -> int:
        """Bytes of the storages the state keeps alive (each counted once and whole; host rows included); the token
        ids not counted."""
        return storage_nbytes(self.tensors())

    def host_nbytes(self) -> int:
        """Bytes of the storages kept in host memory (``state_on_host``: all of them)."""
        return self.nbytes() if self.state_on_host else 0

    def layer_nbytes(self, layer: int) -> int:
        """Bytes of the storages layer ``layer``'s state keeps alive."""
        return storage_nbytes(self.layer_tensors(layer))

    def grad_nbytes(self) -> int:
        """Bytes of the gradient sums (device or host; on the host with the staging buffer)."""
        return storage_nbytes(self.grad_tensors())
