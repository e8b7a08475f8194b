"""DSA top-k key selection for a segment split over a CP group, over a prefix whose rows are split too.

One process (``ops.dsa.topk``) gives each query its ``topk`` best visible keys by indexer score,
ties to the earlier key. Under CP the keys a query sees lie on every rank: each rank's prefix rows
and, in a capture chunk, the own keys of the earlier ranks. On every rank r:

1. all-gather the indexer queries and weights of every rank's tokens (no autograd: selection only);
2. score all N = sum(query_sizes) queries against the local keys with the blocked scorer and keep
   each query's local top-k as sort keys (score, then global key position: ``top_sort_keys``);
3. the ``topk``-th largest sort key of the union of every rank's local top-k is the query's threshold
   (``kth_largest``: found 4 bits at a time, one all-reduce of a [queries, 16] int32 histogram per 4 bits, 1 KiB
   a query in all; not by gathering every rank's local top-k sort keys, R x topk x 8 bytes a query, 512 KiB at
   32 ranks and topk 2048).
   Sort keys are distinct, and a key of the global top-k is in its own rank's local top-k, so the keys at
   or above the threshold are exactly the single-process selection, tie rule included;
4. mark the local keys at or above the threshold: the key mask [N, P_r + T_r] ``sharded_prefix_attention``
   takes (``mixers.attention.attend``).

Global key positions (the tie order) are those of one process: rank r's prefix rows sit at the prompt
positions of ``plan.Split.prefix_spans``, own keys after the whole prefix, at ``sum(prefix_sizes)`` + the
token's index in the segment (a capture chunk: counted over the ranks in order; a replayed response: its own
tokens, the only own keys its queries see).

Steps 2-4 run ``query_block`` queries at a time: temporaries O(query_block x (topk + key_block)) int64
besides the mask. Whether top-k keeps every visible key (no mask on any rank) and every collective's shape
follow from the replicated sizes: ranks issue the same 2 all-gathers and 16 ceil(N / query_block) all-reduces
whatever the data (``selection_collective_bytes``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ...parallel.comm import Group, all_gather, all_reduce_sum, group_rank
from ...plan import Split
from .topk import KEY_BLOCK, dsa_topk_mask, sort_key_position, top_sort_keys

QUERY_BLOCK = 4096  # queries selected at a time: 16 all-reduces each; temporaries O(QUERY_BLOCK x (topk + key block))
_DIGIT_BITS = 4  # ``kth_largest`` finds a sort key 4 bits at a time: 16 rounds of a 16-bin int32 histogram
_ROUNDS, _BINS = 64 // _DIGIT_BITS, 2**_DIGIT_BITS


def most_keys_seen(group_prefix: int, query_sizes: Sequence[int], consecutive: bool) -> int:
    """The most keys any query of a CP call sees: every rank's prefix rows (``group_prefix``, summed) plus the own
    keys of all ranks' segments (``consecutive``: a capture chunk) or of the longest one (a replay round)."""
    return group_prefix + (sum(query_sizes) if consecutive else max(query_sizes))


def keeps_every_key(prefix_rows: int, seg_len: int, topk: int, split: Split | None) -> bool:
    """Whether top-k keeps every key any query sees, so no mask is needed: the most keys a query sees is at most
    ``topk``. One process (``split`` None): the ``prefix_rows`` + ``seg_len`` keys. Under CP ``most_keys_seen``;
    replicated sizes only, so every rank decides alike. Cheap: callers ask it before projecting queries."""
    if split is None:
        return prefix_rows + seg_len <= topk
    return most_keys_seen(sum(split.prefix_sizes), split.query_sizes, split.consecutive) <= topk


def sharded_dsa_topk_mask(
    q: torch.Tensor,
    weights: torch.Tensor,
    k_prefix: torch.Tensor,
    k_self: torch.Tensor,
    scale: float,
    topk: int,
    split: Split | None,
    group: Group,
    key_block: int = KEY_BLOCK,
    query_block: int = QUERY_BLOCK,
) -> torch.Tensor | None:
    """Bool mask of this rank's keys among each query's ``topk`` best (DSA), or None where top-k keeps every key.

    On rank r (float32): ``q`` [T_r, H, D] indexer queries and ``weights`` [T_r, H] of its segment,
    ``k_prefix`` [P_r, D] indexer keys of its prefix rows, ``k_self`` [T_r, D] of its segment (T_r =
    ``query_sizes[r]``, P_r = ``prefix_sizes[r]``). Returns [N, P_r + T_r]: for every query of every rank
    (rank order, N = sum(query_sizes)) its selected keys among this rank's prefix rows, then own keys,
    visible ones only. ``split`` None: one process (``group`` unread), ``dsa_topk_mask`` [T, P + T]. Index scores are in
    the ``ops.dsa.topk`` docstring.
    """
    if keeps_every_key(k_prefix.shape[0], k_self.shape[0], topk, split):
        return None
    if split is None:
        return dsa_topk_mask(q, weights, torch.cat([k_prefix, k_self]), scale, topk, key_block)
    s = split
    key_pos, last_visible = _positions(s, group_rank(group), k_prefix.shape[0], q.device)
    queries = torch.cat(all_gather(q, group, s.query_sizes))
    query_weights = torch.cat(all_gather(weights, group, s.query_sizes))
    keys = torch.cat([k_prefix, k_self])
    mask = torch.empty(len(queries), len(keys), dtype=torch.bool, device=q.device)
    for start in range(0, len(queries), query_block):
        rows = slice(start, start + query_block)
        best = top_sort_keys(queries[rows], query_weights[rows], keys, scale, topk, key_pos, last_visible[rows],
                             key_block)
        threshold = kth_largest(best, topk, group)  # the union is >= topk wide: not keeps_every_key
        local_index = torch.searchsorted(key_pos, sort_key_position(best))
        visible = key_pos <= last_visible[rows, None]
        mask[rows] = torch.zeros_like(visible).scatter_(1, local_index, best >= threshold) & visible
    return mask


def kth_largest(values: torch.Tensor, k: int, group: Group) -> torch.Tensor:
    """int64 [B, 1]: each row's ``k``-th largest value of the union over ``group``'s ranks of their ``values``
    int64 [B, n_r] (distinct across the union, which holds at least ``k`` per row).

    Found from the top 4 bits down: each round every rank counts, per row, its values that match the digits found
    so far by their next digit (a [B, 16] histogram), the counts are summed over the ranks (one all-reduce), and
    the digit holding the k-th largest is the highest whose count from there up reaches what is still needed. The
    top digit is read with its sign bit flipped (two's complement order). Sixteen all-reduces of B x 16 int32,
    whatever the ranks and n_r (``selection_collective_bytes``)."""
    rows = values.shape[0]
    need = torch.full((rows, 1), k, dtype=torch.int32, device=values.device)
    found = torch.zeros(rows, 1, dtype=torch.int64, device=values.device)
    candidate = torch.ones_like(values, dtype=torch.int32)  # 1 where the value matches every digit found so far
    mask, top = _BINS - 1, _BINS // 2
    for shift in range(64 - _DIGIT_BITS, -1, -_DIGIT_BITS):
        flip = top if shift == 64 - _DIGIT_BITS else 0
        digit = ((values >> shift) & mask) ^ flip
        counts = torch.zeros(rows, _BINS, dtype=torch.int32, device=values.device).scatter_add_(1, digit, candidate)
        all_reduce_sum(counts, group)
        at_or_above = counts.flip(1).cumsum(1, dtype=torch.int32).flip(1)  # matching values with this digit or higher
        chosen = (at_or_above >= need).sum(1, keepdim=True) - 1  # the highest digit whose count reaches ``need``
        need -= at_or_above.gather(1, chosen) - counts.gather(1, chosen)  # those strictly above it are taken
        candidate *= digit == chosen
        found |= (chosen ^ flip) << shift
    return found


def selection_collective_bytes(queries: int) -> int:
    """Bytes of the all-reduce buffers ``kth_largest`` passes for ``queries`` queries (any query blocks): 16
    rounds of 16 int32 counts per query."""
    return _ROUNDS * _BINS * 4 * queries


def _positions(s: Split, rank: int, prefix_rows: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Global positions int64 [P_r + T_r] of this rank's keys (ascending), and the last position each of the N
    queries sees (int64 [N]), in one process's numbering: prompt positions, then the segment's tokens."""
    if sum(end - start for start, end in s.prefix_spans) != prefix_rows:
        raise ValueError(
            f"Split.prefix_spans={s.prefix_spans} does not cover this rank's {prefix_rows} prefix rows: "
            "DSA sparse selection needs the prompt positions of the rows (the plan's)"
        )
    prefix_total = sum(s.prefix_sizes)
    before, own = sum(s.query_sizes[:rank]), s.query_sizes[rank]
    own_start = prefix_total + (before if s.consecutive else 0)
    spans = [*s.prefix_spans, (own_start, own_start + own)]
    key_pos = torch.cat([torch.arange(start, end, device=device) for start, end in spans])
    if s.consecutive:  # one sequence: query n is token prefix_total + n
        last_visible = prefix_total + torch.arange(sum(s.query_sizes), device=device)
    else:  # each response sees the prefix, and its own keys causally (only on its own rank)
        last_visible = torch.full((sum(s.query_sizes),), prefix_total - 1, device=device)
        last_visible[before : before + own] = prefix_total + torch.arange(own, device=device)
    return key_pos, last_visible
