"""LongStraw knobs and the actor config that carries them (`actor_rollout_ref.actor.longstraw.*`)."""

from dataclasses import dataclass, field
from typing import Any, Optional

from verl.base_config import BaseConfig
from verl.workers.config import FSDPActorConfig, FSDPCriticConfig

STRATEGY = "longstraw"
PROMPT_GRAD_MODES = ("exact", "detached")


@dataclass
class LongStrawConfig(BaseConfig):
    """LongStraw settings.

    Args:
        prompt_grad: "exact" (default) also backpropagates d(loss)/d(prompt state) through a
            recompute of the prompt, giving the standard gradient; "detached" drops that term
            (cheaper, biased: the prompt positions get no gradient).
        chunk_size: prompt tokens per chunk for capture and recompute; None (default) processes
            the whole prompt at once. Smaller chunks bound the prompt graph's memory.
    """

    prompt_grad: str = "exact"
    chunk_size: Optional[int] = None

    def __post_init__(self) -> None:
        if self.prompt_grad not in PROMPT_GRAD_MODES:
            raise ValueError(
                f"actor_rollout_ref.actor.longstraw.prompt_grad={self.prompt_grad!r} is not supported; "
                f"use one of {PROMPT_GRAD_MODES}."
            )
        if self.chunk_size is not None and (isinstance(self.chunk_size, bool) or int(self.chunk_size) < 1):
            raise ValueError(
                f"actor_rollout_ref.actor.longstraw.chunk_size={self.chunk_size!r} must be a positive integer "
                "or null (whole prompt at once)."
            )


def as_longstraw_config(value: Any) -> LongStrawConfig:
    """Accept a LongStrawConfig, a mapping of its fields, or None (defaults)."""
    if value is None:
        return LongStrawConfig()
    if isinstance(value, LongStrawConfig):
        return value
    unknown = sorted(set(value) - {"prompt_grad", "chunk_size", "_target_"})
    if unknown:
        raise ValueError(
            f"Unknown key(s) {unknown} in actor_rollout_ref.actor.longstraw; "
            "supported: prompt_grad (exact|detached), chunk_size (int or null)."
        )
    return LongStrawConfig(prompt_grad=value.get("prompt_grad", "exact"), chunk_size=value.get("chunk_size"))


def check_supported(cfg: Any, where: str = "actor_rollout_ref.actor") -> None:
    """Reject settings the LongStraw engine cannot honour; `cfg` is an actor or FSDP engine config."""
    unsupported = {
        "ulysses_sequence_parallel_size": (1, "sequence parallelism is not supported; set it to 1"),
        "use_fused_kernels": (False, "fused kernels need full-sequence logits; set it to false"),
        "use_prefix_grouper": (False, "LongStraw already shares the prompt; set it to false"),
        "calculate_sum_pi_squared": (False, "sum of pi^2 over the vocabulary is not produced; set it to false"),
    }
    for name, (ok, why) in unsupported.items():
        value = cfg.get(name, ok)
        if value not in (ok, None):
            raise ValueError(f"{where}.{name}={value!r} with strategy=longstraw: {why}.")


def unserved_role_error(field: str) -> ValueError:
    """The error for `<field>=longstraw` on a role other than the actor or the reference policy."""
    return ValueError(
        f"{field}={STRATEGY}: the {STRATEGY} strategy serves the actor and the reference policy only "
        f"(actor_rollout_ref.actor and .ref); set {field}=fsdp2 (veRL's FSDP2 engine)."
    )


@dataclass
class CheckedCriticConfig(FSDPCriticConfig):
    """veRL's FSDP critic config, refusing `critic.strategy=longstraw` at config time (the shipped
    config's critic; veRL would fail only when building the critic's engine)."""

    def __post_init__(self) -> None:
        if self.strategy == STRATEGY:
            raise unserved_role_error("critic.strategy")
        super().__post_init__()


@dataclass
class LongStrawActorConfig(FSDPActorConfig):
    """FSDP actor config for `strategy: longstraw`, with the `longstraw` knobs.

    The knobs are attached to the engine config (`engine.longstraw`), which is what the
    engine receives; everything else is veRL's FSDP actor config.
    """

    strategy: str = STRATEGY
    longstraw: LongStrawConfig = field(default_factory=LongStrawConfig)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.strategy != STRATEGY:
            raise ValueError(
                f"{type(self).__name__} is for strategy={STRATEGY!r}, got strategy={self.strategy!r}; "
                "set actor_rollout_ref.actor.strategy=longstraw or use veRL's FSDPActorConfig."
            )
        object.__setattr__(self, "longstraw", as_longstraw_config(self.longstraw))
        check_supported(self)
        object.__setattr__(self.engine, "longstraw", self.longstraw)
