"""Public entry points: log-probs and gradients of one GRPO group (``group_*``: one prompt, G responses) and of
any set of rows sharing prefixes (``tree_*``: a prefix tree), each returning a ``GroupResult``.

Every entry point validates its arguments, builds one segment plan (``plan``), and walks it (``execute``).
The ``group_*`` entry points take ``cp_group``: a process group whose ranks all call with the same arguments
and run the group together (context parallel, ``verl_longstraw.parallel``): each rank holds about 1/R of the
prompt state, replays one response per round, and ends with the log-probs and losses of every response.
Parameter gradients are per-rank partial sums whose sum over the group is the single-process gradient. With
``cp_group=None`` (one process) the behaviour and results are the single-process ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from .adapters import Adapter, adapter_for
from .errors import UnsupportedModelError
from .estimate import check_budget, estimate_memory
from .execute import GroupResult, GroupStats, LossFn, Sequences, capture, walk
from .parallel import comm
from .plan import REPLAY_TOKENS, Plan, star_plan, tree_plan, tree_plan_source
from .state import PathState

PROMPT_GRAD_MODES = ("exact", "detached")


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


def validate_group(
    model: nn.Module, prompt_ids: torch.Tensor, responses: list[torch.Tensor], chunk_size: int | None
) -> Adapter:
    """Check one group's inputs and return the model's adapter. Raises ValueError naming the argument."""
    adapter = _validate_prompt(model, prompt_ids, chunk_size)
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


def _check_replay_tokens(replay_tokens: object) -> None:
    if not isinstance(replay_tokens, int) or isinstance(replay_tokens, bool) or replay_tokens < 1:
        raise ValueError(f"replay_tokens must be a positive int (tokens of one replay batch), got {replay_tokens!r}")


def _validate_prompt(model: nn.Module, prompt_ids: torch.Tensor, chunk_size: int | None) -> Adapter:
    adapter = adapter_for(model)
    _check_ids("prompt_ids", prompt_ids, adapter.config.vocab_size)
    if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"chunk_size must be a positive int or None, got {chunk_size!r}")
    return adapter


def _device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def _fingerprint(ids: torch.Tensor) -> tuple[int, int]:
    """(length, position-weighted checksum) of token ids: cheap, order-sensitive, one host sync."""
    weights = torch.arange(1, len(ids) + 1, device=ids.device, dtype=torch.int64) % 1_000_003
    return len(ids), int((ids.long() * weights).sum())


def _agree(cp_group: comm.Group, validate: Callable[[], Any], ids: dict[str, list[torch.Tensor]], **settings) -> Any:
    """``validate()``'s result (the adapter first) once every rank of ``cp_group`` validated the same arguments and
    the adapter serves a group of its size (``Adapter.check_context_parallel``).

    Each rank validates its own arguments, then the ranks exchange (error, fingerprints of the token ids ``ids``
    (argument name -> tensors) and ``settings``) in one small collective, so bad input or ranks that disagree
    raise the same ValueError on every rank instead of leaving some ranks waiting in a collective.
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
        mine = {**{name: [_fingerprint(t) for t in tensors] for name, tensors in ids.items()}, **settings}
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


@dataclass
class PromptState:
    """A prompt captured once (``capture_prompt``) to serve ``group_log_probs`` and then ``group_backward``: the
    path store holding its chain of segments, which segments those are, and what it was captured from and for."""

    store: PathState
    captured: frozenset[int]
    prompt_ids: torch.Tensor
    chunk_size: int | None
    for_backward: bool

    def nbytes(self) -> int:
        """Bytes of the storages the state keeps alive (``PathState.nbytes``)."""
        return self.store.nbytes()

    def tensors(self) -> list[torch.Tensor]:
        return self.store.tensors()

    def check(self, prompt_ids: torch.Tensor, chunk_size: int | None, capacity: int, for_backward: bool) -> None:
        """Raise ValueError naming ``state`` unless it was captured from ``prompt_ids`` with this chunking for
        this rank (``capacity`` rows), and for the backward when ``for_backward``."""
        if self.store.capacity != capacity:
            raise ValueError(f"state holds {self.store.capacity} rows; this rank needs {capacity} for these "
                             "prompt_ids and cp_group (pass the state capture_prompt returned for them)")
        if not torch.equal(self.prompt_ids, prompt_ids.to(self.prompt_ids)):
            raise ValueError("state was captured from other prompt_ids; pass the one capture_prompt returned for these")
        if self.chunk_size != chunk_size:
            raise ValueError(f"state was captured with chunk_size={self.chunk_size}, not {chunk_size}")
        if for_backward and not self.for_backward:
            raise ValueError("prompt_grad='exact' needs a state captured with for_backward=True")


def _star(
    prompt_ids: torch.Tensor, responses: list[torch.Tensor], chunk_size: int | None, cp_group: comm.Group,
    replay_tokens: int = REPLAY_TOKENS,
) -> Plan:
    """The group's plan on this rank (ValueError for a prompt too short for the group)."""
    return star_plan(len(prompt_ids), [len(r) for r in responses], chunk_size, replay_tokens,
                     comm.group_size(cp_group), comm.group_rank(cp_group))


def _star_rows(prompt_ids: torch.Tensor, responses: list[torch.Tensor], device: torch.device) -> Sequences:
    """The star's rows (prompt ++ response i) on ``device``, sharing one prompt tensor."""
    prompt_ids = prompt_ids.to(device)
    return Sequences([(prompt_ids, r.to(device)) for r in responses] or [(prompt_ids,)])


def _walk_star(
    model: nn.Module, adapter: Adapter, plan: Plan, prompt_ids: torch.Tensor, responses: list[torch.Tensor],
    mode: str, state: PromptState | None, chunk_size: int | None, stats: GroupStats, cp_group: comm.Group,
    state_grad_on_host: bool = False, **kwargs: Any,
) -> GroupResult:
    device = _device(model)
    captured: frozenset[int] = frozenset()
    store = None
    if state is not None:
        state.check(prompt_ids, chunk_size, plan.capacity, mode == "exact")
        store, captured = state.store, state.captured
    return walk(adapter, plan, _star_rows(prompt_ids, responses, device), mode, group=cp_group, state=store,
                captured=captured, state_grad_on_host=state_grad_on_host, stats=stats, **kwargs)


def capture_prompt(
    model: nn.Module,
    prompt_ids: torch.Tensor,
    chunk_size: int | None = None,
    for_backward: bool = True,
    stats: GroupStats | None = None,
    cp_group: comm.Group = None,
) -> PromptState:
    """Capture a prompt's state once (no autograd), to pass as ``state=`` to ``group_log_probs`` and
    then ``group_backward`` so a training step computes the prompt's forward once, not twice.

    ``for_backward`` keeps every chunk's end state the exact backward restarts from. The state holds per layer
    what ``adapter.state_kinds`` says (e.g. K/V [1, Hk, P-1, D]).
    """

    def validate():
        adapter = _validate_prompt(model, prompt_ids, chunk_size)
        adapter.check_length(len(prompt_ids))
        # the chain of any group with this prompt (one stand-in response: below it every chunk has a child)
        return adapter, _star(prompt_ids, [prompt_ids[:1]], chunk_size, cp_group)

    adapter, plan = _agree(cp_group, validate, {"prompt_ids": [prompt_ids]}, chunk_size=chunk_size)
    stats = stats if stats is not None else GroupStats()
    mode = "exact" if for_backward else "log_probs"
    store, captured = capture(adapter, plan, _star_rows(prompt_ids, [], _device(model)), mode, cp_group, stats)
    return PromptState(store, captured, prompt_ids.detach().clone(), chunk_size, for_backward)


def group_log_probs(
    model: nn.Module,
    prompt_ids: torch.Tensor,
    responses: list[torch.Tensor],
    temperature: float = 1.0,
    chunk_size: int | None = None,
    return_entropy: bool = False,
    stats: GroupStats | None = None,
    state: PromptState | None = None,
    cp_group: comm.Group = None,
    replay_tokens: int = REPLAY_TOKENS,
) -> GroupResult:
    """Per-token log-probs of each response given the prompt, computing the prompt once.

    ``result.log_probs[i]`` [T_i] float32 (equal to a full forward over prompt ++ response), with
    ``return_entropy`` also ``result.entropies[i]`` [T_i]. ``state`` (from ``capture_prompt``) skips the capture.
    Responses replay in batches of k, in order, with k x (longest T_i of the batch) <= ``replay_tokens`` (one
    forward each, the prompt state broadcast; ``plan.replay_batches``); under ``cp_group`` one response per rank
    per round whatever ``replay_tokens``.
    """

    def validate():
        _check_replay_tokens(replay_tokens)
        _check_temperature(temperature)
        adapter = validate_group(model, prompt_ids, responses, chunk_size)
        return adapter, _star(prompt_ids, responses, chunk_size, cp_group, replay_tokens)

    adapter, plan = _agree(
        cp_group, validate, {"prompt_ids": [prompt_ids], "responses": responses},
        chunk_size=chunk_size, temperature=temperature, entropy=return_entropy,
    )
    stats = stats if stats is not None else GroupStats()
    with torch.no_grad():
        return _walk_star(model, adapter, plan, prompt_ids, responses, "log_probs", state, chunk_size, stats,
                          cp_group, temperature=temperature, with_entropy=return_entropy)


def group_backward(
    model: nn.Module,
    prompt_ids: torch.Tensor,
    responses: list[torch.Tensor],
    loss_fn: LossFn,
    prompt_grad: str = "exact",
    chunk_size: int | None = None,
    temperature: float = 1.0,
    with_entropy: bool = False,
    stats: GroupStats | None = None,
    memory_budget_bytes: int | None = None,
    state: PromptState | None = None,
    cp_group: comm.Group = None,
    state_grad_on_host: bool = False,
    replay_tokens: int = REPLAY_TOKENS,
) -> GroupResult:
    """Accumulate into each parameter's ``.grad`` the gradient of ``sum_i loss_fn(i, logps_i)``.

    ``loss_fn(i, logps_i)`` (or ``loss_fn(i, logps_i, entropy_i)`` with ``with_entropy``)
    returns a scalar for response i; ``logps_i`` [T_i] is float32. ``prompt_grad="exact"``
    gives the standard full-sequence gradient; ``"detached"`` holds the prompt state
    constant (LongStraw paper). With ``memory_budget_bytes``, first compare the pre-flight
    estimate (``verl_longstraw.estimate``: prompt state + state gradients + peak saved for
    backward) against it and raise MemoryError naming the fix before computing anything.
    ``state`` (from ``capture_prompt`` with the same ``chunk_size``) skips the capture.
    ``state_grad_on_host`` keeps the float32 state-gradient sums (exact mode) in host memory
    (pinned where CUDA is available), moved per layer tensor, for prompts whose state gradient
    does not fit beside the model. Returns the losses [G] (detached), the log-probs [T_i] and, with
    ``with_entropy``, the entropies [T_i] of every response (detached, float32, as ``group_log_probs`` returns
    them), so one replay serves both the loss and its inputs.

    Responses replay in batches of k, in order, with k x (longest T_i of the batch) <= ``replay_tokens``: one
    forward of the k right-padded responses against the broadcast prompt state and one backward of the sum of
    their losses (``loss_fn`` is still called per response, with its unpadded tensors); memory grows with the
    budget, not with G. Under ``cp_group`` one response per rank per round whatever ``replay_tokens`` (k = 1).
    """

    def validate():
        _check_replay_tokens(replay_tokens)
        _check_prompt_grad(prompt_grad)
        _check_temperature(temperature)
        adapter = validate_group(model, prompt_ids, responses, chunk_size)
        if memory_budget_bytes is not None:
            dtype = next(model.parameters()).dtype
            longest = max(len(r) for r in responses)
            # rank 0's figures (the most rows) from replicated arguments: every rank reaches the same verdict
            estimate = estimate_memory(adapter.config, len(prompt_ids), len(responses), longest, chunk_size,
                                       prompt_grad, dtype, adapter=adapter, cp_size=comm.group_size(cp_group),
                                       state_grad_on_host=state_grad_on_host, replay_tokens=replay_tokens,
                                       device_type=_device(model).type)
            check_budget(estimate, memory_budget_bytes)
        return adapter, _star(prompt_ids, responses, chunk_size, cp_group, replay_tokens)

    adapter, plan = _agree(
        cp_group, validate, {"prompt_ids": [prompt_ids], "responses": responses},
        chunk_size=chunk_size, temperature=temperature, entropy=with_entropy, prompt_grad=prompt_grad,
        memory_budget_bytes=memory_budget_bytes, state_grad_on_host=state_grad_on_host,
    )
    stats = stats if stats is not None else GroupStats()
    return _walk_star(model, adapter, plan, prompt_ids, responses, prompt_grad, state, chunk_size, stats, cp_group,
                      state_grad_on_host, temperature=temperature, with_entropy=with_entropy, loss_fn=loss_fn)


def _check_prompt_grad(prompt_grad: object) -> None:
    if prompt_grad not in PROMPT_GRAD_MODES:
        raise ValueError(f"prompt_grad must be one of {PROMPT_GRAD_MODES}, got {prompt_grad!r}")


def _check_temperature(temperature: object) -> None:
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature > 0:
        raise ValueError(
            f"temperature must be one positive number for all rows, got {temperature!r}; rows sampled at different "
            "temperatures belong to different calls (one tree per temperature)"
        )


def _check_knob(name: str, value: object, allow_none: bool) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive int{' or None' if allow_none else ''}, got {value!r}")


def validate_tree(
    model: nn.Module, sequences: list[torch.Tensor], score_starts: list[int], temperature: float,
    chunk_size: int | None, response_chunk_size: int | None, min_shared_tokens: int, replay_tokens: int,
) -> Adapter:
    """Check a tree's rows and knobs and return the model's adapter. Raises ValueError naming the argument."""
    adapter = adapter_for(model)
    _check_temperature(temperature)
    _check_knob("chunk_size", chunk_size, allow_none=True)
    _check_knob("response_chunk_size", response_chunk_size, allow_none=True)
    _check_knob("min_shared_tokens", min_shared_tokens, allow_none=False)
    _check_replay_tokens(replay_tokens)
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


def _tree(model, sequences, score_starts, temperature, chunk_size, response_chunk_size, min_shared_tokens,
          replay_tokens, cp_group, plan, **settings) -> tuple[Adapter, Plan]:
    """The validated tree's adapter and this rank's plan (``plan`` where the caller built it, once checked to be
    ``tree_plan``'s of these rows and knobs); under ``cp_group`` once every rank validated the same rows and
    settings (a ValueError on every rank otherwise)."""

    def validate():
        adapter = validate_tree(model, sequences, score_starts, temperature, chunk_size, response_chunk_size,
                                min_shared_tokens, replay_tokens)
        world, rank = comm.group_size(cp_group), comm.group_rank(cp_group)
        knobs = (chunk_size, response_chunk_size, min_shared_tokens, replay_tokens, world, rank)
        if plan is None:
            return adapter, tree_plan(sequences, score_starts, *knobs)
        if not isinstance(plan, Plan) or plan.built_from != tree_plan_source(sequences, score_starts, *knobs):
            raise ValueError(
                "plan is not plan.tree_plan's for these sequences, score_starts, chunk_size, response_chunk_size, "
                "min_shared_tokens, replay_tokens and this rank of cp_group; pass plan=None to build it here"
            )
        return adapter, plan

    return _agree(cp_group, validate, {"sequences": sequences}, score_starts=score_starts, chunk_size=chunk_size,
                  response_chunk_size=response_chunk_size, min_shared_tokens=min_shared_tokens,
                  replay_tokens=replay_tokens, temperature=temperature, **settings)


def tree_log_probs(
    model: nn.Module,
    sequences: list[torch.Tensor],
    score_starts: list[int],
    temperature: float = 1.0,
    chunk_size: int | None = None,
    response_chunk_size: int | None = None,
    min_shared_tokens: int = 1,
    return_entropy: bool = False,
    stats: GroupStats | None = None,
    replay_tokens: int = REPLAY_TOKENS,
    cp_group: comm.Group = None,
    plan: Plan | None = None,
) -> GroupResult:
    """Log-probs of rows that share prefixes, each shared token run once.

    Row i is ``sequences[i]`` [L_i]; ``result.log_probs[i]`` [L_i - score_starts[i]] holds log p(x_t | x_<t) for
    t >= ``score_starts[i]`` (float32, equal to a full forward over the row), with ``return_entropy`` also the
    entropies. Rows sharing a prefix of >= ``min_shared_tokens`` tokens share its segments
    (``plan.tree_plan``: ``chunk_size``, ``response_chunk_size``, ``replay_tokens`` as there). Under ``cp_group``
    every rank passes the same rows: each captured segment is split over the ranks, leaves replay one per rank
    per round, and every rank ends with every row's values. ``plan``: this rank's ``plan.tree_plan`` of these
    rows and knobs where the caller built it already (the engine's pre-flight estimate read it), None: built here.
    """
    adapter, plan = _tree(model, sequences, score_starts, temperature, chunk_size, response_chunk_size,
                          min_shared_tokens, replay_tokens, cp_group, plan, entropy=return_entropy)
    device = _device(model)
    rows = Sequences([(s.to(device),) for s in sequences])
    with torch.no_grad():
        return walk(adapter, plan, rows, "log_probs", temperature, return_entropy, group=cp_group, stats=stats)


def tree_backward(
    model: nn.Module,
    sequences: list[torch.Tensor],
    score_starts: list[int],
    loss_fn: LossFn,
    prompt_grad: str = "exact",
    temperature: float = 1.0,
    chunk_size: int | None = None,
    response_chunk_size: int | None = None,
    min_shared_tokens: int = 1,
    with_entropy: bool = False,
    stats: GroupStats | None = None,
    state_grad_on_host: bool = False,
    replay_tokens: int = REPLAY_TOKENS,
    cp_group: comm.Group = None,
    plan: Plan | None = None,
) -> GroupResult:
    """Accumulate into each parameter's ``.grad`` the gradient of ``sum_i loss_fn(i, logps_i)`` over rows that
    share prefixes (rows, knobs and ``plan`` as ``tree_log_probs``; ``loss_fn`` and ``prompt_grad`` as
    ``group_backward``).

    Each segment of the plan is captured once and recomputed once (exact mode; leaves replayed once with
    autograd), each shared token scored once; the device holds one root-to-leaf path's state and one segment's
    graph at a time. Returns every row's loss, log-probs and (``with_entropy``) entropies, detached.
    """
    _check_prompt_grad(prompt_grad)
    adapter, plan = _tree(model, sequences, score_starts, temperature, chunk_size, response_chunk_size,
                          min_shared_tokens, replay_tokens, cp_group, plan, entropy=with_entropy,
                          prompt_grad=prompt_grad, state_grad_on_host=state_grad_on_host)
    device = _device(model)
    rows = Sequences([(s.to(device),) for s in sequences])
    return walk(adapter, plan, rows, prompt_grad, temperature, with_entropy, loss_fn, group=cp_group,
                state_grad_on_host=state_grad_on_host, stats=stats)
