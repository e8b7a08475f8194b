"""Prefix attention from fused flash-attention kernel calls merged by their logsumexp.

Shapes as ``verl_longstraw.ops.attention``: ``q`` [B, Hq, N, D]; ``k_prefix``/``v_prefix`` [B, Hk, P, D] or
[1, Hk, P, D] (one prefix shared by the B sequences: its kernel call takes the B*N queries as rows of one
batch-1 query, so the prefix is never copied per sequence);
``k_self``/``v_self`` [B, Hk, T, D] (value dim == key dim); Hq a multiple of Hk (the kernels share key
heads themselves). Which own keys a query row sees is an ``OwnKeyRule`` (by default the segment's own causal
attention, N = T). The keys split into at most three kernel calls ("parts"), each over a contiguous range of
query rows: every row over the prefix (not causal); rows start .. start+T over the own keys (causal, T x T, so
top-left and bottom-right alignment agree); the rows after, over all own keys (not causal) where the rule lets
them see those. The merge: lse = logaddexp of the parts', out = sum of o_p exp(lse_p - lse).

``fused_partial_backward`` takes each part's kernel backward with a given output and logsumexp over a key set
that contains this call's keys (the ring-attention identity: p = exp(s - lse) and delta = rowsum(dO * O) are
then that set's), which yields exactly this call's dK/dV and its share of dQ. With the call's own merged output
and logsumexp that is the gradient of ``prefix_causal_attention_fused``; with the output and logsumexp over the
keys of every rank of a context-parallel group it is a rank's share of the sharded op
(``parallel.attention``), which therefore never needs a gradient of the logsumexp. No Python loop over key
blocks; saved are the inputs, the output and the logsumexp, as in the blocked op.

This module alone calls PyTorch's private flash-attention ops (tests/ops/test_fused_attention.py
pins what they take and return):
  CPU:  aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, dropout_p, is_causal, *, attn_mask,
        scale) -> (out, logsumexp [B, H, T], natural log, float32 for half inputs) and its ``_backward``;
        any float dtype, GQA, D == Dv only; T == 0 or no keys crash the process (never passed).
  CUDA: aten._scaled_dot_product_flash_attention / ``_backward`` (fp16/bf16, where
        ``torch.backends.cuda.can_use_flash_attention`` accepts the inputs).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch.backends.cuda import SDPAParams, can_use_flash_attention

from .blocked_attention import OWN_SEGMENT, OwnKeyRule, autocast_off, compute_dtype

FUSED_PATHS = {"cpu": "fused_flash_cpu", "cuda": "fused_flash_cuda"}  # per device: the path name the dispatch counts


def fused_kernel_dtype(
    device: torch.device, dtype: torch.dtype, q_heads: int, kv_heads: int, qk_dim: int, v_dim: int
) -> torch.dtype | None:
    """Arithmetic dtype the fused kernels run inputs of this kind in, or None where they do not take them (value
    dim != key dim as in MLA, a device without a kernel, CUDA outside flash's limits). A function of these
    arguments only, never of sequence lengths, so every rank of a context-parallel group decides alike.

    CPU: ``compute_dtype`` of ``dtype`` (float32 for half/bfloat16, as the blocked op); CUDA: ``dtype`` (fp16/bf16).
    """
    if v_dim != qk_dim or device.type not in FUSED_PATHS:
        return None
    if device.type == "cpu":
        return compute_dtype(dtype)
    return dtype if _flash_accepts(device, dtype, q_heads, kv_heads, qk_dim) else None


@functools.cache
def _flash_accepts(device: torch.device, dtype: torch.dtype, q_heads: int, kv_heads: int, dim: int) -> bool:
    """Whether CUDA's flash kernel takes queries/keys of these heads, head dim and dtype, causal or not, for training
    (asked on small stand-in tensors that require gradients: lengths do not enter its limits, and some GPUs take
    head dims in the forward only)."""
    q = torch.empty(1, q_heads, 8, dim, device=device, dtype=dtype, requires_grad=True)
    k = torch.empty(1, kv_heads, 8, dim, device=device, dtype=dtype, requires_grad=True)
    return all(can_use_flash_attention(SDPAParams(q, k, k, None, 0.0, causal, q_heads != kv_heads))
               for causal in (False, True))


def fused_dtype(
    q: torch.Tensor, k_prefix: torch.Tensor, v_prefix: torch.Tensor, k_self: torch.Tensor, v_self: torch.Tensor
) -> torch.dtype | None:
    """``fused_kernel_dtype`` of these inputs, None without queries."""
    if q.shape[-2] == 0:
        return None
    return fused_kernel_dtype(q.device, q.dtype, q.shape[1], k_self.shape[1], q.shape[-1], v_self.shape[-1])


@dataclass(frozen=True)
class _Part:
    """One kernel call: query rows [start, end) over the prefix keys or over the own keys, causal or not."""

    own: bool
    start: int
    end: int
    causal: bool


def _parts(rows: int, prefix_len: int, own_len: int, own_keys: OwnKeyRule) -> list[_Part]:
    """The kernel calls that cover what ``own_keys`` lets ``rows`` query rows see (rows that see no key: none)."""
    parts = [_Part(False, 0, rows, False)] if prefix_len and rows else []
    if own_len:
        start, end = own_keys.start, own_keys.start + own_len
        if not 0 <= start <= end <= rows:
            raise ValueError(f"the fused op takes own keys of rows {start}..{end} within the {rows} query rows")
        parts.append(_Part(True, start, end, True))
        if own_keys.later_rows_see_all and end < rows:
            parts.append(_Part(True, end, rows, False))
    return parts


def _as_rows(x: torch.Tensor) -> torch.Tensor:
    """[B, H, T, ...] -> [1, H, B*T, ...]: B sequences' queries as the rows of one sequence (for a shared prefix)."""
    return x.transpose(0, 1).reshape(1, x.shape[1], x.shape[0] * x.shape[2], *x.shape[3:])


def _from_rows(x: torch.Tensor, batch: int) -> torch.Tensor:
    """Inverse of ``_as_rows``: [1, H, B*T, ...] -> [B, H, T, ...]."""
    return x.reshape(x.shape[1], batch, x.shape[2] // batch, *x.shape[3:]).transpose(0, 1)


def _kernel_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor, tuple]:
    """(out [B, Hq, N, D], logsumexp [B, Hq, N], what the CUDA backward needs besides) of one kernel call."""
    if q.is_cuda:
        out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = torch.ops.aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, causal, False, scale=scale
        )
        return out, lse, (cum_q, cum_k, max_q, max_k, seed, offset)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    return out, lse, ()


def _kernel_backward(
    grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
    lse: torch.Tensor, causal: bool, scale: float, extra: tuple,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of one kernel call, given the (global) ``out`` and ``lse``."""
    if q.is_cuda:
        cum_q, cum_k, max_q, max_k, seed, offset = extra
        return torch.ops.aten._scaled_dot_product_flash_attention_backward(
            grad_out, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, 0.0, causal, seed, offset, scale=scale
        )
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out, q, k, v, out, lse, 0.0, causal, scale=scale
    )


def _part_inputs(part: _Part, q, k_prefix, v_prefix, k_self, v_self, *per_row: torch.Tensor):
    """(q, k, v, *per_row) of one part in the kernel's layout: the part's rows of q and of each [B, Hq, N, ...]
    tensor in ``per_row``; for a shared batch-1 prefix the B*N rows of one batch-1 query."""
    rows = [x[:, :, part.start : part.end] for x in (q, *per_row)]
    if part.own:
        return rows[0], k_self, v_self, *rows[1:]
    if k_prefix.shape[0] != q.shape[0]:
        rows = [_as_rows(x) for x in rows]
    return rows[0], k_prefix, v_prefix, *rows[1:]


def _part_result(x: torch.Tensor, part: _Part, batch: int) -> torch.Tensor:
    """A part's per-row result back in [B, Hq, rows, ...] (undoing ``_as_rows`` for a shared prefix)."""
    return _from_rows(x, batch) if not part.own and x.shape[0] != batch else x


def fused_partial_forward(
    q: torch.Tensor,
    k_prefix: torch.Tensor,
    v_prefix: torch.Tensor,
    k_self: torch.Tensor,
    v_self: torch.Tensor,
    scale: float,
    dtype: torch.dtype,
    own_keys: OwnKeyRule = OWN_SEGMENT,
) -> tuple[torch.Tensor, torch.Tensor, tuple]:
    """Attention of the N query rows over the prefix and the own keys ``own_keys`` lets them see, no autograd.

    Returns the output [B, Hq, N, D] and its logsumexp [B, Hq, N] in ``compute_dtype(dtype)`` (rows that see no
    key: output 0, logsumexp -inf), and what ``fused_partial_backward`` needs of the kernel calls. Inputs are
    cast to ``dtype`` (from ``fused_kernel_dtype``).
    """
    batch, heads, rows, _ = q.shape
    acc = compute_dtype(dtype)
    out = q.new_zeros(batch, heads, rows, v_self.shape[-1], dtype=acc)
    lse = q.new_full((batch, heads, rows), float("-inf"), dtype=acc)
    extras = []
    xs = [x.to(dtype) for x in (q, k_prefix, v_prefix, k_self, v_self)]
    for part in _parts(rows, k_prefix.shape[-2], k_self.shape[-2], own_keys):
        part_q, part_k, part_v = _part_inputs(part, *xs)
        part_out, part_lse, extra = _kernel_forward(part_q.contiguous(), part_k, part_v, part.causal, scale)
        part_out, part_lse = _part_result(part_out, part, batch), _part_result(part_lse, part, batch)
        seen = lse[:, :, part.start : part.end]
        total = torch.logaddexp(seen, part_lse)
        out[:, :, part.start : part.end] = (out[:, :, part.start : part.end] * (seen - total).exp().unsqueeze(-1)
                                            + part_out * (part_lse - total).exp().unsqueeze(-1))
        lse[:, :, part.start : part.end] = total
        extras.append(extra)
    return out, lse, tuple(extras)


def fused_partial_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k_prefix: torch.Tensor,
    v_prefix: torch.Tensor,
    k_self: torch.Tensor,
    v_self: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    scale: float,
    dtype: torch.dtype,
    own_keys: OwnKeyRule,
    extras: tuple,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (q, k_prefix, v_prefix, k_self, v_self), each in its input's dtype, of the keys of
    ``fused_partial_forward(q, ..., dtype, own_keys)`` (which returned ``extras``) given d(output) ``grad_out``
    [B, Hq, N, D] of an attention whose output ``out`` [B, Hq, N, D] and logsumexp ``lse`` [B, Hq, N] are over
    these keys and possibly others (see the module docstring). ``lse`` must be finite on every row that sees one
    of these keys."""
    xs = [x.to(dtype) for x in (q, k_prefix, v_prefix, k_self, v_self)]
    acc = compute_dtype(dtype)
    per_row = [grad_out.to(dtype), out.to(dtype), lse.to(acc)]
    grad_q, *grads = (torch.zeros_like(x, dtype=acc) for x in (q, k_prefix, v_prefix, k_self, v_self))
    grads = {False: grads[:2], True: grads[2:]}
    parts = _parts(q.shape[-2], k_prefix.shape[-2], k_self.shape[-2], own_keys)
    for part, extra in zip(parts, extras, strict=True):
        part_q, part_k, part_v, part_grad, part_out, part_lse = _part_inputs(part, *xs, *per_row)
        dq, dk, dv = _kernel_backward(part_grad.contiguous(), part_q.contiguous(), part_k, part_v,
                                      part_out.contiguous(), part_lse.contiguous(), part.causal, scale, extra)
        grad_q[:, :, part.start : part.end] += _part_result(dq, part, q.shape[0])
        grad_k, grad_v = grads[part.own]
        grad_k += dk
        grad_v += dv
    inputs = (q, k_prefix, v_prefix, k_self, v_self)
    return tuple(g.to(x.dtype) for g, x in zip((grad_q, *grads[False], *grads[True]), inputs, strict=True))


class _FusedPrefixCausalAttention(torch.autograd.Function):
    """Autograd function behind ``prefix_causal_attention_fused`` (both passes in ``dtype``, autocast off)."""

    @staticmethod
    @autocast_off
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        q: torch.Tensor,
        k_prefix: torch.Tensor,
        v_prefix: torch.Tensor,
        k_self: torch.Tensor,
        v_self: torch.Tensor,
        scale: float,
        dtype: torch.dtype,
    ) -> torch.Tensor:
        out, lse, ctx.extras = fused_partial_forward(q, k_prefix, v_prefix, k_self, v_self, scale, dtype)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k_prefix, v_prefix, k_self, v_self, out, lse)
        ctx.scale, ctx.dtype = scale, dtype
        return out

    @staticmethod
    @autocast_off
    def backward(ctx: torch.autograd.function.FunctionCtx, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grads = fused_partial_backward(grad_out, *ctx.saved_tensors, ctx.scale, ctx.dtype, OWN_SEGMENT, ctx.extras)
        return *grads, None, None


def prefix_causal_attention_fused(
    q: torch.Tensor,
    k_prefix: torch.Tensor,
    v_prefix: torch.Tensor,
    k_self: torch.Tensor,
    v_self: torch.Tensor,
    scale: float,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Every query over the whole prefix and its segment causally; [B, Hq, T, D] in q's dtype.

    Arguments as ``prefix_causal_attention_reference`` (no ``key_mask``); ``dtype`` from ``fused_dtype``
    (which must not be None for these inputs).
    """
    return _FusedPrefixCausalAttention.apply(q, k_prefix, v_prefix, k_self, v_self, scale, dtype)
