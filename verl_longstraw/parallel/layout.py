"""Who holds which prompt tokens and which response, across the R ranks of a context-parallel group.

Everything here is computed from metadata every rank has (prompt length, chunk size, R, the
response lengths), never from data, so every rank takes the same branches and issues the same
collectives ("lockstep").

Prompt: the captured tokens ``p[:-1]`` (``length`` of them) are cut into global chunks of
``chunk_size`` tokens (one chunk when None); a last chunk shorter than R tokens is merged into
the one before, so every rank gets at least one token of every chunk. Chunk k is split into R
contiguous sub-slices, rank r taking sub-slice r (sizes differ by at most one). Each rank's
state holds its sub-slices' rows in chunk order: about length / R rows.

Why round-robin chunks and not one contiguous range per rank: with a contiguous range the
reverse sweep of the exact backward would run rank R-1's rows first, then R-2's, ... (rows of
rank r need the key/value gradients of every later rank first): 1/R utilisation.

Responses: replayed in rounds, response ``round * R + r`` on rank r; ranks without one in the
last round replay a one-token dummy so every rank makes the same calls.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property


def split_evenly(count: int, parts: int) -> list[int]:
    """``count`` items over ``parts`` contiguous parts, sizes differing by at most one (larger first)."""
    return [count // parts + (r < count % parts) for r in range(parts)]


@dataclass(frozen=True)
class PromptLayout:
    """Global chunks of a captured prompt of ``length`` tokens and their split over ``world`` ranks."""

    length: int
    chunk_size: int | None
    world: int

    def __post_init__(self) -> None:
        if self.chunk_size is not None and self.chunk_size < self.world:
            raise ValueError(
                f"chunk_size={self.chunk_size} is smaller than the context-parallel size {self.world}: every rank "
                f"needs at least one token of every chunk; use chunk_size >= {self.world} (tokens per chunk, all ranks)"
            )
        if self.length < self.world:
            raise ValueError(
                f"the prompt has {self.length + 1} tokens ({self.length} captured), fewer than the context-parallel "
                f"size {self.world}: every rank needs at least one prompt token; use a smaller context_parallel_size"
            )

    @cached_property
    def chunks(self) -> tuple[tuple[int, int], ...]:
        """Global [start, end) of every chunk."""
        size = self.chunk_size or self.length
        bounds = [[s, min(s + size, self.length)] for s in range(0, self.length, size)]
        if len(bounds) > 1 and bounds[-1][1] - bounds[-1][0] < self.world:
            last = bounds.pop()
            bounds[-1][1] = last[1]
        return tuple((s, e) for s, e in bounds)

    def slices(self, chunk: int) -> list[tuple[int, int]]:
        """Global [start, end) of every rank's sub-slice of ``chunk``."""
        start, end = self.chunks[chunk]
        out = []
        for size in split_evenly(end - start, self.world):
            out.append((start, start + size))
            start += size
        return out

    def slice_sizes(self, chunk: int) -> list[int]:
        return [e - s for s, e in self.slices(chunk)]

    def rows_before(self, chunk: int, rank: int) -> int:
        """Rows rank ``rank`` holds from the chunks before ``chunk`` (where its rows of ``chunk`` start)."""
        return sum(self.slice_sizes(k)[rank] for k in range(chunk))

    def local_length(self, rank: int) -> int:
        """Rows of growing state rank ``rank`` holds for the whole prompt."""
        return self.rows_before(len(self.chunks), rank)

    def local_chunk_bounds(self, rank: int) -> list[tuple[int, int]]:
        """[start, end) of rank ``rank``'s rows of every chunk, in its local row numbering."""
        out, start = [], 0
        for k in range(len(self.chunks)):
            size = self.slice_sizes(k)[rank]
            out.append((start, start + size))
            start += size
        return out


@dataclass(frozen=True)
class ReplayRounds:
    """Responses of a group spread over ``world`` ranks, one per rank per round."""

    num_responses: int
    world: int

    @property
    def num_rounds(self) -> int:
        return -(-self.num_responses // self.world)

    def response(self, round_index: int, rank: int) -> int | None:
        """Index of the response rank ``rank`` replays in round ``round_index``; None: a dummy."""
        index = round_index * self.world + rank
        return index if index < self.num_responses else None
