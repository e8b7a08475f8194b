"""veRL plugin entry point (`verl.plugins`: longstraw = verl_longstraw.integration.plugin).

Importing it registers, in this order: the CPU platform (only where no accelerator is
found; it must precede veRL's first platform lookup), the `longstraw` engine backend, and
the `longstraw_sync` trainer mode. veRL logs plugin import errors at DEBUG only, which later
surface as "Unknown backend: longstraw"; here they are logged at ERROR with the traceback
and re-raised.
"""

import logging

logger = logging.getLogger("verl_longstraw")


def register() -> None:
    """Register the platform, engine and trainer mode with veRL (idempotent)."""
    from .platform_cpu import register_cpu_platform

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
