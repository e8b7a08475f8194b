"""Measure what autograd keeps for backward: bytes of saved tensors, live and at peak.

Each storage counts once however many graph nodes save it; parameters (and any tensor
passed in ``exclude``) are not counted, so the figure is the activation memory that a
training path holds, comparable across paths.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


class _Saved:
    """A saved tensor; dropping it (when its graph is freed) releases its share of the count."""

    __slots__ = ("tensor", "meter", "key")

    def __init__(self, tensor: torch.Tensor, meter: SavedTensorMeter, key: int):
        self.tensor, self.meter, self.key = tensor, meter, key

    def __del__(self) -> None:
        self.meter._release(self.key)


class SavedTensorMeter:
    """Context manager counting bytes saved for backward; ``peak`` and ``current`` in bytes."""

    def __init__(self, exclude: Iterable[torch.Tensor] = ()):
        self._excluded = {t.untyped_storage().data_ptr() for t in exclude}
        self._live: dict[int, list[int]] = {}  # storage pointer -> [references, bytes]
        self.current = 0
        self.peak = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, tensor: torch.Tensor):
        key = tensor.untyped_storage().data_ptr()
        if key in self._excluded or key == 0:
            return tensor
        entry = self._live.get(key)
        if entry is None:
            nbytes = tensor.untyped_storage().nbytes()
            self._live[key] = [1, nbytes]
            self.current += nbytes
            self.peak = max(self.peak, self.current)
        else:
            entry[0] += 1
        return _Saved(tensor, self, key)

    @staticmethod
    def _unpack(saved):
        return saved.tensor if isinstance(saved, _Saved) else saved

    def _release(self, key: int) -> None:
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
