"""The interface every layer's token mixer implements (``MixerOp``), and what its forward and its costs read.

A mixer op is bound to one decoder layer's module. It owns, for that layer:
- its state: ``kinds`` (``state.kinds``: layout, gradient, bytes, empty value of each state tensor);
- its forward against the path state, ``forward(x, ctx, past, need_output)``, in one process and on a
  context-parallel (CP) group (``context_parallel`` says whether it has a CP form);
- its costs for one call of a plan step (``LayerCall``): the bytes it saves for backward (``saves``), its
  transients (``transient_bytes``, ``score_block_bytes``), its collectives under CP (``collective_bytes``) and its
  forward FLOPs (``flops``).
The memory estimate sums these over a plan's steps and the layers (``estimate``); nothing else decides a layer's
kind. ``ATTENTION_SAVES`` and friends are the per-token coefficients of the projections around the ops, calibrated
against ``memory.SavedTensorMeter`` on CPU.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from ..parallel import comm
from ..plan import ModelCall, Split
from ..state import LayerState, StateKind

if TYPE_CHECKING:
    from .causal_conv import CausalConv


@dataclass
class SegmentContext:
    """What every layer of one segment shares: rotary tables of its positions, how the segment is split
    over a context-parallel group (``split``, the plan's, and ``group``; None: one process), scratch for the
    ops (e.g. DSA's selection, shared by the layers after an indexer layer), and the path state the layers read
    (``past``), for an op that reads a layer's state again after that layer ran (DSA's selection made again)."""

    cos: torch.Tensor  # [S, rotary_dim]: the segment's S tokens
    sin: torch.Tensor
    split: Split | None = None
    group: comm.Group = None
    scratch: dict[str, Any] = field(default_factory=dict)
    past: Sequence[LayerState] | None = None  # ``past[l]``: layer l's state (``execute.run_segment`` sets it); a
    # ``state.stream.StreamedPath`` copies layer l's host rows to the device again at each read

    @property
    def splits_sequence(self) -> bool:
        """Whether this rank's tokens continue another rank's (a capture or recompute chunk under CP)."""
        return self.split is not None and self.split.consecutive


class LayerCall(NamedTuple):
    """One layer's call in one step of a plan on one rank, by shape: what every op's cost reads.

    ``batch`` sequences of ``tokens`` each on this rank (right-padded replays after one shared batch-1 prefix;
    1 for a prompt chunk) after ``prefix`` state rows of this rank, read from buffers of ``state_len`` rows;
    ``need_output``: the layer's output is used (False: the last layer of a segment that scores nothing, whose
    state is all that is needed); ``sizes``: every rank's tokens of the call (this rank's at ``rank``), ``cp_size``
    the ranks whose state the call reads (1: one process, or a CP round whose ranks hold no prompt rows);
    ``consecutive``: the ranks' tokens continue one another (a prompt chunk under CP); inputs of ``dtype`` on a
    ``device_type`` device ("cuda", "cpu"); ``group_prefix``: the prefix rows of every rank the call's state is
    split over, summed (``prefix`` in one process)."""

    batch: int
    tokens: int
    prefix: int
    state_len: int
    need_output: bool
    sizes: tuple[int, ...]
    rank: int
    cp_size: int
    consecutive: bool
    dtype: torch.dtype
    device_type: str
    group_prefix: int

    @property
    def queries(self) -> int:
        """Tokens of all ranks (CP pass-Q gathers them): ``sum(sizes)``."""
        return sum(self.sizes)

    @property
    def act(self) -> int:
        """Bytes of one element in the model dtype."""
        return self.dtype.itemsize

    @property
    def compute(self) -> torch.dtype:
        """The dtype of the ops' arithmetic (at least float32)."""
        return torch.promote_types(self.dtype, torch.float32)


class Saves(NamedTuple):
    """Bytes one layer's mixer saves for backward in one call (``MixerOp.saves``).

    ``own``: its activations and its op's saves on this rank, pass-Q's gathered tensors excluded; ``gathered``:
    CP pass-Q's gathered queries, partial outputs and log-sum-exps (0 in one process); ``shared``: a buffer every
    layer of the same call shape shares (the prefix-causal mask of ``ops.attention.prefix``), counted once per call
    size; ``state_views``: of ``own + gathered``, the bytes that are views of the prompt state's own buffers (counted in
    the state, not again)."""

    own: int
    gathered: int = 0
    shared: int = 0
    state_views: int = 0


def saved_row_bytes(module: torch.nn.Module, width: int, dtype: torch.dtype, inputs: int = 1) -> float:
    """Bytes ``module`` (a norm: ``inputs`` tensors [rows, width] in, e.g. a gated norm's values and gate) saves
    for backward per row on inputs of ``dtype`` that need gradients, its parameters in ``dtype`` too: counted on
    the meta device from the tensors its forward saves (each storage once; its parameters, the optimizer's, not
    counted; an input saved as it is counted), with autograd on whatever the caller's grad mode. Cached per module
    class, parameter shapes, width, dtype, inputs."""
    key = (type(module), tuple(p.shape for p in module.parameters()), width, dtype, inputs)
    if key not in _SAVED_ROW_BYTES:
        _SAVED_ROW_BYTES[key] = _count_saved_row_bytes(module, width, dtype, inputs)
    return _SAVED_ROW_BYTES[key]


_SAVED_ROW_BYTES: dict[tuple, float] = {}


def _count_saved_row_bytes(module: torch.nn.Module, width: int, dtype: torch.dtype, inputs: int) -> float:
    """Per row: the saves of 16 rows less those of 8 (what does not grow with the rows, e.g. a weight's float32
    copy, cancels), over 8. Autograd on whatever the caller's mode: the engine's pre-flight runs inside veRL's
    no_grad log-prob call, where nothing would be saved and the cache would keep 0 for the process."""
    with torch.inference_mode(False), torch.enable_grad():
        sixteen, eight = (_count_saved_bytes(module, width, dtype, inputs, rows) for rows in (16, 8))
    return (sixteen - eight) / 8


def _count_saved_bytes(module: torch.nn.Module, width: int, dtype: torch.dtype, inputs: int, rows: int) -> int:
    params = {name: torch.empty(p.shape, dtype=dtype, device="meta", requires_grad=True)
              for name, p in module.named_parameters()}
    given = {p.untyped_storage()._cdata for p in params.values()}
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        key = tensor.untyped_storage()._cdata
        if key not in given:
            saved[key] = tensor.untyped_storage().nbytes()
        return tensor

    args = [torch.empty(rows, width, dtype=dtype, device="meta", requires_grad=True) for _ in range(inputs)]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        torch.func.functional_call(module, params, tuple(args))
    return sum(saved.values())


def upcast_row_bytes(module: torch.nn.Module, width: int, dtype: torch.dtype, inputs: int = 1) -> float:
    """Per row, the bytes a norm ``module`` saves on half-precision inputs beyond what the calibrated per-token
    coefficients count for it: they were fitted on float32 models, where a norm's float32 math makes no copies and
    every saved tensor has the model dtype's size; in ``dtype`` its float32 copies are larger and new. The
    difference of ``saved_row_bytes`` in ``dtype`` and in float32 (scaled to ``dtype``'s bytes); 0 for float32."""
    if dtype.itemsize >= 4:
        return 0.0
    scaled = saved_row_bytes(module, width, torch.float32, inputs) * dtype.itemsize / 4
    return max(0.0, saved_row_bytes(module, width, dtype, inputs) - scaled)


def affine_merge_bytes(call: LayerCall, backward: bool, summary_elements: int) -> dict[str, int]:
    """Collectives of a recurrent op's affine merge for a prompt chunk under CP (``call.consecutive``; none
    otherwise): the all-gather of every rank's float32 summary of ``summary_elements`` per sequence
    (``parallel.sequence.AffineMerge``); the backward reduce-scatters their gradients."""
    if call.cp_size == 1 or not call.consecutive:
        return {}
    maps = call.cp_size * summary_elements * call.compute.itemsize
    return {"all_gather": maps, "reduce_scatter": maps} if backward else {"all_gather": maps}


def summed(*collectives: dict[str, int]) -> dict[str, int]:
    """Bytes by collective kind of the parts of one call (``MixerOp.collective_bytes``), added kind by kind."""
    out: dict[str, int] = {}
    for part in collectives:
        for kind, nbytes in part.items():
            out[kind] = out.get(kind, 0) + nbytes
    return out


def layer_needs_output(idx: int, num_layers: int, scores: bool) -> bool:
    """Whether layer ``idx`` of ``num_layers`` computes its output in a model call that scores tokens (``scores``)
    or not: every layer but the last of a call that scores nothing, whose state is all that is read of it (the
    walk's ``execute.run_segment``, the estimate and the FLOP count all ask this)."""
    return scores or idx < num_layers - 1


def layer_calls(call: ModelCall, num_layers: int, dtype: torch.dtype, device_type: str) -> list[LayerCall]:
    """Each of ``num_layers`` layers' ``LayerCall`` in a step's model call (``plan.ModelCall``: the step's
    ``call``), inputs of ``dtype`` on a ``device_type`` device: the one shape the estimate, the time model and the
    benchmarks price a step's layers by."""
    return [LayerCall(call.batch, call.tokens, call.prefix, call.state_len,
                      layer_needs_output(idx, num_layers, call.scored is not None), call.sizes, call.rank,
                      call.cp_size, call.consecutive, dtype, device_type, call.group_prefix)
            for idx in range(num_layers)]


def per_sequence(state: torch.Tensor, batch: int) -> torch.Tensor:
    """A fixed-size state [1, ...] for ``batch`` sequences: itself for one, else a contiguous copy [batch, ...]
    (small: e.g. a Gated DeltaNet recurrent state; kernels such as flash-linear-attention's read it densely)."""
    return state if state.shape[0] == batch else state.expand(batch, *state.shape[1:]).contiguous()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """Rotary embedding on the first ``cos.shape[-1]`` channels of ``x`` [..., S, D] (partial rotary passes the rest).

    ``cos``/``sin`` [S, rotary_dim] come from the model's rotary module (split-half layout).
    ``interleaved`` first de-interleaves pairs (DeepSeek-V3 ``rope_interleave``).
    """
    rot_dim = cos.shape[-1]
    if not rot_dim:  # no positional embedding (nemotron_h attention)
        return x
    rot, rest = x[..., :rot_dim], x[..., rot_dim:]
    if interleaved:
        rot = rot.unflatten(-1, (rot_dim // 2, 2)).transpose(-1, -2).flatten(-2)
    rot = rot * cos + rotate_half(rot) * sin
    return torch.cat((rot, rest), dim=-1) if rest.shape[-1] else rot


class MixerOp(ABC):
    """One decoder layer's token mixer, bound to its module: state, forward, CP form and costs (module docstring).

    ``kind`` names the op for reports and benchmarks; nothing branches on it."""

    kind: str = ""
    flop_class: str = "scan"  # the op class its ``flops`` run as (``flops.FLOP_CLASSES``): attention-like ops set
    # "attention"; the recurrences (and ops counting none) are "scan"
    context_parallel: bool = True  # whether ``forward`` has a CP form (``Adapter.check_context_parallel`` asks)
    conv: CausalConv | None = None  # the causal conv in front of the mixer (``mixers.causal_conv``), None without

    @property
    def weights_read(self) -> tuple[str, ...]:
        """Names of the layer's submodules whose weight the forward reads without calling them (its causal conv's):
        LoRA there would be skipped, so the adapter refuses it (``lora.check_lora``)."""
        return () if self.conv is None else self.conv.weights_read

    @property
    @abstractmethod
    def kinds(self) -> tuple[StateKind, ...]:
        """Kind of each of the layer's state tensors."""

    @abstractmethod
    def forward(self, x: torch.Tensor, ctx: SegmentContext, past: LayerState,
                need_output: bool) -> tuple[torch.Tensor | None, LayerState]:
        """Normalised input ``x`` [B, S, hidden] -> (output [B, S, hidden], the segment's state).

        B is 1, or B > 1 right-padded responses replayed together after one batch-1 ``past`` (whose ``Rows``
        tensors are broadcast, never copied per response). Without ``need_output`` only the state is needed (the
        output may be None): attention then skips attending."""

    @abstractmethod
    def saves(self, call: LayerCall) -> Saves:
        """Bytes the forward of ``call`` saves for backward (pinned against ``memory.SavedTensorMeter`` by the
        op's test)."""

    def transient_bytes(self, call: LayerCall) -> int:
        """The largest transient of the call's backward that the saves do not hold (a fused backward's buffers);
        0 where none is counted."""
        return 0

    def forward_transient_bytes(self, call: LayerCall) -> int:
        """The largest transient of the call's forward without autograd (a capture) beyond its inputs and outputs:
        ``score_block_bytes`` unless the op counts more."""
        return self.score_block_bytes(call)

    def score_block_bytes(self, call: LayerCall) -> int:
        """The transient of scoring one block of keys that the call's forward and backward hold at once (a blocked
        pass-Q under CP); 0 where none is counted."""
        return 0

    def collective_bytes(self, call: LayerCall, backward: bool) -> dict[str, int]:
        """Bytes of the collectives the call's forward (and with ``backward`` its backward) issues on a CP group,
        by kind ("all_gather", "reduce_scatter"): a collective's per-rank buffer (an all-gather's output, a
        reduce-scatter's input; variable sizes padded to the largest rank's). Empty in one process."""
        return {}

    @abstractmethod
    def flops(self, tokens: int, prefix: int) -> float:
        """Forward FLOPs of one sequence of ``tokens`` at positions [prefix, prefix + tokens) through the op's
        sequence mixing (the projections are counted as weights, ``flops.active_params``)."""

    def row_nbytes(self, dtype: torch.dtype) -> int:
        """Bytes per token of the differentiable ``Rows``-like state tensors (what attention reads and saves)."""
        return sum(kind.row_nbytes(dtype) for kind in self.kinds if kind.differentiable)


class NoMixer(MixerOp):
    """A block without a token mixer (an MLP or MoE block alone: nemotron_h): no state, nothing mixed."""

    kind = "none"

    @property
    def kinds(self) -> tuple[StateKind, ...]:
        return ()

    def forward(self, x, ctx, past, need_output):
        return None, ()

    def saves(self, call: LayerCall) -> Saves:
        return Saves(0)

    def flops(self, tokens: int, prefix: int) -> float:
        return 0.0
