"""Chunked LM-head scoring: float32 log-probs (and entropies) of target tokens, never holding [T, vocab] logits
for backward."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

SCORE_CHUNK_BYTES = 64 * 2**20  # float32 logits of one row chunk in ``score`` (64 rows of a 248K vocabulary)


@dataclass(frozen=True)
class Scoring:
    """What a segment scores: ``targets`` [B * S - first] token ids (one per scored position, padding included),
    the sampling ``temperature``, whether the entropy too, and ``first``: positions before it are not scored
    (B = 1; a segment whose scoring starts inside it, or a CP rank's part of one)."""

    targets: torch.Tensor
    temperature: float
    with_entropy: bool
    first: int = 0


def score_reference(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Plain ``score`` from the LM head's ``logits`` [T, vocab]: float32 log-softmax of all rows at once,
    differentiated by autograd (which saves [T, vocab] float32 tensors: the log-softmax and, for the entropy,
    its exp)."""
    log_probs = torch.log_softmax(logits.float() / temperature, dim=-1)
    token_log_probs = log_probs.gather(-1, targets[:, None])[:, 0]
    entropy = -(log_probs.exp() * log_probs).sum(-1) if with_entropy else None
    return token_log_probs, entropy


def _autocast_state(device: torch.device) -> tuple[bool, torch.dtype]:
    return torch.is_autocast_enabled(device.type), torch.get_autocast_dtype(device.type)


class _LinearScore(torch.autograd.Function):
    """Autograd function behind ``score``: (log-probs [T], entropy [T] or [0]) of ``hidden`` [T, H] under the
    LM head (``weight`` [vocab, H], ``bias``), a row chunk at a time. Saves ``hidden``, the head's parameters and
    ``targets``; the backward recomputes each chunk's logits and log-softmax under the forward's autocast state
    and sums the head's gradient in place in float32 (float64 for a float64 head), each chunk's product from float32
    copies of its factors: no [vocab, H] temporary per chunk (``head_gradient_bytes``)."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor,
        temperature: float,
        with_entropy: bool,
        chunk_rows: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        token_log_probs = hidden.new_empty(len(hidden), dtype=torch.float32)
        entropy = token_log_probs.new_empty(len(hidden) if with_entropy else 0)
        for start in range(0, len(hidden), chunk_rows):
            rows = slice(start, start + chunk_rows)
            log_probs = torch.log_softmax(F.linear(hidden[rows], weight, bias).float() / temperature, dim=-1)
            token_log_probs[rows] = log_probs.gather(-1, targets[rows, None])[:, 0]
            if with_entropy:
                entropy[rows] = -(log_probs.exp() * log_probs).sum(-1)
        ctx.save_for_backward(hidden, weight, bias, targets)
        ctx.temperature, ctx.chunk_rows, ctx.autocast = temperature, chunk_rows, _autocast_state(hidden.device)
        if not with_entropy:
            ctx.mark_non_differentiable(entropy)
        return token_log_probs, entropy

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad_log_probs: torch.Tensor, grad_entropy: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, bias, targets = ctx.saved_tensors
        enabled, dtype = ctx.autocast
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        sum_dtype = torch.promote_types(weight.dtype, torch.float32)  # float32, float64 for a float64 head
        grad_weight = torch.zeros(weight.shape, dtype=sum_dtype, device=weight.device) if need_weight else None
        grad_bias = torch.zeros(bias.shape, dtype=sum_dtype, device=bias.device) if need_bias else None
        for start in range(0, len(hidden), ctx.chunk_rows):
            rows = slice(start, start + ctx.chunk_rows)
            with torch.autocast(hidden.device.type, dtype=dtype, enabled=enabled):
                logits = F.linear(hidden[rows], weight, bias)
            log_probs = torch.log_softmax(logits.float() / ctx.temperature, dim=-1)
            probs = log_probs.exp()
            # d(log p_target)/dx = onehot - p; d(entropy)/dx = -p * (log p + entropy), x = logits / temperature
            grad = grad_log_probs[rows, None]
            if grad_entropy is not None and grad_entropy.numel():
                entropy = -(probs * log_probs).sum(-1, keepdim=True)
                grad = grad + grad_entropy[rows, None] * (log_probs + entropy)
            grad = probs.mul_(-grad).scatter_add_(-1, targets[rows, None], grad_log_probs[rows, None])
            grad_logits = grad.div_(ctx.temperature).to(logits.dtype)  # as autograd rounds it through .float()
            if need_hidden:
                with torch.autocast(hidden.device.type, dtype=dtype, enabled=enabled):
                    grad_hidden[rows] = grad_logits @ weight
            if need_weight:  # in place: no [vocab, H] temporary per row chunk (head_gradient_bytes)
                grad_weight.addmm_(grad_logits.t().to(sum_dtype), hidden[rows].to(sum_dtype))
            if need_bias:
                grad_bias += grad_logits.to(sum_dtype).sum(0)
        return (
            grad_hidden,
            None if grad_weight is None else grad_weight.to(weight.dtype),
            None if grad_bias is None else grad_bias.to(bias.dtype),
            None, None, None, None,
        )


def head_gradient_bytes(vocab_size: int, hidden_size: int, head_dtype: torch.dtype) -> int:
    """Bytes ``score``'s backward holds for the LM head's weight gradient besides the gradient it hands over: the
    float32 sum [vocab, H] (float64 for a float64 head) that every row chunk's product adds into in place."""
    return vocab_size * hidden_size * torch.promote_types(head_dtype, torch.float32).itemsize


def score(
    hidden: torch.Tensor,
    head: torch.nn.Linear,
    targets: torch.Tensor,
    temperature: float,
    with_entropy: bool,
    chunk_rows: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs [T] (float32) of ``targets`` [T] under the LM ``head``'s logits of ``hidden`` [T, H] / temperature;
    optionally the entropy [T].

    The head and a float32 log-softmax run a row chunk at a time (``chunk_rows`` rows, default:
    ``SCORE_CHUNK_BYTES`` of float32 logits), in forward and backward (recomputed there): the graph saves
    ``hidden``, the head's parameters and ``targets``, never the [T, vocab] logits or any float32 copy of them.
    Values as ``score_reference(head(hidden), ...)``. Call it inside the head module's forward (``call_as``) so
    FSDP2 gathers and reduces the head's parameters as for an ordinary call.
    """
    chunk_rows = chunk_rows or max(1, SCORE_CHUNK_BYTES // (4 * head.out_features))
    token_log_probs, entropy = _LinearScore.apply(
        hidden, head.weight, head.bias, targets, temperature, with_entropy, chunk_rows
    )
    return token_log_probs, entropy if with_entropy else None
