"""The feed-forward half of a decoder layer (``FeedForward``), one op per layer beside its token mixer
(``mixers.MixerOp``): a gated MLP (``Mlp``), routed experts with or without shared ones (``Moe``), or none
(``NoFeedForward``: Nemotron-H's mixer-only blocks).

An op owns, for its layer:
- the intermediate width one token passes through (``width``: the MLP's, or the top-k routed experts', the shared
  experts' and the router's logits), and the routed experts a token runs (``top_k``, read once from the config);
- its costs in a model of a given dtype, linear in the tokens: the bytes its half of the layer saves for backward
  per token (``saved_bytes_per_token``), its backward's transient (``backward_transient_bytes``) and the hidden-wide
  tensors a no-grad forward keeps alive (``forward_live_bytes``), calibrated against ``memory.SavedTensorMeter`` on
  CPU float32 models (``NORM``, ``MLP``, ``MLP_BACKWARD``);
- under expert parallelism, one call's token exchange (``Moe.exchange``).
The adapter declares one per layer (``Adapter.feed_forward``) and still calls the layer's own module; the memory
estimate and the FLOP count read the op. ``ExpertPlan``: which module of a family's layers holds its routed experts
for expert parallelism (``parallel.experts``), where transformers ships no plan for it (``register_expert_plan``,
``expert_plan``).

This module imports nothing of the package but ``errors``: ``parallel`` reads it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from .errors import UnsupportedModelError

NORM = 8.0  # per-token saves of a layer's two norms and residuals, in units of hidden: half before the mixer (counted
# with the mixer's saves by the estimate), half before the feed-forward (``FeedForward.saved_bytes_per_token``)
MLP = 4.0  # gate, up, activation, product, in units of the intermediate width
# the gated MLP's backward, besides its saves: d(product), then d(activation) and d(up) while the saves they read
# are still held, in units of the intermediate width (its largest moment, seen in the dry run)
MLP_BACKWARD = 2.0


class ExpertExchange(NamedTuple):
    """One MoE-layer call's token exchange on one rank under expert parallelism (transformers'
    ``EpDispatchExpertsParallel``: the rank's tokens go to their ``top_k`` experts' owners by all-to-all, one hidden
    vector per (token, top-k slot) pair, and the experts' outputs come back the same way), in bytes."""

    pair_bytes: int  # [tokens x top_k, hidden] in the model dtype: the pairs this rank dispatches (exact whatever the
    # routing); with balanced routing also the pairs it receives, the outputs it returns and those it gets back
    transient_bytes: int  # the dispatch's send and receive buffers held at once: 2 x pair_bytes with balanced routing
    # (a rank that receives every pair of the group's R ranks holds (R + 1) x pair_bytes)
    collective_bytes: int  # the tensors passed to the token all-to-alls in the call's forward, dispatched pairs and
    # returned outputs: 2 x pair_bytes expected (exact summed over ranks routing equal tokens); the backward passes as
    # many again; the exchange of the counts (8 B x the layer's E experts) is not included


@dataclass(frozen=True)
class FeedForward:
    """A layer's feed-forward half on tokens of ``hidden`` width: its intermediate ``width`` (0: none) and the routed
    experts one token runs (``top_k``; 0: no routed experts), and its costs (module docstring)."""

    hidden: int

    @property
    def width(self) -> int:
        """Intermediate width one token passes through, what the activations are counted by."""
        return 0

    @property
    def top_k(self) -> int:
        """Routed experts each token runs (``flops.active_params`` counts a routed-experts tensor at top_k / E)."""
        return 0

    def saved_bytes_per_token(self, dtype: torch.dtype) -> float:
        """Bytes this half of the layer saves for backward per token of ``dtype`` (the post norm's and residual's
        share of ``NORM`` x hidden and ``MLP`` x ``width``); the norm's half-precision copies are the norm's own
        (``mixers.base.upcast_row_bytes``). A layer's backward runs this half first, so these are freed before its
        mixer's backward runs."""
        return (NORM / 2 * self.hidden + MLP * self.width) * dtype.itemsize

    def backward_transient_bytes(self, tokens: int, dtype: torch.dtype) -> int:
        """The backward's largest transient beside its saves for ``tokens`` tokens of ``dtype``: ``MLP_BACKWARD`` x
        ``width`` per token."""
        return tokens * int(MLP_BACKWARD * self.width) * dtype.itemsize

    def forward_live_bytes(self, tokens: int, dtype: torch.dtype) -> int:
        """Bytes of the hidden-wide tensors a no-grad forward of ``tokens`` tokens of ``dtype`` keeps alive in this
        half of the layer (``Adapter.layer``): the layer's input ``h``, the mixer's output, their sum and the post
        norm's output (4 x hidden), then either the gated MLP's activation, up projection and their product
        (3 x ``width``) or, as its down projection returns, the product and the output (``width`` + hidden). MoE
        routing buffers are not counted."""
        m = self.width
        return tokens * dtype.itemsize * (4 * self.hidden + max(3 * m, m + self.hidden))


@dataclass(frozen=True)
class NoFeedForward(FeedForward):
    """A block that is its token mixer alone (Nemotron-H's Mamba2 and attention blocks): no intermediate width. The
    calibrated costs keep the residual's half of ``NORM`` and the hidden-wide tensors around the (absent) MLP."""


@dataclass(frozen=True)
class Mlp(FeedForward):
    """A dense gated MLP of intermediate width ``intermediate``."""

    intermediate: int

    @property
    def width(self) -> int:
        return self.intermediate


@dataclass(frozen=True)
class Moe(FeedForward):
    """A router over ``experts`` routed experts of width ``expert_width``, ``experts_per_token`` of them run per
    token, beside ``shared_width`` of shared experts (or a shared MLP) every token runs (0: none). ``width``: the
    top-k experts', the shared experts' and the router's logits (one per expert)."""

    experts: int
    experts_per_token: int
    expert_width: int
    shared_width: int = 0

    @property
    def width(self) -> int:
        return self.experts_per_token * self.expert_width + self.shared_width + self.experts

    @property
    def top_k(self) -> int:
        return self.experts_per_token

    def exchange(self, tokens: int, dtype: torch.dtype) -> ExpertExchange:
        """The token exchange of one call of ``tokens`` tokens of this rank in ``dtype`` under expert parallelism:
        ``top_k`` pairs per token, one hidden vector each."""
        pair_bytes = tokens * self.top_k * self.hidden * dtype.itemsize
        return ExpertExchange(pair_bytes=pair_bytes, transient_bytes=2 * pair_bytes, collective_bytes=2 * pair_bytes)


def largest_exchange(ops: tuple[FeedForward, ...], tokens: int, dtype: torch.dtype) -> ExpertExchange:
    """The token exchange of the largest MoE layer among ``ops`` (a model's, ``Adapter.feed_forwards``) for
    ``tokens`` tokens of this rank in ``dtype``; UnsupportedModelError naming ``expert_parallel`` for a model
    without routed experts."""
    exchanges = [op.exchange(tokens, dtype) for op in ops if isinstance(op, Moe)]
    if not exchanges:
        raise UnsupportedModelError(
            "expert_parallel: the model has no routed experts to split; set expert_parallel: false")
    return max(exchanges, key=lambda exchange: exchange.pair_bytes)


@dataclass(frozen=True)
class ExpertPlan:
    """Where a family's layers hold their routed experts, for expert parallelism where transformers ships no plan
    (``base_model_ep_plan``): the experts module under the base model (``*`` for a layer number), whose forward the
    dispatcher replaces, and its 3-D weights (experts on dim 0), which it splits."""

    experts: str
    weights: tuple[str, ...]


_EXPERT_PLANS: dict[str, ExpertPlan] = {}


def register_expert_plan(model_types: tuple[str, ...], plan: ExpertPlan) -> None:
    """Declare ``plan`` as the expert plan of ``model_types`` (a family's adapter module does, beside its adapter)."""
    for model_type in model_types:
        _EXPERT_PLANS[model_type] = plan


def expert_plan(model_type: str) -> ExpertPlan | None:
    """The expert plan declared for ``model_type`` (``register_expert_plan``), None where none is."""
    return _EXPERT_PLANS.get(model_type)
