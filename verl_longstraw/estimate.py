"""Pre-flight memory estimate of one walk on one rank, from a transformers config and the walk's plan alone.

``estimate_plan`` reads a plan (``plan.star_plan``, ``plan.tree_plan``: the plan the core runs, on its rank of a
context-parallel (CP) group) and predicts, in bytes; ``estimate_memory`` is its GRPO-group case (a star of a
``prompt_len``-token prompt and ``group_size`` responses, for rank ``rank`` of ``cp_size`` ranks, 1: one
process):
- ``state_bytes``: the rank's prompt state, what ``PromptState.nbytes`` measures (exact: it sums
  the adapter's own ``state_kinds``, read from a model built on the meta device, so estimate and
  state share one layout): ``Rows`` tensors for the rank's rows of the longest path (``Plan.capacity``; a star:
  about (P - 1) / R), the replicated fixed-size tensors of every segment held at once (``Plan.held``; in exact
  mode a star's every chunk boundary: ``boundary_bytes``);
- ``state_grad_bytes``: the float32 sums of the differentiable state tensors' gradients held in
  exact mode (the fixed-size ones of every segment whose sums are held at once), on the device or
  (``state_grad_on_host``) in host memory, pinned at their exact size with the buffer each gradient is staged
  through (``staging_bytes``: the largest state tensor, ``state.store.staging_nbytes``; its source on the device
  waits for the copy, ``in_flight_bytes``); ``state_leaf_grad_bytes``: the gradients in the model's dtype that one
  layer's backward hands its state leaves before they are added into the sums (exact; ``PathState.leaves`` adds
  each as it is produced, so the largest layer's);
- ``saved_peak_bytes``: the peak of tensors saved for backward (what ``SavedTensorMeter``
  counts), the larger of the largest replay step (a batch of k leaves after their parent's rows, k from the
  replay budget ``replay_tokens``; one leaf per rank under CP) and the largest recompute step (exact mode, and
  detached segments that score tokens: a captured segment after its prefix). Under CP both
  include the pass-Q attention's gathered queries of all ranks (a replay round's responses, a
  chunk's tokens), their float32 partial outputs and log-sum-exps (``pass_q_bytes``), and for
  recurrent layers' chunks the affine merge's summary run.
- ``transient_bytes``: the largest transient of any phase: pass-Q's scores of one key block, a row chunk of the
  replay's scoring, or the fused attention backward of one layer (its key blocks, flash's GQA expansion and dq
  accumulators on CUDA, its float32 query gradient; under CP also the gathered outputs and the float32
  reduce-scatter), which ``ops.attention.fused`` and ``ops.attention.cp`` count for the device kind
  ``device_type`` (``fused_backward_transient_bytes``, ``sharded_fused_backward_transient_bytes``). The peak counts
  each transient at its moment (``backward_peak_transient_bytes``, ``_Layers.peak_moment``): the scoring's
  beside every save, a layer's feed-forward backward (``FeedForward.backward_transient_bytes``) beside that
  layer's saves, its mixer's beside its saves less its feed-forward half's; checkpointed, beside that one layer's
  saves only.
- ``capture_peak_bytes``: the largest moment of a no-grad capture (``_Layers.capture_transient``: the rotary
  tables, the state rows its layers returned so far, the hidden-wide tensors of one decoder layer's feed-forward
  half, ``FeedForward.forward_live_bytes``), beside
  the state stored before it (none before the first capture's write).
``total_bytes`` is what the rank's device holds at the peak, the larger of the backward steps' peak
(``backward_bytes``) and the captures'. The backward peak is the largest moment of any backward step: its scoring, or
one layer's feed-forward or mixer backward, each with the saves held then (less ``saved_state_bytes``: the prompt
state's own buffers, which the attention saves as views and ``state_bytes`` already counts; the layers above have
freed theirs, checkpointed also their inputs), its transient and the state gradients on the device then (every sum
after the walk's first backward, during it those that exist, as ``PathState`` makes each on its layer's first
gradient; the leaf gradient of the layer handing it over; one in flight to the host) and the prompt state on the
device then (all of it; with ``state_on_host`` what the stream holds at that moment, ``streamed_moments``, at most
two layers' reads). Each layer's largest moment
(``layer_peak_bytes``, ``unscored_layer_peak_bytes``) and the scoring's (``ends_peak_bytes``) are kept, for
``gpu_table`` to pair each with the FSDP2 units held then. ``host_bytes`` is what it keeps on the host.

The estimate is composition only: the sum over the plan's steps (``Plan.steps``) and the model's layers of what each
layer's mixer op reports for that step's call (``mixers.MixerOp.saves``, ``transient_bytes``, ``score_block_bytes``
of a ``mixers.LayerCall``; the op decides its own path, e.g. ``ops.attention.prefix.attention_path``), plus the norm
before it (``feed_forward.NORM`` / 2 x hidden per token) and what its feed-forward op reports per token
(``feed_forward.FeedForward``: its half of the layer's saves, its backward transient, its no-grad forward's live
tensors and, under expert parallelism, its token exchange; calibrated against ``SavedTensorMeter`` on CPU float32
models, the least certain term; it does not grow with P; in half precision the norms' float32 copies are added,
measured from the model's own norm modules: ``mixers.base.upcast_row_bytes``), the state kinds' bytes and the
scoring's chunks. At a real model's width and length the dry run
(``verl_longstraw.dryrun``, fake CUDA tensors) is the reference it is checked against. ``adapters.adapter_on_meta``
gives the ops of a config alone. ``preflight`` turns the estimate into an early, actionable error.

This module holds the walk only (the group terms). What the model costs a training step besides it (FSDP2's
parameter, gradient and moment shards, the unsharded units, the routed experts' shards) is ``model_terms``'; the
per-GPU figures of a step, both together, are ``gpu_table``'s.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from .adapters import Adapter, adapter_on_meta
from .feed_forward import NORM, largest_exchange
from .knobs import REPLAY_TOKENS, Knobs
from .mixers import LayerCall, Saves, layer_calls, layer_needs_output
from .mixers.base import saved_row_bytes, upcast_row_bytes
from .plan import ModelCall, Plan, Recompute, Replay, star_plan
from .score import SCORE_CHUNK_BYTES, head_gradient_bytes
from .state.store import staging_nbytes

# ``score.score``: the LM head and log-softmax run a row chunk at a time; the graph saves the final hidden states
# (counted per token) and the chunk's logits, float32 log-softmax and its exp are transient: 3 float32 chunks
SCORE_TRANSIENT_CHUNKS = 3


def score_transient_bytes(vocab_size: int, rows: int, head_gradient: int = 0) -> int:
    """Bytes ``score.score`` holds at once while it scores ``rows`` rows: ``SCORE_TRANSIENT_CHUNKS`` float32
    [chunk rows, vocab] tensors, a chunk being ``SCORE_CHUNK_BYTES`` of float32 logits (fewer rows if fewer), and
    in its backward ``head_gradient`` bytes (``score.head_gradient_bytes`` where the LM head is trained, else 0)."""
    chunk_rows = max(1, SCORE_CHUNK_BYTES // (4 * vocab_size))
    return SCORE_TRANSIENT_CHUNKS * 4 * vocab_size * min(rows, chunk_rows) + head_gradient


GIB = 2**30  # bytes


@dataclass(frozen=True)
class MemoryEstimate:
    """Predicted bytes of one group on one rank of a context-parallel group of ``cp_size`` ranks (1: one process).

    ``total_bytes`` is what the rank's device holds at the peak (what a budget limits);
    ``host_bytes`` what it keeps in host memory.
    """

    state_bytes: int  # prompt state on this rank, ``boundary_bytes`` included
    boundary_bytes: int  # the fixed-size state of the held segments but one (exact mode: every chunk start but the
    # first's: a star's chunk boundaries)
    state_grad_bytes: int  # exact mode: float32 sums of the state gradients (on the host with ``state_grad_on_host``)
    state_leaf_grad_bytes: int  # exact mode: the gradients one layer's backward hands its state (model dtype)
    replay_saved_bytes: int  # saved for backward while a batch of ``replay_batch`` responses replays (pass-Q incl.)
    prompt_backward_saved_bytes: int  # saved for backward while a chunk recomputes (pass-Q included)
    pass_q_bytes: int  # of the larger of the two: the gathered queries, partial outputs and log-sum-exps (CP)
    score_block_bytes: int  # the larger of CP pass-Q's float32 scores of one key block and one row chunk of the
    # replay's scoring (``score.score``: logits, float32 log-softmax and exp)
    replay_backward_transient_bytes: int  # one fused attention layer's backward while a replay backpropagates
    prompt_backward_transient_bytes: int  # the same while a recomputed prompt chunk backpropagates (exact mode)
    chunk_tokens: int  # the longest captured segment's tokens (all ranks; a star's prompt chunk)
    cp_size: int
    state_grad_on_host: bool
    replay_batch: int = 1  # responses per replay forward (k)
    detached_total_bytes: int = 0  # ``total_bytes`` of the same walk in detached mode (its own in detached mode)
    staging_bytes: int = 0  # exact mode: the largest state gradient, which ``state_grad_on_host`` stages through a
    # pinned buffer of its size while its source on the device waits for the copy
    layer_call_tokens: int = 0  # the most tokens this rank runs through one layer in one call of the walk (a captured
    # or recomputed chunk's own rows, a replay batch's padded tokens): what one MoE layer's token exchange carries
    all_to_all_bytes: int = 0  # expert parallelism: the send and receive buffers of the largest MoE-layer call's
    # token exchange (``feed_forward.ExpertExchange.transient_bytes`` of ``layer_call_tokens``); 0 without
    saved_state_bytes: int = 0  # of the saved bytes of the backward step at the peak, the state buffers its attention
    # saves as views (``Saves.state_views``): already in ``state_bytes``, so not counted again in ``total_bytes``
    backward_state_bytes: int | None = None  # the prompt state on the device at the backward peak's moment (None:
    # ``state_bytes``); less than ``state_bytes`` where it streams from the host (``streamed_moments``)
    backward_grad_bytes: int | None = None  # the state-gradient bytes on the device at the backward peak's step
    # (None: all of them, ``device_state_grad_bytes + state_leaf_grad_bytes + in_flight_bytes``); fewer when the
    # peak is the walk's first backward, before whose end not every sum exists (``PathState`` makes each on its first
    # gradient)
    backward_peak_transient_bytes: int | None = None  # the transient of the backward moment at the peak
    # (``_Layers.peak_moment``: the scoring's or one layer's; None: ``transient_bytes``)
    backward_peak_saved_bytes: int | None = None  # the saved bytes of the backward step at the peak (None:
    # ``saved_peak_bytes``)
    capture_peak_bytes: int = 0  # device bytes at the largest moment of a no-grad capture: the state stored before
    # it, any state-gradient sums, and ``_Layers.capture_transient`` of its chunk
    state_on_host: bool = False  # the ``Rows`` state in host memory, streamed a layer at a time (``state.stream``)
    host_state_bytes: int = 0  # with ``state_on_host``: the ``Rows`` state kept in host memory (``state_bytes`` then
    # counts its resident window on the device)
    streamed_total_bytes: int = 0  # ``total_bytes`` of the same walk with ``state_on_host`` (its own with the knob)
    streamed_host_state_bytes: int = 0  # ``host_state_bytes`` of the same walk with ``state_on_host`` (its own with
    # the knob): what the knob keeps, or would keep, in host memory
    layer_peak_bytes: tuple[int, ...] = ()  # per decoder layer: device bytes at the largest moment inside it of a
    # backward step that scores (the state, the gradients, the saves and the transient held then): what ``gpu_table``
    # pairs with the FSDP2 units held at that layer (``model_terms.unsharded_moments``); () without a backward step
    unscored_layer_peak_bytes: tuple[int, ...] = ()  # the same of the backward steps that do not score (a recompute)
    ends_peak_bytes: int = 0  # the same at a backward step's scoring or between two steps (the input embedding's)

    @property
    def saved_peak_bytes(self) -> int:
        return max(self.replay_saved_bytes, self.prompt_backward_saved_bytes)

    @property
    def device_state_grad_bytes(self) -> int:
        return 0 if self.state_grad_on_host else self.state_grad_bytes

    @property
    def in_flight_bytes(self) -> int:
        """With ``state_grad_on_host``: the state gradient on the device whose copy to the host is in flight while the
        next layer's backward runs (``state.host.StagedCopies``); else 0."""
        return self.staging_bytes if self.state_grad_on_host else 0

    @property
    def transient_bytes(self) -> int:
        """The largest transient: pass-Q's score block, a scoring chunk, a fused attention layer's backward or an MoE
        layer's all-to-all buffers (they happen at different moments, so the largest counts)."""
        return max(self.score_block_bytes, self.replay_backward_transient_bytes, self.prompt_backward_transient_bytes,
                   self.all_to_all_bytes)

    @property
    def backward_bytes(self) -> int:
        """Device bytes at the peak of the backward steps (replays and recomputes): the prompt state held then
        (``backward_state_bytes``), the state-gradient bytes held then (``backward_grad_bytes``), the saved bytes of
        that step less the state buffers it saves as views (``saved_state_bytes``, counted in the state), and the
        transient of that step's largest moment (``backward_peak_transient_bytes``; where not given, the largest of
        any phase, ``transient_bytes``)."""
        grads = self.backward_grad_bytes
        if grads is None:
            grads = self.device_state_grad_bytes + self.state_leaf_grad_bytes + self.in_flight_bytes
        saved = self.saved_peak_bytes if self.backward_peak_saved_bytes is None else self.backward_peak_saved_bytes
        transient = self.transient_bytes if self.backward_peak_transient_bytes is None else (
            self.backward_peak_transient_bytes)
        state = self.state_bytes if self.backward_state_bytes is None else self.backward_state_bytes
        return state + grads + saved - self.saved_state_bytes + transient

    @property
    def total_bytes(self) -> int:
        """Device bytes at the peak: the larger of the backward steps' peak (``backward_bytes``) and the no-grad
        captures' (``capture_peak_bytes``); they happen at different moments."""
        return max(self.backward_bytes, self.capture_peak_bytes)

    @property
    def host_bytes(self) -> int:
        """Pinned host bytes: the state-gradient sums and their staging buffer (``state_grad_on_host``), the
        streamed state rows (``state_on_host``)."""
        grads = self.state_grad_bytes + self.staging_bytes if self.state_grad_on_host else 0
        return grads + self.host_state_bytes


class MomentGrads(NamedTuple):
    """The state-gradient bytes on the device at each moment of one backward step (``_Layers.peak_moment``): while
    it scores, while layer j's feed-forward half backpropagates (``feed_forward[j]``) and while its mixer does and
    hands its state its gradient (``mixer[j]``)."""

    scoring: int
    feed_forward: list[int]
    mixer: list[int]


class MomentStates(NamedTuple):
    """The prompt state on the device at each moment of a backward step (bytes): while it scores (``scoring``) and
    while layer j backpropagates, both halves (``layers[j]``). The whole state at every moment, unless it streams
    from the host (``streamed_moments``)."""

    scoring: int
    layers: list[int]


class Moment(NamedTuple):
    """One moment of a backward step against the step's saved figure (``_Layers.saved``): the saves freed or not
    yet made by then (``freed``), the transient beside them, the state gradients and the prompt state on the device
    (bytes)."""

    freed: int
    transient: int
    grads: int
    state: int

    @property
    def extra(self) -> int:
        """What the moment holds beyond the step's saved figure (negative: less)."""
        return self.transient + self.grads + self.state - self.freed


class _Layers:
    """A model's decoder layers as the estimate reads them: each layer's mixer op (``Adapter.ops``: its state, saves
    and transients), feed-forward op (``Adapter.feed_forwards``: its saves and transients per token) and the hidden
    width, in a model of ``dtype`` on a ``device_type`` device. A layer saves its input norm's and residual's
    ``NORM`` / 2 x hidden per token, its mixer op's saves, and where its output is used its feed-forward op's."""

    def __init__(self, config, dtype: torch.dtype, adapter: Adapter, device_type: str):
        self.ops = adapter.ops
        self.feed_forwards = adapter.feed_forwards
        self.hidden, self.dtype, self.device_type = config.hidden_size, dtype, device_type
        self.act = dtype.itemsize
        # per layer and token, the half-precision excess of its norms' saves (``upcast_row_bytes``): the norm
        # before the mixer; those after it (the feed-forward half's, with the layer's output used)
        self.mixer_upcasts = [upcast_row_bytes(adapter.layer_norms(idx, False)[0], self.hidden, dtype)
                              for idx in range(len(self.ops))]
        self.feed_forward_upcasts = [sum(upcast_row_bytes(norm, self.hidden, dtype)
                                         for norm in adapter.layer_norms(idx, True)[1:])
                                     for idx in range(len(self.ops))]
        # the rotary tables' width (``Adapter.context``: cos and sin [tokens, rotary dim]); 0 without a rotary module
        rotary = getattr(adapter.backbone, "rotary_emb", None)
        inv_freq = getattr(rotary, "inv_freq", None)
        self.rotary_dim = 2 * inv_freq.shape[-1] if inv_freq is not None else 0

    def calls(self, call: ModelCall) -> list[LayerCall]:
        """Each layer's ``LayerCall`` of a step's model call (``Step.call``: ``mixers.layer_calls``)."""
        return layer_calls(call, len(self.ops), self.dtype, self.device_type)

    def layer_saves(self, idx: int, call: LayerCall) -> Saves:
        """Layer ``idx``'s saves of ``call``: its mixer op's, its input norm's and its feed-forward half's
        (``feed_forward_saves``). A layer without state whose output is not needed does not run."""
        op = self.ops[idx]
        if not call.need_output and not op.kinds:
            return Saves(0)
        mixer = op.saves(call)
        own = call.batch * call.tokens * (NORM / 2 * self.hidden * self.act + self.mixer_upcasts[idx])
        return mixer._replace(own=int(mixer.own + own + self.feed_forward_saves(idx, call)))

    def feed_forward_saves(self, idx: int, call: LayerCall) -> int:
        """Of layer ``idx``'s saves in ``call``, its feed-forward half's (none without ``need_output``): its op's
        (``FeedForward.saved_bytes_per_token``) and its norms' half-precision copies per token. A layer's backward
        runs this half first, so these are freed before its mixer's backward runs."""
        if not call.need_output:
            return 0
        per_token = self.feed_forwards[idx].saved_bytes_per_token(self.dtype) + self.feed_forward_upcasts[idx]
        return int(call.batch * call.tokens * per_token)

    def saved(self, calls: Sequence[LayerCall], checkpointed: bool) -> tuple[int, int, int, list[int]]:
        """(saved bytes, of which pass-Q's gathered, of which views of the state, each layer's saves less its views)
        of one step's ``calls``. Buffers shared by the layers (a mask) count once per size. ``checkpointed``: every
        layer keeps only its input hidden state and the backward recomputes one layer at a time, so the step holds
        the inputs plus the largest layer's saves (its views of the state taken out)."""
        saves = [self.layer_saves(idx, call) for idx, call in enumerate(calls)]
        per_layer = [s.own + s.gathered + s.shared - s.state_views for s in saves]
        if checkpointed:
            largest = max(saves, key=lambda s: (s.own + s.gathered + s.shared - s.state_views, s.gathered))
            inputs = sum(self.checkpoint_inputs(calls))
            return (inputs + largest.own + largest.gathered + largest.shared, largest.gathered, largest.state_views,
                    per_layer)
        gathered = sum(s.gathered for s in saves)
        total = sum(s.own for s in saves) + gathered + sum({s.shared for s in saves if s.shared})
        return total, gathered, sum(s.state_views for s in saves), per_layer

    def checkpoint_inputs(self, calls: Sequence[LayerCall]) -> list[int]:
        """Each layer's input hidden state in ``calls`` ([tokens, hidden], model dtype): what a checkpointed layer
        keeps from its forward until its backward has run."""
        return [call.batch * call.tokens * self.hidden * self.act for call in calls]

    def transient(self, calls: Sequence[LayerCall]) -> int:
        """The largest backward transient of any layer's op in the step (``MixerOp.transient_bytes``)."""
        return max((op.transient_bytes(call) for op, call in zip(self.ops, calls, strict=True)), default=0)

    def moments(self, calls: Sequence[LayerCall], held: Sequence[int], checkpointed: bool, score: int,
                grads: MomentGrads, states: MomentStates) -> tuple[Moment, list[Moment]]:
        """The step's scoring moment and each layer's largest moment, against the step's saved figure (``saved``).
        The backward runs the scoring first (its transient ``score`` beside every save), then the layers from the
        last: layer j's feed-forward half (its backward, ``FeedForward.backward_transient_bytes``, beside all of
        layer j's saves), then its mixer (``MixerOp.transient_bytes`` or ``score_block_bytes``, beside layer j's
        saves less its feed-forward half's, ``feed_forward_saves``). Layers above j have freed their saves by then;
        checkpointed, no layer but j holds saves (the saved figure counts the largest layer's) and the layers above
        j have freed their inputs (``checkpoint_inputs``). ``held``: each layer's saves less its state views
        (``saved``'s per-layer figures); ``grads``, ``states``: the state gradients and the prompt state on the
        device at each of those moments."""
        base = max(held) if checkpointed else sum(held)
        scoring = Moment(max(held) if checkpointed else 0, score, grads.scoring, states.scoring)
        inputs = self.checkpoint_inputs(calls) if checkpointed else [0] * len(calls)
        layers = []
        for idx, (op, feed_forward, call) in enumerate(zip(self.ops, self.feed_forwards, calls, strict=True)):
            # the saves held at layer j's moments besides its own (none checkpointed), less the inputs freed
            below = sum(held[:idx]) * (not checkpointed) - sum(inputs[idx + 1:])
            ff_backward = int(call.need_output) * feed_forward.backward_transient_bytes(call.batch * call.tokens,
                                                                                         self.dtype)
            mixer = max(op.transient_bytes(call), op.score_block_bytes(call))
            ff_held = below + held[idx]
            layers.append(max(Moment(base - ff_held, ff_backward, grads.feed_forward[idx], states.layers[idx]),
                              Moment(base - ff_held + self.feed_forward_saves(idx, call), mixer, grads.mixer[idx],
                                     states.layers[idx]),
                              key=lambda moment: moment.extra))
        return scoring, layers

    def score_block(self, calls: Sequence[LayerCall]) -> int:
        """The largest score block of any layer's op in the step (``MixerOp.score_block_bytes``)."""
        return max((op.score_block_bytes(call) for op, call in zip(self.ops, calls, strict=True)), default=0)

    def capture_mixer_transient(self, calls: Sequence[LayerCall], state_rows: Sequence[int]) -> int:
        """The largest moment of a no-grad capture's token mixers besides the stored state: while layer j's mixer
        runs, the segment state of layers 0..j (``state_rows``: bytes per layer), the layer's input and its norm's
        output ([tokens, hidden] each, model dtype) and the op's no-grad forward transient
        (``MixerOp.forward_transient_bytes``)."""
        largest = 0
        for idx, (op, call) in enumerate(zip(self.ops, calls, strict=True)):
            if not call.need_output and not op.kinds:
                continue
            inputs = 2 * call.batch * call.tokens * self.hidden * self.act
            largest = max(largest, sum(state_rows[: idx + 1]) + inputs + op.forward_transient_bytes(call))
        return largest

    def capture_transient(self, tokens: int, last_layer_stops: bool, state_rows: Sequence[int]) -> int:
        """Bytes a no-grad capture of ``tokens`` (``execute._Walk._capture``: ``run_segment`` under
        ``torch.no_grad``) holds at its largest moment besides the stored state, counted from what ``run_segment``
        and ``Adapter.layer`` keep alive: the rotary tables (cos and sin, [tokens, rotary dim] each, model dtype),
        the segment state every layer run so far returned (``state_rows``: its bytes per layer; the store copies
        them only after the forward), and inside one decoder layer's feed-forward half, which holds the most
        hidden-wide tensors (``FeedForward.forward_live_bytes``). Nothing is saved for backward. The last layer of an
        unscored segment runs no feed-forward (``run_segment``'s ``need_output``). The token mixers' moments are
        ``capture_mixer_transient``'s."""
        rotary = 2 * self.rotary_dim * tokens * self.act
        largest = 0
        for idx, feed_forward in enumerate(self.feed_forwards):
            if not layer_needs_output(idx, len(self.ops), not last_layer_stops):
                continue
            live = feed_forward.forward_live_bytes(tokens, self.dtype)
            largest = max(largest, sum(state_rows[: idx + 1]) + live)
        return rotary + largest


def estimate_memory(
    config,
    prompt_len: int,
    group_size: int,
    response_len: int,
    chunk_size: int | None = None,
    prompt_grad: str = "exact",
    dtype: torch.dtype = torch.bfloat16,
    adapter: Adapter | None = None,
    cp_size: int = 1,
    state_grad_on_host: bool = False,
    rank: int = 0,
    checkpointed: bool = False,
    replay_tokens: int = REPLAY_TOKENS,
    device_type: str = "cuda",
    expert_parallel: bool = False,
    response_chunk_size: int | None = None,
    state_on_host: bool = False,
) -> MemoryEstimate:
    """Predicted memory of ``group_backward`` on rank ``rank`` of ``cp_size`` ranks (``cp_group``; 1: one process)
    for a prompt of ``prompt_len`` tokens and ``group_size`` responses of at most ``response_len`` tokens.

    One process replays k = max(1, min(G, ``replay_tokens`` // ``response_len``)) responses per forward (the
    replay's saved-for-backward peak and logits are those of k responses of ``response_len``; k = 1 gives the
    one-response figures); under CP one response per rank per round. Beyond k, G only scales time.

    The rank's rows come from the plan the core runs (``plan.star_plan``). Rank 0
    holds the most rows (ranks differ by at most one row per chunk), so its figures bound every
    rank's: every rank computes them from the same arguments and reaches the same verdict.
    ``state_grad_on_host``: the state-gradient sums live in host memory (``group_backward``'s flag).
    ``adapter``: the model's adapter when a model is at hand (its state kinds and token mixers are what the
    estimate reads); None builds one from ``config`` on the meta device (``adapters.adapter_on_meta``).

    ``checkpointed``: per-decoder-layer activation checkpointing, which veRL turns on with
    ``actor_rollout_ref.model.enable_gradient_checkpointing`` (non-reentrant) and the adapters honour in
    replay and prompt recompute (``adapters.base.call_as``). Only the saved-for-backward terms change: a
    segment (a replayed response, a recomputed chunk) keeps each layer's input hidden state (tokens x hidden
    x dtype bytes per layer) and its backward recomputes one layer at a time, so the peak adds the largest
    single layer's saves (pass-Q's gathered queries included); the lm_head's logits are outside the layers.
    Not calibrated: ``SavedTensorMeter`` cannot see inside a checkpointed layer (checkpointing installs its
    own saved-tensor hooks) and no GPU measurement of it exists yet. Like the plain estimate it leaves out a
    layer's forward/backward transients, a larger share when one layer's saves are held: a one-off CPU count
    of every live storage (tiny float32 models of 8 layers, exact, chunked) peaked at 1.2x (qwen3) to 2.9x
    (qwen3_5) the checkpointed total, and at 1.0-1.4x the plain one.

    ``device_type``: the device kind whose kernels the fused attention backward's transients are counted for
    (``transient_bytes``; CUDA's flash kernels expand grouped K/V gradients and accumulate dq in float32, the CPU
    kernel computes half inputs in float32).

    ``expert_parallel``: the model's routed experts are split over the CP group (``parallel.experts``); the
    largest MoE-layer call's all-to-all buffers count as a transient (``all_to_all_bytes``).
    ``response_chunk_size``: the knob (``Knobs``): longer responses replay as chains of segments this long.
    ``state_on_host``: the knob: the ``Rows`` state in host memory (``host_state_bytes``), on the device its
    resident window (two layers' rows) in ``state_bytes``.
    """
    if not 0 <= rank < cp_size:
        raise ValueError(f"rank={rank} must be one of the cp_size={cp_size} ranks: 0 <= rank < cp_size")
    knobs = Knobs(chunk_size=chunk_size, response_chunk_size=response_chunk_size, replay_tokens=replay_tokens)
    plan = star_plan(prompt_len, [response_len] * group_size, knobs, cp_size, rank)
    return estimate_plan(config, plan, prompt_grad, dtype, adapter, state_grad_on_host, checkpointed, device_type,
                         expert_parallel, state_on_host)


def layer_reads(specs: list[tuple], rows: int, dtype: torch.dtype) -> list[int]:
    """Per layer, the bytes of the state a segment reads of a path of ``rows`` rows (its rows and one segment's
    fixed-size values): what ``state_on_host`` brings to the device for that layer (``state.stream``)."""
    return [sum(s.path_nbytes(rows, 1, dtype) for s in layer) for layer in specs]


def streamed_window(reads: Sequence[int]) -> int:
    """The most streamed state on the device at once, whatever the moment: the two largest ``layer_reads`` (the
    layer running and the next one's copy)."""
    return sum(sorted(reads, reverse=True)[:2])


def streamed_moments(reads: Sequence[int], checkpointed: bool) -> MomentStates:
    """The streamed state (``state_on_host``) on the device at each moment of a backward step, from each layer's
    ``layer_reads``. Checkpointed, the backward recomputes the layers from the top down and each recompute brings
    its layer's state over and issues the copy of the streamed layer below, dropping the others
    (``StreamedPath._take``): at layer j's moments the lowest streamed layer at or above j (the last one read) and
    the streamed layer below it are on the device. The scoring, after a forward whose layers each held their own
    state and the next one's, and without checkpointing every moment (a layer whose backward saves no view of its
    copy leaves the last two read in place): the window, ``streamed_window``."""
    window = streamed_window(reads)
    if not checkpointed:
        return MomentStates(window, [window] * len(reads))
    streamed = [idx for idx, read in enumerate(reads) if read]
    layers = []
    for idx in range(len(reads)):
        read_last = next((at for at, layer in enumerate(streamed) if layer >= idx), None)
        held = [] if read_last is None else streamed[max(read_last - 1, 0):read_last + 1]
        layers.append(sum(reads[layer] for layer in held))
    return MomentStates(window, layers)


def estimate_plan(
    config,
    plan: Plan,
    mode: str = "exact",
    dtype: torch.dtype = torch.bfloat16,
    adapter: Adapter | None = None,
    state_grad_on_host: bool = False,
    checkpointed: bool = False,
    device_type: str = "cuda",
    expert_parallel: bool = False,
    state_on_host: bool = False,
) -> MemoryEstimate:
    """Predicted memory of a training walk of ``plan`` (a star, a chain, a prefix tree: ``plan.star_plan``,
    ``plan.tree_plan``) computing ``mode`` ("exact" or "detached") on its rank (``plan.rank`` of ``plan.world``).

    Every figure is read off the plan's own steps (``Plan.steps``): the state of the segments held at once
    (``Plan.held``: a ``Rows`` buffer of ``plan.capacity`` rows and each held segment's fixed-size state) and
    their gradient sums, the saved-for-backward peak of the largest replay (a batch of leaves after their
    parent's rows) and of the largest recompute (a captured segment after its prefix), and the transients of
    those steps and of the captures; ``detached_total_bytes`` prices the same plan's detached walk alike.
    ``dtype`` ... ``expert_parallel``, ``state_on_host``: as ``estimate_memory``.
    """
    if mode not in ("exact", "detached"):
        raise ValueError(f"mode must be 'exact' or 'detached' (a training walk), got {mode!r}")
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    adapter = adapter if adapter is not None else adapter_on_meta(config)
    # the walk of ``mode`` and the detached one (the same walk in detached mode), each priced from its own steps
    walks = {walk: _walk_estimate(config, plan, walk, dtype, adapter, state_grad_on_host, checkpointed, device_type,
                                  expert_parallel, state_on_host) for walk in dict.fromkeys((mode, "detached"))}
    return dataclasses.replace(walks[mode], detached_total_bytes=walks["detached"].total_bytes)


class _BackwardPeak:
    """A walk's backward steps (replays, recomputes) priced in order (``add``), keeping the one whose largest moment
    holds the most: its saved bytes (``saved``), the state buffers among them (``views``), the state-gradient bytes
    held then (``grads``) and its transient (``transient``); None before any. ``layer_sums``: each layer's
    state-gradient sums on the device; ``layer_leaf_grads``: the gradient each layer's backward hands its state
    leaves; ``in_flight``: a gradient on its way to the host sums; ``exchange_per_token``: the MoE token exchange's
    transient per token a layer call runs; ``states``: the prompt state on the device at each moment of a step (the
    prompt state held at the peak: ``state``)."""

    def __init__(self, layers: _Layers, checkpointed: bool, layer_sums: Sequence[int], layer_leaf_grads: Sequence[int],
                 in_flight: int, exchange_per_token: int, states: MomentStates):
        self.layers, self.checkpointed = layers, checkpointed
        self.layer_sums, self.layer_leaf_grads, self.in_flight = layer_sums, layer_leaf_grads, in_flight
        self.exchange_per_token, self.states = exchange_per_token, states
        self.moment = self.saved = self.views = self.grads = self.transient = self.state = None
        # per layer, of the steps that do not score and of those that do: the most bytes at its moments
        self.layer_moments = ([0] * len(layer_sums), [0] * len(layer_sums))
        self.ends_moment = 0  # the same at a scoring moment or between two steps (the input embedding's backward)
        self.seen = False  # a backward step has run

    def moment_grads(self) -> MomentGrads:
        """The state gradients on the device at each moment of the next backward step. A layer's leaf gradient
        exists while its mixer backpropagates and hands it over (``PathState.leaves`` adds it into the sum and lets it
        go), the copy of the last one handed may be in flight (``in_flight``) from then on. After the walk's first
        backward every sum exists; during it, those of the layers whose backward has run (``PathState`` makes each on
        its layer's first gradient), the one of the layer handing its gradient included."""
        count, flight = len(self.layer_sums), self.in_flight
        if self.seen:
            sums = sum(self.layer_sums)
            return MomentGrads(sums + flight, [sums + flight] * count,
                               [sums + leaf + flight for leaf in self.layer_leaf_grads])
        feed_forward, mixer, above, handed = [0] * count, [0] * count, 0, False
        for j in reversed(range(count)):
            feed_forward[j] = above + (flight if handed else 0)
            handed = handed or self.layer_leaf_grads[j] > 0
            mixer[j] = above + self.layer_sums[j] + self.layer_leaf_grads[j] + (flight if handed else 0)
            above += self.layer_sums[j]
        return MomentGrads(0, feed_forward, mixer)

    def add(self, calls: Sequence[LayerCall], extra: int, score: int, tokens: int, scores: bool,
            step_grads: int = 0) -> tuple[int, int]:
        """Counts a backward step of ``calls`` (``extra``: the final hidden states its scoring saves; ``score``: its
        scoring's transient; ``tokens``: what one layer call runs on this rank, whose MoE token exchange under
        expert parallelism is a transient of any layer's moment; ``scores``: it scores tokens, so the lm_head
        backpropagates before its layers; ``step_grads``: gradients the step hands its outputs, held at every moment
        of its backward) toward the peak; returns its (saved bytes, of which pass-Q)."""
        saved, pass_q, views, per_layer = self.layers.saved(calls, self.checkpointed)
        saved += extra
        held_grads = self.moment_grads()
        held_grads = MomentGrads(held_grads.scoring + step_grads, [g + step_grads for g in held_grads.feed_forward],
                                 [g + step_grads for g in held_grads.mixer])
        scoring, layers = self.layers.moments(calls, per_layer, self.checkpointed, score, held_grads, self.states)
        exchange = tokens * self.exchange_per_token  # an MoE layer's token exchange, at any layer's moment

        def held(moment: Moment, transient: int) -> int:
            return saved - moment.freed - views + moment.grads + moment.state + transient

        layer_moments = self.layer_moments[scores]
        for idx, moment in enumerate(layers):
            layer_moments[idx] = max(layer_moments[idx], held(moment, max(moment.transient, exchange)))
        self.seen = True
        self.ends_moment = max(self.ends_moment, held(scoring, scoring.transient),
                               self.moment_grads().scoring + self.states.scoring)
        peak = max([scoring, *layers], key=lambda moment: moment.extra)
        transient = max(peak.transient, exchange)
        if self.moment is None or held(peak, transient) > self.moment:
            self.moment, self.saved, self.views = held(peak, transient), saved - peak.freed, views
            self.grads, self.transient, self.state = peak.grads, transient, peak.state
        return saved, pass_q


def _walk_estimate(config, plan: Plan, mode: str, dtype: torch.dtype, adapter: Adapter, state_grad_on_host: bool,
                   checkpointed: bool, device_type: str, expert_parallel: bool, state_on_host: bool) -> MemoryEstimate:
    """``estimate_plan``'s figures of one walk (a text ``config``, an ``adapter``), priced from its steps in order;
    ``detached_total_bytes`` left 0."""
    specs = adapter.specs()
    layers = _Layers(config, dtype, adapter, device_type)
    rows = plan.capacity
    # the MoE token exchange's transient per token a layer call runs (``Moe.exchange``: linear in the tokens)
    exchange_per_token = largest_exchange(adapter.feed_forwards, 1, dtype).transient_bytes if expert_parallel else 0
    states_held, grads_held = plan.held(mode)
    kinds = [s for layer in specs for s in layer]
    state = sum(s.path_nbytes(rows, states_held, dtype) for s in kinds) if states_held else 0
    # the held segments' state besides one segment's (a Rows buffer is one whatever the segments)
    boundaries = state - sum(s.path_nbytes(rows, 1, dtype) for s in kinds) if states_held else 0
    # the same state with ``state_on_host``: all of it in host memory; on the device what each layer reads, at most
    # the window of two layers
    reads = layer_reads(specs, rows, dtype) if states_held else [0] * len(specs)
    streamed_state, streamed_host_state = streamed_window(reads), state
    host_state = 0
    resident_states = MomentStates(state, [state] * len(specs))
    if state_on_host:
        state, host_state = streamed_state, streamed_host_state
    state_grad = leaf_grad = staging = 0
    if mode == "exact" and grads_held:
        grad_dtype = torch.promote_types(dtype, torch.float32)
        state_grad = sum(s.path_nbytes(rows, grads_held, grad_dtype) for s in kinds if s.differentiable)
        staging = staging_nbytes(specs, rows, dtype)
        leaf_grad = max(sum(s.nbytes(rows, dtype) for s in layer if s.differentiable) for layer in specs)

    # per layer: its state-gradient sums on the device and the gradient its backward hands its state leaves
    layer_sums = [0] * len(specs)
    layer_leaf_grads = [0] * len(specs)
    if mode == "exact" and grads_held:
        layer_sums = [0 if state_grad_on_host else sum(s.path_nbytes(rows, grads_held, grad_dtype)
                                                       for s in layer if s.differentiable) for layer in specs]
        layer_leaf_grads = [sum(s.nbytes(rows, dtype) for s in layer if s.differentiable) for layer in specs]
    in_flight = staging if state_grad_on_host else 0
    # the backward steps priced with the prompt state where the walk keeps it, and (unless that is the host already)
    # with it streamed from the host
    streamed_peak = _BackwardPeak(layers, checkpointed, layer_sums, layer_leaf_grads, in_flight, exchange_per_token,
                                  streamed_moments(reads, checkpointed))
    peak = streamed_peak if state_on_host else _BackwardPeak(layers, checkpointed, layer_sums, layer_leaf_grads,
                                                             in_flight, exchange_per_token, resident_states)
    # per token a scored step saves the final norm's output, which ``score`` saves, and the norm's own saves
    final_norm = getattr(adapter.backbone, adapter.final_norm)
    hidden_bytes = config.hidden_size * layers.act + saved_row_bytes(final_norm, config.hidden_size, dtype)
    head = adapter.lm_head.weight  # its gradient's float32 sum exists while a backward scores (a trained head)
    head_gradient = head_gradient_bytes(head.shape[0], head.shape[1], dtype) if head.requires_grad else 0
    # per backward step type: the largest saved bytes (of which pass-Q) and backward transient of its steps
    saved_most = {Replay: (0, 0), Recompute: (0, 0)}
    transient_most = {Replay: 0, Recompute: 0}
    score_block = capture_peak = streamed_capture_peak = call_tokens = 0
    batch_most, written = 1, False
    for step in plan.steps(mode):
        if step.call is None:
            continue
        calls = layers.calls(step.call)
        # what one layer call runs on this rank: a batch padded to its longest (a CP dummy: 1 token), this rank's part
        # of a captured segment
        batch, tokens = step.call.batch, step.call.batch * step.call.tokens
        scores = step.call.scored is not None
        scoring = 0
        if scores:  # a capture runs no backward: its scoring holds no head gradient
            scoring = score_transient_bytes(config.vocab_size, tokens, head_gradient if step.differentiable else 0)
        score_block = max(score_block, scoring, layers.score_block(calls))
        batch_most, call_tokens = max(batch_most, batch), max(call_tokens, tokens)
        if step.differentiable:
            # a recompute's own new state rows take the state gradient, so the walk holds them through the backward
            # (``execute._Walk._recompute``); checkpointed, no layer's saves hold them besides. The gradients it
            # hands them (exact: the sums' rows in the model dtype on the device; detached under CP zeros, so every
            # rank runs one graph) are held beside them until the backward returns.
            own_state = own_grads = 0
            if step.keeps_own_state:
                rows = sum(s.nbytes(tokens, dtype) for layer in specs for s in layer)
                # exact: the float32 sums' rows, a copy where they are on the host or of another dtype (else views)
                copied = mode == "exact" and (state_grad_on_host or torch.promote_types(dtype, torch.float32) != dtype)
                own_state, own_grads = rows * checkpointed, rows * (copied or (mode != "exact" and plan.world > 1))
            step_saves = (calls, int(tokens * hidden_bytes if scores else 0) + own_state, scoring, tokens, scores,
                          own_grads)
            saved, pass_q = peak.add(*step_saves)
            if streamed_peak is not peak:
                streamed_peak.add(*step_saves)
            if saved > saved_most[type(step)][0]:
                saved_most[type(step)] = (saved, pass_q)
            transient_most[type(step)] = max(transient_most[type(step)], layers.transient(calls))
        else:  # a capture, no grad: the state stored before it, any sums, the forward's transient (the feed-forward
            # half's or a mixer's beside the state rows returned so far)
            own_rows = [sum(s.nbytes(tokens, dtype) for s in layer) for layer in specs]
            sums = sum(layer_sums) if peak.seen else 0
            transient = max(layers.capture_transient(tokens, not scores, own_rows),
                            layers.capture_mixer_transient(calls, own_rows))
            capture_peak = max(capture_peak, (state if written else 0) + sums + transient)
            streamed_capture_peak = max(streamed_capture_peak, (streamed_state if written else 0) + sums + transient)
            written = True
    (replay, replay_pass_q), (backward, backward_pass_q) = saved_most[Replay], saved_most[Recompute]
    captured = [plan.segments[i].length for i in plan.captured]
    estimate = MemoryEstimate(
        state_bytes=state,
        boundary_bytes=boundaries,
        state_grad_bytes=state_grad,
        state_leaf_grad_bytes=leaf_grad,
        replay_saved_bytes=replay,
        prompt_backward_saved_bytes=backward,
        pass_q_bytes=backward_pass_q if backward >= replay else replay_pass_q,
        score_block_bytes=score_block,
        replay_backward_transient_bytes=transient_most[Replay],
        prompt_backward_transient_bytes=transient_most[Recompute],
        chunk_tokens=max(captured, default=0),
        cp_size=plan.world,
        state_grad_on_host=state_grad_on_host,
        replay_batch=batch_most,
        staging_bytes=staging,
        layer_call_tokens=call_tokens,
        all_to_all_bytes=call_tokens * exchange_per_token,
        saved_state_bytes=peak.views or 0,
        backward_grad_bytes=peak.grads,
        backward_state_bytes=peak.state,
        backward_peak_saved_bytes=peak.saved,
        backward_peak_transient_bytes=peak.transient,
        capture_peak_bytes=capture_peak,
        state_on_host=state_on_host,
        host_state_bytes=host_state,
        streamed_host_state_bytes=streamed_host_state,
        layer_peak_bytes=tuple(peak.layer_moments[True]) if peak.seen else (),
        unscored_layer_peak_bytes=tuple(peak.layer_moments[False]) if peak.seen else (),
        ends_peak_bytes=peak.ends_moment if peak.seen else 0,
    )
    streamed_backward = streamed_peak.moment if streamed_peak.seen else 0
    return dataclasses.replace(estimate, streamed_total_bytes=max(streamed_backward, streamed_capture_peak))
