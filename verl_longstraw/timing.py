"""Phase timing that counts device work: wall seconds including the kernels a phase queued.

On an accelerator a kernel launch returns before the kernel runs, so host clocks alone time
the launches. `Stopwatch` synchronizes the device when it starts and when it is read.
`phase(name)` marks each step of a walk for whoever observes them (`observe_phases`: the dry run's meters).
"""

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import ContextManager

import torch

_OBSERVERS: list[Callable[[str], ContextManager[None]]] = []


@contextlib.contextmanager
def observe_phases(enter: Callable[[str], ContextManager[None]]) -> Iterator[None]:
    """Inside the block, every walk step runs inside ``enter(phase)`` (phase: "capture", "replay", "recompute")."""
    _OBSERVERS.append(enter)
    try:
        yield
    finally:
        _OBSERVERS.remove(enter)


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """A walk step of phase ``name``, inside every observer's context."""
    with contextlib.ExitStack() as stack:
        for enter in list(_OBSERVERS):
            stack.enter_context(enter(name))
        yield


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on `device` if it is torch's accelerator (CPU work is done when issued)."""
    accelerator = torch.accelerator.current_accelerator()
    if accelerator is not None and device.type == accelerator.type:
        torch.accelerator.synchronize(device)


class Stopwatch:
    """Seconds since creation, counting the work queued on `device` before each `seconds()` call
    and not the work queued before creation."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        synchronize(device)
        self.start = time.perf_counter()

    def seconds(self) -> float:
        synchronize(self.device)
        return time.perf_counter() - self.start
