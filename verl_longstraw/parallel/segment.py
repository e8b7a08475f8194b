"""How one segment (a capture chunk or a replay round) is split over the ranks of a CP group.

The adapters' token mixers ask the segment context for attention, the delta rule and the
conv input; with a ``SegmentSharding`` those run across the ranks, without one (a single
process) they are the local ops. One code path per adapter either way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist


@dataclass(frozen=True)
class SegmentSharding:
    """Rank r runs ``query_sizes[r]`` tokens of the segment against its ``prefix_sizes[r]`` rows of the prompt state.

    ``consecutive``: the ranks' tokens are consecutive sub-slices of one sequence in rank order
    (capture and recompute chunks: state flows from rank to rank and later ranks see earlier
    ranks' keys); otherwise each rank's tokens are a sequence of their own (replayed responses,
    which only share the prompt state). ``prefix_spans``: the prompt positions of this rank's prefix rows, as
    global [start, end) runs in row order (``plan.Split``; DSA's top-k tie rule needs them).
    """

    group: dist.ProcessGroup
    query_sizes: tuple[int, ...]
    prefix_sizes: tuple[int, ...]
    consecutive: bool
    prefix_spans: tuple[tuple[int, int], ...] | None = None
