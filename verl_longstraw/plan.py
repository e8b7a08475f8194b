"""The segment plan: which tokens run in which segment, in which order, on which rank. Built once per call and
read by every phase (``execute``), the entry points (``api``), the engine, the estimate and the benchmarks.

Rows and positions. Row i is a token sequence x[0..L_i) scored from token ``score_starts[i]`` on: the log-probs
of x[t] given x[:t] for t >= score_start. Input position p (0 <= p < L_i - 1) runs token x[p] and predicts
x[p + 1]; rows that share their first m + 1 tokens share input positions [0, m) (inputs and targets alike).

A plan is a forest of segments. A segment is a span [start, end) of input positions continuing its parent's
state (a root continues nothing), shared by every row whose path passes it, and scores its positions from
``score_from`` on (``end``: none). Shapes:
- the star (``star_plan``): the prompt's positions [0, P - 1) as a chain of ``chunk_size`` segments (one when
  None), each response a leaf under its last segment (input [p[-1]] + r[:-1]);
- a prefix tree (``tree_plan``): the trie of the rows' positions, cut where rows branch or end, where scoring
  starts, into ``chunk_size`` chains (segments with children) and ``response_chunk_size`` chains (the scored
  leaves: a long response becomes a chain whose last segment is the leaf).

Order (``Plan.steps``): a depth-first walk of typed steps (``STEP_TYPES``). A segment with children is captured
without autograd (``Capture``); its leaf children are replayed in batches (``Replay``: k siblings padded to the
longest, k x T_max <= ``replay_tokens``); its other children are walked; then, when it needs a gradient (exact
mode: always; detached: when it scores tokens), it is recomputed (``Recompute``); it is released (``Release``)
after the last step that reads it. So one root-to-leaf path's state is held at a time (``capacity`` rows). Each
step carries what it means: its model call's figures (``ModelCall``, read by every cost) and the walk's own
collectives (``Step.collectives``); ``execute`` is the one interpreter that runs them, the estimate, the FLOP
count, the time model and the benchmarks price them.

Context parallel (``world`` R > 1, star plans): computed from metadata every rank has, never from data, so every
rank takes the same branches and issues the same collectives ("lockstep"). The captured positions are cut into
global chunks of ``chunk_size`` (a last chunk shorter than R is merged into the one before, so every rank gets at
least one token of every chunk); chunk k is split into R contiguous sub-slices, rank r taking sub-slice r
(sizes differ by at most one), and each rank holds its sub-slices' rows in chunk order. Round-robin chunks, not
one range per rank: the reverse sweep of the exact backward then keeps every rank busy (with one range per rank
rank r's rows would wait for every later rank's key/value gradients: 1/R utilisation). Responses replay in
rounds, response ``round * R + r`` on rank r; ranks without one in the last round replay a one-token dummy.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from .knobs import Knobs

MODES = ("log_probs", "exact", "detached")  # what a walk computes: values only, or values and a gradient


def split_evenly(count: int, parts: int) -> list[int]:
    """``count`` items over ``parts`` contiguous parts, sizes differing by at most one (larger first)."""
    return [count // parts + (r < count % parts) for r in range(parts)]


def chunk_bounds(start: int, end: int, chunk_size: int | None) -> list[tuple[int, int]]:
    """[(s, e)] covering positions [start, end) in chunks of ``chunk_size`` (one chunk if None)."""
    size = chunk_size or max(end - start, 1)
    return [(s, min(s + size, end)) for s in range(start, end, size)]


def replay_batches(lengths: Sequence[int], replay_tokens: int) -> list[list[int]]:
    """Indices packed in order into batches whose padded size k x max(T_i) stays within ``replay_tokens``
    (one longer than the budget replays alone)."""
    batches: list[list[int]] = []
    longest = 0
    for i, length in enumerate(lengths):
        if batches and (len(batches[-1]) + 1) * max(longest, length) <= replay_tokens:
            batches[-1].append(i)
            longest = max(longest, length)
        else:
            batches.append([i])
            longest = length
    return batches


def check_prompt_layout(captured: int, chunk_size: int | None, world: int) -> None:
    """Raise ValueError, naming the fix, for a prompt of ``captured`` captured positions that cannot be split over
    ``world`` CP ranks (every rank needs at least one token of every chunk)."""
    _check_chunking(chunk_size, world)
    if captured < world:
        raise ValueError(
            f"the prompt has {captured + 1} tokens ({captured} captured), fewer than the context-parallel "
            f"size {world}: every rank needs at least one prompt token; use a smaller context_parallel_size"
        )


@dataclass(frozen=True)
class Split:
    """How one step is split over the R ranks of a CP group: metadata every rank has, the one description the
    adapters' token mixers read at run time too (``mixers.SegmentContext``, with the group).

    Rank r runs ``query_sizes[r]`` tokens against its ``prefix_sizes[r]`` rows of state. ``consecutive``: the
    ranks' tokens are consecutive sub-slices of one sequence in rank order (capture and recompute chunks: state
    flows from rank to rank, later ranks see earlier ranks' keys); otherwise each rank's tokens are a sequence of
    their own (replayed leaves, which share only the state). ``prefix_spans``: the positions of this rank's
    prefix rows as [start, end) runs in row order (DSA's top-k tie rule needs them)."""

    query_sizes: tuple[int, ...]
    prefix_sizes: tuple[int, ...]
    consecutive: bool
    prefix_spans: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Segment:
    """Input positions [start, end) after ``parent``'s (None: a root), scored from ``score_from`` on
    (``end``: nothing scored). ``row``: a row whose path passes it (its tokens are the segment's).
    This rank's part: input positions [``own_start``, ``own_end``) and state rows [``row_start``,
    ``row_start + own_end - own_start``) (one process: the positions themselves); under CP a captured segment's
    ``split`` (every rank's tokens and rows before it, ``rank_rows``), a leaf's part the whole leaf."""

    index: int
    parent: int | None
    start: int
    end: int
    score_from: int
    row: int
    children: tuple[int, ...] = ()
    own_start: int = -1
    own_end: int = -1
    row_start: int = -1
    split: Split | None = None
    rank_rows: tuple[int, ...] = (0,)  # every rank's rows of state before the segment

    @property
    def length(self) -> int:
        return self.end - self.start

    @property
    def scored(self) -> int:
        """Positions it scores."""
        return self.end - self.score_from

    @property
    def row_end(self) -> int:
        """This rank's rows after the segment: where its children's rows start."""
        return self.row_start + self.own_end - self.own_start


@dataclass(frozen=True)
class Piece:
    """Part of a row's scored values: values [first, last) of ``segment``'s scored positions."""

    segment: int
    first: int
    last: int


@dataclass(frozen=True)
class ModelCall:
    """What one step runs through the model on this rank (one ``execute.run_segment`` call), the figures every
    cost of the step reads (each layer's ``mixers.LayerCall``: ``mixers.layer_calls``; its FLOPs:
    ``flops.ModelCost.call_forward``).

    ``lengths``: each sequence's real tokens on this rank, run as one batch right-padded to the longest (a CP
    dummy: none, run as one token); ``start``: the position of their first token; ``scored``: each sequence's
    positions scored on this rank (None: the call scores nothing and its last layer stops at its state);
    ``prefix``: this rank's rows of state before them, ``group_prefix`` every rank's summed, in buffers of
    ``state_len`` rows (``Plan.capacity``); ``sizes``: every rank's tokens (one process: the padded tokens);
    ``rank`` of the ``cp_size`` ranks whose state the call reads (1: one process, or a CP round after no state);
    ``consecutive``: as ``Split``'s."""

    lengths: tuple[int, ...]
    start: int
    scored: tuple[int, ...] | None
    prefix: int
    group_prefix: int
    state_len: int
    sizes: tuple[int, ...]
    rank: int
    cp_size: int
    consecutive: bool

    @property
    def batch(self) -> int:
        """Sequences the call runs (a CP dummy: one)."""
        return max(len(self.lengths), 1)

    @property
    def tokens(self) -> int:
        """Tokens of each sequence as run: the longest (a CP dummy: one)."""
        return max(self.lengths, default=1)


VALUE_BYTES = torch.float32.itemsize  # a scored value (log-prob, entropy) and a gathered loss are float32


@dataclass(frozen=True)
class Step:
    """One step of a walk on this rank (``Plan.steps``), one of ``STEP_TYPES``: a call of the model (``call``;
    ``Capture``, ``Replay``, ``Recompute``) or none (``Release``). ``segments``: what it runs or frees;
    ``parent``: the segment after whose state it runs (None: a root's or none).

    Per type: ``phase``, the timing label of its seconds (``timing.phase``; ``execute.GroupStats``);
    ``differentiable``: a walk computing a gradient runs it with autograd and backpropagates it;
    ``keeps_own_state``: its segment's new state stays alive through its backward (a recompute's takes the state
    gradient; a replay's leaves' state is freed first)."""

    segments: tuple[int | None, ...]
    parent: int | None
    call: ModelCall | None = None

    phase: ClassVar[str]
    differentiable: ClassVar[bool] = False
    keeps_own_state: ClassVar[bool] = False

    @property
    def writes(self) -> int | None:
        """The segment whose state the step stores (None: none)."""
        return None

    @property
    def frees(self) -> int | None:
        """The segment whose state and gradient sums the step frees (None: none)."""
        return None

    @property
    def reads(self) -> tuple[int, ...]:
        """The segments whose stored state or gradient sums the step reads."""
        return () if self.parent is None else (self.parent,)

    def collectives(self, loss: bool, entropy: bool) -> dict[str, int]:
        """Bytes by collective op (``comm.trace_collectives``' convention: a buffer's bytes, variable sizes padded to
        the largest) of the walk's own collectives in the step under CP, besides its layers'
        (``MixerOp.collective_bytes``): the gathers of scored values and losses, the sum of value gradients.
        ``loss``: the walk evaluates a loss; ``entropy``: it computes entropies too."""
        return {}


@dataclass(frozen=True)
class _ModelStep(Step):
    """A step that calls the model on ``split`` (None: one process)."""

    split: Split | None = None

    @property
    def sharded(self) -> bool:
        """Whether the call reads the other ranks (runs on its ``split``): under CP, except a replay round after no
        state (roots), whose ranks each run their leaf alone (nothing to attend across the ranks)."""
        return self.call.cp_size > 1


def _gather_bytes(sizes: tuple[int, ...], per_entry: int) -> int:
    """Bytes of an all-gather of every rank's ``sizes`` entries of ``per_entry`` bytes, padded to the largest."""
    return len(sizes) * max(sizes, default=0) * per_entry


@dataclass(frozen=True)
class Capture(_ModelStep):
    """Run ``segments[0]`` without autograd after ``parent``'s state and store its state. Under CP a segment
    that scores gathers every rank's scored values (``gathered``: every rank's count; else empty)."""

    gathered: tuple[int, ...] = ()
    phase = "capture"

    @property
    def writes(self) -> int:
        return self.segments[0]

    def collectives(self, loss: bool, entropy: bool) -> dict[str, int]:
        values = _gather_bytes(self.gathered, VALUE_BYTES) * (2 if entropy else 1)
        return {"all_gather": values} if values else {}


@dataclass(frozen=True)
class Replay(_ModelStep):
    """Run sibling leaves ``segments`` (k >= 1 in one process, padded to the longest; under CP this rank's leaf of
    ``round``, every rank's leaf of the round, None: a one-token dummy that keeps the ranks' calls matched) after
    ``parent``'s state, with autograd and a backward in a gradient walk. A CP round gathers every rank's scored
    values (``gathered``: each rank's count, a dummy's 1) and losses (``loss_rows``: each rank's rows ending at its
    leaf, a dummy's 1; with a validity flag each)."""

    round: tuple[int | None, ...] = ()
    gathered: tuple[int, ...] = ()
    loss_rows: tuple[int, ...] = ()
    phase = "replay"
    differentiable = True

    def collectives(self, loss: bool, entropy: bool) -> dict[str, int]:
        total = _gather_bytes(self.gathered, VALUE_BYTES) * (2 if entropy else 1)
        if loss:
            total += _gather_bytes(tuple(2 * n for n in self.loss_rows), VALUE_BYTES)
        return {"all_gather": total} if total else {}


@dataclass(frozen=True)
class Recompute(_ModelStep):
    """Run captured ``segments[0]`` again with autograd after ``parent``'s state and backpropagate its state's and
    its values' summed gradients. Under CP a segment that scores sums every rank's gradients of its ``reduced``
    scored values (else 0)."""

    reduced: int = 0
    phase = "recompute"
    differentiable = True
    keeps_own_state = True

    @property
    def reads(self) -> tuple[int, ...]:
        return (*super().reads, self.segments[0])

    def collectives(self, loss: bool, entropy: bool) -> dict[str, int]:
        values = self.reduced * VALUE_BYTES * (2 if entropy else 1)
        return {"all_reduce": values} if values else {}


@dataclass(frozen=True)
class Release(Step):
    """Free ``segments[0]``'s state and gradient sums, after the last step that reads them."""

    phase = "release"

    @property
    def frees(self) -> int:
        return self.segments[0]


STEP_TYPES = (Capture, Replay, Recompute, Release)  # every step a plan yields is one of these


@dataclass(frozen=True)
class Plan:
    """Segments (by index; parents before children), rows (``pieces``: each row's scored values in order;
    ``ends``: each row's last segment), ``capacity`` (state rows of the longest path on this rank), the knobs it
    was built with, ``world`` and this rank; ``built_from``: the rows' shape it was built from (``star_source``,
    ``tree_source``)."""

    segments: tuple[Segment, ...]
    pieces: tuple[tuple[Piece, ...], ...]
    ends: tuple[int, ...]
    capacity: int
    knobs: Knobs
    world: int = 1
    rank: int = 0
    built_from: tuple = field(default=(), compare=False, repr=False)
    _steps: dict = field(default_factory=dict, compare=False, repr=False)

    def serves(self, built_from: tuple, knobs: Knobs, world: int, rank: int) -> bool:
        """Whether this is the plan its builder makes of rows of shape ``built_from`` (``star_source``,
        ``tree_source``: a tree's rows by their tokens too) with ``knobs`` on ``rank`` of ``world``."""
        return (self.built_from == built_from and self.knobs.plans_like(knobs)
                and (self.world, self.rank) == (world, rank))

    @property
    def num_rows(self) -> int:
        return len(self.pieces)

    @property
    def roots(self) -> tuple[int, ...]:
        return tuple(s.index for s in self.segments if s.parent is None)

    def is_leaf(self, index: int) -> bool:
        return not self.segments[index].children

    def needs_recompute(self, index: int, mode: str) -> bool:
        """Whether a captured segment is run again with autograd: exact mode always, detached when it scores."""
        return mode == "exact" or (mode == "detached" and self.segments[index].scored > 0)

    def steps(self, mode: str) -> tuple[Step, ...]:
        """This rank's steps of a walk computing ``mode`` (``MODES``), in order (module docstring)."""
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if mode not in self._steps:
            steps: list[Step] = []
            self._walk(None, tuple(self.roots), mode, steps)
            self._steps[mode] = _with_releases(steps)
        return self._steps[mode]

    def _walk(self, parent: int | None, children: tuple[int, ...], mode: str, steps: list[Step]) -> None:
        leaves = [c for c in children if self.is_leaf(c)]
        steps.extend(self._replays(parent, leaves))
        for child in children:
            if self.is_leaf(child):
                continue
            s = self.segments[child]
            sharded = s.split is not None
            steps.append(Capture((child,), parent, self._segment_call(child), s.split,
                                 self.rank_scored(child) if sharded and s.scored else ()))
            self._walk(child, s.children, mode, steps)
            if self.needs_recompute(child, mode):
                steps.append(Recompute((child,), parent, self._segment_call(child), s.split,
                                       s.scored if sharded else 0))

    def _segment_call(self, index: int) -> ModelCall:
        """The call capturing or recomputing segment ``index``: this rank's part after its prefix rows, scoring
        its scored positions on this rank (every rank scores, perhaps none, when the segment scores any)."""
        s = self.segments[index]
        prefixes = self.rank_prefix_rows(index)
        first, last = self.own_scored(index)
        return ModelCall((s.own_end - s.own_start,), s.own_start, (last - first,) if s.scored else None,
                         prefixes[self.rank], sum(prefixes), self.capacity, self.rank_tokens(index), self.rank,
                         self.world, True)

    def _replays(self, parent: int | None, leaves: list[int]) -> list[Step]:
        if not leaves:
            return []
        start = 0 if parent is None else self.segments[parent].end
        state_rows = self.rank_rows_after(parent)
        if self.world == 1:
            steps = []
            for batch in replay_batches([self.segments[i].length for i in leaves], self.knobs.replay_tokens):
                lengths = tuple(self.segments[leaves[i]].length for i in batch)
                call = ModelCall(lengths, start, lengths, state_rows[0], state_rows[0], self.capacity,
                                 (max(lengths),), 0, 1, False)
                steps.append(Replay(tuple(leaves[i] for i in batch), parent, call))
            return steps
        steps = []
        spans = self._spans(parent)
        rows_ending = Counter(self.ends)
        for first in range(0, len(leaves), self.world):
            round_ = tuple(leaves[first + r] if first + r < len(leaves) else None for r in range(self.world))
            sizes = tuple(self.segments[i].length if i is not None else 1 for i in round_)
            split = Split(sizes, state_rows, False, spans)
            mine = round_[self.rank]
            lengths = () if mine is None else (self.segments[mine].length,)
            call = ModelCall(lengths, start, lengths, state_rows[self.rank], sum(state_rows), self.capacity, sizes,
                             self.rank, self.world if any(state_rows) else 1, False)
            steps.append(Replay((mine,), parent, call, split, round_,
                                tuple(1 if i is None else self.segments[i].scored for i in round_),
                                tuple(1 if i is None else rows_ending[i] for i in round_)))
        return steps

    def rank_rows_after(self, parent: int | None) -> tuple[int, ...]:
        """Every rank's rows of state after segment ``parent`` (None: before any)."""
        if parent is None:
            return (0,) * self.world
        s = self.segments[parent]
        return tuple(r + n for r, n in zip(s.rank_rows, self.rank_tokens(parent), strict=True))

    def _spans(self, parent: int | None) -> tuple[tuple[int, int], ...]:
        """This rank's positions of the rows after ``parent``, as runs in row order."""
        return tuple((self.segments[i].own_start, self.segments[i].own_end)
                     for i in (self.path(parent) if parent is not None else []))

    # -- what the walk costs, read by the estimate, the engine's metrics and the tests -------------------------
    def tokens_forwarded(self, mode: str) -> int:
        """Tokens this rank runs through the model in a walk of ``mode``: captures, replays (real tokens),
        recomputes."""
        return sum(sum(step.call.lengths) for step in self.steps(mode) if step.call is not None)

    def held(self, mode: str) -> tuple[int, int]:
        """(segments whose state is held at once, segments whose gradient sums are held at once), the most over a
        walk of ``mode``: a segment's state from its capture to its release; in exact mode its gradient sums from
        the first replay or recompute that continues it (and hands its state a gradient) to its release. What the
        path store holds (``state.PathState``) at its largest, read by the estimate."""
        states, sums, most_states, most_sums = set(), set(), 0, 0
        for step in self.steps(mode):
            if step.frees is not None:
                states.discard(step.frees)
                sums.discard(step.frees)
                continue
            if step.writes is not None:
                states.add(step.writes)
            elif mode == "exact" and step.differentiable and step.parent is not None:
                sums.add(step.parent)
            most_states, most_sums = max(most_states, len(states)), max(most_sums, len(sums))
        return most_states, most_sums

    def rank_scored(self, index: int) -> tuple[int, ...]:
        """Every rank's scored positions of segment ``index`` (its part from ``score_from`` on)."""
        s = self.segments[index]
        start, out = s.start, []
        for size in self.rank_tokens(index):
            out.append(max(0, start + size - max(start, s.score_from)))
            start += size
        return tuple(out)

    def own_scored(self, index: int) -> tuple[int, int]:
        """[first, last) of segment ``index``'s scored values that this rank's part computes."""
        s = self.segments[index]
        first = max(s.own_start, s.score_from)
        return first - s.score_from, max(first, s.own_end) - s.score_from

    def rank_tokens(self, index: int) -> tuple[int, ...]:
        """Every rank's tokens of segment ``index`` (one process: its length)."""
        split = self.segments[index].split
        return split.query_sizes if split is not None else (self.segments[index].length,)

    def rank_prefix_rows(self, index: int) -> tuple[int, ...]:
        """Every rank's rows of state before segment ``index`` (one process: its start)."""
        split = self.segments[index].split
        return split.prefix_sizes if split is not None else (self.segments[index].row_start,)

    @property
    def captured(self) -> tuple[int, ...]:
        """Segments with children (captured, and recomputed in exact mode), in plan order."""
        return tuple(s.index for s in self.segments if s.children)

    @property
    def captured_tokens(self) -> int:
        """Tokens this rank captures in any walk (its part of every segment with children)."""
        return sum(self.segments[i].own_end - self.segments[i].own_start for i in self.captured)

    def path(self, index: int) -> list[int]:
        """Segments from a root down to ``index``."""
        out = []
        while index is not None:
            out.append(index)
            index = self.segments[index].parent
        return out[::-1]


def _with_releases(steps: list[Step]) -> tuple[Step, ...]:
    """``steps`` with a ``Release`` of every captured segment right after the last step that reads its state (a
    child's capture, replay or recompute) or its own recompute, whichever is later."""
    last: dict[int, int] = {}
    for k, step in enumerate(steps):
        if step.writes is not None:
            last.setdefault(step.writes, k)
        for segment in step.reads:
            last[segment] = k
    after: dict[int, list[int]] = {}
    for segment, k in last.items():
        after.setdefault(k, []).append(segment)
    out = []
    for k, step in enumerate(steps):
        out.append(step)
        out.extend(Release((segment,), None) for segment in after.get(k, []))
    return tuple(out)


def chain_bounds(start: int, end: int, chunk_size: int | None, min_length: int) -> list[tuple[int, int]]:
    """``chunk_bounds``, a last chunk shorter than ``min_length`` merged into the one before (under CP every rank
    needs at least one token of every captured segment: ``min_length`` = R)."""
    bounds = [list(b) for b in chunk_bounds(start, end, chunk_size)]
    if len(bounds) > 1 and bounds[-1][1] - bounds[-1][0] < min_length:
        last = bounds.pop()
        bounds[-1][1] = last[1]
    return [(s, e) for s, e in bounds]


def _finish(segments: list[dict], rows: list[tuple[int, int]], knobs: Knobs, world: int, rank: int,
            built_from: tuple) -> Plan:
    """The plan of segments (dicts of ``parent``, ``start``, ``end``, ``score_from``, ``row``; parents first) and
    rows (first scored position, last segment), on ``rank`` of ``world``: a captured segment (one with children)
    is split into ``world`` contiguous parts, each rank's rows of a path its parts in path order."""
    children: dict[int, list[int]] = {i: [] for i in range(len(segments))}
    for i, s in enumerate(segments):
        if s["parent"] is not None:
            children[s["parent"]].append(i)
    built: list[Segment] = []
    ends_of: dict[int, tuple[int, ...]] = {}  # every rank's rows after a captured segment
    for i, s in enumerate(segments):
        before = ends_of[s["parent"]] if s["parent"] is not None else (0,) * world
        own_start, own_end, split = s["start"], s["end"], None
        if children[i] and world > 1:
            sizes = tuple(split_evenly(s["end"] - s["start"], world))
            own_start = s["start"] + sum(sizes[:rank])
            own_end = own_start + sizes[rank]
            path = []
            index = s["parent"]
            while index is not None:
                path.append((built[index].own_start, built[index].own_end))
                index = built[index].parent
            split = Split(sizes, before, True, tuple(reversed(path)))
            ends_of[i] = tuple(b + n for b, n in zip(before, sizes, strict=True))
        elif children[i]:
            ends_of[i] = (before[0] + s["end"] - s["start"],)
        built.append(Segment(index=i, children=tuple(children[i]), own_start=own_start, own_end=own_end,
                             row_start=before[rank], split=split, rank_rows=before, **s))
    pieces = []
    for first_scored, end in rows:
        row_pieces = []
        index: int | None = end
        while index is not None:
            seg = built[index]
            lo = max(seg.score_from, first_scored, seg.start)
            if lo < seg.end:
                row_pieces.append(Piece(seg.index, lo - seg.score_from, seg.end - seg.score_from))
            index = seg.parent
        pieces.append(tuple(reversed(row_pieces)))
    capacity = max((s.row_end for s in built if s.children), default=0)  # leaves write no state
    return Plan(tuple(built), tuple(pieces), tuple(end for _, end in rows), capacity, knobs, world, rank, built_from)


def _check_chunking(chunk_size: int | None, world: int, name: str = "chunk_size") -> None:
    """ValueError naming the knob ``name`` where its ``chunk_size`` is below the CP size ``world``."""
    if chunk_size is not None and chunk_size < world:
        raise ValueError(
            f"{name}={chunk_size} is smaller than the context-parallel size {world}: every rank "
            f"needs at least one token of every chunk; use {name} >= {world} (tokens per chunk, all ranks)"
        )


def star_source(prompt_len: int, response_lens: Sequence[int]) -> tuple:
    """The rows' shape ``star_plan`` records as ``Plan.built_from``."""
    return ("star", prompt_len, tuple(response_lens))


def star_plan(
    prompt_len: int,
    response_lens: Sequence[int],
    knobs: Knobs = Knobs(),
    world: int = 1,
    rank: int = 0,
) -> Plan:
    """One GRPO group: a prompt of ``prompt_len`` tokens (positions [0, P - 1) captured, in ``knobs.chunk_size``
    chunks) and one leaf per response of ``response_lens[i]`` tokens (input [p[-1]] + r[:-1], every position
    scored), a ``knobs.response_chunk_size`` chain where longer (as ``tree_plan`` cuts a scored leaf); leaves replay
    in ``knobs.replay_tokens`` batches (``min_shared_tokens`` is not read). Rows: prompt + response i, scored from
    token P. ``world`` > 1: this ``rank``'s part of a CP group."""
    captured = prompt_len - 1
    if world > 1:
        check_prompt_layout(captured, knobs.chunk_size, world)
        _check_chunking(knobs.response_chunk_size, world, "response_chunk_size")
    segments = [dict(parent=None if k == 0 else k - 1, start=s, end=e, score_from=e, row=0)
                for k, (s, e) in enumerate(chain_bounds(0, captured, knobs.chunk_size, world))]
    last = len(segments) - 1 if segments else None
    rows = []
    for i, length in enumerate(response_lens):
        parent = last
        for s, e in chain_bounds(captured, captured + length, knobs.response_chunk_size, world):
            segments.append(dict(parent=parent, start=s, end=e, score_from=s, row=i))
            parent = len(segments) - 1
        rows.append((captured, parent))
    return _finish(segments, rows, knobs, world, rank, star_source(prompt_len, response_lens))


def _common_prefix(a: torch.Tensor, b: torch.Tensor, limit: int) -> int:
    """Length of the common prefix of token ids ``a`` and ``b`` within their first ``limit`` tokens."""
    differs = (a[:limit] != b[:limit]).nonzero()
    return int(differs[0, 0]) if len(differs) else limit


def tree_source(sequences: Sequence[torch.Tensor], score_starts: Sequence[int]) -> tuple:
    """The rows ``tree_plan`` records as ``Plan.built_from``: their lengths, score starts and a position-weighted
    checksum of each row's token ids (the tree's sharing depends on the tokens, so a plan of other tokens of the
    same lengths is refused). One vectorized pass and one host sync for all rows."""
    lengths = tuple(len(ids) for ids in sequences)
    flat = torch.cat([ids.reshape(-1).long() for ids in sequences])
    starts = torch.tensor([0, *lengths[:-1]], device=flat.device).cumsum(0)
    row = torch.repeat_interleave(torch.arange(len(lengths), device=flat.device),
                                  torch.tensor(lengths, device=flat.device))
    weights = (torch.arange(len(flat), device=flat.device) - starts[row] + 1) % 1_000_003
    sums = torch.zeros(len(lengths), dtype=torch.int64, device=flat.device).index_add_(0, row, flat * weights)
    return ("tree", lengths, tuple(score_starts), tuple(sums.tolist()))


def tree_plan(
    sequences: Sequence[torch.Tensor],
    score_starts: Sequence[int],
    knobs: Knobs = Knobs(),
    world: int = 1,
    rank: int = 0,
) -> Plan:
    """The prefix tree of rows ``sequences[i]`` (1-D token ids; compared on the host) scored from token
    ``score_starts[i]`` on (module docstring); ``world`` > 1: this ``rank``'s part of a CP group.

    Rows share the input positions of their common prefix when it has at least ``knobs.min_shared_tokens`` tokens
    (shorter sharing splits the rows into separate trees). Each trie node is cut where scoring starts (its rows'
    earliest scored position), its unscored or shared part into ``knobs.chunk_size`` chains, a scored leaf into a
    ``knobs.response_chunk_size`` chain (None: whole); leaves replay in ``knobs.replay_tokens`` batches.
    Identical rows share every segment. Under CP every captured segment has at least R positions (one per rank): a
    shorter chain tail joins the piece before it, a shorter cut where scoring starts is not made (the segment
    scores from inside), and a shorter shared node is not shared (its rows' children start where it would have).
    """
    _check_chunking(knobs.chunk_size, world)
    _check_chunking(knobs.response_chunk_size, world, "response_chunk_size")
    host = [s.detach().to("cpu") for s in sequences]
    positions = [len(s) - 1 for s in host]  # input positions of each row
    first_scored = [start - 1 for start in score_starts]  # each row's first scored input position
    segments: list[dict] = []
    ends = [-1] * len(host)

    def add_chain(parent: int | None, start: int, end: int, score_from: int, size: int | None, row: int) -> int:
        for s, e in chain_bounds(start, end, size, world):
            segments.append(dict(parent=parent, start=s, end=e, score_from=min(max(score_from, s), e), row=row))
            parent = len(segments) - 1
        return parent

    def groups_at(rows: list[int], depth: int) -> list[list[int]]:
        """``rows`` (all sharing tokens [0, depth]) continuing past input position ``depth``, grouped by the
        token after it."""
        by_token: dict[int, list[int]] = {}
        for r in rows:
            by_token.setdefault(int(host[r][depth + 1]), []).append(r)
        return list(by_token.values())

    def build(rows: list[int], depth: int, parent: int | None) -> None:
        """Segments of ``rows``, which share input positions [0, depth), after segment ``parent``."""
        reference = host[rows[0]]
        shared = min(positions[r] for r in rows)
        for r in rows[1:]:
            shared = min(shared, _common_prefix(host[r], reference, shared + 1) - 1)
        ending = [r for r in rows if positions[r] == shared]
        continuing = groups_at([r for r in rows if positions[r] > shared], shared)
        branches = continuing + ([ending] if ending else [])
        too_short = (parent is None and shared + 1 < knobs.min_shared_tokens) or 0 < shared - depth < world
        if len(branches) > 1 and too_short:
            for group in branches:
                build(group, depth, parent)  # not shared: each branch on its own
            return
        if shared > depth:
            score_from = min(max(first_scored[r], depth) for r in rows)
            unscored_end = min(score_from, shared)
            if continuing:  # captured: split where scoring starts only if both parts have R positions
                cut = unscored_end if min(unscored_end - depth, shared - unscored_end) >= world else depth
            else:  # a leaf: the unscored part is captured, the scored part replayed
                cut = unscored_end if unscored_end - depth >= world else depth
            if cut > depth:
                parent = add_chain(parent, depth, cut, cut, knobs.chunk_size, rows[0])
            if cut < shared:
                size = knobs.chunk_size if continuing else knobs.response_chunk_size
                parent = add_chain(parent, cut, shared, score_from, size, rows[0])
        for r in ending:
            ends[r] = parent
        for group in continuing:
            build(group, shared, parent)

    roots: dict[tuple[int, int], list[int]] = {}
    for r, s in enumerate(host):
        roots.setdefault((int(s[0]), int(s[1])), []).append(r)
    for rows in roots.values():
        build(rows, 0, None)
    return _finish(segments, list(zip(first_scored, ends, strict=True)), knobs, world, rank,
                   tree_source(host, score_starts))
