"""Expert parallelism over the context-parallel group: each of the R ranks of a CP group holds E / R of every MoE
layer's routed experts, and the tokens routed to the others travel to their owners and back by all-to-all.

The dispatcher is transformers' own (>= 5.19): its ``ep_dispatch_experts`` plan (``EpDispatchExpertsParallel``:
the (token, expert) pairs sorted by owner, counts and tokens exchanged with an autograd-capable
``all_to_all_single``, the local experts run, the outputs sent back and weighted) with the expert weights as
DTensors ``Shard(0)`` over a mesh of the CP group (``grouped_gemm``). The plan is the model config's
``base_model_ep_plan``, or for a family transformers has none for, the adapter's ``expert_plan`` (data: the same two
styles on its experts module's names); a family with neither is refused by name.

Every rank must call every MoE layer the same number of times, in the same order: the CP walk does (every rank runs
every step of the plan, a rank without a response in a replay round replays a one-token dummy), so R > 1 is
required; with R = 1 the ranks would run different groups and their all-to-alls would not match.

Gradients: an expert shard's gradient is the whole group's (the all-to-all's backward brings every rank's tokens'
gradient to the owner), while a dense parameter's is this rank's share of the sum over the group, as under CP
without experts. ``expert_parameters`` names the first kind.
"""

from __future__ import annotations

import importlib.metadata

import torch.distributed as dist
from packaging.version import Version
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from ..adapters import adapter_for
from ..errors import UnsupportedModelError

MIN_TRANSFORMERS = Version("5.19.0")  # the first release with the ep_dispatch_experts plan
DISPATCH, SHARDED = "ep_dispatch_experts", "grouped_gemm"  # transformers' plan styles: the module, its weights


def _transformers_expert_parallelism():
    """transformers' ``apply_expert_parallelism``; UnsupportedModelError naming the release needed."""
    installed = Version(importlib.metadata.version("transformers"))
    try:
        from transformers.distributed.tensor_parallel import apply_expert_parallelism
    except ImportError:
        apply_expert_parallelism = None
    if installed < MIN_TRANSFORMERS or apply_expert_parallelism is None:
        raise UnsupportedModelError(
            f"expert_parallel needs transformers>={MIN_TRANSFORMERS} (its ep_dispatch_experts plan); transformers "
            f"{installed} is installed: pip install 'transformers>={MIN_TRANSFORMERS}' or set expert_parallel: false")
    return apply_expert_parallelism


def expert_plan(model: nn.Module) -> dict[str, str]:
    """``model``'s expert-parallel plan, full module and parameter names (``*`` for a layer number) to
    transformers' styles: its ``ep_plan`` (the config's ``base_model_ep_plan``), else its adapter's ``expert_plan``
    under the base model's name; UnsupportedModelError naming the family when neither exists."""
    plan = dict(getattr(model, "ep_plan", None) or {})
    if not plan:
        own = adapter_for(model).expert_plan
        prefix = f"{model.base_model_prefix}." if getattr(model, "base_model_prefix", "") else ""
        plan = {f"{prefix}{name}": style for name, style in (own or {}).items()}
    if DISPATCH not in plan.values():
        raise UnsupportedModelError(
            f"model_type {model.config.model_type!r} has no expert-parallel plan (neither transformers' "
            "base_model_ep_plan nor its LongStraw adapter's expert_plan): set expert_parallel: false")
    return plan


def _matches(pattern: str, name: str) -> bool:
    parts, names = pattern.split("."), name.split(".")
    return len(parts) == len(names) and all(p == "*" and n.isdigit() or p == n for p, n in zip(parts, names,
                                                                                              strict=True))


def _dispatched(model: nn.Module, plan: dict[str, str]) -> list[tuple[str, nn.Module]]:
    """(name, module) of every experts module the plan dispatches to."""
    patterns = [name for name, style in plan.items() if style == DISPATCH]
    return [(name, module) for name, module in model.named_modules() if any(_matches(p, name) for p in patterns)]


def check_expert_parallel(model: nn.Module, world: int) -> dict[str, str]:
    """Whether ``model``'s routed experts can be put on a CP group of ``world`` ranks; returns its plan
    (``expert_plan``). Raises naming the field and the fix: ValueError for R = 1 or experts not divisible by R,
    UnsupportedModelError for an old transformers or a family without a plan. The same on every rank (it reads
    the model and ``world`` only)."""
    _transformers_expert_parallelism()
    if world < 2:
        raise ValueError(
            "expert_parallel needs context_parallel_size > 1: the experts are split over the CP group, whose ranks "
            "call every MoE layer in lockstep (with context_parallel_size 1 the ranks run different groups and the "
            "all-to-all would hang); set context_parallel_size >= 2 or expert_parallel: false")
    plan = expert_plan(model)
    experts = _dispatched(model, plan)
    if not experts:
        raise UnsupportedModelError(f"model_type {model.config.model_type!r}: its expert-parallel plan names no "
                                    "module of this model (already sharded, or a changed module layout)")
    counts = sorted({module.num_experts for _, module in experts})
    if any(count % world for count in counts):
        raise ValueError(
            f"expert_parallel splits each MoE layer's {'/'.join(map(str, counts))} routed experts over "
            f"context_parallel_size = {world} ranks: they must divide evenly; set context_parallel_size to a divisor "
            "of the expert count or expert_parallel: false")
    return plan


def apply_expert_parallel(model: nn.Module, group: dist.ProcessGroup | None = None) -> frozenset[nn.Parameter]:
    """Put ``model``'s routed experts on ``group`` (the CP group; None: the default group), E / R per rank, tokens
    dispatched by all-to-all (module docstring). Checks first (``check_expert_parallel``); returns the expert
    parameters (``expert_parameters``). Every rank of the group calls it, on the same model."""
    apply_expert_parallelism = _transformers_expert_parallelism()
    world = dist.get_world_size(group)
    plan = check_expert_parallel(model, world)
    device = next(model.parameters()).device
    mesh = DeviceMesh.from_group(group if group is not None else dist.group.WORLD, device.type)
    apply_expert_parallelism(model, mesh, None, plan)
    return expert_parameters(model)


def expert_parameters(model: nn.Module) -> frozenset[nn.Parameter]:
    """The routed-expert parameters ``apply_expert_parallel`` sharded over the CP group (DTensors ``Shard(0)``):
    their gradients are already the whole group's."""
    return frozenset(p for _, module in _dispatched(model, expert_plan(model)) for p in module.parameters()
                     if isinstance(p, DTensor))
