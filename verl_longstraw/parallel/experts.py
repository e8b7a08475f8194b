"""Expert parallelism over the context-parallel group: each of the R ranks of a CP group holds E / R of every MoE
layer's routed experts, and the tokens routed to the others travel to their owners and back by all-to-all.

The dispatcher is transformers' own (>= 5.19, through ``parallel.transformers_ep``, which owns the release seam):
its ``ep_dispatch_experts`` plan (``EpDispatchExpertsParallel``:
the (token, expert) pairs sorted by owner, counts and tokens exchanged with an autograd-capable
``all_to_all_single``, the local experts run, the outputs sent back and weighted) with the expert weights as
DTensors ``Shard(0)`` over a mesh of the CP group (``grouped_gemm``). The plan is the model config's
``base_model_ep_plan``, or for a family transformers has none for, the one its adapter module declares
(``feed_forward.expert_plan``: its experts module and their weights, given the same two styles here); a family with
neither is refused by name.

Every rank must call every MoE layer the same number of times, in the same order: the CP walk does (every rank runs
every step of the plan, a rank without a response in a replay round replays a one-token dummy), so R > 1 is
required; with R = 1 the ranks would run different groups and their all-to-alls would not match.

Gradients: an expert shard's gradient is the whole group's (the all-to-all's backward brings every rank's tokens'
gradient to the owner), while a dense parameter's is this rank's share of the sum over the group, as under CP
without experts. ``expert_parameters`` names the first kind.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from ..errors import UnsupportedModelError
from ..feed_forward import expert_plan as declared_expert_plan
from ..lora import base_model
from . import transformers_ep
from .fsdp2 import mesh_device
from .transformers_ep import DISPATCH, SHARDED, matches


def declared_plan(model: nn.Module) -> dict[str, str]:
    """The expert-parallel plan ``model``'s family declares (``feed_forward.register_expert_plan``) in
    transformers' styles, full names relative to the transformers model (a peft model's base model): its experts
    module dispatched, their weights split; empty where the family declares none."""
    model = base_model(model)
    declared = declared_expert_plan(model.config.model_type)
    if declared is None:
        return {}
    prefix = f"{model.base_model_prefix}." if getattr(model, "base_model_prefix", "") else ""
    experts = f"{prefix}{declared.experts}"
    return {**{f"{experts}.{weight}": SHARDED for weight in declared.weights}, experts: DISPATCH}


def expert_plan(model: nn.Module) -> dict[str, str]:
    """``model``'s expert-parallel plan, full module and parameter names (``*`` for a layer number) to
    transformers' styles: its ``ep_plan`` (the config's ``base_model_ep_plan``), else its family's
    (``declared_plan``); UnsupportedModelError naming the family when neither exists. Names are relative to the
    transformers model (a peft model's base model)."""
    model = base_model(model)
    plan = dict(getattr(model, "ep_plan", None) or {}) or declared_plan(model)
    if DISPATCH not in plan.values():
        raise UnsupportedModelError(
            f"model_type {model.config.model_type!r} has no expert-parallel plan (neither transformers' "
            "base_model_ep_plan nor one its LongStraw adapter module declares, feed_forward.register_expert_plan): "
            "set expert_parallel: false")
    return plan


def _dispatched(model: nn.Module, plan: dict[str, str]) -> list[tuple[str, nn.Module]]:
    """(name, module) of every experts module of ``model`` (a transformers model) the plan dispatches to."""
    patterns = [name for name, style in plan.items() if style == DISPATCH]
    return [(name, module) for name, module in model.named_modules() if any(matches(p, name) for p in patterns)]


def dispatched_experts(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of every routed-experts module of ``model`` (a peft model: its base model's; names relative
    to it) that its expert plan dispatches to, one per MoE layer in layer order: what expert parallelism splits
    over the CP group and keeps out of FSDP2. UnsupportedModelError for a model without a plan."""
    model = base_model(model)
    return _dispatched(model, expert_plan(model))


def check_expert_parallel(model: nn.Module, world: int) -> dict[str, str]:
    """Whether ``model``'s routed experts can be put on a CP group of ``world`` ranks; returns its plan
    (``expert_plan``). Raises naming the field and the fix: ValueError for R = 1 or experts not divisible by R,
    UnsupportedModelError for an old transformers or a family without a plan. The same on every rank (it reads
    the model and ``world`` only)."""
    transformers_ep.generation()
    if world < 2:
        raise ValueError(
            "expert_parallel needs context_parallel_size > 1: the experts are split over the CP group, whose ranks "
            "call every MoE layer in lockstep (with context_parallel_size 1 the ranks run different groups and the "
            "all-to-all would hang); set context_parallel_size >= 2 or expert_parallel: false")
    model = base_model(model)
    plan = expert_plan(model)
    experts = _dispatched(model, plan)
    if not experts:
        raise UnsupportedModelError(f"model_type {model.config.model_type!r}: its expert-parallel plan names no "
                                    "module of this model (already sharded, or a changed module layout)")
    sharded = [name for name, style in plan.items() if style == SHARDED]
    for name, module in experts:
        unsplit = [p_name for p_name, _ in module.named_parameters() if not any(
            matches(pattern, f"{name}.{p_name}") for pattern in sharded)]
        if unsplit:
            raise UnsupportedModelError(
                f"expert_parallel splits exactly the plan's expert weights, but {name} also holds {unsplit}: LoRA "
                "adapters on the routed experts cannot be split (peft's all-linear adds the experts' parameters); "
                "target the dense modules only (veRL: actor_rollout_ref.model.target_modules as a list, e.g. "
                "[q_proj, k_proj, v_proj, o_proj]) or set expert_parallel: false")
    counts = sorted({module.num_experts for _, module in experts})
    if any(count % world for count in counts):
        raise ValueError(
            f"expert_parallel splits each MoE layer's {'/'.join(map(str, counts))} routed experts over "
            f"context_parallel_size = {world} ranks: they must divide evenly; set context_parallel_size to a divisor "
            "of the expert count or expert_parallel: false")
    return plan


def apply_expert_parallel(model: nn.Module, group: DeviceMesh | dist.ProcessGroup | None = None
                          ) -> frozenset[nn.Parameter]:
    """Put ``model``'s routed experts on ``group`` (the CP group, or its one-dimensional mesh: FSDP2's mesh where
    FSDP2 shards the rest, so that both kinds of DTensor meet in one gradient norm; None: the default group), E / R
    per rank, tokens dispatched by all-to-all (module docstring). Checks first (``check_expert_parallel``); returns
    the expert parameters (``expert_parameters``). Every rank of the group calls it, on the same model. Each rank
    keeps its slice of the weights it has; a rank whose experts are on the meta device gets empty shards to be
    filled by ``broadcast_expert_weights`` (which replaces those parameters: read ``expert_parameters``
    after it)."""
    model = base_model(model)
    if isinstance(group, DeviceMesh):
        mesh = group
    else:
        mesh = DeviceMesh.from_group(group if group is not None else dist.group.WORLD,
                                     next(p for p in model.parameters() if not p.is_meta).device.type)
    plan = check_expert_parallel(model, mesh.size())
    transformers_ep.apply(model, mesh, plan)
    return expert_parameters(model)


def expert_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """The routed-expert parameters of ``model`` before ``apply_expert_parallel``, by full name (detached, the
    same storage): what ``broadcast_expert_weights`` sends from the rank that holds the loaded weights."""
    return {f"{name}.{p_name}": p.detach() for name, module in dispatched_experts(model)
            for p_name, p in module.named_parameters()}


@torch.no_grad()
def broadcast_expert_weights(model: nn.Module, weights: dict[str, torch.Tensor] | None, src: int = 0) -> None:
    """Fill every rank's expert shards (after ``apply_expert_parallel``) from ``weights``, the full expert weights
    of the rank ``src`` of the default group (``expert_weights``; None on every other rank): one shard's rows at a
    time are broadcast to every rank, and the ranks whose shard it is copy it (a transient of one shard). A shard
    on the meta device is made first, on its mesh's device. Every rank of the default group calls it."""
    for name, module in dispatched_experts(model):
        for p_name, param in list(module.named_parameters()):
            local = param.to_local()
            if local.is_meta:
                local = torch.empty_like(local, device=mesh_device(param.device_mesh))
                module._parameters[p_name] = nn.Parameter(
                    DTensor.from_local(local, param.device_mesh, param.placements, run_check=False),
                    requires_grad=param.requires_grad)
            rows, owner = local.shape[0], param.device_mesh.get_local_rank()
            for shard in range(param.device_mesh.size()):
                part = torch.empty_like(local)
                if dist.get_rank() == src:
                    part.copy_(weights[f"{name}.{p_name}"][shard * rows:(shard + 1) * rows])
                dist.broadcast(part, src=src)
                if shard == owner:
                    local.copy_(part)


@contextmanager
def experts_set_aside(model: nn.Module) -> Iterator[None]:
    """Take ``model``'s routed-experts modules (those its expert plan dispatches to) out of the module tree for the
    block, an empty module in each place, then put them back where they were: what wraps the rest with FSDP2 and
    loads its weights (veRL's ``_build_fsdp_module``) never sees them."""
    taken = []
    for name, module in dispatched_experts(model):
        parent_name, _, attribute = name.rpartition(".")
        parent = base_model(model).get_submodule(parent_name)
        taken.append((parent, attribute, module))
        parent._modules[attribute] = nn.Module()  # keeps its place in the parent's order
    try:
        yield
    finally:
        for parent, attribute, module in taken:
            parent._modules[attribute] = module


@contextmanager
def trace_all_to_all() -> Iterator[list[int]]:
    """Bytes of every token tensor this rank passes to the experts' all-to-alls inside the block, appended to the
    yielded list: the forward's (the (token, expert) pairs sent to their owners, the outputs sent back) and, for
    those autograd will differentiate, the gradient each backward sends. (Not the per-expert counts, E int64 per
    call.) Wraps the name the installed release's dispatcher calls (``transformers_ep.token_all_to_all``: torch's
    functional collective; tests/parallel/test_experts.py pins that the dispatcher goes through it)."""
    module, attribute, original = transformers_ep.token_all_to_all()
    sent: list[int] = []

    def traced(tensor: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        sent.append(tensor.numel() * tensor.element_size())
        out = original(tensor, *args, **kwargs)
        if out.requires_grad:
            out.register_hook(lambda grad: sent.append(grad.numel() * grad.element_size()))
        return out

    setattr(module, attribute, traced)
    try:
        yield sent
    finally:
        setattr(module, attribute, original)


def expert_parameters(model: nn.Module) -> frozenset[nn.Parameter]:
    """The routed-expert parameters ``apply_expert_parallel`` sharded over the CP group (DTensors ``Shard(0)``):
    their gradients are already the whole group's."""
    return frozenset(p for _, module in dispatched_experts(model) for p in module.parameters()
                     if isinstance(p, DTensor))
