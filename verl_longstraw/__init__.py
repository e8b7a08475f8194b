"""verl-longstraw: capture what a micro-batch's rows share once, replay the rest, exact gradients.

The core (this package minus ``integration``) depends on torch and transformers only.
"""

from .api import capture_prompt, group_backward, group_log_probs, tree_backward, tree_log_probs
from .errors import UnsupportedModelError
from .execute import GroupResult, GroupStats
from .knobs import Knobs

__all__ = [
    "GroupResult", "GroupStats", "Knobs", "UnsupportedModelError", "capture_prompt", "group_backward",
    "group_log_probs", "tree_backward", "tree_log_probs",
]
