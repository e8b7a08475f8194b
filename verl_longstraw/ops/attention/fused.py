"""Prefix attention from fused flash-attention kernel calls merged by their logsumexp.

Shapes as ``verl_longstraw.ops.attention.prefix``: ``q`` [B, Hq, N, D]; ``k_prefix``/``v_prefix`` [B, Hk, P, D] or
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
(``ops.attention.cp``), which therefore never needs a gradient of the logsumexp. The same identity lets the
backward split the prefix keys into blocks of bounded bytes (``BACKWARD_BLOCK_BYTES``), one kernel call each, so
its transients (``fused_backward_transient_bytes``) do not grow with the prefix; the forward makes one call per
part. Saved are the inputs, the output and the logsumexp, as in the blocked op. The query gradient is summed in
float32 (``compute_dtype``) over the calls and rounded to q's dtype once.

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
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.backends.cuda import SDPAParams, can_use_flash_attention

from ...dtypes import compute_dtype
from ...fake_cuda import is_fake
from .blocked import OWN_SEGMENT, OwnKeyRule, autocast_off

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
    if device.type == "cuda" and not _flash_accepts(device, dtype, q_heads, kv_heads, qk_dim):
        return None
    return _kernel_dtype(device.type, dtype)


FLASH_MAX_HEAD_DIM = 256  # flash attention's largest head dim (training), CUDA


def planned_fused_dtype(
    device_type: str, dtype: torch.dtype, q_heads: int, kv_heads: int, qk_dim: int, v_dim: int
) -> torch.dtype | None:
    """``fused_kernel_dtype`` for a device of ``device_type`` that this process need not have (a memory table for
    CUDA GPUs computed on a CPU host): asked of the device where torch sees one; on CUDA without a visible GPU,
    flash's documented training limits instead (fp16/bf16, head dim a multiple of 8 and at most
    ``FLASH_MAX_HEAD_DIM``)."""
    if device_type != "cuda" or torch.cuda.is_available():
        return fused_kernel_dtype(torch.device(device_type), dtype, q_heads, kv_heads, qk_dim, v_dim)
    return dtype if v_dim == qk_dim and _flash_documented(dtype, qk_dim) else None


def _flash_documented(dtype: torch.dtype, dim: int) -> bool:
    """flash's documented training limits (sm80+): fp16/bf16, head dim a multiple of 8 and at most
    ``FLASH_MAX_HEAD_DIM``."""
    return dtype in (torch.float16, torch.bfloat16) and dim % 8 == 0 and dim <= FLASH_MAX_HEAD_DIM


def _kernel_dtype(device_type: str, dtype: torch.dtype) -> torch.dtype:
    """What the kernels compute inputs of ``dtype`` in on a device of ``device_type`` where they take them: CPU
    ``compute_dtype`` (its kernel takes any float dtype), CUDA ``dtype`` itself (flash: fp16/bf16)."""
    return compute_dtype(dtype) if device_type == "cpu" else dtype


@functools.cache
def _flash_accepts(device: torch.device, dtype: torch.dtype, q_heads: int, kv_heads: int, dim: int) -> bool:
    """Whether CUDA's flash kernel takes queries/keys of these heads, head dim and dtype, causal or not, for training.

    Head dims must be a multiple of 8: the kernels check it themselves (``mha_fwd``/``mha_bwd``) and SDPA pads other
    dims before calling them, which this module, calling them directly, does not; ``can_use_flash_attention``
    accepts any dim up to 256. The rest is asked on small stand-in tensors that require gradients (lengths do not
    enter its limits, and some GPUs take head dims in the forward only), under grad mode whatever the caller's: the
    training limits apply only where grad mode is on, and the answer is cached per arguments, not per grad mode.
    A dry run's fake CUDA device (``fake_cuda``) has no GPU to ask: the documented limits answer.
    """
    if dim % 8:
        return False
    with torch.enable_grad():
        q = torch.empty(1, q_heads, 8, dim, device=device, dtype=dtype, requires_grad=True)
        k = torch.empty(1, kv_heads, 8, dim, device=device, dtype=dtype, requires_grad=True)
        if is_fake(q):
            return _flash_documented(dtype, dim)
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
    if q.device.type == "cuda":
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
    """(dq, dk, dv) of one kernel call in the kernel dtype, given the (global) ``out`` and ``lse`` laid out as
    ``_backward_rows`` makes them. ``k``/``v`` may be a block of the keys of the forward call that returned
    ``extra``: the dense CUDA kernel reads lengths from the shapes, and ``max_k`` is this call's."""
    if q.device.type == "cuda":
        cum_q, cum_k, max_q, _, seed, offset = extra
        return torch.ops.aten._scaled_dot_product_flash_attention_backward(
            grad_out, q, k, v, out, lse, cum_q, cum_k, max_q, k.shape[-2], 0.0, causal, seed, offset, scale=scale
        )
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out, q, k, v, out, lse, 0.0, causal, scale=scale
    )


def _part_rows(part: _Part, shared: bool, *per_row: torch.Tensor) -> list[torch.Tensor]:
    """The part's rows of each [B, Hq, N, ...] tensor in ``per_row``; for the prefix part of a batch-1 prefix that
    the B sequences share (``shared``) the B*N rows of one batch-1 query (``_as_rows``)."""
    rows = [x[:, :, part.start : part.end] for x in per_row]
    return [_as_rows(x) for x in rows] if shared and not part.own else rows


def _kernel_layout(x: torch.Tensor) -> torch.Tensor:
    """[B, H, S, D] ``x`` laid out as [B, S, H, D] in memory (a copy only where it is not): how flash's CUDA
    backward reads d(output) and output (its wrapper's ``.contiguous()`` of their transposed views is then free)."""
    return x.transpose(1, 2).contiguous().transpose(1, 2)


def _backward_rows(part: _Part, shared: bool, q, grad_out, out, lse) -> list[torch.Tensor]:
    """(q, d(output), output, logsumexp) rows of one part as its kernel backward calls take them: on CUDA
    d(output)/output laid out by ``_kernel_layout`` and the logsumexp contiguous (flash indexes it so), made once
    per part, not per key block; the CPU kernel reads any strides."""
    rows = _part_rows(part, shared, q, grad_out, out, lse)
    if q.device.type == "cuda":
        rows = [rows[0], _kernel_layout(rows[1]), _kernel_layout(rows[2]), rows[3].contiguous()]
    return rows


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
    # laid out [B, N, Hq, D] in memory, as the kernels return it and their backward reads it (``_kernel_layout``)
    out = q.new_zeros(batch, rows, heads, v_self.shape[-1], dtype=acc).transpose(1, 2)
    lse = q.new_full((batch, heads, rows), float("-inf"), dtype=acc)
    extras = []
    q, k_prefix, v_prefix, k_self, v_self = (x.to(dtype) for x in (q, k_prefix, v_prefix, k_self, v_self))
    for part in _parts(rows, k_prefix.shape[-2], k_self.shape[-2], own_keys):
        (part_q,) = _part_rows(part, k_prefix.shape[0] != batch, q)
        part_k, part_v = (k_self, v_self) if part.own else (k_prefix, v_prefix)
        part_out, part_lse, extra = _kernel_forward(part_q.contiguous(), part_k, part_v, part.causal, scale)
        part_out, part_lse = _part_result(part_out, part, batch), _part_result(part_lse, part, batch)
        seen = lse[:, :, part.start : part.end]
        total = torch.logaddexp(seen, part_lse)
        # in place: no [B, Hq, n, D] float32 temporaries beside the output (3 of them as out * a + part * b)
        merged = out[:, :, part.start : part.end].mul_((seen - total).exp().unsqueeze(-1))
        merged.addcmul_(part_out, (part_lse - total).exp().unsqueeze(-1))
        lse[:, :, part.start : part.end] = total
        extras.append(extra)
    return out, lse, tuple(extras)


BACKWARD_BLOCK_BYTES = 2**30
"""Bytes one kernel backward call over prefix keys may hold for its key block (``backward_key_rows``): 1 GiB, e.g.
37449 keys per call at Qwen3.5-27B's attention in bf16 on CUDA (24 query and 4 key heads of 256: 28 KiB per key),
so the prefix's backward never holds more than one block's buffers, however long the prefix."""


def _key_row_bytes(device_type: str, dtype: torch.dtype, q_heads: int, kv_heads: int, dim: int) -> int:
    """Bytes a kernel backward call holds per key row (of one key sequence) of inputs of ``dtype``, besides its
    gradient: the dK/dV it returns ([B, n, Hk, D] each, kernel dtype ``_kernel_dtype``); on CUDA with grouped
    heads flash's dk_expanded/dv_expanded ([B, n, Hq, D] each, kernel dtype) that it sums over each group; where the
    kernel dtype is not ``dtype`` (CPU, half inputs) the keys' and values' copy in it."""
    kernel = _kernel_dtype(device_type, dtype)
    heads = kv_heads  # dK, dV as returned
    if device_type == "cuda" and q_heads != kv_heads:
        heads += q_heads
    if kernel != dtype:
        heads += kv_heads
    return heads * 2 * dim * kernel.itemsize


def backward_key_rows(device_type: str, dtype: torch.dtype, key_batch: int, q_heads: int, kv_heads: int,
                      dim: int) -> int:
    """Prefix keys per kernel backward call for ``key_batch`` key sequences of inputs of ``dtype``: the most whose
    ``_key_row_bytes`` fit in ``BACKWARD_BLOCK_BYTES``, at least one."""
    return max(1, BACKWARD_BLOCK_BYTES // (key_batch * _key_row_bytes(device_type, dtype, q_heads, kv_heads, dim)))


def _block_backward(
    part: _Part, extra: tuple, rows: list[torch.Tensor], keys: torch.Tensor, values: torch.Tensor, scale: float,
    dtype: torch.dtype, grad_q: torch.Tensor | None, grads: tuple[torch.Tensor | None, torch.Tensor | None],
    accumulate: bool,
) -> None:
    """One kernel backward call of ``part`` over a block of its keys/values [B, Hk, n, D] (cast to the kernel
    ``dtype``): adds its share of d(q) into ``grad_q``'s rows of the part, writes (``accumulate``: adds) its
    dK/dV into ``grads`` (the block's rows of the gradients; None where not needed). Its buffers die at return."""
    dq, dk, dv = _kernel_backward(rows[1], rows[0], keys.to(dtype), values.to(dtype), rows[2], rows[3], part.causal,
                                  scale, extra)
    if grad_q is not None:
        grad_q[:, :, part.start : part.end] += _part_result(dq, part, grad_q.shape[0])
    for grad, block_grad in zip(grads, (dk, dv), strict=True):
        if grad is not None and accumulate:
            grad += block_grad
        elif grad is not None:
            grad.copy_(block_grad)


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
    needs_grad: Sequence[bool] = (True,) * 5,
) -> tuple[torch.Tensor | None, ...]:
    """Gradients (q, k_prefix, v_prefix, k_self, v_self) of the keys of ``fused_partial_forward(q, ..., dtype,
    own_keys)`` (which returned ``extras``) given d(output) ``grad_out`` [B, Hq, N, D] of an attention whose output
    ``out`` [B, Hq, N, D] and logsumexp ``lse`` [B, Hq, N] are over these keys and possibly others (see the module
    docstring). ``lse`` must be finite on every row that sees one of these keys; N > 0 (as ``fused_dtype`` and
    ``ops.attention.cp`` ensure), so every key is in some kernel call and every gradient row gets written.

    d(q) is in ``compute_dtype(dtype)`` (float32 for half inputs, whatever q's dtype): the sum of the kernel calls'
    shares, which the caller rounds to q's dtype once, after adding whatever else it sums (other ranks' shares).
    The K/V gradients are in their inputs' dtypes. None for an input whose ``needs_grad`` entry (q, k_prefix,
    v_prefix, k_self, v_self) is False: nothing is allocated for it (the kernels' dK/dV of a block are dropped).

    The prefix part runs over blocks of at most ``backward_key_rows`` keys, one kernel call each (exact: the ring
    identity holds for any key split), and each block's dK/dV goes straight into its rows of the gradient; the own
    keys take one call per part, with a ``compute_dtype`` sum only where two parts reach them (rows after the own
    segment that see all own keys). Laid out [B, N, Hq, D] in memory (as ``fused_partial_forward``'s output and
    the gradient autograd returns through the adapters' transpose and reshape), ``grad_out`` and ``out`` need no
    copy for the CUDA kernels. Peak bytes besides the K/V gradients: ``fused_backward_transient_bytes``.
    """
    needs = dict(zip(("q", "k_prefix", "v_prefix", "k_self", "v_self"), needs_grad, strict=True))
    acc, shared = compute_dtype(dtype), k_prefix.shape[0] != q.shape[0]
    parts = _parts(q.shape[-2], k_prefix.shape[-2], k_self.shape[-2], own_keys)
    accumulate_own = sum(part.own for part in parts) > 1
    grad_q = q.new_zeros(q.shape, dtype=acc) if needs["q"] else None
    grads = {
        False: tuple(torch.empty_like(x) if needs[name] else None
                     for name, x in (("k_prefix", k_prefix), ("v_prefix", v_prefix))),
        True: tuple((torch.zeros_like(x, dtype=acc) if accumulate_own else torch.empty_like(x)) if needs[name] else None
                    for name, x in (("k_self", k_self), ("v_self", v_self))),
    }
    per_row = (q.to(dtype), grad_out.to(dtype), out.to(dtype), lse.to(acc))
    block = backward_key_rows(q.device.type, k_prefix.dtype, k_prefix.shape[0], q.shape[1], k_prefix.shape[1],
                              q.shape[-1])
    for part, extra in zip(parts, extras, strict=True):
        rows = _backward_rows(part, shared, *per_row)
        keys, values = (k_self, v_self) if part.own else (k_prefix, v_prefix)
        step = keys.shape[-2] if part.own else block
        for start in range(0, keys.shape[-2], step):
            block_rows = slice(start, start + step)
            _block_backward(part, extra, rows, keys[..., block_rows, :], values[..., block_rows, :], scale, dtype,
                            grad_q, tuple(g[..., block_rows, :] if g is not None else None for g in grads[part.own]),
                            accumulate=part.own and accumulate_own)
    own = tuple(g.to(x.dtype) if g is not None else None for g, x in zip(grads[True], (k_self, v_self), strict=True))
    return grad_q, *grads[False], *own


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _call_query_bytes(device_type: str, kernel: torch.dtype, batch: int, rows: int, q_heads: int, dim: int) -> int:
    """Bytes one kernel backward call over ``rows`` query rows of ``batch`` sequences allocates for the queries' side:
    dq as returned [B, n, Hq, D] (kernel dtype); on CUDA flash's float32 dq_accum [B, n rounded up to 128, Hq,
    D rounded up to 32] and softmax_d [B, Hq, n rounded up to 128] (``mha_bwd``)."""
    total = batch * rows * q_heads * dim * kernel.itemsize
    if device_type == "cuda":
        padded = _round_up(rows, 128)
        total += 4 * batch * q_heads * padded * (_round_up(dim, 32) + 1)
    return total


def fused_backward_transient_bytes(
    device_type: str,
    dtype: torch.dtype,
    batch: int,
    q_heads: int,
    kv_heads: int,
    dim: int,
    query_rows: int,
    prefix_rows: int,
    own_rows: int,
    own_keys: OwnKeyRule = OWN_SEGMENT,
    shared_prefix: bool = False,
) -> int:
    """Peak bytes ``fused_partial_backward`` allocates besides the K/V gradients it returns, on a device of
    ``device_type`` for inputs of ``dtype`` that all need gradients: q [batch, q_heads, query_rows, dim], prefix
    K/V [batch, kv_heads, prefix_rows, dim] (batch 1 with ``shared_prefix``), own K/V of ``own_rows``, own keys
    seen as ``own_keys`` says. kernel: ``_kernel_dtype``; acc: ``compute_dtype``; a query tensor: [B, Hq, N, D].

    Held through the backward:
    - d(q) in acc (the float32 sum of the calls' shares; the caller's cast to q's dtype is q's gradient);
    - where kernel != dtype (CPU, half inputs): q, d(output) and output in the kernel dtype, 3 query tensors;
    - where two calls reach the own keys (rows after the segment see all of them): their float32 dK/dV sums.
    Plus the largest kernel call, each over n query rows and m keys:
    - the keys' side: m x ``_key_row_bytes`` per key sequence (dK/dV as returned, flash's GQA expansion on CUDA,
      K/V in the kernel dtype), m at most ``backward_key_rows`` for the prefix, the own keys for an own part;
    - the queries' side: ``_call_query_bytes`` (dq as returned; on CUDA flash's float32 dq_accum and softmax_d);
    - the part's rows of q, d(output), output (kernel dtype) and logsumexp (acc) where they are not a view:
      for the prefix shared by B sequences their B x N rows of one batch-1 query (counted as copies), on CUDA the
      rows of a part that starts or ends inside the queries of B > 1 sequences (d(output), output, logsumexp).
    Assumes d(output) and output laid out [B, N, Hq, D] in memory (see ``fused_partial_backward``; else 2 query
    tensors more on CUDA). Not counted: the CPU kernel's per-thread scratch (a few [kernel block x kernel
    block] buffers per thread).
    """
    kernel, acc = _kernel_dtype(device_type, dtype), compute_dtype(dtype)
    query_tensor = batch * q_heads * query_rows * dim
    held = query_tensor * acc.itemsize + (3 * query_tensor * kernel.itemsize if kernel != dtype else 0)
    parts = _parts(query_rows, prefix_rows, own_rows, own_keys)
    if sum(part.own for part in parts) > 1:
        held += 2 * batch * kv_heads * own_rows * dim * acc.itemsize
    key_row = _key_row_bytes(device_type, dtype, q_heads, kv_heads, dim)
    calls = [0]
    for part in parts:
        rows = part.end - part.start
        part_tensor = batch * q_heads * rows * dim
        if part.own:
            keys = batch * own_rows * key_row
            inside = rows < query_rows and batch > 1 and device_type == "cuda"
            copies = (2 * part_tensor * kernel.itemsize + batch * q_heads * rows * acc.itemsize) if inside else 0
        else:
            key_batch = 1 if shared_prefix else batch
            keys = key_batch * key_row * min(prefix_rows, backward_key_rows(device_type, dtype, key_batch, q_heads,
                                                                            kv_heads, dim))
            copies = (3 * part_tensor * kernel.itemsize + batch * q_heads * rows * acc.itemsize) if shared_prefix else 0
        call_batch, call_rows = (1, batch * rows) if shared_prefix and not part.own else (batch, rows)
        calls.append(keys + copies + _call_query_bytes(device_type, kernel, call_batch, call_rows, q_heads, dim))
    return held + max(calls)


class _FusedPrefixCausalAttention(torch.autograd.Function):
    """Autograd function behind ``prefix_causal_attention_fused`` (both passes in ``dtype``, autocast off).

    Sinks (one logit per query head with no value, in every row's softmax denominator) are one more key set of
    the merge: the output is scaled by exp(lse - lse'), lse' = logaddexp(lse, sink). The kernels' backward then
    takes the merged output and logsumexp (the ring identity of the module docstring, the sink one of the key
    sets), and d(sink) = -sum over rows of exp(sink - lse') * rowsum(dO * O), O the merged output."""

    @staticmethod
    @autocast_off
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        q: torch.Tensor,
        k_prefix: torch.Tensor,
        v_prefix: torch.Tensor,
        k_self: torch.Tensor,
        v_self: torch.Tensor,
        sinks: torch.Tensor | None,
        scale: float,
        dtype: torch.dtype,
    ) -> torch.Tensor:
        out, lse, ctx.extras = fused_partial_forward(q, k_prefix, v_prefix, k_self, v_self, scale, dtype)
        if sinks is not None:
            merged = torch.logaddexp(lse, sinks.to(lse.dtype)[None, :, None])
            out, lse = out * (lse - merged).exp().unsqueeze(-1), merged
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k_prefix, v_prefix, k_self, v_self, out, lse, sinks)
        ctx.scale, ctx.dtype = scale, dtype
        return out

    @staticmethod
    @autocast_off
    def backward(ctx: torch.autograd.function.FunctionCtx, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        saved = ctx.saved_tensors  # unpacked once: activation checkpointing lets each saved tensor unpack once
        *inputs, sinks = saved
        grad_q, *grads = fused_partial_backward(grad_out, *inputs, ctx.scale, ctx.dtype, OWN_SEGMENT, ctx.extras,
                                                ctx.needs_input_grad[:5])
        grad_sinks = None
        if sinks is not None and ctx.needs_input_grad[5]:
            acc, out, lse = compute_dtype(ctx.dtype), inputs[5], inputs[6]
            delta = (grad_out.to(acc) * out.to(acc)).sum(-1)  # [B, Hq, N]
            grad_sinks = -((sinks.to(acc)[None, :, None] - lse).exp() * delta).sum((0, 2)).to(sinks.dtype)
        q = saved[0]
        return grad_q.to(q.dtype) if grad_q is not None else None, *grads, grad_sinks, None, None


def prefix_causal_attention_fused(
    q: torch.Tensor,
    k_prefix: torch.Tensor,
    v_prefix: torch.Tensor,
    k_self: torch.Tensor,
    v_self: torch.Tensor,
    scale: float,
    dtype: torch.dtype,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Every query over the whole prefix and its segment causally; [B, Hq, T, D] in q's dtype.

    Arguments as ``prefix_causal_attention_reference`` (no ``key_mask``); ``dtype`` from ``fused_dtype``
    (which must not be None for these inputs); ``sinks`` [Hq]: learned logits in every row's softmax denominator
    (gpt-oss; ``_FusedPrefixCausalAttention``), None: none.
    """
    return _FusedPrefixCausalAttention.apply(q, k_prefix, v_prefix, k_self, v_self, sinks, scale, dtype)
