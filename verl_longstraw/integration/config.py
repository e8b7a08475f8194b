"""LongStraw knobs and the actor config that carries them (`actor_rollout_ref.actor.longstraw.*`)."""

from dataclasses import dataclass, field, fields
from typing import Any, Optional

from verl.base_config import BaseConfig
from verl.workers.config import FSDPActorConfig, FSDPCriticConfig

from verl_longstraw.knobs import Knobs

STRATEGY = "longstraw"


def _knob(default: Any, doc: str) -> Any:
    """A field of the ``longstraw`` block with its documentation (``metadata["doc"]``): the one place a knob is
    described; docs/knobs.md is generated from it (``scripts/docs_knobs.py``)."""
    return field(default=default, metadata={"doc": doc})


@dataclass
class LongStrawConfig(BaseConfig):
    """The LongStraw knobs of a veRL config: ``actor_rollout_ref.actor.longstraw.*``, which the reference policy
    inherits. The knobs the core reads are built from them once, validated, as ``knobs``
    (``verl_longstraw.Knobs``; not a config key): what the engine hands every walk and plan. Each field's meaning
    is its ``doc`` metadata below, the one description of the knob (docs/knobs.md is generated from it).
    """

    prompt_grad: str = _knob("exact", (
        "`exact`: the standard gradient: d(loss)/d(prompt state) is accumulated over the responses and "
        "backpropagated through one recompute of the prompt per group. `detached`: that term is dropped, the "
        "prompt state held constant (the paper's mode; cheaper, biased: the prompt positions get no gradient). "
        "Read by backward walks only."))
    chunk_size: Optional[int] = _knob(None, (
        "prompt tokens per capture/recompute chunk (a captured segment of a prompt, or of any shared, unscored "
        "part of a prefix tree). `null` processes the prompt at once (its graph is held during the recompute). "
        "Set it for long prompts: memory is then prompt state + state gradient + one chunk's graph."))
    context_parallel_size: int = _knob(1, (
        "R ranks that run one GRPO group together, each holding ~1/R of the prompt state "
        "(`verl_longstraw.parallel`); `1` gives every rank its own groups. R must divide the world size. FSDP2 "
        "then shards over the R ranks of a CP group: `fsdp_config.fsdp_size` must be `-1` when the world is R, "
        "else R (the CP groups are data-parallel replicas, HSDP across them). R > 1 needs `use_dynamic_bsz: "
        "false`, `shuffle: false` and micro-batches of whole groups."))
    state_grad_on_host: bool = _knob(False, (
        "exact mode: keep the float32 prompt-state gradient sums in host memory instead of on the device "
        "(pinned at their exact size with CUDA; each gradient staged through one pinned buffer of the largest "
        "state tensor, its copy overlapping the backward)."))
    state_on_host: bool = _knob(False, (
        "keep the captured prompt state in host memory (pinned with CUDA): the rows that grow with the prompt "
        "(K/V, MLA latents, DSA index keys) and the fixed-size states (convolution, recurrent, sliding windows) "
        "with their copies at every chunk boundary, written as the captures produce them; bring one layer's state "
        "to the device just before that layer runs in a capture, replay, recompute or backward, the next layer's "
        "copy in flight on a side stream (`verl_longstraw/state/stream.py`): the device holds one or two layers' "
        "state instead of every layer's, the node's host memory the rest (the pre-flight checks both). Costs "
        "host-to-device traffic of the prompt state per replay round and recompute. Combine with "
        "`state_grad_on_host` for exact mode."))
    preflight: bool = _knob(True, (
        "before the first capture of each call, compare the memory estimate of its largest unit "
        "(`verl_longstraw.estimate.estimate_plan` of its prefix tree's plan) with the budget. The trees of the "
        "whole call are walked when they fit; else each micro-batch's own trees; when those do not fit either, "
        "every rank fails naming the knobs that would make it fit, instead of running out of memory mid-step. "
        "`false`: the whole call's trees, unchecked."))
    memory_budget_gb: Optional[float] = _knob(None, (
        "GiB per device the pre-flight check allows; `null`: the device's free memory at the start of the step "
        "(host MemAvailable on CPU)."))
    replay_tokens: int = _knob(8192, (
        "response tokens replayed in one forward: a group's responses go k at a time with k x (longest of the k) "
        "<= `replay_tokens`, the prompt state shared by the k (not copied; `verl_longstraw.plan`). Memory grows "
        "with this budget, not with G; the default is one 8K response at a time, `1` replays each response alone. "
        "Under context parallelism one response per rank per round."))
    single_forward: bool = _knob(True, (
        "training: when veRL's loss is a sum of per-response terms (`ppo_loss` with the vanilla, gspo, gpg, sapo, "
        "geo_mean, cispo, dppo_tv or dppo_kl policy loss, any `loss_agg_mode`, KL loss, entropy; "
        "`integration/losses.py`, `splits_by_response`), replay each response once and backpropagate its own "
        "loss term. Other losses (clip_cov, kl_cov, custom), or `false`, take two passes: a no-grad replay to "
        "evaluate the loss, then a replay with autograd fed d(loss)/d(log-probs). Logged as "
        "`longstraw/single_forward` (1 or 0)."))
    min_shared_tokens: int = _knob(64, (
        "rows of a call whose token ids share a prefix of at least this many tokens share its segments "
        "(captured once, recomputed once), whatever produced them: a GRPO group's prompt, a system prompt across "
        "groups, per-turn samples, branched rollouts (`verl_longstraw.plan.tree_plan`). The rows of a call are "
        "all of veRL's micro-batches of this rank's mini-batch (or log-prob batch): one walk shares across them, "
        "and each row's loss term is still the one its micro-batch gives it. Shorter common prefixes run inside "
        "each row: a segment of its own costs two more model calls (capture and recompute), more than replaying "
        "a few dozen tokens per row. Under context parallelism the CP group walks the same trees together. In the "
        "core it applies to prefix trees only (a star always shares its prompt)."))
    response_chunk_size: Optional[int] = _knob(None, (
        "a response (a scored leaf) longer than this replays as a chain of segments of this many tokens "
        "(captured and recomputed like a chunked prompt), so it holds one segment's graph instead of its whole "
        "length's. `null`: each response whole. One process."))
    expert_parallel: bool = _knob(False, (
        "split each MoE layer's routed experts over the CP group with transformers' expert-parallel plan "
        "(`parallel/experts.py`, transformers >= 5.19): E / R resident per rank outside FSDP2, the tokens routed "
        "to another rank's experts exchanged by all-to-all, instead of FSDP2 all-gathering every expert per call. "
        "Needs `context_parallel_size` R > 1, routed experts divisible by R and a family with a plan (refused "
        "naming the field otherwise). Logged as `longstraw/ep_collective_bytes`."))

    def __post_init__(self) -> None:
        where = "actor_rollout_ref.actor.longstraw"
        try:
            knobs = Knobs(chunk_size=self.chunk_size, response_chunk_size=self.response_chunk_size,
                          min_shared_tokens=self.min_shared_tokens, replay_tokens=self.replay_tokens,
                          prompt_grad=self.prompt_grad, state_grad_on_host=self.state_grad_on_host,
                          state_on_host=self.state_on_host)
        except ValueError as exc:
            raise ValueError(f"{where}.{exc}") from None
        self.knobs = knobs  # not a field: the config's keys stay the ones above
        if not _positive_int(self.context_parallel_size):
            raise ValueError(
                f"{where}.context_parallel_size={self.context_parallel_size!r} must be a positive integer "
                "(1: no context parallelism)."
            )
        for name in ("preflight", "single_forward", "expert_parallel"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{where}.{name}={getattr(self, name)!r} must be true or false.")
        if self.expert_parallel and self.context_parallel_size < 2:
            raise ValueError(
                f"{where}.expert_parallel=true needs {where}.context_parallel_size >= 2: the experts are split over "
                "the CP group, whose ranks call every MoE layer in lockstep (with context_parallel_size 1 the ranks "
                "run different groups and the all-to-all would hang); set context_parallel_size >= 2 or "
                "expert_parallel=false.")
        budget = self.memory_budget_gb
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, (int, float)) or budget <= 0):
            raise ValueError(f"{where}.memory_budget_gb={budget!r} must be a positive number of GiB or null "
                             "(the device's free memory).")


KNOBS = tuple(f.name for f in fields(LongStrawConfig) if f.name != "_target_")  # the keys of the longstraw block


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def as_longstraw_config(value: Any) -> LongStrawConfig:
    """Accept a LongStrawConfig, a mapping of its fields, or None (defaults)."""
    if value is None:
        return LongStrawConfig()
    if isinstance(value, LongStrawConfig):
        return value
    unknown = sorted(set(value) - {*KNOBS, "_target_"})
    if unknown:
        raise ValueError(
            f"Unknown key(s) {unknown} in actor_rollout_ref.actor.longstraw; supported: {', '.join(KNOBS)}."
        )
    return LongStrawConfig(**{k: value[k] for k in KNOBS if k in value})


def check_context_parallel(
    cp_size: int, world_size: int, fsdp_size: int, where: str = "actor_rollout_ref.actor"
) -> None:
    """Refuse a context-parallel layout the engine cannot run: R ranks of a CP group must be one FSDP
    shard group (parameters are all-gathered per layer in lockstep inside it), and R | world size."""
    if cp_size == 1:
        return
    if world_size % cp_size:
        raise ValueError(
            f"{where}.longstraw.context_parallel_size={cp_size} does not divide the world size {world_size} "
            "(trainer.nnodes x trainer.n_gpus_per_node); choose a divisor."
        )
    shard = world_size if fsdp_size < 0 or fsdp_size >= world_size else fsdp_size
    if shard != cp_size:
        fix = "-1 (or the world size)" if world_size == cp_size else str(cp_size)
        raise ValueError(
            f"{where}.longstraw.context_parallel_size={cp_size} needs the FSDP shard group to be the CP group, but "
            f"{where}.fsdp_config.fsdp_size={fsdp_size} shards over {shard} ranks; set fsdp_size={fix} "
            "(HSDP: shard within a CP group, replicate across groups)."
        )


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
        if self.longstraw.context_parallel_size > 1:
            _check_whole_groups(self)
        object.__setattr__(self.engine, "longstraw", self.longstraw)


def _check_whole_groups(actor: "LongStrawActorConfig") -> None:
    """With context parallelism a micro-batch must hold whole GRPO groups (the R ranks capture one
    group's prompt together; a split group is captured once per fragment)."""
    cp_size = actor.longstraw.context_parallel_size
    where = "actor_rollout_ref.actor"
    if actor.use_dynamic_bsz:
        raise ValueError(
            f"{where}.use_dynamic_bsz=True with longstraw.context_parallel_size={cp_size}: dynamic batching packs "
            "samples by tokens and splits GRPO groups; set use_dynamic_bsz=false and "
            f"ppo_micro_batch_size_per_gpu to a multiple of rollout.n ({actor.rollout_n})."
        )
    mbs = actor.ppo_micro_batch_size_per_gpu
    if mbs is not None and actor.rollout_n > 1 and mbs % actor.rollout_n:
        raise ValueError(
            f"{where}.ppo_micro_batch_size_per_gpu={mbs} with longstraw.context_parallel_size={cp_size}: a "
            f"micro-batch must hold whole groups of rollout.n={actor.rollout_n} responses; set it to a multiple "
            f"of {actor.rollout_n}."
        )
    if actor.shuffle:
        raise ValueError(
            f"{where}.shuffle=True with longstraw.context_parallel_size={cp_size}: shuffling mini-batches splits "
            "GRPO groups; set shuffle=false."
        )
