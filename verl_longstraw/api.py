"""Public entry points: log-probs and gradients of one GRPO group (``group_*``: one prompt, G responses) and of
any set of rows sharing prefixes (``tree_*``: a prefix tree), each returning a ``GroupResult``.

Every entry point validates its arguments, takes the segment plan (``plan``) its caller built or builds it, and
walks it (``execute``); the two families differ only in the plan (``plan.star_plan``, ``plan.tree_plan``) and in
how their arguments are named. The knobs of the plan and the walk travel as one ``knobs.Knobs`` (``knobs=``).
Every entry point takes ``cp_group``: a process group whose ranks all call with the same arguments and run the
rows together (context parallel, ``verl_longstraw.parallel``): each rank holds about 1/R of the captured state,
replays one leaf per round, and ends with the log-probs and losses of every row. Parameter gradients are per-rank
partial sums whose sum over the group is the single-process gradient. With ``cp_group=None`` (one process) the
behaviour and results are the single-process ones.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import asdict, dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from .adapters import Adapter, adapter_for
from .errors import UnsupportedModelError
from .estimate import estimate_plan
from .execute import GroupResult, GroupStats, LossFn, Sequences, capture, walk
from .knobs import Knobs
from .parallel import comm
from .parallel.fsdp2 import compute_device
from .plan import Plan, star_plan, star_source, tree_plan, tree_source
from .preflight import available_host_bytes, check_budget, check_host_budget
from .state import PathState


def _check_ids(name: str, ids: object, vocab_size: int) -> None:
    if not isinstance(ids, torch.Tensor) or ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} must be a LongTensor of token ids, got {type(ids).__name__}")
    if ids.dim() != 1:
        raise ValueError(f"{name} must be 1-D (one unpadded sequence), got shape {tuple(ids.shape)}")
    if ids.numel() == 0:
        raise ValueError(f"{name} is empty; every prompt and response needs at least one token")
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= vocab_size:
        raise ValueError(f"{name} has token ids in [{low}, {high}], outside the vocabulary [0, {vocab_size})")


def _check_knobs(knobs: object) -> None:
    if not isinstance(knobs, Knobs):
        raise ValueError(f"knobs must be a verl_longstraw.Knobs (e.g. Knobs(chunk_size=4096)), got "
                         f"{type(knobs).__name__}")


def _check_temperature(temperature: object) -> None:
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature > 0:
        raise ValueError(
            f"temperature must be one positive number for all rows, got {temperature!r}; rows sampled at different "
            "temperatures belong to different calls (one tree per temperature)"
        )


def validate_group(model: nn.Module, prompt_ids: torch.Tensor, responses: list[torch.Tensor]) -> Adapter:
    """Check one group's inputs and return the model's adapter. Raises ValueError naming the argument."""
    adapter = _validate_prompt(model, prompt_ids)
    config = adapter.config
    if not isinstance(responses, (list, tuple)) or not responses:
        raise ValueError("responses must be a non-empty list of 1-D LongTensors")
    max_len = getattr(config, "max_position_embeddings", None)
    for i, response in enumerate(responses):
        _check_ids(f"responses[{i}]", response, config.vocab_size)
        total = len(prompt_ids) + len(response)
        if max_len is not None and total > max_len:
            raise ValueError(
                f"prompt ({len(prompt_ids)}) + responses[{i}] ({len(response)}) = {total} tokens exceeds "
                f"max_position_embeddings={max_len}; truncate the prompt or the response"
            )
        adapter.check_length(total)
    return adapter


def _validate_prompt(model: nn.Module, prompt_ids: torch.Tensor) -> Adapter:
    adapter = adapter_for(model)
    _check_ids("prompt_ids", prompt_ids, adapter.config.vocab_size)
    return adapter


def validate_tree(model: nn.Module, sequences: list[torch.Tensor], score_starts: list[int]) -> Adapter:
    """Check a tree's rows and return the model's adapter. Raises ValueError naming the argument."""
    adapter = adapter_for(model)
    if not isinstance(sequences, (list, tuple)) or not sequences:
        raise ValueError("sequences must be a non-empty list of 1-D LongTensors")
    if not isinstance(score_starts, (list, tuple)) or len(score_starts) != len(sequences):
        raise ValueError(f"score_starts must be a list with one int per sequence ({len(sequences)}), "
                         f"got {score_starts!r}")
    max_len = getattr(adapter.config, "max_position_embeddings", None)
    for i, (ids, start) in enumerate(zip(sequences, score_starts, strict=True)):
        _check_ids(f"sequences[{i}]", ids, adapter.config.vocab_size)
        if not isinstance(start, int) or isinstance(start, bool) or not 1 <= start < len(ids):
            raise ValueError(f"score_starts[{i}]={start!r} must be an int in [1, {len(ids)}) (the first scored "
                             f"token of sequences[{i}], which has {len(ids)} tokens)")
        if max_len is not None and len(ids) > max_len:
            raise ValueError(f"sequences[{i}] has {len(ids)} tokens, more than max_position_embeddings={max_len}; "
                             "truncate it")
        adapter.check_length(len(ids))
    return adapter


def _fingerprint(ids: torch.Tensor) -> tuple[int, int]:
    """(length, position-weighted checksum) of token ids: cheap, order-sensitive, one host sync."""
    weights = torch.arange(1, len(ids) + 1, device=ids.device, dtype=torch.int64) % 1_000_003
    return len(ids), int((ids.long() * weights).sum())


def _agree(cp_group: comm.Group, validate: Callable[[], Any], ids: dict[str, list[torch.Tensor]], knobs: Knobs,
           **settings) -> Any:
    """``validate()``'s result (the adapter first) once every rank of ``cp_group`` validated the same arguments and
    the adapter serves a group of its size (``Adapter.check_context_parallel``).

    Each rank validates its own arguments, then the ranks exchange (error, fingerprints of the token ids ``ids``
    (argument name -> tensors), the fields of ``knobs`` and ``settings``) in one small collective, so bad input or
    ranks that disagree raise the same ValueError on every rank (naming the argument or knob that differs) instead
    of leaving some ranks waiting in a collective.
    """
    if cp_group is None:
        return validate()
    result, error = None, None
    try:
        result = validate()
        result[0].check_context_parallel(comm.group_size(cp_group))
    except (ValueError, UnsupportedModelError, MemoryError) as exc:
        error = exc
    mine = None
    if error is None:
        mine = {**{name: [_fingerprint(t) for t in tensors] for name, tensors in ids.items()}, **asdict(knobs),
                **settings}
    gathered: list[Any] = [None] * comm.group_size(cp_group)
    message = None if error is None else f"{type(error).__name__}: {error}"
    dist.all_gather_object(gathered, (message, mine), group=cp_group)
    if error is not None:
        raise error
    for rank, (message, _) in enumerate(gathered):
        if message is not None:
            raise ValueError(f"rank {rank} of the context-parallel group rejected its arguments ({message})")
    for field in mine:
        values = [theirs[field] for _, theirs in gathered]
        if any(v != values[0] for v in values):
            raise ValueError(
                f"the ranks of the context-parallel group passed different {field} ({field} per rank: "
                f"{values if field not in ids else 'see fingerprints'}); every rank of cp_group must call with "
                f"the same {', '.join(ids)} and settings"
            )
    return result


def _plan(plan: Plan | None, build: Callable[[int, int], Plan], built_from: tuple, knobs: Knobs,
          cp_group: comm.Group, builder: str, rows: str) -> Plan:
    """This rank's plan: ``plan`` where the caller built it (checked to be ``build``'s: ``Plan.serves``), else
    ``build(world, rank)``. ValueError naming ``plan`` for a plan of other rows (``rows`` names them), knobs or
    rank."""
    world, rank = comm.group_size(cp_group), comm.group_rank(cp_group)
    if plan is None:
        return build(world, rank)
    if not isinstance(plan, Plan) or not plan.serves(built_from, knobs, world, rank):
        raise ValueError(f"plan is not plan.{builder}'s for these {rows}, knobs and this rank of cp_group; pass "
                         "plan=None to build it here")
    return plan


@dataclass
class PromptState:
    """A prompt captured once (``capture_prompt``) to serve ``group_log_probs`` and then ``group_backward``: the
    path store holding its chain of segments, which segments those are, the prompt it was captured from, the plan
    of the capture (the prompt's chain on this rank, with the knobs it was captured with), and for what."""

    store: PathState
    captured: frozenset[int]
    prompt_ids: torch.Tensor
    plan: Plan
    for_backward: bool

    def nbytes(self) -> int:
        """Bytes of the storages the state keeps alive (``PathState.nbytes``)."""
        return self.store.nbytes()

    def tensors(self) -> list[torch.Tensor]:
        return self.store.tensors()

    def check(self, prompt_ids: torch.Tensor, plan: Plan, for_backward: bool) -> None:
        """Raise ValueError naming ``state`` unless it was captured from ``prompt_ids`` with the chunking of
        ``plan`` (the group's plan on this rank: as many rows), and for the backward when ``for_backward``."""
        if self.plan.capacity != plan.capacity:
            raise ValueError(f"state holds {self.plan.capacity} rows; this rank needs {plan.capacity} for these "
                             "prompt_ids and cp_group (pass the state capture_prompt returned for them)")
        if not torch.equal(self.prompt_ids, prompt_ids.to(self.prompt_ids)):
            raise ValueError("state was captured from other prompt_ids; pass the one capture_prompt returned for these")
        if self.plan.knobs.chunk_size != plan.knobs.chunk_size:
            raise ValueError(f"state was captured with chunk_size={self.plan.knobs.chunk_size}, not "
                             f"{plan.knobs.chunk_size}")
        if for_backward and not self.for_backward:
            raise ValueError("prompt_grad='exact' needs a state captured with for_backward=True")


def _star_rows(prompt_ids: torch.Tensor, responses: list[torch.Tensor], device: torch.device) -> Sequences:
    """The star's rows (prompt ++ response i) on ``device``, sharing one prompt tensor."""
    prompt_ids = prompt_ids.to(device)
    return Sequences([(prompt_ids, r.to(device)) for r in responses] or [(prompt_ids,)])


def _walk(adapter: Adapter, plan: Plan, rows: Sequences, mode: str, temperature: float, with_entropy: bool,
          loss_fn: LossFn | None, knobs: Knobs, stats: GroupStats | None, cp_group: comm.Group,
          state: PromptState | None = None) -> GroupResult:
    """Every entry point's walk of its validated ``plan`` over ``rows`` computing ``mode``, continuing ``state``'s
    captured segments where given (already checked against ``plan``); no autograd in mode "log_probs"."""
    store, captured = (None, frozenset()) if state is None else (state.store, state.captured)
    with torch.no_grad() if mode == "log_probs" else nullcontext():
        return walk(adapter, plan, rows, mode, temperature, with_entropy, loss_fn, group=cp_group, state=store,
                    captured=captured, state_grad_on_host=knobs.state_grad_on_host and mode != "log_probs",
                    stats=stats, state_on_host=knobs.state_on_host)


def _group(model: nn.Module, prompt_ids: torch.Tensor, responses: list[torch.Tensor], mode: str, temperature: float,
           knobs: Knobs, cp_group: comm.Group, plan: Plan | None, state: PromptState | None,
           estimate_under: int | None = None, **settings: Any) -> tuple[Adapter, Plan]:
    """The validated group's adapter and this rank's star plan (``plan`` where the caller built it) for a walk
    computing ``mode``, ``state`` checked against it; with ``estimate_under`` (bytes) MemoryError, naming the fix,
    where the pre-flight estimate of the plan on rank 0 (the most rows: every rank reaches the same verdict)
    exceeds it. Under ``cp_group`` once every rank validated the same arguments (a ValueError on every rank
    otherwise)."""

    def validate():
        _check_knobs(knobs)
        _check_temperature(temperature)
        adapter = validate_group(model, prompt_ids, responses)
        lengths = [len(r) for r in responses]
        group_plan = _plan(plan, lambda world, rank: star_plan(len(prompt_ids), lengths, knobs, world, rank),
                           star_source(len(prompt_ids), lengths), knobs, cp_group, "star_plan",
                           "prompt_ids and responses (their lengths)")
        if state is not None:
            state.check(prompt_ids, group_plan, mode == "exact")
        if estimate_under is not None:
            on_rank0 = group_plan if group_plan.rank == 0 else star_plan(len(prompt_ids), lengths, knobs,
                                                                         group_plan.world, 0)
            estimate = estimate_plan(adapter.config, on_rank0, mode, next(model.parameters()).dtype,
                                     adapter=adapter, state_grad_on_host=knobs.state_grad_on_host,
                                     device_type=compute_device(model).type, state_on_host=knobs.state_on_host)
            check_budget(estimate, estimate_under)
            if estimate.host_bytes:
                check_host_budget(estimate, available_host_bytes())
        return adapter, group_plan

    return _agree(cp_group, validate, {"prompt_ids": [prompt_ids], "responses": responses}, knobs,
                  temperature=temperature, **settings)


def capture_prompt(
    model: nn.Module,
    prompt_ids: torch.Tensor,
    *,
    for_backward: bool = True,
    stats: GroupStats | None = None,
    cp_group: comm.Group = None,
    knobs: Knobs = Knobs(),
) -> PromptState:
    """Capture a prompt's state once (no autograd), to pass as ``state=`` to ``group_log_probs`` and
    then ``group_backward`` (with the same ``knobs.chunk_size``) so a training step computes the prompt's forward
    once, not twice.

    ``for_backward`` keeps every chunk's end state the exact backward restarts from (and, with
    ``knobs.state_grad_on_host``, makes the store keep its state-gradient sums on the host). The state holds per
    layer what ``adapter.state_kinds`` says (e.g. K/V [1, Hk, P-1, D]).
    """

    def validate():
        _check_knobs(knobs)
        adapter = _validate_prompt(model, prompt_ids)
        adapter.check_length(len(prompt_ids))
        # the chain of any group with this prompt (one stand-in response: below it every chunk has a child)
        world, rank = comm.group_size(cp_group), comm.group_rank(cp_group)
        return adapter, star_plan(len(prompt_ids), [1], knobs, world, rank)

    adapter, plan = _agree(cp_group, validate, {"prompt_ids": [prompt_ids]}, knobs)
    stats = stats if stats is not None else GroupStats()
    mode = "exact" if for_backward else "log_probs"
    store, captured = capture(adapter, plan, _star_rows(prompt_ids, [], compute_device(model)), mode, cp_group, stats,
                              on_host=knobs.state_grad_on_host and for_backward, state_on_host=knobs.state_on_host)
    return PromptState(store, captured, prompt_ids.detach().clone(), plan, for_backward)


def group_log_probs(
    model: nn.Module,
    prompt_ids: torch.Tensor,
    responses: list[torch.Tensor],
    *,
    temperature: float = 1.0,
    return_entropy: bool = False,
    stats: GroupStats | None = None,
    state: PromptState | None = None,
    cp_group: comm.Group = None,
    knobs: Knobs = Knobs(),
    plan: Plan | None = None,
) -> GroupResult:
    """Per-token log-probs of each response given the prompt, computing the prompt once.

    ``result.log_probs[i]`` [T_i] float32 (equal to a full forward over prompt ++ response), with
    ``return_entropy`` also ``result.entropies[i]`` [T_i]. ``state`` (from ``capture_prompt``) skips the capture.
    Responses replay in batches of k, in order, with k x (longest T_i of the batch) <= ``knobs.replay_tokens``
    (one forward each, the prompt state broadcast; ``plan.replay_batches``); under ``cp_group`` one response per
    rank per round whatever ``replay_tokens``. ``plan``: this rank's ``plan.star_plan`` of these lengths and
    knobs where the caller built it already (checked by shape, not by token ids: ``Plan.serves``); None: built
    here.
    """
    adapter, plan = _group(model, prompt_ids, responses, "log_probs", temperature, knobs, cp_group, plan, state,
                           entropy=return_entropy)
    return _walk(adapter, plan, _star_rows(prompt_ids, responses, compute_device(model)), "log_probs", temperature,
                 return_entropy, None, knobs, stats, cp_group, state)


def group_backward(
    model: nn.Module,
    prompt_ids: torch.Tensor,
    responses: list[torch.Tensor],
    loss_fn: LossFn,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    stats: GroupStats | None = None,
    memory_budget_bytes: int | None = None,
    state: PromptState | None = None,
    cp_group: comm.Group = None,
    knobs: Knobs = Knobs(),
    plan: Plan | None = None,
) -> GroupResult:
    """Accumulate into each parameter's ``.grad`` the gradient of ``sum_i loss_fn(i, logps_i)``.

    ``loss_fn(i, logps_i)`` (or ``loss_fn(i, logps_i, entropy_i)`` with ``with_entropy``)
    returns a scalar for response i; ``logps_i`` [T_i] is float32. ``knobs.prompt_grad="exact"``
    gives the standard full-sequence gradient; ``"detached"`` holds the prompt state
    constant (LongStraw paper). With ``memory_budget_bytes``, first compare the pre-flight
    estimate of the plan (``verl_longstraw.estimate.estimate_plan``: prompt state + state gradients + peak saved
    for backward) against it and raise MemoryError naming the fix before computing anything.
    ``state`` (from ``capture_prompt`` with the same ``knobs.chunk_size``) skips the capture.
    ``knobs.state_grad_on_host`` keeps the float32 state-gradient sums (exact mode) in host memory
    (pinned where CUDA is available), moved per layer tensor, for prompts whose state gradient
    does not fit beside the model (a ``state``'s store keeps them where ``capture_prompt`` put them). Returns the
    losses [G] (detached), the log-probs [T_i] and, with ``with_entropy``, the entropies [T_i] of every response
    (detached, float32, as ``group_log_probs`` returns them), so one replay serves both the loss and its inputs.

    Responses replay in batches of k, in order, with k x (longest T_i of the batch) <= ``knobs.replay_tokens``: one
    forward of the k right-padded responses against the broadcast prompt state and one backward of the sum of
    their losses (``loss_fn`` is still called per response, with its unpadded tensors); memory grows with the
    budget, not with G. Under ``cp_group`` one response per rank per round whatever ``replay_tokens`` (k = 1).
    ``plan`` as ``group_log_probs``.
    """
    adapter, plan = _group(model, prompt_ids, responses, knobs.prompt_grad, temperature, knobs, cp_group, plan,
                           state, memory_budget_bytes, entropy=with_entropy, memory_budget_bytes=memory_budget_bytes)
    return _walk(adapter, plan, _star_rows(prompt_ids, responses, compute_device(model)), knobs.prompt_grad,
                 temperature, with_entropy, loss_fn, knobs, stats, cp_group, state)


def _tree(model: nn.Module, sequences: list[torch.Tensor], score_starts: list[int], temperature: float,
          knobs: Knobs, cp_group: comm.Group, plan: Plan | None, **settings: Any) -> tuple[Adapter, Plan]:
    """The validated tree's adapter and this rank's plan (``plan`` where the caller built it, once checked to be
    ``tree_plan``'s of rows of these lengths and knobs); under ``cp_group`` once every rank validated the same rows
    and settings (a ValueError on every rank otherwise)."""

    def validate():
        _check_knobs(knobs)
        _check_temperature(temperature)
        adapter = validate_tree(model, sequences, score_starts)
        return adapter, _plan(plan, lambda world, rank: tree_plan(sequences, score_starts, knobs, world, rank),
                              tree_source(sequences, score_starts), knobs, cp_group, "tree_plan",
                              "sequences (their lengths), score_starts")

    return _agree(cp_group, validate, {"sequences": sequences}, knobs, score_starts=score_starts,
                  temperature=temperature, **settings)


def _tree_rows(sequences: list[torch.Tensor], model: nn.Module) -> Sequences:
    device = compute_device(model)
    return Sequences([(s.to(device),) for s in sequences])


def tree_log_probs(
    model: nn.Module,
    sequences: list[torch.Tensor],
    score_starts: list[int],
    *,
    temperature: float = 1.0,
    return_entropy: bool = False,
    stats: GroupStats | None = None,
    cp_group: comm.Group = None,
    knobs: Knobs = Knobs(),
    plan: Plan | None = None,
) -> GroupResult:
    """Log-probs of rows that share prefixes, each shared token run once.

    Row i is ``sequences[i]`` [L_i]; ``result.log_probs[i]`` [L_i - score_starts[i]] holds log p(x_t | x_<t) for
    t >= ``score_starts[i]`` (float32, equal to a full forward over the row), with ``return_entropy`` also the
    entropies. Rows sharing a prefix of >= ``knobs.min_shared_tokens`` tokens share its segments
    (``plan.tree_plan``: ``knobs`` as there). Under ``cp_group`` every rank passes the same rows: each captured
    segment is split over the ranks, leaves replay one per rank per round, and every rank ends with every row's
    values. ``plan``: this rank's ``plan.tree_plan`` of these rows and knobs where the caller built it already (the
    engine's pre-flight estimate read it; checked by the rows' lengths and score starts, not their token ids:
    ``Plan.serves``), None: built here.
    """
    adapter, plan = _tree(model, sequences, score_starts, temperature, knobs, cp_group, plan, entropy=return_entropy)
    return _walk(adapter, plan, _tree_rows(sequences, model), "log_probs", temperature, return_entropy, None,
                 knobs, stats, cp_group)


def tree_backward(
    model: nn.Module,
    sequences: list[torch.Tensor],
    score_starts: list[int],
    loss_fn: LossFn,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    stats: GroupStats | None = None,
    cp_group: comm.Group = None,
    knobs: Knobs = Knobs(),
    plan: Plan | None = None,
) -> GroupResult:
    """Accumulate into each parameter's ``.grad`` the gradient of ``sum_i loss_fn(i, logps_i)`` over rows that
    share prefixes (rows, ``knobs`` and ``plan`` as ``tree_log_probs``; ``loss_fn`` and ``knobs.prompt_grad`` as
    ``group_backward``).

    Each segment of the plan is captured once and recomputed once (exact mode; leaves replayed once with
    autograd), each shared token scored once; the device holds one root-to-leaf path's state and one segment's
    graph at a time. Returns every row's loss, log-probs and (``with_entropy``) entropies, detached.
    """
    adapter, plan = _tree(model, sequences, score_starts, temperature, knobs, cp_group, plan, entropy=with_entropy)
    return _walk(adapter, plan, _tree_rows(sequences, model), knobs.prompt_grad, temperature, with_entropy,
                 loss_fn, knobs, stats, cp_group)
