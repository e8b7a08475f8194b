"""verl-longstraw: capture what a micro-batch's rows share once, replay the rest, exact gradients.

The core (this package minus ``integration``) depends on torch and transformers only. The public names below load
on first use (PEP 562), so a light module (``verl_longstraw.machine``, ``verl_longstraw.configs``, the recipes'
command-line helpers) imports without the model code.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .api import capture_prompt as capture_prompt
    from .api import group_backward as group_backward
    from .api import group_log_probs as group_log_probs
    from .api import tree_backward as tree_backward
    from .api import tree_log_probs as tree_log_probs
    from .errors import UnsupportedModelError as UnsupportedModelError
    from .execute import GroupResult as GroupResult
    from .execute import GroupStats as GroupStats
    from .knobs import Knobs as Knobs

_HOMES = {
    "capture_prompt": ".api", "group_backward": ".api", "group_log_probs": ".api", "tree_backward": ".api",
    "tree_log_probs": ".api", "UnsupportedModelError": ".errors", "GroupResult": ".execute",
    "GroupStats": ".execute", "Knobs": ".knobs",
}
__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOMES[name], __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_HOMES])
