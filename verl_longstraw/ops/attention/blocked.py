"""Memory-lean attention of query rows over a long cached prefix plus a segment of own keys.

The general op, ``partial_attention_blocked``, returns the attention output and its logsumexp
(so partial results over disjoint key sets merge exactly; the context-parallel op relies on it)
and takes the logsumexp's gradient in backward. ``q`` [B, Hq, N, D]; ``k_prefix`` [B, Hk, P, D],
``v_prefix`` [B, Hk, P, Dv]; ``k_self`` [B, Hk, T, D], ``v_self`` [B, Hk, T, Dv]; Hq a multiple
of Hk. Every query row sees the whole prefix; which own keys it sees is an ``OwnKeyRule``
(by default the segment's own causal attention, N = T). An optional ``key_mask`` [N, P + T]
(bool, True = may attend) restricts that further, e.g. to a sparse top-k selection; it is the
only extra tensor saved (one byte per query x key, shared by all heads). A row that sees no key
gets output 0, logsumexp -inf and zero gradients.

Flash-attention-2 style in plain torch: the forward walks the keys (prefix, then own keys) in
blocks with an online softmax, so the largest temporary is one block of scores
[B, Hq, N, block_size], never [B, Hq, N, P]. Only the inputs, the output and the logsumexp
[B, Hq, N] are saved; the backward recomputes each block's probabilities from the logsumexp.
Query heads of a group are folded into the row dimension ([B, Hk, G*N, D] with G = Hq // Hk),
so grouped heads share their key head without repeating K/V. Arithmetic is float32 (float64
for float64 inputs) in the forward and the backward alike, also under autocast: the running max, sum and
output, the scores, probabilities and every gradient. The matmuls' operands are float32 too, except for
fp16/bf16 inputs on CUDA (``matmul_dtype``): there they are the half inputs, probabilities and gradients
rounded to it, with float32 products and sums (tensor cores, as flash attention; e.g. MLA's absorbed head
dims 576/512, which no fused kernel takes).

``prefix_causal_attention_blocked`` is the single-segment op (output only, in q's dtype), with
the signature and semantics of ``prefix_causal_attention_reference`` in
``verl_longstraw.ops.attention.prefix``; ``partial_attention_reference`` there is the plain reference
of the general op. Tests compare each with its reference.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from ...dtypes import compute_dtype


@dataclass(frozen=True)
class OwnKeyRule:
    """Which own keys (``k_self``, T of them) each of N query rows sees.

    Row i sits at position ``i - start`` of the own segment and sees own keys 0 .. i - start
    (causal); rows before ``start`` see none; rows after the segment (i >= start + T) see all
    of them if ``later_rows_see_all``, else none. The default is a segment's own causal attention
    (start 0, N = T).
    """

    start: int = 0
    later_rows_see_all: bool = False

    def hidden(self, rows: int, own_len: int, key_start: int, key_end: int, device: torch.device) -> torch.Tensor:
        """Bool [rows, key_end - key_start]: True where row i may not see own key j (j in [key_start, key_end))."""
        position = torch.arange(rows, device=device) - self.start
        hidden = torch.arange(key_start, key_end, device=device) > position.unsqueeze(1)
        if not self.later_rows_see_all:
            hidden |= (position >= own_len).unsqueeze(1)
        return hidden


OWN_SEGMENT = OwnKeyRule()  # the queries are the own segment, attending to it causally


def _key_blocks(prefix_len: int, own_len: int, block_size: int) -> Iterator[tuple[bool, int, int]]:
    """(is_own, start, end) over the prefix keys, then the own keys."""
    for start in range(0, prefix_len, block_size):
        yield False, start, min(start + block_size, prefix_len)
    for start in range(0, own_len, block_size):
        yield True, start, min(start + block_size, own_len)


@functools.cache
def _float_output_bmm(device: torch.device) -> bool:
    """Whether ``torch.bmm(..., out_dtype=torch.float32)`` runs for bfloat16 operands on ``device`` (CUDA builds)."""
    a = torch.ones(1, 8, 8, dtype=torch.bfloat16, device=device)
    try:
        return torch.bmm(a, a, out_dtype=torch.float32).dtype == torch.float32
    except (RuntimeError, TypeError):
        return False


def matmul_dtype(q: torch.Tensor) -> torch.dtype:
    """Operand dtype of the blocked op's matmuls for queries like ``q``: fp16/bf16 on CUDA (tensor cores, products
    summed and returned in float32 by ``torch.bmm(..., out_dtype=torch.float32)``, as flash attention keeps its
    scores), else ``compute_dtype`` (float32 matmuls; CPU has no float32-output half matmul)."""
    if planned_matmul_dtype(q.device.type, q.dtype) == q.dtype and _float_output_bmm(q.device):
        return q.dtype
    return compute_dtype(q.dtype)


def planned_matmul_dtype(device_type: str, dtype: torch.dtype) -> torch.dtype:
    """``matmul_dtype`` for inputs of ``dtype`` on a device of ``device_type`` this process need not have (an estimate
    for CUDA GPUs made on a CPU host): half operands on CUDA (where a build lacks ``bmm``'s float32-output overload,
    ``matmul_dtype`` finds out on the device and takes ``compute_dtype``), else ``compute_dtype``."""
    if device_type == "cuda" and dtype in (torch.float16, torch.bfloat16):
        return dtype
    return compute_dtype(dtype)


def _matmul(a: torch.Tensor, b: torch.Tensor, operand: torch.dtype, acc: torch.dtype) -> torch.Tensor:
    """``a @ b`` ([..., n, m] @ [..., m, k], same leading dims) from operands rounded to ``operand``, summed and
    returned in ``acc``. For half operands: one CUDA ``bmm`` with float32 output, elsewhere the same arithmetic
    by float32 matmul of the rounded operands (their products are exact in float32), which is how tests on CPU
    exercise it."""
    if operand == acc:
        return a.to(acc) @ b.to(acc)
    if a.device.type == "cuda":
        out = torch.bmm(a.to(operand).flatten(0, -3), b.to(operand).flatten(0, -3), out_dtype=acc)
        return out.unflatten(0, a.shape[:-2])
    return a.to(operand).to(acc) @ b.to(operand).to(acc)


def _block_scores(
    q_rows: torch.Tensor,
    k_block: torch.Tensor,
    scale: float,
    dtypes: tuple[torch.dtype, torch.dtype],
    groups: int,
    is_own: bool,
    start: int,
    prefix_len: int,
    own_len: int,
    own_keys: OwnKeyRule,
    key_mask: torch.Tensor | None,
) -> torch.Tensor:
    """Scores [B, Hk, G*N, n] (``scale`` x dot products) of query rows [B, Hk, G*N, D] against keys [B, Hk, n, D],
    from matmul operands and into an accumulator of ``dtypes`` (``_matmul``).

    Own keys that ``own_keys`` hides get -inf, and so do keys that ``key_mask`` [N, P + T] hides
    (``start`` is relative to the prefix or the own keys).
    """
    scores = _matmul(q_rows, k_block.transpose(-1, -2), *dtypes).mul_(scale)
    rows, n = q_rows.shape[-2] // groups, k_block.shape[-2]
    hidden = own_keys.hidden(rows, own_len, start, start + n, scores.device) if is_own else None
    if key_mask is not None:
        offset = prefix_len if is_own else 0
        unselected = ~key_mask[:, offset + start : offset + start + n]
        hidden = unselected if hidden is None else hidden | unselected
    if hidden is not None:
        scores.unflatten(-2, (groups, rows)).masked_fill_(hidden, float("-inf"))
    return scores


def autocast_off(method: Callable) -> Callable:
    """An autograd Function's forward or backward run with autocast off on the device of its first tensor argument
    (``torch.amp.custom_fwd``/``custom_bwd`` for whichever device the op runs on)."""

    @functools.wraps(method)
    def run(ctx: torch.autograd.function.FunctionCtx, first: torch.Tensor, *rest: object) -> object:
        with torch.autocast(first.device.type, enabled=False):
            return method(ctx, first, *rest)

    return run


def _empty_if(needed: bool, like: torch.Tensor) -> torch.Tensor | None:
    """An uninitialised gradient buffer shaped and typed like ``like`` where a gradient is needed, else None."""
    return torch.empty_like(like) if needed else None


class _PartialAttentionBlocked(torch.autograd.Function):
    """Autograd function behind ``partial_attention_blocked``: outputs (out, logsumexp); backward takes both
    gradients.

    Both passes compute in ``compute_dtype`` of q's dtype with autocast off (the forward would otherwise
    score in the autocast dtype and the backward, which runs outside autocast, recompute the probabilities
    in float32 from a logsumexp that does not match them). The backward writes each key block's dK/dV into
    gradients allocated once per input (no per-block lists), and skips the inputs that need none.
    """

    @staticmethod
    @autocast_off
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        q: torch.Tensor,
        k_prefix: torch.Tensor,
        v_prefix: torch.Tensor,
        k_self: torch.Tensor,
        v_self: torch.Tensor,
        key_mask: torch.Tensor | None,
        scale: float,
        own_keys: OwnKeyRule,
        block_size: int,
        out_dtype: torch.dtype,
        operand: torch.dtype,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        batch, q_heads, rows, _ = q.shape
        kv_heads, own_len = k_self.shape[1], k_self.shape[-2]
        groups = q_heads // kv_heads
        dtype = compute_dtype(q.dtype)
        dtypes = (operand, dtype)
        q_rows = q.reshape(batch, kv_heads, groups * rows, -1).to(operand)
        keys, values = {False: k_prefix, True: k_self}, {False: v_prefix, True: v_self}

        row_max = q.new_full(q_rows.shape[:-1], float("-inf"), dtype=dtype)
        row_sum = q.new_zeros(q_rows.shape[:-1], dtype=dtype)
        acc = q.new_zeros(*q_rows.shape[:-1], v_self.shape[-1], dtype=dtype)
        for is_own, start, end in _key_blocks(k_prefix.shape[-2], own_len, block_size):
            k_block = keys[is_own][..., start:end, :]
            v_block = values[is_own][..., start:end, :]
            scores = _block_scores(
                q_rows, k_block, scale, dtypes, groups, is_own, start, k_prefix.shape[-2], own_len, own_keys, key_mask
            )
            new_max = torch.maximum(row_max, scores.amax(dim=-1))
            # rows with no visible key so far keep max -inf: shift by 0 instead
            shift = new_max.masked_fill(new_max == float("-inf"), 0.0)
            probs = scores.sub_(shift.unsqueeze(-1)).exp_()  # in place: one block of scores at a time
            correction = (row_max - shift).exp()
            row_sum = row_sum * correction + probs.sum(dim=-1)
            # in place: at MLA's 64 heads x 512 a [rows, Dv] float32 copy is 8 GiB for 64K gathered queries
            acc.mul_(correction.unsqueeze(-1)).add_(_matmul(probs, v_block, *dtypes))
            row_max = new_max
            del scores, probs  # before the next block's scores are made

        # rows that saw no key: acc and row_sum are 0 -> output 0, logsumexp -inf
        out = acc.div_(row_sum.masked_fill(row_sum == 0, 1.0).unsqueeze(-1))
        out = out.reshape(batch, q_heads, rows, -1).to(out_dtype)
        logsumexp = (row_max + row_sum.log()).reshape(batch, q_heads, rows)
        ctx.save_for_backward(q, k_prefix, v_prefix, k_self, v_self, out, logsumexp, key_mask)
        ctx.scale, ctx.own_keys, ctx.block_size, ctx.operand = scale, own_keys, block_size, operand
        return out, logsumexp

    @staticmethod
    @autocast_off
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad_out: torch.Tensor, grad_logsumexp: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        q, k_prefix, v_prefix, k_self, v_self, out, logsumexp, key_mask = ctx.saved_tensors
        batch, q_heads, rows, _ = q.shape
        kv_heads, own_len = k_self.shape[1], k_self.shape[-2]
        groups = q_heads // kv_heads
        dtype = logsumexp.dtype  # the forward's compute dtype
        dtypes = (ctx.operand, dtype)
        folded = (batch, kv_heads, groups * rows, -1)
        keys, values = {False: k_prefix, True: k_self}, {False: v_prefix, True: v_self}
        # one gradient per K/V input that needs one, in its dtype; key block [start, end) writes rows start:end
        needs = dict(zip(("q", "k_prefix", "v_prefix", "k_self", "v_self"), ctx.needs_input_grad, strict=False))
        grad_k = {False: _empty_if(needs["k_prefix"], k_prefix), True: _empty_if(needs["k_self"], k_self)}
        grad_v = {False: _empty_if(needs["v_prefix"], v_prefix), True: _empty_if(needs["v_self"], v_self)}
        q_rows = q.reshape(folded).to(ctx.operand)
        grad_out = grad_out.to(dtype).reshape(folded)
        # d(score) = p * (dO.v - delta) with delta = rowsum(dO * O) - d(logsumexp), since d(logsumexp)/d(score) = p
        delta = (grad_out * out.to(dtype).reshape(folded)).sum(dim=-1, keepdim=True)
        delta = delta - grad_logsumexp.to(dtype).reshape(folded)
        # rows that saw no key have only -inf scores: any finite shift gives p = 0 there instead of NaN
        shift = logsumexp.masked_fill(logsumexp == float("-inf"), 0.0).reshape(folded)
        grad_out = grad_out.to(ctx.operand)  # a matmul operand from here on
        grad_q_rows = torch.zeros_like(q_rows, dtype=dtype) if needs["q"] else None
        for is_own, start, end in _key_blocks(k_prefix.shape[-2], own_len, ctx.block_size):
            k_block = keys[is_own][..., start:end, :]
            scores = _block_scores(q_rows, k_block, ctx.scale, dtypes, groups, is_own, start, k_prefix.shape[-2],
                                   own_len, ctx.own_keys, key_mask)
            probs = scores.sub_(shift).exp_()
            if grad_v[is_own] is not None:
                grad_v[is_own][..., start:end, :] = _matmul(probs.transpose(-1, -2), grad_out, *dtypes)
            if grad_q_rows is None and grad_k[is_own] is None:
                continue
            v_block = values[is_own][..., start:end, :]
            # gradient of the scaled scores: scale * d(score)
            grad_scores = _matmul(grad_out, v_block.transpose(-1, -2), *dtypes).sub_(delta).mul_(probs).mul_(ctx.scale)
            if grad_q_rows is not None:
                grad_q_rows += _matmul(grad_scores, k_block, *dtypes)
            if grad_k[is_own] is not None:
                grad_k[is_own][..., start:end, :] = _matmul(grad_scores.transpose(-1, -2), q_rows, *dtypes)
            del scores, probs, grad_scores  # before the next block's scores are made
        grad_q = grad_q_rows.reshape(q.shape).to(q.dtype) if grad_q_rows is not None else None
        return grad_q, grad_k[False], grad_v[False], grad_k[True], grad_v[True], None, None, None, None, None, None


def check_key_mask(key_mask: torch.Tensor | None, rows: int, keys: int) -> None:
    """Raise ValueError unless ``key_mask`` is None or bool [rows, keys]."""
    if key_mask is not None and (key_mask.dtype != torch.bool or tuple(key_mask.shape) != (rows, keys)):
        raise ValueError(
            f"key_mask must be a bool tensor [queries, prefix + own keys] = [{rows}, {keys}], "
            f"got {key_mask.dtype} {list(key_mask.shape)}"
        )


def partial_attention_blocked(
    q: torch.Tensor,
    k_prefix: torch.Tensor,
    v_prefix: torch.Tensor,
    k_self: torch.Tensor,
    v_self: torch.Tensor,
    scale: float,
    own_keys: OwnKeyRule = OWN_SEGMENT,
    key_mask: torch.Tensor | None = None,
    block_size: int = 1024,
    out_dtype: torch.dtype | None = None,
    operand_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocked online-softmax attention of N query rows over the prefix and the own keys ``own_keys`` lets them see.

    Shapes in the module docstring; ``block_size`` keys are scored at a time; the matmuls take operands in
    ``operand_dtype`` (default ``matmul_dtype(q)``) and sum in the arithmetic dtype. Returns the output
    [B, Hq, N, Dv] in ``out_dtype`` (default: the arithmetic dtype) and the logsumexp of the scores
    [B, Hq, N] in the arithmetic dtype (-inf, with output 0, for rows that see no key); both are
    differentiable.
    """
    check_key_mask(key_mask, q.shape[-2], k_prefix.shape[-2] + k_self.shape[-2])
    out_dtype = out_dtype or compute_dtype(q.dtype)
    operand_dtype = operand_dtype or matmul_dtype(q)
    return _PartialAttentionBlocked.apply(
        q, k_prefix, v_prefix, k_self, v_self, key_mask, scale, own_keys, block_size, out_dtype, operand_dtype
    )


def prefix_causal_attention_blocked(
    q: torch.Tensor,
    k_prefix: torch.Tensor,
    v_prefix: torch.Tensor,
    k_self: torch.Tensor,
    v_self: torch.Tensor,
    scale: float,
    block_size: int = 1024,
    key_mask: torch.Tensor | None = None,
    operand_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Blocked online-softmax attention over prefix + causal segment. Returns [B, Hq, T, Dv] in q's dtype.

    Arguments as ``prefix_causal_attention_reference``; ``block_size`` keys are scored at a time;
    ``key_mask`` [T, P + T] bool (True = visible) restricts which keys each query sees; ``operand_dtype``
    as ``partial_attention_blocked``.
    """
    return partial_attention_blocked(
        q, k_prefix, v_prefix, k_self, v_self, scale, key_mask=key_mask, block_size=block_size, out_dtype=q.dtype,
        operand_dtype=operand_dtype,
    )[0]
