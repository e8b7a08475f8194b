"""Capture a prompt's state once, replay responses against it, backpropagate the prompt once.

Phases for one GRPO group (prompt ``p`` of P tokens, responses ``r_i``):
1. capture: run ``p[:-1]`` without autograd, chunk by chunk, keeping each layer's state;
2. replay: for each response run ``[p[-1]] + r_i[:-1]`` against the state (positions
   P-1 ...), score ``r_i``, and backpropagate its loss at once. Responses replay in batches of
   k (``replay_batches``: k x the longest within a token budget), one forward of [k, T_max]
   right-padded inputs per batch with the state broadcast over the k responses (never copied per
   response), one backward per batch (one batch graph alive);
3. exact mode: the state was a leaf; after each batch's backward its ``.grad`` is added
   into a float32 sum (so bfloat16 models sum the G responses' state gradients in float32),
   giving d(sum of losses)/d(state); recompute the prompt chunk by chunk in reverse, from each chunk's boundary
   state, and backpropagate those gradients (plus the gradient the later chunks sent back
   into this chunk's rows) into the parameters.
Each phase runs as one call of the model module and each layer as a call of that layer,
so FSDP2 and gradient-checkpointing hooks apply as in an ordinary forward. A layer's only
positional argument is the hidden state: the prompt state reaches it through a closure, so
FSDP2's ``cast_forward_inputs`` (bf16 mixed precision) never rounds the float32 recurrent state.

Context parallel (a process group of R ranks, ``verl_longstraw.parallel``): every rank runs the
same phases with the same calls, on its sub-slice of every chunk (``PromptChunk.sharding``) and
on its response of every replay round (``response_rounds``: one response per rank, never batched);
the adapters' mixers then attend and hand state across the ranks.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence

from .adapters import Adapter
from .adapters.base import call_as
from .parallel import comm
from .parallel.layout import PromptLayout, ReplayRounds
from .parallel.segment import SegmentSharding
from .state import LayerState, PromptState, StateSpec


@dataclass
class GroupStats:
    """What one group cost on this rank: bytes held (the largest over the groups recorded) and seconds per phase."""

    prompt_state_bytes: int = 0
    state_grad_device_bytes: int = 0  # exact mode: float32 state-gradient sums on the device
    state_grad_host_bytes: int = 0  # the same, kept in host memory (``state_grad_on_host``)
    capture_s: float = 0.0
    replay_s: float = 0.0
    prompt_backward_s: float = 0.0
    response_tokens: int = 0


def chunk_bounds(length: int, chunk_size: int | None) -> list[tuple[int, int]]:
    """[(start, end)] covering ``length`` tokens in chunks of ``chunk_size`` (one chunk if None)."""
    if length == 0:
        return []
    size = chunk_size or length
    return [(s, min(s + size, length)) for s in range(0, length, size)]


@dataclass(frozen=True)
class PromptChunk:
    """One capture (and recompute) step of this rank: prompt tokens [start, end), written to the
    local state rows from ``row_start``; ``sharding`` says how the chunk is split over a CP group."""

    start: int
    end: int
    row_start: int
    sharding: SegmentSharding | None = None


def prompt_chunks(
    length: int, chunk_size: int | None, group: comm.Group = None, delta_rule_mode: str = "affine"
) -> tuple[list[PromptChunk], tuple[int, ...]]:
    """This rank's capture steps over ``length`` prompt tokens, and the rows of state every rank will hold.

    One process: the chunks of ``chunk_bounds``. A CP group: every global chunk of
    ``PromptLayout``, this rank's sub-slice of it.
    """
    if group is None:
        return [PromptChunk(s, e, s) for s, e in chunk_bounds(length, chunk_size)], (length,)
    layout = PromptLayout(length, chunk_size, comm.group_size(group))
    rank = comm.group_rank(group)
    chunks = []
    for k, (row_start, _) in enumerate(layout.local_chunk_bounds(rank)):
        sizes = tuple(layout.slice_sizes(k))
        prefix = tuple(layout.rows_before(k, r) for r in range(layout.world))
        sharding = SegmentSharding(group, sizes, prefix, consecutive=True, delta_rule_mode=delta_rule_mode,
                                   prefix_spans=tuple((c.start, c.end) for c in chunks))
        chunks.append(PromptChunk(*layout.slices(k)[rank], row_start, sharding))
    return chunks, tuple(layout.local_length(r) for r in range(layout.world))


def response_inputs(prompt_ids: torch.Tensor, response: torch.Tensor) -> torch.Tensor:
    """Tokens replayed for a response: the last prompt token, then all but the last response token."""
    return torch.cat([prompt_ids[-1:], response[:-1]])


REPLAY_TOKENS = 8192  # default token budget of one replay batch: k responses padded to the longest, k x T_max


def replay_batches(lengths: Sequence[int], replay_tokens: int) -> list[list[int]]:
    """Response indices packed in order into batches whose padded size k x max(T_i) stays within ``replay_tokens``
    (a response longer than the budget replays alone)."""
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


@dataclass(frozen=True)
class ReplayStep:
    """What this rank replays in one step: the indices of its ``batch`` of k responses (k >= 1 in one process;
    one per rank under CP, None: a one-token dummy that keeps the ranks' calls matched), input tokens ([T] for
    a CP round, [k, T_max] right-padded in one process), target tokens [k * T_max] (padded like the inputs),
    each response's target count ``lengths``, and the round's ``sharding``."""

    batch: tuple[int | None, ...]
    inputs: torch.Tensor
    targets: torch.Tensor
    lengths: tuple[int, ...]
    sharding: SegmentSharding | None
    target_sizes: tuple[int, ...]  # every rank's target count this round (CP, for gathering results)
    responses: tuple[int | None, ...]  # every rank's response index this round (CP)

    def split(self, values: torch.Tensor) -> list[torch.Tensor]:
        """Per-token ``values`` [k * T_max] of the step -> each response's [T_i] (padding dropped; views)."""
        return [row[:n] for row, n in zip(values.view(len(self.batch), -1), self.lengths, strict=True)]

    @property
    def real_tokens(self) -> int:
        """Target tokens of this rank's real responses (dummies and padding excluded)."""
        return sum(n for i, n in zip(self.batch, self.lengths, strict=True) if i is not None)


def response_rounds(
    prompt_ids: torch.Tensor,
    responses: list[torch.Tensor],
    chunks: list[PromptChunk],
    state_rows: tuple[int, ...],
    group: comm.Group = None,
    replay_tokens: int = REPLAY_TOKENS,
) -> Iterator[ReplayStep]:
    """This rank's replay steps. One process: the ``replay_batches`` of ``replay_tokens``, each one forward of k
    right-padded responses against the (broadcast) prompt state. CP: one response per rank per round
    (``ReplayRounds``; ``replay_tokens`` unused), each rank against its ``state_rows[rank]`` prompt-state rows
    (this rank's rows: those of its capture ``chunks``)."""
    if group is None:
        for batch in replay_batches([len(r) for r in responses], replay_tokens):
            targets = [responses[i] for i in batch]
            inputs = pad_sequence([response_inputs(prompt_ids, t) for t in targets], batch_first=True)
            lengths = tuple(len(t) for t in targets)
            yield ReplayStep(tuple(batch), inputs, pad_sequence(targets, batch_first=True).flatten(), lengths, None,
                             lengths, tuple(batch))
        return
    spans = tuple((c.start, c.end) for c in chunks)
    world = comm.group_size(group)
    rounds = ReplayRounds(len(responses), world)
    dummy = prompt_ids[-1:]
    for round_index in range(rounds.num_rounds):
        indices = tuple(rounds.response(round_index, r) for r in range(world))
        targets = [responses[i] if i is not None else dummy for i in indices]
        sizes = tuple(len(t) for t in targets)
        sharding = SegmentSharding(group, sizes, state_rows, False, prefix_spans=spans)
        mine = targets[comm.group_rank(group)]
        own = indices[comm.group_rank(group)]
        inputs = response_inputs(prompt_ids, mine) if own is not None else dummy
        yield ReplayStep((own,), inputs, mine, (len(mine),), sharding, sizes, indices)


def gather_round(
    values: list[torch.Tensor], step: ReplayStep, group: comm.Group, sizes: tuple[int, ...] | None = None
) -> dict[int, torch.Tensor]:
    """Every rank's ``values`` of one step (one tensor per response of ``step.batch``, per token [T_i] unless
    ``sizes`` says otherwise), by response index (dummies dropped); no autograd."""
    if group is None:
        return {i: v.detach() for i, v in zip(step.batch, values, strict=True)}
    parts = comm.all_gather(values[0].detach().contiguous(), group, sizes or step.target_sizes)
    return {i: part for i, part in zip(step.responses, parts, strict=True) if i is not None}


def run_segment(
    adapter: Adapter,
    ids: torch.Tensor,
    start: int,
    past: list[LayerState] | None,
    scoring: Scoring | None,
    sharding: SegmentSharding | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None] | list[LayerState]:
    """Run tokens ``ids`` [S] at positions ``start``... after ``past`` (None: nothing before), or ``ids`` [B, S]:
    B right-padded sequences after the same ``past``, in one forward (the state broadcast over them).

    With ``scoring``: the float32 log-probs of ``scoring.targets`` and the entropies (or None), each [B * S]
    (B = 1 for ids [S]), the LM head scored a row chunk at a time (``score``) inside the head module's call.
    Otherwise each layer's segment state (the last layer stops once its state is known: its output is never read).
    """

    def forward() -> tuple[torch.Tensor | None, ...]:
        h = adapter.embed(ids)
        ctx = adapter.context(h, start, sharding)
        layer_past = past or [adapter.empty_state(i, h) for i in range(adapter.num_layers)]
        states = []
        for idx, layer in enumerate(adapter.layers):
            need_output = scoring is not None or idx < adapter.num_layers - 1

            def layer_forward(h, idx=idx, need_output=need_output):
                return adapter.layer(idx, h, ctx, layer_past[idx], need_output)

            out = call_as(layer, layer_forward, h)
            if need_output:
                h, out = out[0], out[1:]
            states.append(tuple(out))
        if scoring is not None:
            head = adapter.model.lm_head

            def head_forward(hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
                return score(hidden, head, scoring.targets, scoring.temperature, scoring.with_entropy)

            return call_as(head, head_forward, adapter.final_hidden(h))
        return tuple(t for s in states for t in s)

    out = call_as(adapter.model, forward)
    if scoring is not None:
        return out
    flat = iter(out)
    return [tuple(next(flat) for _ in spec) for spec in adapter.specs()]


def capture(
    adapter: Adapter,
    ids: torch.Tensor,
    chunks: list[PromptChunk],
    rows: int,
    chunk_size: int | None,
    keep_boundaries: bool,
) -> PromptState:
    """This rank's state of the prompt tokens ``ids`` [P'] (``rows`` rows), chunk by chunk without autograd."""
    state = PromptState(adapter.specs(), rows, keep_boundaries, chunk_size)
    with torch.no_grad():
        for c in chunks:
            segment = run_segment(adapter, ids[c.start : c.end], c.start, state.current(), None, c.sharding)
            state.append(segment, c.end - c.start)
    return state


def _leaves(specs: list[tuple[StateSpec, ...]], layers: list[LayerState], requires_grad: bool) -> list[LayerState]:
    """Detached copies of per-layer state tensors; differentiable ones get ``requires_grad``."""
    return [
        tuple(t.detach().requires_grad_(requires_grad and s.differentiable) for s, t in zip(spec, layer, strict=True))
        for spec, layer in zip(specs, layers, strict=True)
    ]


def as_leaves(state: PromptState, requires_grad: bool) -> list[LayerState] | None:
    """The captured state as autograd leaves (differentiable tensors get ``requires_grad``)."""
    current = state.current()
    return None if current is None else _leaves(state.specs, current, requires_grad)


StateGrads = list[list[torch.Tensor | None]]


def _grad_sum_buffer(shape: tuple[int, ...], like: torch.Tensor, on_host: bool) -> torch.Tensor:
    """Zeros for a float32 (float64 for float64 state) gradient sum shaped ``shape``: on ``like``'s device, or in
    host memory (pinned where an accelerator can copy from it asynchronously)."""
    dtype = torch.promote_types(like.dtype, torch.float32)
    if not on_host:
        return like.new_zeros(shape, dtype=dtype)
    return torch.zeros(shape, dtype=dtype, device="cpu", pin_memory=torch.cuda.is_available())


def accumulate_state_grads(leaves: list[LayerState], grads: StateGrads | None, on_host: bool = False) -> StateGrads:
    """Add each state leaf's ``.grad`` into ``grads`` (float32, or float64 for float64 state) and clear it.

    Called after every replay batch's backward, so the sum over the G responses accumulates in
    float32 even for a bfloat16 state; ``grads`` None starts the sums. With ``on_host`` the sums
    live in host memory, each leaf's gradient moved there as it arrives, one layer's tensor at a
    time. Returns the sums, one entry per state tensor
    (None while no gradient reached it).
    """
    grads = grads if grads is not None else [[None] * len(layer) for layer in leaves]
    for layer, sums in zip(leaves, grads, strict=True):
        for j, leaf in enumerate(layer):
            if leaf.grad is None:
                continue
            if sums[j] is None:
                sums[j] = _grad_sum_buffer(tuple(leaf.shape), leaf, on_host)
            sums[j] += leaf.grad.to(sums[j].device)
            leaf.grad = None
    return grads


def backward_prompt(
    adapter: Adapter,
    ids: torch.Tensor,
    chunks: list[PromptChunk],
    state: PromptState,
    grads: StateGrads,
    on_host: bool = False,
) -> None:
    """Backpropagate the state gradients ``grads`` (``accumulate_state_grads``) through the prompt ``ids``, chunks
    in reverse.

    Chunk k is recomputed from its boundary state (as leaves). Its outputs receive the
    gradient of its own rows plus, for fixed-size state, the gradient at its end (cast to
    the output's dtype); the gradient it sends into earlier rows is added to those rows'
    float32 sums, and the gradient of its starting fixed-size state becomes the end
    gradient of chunk k-1. Sums may live in host memory (``accumulate_state_grads(on_host=True)``):
    each chunk's slice moves to the device, and earlier rows' gradients move back, one tensor at a
    time; ``on_host`` places sums first created here.
    """
    for index in reversed(range(len(chunks))):
        c = chunks[index]
        start, end = c.row_start, c.row_start + c.end - c.start  # this rank's rows of the chunk
        past = state.at_boundary(index, start)
        past_leaves = None if past is None else _leaves(state.specs, past, requires_grad=True)
        with torch.enable_grad():
            segment = run_segment(adapter, ids[c.start : c.end], c.start, past_leaves, None, c.sharding)
        outputs, output_grads = [], []
        for spec, seg_layer, grad_layer in zip(state.specs, segment, grads, strict=True):
            for s, out, grad in zip(spec, seg_layer, grad_layer, strict=True):
                if not out.requires_grad:
                    continue
                outputs.append(out)  # with a zero gradient if none reached it: every rank runs the same graph
                if grad is None:
                    output_grads.append(torch.zeros_like(out))
                else:
                    output_grads.append((grad[..., start:end, :] if s.growing else grad).to(out.device, out.dtype))
        if outputs:
            torch.autograd.backward(outputs, output_grads)
        if past_leaves is None:
            continue
        for spec, leaf_layer, grad_layer in zip(state.specs, past_leaves, grads, strict=True):
            for j, (s, leaf) in enumerate(zip(spec, leaf_layer, strict=True)):
                if not s.growing:
                    grad_layer[j] = leaf.grad
                elif leaf.grad is not None:
                    if grad_layer[j] is None:
                        shape = (*leaf.shape[:-2], state.length, leaf.shape[-1])
                        grad_layer[j] = _grad_sum_buffer(shape, leaf, on_host)
                    grad_layer[j][..., :start, :] += leaf.grad.to(grad_layer[j].device)


SCORE_CHUNK_BYTES = 64 * 2**20  # float32 logits of one row chunk in ``score`` (64 rows of a 248K vocabulary)


@dataclass(frozen=True)
class Scoring:
    """What a replay scores: ``targets`` [B * S] token ids (one per position, padding included), the sampling
    ``temperature``, and whether the entropy too."""

    targets: torch.Tensor
    temperature: float
    with_entropy: bool


def score_reference(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Plain ``score`` from the LM head's ``logits`` [T, vocab]: float32 log-softmax of all rows at once,
    differentiated by autograd (which saves [T, vocab] float32 tensors: the log-softmax and, for the entropy,
    its exp)."""
    log_probs = torch.log_softmax(logits.float() / temperature, dim=-1)
    token_log_probs = log_probs.gather(-1, targets[:, None])[:, 0]
    entropy = -(log_probs.exp() * log_probs).sum(-1) if with_entropy else None
    return token_log_probs, entropy


def _autocast_state(device: torch.device) -> tuple[bool, torch.dtype]:
    return torch.is_autocast_enabled(device.type), torch.get_autocast_dtype(device.type)


class _LinearScore(torch.autograd.Function):
    """Autograd function behind ``score``: (log-probs [T], entropy [T] or [0]) of ``hidden`` [T, H] under the
    LM head (``weight`` [vocab, H], ``bias``), a row chunk at a time. Saves ``hidden``, the head's parameters and
    ``targets``; the backward recomputes each chunk's logits and log-softmax under the forward's autocast state
    and sums the head's gradient in float32."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor,
        temperature: float,
        with_entropy: bool,
        chunk_rows: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        token_log_probs = hidden.new_empty(len(hidden), dtype=torch.float32)
        entropy = token_log_probs.new_empty(len(hidden) if with_entropy else 0)
        for start in range(0, len(hidden), chunk_rows):
            rows = slice(start, start + chunk_rows)
            log_probs = torch.log_softmax(F.linear(hidden[rows], weight, bias).float() / temperature, dim=-1)
            token_log_probs[rows] = log_probs.gather(-1, targets[rows, None])[:, 0]
            if with_entropy:
                entropy[rows] = -(log_probs.exp() * log_probs).sum(-1)
        ctx.save_for_backward(hidden, weight, bias, targets)
        ctx.temperature, ctx.chunk_rows, ctx.autocast = temperature, chunk_rows, _autocast_state(hidden.device)
        if not with_entropy:
            ctx.mark_non_differentiable(entropy)
        return token_log_probs, entropy

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad_log_probs: torch.Tensor, grad_entropy: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, bias, targets = ctx.saved_tensors
        enabled, dtype = ctx.autocast
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_weight else None
        grad_bias = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if need_bias else None
        for start in range(0, len(hidden), ctx.chunk_rows):
            rows = slice(start, start + ctx.chunk_rows)
            with torch.autocast(hidden.device.type, dtype=dtype, enabled=enabled):
                logits = F.linear(hidden[rows], weight, bias)
            log_probs = torch.log_softmax(logits.float() / ctx.temperature, dim=-1)
            probs = log_probs.exp()
            # d(log p_target)/dx = onehot - p; d(entropy)/dx = -p * (log p + entropy), x = logits / temperature
            grad = grad_log_probs[rows, None]
            if grad_entropy is not None and grad_entropy.numel():
                entropy = -(probs * log_probs).sum(-1, keepdim=True)
                grad = grad + grad_entropy[rows, None] * (log_probs + entropy)
            grad = probs.mul_(-grad).scatter_add_(-1, targets[rows, None], grad_log_probs[rows, None])
            grad_logits = grad.div_(ctx.temperature).to(logits.dtype)  # as autograd rounds it through .float()
            with torch.autocast(hidden.device.type, dtype=dtype, enabled=enabled):
                if need_hidden:
                    grad_hidden[rows] = grad_logits @ weight
                if need_weight:
                    grad_weight += (grad_logits.t() @ hidden[rows]).float()
            if need_bias:
                grad_bias += grad_logits.float().sum(0)
        return (
            grad_hidden,
            None if grad_weight is None else grad_weight.to(weight.dtype),
            None if grad_bias is None else grad_bias.to(bias.dtype),
            None, None, None, None,
        )


def score(
    hidden: torch.Tensor,
    head: torch.nn.Linear,
    targets: torch.Tensor,
    temperature: float,
    with_entropy: bool,
    chunk_rows: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs [T] (float32) of ``targets`` [T] under the LM ``head``'s logits of ``hidden`` [T, H] / temperature;
    optionally the entropy [T].

    The head and a float32 log-softmax run a row chunk at a time (``chunk_rows`` rows, default:
    ``SCORE_CHUNK_BYTES`` of float32 logits), in forward and backward (recomputed there): the graph saves
    ``hidden``, the head's parameters and ``targets``, never the [T, vocab] logits or any float32 copy of them.
    Values as ``score_reference(head(hidden), ...)``. Call it inside the head module's forward (``call_as``) so
    FSDP2 gathers and reduces the head's parameters as for an ordinary call.
    """
    chunk_rows = chunk_rows or max(1, SCORE_CHUNK_BYTES // (4 * head.out_features))
    token_log_probs, entropy = _LinearScore.apply(
        hidden, head.weight, head.bias, targets, temperature, with_entropy, chunk_rows
    )
    return token_log_probs, entropy if with_entropy else None
