"""Collectives of a context-parallel (CP) group, differentiable, with variable sizes and a trace.

Semantics of gradients across ranks ("partial sums"): a tensor computed on one rank has its
gradient on that rank; a tensor every rank holds a copy of (e.g. an all-gather's output) gets
on each rank the gradient of that rank's use, and the true gradient is the sum over ranks.
So the backward of an all-gather is a reduce-scatter (the sum of every rank's gradient of slot
j goes to rank j), and the backward of a reduce-scatter is an all-gather. Parameters end up
with per-rank partial gradients whose sum over the CP group is the single-process gradient.
The all-gather's backward sums the copies' gradients in ``compute_dtype`` (float32 for half dtypes, on the
wire too) and rounds the sum to the input's dtype once, rather than once per step of the reduction.

Sizes that differ between ranks (``sizes[r]`` along ``dim``) are padded to the largest for the
wire and cut again after it; every rank must pass the same ``sizes`` (they come from the
replicated layout, never from data). ``group=None`` means one process: the ops are identities.

``trace_collectives()`` records every collective issued through this module as
``(op, group_size, numel, dtype)``; tests compare the records of all ranks to prove lockstep.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
import torch.distributed as dist

from ..dtypes import compute_dtype

Group = dist.ProcessGroup | None
_TRACES: list[list[tuple[str, int, int, str]]] = []


def group_size(group: Group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: Group) -> int:
    return 0 if group is None else dist.get_rank(group)


@contextmanager
def trace_collectives() -> Iterator[list[tuple[str, int, int, str]]]:
    """Record ``(op, group_size, numel, dtype)`` of every collective issued inside the block."""
    records: list[tuple[str, int, int, str]] = []
    _TRACES.append(records)
    try:
        yield records
    finally:
        _TRACES.remove(records)


def _record(op: str, group: Group, tensor: torch.Tensor) -> None:
    for records in _TRACES:
        records.append((op, group_size(group), tensor.numel(), str(tensor.dtype).removeprefix("torch.")))


def _pad(x: torch.Tensor, length: int, dim: int) -> torch.Tensor:
    missing = length - x.shape[dim]
    if missing == 0:
        return x.contiguous()
    return torch.cat([x, x.new_zeros(_with_dim(x.shape, dim, missing))], dim=dim)


def _with_dim(shape: torch.Size, dim: int, size: int) -> list[int]:
    out = list(shape)
    out[dim] = size
    return out


def gather_padded(x: torch.Tensor, sizes: Sequence[int], dim: int, group: Group) -> list[torch.Tensor]:
    """All ranks' ``x`` (rank r's has ``sizes[r]`` entries along ``dim``), no autograd."""
    longest = max(sizes)
    padded = _pad(x, longest, dim).movedim(dim, 0).contiguous()
    out = padded.new_empty((len(sizes) * padded.shape[0], *padded.shape[1:]))
    _record("all_gather", group, out)
    dist.all_gather_into_tensor(out, padded, group=group)
    out = out.unflatten(0, (len(sizes), padded.shape[0]))
    return [out[r, : sizes[r]].movedim(0, dim) for r in range(len(sizes))]


def reduce_scatter_padded(
    parts: Sequence[torch.Tensor], sizes: Sequence[int], dim: int, group: Group, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Sum over ranks of ``parts[j]`` (``sizes[j]`` entries along ``dim``), delivered to rank j in ``dtype`` (None:
    the parts'), which the wire and the sum use; no autograd. The parts are copied once, into the one buffer of
    R x max(sizes) entries that is sent (zero padding)."""
    longest = max(sizes)
    first = parts[0].movedim(dim, 0)
    stacked = first.new_empty((len(parts) * longest, *first.shape[1:]), dtype=dtype or first.dtype)
    for r, part in enumerate(parts):
        stacked[r * longest : r * longest + sizes[r]] = part.movedim(dim, 0)
        stacked[r * longest + sizes[r] : (r + 1) * longest] = 0
    out = stacked.new_empty((longest, *stacked.shape[1:]))
    _record("reduce_scatter", group, stacked)
    dist.reduce_scatter_tensor(out, stacked, group=group)
    return out[: sizes[group_rank(group)]].movedim(0, dim)


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, sizes: tuple[int, ...], dim: int, group: Group) -> tuple[torch.Tensor, ...]:
        ctx.sizes, ctx.dim, ctx.group = sizes, dim, group
        return tuple(gather_padded(x, sizes, dim, group))

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None):
        like = next(g for g in grads if g is not None)
        grads = [
            g if g is not None else like.new_zeros(_with_dim(like.shape, ctx.dim, n))
            for g, n in zip(grads, ctx.sizes, strict=True)
        ]
        summed = reduce_scatter_padded(grads, ctx.sizes, ctx.dim, ctx.group, compute_dtype(like.dtype))
        return summed.to(like.dtype), None, None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, sizes: tuple[int, ...], dim: int, group: Group, *parts: torch.Tensor) -> torch.Tensor:
        ctx.sizes, ctx.dim, ctx.group = sizes, dim, group
        return reduce_scatter_padded(parts, sizes, dim, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return (None, None, None, *gather_padded(grad.contiguous(), ctx.sizes, ctx.dim, ctx.group))


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return all_reduce_sum(x.clone(), group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return all_reduce_sum(grad.clone(), ctx.group), None


def all_gather(x: torch.Tensor, group: Group, sizes: Sequence[int] | None = None, dim: int = 0) -> list[torch.Tensor]:
    """Every rank's ``x`` (differentiable): a list of ``group_size`` tensors; rank r's is ``sizes[r]`` long along
    ``dim``.

    ``sizes`` None means equal shapes on all ranks. Gradient: reduce-scatter of the copies' gradients to the owners,
    summed in ``compute_dtype`` and then cast to ``x``'s dtype.
    """
    if group is None:
        return [x]
    sizes = tuple(sizes) if sizes is not None else (x.shape[dim],) * group_size(group)
    if x.shape[dim] != sizes[group_rank(group)]:
        raise ValueError(f"all_gather: this rank's tensor has {x.shape[dim]} entries along dim {dim}, sizes says "
                         f"{sizes[group_rank(group)]}")
    return list(_AllGather.apply(x, sizes, dim, group))


def reduce_scatter(
    parts: Sequence[torch.Tensor], group: Group, sizes: Sequence[int] | None = None, dim: int = 0
) -> torch.Tensor:
    """Sum over ranks of ``parts[j]``, returned on rank j (differentiable; gradient: an all-gather)."""
    if group is None:
        return parts[0]
    sizes = tuple(sizes) if sizes is not None else tuple(p.shape[dim] for p in parts)
    return _ReduceScatter.apply(sizes, dim, group, *parts)


def all_reduce_sum(x: torch.Tensor, group: Group) -> torch.Tensor:
    """In-place sum over ranks of ``x`` (no autograd); returns ``x``."""
    if group is not None:
        _record("all_reduce", group, x)
        dist.all_reduce(x, group=group)
    return x


def all_reduce_sum_differentiable(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Sum over ranks of ``x``, as a new tensor every rank holds (gradient: the sum of the copies' gradients)."""
    return x if group is None else _AllReduce.apply(x, group)


def broadcast(x: torch.Tensor, src_rank: int, group: Group) -> torch.Tensor:
    """In-place broadcast of ``x`` from group rank ``src_rank`` (no autograd); returns ``x``."""
    if group is not None:
        _record("broadcast", group, x)
        dist.broadcast(x, group_src=src_rank, group=group)
    return x


def send(x: torch.Tensor, dst_rank: int, group: Group) -> None:
    """Point-to-point send to group rank ``dst_rank`` (no autograd)."""
    _record("send", group, x)
    dist.send(x.contiguous(), group_dst=dst_rank, group=group)


def recv(like: torch.Tensor, src_rank: int, group: Group) -> torch.Tensor:
    """Receive a tensor shaped like ``like`` from group rank ``src_rank`` (no autograd)."""
    out = torch.empty_like(like, memory_format=torch.contiguous_format)
    _record("recv", group, out)
    dist.recv(out, group_src=src_rank, group=group)
    return out
