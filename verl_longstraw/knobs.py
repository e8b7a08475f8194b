"""The knobs of a walk: how a plan cuts and batches its rows and what a backward walk computes and keeps where.

One frozen value (``Knobs``) is taken by every entry point (``api``: ``knobs=``) and plan builder (``plan``), and
built once from the veRL config by the engine (``integration.config.LongStrawConfig.knobs``).
"""

from __future__ import annotations

from dataclasses import dataclass

REPLAY_TOKENS = 8192  # default token budget of one replay batch: k leaves padded to the longest, k x T_max
PROMPT_GRAD_MODES = ("exact", "detached")
PLAN_KNOBS = ("chunk_size", "response_chunk_size", "min_shared_tokens", "replay_tokens")  # what a plan reads


def _positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


@dataclass(frozen=True)
class Knobs:
    """The knobs of a walk (a frozen value; ``__post_init__`` raises ValueError naming the field and the fix).

    Each field is the veRL config key of the same name (``actor_rollout_ref.actor.longstraw.*``), described once,
    in ``integration.config.LongStrawConfig``'s field docs (docs/knobs.md); only ``min_shared_tokens`` has another
    default here (1).
    """

    chunk_size: int | None = None
    response_chunk_size: int | None = None
    min_shared_tokens: int = 1
    replay_tokens: int = REPLAY_TOKENS
    prompt_grad: str = "exact"
    state_grad_on_host: bool = False
    state_on_host: bool = False

    def __post_init__(self) -> None:
        if self.chunk_size is not None and not _positive_int(self.chunk_size):
            raise ValueError("chunk_size must be a positive int (input positions per captured segment) or None (the "
                             f"whole prompt at once), got {self.chunk_size!r}")
        if self.response_chunk_size is not None and not _positive_int(self.response_chunk_size):
            raise ValueError("response_chunk_size must be a positive int (positions per segment of a long response) or "
                             f"None (each response replayed whole), got {self.response_chunk_size!r}")
        if not _positive_int(self.min_shared_tokens):
            raise ValueError("min_shared_tokens must be a positive int (tokens of common prefix for rows to share its "
                             f"segments), got {self.min_shared_tokens!r}")
        if not _positive_int(self.replay_tokens):
            raise ValueError("replay_tokens must be a positive int (tokens of one replay batch; 1: one response at a "
                             f"time), got {self.replay_tokens!r}")
        if self.prompt_grad not in PROMPT_GRAD_MODES:
            raise ValueError(f"prompt_grad must be one of {PROMPT_GRAD_MODES}, got {self.prompt_grad!r}")
        if not isinstance(self.state_grad_on_host, bool):
            raise ValueError(f"state_grad_on_host must be True or False, got {self.state_grad_on_host!r}")
        if not isinstance(self.state_on_host, bool):
            raise ValueError(f"state_on_host must be True or False, got {self.state_on_host!r}")

    def plans_like(self, other: Knobs) -> bool:
        """Whether a plan built with ``other`` is the plan built with these: the knobs a plan reads
        (``PLAN_KNOBS``) agree."""
        return all(getattr(self, name) == getattr(other, name) for name in PLAN_KNOBS)
