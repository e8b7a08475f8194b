"""Host memory for the exact backward's state-gradient sums (``state_grad_on_host``): pinned at its exact size, and
filled by device-to-host copies that overlap the backward.

torch pins host memory (``pin_memory=True``) through its caching host allocator, which rounds every block up to a
power of two: sums of 88 GiB could pin up to twice that. ``host_zeros`` asks for the bytes exactly: anonymous memory
(whole pages, zero-filled) registered with CUDA (``cudaHostRegister`` through ``torch.cuda.cudart()``, the binding
torch's own ``torch.cuda._pin_memory_utils`` calls) where CUDA is available, and unregistered when the last tensor
on it is freed. ``host_memory`` counts what this process holds that way: the bytes asked, pinned on CUDA.

``StagedCopies``: state gradients arrive on the device one tensor at a time during a backward (a state leaf's
post-accumulate-grad hook). Each is copied into one pinned staging buffer on a copy stream of its own
(``non_blocking``) and added into its sum on the host only when the next one needs the buffer or the sums are read
(``flush``), so a copy runs while the backward computes the layers before it. The staging buffer holds the largest
state gradient (``state.store.staging_nbytes``); the estimate counts it beside the sums, and on the device the
copy's source, held until the copy lands, beside the gradients one layer's backward hands its state.
"""

from __future__ import annotations

import contextlib
import mmap
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context, as torch's own helper registers


@dataclass
class HostMemory:
    """Bytes of ``host_zeros`` memory this process holds now (``live``) and held at most since the last
    ``reset_peak`` (``peak``): pinned where CUDA is available."""

    live: int = 0
    peak: int = 0

    def reset_peak(self) -> None:
        self.peak = self.live


host_memory = HostMemory()


class _Block(mmap.mmap):
    """``nbytes`` of anonymous memory, registered with CUDA from ``register`` until it is freed."""

    def __new__(cls, nbytes: int):
        block = super().__new__(cls, -1, nbytes)
        block.nbytes, block.registered = nbytes, None
        host_memory.live += nbytes
        host_memory.peak = max(host_memory.peak, host_memory.live)
        return block

    def register(self, address: int) -> None:
        error = int(torch.cuda.cudart().cudaHostRegister(address, self.nbytes, _PORTABLE))
        if error:
            raise RuntimeError(f"cudaHostRegister of {self.nbytes} bytes failed with cudaError {error}: the host "
                               "cannot pin the state-gradient sums (ulimit -l, or state_grad_on_host: false)")
        self.registered = address

    def __del__(self, memory: HostMemory = host_memory, cuda=torch.cuda) -> None:  # bound now: runs at exit too
        memory.live -= self.nbytes
        if self.registered is not None:
            cuda.cudart().cudaHostUnregister(self.registered)


_STAND_INS: list[Callable[[tuple[int, ...], torch.dtype], torch.Tensor]] = []


@contextlib.contextmanager
def host_stand_in(allocate: Callable[[tuple[int, ...], torch.dtype], torch.Tensor]) -> Iterator[None]:
    """Inside the block ``host_zeros`` returns ``allocate(shape, dtype)`` instead, counted in ``host_memory`` until
    it is freed: a dry run's fake host tensors (``dryrun``), whose bytes are counted and never touched."""
    _STAND_INS.append(allocate)
    try:
        yield
    finally:
        _STAND_INS.remove(allocate)


def _release(nbytes: int) -> None:
    host_memory.live -= nbytes


def host_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Zeros [shape] of ``dtype`` in host memory of exactly their bytes, pinned where CUDA is available (module
    docstring); freed (and unpinned) with the last tensor on them."""
    nbytes = torch.Size(shape).numel() * dtype.itemsize
    if _STAND_INS:
        tensor = _STAND_INS[-1](shape, dtype)
        host_memory.live += nbytes
        host_memory.peak = max(host_memory.peak, host_memory.live)
        weakref.finalize(tensor.untyped_storage(), _release, nbytes)
        return tensor
    if not nbytes:
        return torch.zeros(shape, dtype=dtype)
    block = _Block(nbytes)
    tensor = torch.frombuffer(block, dtype=dtype, count=nbytes // dtype.itemsize).view(shape)
    if torch.cuda.is_available():
        block.register(tensor.data_ptr())
    return tensor


def host_copy(value: torch.Tensor) -> torch.Tensor:
    """A copy of ``value`` (any device) in ``host_zeros`` memory: its own bytes exactly, pinned where CUDA is
    available."""
    return host_zeros(tuple(value.shape), value.dtype).copy_(value)


class StagedCopies:
    """Copies of device tensors of at most ``nbytes`` each into the host, through one pinned staging buffer: ``add``
    starts one (asynchronous from CUDA), and hands the host copy to its callback once it has landed and before the
    next copy reuses the buffer, or at ``flush``. Host tensors go through the same buffer synchronously."""

    def __init__(self, nbytes: int):
        self.nbytes = nbytes
        self.buffer: torch.Tensor | None = None  # uint8 [nbytes], made at the first add
        self.stream: torch.cuda.Stream | None = None
        self.pending: tuple[torch.Tensor, torch.cuda.Event | None, Callable[[torch.Tensor], None]] | None = None

    def add(self, tensor: torch.Tensor, then: Callable[[torch.Tensor], None]) -> None:
        """Copy ``tensor`` to the host and call ``then(host copy)`` later (class docstring). The host copy is a view
        of the staging buffer, valid until ``then`` returns."""
        self.flush()
        size = tensor.numel() * tensor.element_size()
        if size > self.nbytes:
            raise ValueError(f"a state gradient of {size} bytes exceeds the {self.nbytes}-byte staging buffer sized "
                             "for the largest state tensor: the state layout and its sizing disagree")
        if self.buffer is None:
            self.buffer = host_zeros((self.nbytes,), torch.uint8)
        staged = self.buffer[:size].view(tensor.dtype).view(tensor.shape)
        event = None
        if tensor.device.type == "cuda":
            if self.stream is None:
                self.stream = torch.cuda.Stream(tensor.device)
            self.stream.wait_stream(torch.cuda.current_stream(tensor.device))  # after the kernels that made it
            with torch.cuda.stream(self.stream):
                staged.copy_(tensor, non_blocking=True)
            tensor.record_stream(self.stream)  # its memory is not reused before the copy has read it
            event = self.stream.record_event()
        else:
            staged.copy_(tensor)
        self.pending = (staged, event, then)

    def flush(self) -> None:
        """Hand the copy in flight, if any, to its callback once it has landed."""
        if self.pending is None:
            return
        staged, event, then = self.pending
        self.pending = None
        if event is not None:
            event.synchronize()
        then(staged)

    def tensors(self) -> list[torch.Tensor]:
        """The staging buffer ([] before the first copy)."""
        return [] if self.buffer is None else [self.buffer]
