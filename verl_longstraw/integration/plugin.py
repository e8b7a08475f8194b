"""veRL plugin entry point (`verl.plugins`: longstraw = verl_longstraw.integration.plugin).

Importing it registers, in this order: transformers' hub kernels off unless the job says
otherwise (``keep_hub_kernels_off``), the CPU platform (only where no accelerator is
found; it must precede veRL's first platform lookup), the `longstraw` engine backend, and
the `longstraw_sync` trainer mode. veRL logs plugin import errors at DEBUG only, which later
surface as "Unknown backend: longstraw"; here they are logged at ERROR with the traceback
and re-raised.
"""

import logging
import os

logger = logging.getLogger("verl_longstraw")
HUB_KERNELS = "USE_HUB_KERNELS"  # transformers' switch for hub kernels (on unless "0"/"false"/... from 5.25)


def keep_hub_kernels_off() -> None:
    """``USE_HUB_KERNELS=0`` in this process unless the job set it. transformers 5.25 requires the ``kernels``
    package and kernelizes every model ``from_pretrained`` builds; veRL 0.9.1 builds every rank's model but rank
    0's on the meta device, which ``kernels`` refuses (``ValueError: Unsupported device type 'meta'``), so its
    FSDP engines, stock ``fsdp2`` included, fail to start. An explicit value (e.g. ``USE_HUB_KERNELS=1``) is
    kept."""
    os.environ.setdefault(HUB_KERNELS, "0")


def register() -> None:
    """Register the platform, engine and trainer mode with veRL (idempotent)."""
    from .platform_cpu import register_cpu_platform

    keep_hub_kernels_off()

    register_cpu_platform()
    from . import engine, trainer  # noqa: F401  (importing them registers the engine backend and the trainer mode)


try:
    register()
except Exception:
    logger.exception(
        "verl_longstraw plugin failed to import: strategy=longstraw will be unavailable "
        "(veRL then reports 'Unknown backend: longstraw'). Fix the error above."
    )
    raise
