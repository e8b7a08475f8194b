"""Phase timing that counts device work: wall seconds including the kernels a phase queued.

On an accelerator a kernel launch returns before the kernel runs, so host clocks alone time
the launches. `Stopwatch` synchronizes the device when it starts and when it is read.
"""

import time

import torch


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
