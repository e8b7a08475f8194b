"""Capture a prompt's state once, replay responses against it, backpropagate the prompt once.

Phases for one GRPO group (prompt ``p`` of P tokens, responses ``r_i``):
1. capture: run ``p[:-1]`` without autograd, chunk by chunk, keeping each layer's state;
2. replay: for each response run ``[p[-1]] + r_i[:-1]`` against the state (positions
   P-1 ...), score ``r_i``, and backpropagate its loss at once (one response graph alive);
3. exact mode: the state was a leaf; after each response's backward its ``.grad`` is added
   into a float32 sum (so bfloat16 models sum the G responses' state gradients in float32),
   giving d(sum of losses)/d(state); recompute the prompt chunk by chunk in reverse, from each chunk's boundary
   state, and backpropagate those gradients (plus the gradient the later chunks sent back
   into this chunk's rows) into the parameters.
Each phase runs as one call of the model module and each layer as a call of that layer,
so FSDP2 and gradient-checkpointing hooks apply as in an ordinary forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .adapters import Adapter
from .adapters.base import call_as
from .state import LayerState, PromptState, StateSpec


@dataclass
class GroupStats:
    """What one group cost: state size and seconds per phase."""

    prompt_state_bytes: int = 0
    capture_s: float = 0.0
    replay_s: float = 0.0
    prompt_backward_s: float = 0.0
    response_tokens: int = 0


def chunk_bounds(length: int, chunk_size: int | None) -> list[tuple[int, int]]:
    """[(start, end)] covering ``length`` tokens in chunks of ``chunk_size`` (one chunk if None)."""
    if length == 0:
        return []
    size = chunk_size or length
    return [(s, min(s + size, length)) for s in range(0, length, size)]


def run_segment(
    adapter: Adapter, ids: torch.Tensor, start: int, past: list[LayerState] | None, with_logits: bool
) -> torch.Tensor | list[LayerState]:
    """Run tokens ``ids`` [S] at positions ``start``... after ``past`` (None: nothing before).

    Returns logits [S, vocab] with ``with_logits``; otherwise each layer's segment state
    (the last layer stops once its state is known: its output is never read).
    """

    def forward() -> torch.Tensor | tuple[torch.Tensor, ...]:
        h = adapter.embed(ids)
        ctx = adapter.context(h, start)
        layer_past = past or [adapter.empty_state(i, h) for i in range(adapter.num_layers)]
        states = []
        for idx, layer in enumerate(adapter.layers):
            need_output = with_logits or idx < adapter.num_layers - 1

            def layer_forward(h, *state, idx=idx, need_output=need_output):
                return adapter.layer(idx, h, ctx, state, need_output)

            out = call_as(layer, layer_forward, h, *layer_past[idx])
            if need_output:
                h, out = out[0], out[1:]
            states.append(tuple(out))
        if with_logits:
            return adapter.head(h)
        return tuple(t for s in states for t in s)

    out = call_as(adapter.model, forward)
    if with_logits:
        return out
    flat = iter(out)
    return [tuple(next(flat) for _ in spec) for spec in adapter.specs()]


def capture(adapter: Adapter, ids: torch.Tensor, chunk_size: int | None, keep_boundaries: bool) -> PromptState:
    """State of the prompt tokens ``ids`` [P'], computed chunk by chunk without autograd."""
    state = PromptState(adapter.specs(), len(ids), keep_boundaries, chunk_size)
    with torch.no_grad():
        for s, e in chunk_bounds(len(ids), chunk_size):
            state.append(run_segment(adapter, ids[s:e], s, state.current(), with_logits=False), e - s)
    return state


def _leaves(specs: list[tuple[StateSpec, ...]], layers: list[LayerState], requires_grad: bool) -> list[LayerState]:
    """Detached copies of per-layer state tensors; differentiable ones get ``requires_grad``."""
    return [
        tuple(t.detach().requires_grad_(requires_grad and s.differentiable) for s, t in zip(spec, layer))
        for spec, layer in zip(specs, layers)
    ]


def as_leaves(state: PromptState, requires_grad: bool) -> list[LayerState] | None:
    """The captured state as autograd leaves (differentiable tensors get ``requires_grad``)."""
    current = state.current()
    return None if current is None else _leaves(state.specs, current, requires_grad)


StateGrads = list[list[torch.Tensor | None]]


def accumulate_state_grads(leaves: list[LayerState], grads: StateGrads | None) -> StateGrads:
    """Add each state leaf's ``.grad`` into ``grads`` (float32, or float64 for float64 state) and clear it.

    Called after every response's backward, so the sum over the G responses accumulates in
    float32 even for a bfloat16 state; ``grads`` None starts the sums. Returns the sums, one
    entry per state tensor (None while no gradient reached it).
    """
    grads = grads if grads is not None else [[None] * len(layer) for layer in leaves]
    for layer, sums in zip(leaves, grads):
        for j, leaf in enumerate(layer):
            if leaf.grad is None:
                continue
            if sums[j] is None:
                sums[j] = leaf.grad.to(torch.promote_types(leaf.dtype, torch.float32), copy=True)
            else:
                sums[j] += leaf.grad
            leaf.grad = None
    return grads


def backward_prompt(
    adapter: Adapter, ids: torch.Tensor, chunk_size: int | None, state: PromptState, grads: StateGrads
) -> None:
    """Backpropagate the state gradients ``grads`` (``accumulate_state_grads``) through the prompt ``ids``, in reverse chunks.

    Chunk k is recomputed from its boundary state (as leaves). Its outputs receive the
    gradient of its own rows plus, for fixed-size state, the gradient at its end (cast to
    the output's dtype); the gradient it sends into earlier rows is added to those rows'
    float32 sums, and the gradient of its starting fixed-size state becomes the end
    gradient of chunk k-1.
    """
    bounds = chunk_bounds(len(ids), chunk_size)
    for index in reversed(range(len(bounds))):
        start, end = bounds[index]
        past = state.at_boundary(index, start)
        past_leaves = None if past is None else _leaves(state.specs, past, requires_grad=True)
        with torch.enable_grad():
            segment = run_segment(adapter, ids[start:end], start, past_leaves, with_logits=False)
        outputs, output_grads = [], []
        for spec, seg_layer, grad_layer in zip(state.specs, segment, grads):
            for s, out, grad in zip(spec, seg_layer, grad_layer):
                if grad is not None and out.requires_grad:
                    outputs.append(out)
                    output_grads.append((grad[..., start:end, :] if s.growing else grad).to(out.dtype))
        if outputs:
            torch.autograd.backward(outputs, output_grads)
        if past_leaves is None:
            continue
        for spec, leaf_layer, grad_layer in zip(state.specs, past_leaves, grads):
            for j, (s, leaf) in enumerate(zip(spec, leaf_layer)):
                if not s.growing:
                    grad_layer[j] = leaf.grad
                elif leaf.grad is not None:
                    if grad_layer[j] is None:
                        shape = (*leaf.shape[:-2], state.length, leaf.shape[-1])
                        grad_layer[j] = leaf.new_zeros(shape, dtype=torch.promote_types(leaf.dtype, torch.float32))
                    grad_layer[j][..., :start, :] += leaf.grad


def response_inputs(prompt_ids: torch.Tensor, response: torch.Tensor) -> torch.Tensor:
    """Tokens replayed for a response: the last prompt token, then all but the last response token."""
    return torch.cat([prompt_ids[-1:], response[:-1]])


def score(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs [T] (float32) of ``targets`` under ``logits`` [T, vocab] / temperature, and optionally the entropy [T]."""
    log_probs = torch.log_softmax(logits.float() / temperature, dim=-1)
    token_log_probs = log_probs.gather(-1, targets[:, None])[:, 0]
    entropy = -(log_probs.exp() * log_probs).sum(-1) if with_entropy else None
    return token_log_probs, entropy
