"""Run a plan (``plan.Plan``): capture segments without autograd, replay leaves, recompute segments with the
gradient their subtrees handed back, and return every row's log-probs (and losses).

A walk (``walk``) follows ``Plan.steps``: ``_Walk.run`` is the one interpreter of the plan's typed steps
(``plan.STEP_TYPES``), a handler per type (``_HANDLERS``); ``capture`` is the same run, stopped before the first
replay or recompute. Each step but a release is one call of the model module (``run_segment``) and each layer one
call of that layer, so FSDP2 and gradient-checkpointing hooks apply as in an ordinary forward. A
layer's only positional argument is the hidden state: the state reaches it through a closure, so FSDP2's
``cast_forward_inputs`` (bf16 mixed precision) never rounds a float32 recurrent state.

Gradient (modes "exact" and "detached"): a row's loss (``loss_fn(row, log_probs[, entropies])``) is evaluated
once its last segment has run: its values from leaves replayed in the same step are live (that step's backward
runs through them), the values from earlier segments are leaves whose gradient is added to those segments'
float32 per-token sums. In exact mode the state a replay or recompute reads is a leaf too, whose gradient goes
into the path store's float32 sums as the backward produces it (``state.PathState.leaves``); a segment's
recompute then backpropagates its state's summed gradient plus its scored tokens' (and hands the gradient of its
parent's state on). So the gradient is the standard full-sequence one, each shared token scored once, and one
path's state is held at a time. Detached mode reads the state as constants (the LongStraw paper's gradient),
recomputing only segments that score tokens.

Context parallel (``group``): every rank runs the same steps on its part (``Segment.own_*``,
``Step.split``), the adapters' mixers attend and hand state across the ranks, and each replay round's values and
losses are gathered so every rank ends with every row's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch.nn.utils.rnn import pad_sequence

from .adapters import Adapter
from .adapters.base import call_as
from .fake_cuda import is_fake
from .flops import BACKWARD, model_cost
from .mixers import layer_needs_output
from .parallel import comm
from .parallel.fsdp2 import compute_device
from .plan import Capture, Plan, Recompute, Release, Replay, Split, Step
from .score import Scoring, score
from .state import LayerState, PathState
from .state.stream import saving_as_host_rows
from .timing import Stopwatch, phase

LossFn = Callable[..., torch.Tensor]


@dataclass
class GroupStats:
    """What a walk cost on this rank: bytes held (the largest over the walks recorded), seconds per phase,
    tokens run through the model per phase (captured, replayed: real tokens, recomputed) and the FLOPs they ran."""

    prompt_state_bytes: int = 0  # host rows included (``state_on_host``)
    state_grad_device_bytes: int = 0  # exact mode: float32 state-gradient sums on the device
    state_grad_host_bytes: int = 0  # the same, kept in host memory (``state_grad_on_host``)
    capture_s: float = 0.0
    replay_s: float = 0.0
    prompt_backward_s: float = 0.0
    tokens_captured: int = 0
    tokens_replayed: int = 0
    tokens_recomputed: int = 0
    segments: int = 0  # segments of the plans walked
    model_flops: float = 0.0  # forward and backward FLOPs of every call, recomputes included (``flops``)
    prompt_state_host_bytes: int = 0  # of ``prompt_state_bytes``, the rows kept in host memory (``state_on_host``)

    @property
    def tokens_forwarded(self) -> int:
        """Tokens run through the model: captures, replays and recomputes."""
        return self.tokens_captured + self.tokens_replayed + self.tokens_recomputed


@dataclass
class GroupResult:
    """What every entry point returns: per row the float32 log-probs [T_i] of its scored tokens, the entropies
    [T_i] when asked (else None), the losses [rows] when a loss was given (else None), detached; and the stats."""

    log_probs: list[torch.Tensor]
    entropies: list[torch.Tensor] | None
    losses: torch.Tensor | None
    stats: GroupStats = field(default_factory=GroupStats)


@dataclass
class SegmentOutput:
    """``run_segment``'s result: each layer's state of the segment, and the float32 log-probs and entropies
    [B * S] of the scored positions (None where not scored / not asked)."""

    states: list[LayerState]
    log_probs: torch.Tensor | None
    entropies: torch.Tensor | None


class Sequences:
    """Token ids of a plan's rows: row i is the concatenation of ``parts[i]`` (1-D tensors on one device), read
    by span without materialising it (a star's rows share one prompt tensor)."""

    def __init__(self, parts: Sequence[Sequence[torch.Tensor]]):
        self.parts = [tuple(p) for p in parts]
        self.lengths = [sum(len(t) for t in p) for p in self.parts]

    def span(self, row: int, start: int, end: int) -> torch.Tensor:
        """Tokens [start, end) of row ``row``."""
        out, offset = [], 0
        for part in self.parts[row]:
            lo, hi = max(start - offset, 0), min(end - offset, len(part))
            if lo < hi:
                out.append(part[lo:hi])
            offset += len(part)
        return out[0] if len(out) == 1 else torch.cat(out)


def run_segment(
    adapter: Adapter,
    ids: torch.Tensor,
    start: int,
    past: list[LayerState] | None,
    scoring: Scoring | None,
    split: Split | None = None,
    group: comm.Group = None,
) -> SegmentOutput:
    """Run tokens ``ids`` [S] at positions ``start``... after ``past`` (None: nothing before), or ``ids`` [B, S]:
    B right-padded sequences after the same ``past``, in one forward (the state broadcast over them); ``split``
    over ``group``: this rank's part of a CP step (None: one process).

    Every layer's segment state is returned; with ``scoring`` also the log-probs of ``scoring.targets`` and the
    entropies (or None), each [B * S - scoring.first], the LM head scored a row chunk at a time (``score``) inside
    the head module's call. Without it the last layer stops once its state is known (its output is never read).
    """

    def forward(ids: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        h = adapter.embed(ids)
        ctx = adapter.context(h, start, split, group)
        layer_past = past or [tuple(kind.empty(h) for kind in kinds) for kinds in adapter.specs()]
        ctx.past = layer_past
        states = []
        for idx, layer in enumerate(adapter.layers):
            need_output = layer_needs_output(idx, adapter.num_layers, scoring is not None)

            def layer_forward(h, idx=idx, need_output=need_output):
                return adapter.layer(idx, h, ctx, layer_past[idx], need_output)

            h, *state = call_as(layer, layer_forward, h)
            states.extend(state)
        log_probs = entropies = None
        if scoring is not None:
            head = adapter.lm_head

            def head_forward(hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
                return score(hidden, head, scoring.targets, scoring.temperature, scoring.with_entropy)

            log_probs, entropies = call_as(head, head_forward, adapter.final_hidden(h)[scoring.first :])
        return (log_probs, entropies, *states)

    # the ids go through the root's call: FSDP2's root pre-forward on CUDA (torch <= 2.11) fails on a call without
    # inputs (``_to_kwargs`` returns no argument tuple for it)
    log_probs, entropies, *flat = call_as(adapter.model, forward, ids)
    flat_iter = iter(flat)
    return SegmentOutput([tuple(next(flat_iter) for _ in kinds) for kinds in adapter.specs()], log_probs, entropies)


class _Walk:
    """One walk of ``plan`` (``walk``); holds the values, gradient sums and losses while it runs."""

    def __init__(self, adapter: Adapter, plan: Plan, sequences: Sequences, mode: str, temperature: float,
                 with_entropy: bool, loss_fn: LossFn | None, group: comm.Group, store: PathState,
                 captured: frozenset[int], stats: GroupStats):
        self.adapter, self.plan, self.sequences, self.mode = adapter, plan, sequences, mode
        self.temperature, self.with_entropy, self.loss_fn, self.group = temperature, with_entropy, loss_fn, group
        self.store, self.captured, self.stats = store, captured, stats
        self.cost = model_cost(adapter)
        self.backward = mode != "log_probs"
        self.exact = mode == "exact"
        self.values: dict[int, torch.Tensor] = {}  # segment -> float32 log-probs of its scored positions
        self.entropy_values: dict[int, torch.Tensor] = {}
        self.value_grads: dict[int, list[torch.Tensor | None]] = {}  # segment -> [d/d log-probs, d/d entropies]
        self.losses: dict[int, torch.Tensor] = {}
        self.rows_ending: dict[int, list[int]] = {}
        self.stored: list[int] = []  # segments whose state this walk wrote, in order
        for row, end in enumerate(plan.ends):
            self.rows_ending.setdefault(end, []).append(row)

    # -- helpers -----------------------------------------------------------------------------------------------
    def _parent_rows(self, parent: int | None) -> int:
        return 0 if parent is None else self.plan.segments[parent].row_end

    def _own_tokens(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) [S] of this rank's part of segment ``index``."""
        s = self.plan.segments[index]
        return (self.sequences.span(s.row, s.own_start, s.own_end),
                self.sequences.span(s.row, s.own_start + 1, s.own_end + 1))

    def _flops(self, step: Step) -> float:
        """Forward FLOPs of ``step``'s call on this rank (``flops.ModelCost.call_forward``)."""
        return sum(self.cost.call_forward(step.call).values())

    def _scoring(self, targets: torch.Tensor, first: int = 0) -> Scoring:
        return Scoring(targets[first:], self.temperature, self.with_entropy, first)

    def _segment_scoring(self, index: int, targets: torch.Tensor) -> Scoring | None:
        """The scoring of a captured segment's part on this rank: from its first scored position on (every rank
        scores, perhaps no position, when the segment scores any: the LM head is called on every rank alike)."""
        s = self.plan.segments[index]
        if not s.scored:
            return None
        return self._scoring(targets, min(max(s.score_from - s.own_start, 0), s.own_end - s.own_start))

    def _keep_values(self, index: int, log_probs: torch.Tensor, entropies: torch.Tensor | None) -> None:
        self.values[index] = log_probs.detach()
        if entropies is not None:
            self.entropy_values[index] = entropies.detach()

    def _keep_segment_values(self, step: Capture, out: SegmentOutput) -> None:
        """Keep a captured segment's scored values; under CP every rank's parts (``Capture.gathered``), so every
        rank has them all."""
        values = [out.log_probs, out.entropies]
        if self.group is not None:
            values = [None if v is None else torch.cat(comm.all_gather(v.detach().contiguous(), self.group,
                                                                       step.gathered))
                      for v in values]
        self._keep_values(step.segments[0], *values)

    def _owns_row_losses(self) -> bool:
        """Whether this rank backpropagates the losses of rows ending at a captured segment (every rank evaluates
        them; one backpropagates, as one rank does a leaf's)."""
        return self.group is None or comm.group_rank(self.group) == 0

    # -- rows and their losses ------------------------------------------------------------------------------
    def _row_losses(self, rows: list[int], live: dict[int, tuple[torch.Tensor, torch.Tensor | None]]):
        """Losses of ``rows`` (each a scalar tensor, a zero-size placeholder for a wrong return) and the leaves
        standing for their values from earlier segments: [(segment, piece, lp leaf, entropy leaf)]."""
        losses, stand_ins = [], []
        for row in rows:
            lp_parts, ent_parts = [], []
            for piece in self.plan.pieces[row]:
                if piece.segment in live:
                    lp, ent = live[piece.segment]
                    lp, ent = lp[piece.first : piece.last], None if ent is None else ent[piece.first : piece.last]
                else:
                    lp = self.values[piece.segment][piece.first : piece.last]
                    ent = self.entropy_values.get(piece.segment)
                    ent = None if ent is None else ent[piece.first : piece.last]
                    if self.backward:
                        lp = lp.detach().requires_grad_()
                        ent = None if ent is None else ent.detach().requires_grad_()
                        stand_ins.append((piece, lp, ent))
                lp_parts.append(lp)
                ent_parts.append(ent)
            lp = lp_parts[0] if len(lp_parts) == 1 else torch.cat(lp_parts)
            ent = None
            if self.with_entropy:
                ent = ent_parts[0] if len(ent_parts) == 1 else torch.cat(ent_parts)
            losses.append(self.loss_fn(row, lp, ent) if self.with_entropy else self.loss_fn(row, lp))
        return losses, stand_ins

    def _add_value_grads(self, stand_ins) -> None:
        for piece, lp, ent in stand_ins:
            sums = self.value_grads.setdefault(piece.segment, [None, None])
            for j, leaf in enumerate((lp, ent)):
                if leaf is None or leaf.grad is None:
                    continue
                if sums[j] is None:
                    sums[j] = torch.zeros_like(self.values[piece.segment])
                sums[j][piece.first : piece.last] += leaf.grad

    def _record_losses(self, rows: list[int], losses: list, like: torch.Tensor, step: Step | None) -> None:
        """Check each loss is a scalar tensor (on every rank, for every rank's rows) and keep its value. One
        process checks on the host; a CP round gathers each rank's verdicts with the values (a dry run's fake
        tensors hold no verdict to read: its loss_fn is the dry run's own)."""
        scalar = [isinstance(loss, torch.Tensor) and loss.dim() == 0 for loss in losses]
        if step is None or not step.round:
            for row, loss, ok in zip(rows, losses, scalar, strict=True):
                if not ok:
                    raise ValueError(f"loss_fn must return a scalar tensor; it did not for row {row}")
                self.losses[row] = loss.detach().to(like.dtype)
            return
        payloads = [torch.stack([loss.detach().to(like.dtype), like.new_ones(())]) if ok else like.new_zeros(2)
                    for loss, ok in zip(losses, scalar, strict=True)]
        sizes = tuple(2 * rows for rows in step.loss_rows)
        mine = torch.cat(payloads) if payloads else like.new_zeros(2)
        gathered = comm.all_gather(mine.contiguous(), self.group, sizes)
        rows, payloads = [], []
        for leaf, part in zip(step.round, gathered, strict=True):
            if leaf is not None:
                rows.extend(self.rows_ending.get(leaf, ()))
                payloads.extend(part.view(-1, 2))
        for row, (value, ok) in zip(rows, payloads, strict=True):
            if not is_fake(ok) and not ok:
                raise ValueError(f"loss_fn must return a scalar tensor; it did not for row {row}")
            self.losses[row] = value

    # -- steps: the one interpreter of the plan ----------------------------------------------------------------
    def run(self, stop_before_backward: bool = False) -> None:
        """Run the walk's steps (``plan.steps(mode)``) in order, each by its type's handler (``_HANDLERS``), its
        seconds under its ``phase`` label; ``stop_before_backward``: stop at the first differentiable step (a
        replay or recompute), which ``capture`` runs up to. The captures and releases of segments ``captured``
        before (by ``capture``) are not run again."""
        for step in self.plan.steps(self.mode):
            if stop_before_backward and step.differentiable:
                return
            if not step.differentiable and step.segments[0] in self.captured:
                continue
            handler, seconds_field = _HANDLERS[type(step)]
            if seconds_field is None:
                getattr(self, handler)(step)
                continue
            watch = Stopwatch(self.store_device)
            with phase(step.phase):
                getattr(self, handler)(step)
            setattr(self.stats, seconds_field, getattr(self.stats, seconds_field) + watch.seconds())

    @property
    def store_device(self) -> torch.device:
        return compute_device(self.adapter.model)

    def _release(self, step: Release) -> None:
        s = self.plan.segments[step.segments[0]]
        self.store.release(s.index, s.row_start, s.row_end)

    def _capture(self, step: Capture) -> None:
        s = self.plan.segments[step.segments[0]]
        inputs, targets = self._own_tokens(s.index)
        past = self.store.read(step.parent, self._parent_rows(step.parent))
        scoring = self._segment_scoring(s.index, targets)
        with torch.no_grad():
            out = run_segment(self.adapter, inputs, s.own_start, past, scoring, step.split, self.group)
        self.store.write(s.index, s.row_start, out.states)
        self.stored.append(s.index)
        self.stats.tokens_captured += s.own_end - s.own_start
        self.stats.model_flops += self._flops(step)
        self.stats.prompt_state_bytes = max(self.stats.prompt_state_bytes, self.store.nbytes())
        self.stats.prompt_state_host_bytes = max(self.stats.prompt_state_host_bytes, self.store.host_nbytes())
        if s.scored:
            self._keep_segment_values(step, out)
        rows = self.rows_ending.get(s.index, [])
        if rows and self.loss_fn is not None:
            with torch.enable_grad():
                losses, stand_ins = self._row_losses(rows, {})
            self._record_losses(rows, losses, self.values[s.index], None)
            differentiable = [loss for loss in losses if loss.requires_grad]
            if differentiable and self._owns_row_losses():
                torch.autograd.backward(differentiable)
                self._add_value_grads(stand_ins)

    def _replay(self, step: Replay) -> None:
        parent_rows = self._parent_rows(step.parent)
        if self.backward:
            past = self.store.leaves(step.parent, parent_rows, requires_grad=self.exact)
        else:
            past = self.store.read(step.parent, parent_rows)
        leaves = [i for i in step.segments if i is not None]
        if not step.round:
            pairs = [self._own_tokens(i) for i in leaves]
            inputs = pad_sequence([p[0] for p in pairs], batch_first=True)
            targets = pad_sequence([p[1] for p in pairs], batch_first=True).flatten()
            lengths = [len(p[0]) for p in pairs]
        else:
            if leaves:
                inputs, targets = self._own_tokens(leaves[0])
            else:  # a dummy: one token, so the rank's calls match the others'
                inputs = targets = self.sequences.span(0, 0, 1)
            lengths = [len(inputs)]
        with torch.enable_grad() if self.backward else torch.no_grad(), saving_as_host_rows(past):
            out = run_segment(self.adapter, inputs, step.call.start, past, self._scoring(targets),
                              step.split if step.sharded else None, self.group)
            # a leaf's values start where it scores: under CP a leaf may begin with fewer than R unscored positions
            firsts = [self.plan.segments[i].score_from - self.plan.segments[i].start for i in leaves] or [0]
            lps = [row[f:n] for row, f, n in zip(out.log_probs.view(len(lengths), -1), firsts, lengths, strict=True)]
            ents = [None] * len(lps)
            if self.with_entropy:
                ents = [row[f:n] for row, f, n in zip(out.entropies.view(len(lengths), -1), firsts, lengths,
                                                      strict=True)]
            del out  # a leaf's segment state (each layer's new K/V rows, recurrent states) is never read: freed
            # before the backward, which under checkpointing would otherwise hold every layer's
            live = {i: (lp, ent) for i, lp, ent in zip(leaves, lps, ents, strict=False)}
            rows = [row for i in leaves for row in self.rows_ending.get(i, [])]
            losses, stand_ins = [], []
            if self.loss_fn is not None:
                losses, stand_ins = self._row_losses(rows, live)
        self.stats.tokens_replayed += sum(lengths) if leaves else 0
        forward = self._flops(step)  # real tokens, all scored
        self.stats.model_flops += forward
        self._gather_values(step, leaves, lps, ents)
        if self.loss_fn is None:
            return
        self._record_losses(rows, losses, lps[0], step)
        if not leaves:  # a CP dummy: a zero loss over the same graph, so its backward makes the same calls
            losses = [lps[0].sum() * 0 + (ents[0].sum() * 0 if self.with_entropy else 0)]
        torch.autograd.backward(losses)  # one backward for the batch
        self.stats.model_flops += BACKWARD * forward
        self._add_value_grads(stand_ins)
        self._note_state_grad_bytes()

    def _gather_values(self, step: Replay, leaves: list[int], lps: list, ents: list) -> None:
        """Keep the step's leaves' values; under CP every rank's (no autograd)."""
        if not step.round:
            for i, lp, ent in zip(leaves, lps, ents, strict=True):
                self._keep_values(i, lp, ent)
            return
        for source, keep in ((lps, self.values), (ents, self.entropy_values)):
            if source[0] is None:
                continue
            parts = comm.all_gather(source[0].detach().contiguous(), self.group, step.gathered)
            for leaf, part in zip(step.round, parts, strict=True):
                if leaf is not None:
                    keep[leaf] = part

    def _recompute(self, step: Recompute) -> None:
        s = self.plan.segments[step.segments[0]]
        inputs, targets = self._own_tokens(s.index)
        parent_rows = self._parent_rows(step.parent)
        past = self.store.leaves(step.parent, parent_rows, requires_grad=self.exact)
        scoring = self._segment_scoring(s.index, targets)
        with torch.enable_grad(), saving_as_host_rows(past):
            out = run_segment(self.adapter, inputs, s.own_start, past, scoring, step.split, self.group)
        forward = self._flops(step)
        self.stats.model_flops += forward
        outputs, grads = [], []
        if self.exact or self.group is not None:  # detached under CP: zero gradients, so every rank runs one graph
            # (a sharded mixer's collectives in backward run only where its outputs get a gradient)
            state_grads = self.store.grads_for(s.index, s.row_start, s.row_end) if self.exact else None
            for j, layer_out in enumerate(out.states):
                for k, value in enumerate(layer_out):
                    if value.requires_grad:  # a zero gradient if none reached it: every rank runs the same graph
                        grad = None if state_grads is None else state_grads[j][k]
                        outputs.append(value)
                        grads.append(torch.zeros_like(value) if grad is None else grad.to(value.device, value.dtype))
        value_grads = self.value_grads.pop(s.index, [None, None])
        first, last = self.plan.own_scored(s.index)
        kept = (self.values, self.entropy_values)
        for value, grad, values in zip((out.log_probs, out.entropies), value_grads, kept, strict=True):
            if value is None:
                continue
            if self.group is not None:  # the ranks' row losses all reached this segment's values: sum them
                grad = comm.all_reduce_sum(torch.zeros_like(values[s.index]) if grad is None else grad, self.group)
            if grad is not None:
                outputs.append(value)
                grads.append(grad[first:last])
        if outputs:
            torch.autograd.backward(outputs, grads)
            self.stats.model_flops += BACKWARD * forward
        self.stats.tokens_recomputed += s.own_end - s.own_start
        self._note_state_grad_bytes()

    def _note_state_grad_bytes(self) -> None:
        """Record the gradient sums held after a backward (exact mode: the state leaves added their gradients into
        the store's sums during it; a recompute's before its own sums are released)."""
        if not self.exact:
            return
        self.store.flush()  # the backward's last gradient still on its way to the host is one of its sums
        held = self.store.grad_nbytes()
        if self.store.on_host:
            self.stats.state_grad_host_bytes = max(self.stats.state_grad_host_bytes, held)
        else:
            self.stats.state_grad_device_bytes = max(self.stats.state_grad_device_bytes, held)


def walk(
    adapter: Adapter,
    plan: Plan,
    sequences: Sequences,
    mode: str,
    temperature: float = 1.0,
    with_entropy: bool = False,
    loss_fn: LossFn | None = None,
    group: comm.Group = None,
    state: PathState | None = None,
    captured: frozenset[int] = frozenset(),
    state_grad_on_host: bool = False,
    stats: GroupStats | None = None,
    state_on_host: bool = False,
) -> GroupResult:
    """Run ``plan`` over ``sequences`` computing ``mode`` (``plan.MODES``); ``loss_fn`` (modes "exact",
    "detached") gets each row's values and its backward accumulates into the parameters' ``.grad``.

    ``state``: a store already holding the segments ``captured`` (``capture``), which are not captured again and
    not released. ``state_grad_on_host``, ``state_on_host``: the store's (``PathState``; a ``state``'s own). Returns
    every row's values (and losses) on every rank.
    """
    store = state if state is not None else PathState(adapter.specs(), plan.capacity, state_grad_on_host,
                                                      state_on_host)
    stats = stats if stats is not None else GroupStats()
    stats.segments += len(plan.segments)
    run = _Walk(adapter, plan, sequences, mode, temperature, with_entropy, loss_fn, group, store, captured, stats)
    run.run()
    log_probs, entropies = [], [] if with_entropy else None
    for row in range(plan.num_rows):
        pieces = plan.pieces[row]
        log_probs.append(torch.cat([run.values[p.segment][p.first : p.last] for p in pieces]))
        if with_entropy:
            entropies.append(torch.cat([run.entropy_values[p.segment][p.first : p.last] for p in pieces]))
    losses = None
    if loss_fn is not None:
        losses = torch.stack([run.losses[row] for row in range(plan.num_rows)])
    return GroupResult(log_probs, entropies, losses, stats)


def capture(adapter: Adapter, plan: Plan, sequences: Sequences, mode: str, group: comm.Group, stats: GroupStats,
            on_host: bool = False, state_on_host: bool = False) -> tuple[PathState, frozenset[int]]:
    """Run the steps of a ``mode`` walk of ``plan`` up to its first differentiable one (a replay or recompute;
    a star's prompt chain: its captures, and the releases of what that mode no longer needs): the store
    (``PathState(..., on_host, state_on_host)``) and the segments captured, for ``walk(state=..., captured=...)``."""
    store = PathState(adapter.specs(), plan.capacity, on_host, state_on_host)
    run = _Walk(adapter, plan, sequences, mode, 1.0, False, None, group, store, frozenset(), stats)
    run.run(stop_before_backward=True)
    return store, frozenset(run.stored)


# each step type's handler (a method of ``_Walk``) and the ``GroupStats`` field its seconds add to (None: untimed)
_HANDLERS: dict[type[Step], tuple[str, str | None]] = {
    Capture: ("_capture", "capture_s"),
    Replay: ("_replay", "replay_s"),
    Recompute: ("_recompute", "prompt_backward_s"),
    Release: ("_release", None),
}
