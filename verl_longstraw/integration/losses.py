"""veRL's loss in the longstraw engine: how a call's walks give veRL's loss and its gradient (``LossStrategy``).

veRL's loss is evaluated per micro-batch, as veRL's loop calls it (``LossStrategy.micro_batch_loss``), on the
[T_i] response log-probs (and entropies) of each row the call's units gave it. Training takes one of two strategies,
reported as ``longstraw/single_forward`` (1 or 0); ``loss_strategy`` picks one per call:

- ``SingleForward``, one replay per response (``longstraw.single_forward`` and a loss that splits into per-response
  terms, ``splits_by_response``): each response's replay evaluates veRL's loss with that response's log-probs live
  and backpropagates it at once; the loss value and metrics come from the detached log-probs afterwards.
- ``TwoPass`` (other losses, e.g. clip_cov/kl_cov, or ``single_forward: false``): evaluate veRL's own loss function
  (e.g. ``ppo_loss`` with the global normalisers) on no-grad log-probs, take its gradient with respect to every
  token's log-prob/entropy, and backpropagate that through a backward walk per unit. By the chain rule this is the
  gradient of veRL's loss for any policy loss and ``loss_agg_mode``; the cost is one extra forward per response and
  per shared segment of a tree (the backward walk captures again what the log-prob walk captured: only one
  root-to-leaf path's state is ever held).

A forward-only call (``LossStrategy``) runs the log-prob walk alone.

Which losses split: veRL's ``ppo_loss`` (verl/workers/utils/losses.py) aggregates a policy loss, an entropy term and
a KL term with ``agg_loss``. Once the batch normalisers are fixed (``dp_size``, ``batch_num_tokens``,
``global_batch_size``, the loss-mask counts: all known from the masks before any forward), every ``loss_agg_mode``
veRL ships is a sum over responses of a term that reads only that response's log-probs and entropies. Then
d(loss)/d(response i's log-probs) is the gradient of the loss evaluated with response i's log-probs live and any
fixed values elsewhere, and each response can backpropagate its own term inside its replay. Policy losses that read
batch statistics of the log-probs (clip_cov and kl_cov select tokens by a covariance over the batch) do not split;
neither does a loss this module does not know. Those keep the two-pass path.
"""

import functools
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Optional

import torch
import torch.distributed as dist
from tensordict import TensorDict
from verl.utils.device import get_device_id
from verl.workers.engine.utils import detach_tree
from verl.workers.utils.losses import ppo_loss

from verl_longstraw import GroupResult, GroupStats

from .regroup import Tree, WalkRows, gather_response_values, response_starts, scatter_response_values

# policy losses (verl.trainer.ppo.core_algos, register_policy_loss) whose per-token or per-sequence terms
# read only their own response: ratios, clipping and sequence means are per row, normalisers come from masks
PER_RESPONSE_POLICY_LOSSES = frozenset(
    {"vanilla", "gspo", "gpg", "sapo", "geo_mean", "cispo", "dppo_tv", "dppo_kl"}
)

RowValues = list[Optional[torch.Tensor]]
"""Per walk row (``WalkRows``): the [T_i] float32 values of its response tokens (log-probs, entropies or their
gradients); None for a row in no unit."""
UnitLoss = Callable[..., torch.Tensor]
"""``(i, log_probs [T_i], entropy [T_i] or None) -> scalar``: the loss a backward walk backpropagates for the
unit's row ``i``."""
LossGradients = tuple[list[torch.Tensor], Optional[list[torch.Tensor]]]
"""One micro-batch's d(scaled loss)/d(log-probs) and d(loss)/d(entropies) per row ([T_i] each; the entropies' None
when the loss does not depend on them)."""


def splits_by_response(loss_function: Callable) -> bool:
    """Whether ``loss_function`` (what veRL's worker hands the engine: ``partial(ppo_loss, config=...)``) is
    a sum of per-response terms given the batch normalisers (see the module docstring)."""
    if not isinstance(loss_function, functools.partial) or loss_function.func is not ppo_loss:
        return False
    config = loss_function.keywords.get("config")
    policy_loss = getattr(config, "policy_loss", None) or {}
    return policy_loss.get("loss_mode", "vanilla") in PER_RESPONSE_POLICY_LOSSES


@dataclass(frozen=True)
class UnitWalks:
    """What a strategy runs, as the engine runs it: one unit's log-prob walk (``log_probs(unit, with_entropy,
    stats)``) and backward walk (``backward(unit, loss_fn, with_entropy, stats)``) with its plan, knobs and CP group;
    the compute dtype's autocast; the loss each rank backpropagates (``scale_loss``: the gradient scaler's, times R
    under context parallelism); veRL's data-parallel group."""

    log_probs: Callable[[Tree, bool, GroupStats], GroupResult]
    backward: Callable[[Tree, UnitLoss, bool, GroupStats], GroupResult]
    autocast: Callable[[], ContextManager]
    scale_loss: Callable[[torch.Tensor], torch.Tensor]
    dp_group: Optional[dist.ProcessGroup]


class LossStrategy:
    """A forward-only call's strategy, and the base of the training ones (``SingleForward``, ``TwoPass``): one
    log-prob walk per unit, no autograd; veRL's loss, if any, on its values."""

    forward_only = True
    differentiates = False  # True: veRL's loss is evaluated with autograd, its gradient fed to a backward walk

    def __init__(self, walks: UnitWalks, modes: tuple[str, ...] = ("log_probs",)):
        self.walks = walks
        self.modes = modes  # the walks each unit takes, in order (``Plan.tokens_forwarded``'s modes)

    def walk(
        self, units: list[Tree], walk: WalkRows, loss_function: Optional[Callable], calculate_entropy: bool,
        stats: GroupStats,
    ) -> tuple[RowValues, Optional[RowValues]]:
        """Every walk row's log-probs (and entropies), float32, no autograd: one log-prob walk per unit."""
        log_probs: list[Any] = [None] * len(walk)
        entropy: Optional[list[Any]] = [None] * len(walk) if calculate_entropy else None
        with torch.no_grad(), self.walks.autocast():
            for unit in units:
                result = self.walks.log_probs(unit, calculate_entropy, stats)
                for k, row in enumerate(unit.rows):
                    log_probs[row] = result.log_probs[k].float()
                    if calculate_entropy:
                        entropy[row] = result.entropies[k].float()
        return log_probs, entropy

    def micro_batch_loss(
        self, micro_batch: TensorDict, log_probs: RowValues, entropy: Optional[RowValues],
        loss_function: Optional[Callable], return_model_output: bool,
    ) -> tuple[dict, Optional[LossGradients]]:
        """veRL's output for one micro-batch from its rows' [T_i] response log-probs (and entropies):
        ``loss_function`` evaluated on it as veRL's micro-batched loop does, and, where the strategy
        ``differentiates``, the loss's gradients (``LossGradients``; else None)."""
        offsets = micro_batch["input_ids"].offsets()
        lp_flat = scatter_response_values(log_probs, micro_batch).requires_grad_(self.differentiates)
        model_output = {"log_probs": torch.nested.nested_tensor_from_jagged(lp_flat, offsets)}
        ent_flat = None
        if entropy is not None:
            ent_flat = scatter_response_values(entropy, micro_batch).requires_grad_(self.differentiates)
            model_output["entropy"] = torch.nested.nested_tensor_from_jagged(ent_flat, offsets)

        if loss_function is not None:
            with torch.enable_grad() if self.differentiates else torch.no_grad(), self.walks.autocast():
                loss, metrics = loss_function(model_output=model_output, data=micro_batch, dp_group=self.walks.dp_group)
        else:
            assert self.forward_only, "forward_only must be True when loss_function is None"
            loss, metrics = torch.tensor(1.0, device=get_device_id()), {}

        grads = self.loss_gradients(loss, lp_flat, ent_flat, micro_batch)
        output = {"loss": loss.detach().item(), "metrics": dict(metrics)}
        if self.forward_only or return_model_output:
            output["model_output"] = detach_tree(model_output)
        return output, grads

    def loss_gradients(self, loss: torch.Tensor, lp_flat: torch.Tensor, ent_flat: Optional[torch.Tensor],
                       micro_batch: TensorDict) -> Optional[LossGradients]:
        """None: only ``TwoPass`` differentiates veRL's loss."""
        return None

    def backward(self, units: list[Tree], grads: list[Optional[LossGradients]], stats: GroupStats) -> None:
        """The walks after veRL's loss (``grads``: each micro-batch's ``loss_gradients``): none but ``TwoPass``'s."""


class SingleForward(LossStrategy):
    """Training with one replay per response, for a loss that splits by response (the module docstring)."""

    forward_only = False

    def __init__(self, walks: UnitWalks, prompt_grad: str):
        super().__init__(walks, (prompt_grad,))

    def walk(
        self, units: list[Tree], walk: WalkRows, loss_function: Optional[Callable], calculate_entropy: bool,
        stats: GroupStats,
    ) -> tuple[RowValues, Optional[RowValues]]:
        """Each response's replay evaluates veRL's loss on the response's micro-batch with that response's log-probs
        (and entropy) live and zeros in every other row, and backpropagates it at once (a tree's shared response
        tokens pass their share on). Its gradient is the response's share of its micro-batch loss's gradient.
        Returns the per-walk-row log-probs and entropies (detached, float32, None for rows in no unit) for the loss
        values and metrics."""
        starts = [response_starts(mb) for mb in walk.micro_batches]
        totals = [int(mb["input_ids"].offsets()[-1]) for mb in walk.micro_batches]

        def live(values: torch.Tensor, m: int, row: int) -> torch.Tensor:
            """[total] nested over micro-batch ``m``'s prompt + response: ``values`` [T] at ``row``'s response
            positions, else 0."""
            start = starts[m][row]
            flat = torch.zeros(totals[m], device=values.device)
            flat = torch.cat([flat[:start], values.float(), flat[start + len(values) :]])
            return torch.nested.nested_tensor_from_jagged(flat, walk.micro_batches[m]["input_ids"].offsets())

        log_probs: list[Any] = [None] * len(walk)
        entropy: Optional[list[Any]] = [None] * len(walk) if calculate_entropy else None
        for unit in units:

            def loss_fn(i: int, logps: torch.Tensor, ent: Optional[torch.Tensor] = None, unit=unit) -> torch.Tensor:
                m, row = walk.locate(unit.rows[i])
                output = {"log_probs": live(logps, m, row)}
                if ent is not None:
                    output["entropy"] = live(ent, m, row)
                loss, _ = loss_function(model_output=output, data=walk.micro_batches[m], dp_group=self.walks.dp_group)
                return self.walks.scale_loss(loss)

            result = self.walks.backward(unit, loss_fn, calculate_entropy, stats)
            for k, row in enumerate(unit.rows):
                log_probs[row] = result.log_probs[k]
                if calculate_entropy:
                    entropy[row] = result.entropies[k]
        return log_probs, entropy


class TwoPass(LossStrategy):
    """Training in two passes, for any loss (the module docstring): the log-prob walk, veRL's loss differentiated
    with respect to its values per micro-batch, then a backward walk per unit fed those gradients."""

    forward_only = False
    differentiates = True

    def __init__(self, walks: UnitWalks, prompt_grad: str):
        super().__init__(walks, ("log_probs", prompt_grad))

    def loss_gradients(self, loss: torch.Tensor, lp_flat: torch.Tensor, ent_flat: Optional[torch.Tensor],
                       micro_batch: TensorDict) -> LossGradients:
        """d(scaled loss)/d(log-probs) and d(loss)/d(entropies) per row of ``micro_batch`` from its flat [total]
        leaves (the entropies' None when the loss does not depend on them)."""
        leaves = [lp_flat] if ent_flat is None else [lp_flat, ent_flat]
        flat_grads = torch.autograd.grad(self.walks.scale_loss(loss), leaves, allow_unused=True)
        g_ent = None
        if ent_flat is not None and flat_grads[1] is not None and bool(flat_grads[1].ne(0).any()):
            g_ent = gather_response_values(flat_grads[1], micro_batch)
        g_lp = torch.zeros_like(lp_flat) if flat_grads[0] is None else flat_grads[0]
        return gather_response_values(g_lp, micro_batch), g_ent

    def backward(self, units: list[Tree], grads: list[Optional[LossGradients]], stats: GroupStats) -> None:
        """Backpropagate the micro-batches' losses through every unit's backward walk, given each micro-batch's
        ``LossGradients`` (in walk order: together one [T_i] gradient per walk row)."""
        g_lp = [g for lp, _ in grads for g in lp]
        g_ent = None
        if any(ent is not None for _, ent in grads):
            g_ent = [g for lp, ent in grads for g in (ent if ent is not None else map(torch.zeros_like, lp))]
        for unit in units:

            def loss_fn(i: int, logps: torch.Tensor, entropy: Optional[torch.Tensor] = None, unit=unit):
                row = unit.rows[i]
                term = (g_lp[row] * logps.float()).sum()
                if entropy is not None:
                    term = term + (g_ent[row] * entropy.float()).sum()
                return term

            self.walks.backward(unit, loss_fn, g_ent is not None, stats)


def loss_strategy(walks: UnitWalks, loss_function: Optional[Callable], forward_only: bool, single_forward: bool,
                  prompt_grad: str) -> LossStrategy:
    """The strategy of one call: ``LossStrategy`` forward only; ``SingleForward`` training with
    ``longstraw.single_forward`` and a loss that splits by response; else ``TwoPass``. ``prompt_grad``: the
    training walks' mode (``Knobs.prompt_grad``)."""
    if forward_only:
        return LossStrategy(walks)
    if single_forward and splits_by_response(loss_function):
        return SingleForward(walks, prompt_grad)
    return TwoPass(walks, prompt_grad)
