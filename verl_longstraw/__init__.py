"""verl-longstraw: capture a GRPO group's shared prompt once, replay its responses, exact gradients.

The core (this package minus ``integration``) depends on torch and transformers only.
"""

from .api import capture_prompt, group_backward, group_log_probs
from .errors import UnsupportedModelError
from .replay import GroupStats

__all__ = ["GroupStats", "UnsupportedModelError", "capture_prompt", "group_backward", "group_log_probs"]
