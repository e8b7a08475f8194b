"""A path's prompt state in host memory, brought to the device one layer at a time (``state_on_host``).

With ``state_on_host`` the store (``store.PathState``) keeps every state kind in host memory, pinned where CUDA is
available (``Rows``: K/V, MLA latents, DSA index keys; ``Fixed``, ``Window``: each held segment's value, a chunked
prompt's chunk-boundary copies among them), and the state a segment continues is a ``StreamedPath``: a sequence of
per-layer states whose item ``l`` is layer l's state copied to the device when the walk's layer l asks for it
(``execute.run_segment`` reads ``past[l]`` right before it runs the layer), with the next layer's copy already issued
(on CUDA on a copy stream of its own, so it overlaps layer l; elsewhere at once).

A forward with autograd saves views of a layer's state for its backward (the attention ops save the prefix K/V),
which would hold every layer's copy until the backward. Inside ``saving_as_host_rows(past)`` a saved tensor that is
(a view of) a copy is packed as a reference to its layer (``torch.autograd.graph.saved_tensors_hooks``: its layer,
tensor and view geometry) and unpacked in the backward by copying that layer's state to the device again, the layer
before it (in backward order) issued at the same time. So one or two layers' state is on the device at a time
(``resident`` counts them).

Exact mode: a copy that must hand a gradient to the store goes through ``_HandGrad``, whose backward hands the
gradient summed over the copy's uses to ``HostRows.hand_grad`` (the store adds it into its float32 sums as it does
a state leaf's ``.grad``); the copy is no autograd leaf, so the graph does not keep it alive.

On CPU the host and the device are the same memory but the copies are made all the same (new storage, the host
rows' strides), so a CPU run exercises every step and computes what the resident walk computes, bit for bit.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

GradHandler = Callable[[torch.Tensor], None]


@dataclass(frozen=True)
class HostRows:
    """One state tensor of a layer kept in host memory: ``rows`` (a rows kind's [..., row_end, d], a view of the
    store's host buffer; a fixed-size kind's whole value); ``hand_grad`` (exact mode, a differentiable kind) takes
    d(loss)/d(rows) on the device once a backward has summed it over the rows' uses; None: the rows are a constant."""

    rows: torch.Tensor
    hand_grad: GradHandler | None = None


@dataclass
class Resident:
    """Layers whose streamed rows are on the device now (``live``: (path id, layer) -> live copies) and the most
    layers at once since the last ``reset_peak`` (``peak``)."""

    live: dict[tuple[int, int], int] = field(default_factory=dict)
    peak: int = 0

    def reset_peak(self) -> None:
        self.peak = len(self.live)

    def copied(self, key: tuple[int, int]) -> None:
        """A copy of layer ``key``'s rows was made on the device."""
        self.live[key] = self.live.get(key, 0) + 1
        self.peak = max(self.peak, len(self.live))

    def freed(self, key: tuple[int, int]) -> None:
        """A copy of layer ``key``'s rows was freed (its storage's finalizer)."""
        self.live[key] -= 1
        if not self.live[key]:
            del self.live[key]


resident = Resident()

_COPY_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _copy_stream(device: torch.device) -> torch.cuda.Stream | None:
    """The side stream host-to-device copies run on (one per CUDA device); None off CUDA (copies run at once). Made
    again where the one kept is not of the ``torch.cuda.Stream`` class in force: a dry run's (``fake_cuda``) stand-in
    does not outlive its run, nor a real stream enter one."""
    if device.type != "cuda":
        return None
    if not isinstance(_COPY_STREAMS.get(device), torch.cuda.Stream):
        _COPY_STREAMS[device] = torch.cuda.Stream(device)
    return _COPY_STREAMS[device]


def copies_landed(device: torch.device) -> None:
    """Wait until every copy issued to ``device`` has read its host rows (before the store overwrites host rows a
    prefetch of another path may still be reading: a sibling segment's, after its parent's rows)."""
    stream = _COPY_STREAMS.get(device)
    if isinstance(stream, torch.cuda.Stream):  # none issued on another class's stream (``_copy_stream``)
        stream.synchronize()


def _copy_rows(destination: torch.Tensor, source: torch.Tensor, non_blocking: bool) -> None:
    """Copy ``source`` into ``destination`` (the same strides): a contiguous tensor (a fixed-size value) in one copy;
    rows [..., n, d] of a buffer [..., capacity, d] one contiguous [n, d] block per leading index: each block one
    direct copy from pinned memory."""
    if source.is_contiguous():
        destination.copy_(source, non_blocking=non_blocking)
        return
    rows = source.shape[-2:]
    for to, of in zip(destination.view(-1, *rows), source.view(-1, *rows), strict=True):
        to.copy_(of, non_blocking=non_blocking)


@dataclass
class _Copies:
    """One layer's device copies and, on CUDA, the event after which they have landed."""

    tensors: list[torch.Tensor]
    landed: torch.cuda.Event | None


@dataclass(frozen=True)
class _SavedRows:
    """A saved tensor packed as a view of tensor ``j`` of layer ``layer``'s device copy."""

    layer: int
    j: int
    size: torch.Size
    stride: tuple[int, ...]
    offset: int


class _HandGrad(torch.autograd.Function):
    """``rows`` as they are (a view), whose gradient, summed over its uses, goes to ``hand`` instead of to a leaf;
    ``anchor`` (an empty tensor requiring grad) makes the output require grad."""

    @staticmethod
    def forward(ctx, anchor: torch.Tensor, rows: torch.Tensor, hand: GradHandler) -> torch.Tensor:
        ctx.hand = hand
        return rows

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[None, None, None]:
        ctx.hand(grad)
        return None, None, None


class StreamedPath(Sequence):
    """The state a segment continues, per layer (module docstring): ``layers[l][j]`` the ``HostRows`` of tensor j of
    layer l (as ``PathState.read``/``leaves`` give it); ``device``: where layers run. Item ``l`` is layer l's state
    on the device, the ``HostRows`` copied (and, with a ``hand_grad``, behind ``_HandGrad``)."""

    def __init__(self, layers: list[tuple[HostRows, ...]], device: torch.device):
        self.layers = layers
        self.device = device
        self.streamed = [idx for idx, layer in enumerate(layers) if layer]  # the layers with a state
        self.copies: dict[int, _Copies] = {}
        # a copy's storage by identity (id of the storage object, which the entry keeps alive: not its address, which
        # a fake tensor's storage does not have) -> (the storage, layer, j)
        self.storages: dict[int, tuple[torch.UntypedStorage, int, int]] = {}
        self.anchor: torch.Tensor | None = None
        self.last_read: int | None = None  # the position in ``streamed`` of the layer ``__getitem__`` gave last
        if any(t.hand_grad is not None for layer in layers for t in layer):
            self.anchor = torch.empty(0, device=device, requires_grad=True)

    def __len__(self) -> int:
        return len(self.layers)

    def __getitem__(self, idx: int) -> tuple[torch.Tensor, ...]:
        """Layer ``idx``'s state on the device, the next streamed layer's copy issued in the order the layers are
        read: up in a forward; down when the read is of the streamed layer just below the last one read (a
        checkpointed layer's recompute in the backward, which reads the layers from the top down)."""
        if idx not in self.streamed:
            return self.layers[idx]
        position = self.streamed.index(idx)
        going_down = self.last_read is not None and position == self.last_read - 1
        self.last_read = position
        copies = self._take(idx, forward=not going_down)
        return tuple(copy if value.hand_grad is None else _HandGrad.apply(self.anchor, copy, value.hand_grad)
                     for value, copy in zip(self.layers[idx], copies, strict=True))

    def _take(self, idx: int, forward: bool) -> list[torch.Tensor]:
        """Layer ``idx``'s copies, landed for the current stream; every other layer's dropped but the next one's in
        the walk's order (``forward``: the next layer up, else the next down), which is issued now. The others are
        dropped first: a backward that skips a layer (nothing of its copy saved) must not hold three."""
        position = self.streamed.index(idx)
        following = position + 1 if forward else position - 1
        ahead = self.streamed[following] if 0 <= following < len(self.streamed) else None
        for layer in list(self.copies):
            if layer not in (idx, ahead):
                self._forget(layer)
        if idx not in self.copies:
            self._issue(idx)
        copies = self.copies[idx]
        if copies.landed is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(copies.landed)
            for t in copies.tensors:
                t.record_stream(current)  # its memory is not reused before the current stream has read it
        if ahead is not None and ahead not in self.copies:
            self._issue(ahead)
        return copies.tensors

    def _issue(self, idx: int) -> None:
        """Start copying layer ``idx``'s host state to the device (on CUDA on the copy stream, else at once)."""
        stream = _copy_stream(self.device)
        tensors: list[torch.Tensor] = []
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            for j, value in enumerate(self.layers[idx]):
                rows = value.rows
                copy = torch.empty_strided(rows.shape, rows.stride(), dtype=rows.dtype, device=self.device)
                _copy_rows(copy, rows, non_blocking=stream is not None)
                key = (id(self), idx)
                resident.copied(key)
                weakref.finalize(copy.untyped_storage(), resident.freed, key)
                storage = copy.untyped_storage()
                if storage.nbytes():  # an empty copy is no one's view
                    self.storages[id(storage)] = (storage, idx, j)
                tensors.append(copy)
        self.copies[idx] = _Copies(tensors, stream.record_event() if stream is not None else None)

    def _forget(self, idx: int) -> None:
        """Drop this path's references to layer ``idx``'s copies (freed once nothing else uses them)."""
        for t in self.copies.pop(idx).tensors:
            self.storages.pop(id(t.untyped_storage()), None)

    # -- saved for backward ----------------------------------------------------------------------------------------
    def _pack(self, tensor: torch.Tensor) -> torch.Tensor | _SavedRows:
        """A saved tensor: a reference if it is a view of a copy of this path's (in its dtype), else itself, detached
        (autograd saves a node's own output without its grad_fn; kept with it, the tensor and the node would hold
        each other, a cycle through C++ that Python's collector never frees)."""
        found = None
        if tensor.device == self.device and tensor.layout == torch.strided:
            storage = tensor.untyped_storage()
            found = self.storages.get(id(storage))
            found = found if found is not None and found[0] is storage else None
        if found is None or self.copies[found[1]].tensors[found[2]].dtype != tensor.dtype:
            return tensor.detach()
        return _SavedRows(found[1], found[2], tensor.size(), tensor.stride(), tensor.storage_offset())

    def _unpack(self, saved: torch.Tensor | _SavedRows) -> torch.Tensor:
        """A saved tensor for the backward: a reference's view of its layer's rows, copied to the device again if
        they are not there (the layer below issued: backward order)."""
        if isinstance(saved, torch.Tensor):
            return saved
        copy = self._take(saved.layer, forward=False)[saved.j]
        return copy.as_strided(saved.size, saved.stride, saved.offset)


def saving_as_host_rows(past: Sequence | None) -> contextlib.AbstractContextManager:
    """Inside: what autograd saves of ``past``'s device copies is packed as references to its host rows (module
    docstring); nothing changes unless ``past`` is a ``StreamedPath``."""
    if not isinstance(past, StreamedPath):
        return contextlib.nullcontext()
    return torch.autograd.graph.saved_tensors_hooks(past._pack, past._unpack)

