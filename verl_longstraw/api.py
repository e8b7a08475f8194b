"""Public entry points: log-probs and gradients of one GRPO group (one prompt, G responses)."""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from .adapters import Adapter, adapter_for
from .estimate import check_budget, estimate_memory
from .replay import (
    GroupStats,
    accumulate_state_grads,
    as_leaves,
    backward_prompt,
    capture,
    response_inputs,
    run_segment,
    score,
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


def _validate_prompt(model: nn.Module, prompt_ids: torch.Tensor, chunk_size: int | None) -> Adapter:
    adapter = adapter_for(model)
    _check_ids("prompt_ids", prompt_ids, adapter.config.vocab_size)
    if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"chunk_size must be a positive int or None, got {chunk_size!r}")
    return adapter


def _device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def _prompt_state(
    adapter: Adapter,
    prompt_ids: torch.Tensor,
    chunk_size: int | None,
    keep_boundaries: bool,
    stats: GroupStats,
    state: PromptState | None,
) -> PromptState:
    """``state`` after checking it was captured from ``prompt_ids`` with this chunking, else a fresh
    capture of ``prompt_ids[:-1]`` bound to ``prompt_ids``."""
    if state is not None:
        if state.length != len(prompt_ids) - 1 or state.filled != state.length:
            raise ValueError(f"state holds {state.filled} of {state.length} tokens; this prompt needs "
                             f"{len(prompt_ids) - 1} (pass the state captured from these prompt_ids)")
        state.check_prompt(prompt_ids)
        if state.chunk_size != chunk_size:
            raise ValueError(f"state was captured with chunk_size={state.chunk_size}, not {chunk_size}")
        if keep_boundaries and state.boundaries is None:
            raise ValueError("prompt_grad='exact' needs a state captured with for_backward=True")
        return state
    watch = Stopwatch(prompt_ids.device)
    state = capture(adapter, prompt_ids[:-1], chunk_size, keep_boundaries)
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
) -> PromptState:
    """Capture a prompt's state once (no autograd), to pass as ``state=`` to ``group_log_probs`` and
    then ``group_backward`` so a training step computes the prompt's forward once, not twice.

    ``for_backward`` keeps the chunk-boundary states the exact backward restarts from. The
    state holds per layer what ``adapter.state_specs`` says (e.g. K/V [1, Hk, P-1, D]).
    """
    adapter = _validate_prompt(model, prompt_ids, chunk_size)
    adapter.check_length(len(prompt_ids))
    with torch.no_grad():
        return _prompt_state(adapter, prompt_ids.to(_device(model)), chunk_size, for_backward,
                             stats if stats is not None else GroupStats(), None)


def group_log_probs(
    model: nn.Module,
    prompt_ids: torch.Tensor,
    responses: list[torch.Tensor],
    temperature: float = 1.0,
    chunk_size: int | None = None,
    return_entropy: bool = False,
    stats: GroupStats | None = None,
    state: PromptState | None = None,
):
    """Per-token log-probs of each response given the prompt, computing the prompt once.

    Returns a list of float32 tensors [T_i] (equal to a full forward over prompt ++ response),
    and with ``return_entropy`` also the entropies [T_i] of the same positions. ``state``
    (from ``capture_prompt``) skips the capture.
    """
    adapter = validate_group(model, prompt_ids, responses, chunk_size)
    device = _device(model)
    prompt_ids = prompt_ids.to(device)
    stats = stats if stats is not None else GroupStats()
    log_probs, entropies = [], []
    with torch.no_grad():
        past = _prompt_state(adapter, prompt_ids, chunk_size, False, stats, state).current()
        watch = Stopwatch(device)
        for response in responses:
            response = response.to(device)
            logits = run_segment(adapter, response_inputs(prompt_ids, response), len(prompt_ids) - 1, past, True)
            lp, ent = score(logits, response, temperature, return_entropy)
            log_probs.append(lp)
            entropies.append(ent)
            stats.response_tokens += len(response)
        stats.replay_s += watch.seconds()
    return (log_probs, entropies) if return_entropy else log_probs


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
) -> torch.Tensor:
    """Accumulate into each parameter's ``.grad`` the gradient of ``sum_i loss_fn(i, logps_i)``.

    ``loss_fn(i, logps_i)`` (or ``loss_fn(i, logps_i, entropy_i)`` with ``with_entropy``)
    returns a scalar for response i; ``logps_i`` [T_i] is float32. ``prompt_grad="exact"``
    gives the standard full-sequence gradient; ``"detached"`` holds the prompt state
    constant (LongStraw paper). With ``memory_budget_bytes``, first compare the pre-flight
    estimate (``verl_longstraw.estimate``: prompt state + state gradients + peak saved for
    backward) against it and raise MemoryError naming the fix before computing anything.
    ``state`` (from ``capture_prompt`` with the same ``chunk_size``) skips the capture.
    Returns the losses [G], detached.
    """
    if prompt_grad not in PROMPT_GRAD_MODES:
        raise ValueError(f"prompt_grad must be one of {PROMPT_GRAD_MODES}, got {prompt_grad!r}")
    adapter = validate_group(model, prompt_ids, responses, chunk_size)
    if memory_budget_bytes is not None:
        dtype = next(model.parameters()).dtype
        longest = max(len(r) for r in responses)
        estimate = estimate_memory(adapter.config, len(prompt_ids), len(responses), longest, chunk_size, prompt_grad,
                                   dtype, specs=adapter.specs())
        check_budget(estimate, memory_budget_bytes, chunk_size)
    device = _device(model)
    prompt_ids = prompt_ids.to(device)
    exact = prompt_grad == "exact"
    stats = stats if stats is not None else GroupStats()

    state = _prompt_state(adapter, prompt_ids, chunk_size, exact, stats, state)
    leaves = as_leaves(state, requires_grad=exact)

    watch = Stopwatch(device)
    losses, state_grads = [], None
    for i, response in enumerate(responses):
        response = response.to(device)
        logits = run_segment(adapter, response_inputs(prompt_ids, response), len(prompt_ids) - 1, leaves, True)
        lp, ent = score(logits, response, temperature, with_entropy)
        loss = loss_fn(i, lp, ent) if with_entropy else loss_fn(i, lp)
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            raise ValueError(f"loss_fn must return a scalar tensor, got {type(loss).__name__} for response {i}")
        loss.backward()
        if exact and leaves is not None:
            state_grads = accumulate_state_grads(leaves, state_grads)
        losses.append(loss.detach())
        stats.response_tokens += len(response)
    stats.replay_s += watch.seconds()

    if exact and leaves is not None:
        watch = Stopwatch(device)
        backward_prompt(adapter, prompt_ids[:-1], chunk_size, state, state_grads)
        stats.prompt_backward_s += watch.seconds()
    return torch.stack(losses)
