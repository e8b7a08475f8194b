"""Public entry points: log-probs and gradients of one GRPO group (one prompt, G responses).

Every entry point takes ``cp_group``: a process group whose ranks all call it with the same
arguments and run the group together (context parallel, ``verl_longstraw.parallel``): each rank
holds about 1/R of the prompt state, replays one response per round, and ends with the
log-probs and losses of every response. Parameter gradients are per-rank partial sums whose
sum over the group is the single-process gradient. With ``cp_group=None`` (one process) the
behaviour and results are the single-process ones.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from .adapters import Adapter, adapter_for
from .errors import UnsupportedModelError
from .estimate import check_budget, estimate_memory
from .parallel import comm
from .replay import (
    REPLAY_TOKENS,
    GroupStats,
    PromptChunk,
    Scoring,
    accumulate_state_grads,
    as_leaves,
    backward_prompt,
    capture,
    gather_round,
    prompt_chunks,
    response_rounds,
    run_segment,
)
from .state import PromptState
from .timing import Stopwatch

PROMPT_GRAD_MODES = ("exact", "detached")
LossFn = Callable[..., torch.Tensor]


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


def _agree(cp_group: comm.Group, validate: Callable[[], Any], prompt_ids, responses, **settings) -> Any:
    """``validate()``'s result once every rank of ``cp_group`` validated the same group.

    Each rank validates its own arguments, then the ranks exchange (error, fingerprint of the
    prompt, the responses and ``settings``) in one small collective, so bad input or ranks
    that disagree raise the same ValueError on every rank instead of leaving some ranks
    waiting in a collective.
    """
    if cp_group is None:
        return validate()
    result, error = None, None
    try:
        result = validate()
    except (ValueError, UnsupportedModelError, MemoryError) as exc:
        error = exc
    mine = None
    if error is None:
        mine = {"prompt_ids": _fingerprint(prompt_ids), "responses": [_fingerprint(r) for r in responses], **settings}
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
                f"{values if field != 'responses' else 'see fingerprints'}); every rank of cp_group must call with "
                "the same prompt_ids, responses and settings"
            )
    return result


def _plan(
    prompt_ids: torch.Tensor, chunk_size: int | None, cp_group: comm.Group
) -> tuple[list[PromptChunk], tuple[int, ...]]:
    """This rank's capture chunks and every rank's state rows (ValueError for a prompt too short for the group)."""
    return prompt_chunks(len(prompt_ids) - 1, chunk_size, cp_group)


def _prompt_state(
    adapter: Adapter,
    prompt_ids: torch.Tensor,
    chunk_size: int | None,
    keep_boundaries: bool,
    stats: GroupStats,
    state: PromptState | None,
    chunks: list[PromptChunk],
    rows: int,
) -> PromptState:
    """``state`` after checking it was captured from ``prompt_ids`` with this chunking, else a fresh
    capture of ``prompt_ids[:-1]`` bound to ``prompt_ids``."""
    if state is not None:
        if state.length != rows:
            raise ValueError(f"state holds {state.length} rows; this rank needs {rows} for these prompt_ids "
                             "and cp_group (pass the state capture_prompt returned for them)")
        state.check_prompt(prompt_ids)
        if state.chunk_size != chunk_size:
            raise ValueError(f"state was captured with chunk_size={state.chunk_size}, not {chunk_size}")
        if keep_boundaries and state.boundaries is None:
            raise ValueError("prompt_grad='exact' needs a state captured with for_backward=True")
        return state
    watch = Stopwatch(prompt_ids.device)
    state = capture(adapter, prompt_ids[:-1], chunks, rows, chunk_size, keep_boundaries)
    state.bind(prompt_ids)
    stats.capture_s += watch.seconds()
    stats.prompt_state_bytes = max(stats.prompt_state_bytes, state.nbytes())
    return state


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

    ``for_backward`` keeps the chunk-boundary states the exact backward restarts from. The
    state holds per layer what ``adapter.state_specs`` says (e.g. K/V [1, Hk, P-1, D]).
    """

    def validate():
        adapter = _validate_prompt(model, prompt_ids, chunk_size)
        adapter.check_length(len(prompt_ids))
        return adapter, _plan(prompt_ids, chunk_size, cp_group)

    adapter, (chunks, rows) = _agree(cp_group, validate, prompt_ids, [], chunk_size=chunk_size)
    stats = stats if stats is not None else GroupStats()
    with torch.no_grad():
        return _prompt_state(adapter, prompt_ids.to(_device(model)), chunk_size, for_backward, stats, None,
                             chunks, rows[comm.group_rank(cp_group)])


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
):
    """Per-token log-probs of each response given the prompt, computing the prompt once.

    Returns a list of float32 tensors [T_i] (equal to a full forward over prompt ++ response),
    and with ``return_entropy`` also the entropies [T_i] of the same positions. ``state``
    (from ``capture_prompt``) skips the capture. Responses replay in batches of k, in order, with
    k x (longest T_i of the batch) <= ``replay_tokens`` (one forward each, the prompt state broadcast;
    ``replay.replay_batches``); under ``cp_group`` one response per rank per round whatever ``replay_tokens``.
    """
    def validate():
        _check_replay_tokens(replay_tokens)
        return validate_group(model, prompt_ids, responses, chunk_size), _plan(prompt_ids, chunk_size, cp_group)

    adapter, (chunks, rows) = _agree(
        cp_group, validate, prompt_ids, responses,
        chunk_size=chunk_size, temperature=temperature, entropy=return_entropy,
    )
    device = _device(model)
    prompt_ids = prompt_ids.to(device)
    stats = stats if stats is not None else GroupStats()
    log_probs, entropies = {}, {}
    with torch.no_grad():
        rank_rows = rows[comm.group_rank(cp_group)]
        past = _prompt_state(adapter, prompt_ids, chunk_size, False, stats, state, chunks, rank_rows).current()
        watch = Stopwatch(device)
        steps = response_rounds(prompt_ids, [r.to(device) for r in responses], chunks, rows, cp_group, replay_tokens)
        for step in steps:
            scoring = Scoring(step.targets, temperature, return_entropy)
            lp, ent = run_segment(adapter, step.inputs, len(prompt_ids) - 1, past, scoring, step.sharding)
            log_probs.update(gather_round(step.split(lp), step, cp_group))
            if return_entropy:
                entropies.update(gather_round(step.split(ent), step, cp_group))
            stats.response_tokens += step.real_tokens
        stats.replay_s += watch.seconds()
    log_probs = [log_probs[i] for i in range(len(responses))]
    return (log_probs, [entropies[i] for i in range(len(responses))]) if return_entropy else log_probs


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
    return_log_probs: bool = False,
    replay_tokens: int = REPLAY_TOKENS,
):
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
    does not fit beside the model. Returns the losses [G], detached; with ``return_log_probs`` also the
    log-probs [T_i] and entropies [T_i] (None without ``with_entropy``) of every response, detached (float32, as
    ``group_log_probs`` returns them), so one replay serves both the loss and its inputs.

    Responses replay in batches of k, in order, with k x (longest T_i of the batch) <= ``replay_tokens``: one
    forward of the k right-padded responses against the broadcast prompt state and one backward of the sum of
    their losses (``loss_fn`` is still called per response, with its unpadded tensors); memory grows with the
    budget, not with G. Under ``cp_group`` one response per rank per round whatever ``replay_tokens`` (k = 1).
    """

    def validate():
        _check_replay_tokens(replay_tokens)
        if prompt_grad not in PROMPT_GRAD_MODES:
            raise ValueError(f"prompt_grad must be one of {PROMPT_GRAD_MODES}, got {prompt_grad!r}")
        adapter = validate_group(model, prompt_ids, responses, chunk_size)
        if memory_budget_bytes is not None:
            dtype = next(model.parameters()).dtype
            longest = max(len(r) for r in responses)
            # rank 0's figures (the most rows) from replicated arguments: every rank reaches the same verdict
            estimate = estimate_memory(adapter.config, len(prompt_ids), len(responses), longest, chunk_size,
                                       prompt_grad, dtype, specs=adapter.specs(), cp_size=comm.group_size(cp_group),
                                       state_grad_on_host=state_grad_on_host, replay_tokens=replay_tokens,
                                       device_type=_device(model).type)
            check_budget(estimate, memory_budget_bytes)
        return adapter, _plan(prompt_ids, chunk_size, cp_group)

    adapter, (chunks, rows) = _agree(
        cp_group, validate, prompt_ids, responses,
        chunk_size=chunk_size, temperature=temperature, entropy=with_entropy, prompt_grad=prompt_grad,
        memory_budget_bytes=memory_budget_bytes, state_grad_on_host=state_grad_on_host,
    )
    device = _device(model)
    prompt_ids = prompt_ids.to(device)
    exact = prompt_grad == "exact"
    stats = stats if stats is not None else GroupStats()

    state = _prompt_state(adapter, prompt_ids, chunk_size, exact, stats, state, chunks, rows[comm.group_rank(cp_group)])
    leaves = as_leaves(state, requires_grad=exact)

    watch = Stopwatch(device)
    losses, state_grads, log_probs, entropies = {}, None, {}, {}
    for step in response_rounds(prompt_ids, [r.to(device) for r in responses], chunks, rows, cp_group, replay_tokens):
        scoring = Scoring(step.targets, temperature, with_entropy)
        lp, ent = run_segment(adapter, step.inputs, len(prompt_ids) - 1, leaves, scoring, step.sharding)
        lps = step.split(lp)
        ents = step.split(ent) if with_entropy else [None] * len(lps)
        batch_losses = [_response_loss(loss_fn, i, lp_i, ent_i, with_entropy)
                        for i, lp_i, ent_i in zip(step.batch, lps, ents, strict=True)]
        # losses and validity of every rank's responses before any rank starts a backward (with its collectives)
        payloads = [
            torch.stack([loss.detach().to(lp.dtype), lp.new_ones(())])
            if isinstance(loss, torch.Tensor) and loss.dim() == 0 else lp.new_zeros(2)
            for loss in batch_losses
        ]
        shared = gather_round(payloads, step, cp_group, sizes=(2,) * len(step.target_sizes))
        for i, (value, ok) in shared.items():
            if not ok:
                raise ValueError(f"loss_fn must return a scalar tensor; it did not for response {i}")
            losses[i] = value
        if return_log_probs:
            log_probs.update(gather_round(lps, step, cp_group))
            if with_entropy:
                entropies.update(gather_round(ents, step, cp_group))
        torch.autograd.backward(batch_losses)  # one backward for the batch
        if exact and leaves is not None:
            state_grads = accumulate_state_grads(leaves, state_grads, state_grad_on_host)
        stats.response_tokens += step.real_tokens
    stats.replay_s += watch.seconds()

    if exact and leaves is not None:
        held = sum(t.numel() * t.element_size() for layer in state_grads or [] for t in layer if t is not None)
        if state_grad_on_host:
            stats.state_grad_host_bytes = max(stats.state_grad_host_bytes, held)
        else:
            stats.state_grad_device_bytes = max(stats.state_grad_device_bytes, held)
        watch = Stopwatch(device)
        backward_prompt(adapter, prompt_ids[:-1], chunks, state, state_grads, state_grad_on_host)
        stats.prompt_backward_s += watch.seconds()
    losses = torch.stack([losses[i] for i in range(len(responses))])
    if not return_log_probs:
        return losses
    order = range(len(responses))
    return losses, [log_probs[i] for i in order], [entropies[i] for i in order] if with_entropy else None


def _response_loss(loss_fn: LossFn, index: int | None, lp: torch.Tensor, ent: torch.Tensor | None, with_entropy: bool):
    """``loss_fn``'s loss for response ``index``; for a CP dummy (None) a zero loss over the same graph,
    so its backward makes the same calls as a real one."""
    if index is None:
        return lp.sum() * 0 + (ent.sum() * 0 if with_entropy else 0)
    return loss_fn(index, lp, ent) if with_entropy else loss_fn(index, lp)
