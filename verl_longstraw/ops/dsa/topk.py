"""DeepSeek Sparse Attention (DSA) key selection: each query's ``topk`` keys by indexer score.

Shapes: ``q`` [S, H, D] indexer queries, ``weights`` [S, H] per-head weights, ``keys`` [T, D]
indexer keys of the prefix and then the S queries' own tokens (T = P + S), all float32. Index
score of query s and key t (the model's formula)::

    score[s, t] = sum_h weights[s, h] * relu(scale * q[s, h] . keys[t])

Query s sees keys t <= P + s. Among visible keys with equal scores the earlier key is chosen
(the model's ``topk`` leaves ties to the kernel). The result is a bool mask [S, T], True at the
chosen visible keys.

``dsa_topk_mask_reference`` scores every key at once: a [S, H, T] float32 temporary.
``dsa_topk_mask`` scores ``key_block`` keys at a time, summing over heads as it goes, and keeps a
running top-k: temporaries O(S x (topk + key_block)) besides the [S, T] bool result.
``top_sort_keys`` is that running top-k for keys at any positions (``ops.dsa.cp`` merges the
top-k of the keys each rank of a context-parallel group holds).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import register_flop_formula

KEY_BLOCK = 4096
_LOW = 2**32  # a key's rank among equal scores lives in the low 32 bits of its sort key


def dsa_topk_mask_reference(
    q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, scale: float, topk: int
) -> torch.Tensor:
    """Bool mask [S, T] of each query's ``topk`` best visible keys (shapes in the module docstring)."""
    seg, total = q.shape[0], keys.shape[0]
    scores = F.relu(torch.einsum("shd,td->sht", q, keys) * scale)
    index_scores = torch.einsum("sht,sh->st", scores, weights)
    visible = torch.ones(seg, total, dtype=torch.bool, device=q.device).tril(total - seg)
    index_scores = index_scores.masked_fill(~visible, float("-inf"))
    top = index_scores.sort(dim=-1, descending=True, stable=True).indices[:, : min(topk, total)]
    return torch.zeros_like(visible).scatter_(-1, top, True) & visible


def dsa_topk_mask(
    q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, scale: float, topk: int, key_block: int = KEY_BLOCK
) -> torch.Tensor:
    """``dsa_topk_mask_reference`` (same selection) scoring ``key_block`` keys at a time."""
    seg, total = q.shape[0], keys.shape[0]
    prefix = total - seg
    last_visible = torch.arange(prefix, total, device=q.device)
    best = top_sort_keys(q, weights, keys, scale, topk, None, last_visible, key_block)
    chosen = sort_key_position(best)
    return torch.zeros(seg, total, dtype=torch.bool, device=q.device).scatter_(-1, chosen, True).tril_(prefix)


def running_top_sort_keys(
    q: torch.Tensor,
    weights: torch.Tensor,
    keys: torch.Tensor,
    scale: float,
    topk: int,
    key_pos: torch.Tensor | None,
    last_visible: torch.Tensor,
    key_block: int = KEY_BLOCK,
) -> torch.Tensor:
    """Sort keys int64 [S, min(topk, T)] of each query's ``topk`` best keys, in no order (shapes in the module
    docstring; ``sort_key_position`` gives their key positions).

    Key t is at position ``key_pos[t]`` (int64 [T], distinct; None: t) and visible to query s iff that
    position is <= ``last_visible[s]`` (int64 [S]); invisible keys score -inf, so they are among the
    result only where fewer than ``topk`` keys are visible. Sort keys order by score, then earlier position.
    ``key_block`` keys are scored at a time, summed over heads as it goes, and merged into a running top-k:
    temporaries besides the output O(S x (topk + key_block)).

    Callers use ``top_sort_keys``, this function as one op (``torch.ops.verl_longstraw.dsa_top_sort_keys``) with a
    fake implementation of its output's shape and a FLOP formula (the scoring's matmuls), so a dry run on fake
    tensors (``verl_longstraw.dryrun``) dispatches it once instead of its loop of heads x key blocks (some 200,000
    small ops per GLM-5.2 indexer layer call of a 64K chunk on 32 ranks).
    """
    best = torch.empty(q.shape[0], 0, dtype=torch.int64, device=q.device)
    for start in range(0, keys.shape[0], key_block):
        block = keys[start : start + key_block]
        scores = q.new_zeros(q.shape[0], block.shape[0])
        for h in range(q.shape[1]):  # sum over heads without a [S, H, block] temporary
            scores += weights[:, h, None] * F.relu(q[:, h] @ block.T * scale)
        if key_pos is None:
            block_pos = torch.arange(start, start + block.shape[0], device=q.device)
        else:
            block_pos = key_pos[start : start + key_block]
        scores.masked_fill_(block_pos > last_visible[:, None], float("-inf"))
        candidates = torch.cat([best, _sort_keys(scores, block_pos)], dim=-1)
        best = candidates.topk(topk, dim=-1, sorted=False).values if candidates.shape[-1] > topk else candidates
    return best


top_sort_keys = torch.library.custom_op("verl_longstraw::dsa_top_sort_keys", running_top_sort_keys, mutates_args=())


@top_sort_keys.register_fake
def _top_sort_keys_shape(q, weights, keys, scale, topk, key_pos, last_visible, key_block=KEY_BLOCK) -> torch.Tensor:
    """The output's shape. ``key_block`` has its default here too: torch 2.11 leaves an argument equal to its schema
    default out of the call."""
    return q.new_empty(q.shape[0], min(topk, keys.shape[0]), dtype=torch.int64)


@register_flop_formula(torch.ops.verl_longstraw.dsa_top_sort_keys)
def _top_sort_keys_flops(q_shape, weights_shape, keys_shape, *args, **kwargs) -> int:
    """The scoring's matmuls: 2 FLOPs a product of S queries x H heads x D dims x T keys."""
    queries, heads, dim = q_shape
    return 2 * queries * heads * dim * keys_shape[0]


def sort_key_position(sort_keys: torch.Tensor) -> torch.Tensor:
    """Key positions (int64, same shape) of ``top_sort_keys``' sort keys."""
    return _LOW - 1 - (sort_keys & (_LOW - 1))


def _sort_keys(scores: torch.Tensor, key_pos: torch.Tensor) -> torch.Tensor:
    """int64 [S, B] ordered as (score, then earlier key) and distinct: the float32 score's bits mapped to an
    order-preserving int32 in the high half, the inverted key position in the low half."""
    bits = scores.view(torch.int32)  # no -0.0: the scores are sums that start at +0.0
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # negative floats: flip the magnitude bits
    return ordered.to(torch.int64) * _LOW + (_LOW - 1 - key_pos)
