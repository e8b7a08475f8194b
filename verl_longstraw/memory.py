"""Measure memory by storages: what autograd keeps for backward (live and at peak), and what a
set of tensors keeps alive.

A tensor that is a view keeps its whole storage alive, so both count whole storages, each
once however many tensors (or graph nodes) refer to it. The meter does not count parameters
(or any tensor passed in ``exclude``), so its figure is the activation memory that a training
path holds, comparable across paths.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


def storage_key(tensor: torch.Tensor) -> tuple[torch.device, int]:
    """Identity of the storage behind ``tensor`` (shared by all its views)."""
    return tensor.device, tensor.untyped_storage().data_ptr()


def storage_nbytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors``: each counted once and whole."""
    return sum({storage_key(t): t.untyped_storage().nbytes() for t in tensors}.values())


class _Saved:
    """A saved tensor; dropping it (when its graph is freed) releases its share of the count."""

    __slots__ = ("tensor", "meter", "key")

    def __init__(self, tensor: torch.Tensor, meter: SavedTensorMeter, key: tuple[torch.device, int]):
        self.tensor, self.meter, self.key = tensor, meter, key

    def __del__(self) -> None:
        self.meter._release(self.key)


class SavedTensorMeter:
    """Context manager counting bytes saved for backward; ``peak`` and ``current`` in bytes."""

    def __init__(self, exclude: Iterable[torch.Tensor] = ()):
        self._excluded = {storage_key(t) for t in exclude}
        self._live: dict[tuple[torch.device, int], list[int]] = {}  # storage -> [references, bytes]
        self.current = 0
        self.peak = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, tensor: torch.Tensor):
        key = storage_key(tensor)
        if key in self._excluded or key[1] == 0:
            return tensor
        entry = self._live.get(key)
        if entry is None:
            nbytes = tensor.untyped_storage().nbytes()
            self._live[key] = [1, nbytes]
            self.current += nbytes
            self.peak = max(self.peak, self.current)
        else:
            entry[0] += 1
        return _Saved(tensor.detach(), self, key)  # detached: a saved output would otherwise keep its own graph alive

    @staticmethod
    def _unpack(saved):
        return saved.tensor if isinstance(saved, _Saved) else saved

    def _release(self, key: tuple[torch.device, int]) -> None:
        entry = self._live[key]
        entry[0] -= 1
        if entry[0] == 0:
            self.current -= entry[1]
            del self._live[key]

    def __enter__(self) -> SavedTensorMeter:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)


def parameter_meter(model: torch.nn.Module) -> SavedTensorMeter:
    """A meter that ignores ``model``'s parameters."""
    return SavedTensorMeter(exclude=model.parameters())
