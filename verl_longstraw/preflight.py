"""The pre-flight check, before any capture: whether one rank's walk fits its device budget, read off the memory
estimate of each unit's plan (``estimate.estimate_plan``) and the bytes the model holds besides.

``check_budget`` turns one estimate into an actionable MemoryError naming the knobs that shrink it, and
``check_host_budget`` its host figure (``state_on_host``, ``state_grad_on_host``) against the node's available
memory (``available_host_bytes``) shared by its ranks; ``choose_units``
picks, of candidate ways to split a step into units (prefix trees, each walked as one plan), the first whose largest
unit fits on every rank of the process group, so every rank walks the same units and all raise together.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import NamedTuple, TypeVar

import torch.distributed as dist

from .estimate import GIB, MemoryEstimate

Unit = TypeVar("Unit")


class Budget(NamedTuple):
    """Device bytes a step may take on one rank, and where the figure comes from (named in the error)."""

    nbytes: int
    source: str


def check_budget(estimate: MemoryEstimate, budget_bytes: int) -> None:
    """Raise MemoryError when one rank's device bytes ``estimate.total_bytes`` exceed ``budget_bytes``, naming
    the knobs that shrink them: what each saves and whether that alone fits."""
    e = estimate
    if e.total_bytes <= budget_bytes:
        return

    def gib(n: int) -> str:
        return f"{n / GIB:.3g} GiB"

    def saving(total_without: int) -> str:
        verdict = "fits" if total_without <= budget_bytes else "not enough alone"
        return f"-{gib(e.total_bytes - total_without)}, {verdict}"

    knobs = []
    if not e.state_on_host and e.streamed_total_bytes < e.total_bytes:
        knobs.append(f"actor_rollout_ref.actor.longstraw.state_on_host=True ({saving(e.streamed_total_bytes)}: the "
                     f"prompt state's rows, {gib(e.streamed_host_state_bytes)} a rank, in host memory, brought to the "
                     "device a layer at a time)")
    if e.device_state_grad_bytes:
        knobs.append(f"state_grad_on_host=True ({saving(e.total_bytes - e.device_state_grad_bytes + e.staging_bytes)}: "
                     "the float32 state-gradient sums in host memory)")
    if e.state_grad_bytes:
        knobs.append(f"prompt_grad='detached' ({saving(e.detached_total_bytes)}; biased: drops the gradient through "
                     "the prompt)")
    if e.replay_saved_bytes > e.prompt_backward_saved_bytes and e.replay_batch > 1:
        knobs.append(f"replay_tokens smaller (now {e.replay_batch} responses replay together and their replay, "
                     f"{gib(e.replay_saved_bytes)} saved for backward, is the peak; its share shrinks about in "
                     "proportion)")
    if e.prompt_backward_saved_bytes >= e.replay_saved_bytes or e.cp_size > 1:
        smaller = max(e.cp_size, e.chunk_tokens // 4)
        knobs.append(f"chunk_size={smaller} (the longest captured chunk now has {e.chunk_tokens} tokens; the prompt "
                     f"backward saves {gib(e.prompt_backward_saved_bytes)} for one chunk, pass-Q scores its tokens "
                     "by blocks)")
    knobs.append(f"context-parallel size R={2 * e.cp_size} (a cp_group of {2 * e.cp_size} ranks, now {e.cp_size}: "
                 "each rank holds 1/R of the prompt's token rows and of their gradients)")
    raise MemoryError(
        f"estimated {gib(e.total_bytes)} > budget {gib(budget_bytes)} per rank (R={e.cp_size}): prompt state "
        f"{gib(e.state_bytes)} (of which chunk-boundary copies {gib(e.boundary_bytes)}), state-gradient sums "
        f"{gib(e.device_state_grad_bytes)} on the device and {gib(e.host_bytes)} on the host, state gradients of "
        f"one layer's backward {gib(e.state_leaf_grad_bytes)}, saved for backward {gib(e.saved_peak_bytes)} (of which "
        f"pass-Q {gib(e.pass_q_bytes)}), largest transient (score block, scoring chunk, attention backward, MoE "
        f"all-to-all) "
        f"{gib(e.transient_bytes)}. To fit: "
        + "; ".join(knobs) + "; or shorten the prompt"
    )



def available_host_bytes() -> int:
    """Bytes of host memory the node can still give (``MemAvailable`` of /proc/meminfo; elsewhere its free pages)."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check_host_budget(estimate: MemoryEstimate, available_bytes: int, ranks_per_host: int = 1) -> None:
    """Raise MemoryError when ``ranks_per_host`` ranks' host bytes (``estimate.host_bytes`` each: the streamed
    prompt state of ``state_on_host``, the state-gradient sums of ``state_grad_on_host``) exceed the node's
    ``available_bytes``, naming the fields and what each puts there."""
    e, needed = estimate, estimate.host_bytes * ranks_per_host
    if needed <= available_bytes:
        return

    def gib(n: int) -> str:
        return f"{n / GIB:.3g} GiB"

    grads = e.host_bytes - e.host_state_bytes
    raise MemoryError(
        f"estimated {gib(needed)} of host memory ({ranks_per_host} rank(s) of this node x {gib(e.host_bytes)}) > "
        f"{gib(available_bytes)} available (MemAvailable): state_on_host keeps {gib(e.host_state_bytes)} of prompt "
        f"state rows a rank there, state_grad_on_host {gib(grads)} of state-gradient sums and their staging buffer. "
        "To fit: state_on_host=False or state_grad_on_host=False where the device can hold them instead, a larger "
        "context-parallel size R (each rank holds 1/R of the rows), fewer ranks per node, or a shorter prompt")


def over_budget(estimate: MemoryEstimate, model_bytes: int, budget: Budget, describe: Callable[[], str], held: str,
                knobs_hint: str) -> str | None:
    """Why the walk of ``estimate`` does not fit ``budget`` beside ``model_bytes`` (the unsharded parameters and
    gradients of ``held``), or its host bytes the node's available memory shared by the node's ranks
    (``check_host_budget``; ``LOCAL_WORLD_SIZE`` ranks, 1 where unset), naming what is walked (``describe()``, asked
    only then), the knobs (``check_budget``) and ``knobs_hint`` (where the caller's knobs are set); None when it
    fits."""
    try:
        check_budget(estimate, budget.nbytes - model_bytes)
        if estimate.host_bytes:
            check_host_budget(estimate, available_host_bytes(), int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except MemoryError as exc:
        return (
            f"LongStraw pre-flight check, before any capture: {describe()} does not fit the budget "
            f"({budget.source}: {budget.nbytes / GIB:.3g} GiB, of which {model_bytes / GIB:.3g} GiB go to unsharded "
            f"parameters and gradients of {held}). {exc}. {knobs_hint}"
        )
    return None


def choose_units(candidates: Sequence[Callable[[], Sequence[Unit]]], estimate: Callable[[Unit], MemoryEstimate],
                 model_bytes: int, verdict: Callable[[Unit, MemoryEstimate], str | None] | None
                 ) -> tuple[list[Unit], int]:
    """The units this rank walks and the step's estimated device bytes (the largest unit's ``estimate`` plus
    ``model_bytes``). ``candidates`` are tried in order, a later one made only when the ones before it do not fit
    on some rank. ``verdict`` (e.g. ``over_budget`` against the rank's budget) says why a unit's estimate does not
    fit, None when it does; None: no check, the first candidate is walked. Every rank of the default process group
    (when one is initialised) learns every rank's verdict on its largest unit, and when not even the last candidate
    fits each raises MemoryError with its own reason or the first failing rank's."""
    if not candidates:
        raise ValueError("choose_units needs at least one candidate way to split the step")
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    for attempt, candidate in enumerate(candidates):
        units = list(candidate())
        estimates = [(unit, estimate(unit)) for unit in units]
        unit, largest = max(estimates, key=lambda e: e[1].total_bytes, default=(None, None))
        total = model_bytes + (largest.total_bytes if largest is not None else 0)
        if verdict is None:
            return units, total
        message = None if largest is None else verdict(unit, largest)
        verdicts: list[str | None] = [message]
        if world > 1:
            verdicts = [None] * world
            dist.all_gather_object(verdicts, message)
        if all(theirs is None for theirs in verdicts):
            return units, total
        if attempt + 1 < len(candidates):
            continue
        if message is not None:
            raise MemoryError(message)
        rank = next(rank for rank, theirs in enumerate(verdicts) if theirs is not None)
        raise MemoryError(f"rank {rank} failed the pre-flight check: {verdicts[rank]}")
    raise AssertionError("unreachable: the last candidate returns or raises")
