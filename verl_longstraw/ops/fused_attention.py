"""Prefix-causal attention from two fused flash-attention kernel calls merged by their logsumexp.

Shapes as ``verl_longstraw.ops.attention``: ``q`` [B, Hq, T, D]; ``k_prefix``/``v_prefix`` [B, Hk, P, D] or
[1, Hk, P, D] (one prefix shared by the B sequences: its kernel call takes the B*T queries as rows of one
batch-1 query, so the prefix is never copied per sequence);
``k_self``/``v_self`` [B, Hk, T, D] (value dim == key dim); Hq a multiple of Hk (the kernels share key
heads themselves). Part 1 is q over the prefix (not causal), part 2 q over its own keys (causal,
T x T, so top-left and bottom-right alignment agree). The merge: lse = logaddexp(lse1, lse2),
out = o1 exp(lse1 - lse) + o2 exp(lse2 - lse). The backward calls each part's kernel backward with
the global output and logsumexp (the ring-attention identity: p = exp(s - lse) and
delta = rowsum(dO * O) are then the global ones), which yields exactly that key subset's dK/dV and
its share of dQ. No Python loop over key blocks; saved are the inputs, the output (q's dtype) and
the logsumexp, as in the blocked op.

This module alone calls PyTorch's private flash-attention ops (tests/ops/test_fused_attention.py
pins what they take and return):
  CPU:  aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, dropout_p, is_causal, *, attn_mask,
        scale) -> (out, logsumexp [B, H, T], natural log, float32 for half inputs) and its ``_backward``;
        any float dtype, GQA, D == Dv only; T == 0 or no keys crash the process (never passed).
  CUDA: aten._scaled_dot_product_flash_attention / ``_backward`` (fp16/bf16, where
        ``torch.backends.cuda.can_use_flash_attention`` accepts the inputs).
"""

from __future__ import annotations

import torch
from torch.backends.cuda import SDPAParams, can_use_flash_attention

from .blocked_attention import _autocast_off, compute_dtype

FUSED_PATHS = {"cpu": "fused_flash_cpu", "cuda": "fused_flash_cuda"}  # per device: the path name the dispatch counts


def fused_dtype(
    q: torch.Tensor, k_prefix: torch.Tensor, v_prefix: torch.Tensor, k_self: torch.Tensor, v_self: torch.Tensor
) -> torch.dtype | None:
    """Arithmetic dtype the fused op runs these inputs in, or None where its kernels do not take them
    (value dim != key dim as in MLA, no queries, a device without a kernel, CUDA outside flash's limits).

    CPU: ``compute_dtype`` of q's (float32 for half/bfloat16, as the blocked op); CUDA: q's own (fp16/bf16).
    """
    if q.shape[-2] == 0 or v_self.shape[-1] != q.shape[-1] or q.device.type not in FUSED_PATHS:
        return None
    if q.device.type == "cpu":
        return compute_dtype(q.dtype)
    gqa = q.shape[1] != k_self.shape[1]
    parts = [(k_self, v_self, True)] + [(k_prefix, v_prefix, False)] * (k_prefix.shape[-2] > 0)
    accepted = all(
        k.dtype == v.dtype == q.dtype and can_use_flash_attention(SDPAParams(q, k, v, None, 0.0, causal, gqa))
        for k, v, causal in parts
    )
    return q.dtype if accepted else None


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


class _FusedPrefixCausalAttention(torch.autograd.Function):
    """Autograd function behind ``prefix_causal_attention_fused`` (both passes in ``dtype``, autocast off)."""

    @staticmethod
    @_autocast_off
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
        xs = [x.to(dtype) for x in (q, k_prefix, v_prefix, k_self, v_self)]
        out, lse, own_extra = _kernel_forward(xs[0], xs[3], xs[4], True, scale)
        prefix_extra, batch, shared = (), q.shape[0], k_prefix.shape[0] != q.shape[0]
        if k_prefix.shape[-2] > 0:
            q_prefix = _as_rows(xs[0]).contiguous() if shared else xs[0]
            out_prefix, lse_prefix, prefix_extra = _kernel_forward(q_prefix, xs[1], xs[2], False, scale)
            if shared:
                out_prefix, lse_prefix = _from_rows(out_prefix, batch), _from_rows(lse_prefix, batch)
            total = torch.logaddexp(lse_prefix, lse)
            out = out_prefix * (lse_prefix - total).exp().unsqueeze(-1) + out * (lse - total).exp().unsqueeze(-1)
            lse = total
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k_prefix, v_prefix, k_self, v_self, out, lse)
        ctx.scale, ctx.dtype, ctx.extra = scale, dtype, (prefix_extra, own_extra)
        return out

    @staticmethod
    @_autocast_off
    def backward(ctx: torch.autograd.function.FunctionCtx, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k_prefix, v_prefix, k_self, v_self, out, lse = ctx.saved_tensors
        q_, kp, vp, ks, vs, out, grad_out = (x.to(ctx.dtype) for x in (q, k_prefix, v_prefix, k_self, v_self, out,
                                                                       grad_out.contiguous()))
        prefix_extra, own_extra = ctx.extra
        grad_q, grad_ks, grad_vs = _kernel_backward(grad_out, q_, ks, vs, out, lse, True, ctx.scale, own_extra)
        grad_kp, grad_vp = torch.zeros_like(k_prefix), torch.zeros_like(v_prefix)  # empty unless there is a prefix
        if k_prefix.shape[-2] > 0:
            shared = k_prefix.shape[0] != q.shape[0]
            per_query = (grad_out, q_, out, lse)
            if shared:
                per_query = tuple(_as_rows(x).contiguous() for x in per_query)
            grad_q_prefix, grad_kp, grad_vp = _kernel_backward(
                *per_query[:2], kp, vp, *per_query[2:], False, ctx.scale, prefix_extra
            )
            if shared:
                grad_q_prefix = _from_rows(grad_q_prefix, q.shape[0])
            grad_q = grad_q + grad_q_prefix
            grad_kp, grad_vp = grad_kp.to(k_prefix.dtype), grad_vp.to(v_prefix.dtype)
        return grad_q.to(q.dtype), grad_kp, grad_vp, grad_ks.to(k_self.dtype), grad_vs.to(v_self.dtype), None, None


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
