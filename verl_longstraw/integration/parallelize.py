"""Context and expert parallelism of the longstraw engine, applied from outside veRL's FSDP2 engine (torchtitan's
style: the engine calls these at veRL's hooks: its device mesh, its FSDP2 wrapping, its loss and gradients).

With ``longstraw.context_parallel_size`` R > 1 the ranks form CP groups of R consecutive ranks
(``context_parallel_mesh``), FSDP2 sharding over the CP group (CP groups are replicas: HSDP). veRL dispatches by
the data-parallel rank the engine reports (rank // R, like Ulysses), so the R ranks receive the same micro-batches
and run every group together in lockstep (``verl_longstraw.parallel``): each holds 1/R of the prompt state,
parameters stay sharded layer by layer, and each backward reduce-scatters inside the CP group. Every rank ends with
a disjoint part of the group's gradient and FSDP averages the R parts, so the loss gradient is scaled by R
(``scale_loss``; veRL's Ulysses gather does the same); veRL's loss already carries the data-parallel factor that
the replica average divides out.

With ``longstraw.expert_parallel`` each MoE layer's routed experts are split over the CP group instead
(``build_expert_parallel``; ``verl_longstraw.parallel.experts``, transformers' plan): E / R resident per rank
outside FSDP2, the tokens routed to another rank's experts exchanged by all-to-all in the CP walk's lockstep. An
expert's gradient arrives as the group's sum, so what a step adds to it is divided by R
(``unscale_expert_gradients``); replicas average it with the rest.
"""

from contextlib import nullcontext
from typing import Any, Callable, ContextManager, Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from verl.utils.device import get_device_name

from verl_longstraw.parallel import experts

from .config import check_context_parallel

ExpertGradients = dict[torch.nn.Parameter, Optional[torch.Tensor]]
"""Each expert-parallel parameter that trains with a copy of its gradient (None: none yet, as after veRL's
zero_grad)."""


def context_parallel_mesh(cp_size: int, fsdp_size: int) -> Optional[DeviceMesh]:
    """The ("dp", "cp") mesh of the world's ranks in CP groups of ``cp_size`` consecutive ranks (its "cp" mesh:
    FSDP2's), after checking ``cp_size`` against the world and veRL's ``fsdp_size``; None without context
    parallelism."""
    world = dist.get_world_size()
    check_context_parallel(cp_size, world, fsdp_size, where="actor_rollout_ref.actor")
    if cp_size == 1:
        return None
    return init_device_mesh(get_device_name(), mesh_shape=(world // cp_size, cp_size), mesh_dim_names=("dp", "cp"))


def build_expert_parallel(module: torch.nn.Module, mesh: DeviceMesh,
                          build: Callable[[torch.nn.Module], torch.nn.Module]) -> torch.nn.Module:
    """``build`` (veRL's FSDP2 wrapping and weight loading) with the routed experts set aside, then the experts
    split over ``mesh`` (the CP group, FSDP2's mesh) and filled from rank 0's loaded weights
    (``parallel.experts``)."""
    experts.check_expert_parallel(module, mesh.size())  # LoRA on the experts: refused before any collective
    weights = experts.expert_weights(module) if dist.get_rank() == 0 else None
    with experts.experts_set_aside(module):
        module = build(module)
    experts.apply_expert_parallel(module, mesh)
    experts.broadcast_expert_weights(module, weights)
    return module


def scale_loss(loss: torch.Tensor, scaler: Optional[Any], cp_size: int) -> torch.Tensor:
    """The loss each rank backpropagates: through the gradient ``scaler`` if any, times R = ``cp_size`` under
    context parallelism (every rank of a CP group backpropagates its own part; the module docstring). Expert-parallel
    experts' gradients are divided by R back (``unscale_expert_gradients``)."""
    scaled = scaler.scale(loss) if scaler is not None else loss
    return scaled * cp_size if cp_size > 1 else scaled


def expert_gradients(module: torch.nn.Module) -> ExpertGradients:
    """Each expert-parallel parameter of ``module`` that trains with a copy of its gradient so far."""
    return {p: None if p.grad is None else p.grad.detach().clone()
            for p in experts.expert_parameters(module) if p.requires_grad}


def unscale_expert_gradients(before: ExpertGradients, cp_size: int) -> None:
    """Divide by R = ``cp_size`` what a call's backward added to each expert gradient (``before``:
    ``expert_gradients`` at the call's start). An expert's gradient arrives as the whole CP group's sum of the
    losses ``scale_loss`` scaled by R, where FSDP2 averages the dense parameters' over the group. (Not a tensor hook:
    veRL's parameter offload moves the parameters and the hooks do not survive it.)"""
    for param, earlier in before.items():
        if param.grad is None:
            continue
        if earlier is None:
            param.grad.div_(cp_size)
        else:
            param.grad.sub_(earlier).div_(cp_size).add_(earlier)


def trace_experts(expert_parallel: bool) -> ContextManager[list[int]]:
    """The experts' all-to-all bytes of this rank inside the block (``experts.trace_all_to_all``), an empty list
    without expert parallelism."""
    return experts.trace_all_to_all() if expert_parallel else nullcontext([])
