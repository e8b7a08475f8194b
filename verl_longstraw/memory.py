"""Measure memory by storages: what autograd keeps for backward (live and at peak), what a
set of tensors keeps alive, and what ops allocate while a block runs (live and at peak).

A tensor that is a view keeps its whole storage alive, so all three count whole storages, each
once however many tensors (or graph nodes) refer to it. The saved-tensor meter does not count parameters
(or any tensor passed in ``exclude``), so its figure is the activation memory that a training
path holds, comparable across paths.

``AllocationMeter`` is the one user of ``torch.utils._python_dispatch.TorchDispatchMode`` (tests/test_estimate.py
pins what it relies on).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode


def storage_key(tensor: torch.Tensor) -> tuple[torch.device, int]:
    """Identity of the storage behind ``tensor`` (shared by all its views) while it lives: its storage object's
    address, which a dry run's fake tensors have too (their data pointers are all 0)."""
    return tensor.device, tensor.untyped_storage()._cdata


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


class AllocationMeter(TorchDispatchMode):
    """Context manager counting the storages that ops allocate while it is active: ``current`` bytes still alive
    and their ``peak``, in bytes. A storage counts from the op that returns it until it is freed (a weakref
    finalizer); views and in-place results of storages that existed before are not new. Counts what the dispatcher
    sees: an op's outputs, not the scratch a kernel allocates and frees inside itself. CPU autograd runs a
    backward on the calling thread, so a ``torch.autograd.grad`` inside the block is counted."""

    def __init__(self) -> None:
        super().__init__()
        self._live: dict[tuple[torch.device, int], int] = {}
        self.current = 0
        self.peak = 0

    def _release(self, key: tuple[torch.device, int]) -> None:
        self.current -= self._live.pop(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        given = {storage_key(x) for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)}
        for x in pytree.tree_leaves(out):
            if not isinstance(x, torch.Tensor) or not x.untyped_storage().nbytes():
                continue
            key = storage_key(x)
            if key not in given and key not in self._live:
                storage = x.untyped_storage()
                self._live[key] = storage.nbytes()
                self.current += storage.nbytes()
                weakref.finalize(storage, self._release, key)
        self.peak = max(self.peak, self.current)
        return out
