"""The model terms of a training step's memory: what veRL's FSDP2 (and, under expert parallelism, the routed experts'
shards) costs one rank of a context-parallel (CP) group of R ranks, besides the walk's own bytes
(``estimate``: the group terms).

- ``parameter_counts`` / ``count_units``: a model's parameters by the units veRL's FSDP2 wrapping shards on their own
  (``ParameterCounts``: per unit, those of its routed experts, those that train under LoRA, each parameter's dim 0
  for FSDP2's per-parameter split, the buffers' bytes), read off a model built on the meta device or a live one;
- ``unsharded_bytes``: the parameter and gradient bytes FSDP2 holds unsharded at once during a step;
  ``unsharded_moments``: the same moment by moment (each decoder layer's backward, the ends, a no-grad forward);
- ``expert_shard_bytes``: the routed-expert shards a rank keeps resident under expert parallelism (parameters,
  gradients, AdamW moments; ``ExpertShardBytes``; one MoE-layer call's token exchange is its feed-forward op's,
  ``feed_forward.Moe.exchange``);
- ``Lora``: veRL's LoRA settings and the one peft construction (``Lora.wrap``) the counts, the dry run and the tests
  read; ``Training``: the knobs of one training step (lengths, LongStraw's and veRL's FSDP2 settings, LoRA), read
  off a composed recipe by ``recipe_training`` (``VERL_DTYPES``: veRL's dtype names).

All figures are bytes (or parameter counts, where named so). ``gpu_table`` adds these to the walk estimate for the
per-GPU figures of a step; the engine's pre-flight check reads ``count_units``, ``unsharded_bytes`` and
``expert_shard_bytes`` of its live model.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from .adapters import model_on_meta
from .errors import UnsupportedModelError
from .knobs import REPLAY_TOKENS
from .parallel import experts as parallel_experts


def _largest_pair(units: Sequence[int]) -> int:
    """The most of two consecutive ``units`` (all of them when there are fewer than two)."""
    return max((a + b for a, b in zip(units[:-1], units[1:], strict=True)), default=sum(units))


def _gradient_peak(units: Sequence[int], grad_width: int, reduce_width: int) -> int:
    """The most bytes of unsharded gradients and reduce-scatter inputs FSDP2 holds at once in one backward over
    ``units`` (parameter counts). At a unit's post-backward FSDP2 drops the input it kept of the unit before (after
    waiting on its collective), allocates this unit's input (``reduce_width`` B per parameter) and copies the
    gradients (``grad_width`` B each) in before freeing them; while the next unit's gradients grow it keeps this
    input (torch.distributed.fsdp._fully_shard: ``FSDPParamGroup.post_backward``, ``foreach_reduce``; torch
    2.11-2.13). A kept input beside a smaller unit's gradients is less than its own unit's copy-in moment, so the
    peak is that moment of the largest unit: (``grad_width`` + ``reduce_width``) x max(``units``)."""
    return (grad_width + reduce_width) * max(units, default=0)


@dataclass(frozen=True)
class ParameterCounts:
    """Parameters of a model by the units veRL's FSDP2 wrapping shards on their own
    (``verl.utils.fsdp_utils.apply_fsdp2``), in the order a forward runs them: the input embedding, each
    decoder layer, the lm_head (embedding and lm_head are units only when untied); ``root``: the rest
    (e.g. the final norm), sharded with the root module. ``experts``: of each unit's parameters, those of its routed
    experts (``parallel.experts.dispatched_experts``: what expert parallelism splits over the CP group and keeps
    out of FSDP2; 0 for a dense unit). ``trains``: the same counts of the parameters that get gradients and
    optimizer state (a LoRA model's adapters; None: every parameter)."""

    units: tuple[int, ...]
    root: int
    experts: tuple[int, ...]
    trains: ParameterCounts | None = None
    dims: tuple[tuple[int, int, bool], ...] = ()  # each parameter's (dim 0, elements per dim-0 row, a routed expert's)
    buffer_bytes: int = 0  # the model's buffers (rotary tables), which every rank holds whole on the device

    def shard(self, cp_size: int, expert_parallel: bool) -> int:
        """The parameters rank 0 of ``cp_size`` holds as FSDP2 shards: FSDP2 splits each parameter on dim 0, rank 0
        taking ceil(dim 0 / R) rows (a [1, 4096] gate: all of it); the routed experts are outside FSDP2 under
        ``expert_parallel``."""
        return sum(-(-rows // cp_size) * row for rows, row, routed in self.dims if not (routed and expert_parallel))

    @property
    def total(self) -> int:
        return sum(self.units) + self.root

    @property
    def expert_total(self) -> int:
        """The routed experts' parameters, all MoE layers."""
        return sum(self.experts)

    @property
    def trainable(self) -> ParameterCounts:
        """The counts of the parameters that train."""
        return self.trains if self.trains is not None else self

    @property
    def largest_pair(self) -> int:
        """The most parameters of two consecutive units: FSDP2 unsharding the running unit and the next."""
        return _largest_pair(self.units)

    @property
    def largest_pair_without_experts(self) -> int:
        """The most parameters of two consecutive units less their routed experts: what FSDP2 unshards at once
        under expert parallelism (the experts stay resident shards)."""
        return _largest_pair([unit - experts for unit, experts in zip(self.units, self.experts, strict=True)])


def parameter_counts(config, lora: Lora | None = None) -> ParameterCounts:
    """``config``'s model, built on the meta device (no weights, no memory), counted by FSDP2 unit; under
    ``lora`` as veRL builds it (peft's ``get_peft_model``, the base frozen)."""
    return count_units((lora or Lora()).wrap(model_on_meta(config)))


def count_units(model: torch.nn.Module) -> ParameterCounts:
    """A causal LM's parameters by FSDP2 unit (full counts also when ``fully_shard`` or expert parallelism made them
    DTensors), those of its routed experts (``parallel.experts.dispatched_experts``; none for a model without an
    expert-parallel plan), and (``trains``) those that require gradients where some do not (a LoRA model)."""
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    untied = head is not None and head.weight is not embed.weight
    modules = [embed, *model.get_decoder().layers, head] if untied else list(model.get_decoder().layers)
    try:
        routed = {p for _, module in parallel_experts.dispatched_experts(model) for p in module.parameters()}
    except UnsupportedModelError:  # no expert-parallel plan: every parameter is FSDP2's
        routed = set()

    def counts(which, trains: ParameterCounts | None = None) -> ParameterCounts:
        units = tuple(sum(p.numel() for p in m.parameters() if which(p)) for m in modules)
        experts = tuple(sum(p.numel() for p in m.parameters() if which(p) and p in routed) for m in modules)
        dims = tuple((p.shape[0] if p.dim() else 1, p.numel() // max(p.shape[0] if p.dim() else 1, 1), p in routed)
                     for p in model.parameters() if which(p))
        buffers = sum(b.numel() * b.element_size() for b in model.buffers())
        return ParameterCounts(units, sum(p.numel() for p in model.parameters() if which(p)) - sum(units), experts,
                               trains, dims, buffers)

    frozen = any(not p.requires_grad for p in model.parameters())
    return counts(lambda p: True, counts(lambda p: p.requires_grad) if frozen else None)


def unsharded_bytes(
    params: ParameterCounts,
    cp_size: int,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    training: bool,
    expert_parallel: bool = False,
) -> tuple[int, int]:
    """(parameter bytes, gradient bytes) a rank holds unsharded at once during a step: two consecutive FSDP2
    units with context parallelism (``cp_size`` > 1: unsharded layer by layer), the whole model with
    ``cp_size`` 1 (the engine holds every unit unsharded for a micro-batch); with ``expert_parallel`` the two units
    less their routed experts (``ParameterCounts.largest_pair_without_experts``; the experts' shards are resident,
    ``expert_shard_bytes``). Gradients (``training``) of the parameters that train (``ParameterCounts.trainable``):
    with ``cp_size`` > 1 the most that FSDP2's backward holds at once, unsharded in ``param_dtype`` beside the
    ``reduce_dtype`` reduce-scatter inputs (``_gradient_peak``); with ``cp_size`` 1 every unit's gradient and, in
    another ``reduce_dtype``, its copy (an upper bound)."""
    if expert_parallel and cp_size < 2:
        raise ValueError(f"expert_parallel splits the experts over the CP group: cp_size must be > 1, got {cp_size}")

    def held(counts: ParameterCounts) -> int:
        if expert_parallel:
            return counts.largest_pair_without_experts
        return counts.largest_pair if cp_size > 1 else counts.total

    if not training:
        return held(params) * param_dtype.itemsize, 0
    trains = params.trainable  # LoRA: the adapters
    if cp_size < 2:
        reduce_copy = reduce_dtype.itemsize if reduce_dtype != param_dtype else 0
        return held(params) * param_dtype.itemsize, trains.total * (param_dtype.itemsize + reduce_copy)
    units = [u - e for u, e in zip(trains.units, trains.experts, strict=True)] if expert_parallel else trains.units
    return held(params) * param_dtype.itemsize, _gradient_peak(units, param_dtype.itemsize, reduce_dtype.itemsize)


class UnshardedMoments(NamedTuple):
    """The parameter and gradient bytes FSDP2 holds unsharded at each kind of moment of a step (``unsharded_moments``):
    while decoder layer j backpropagates in a backward that scored (``layers[j]``) or did not (``unscored_layers[j]``:
    no lm_head gradient), at the ends (the lm_head scoring or the input embedding's backward: ``ends``) and in a
    no-grad forward (``forward``, parameters only)."""

    layers: tuple[tuple[int, int], ...]  # (parameter bytes, gradient bytes) at each decoder layer's backward
    unscored_layers: tuple[tuple[int, int], ...]
    ends: tuple[int, int]
    forward: tuple[int, int]


def unsharded_moments(
    params: ParameterCounts,
    layers: int,
    cp_size: int,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    expert_parallel: bool = False,
) -> UnshardedMoments:
    """``unsharded_bytes`` moment by moment, for a model of ``layers`` decoder layers, so that a step's peak pairs each
    moment of the walk with what FSDP2 holds then. With ``cp_size`` > 1, while decoder layer j backpropagates FSDP2
    holds its unit and the one it prefetches (the unit before j: layer j - 1, or the input embedding's), layer j's
    unsharded gradient and, until its post-backward, the reduce-scatter input it kept of the unit after j (after the
    last layer the lm_head's, in a backward that scored), then layer j's own (``_gradient_peak``'s moments); at the
    ends the largest pair and the largest unit's gradients (``unsharded_bytes``); in a no-grad forward the largest
    pair's parameters. With ``cp_size`` 1 the engine holds every unit unsharded: ``unsharded_bytes`` at every
    moment."""
    held, grads = unsharded_bytes(params, cp_size, param_dtype, reduce_dtype, training=True,
                                  expert_parallel=expert_parallel)
    if cp_size < 2:
        return UnshardedMoments(((held, grads),) * layers, ((held, grads),) * layers, (held, grads), (held, 0))
    trains = params.trainable

    def fsdp(counts: ParameterCounts) -> list[int]:  # each unit's parameters FSDP2 shards
        if not expert_parallel:
            return list(counts.units)
        return [unit - experts for unit, experts in zip(counts.units, counts.experts, strict=True)]

    units, trained = fsdp(params), fsdp(trains)
    ends = len(units) == layers + 2  # the input embedding and the lm_head are units of their own (untied)
    if not ends and len(units) != layers:
        raise ValueError(f"{len(units)} FSDP2 units for {layers} decoder layers: expected the layers, or the layers "
                         "with the input embedding and the lm_head")
    if not ends:  # no units before the first layer or after the last
        units, trained = [0, *units, 0], [0, *trained, 0]
    width, reduce_width = param_dtype.itemsize, reduce_dtype.itemsize

    def per_layer(after: Sequence[int]) -> tuple[tuple[int, int], ...]:  # ``after``: each unit's successor's trained
        return tuple(((units[k] + units[k - 1]) * width,
                      max(width * trained[k] + reduce_width * after[k], (width + reduce_width) * trained[k]))
                     for k in range(1, layers + 1))

    unscored = [*trained[1:-1], 0]  # a backward that did not score: no lm_head gradient after the last layer
    return UnshardedMoments(per_layer(trained[1:]), per_layer(unscored), (held, grads), (held, 0))


class ExpertShardBytes(NamedTuple):
    """Bytes of the routed-expert shards one rank of a CP group of R holds under expert parallelism: E / R experts of
    every MoE layer, DTensors outside FSDP2 in their own dtype (the model's: veRL's ``fsdp_config.model_dtype``)."""

    parameters: int  # resident: 1/R of the routed experts' parameters
    gradients: int  # of those that train: from a step's first backward until the optimizer step (each the whole
    # group's gradient of the rank's experts)
    moments: int  # AdamW's exp_avg and exp_avg_sq of those that train, in the same dtype


def expert_shard_bytes(params: ParameterCounts, cp_size: int, dtype: torch.dtype) -> ExpertShardBytes:
    """The routed-expert shards (``ParameterCounts.experts``) of one of ``cp_size`` ranks in ``dtype``: each MoE
    layer's experts divide evenly over the ranks (``parallel.experts.check_expert_parallel`` requires it)."""
    shard = sum(experts // cp_size for experts in params.experts) * dtype.itemsize
    trained = sum(experts // cp_size for experts in params.trainable.experts) * dtype.itemsize
    return ExpertShardBytes(parameters=shard, gradients=trained, moments=2 * trained)


@dataclass(frozen=True)
class Lora:
    """veRL's LoRA settings (``actor_rollout_ref.model.lora_rank``, ``target_modules``): 0 = no LoRA."""

    rank: int = 0
    target_modules: str | tuple[str, ...] = "all-linear"

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """``model`` as veRL builds it for these settings: peft's ``get_peft_model`` with LoRA adapters of ``rank``
        on ``target_modules``, the base frozen (on the device ``model``'s parameters are on: the meta device for an
        estimate or a dry run); ``model`` itself when ``rank`` is 0."""
        if self.rank == 0:
            return model
        from peft import LoraConfig, get_peft_model

        device = next(model.parameters()).device
        with torch.device(device):
            return get_peft_model(model, LoraConfig(r=self.rank, target_modules=self.target_modules))


@dataclass(frozen=True)
class Training:
    """What one training step runs on each rank (a recipe's knobs): GRPO groups of ``group_size`` responses of
    at most ``response_len`` tokens to a ``prompt_len``-token prompt; LongStraw's ``chunk_size``,
    ``prompt_grad``, ``cp_size`` (context_parallel_size R = the FSDP shard group) and ``state_grad_on_host``;
    veRL's FSDP2 settings: ``offload_policy`` (parameter and gradient shards and the optimizer step on
    the host), ``optimizer_offload`` (AdamW moments on the host), the mixed-precision ``param_dtype`` and
    ``reduce_dtype``, ``model_dtype`` (the dtype the model is loaded in: the sharded parameters', their gradients'
    and moments'), and ``checkpointing`` (``enable_gradient_checkpointing``); LongStraw's ``replay_tokens``
    (the replay batch's token budget) and ``expert_parallel`` (the routed experts split over the CP group,
    resident in ``model_dtype`` outside FSDP2: ``parallel.experts``), ``state_on_host`` (the prompt state's rows in
    host memory, streamed a layer at a time: ``state.stream``); ``lora``: veRL's LoRA settings (the base
    frozen: gradients and AdamW moments of the adapters only, the reference policy the actor with its adapters
    disabled)."""

    prompt_len: int
    group_size: int
    response_len: int
    chunk_size: int | None
    prompt_grad: str
    cp_size: int
    state_grad_on_host: bool
    offload_policy: bool
    optimizer_offload: bool
    param_dtype: torch.dtype = torch.bfloat16
    reduce_dtype: torch.dtype = torch.float32
    checkpointing: bool = True
    replay_tokens: int = REPLAY_TOKENS
    lora: Lora = Lora()
    model_dtype: torch.dtype = torch.float32
    expert_parallel: bool = False
    response_chunk_size: int | None = None
    state_on_host: bool = False


VERL_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}  # veRL's config spelling
VERL_DTYPES = {name: dtype for dtype, name in VERL_DTYPE_NAMES.items()}


def recipe_training(cfg) -> Training:
    """The ``Training`` knobs of a composed veRL config (``configs.compose_recipe``: an omegaconf ``DictConfig``):
    lengths, ``rollout.n``, ``actor.longstraw.*``, ``fsdp_config``'s offload, dtypes and mixed precision, gradient
    checkpointing, veRL's LoRA settings."""
    actor, model = cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.model
    knobs, fsdp = actor.longstraw, actor.fsdp_config
    targets = model.get("target_modules", "all-linear")
    return Training(
        prompt_len=cfg.data.max_prompt_length, group_size=cfg.actor_rollout_ref.rollout.n,
        response_len=cfg.data.max_response_length, chunk_size=knobs.chunk_size, prompt_grad=knobs.prompt_grad,
        cp_size=knobs.context_parallel_size, state_grad_on_host=knobs.state_grad_on_host,
        offload_policy=fsdp.offload_policy, optimizer_offload=fsdp.optimizer_offload,
        param_dtype=VERL_DTYPES[fsdp.mixed_precision.param_dtype],
        reduce_dtype=VERL_DTYPES[fsdp.mixed_precision.reduce_dtype],
        checkpointing=model.enable_gradient_checkpointing,
        lora=Lora(model.get("lora_rank", 0), targets if isinstance(targets, str) else tuple(targets)),
        model_dtype=VERL_DTYPES[fsdp.model_dtype], expert_parallel=knobs.get("expert_parallel", False),
        response_chunk_size=knobs.get("response_chunk_size"), state_on_host=knobs.state_on_host,
    )
