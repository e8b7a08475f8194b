"""FSDP2 control for replay: how the engine keeps every rank's FSDP collectives in step.

LongStraw calls the root module and each decoder layer several times per prompt group, and
the number of calls depends on the group (prompt length, chunks, responses).

- One group per rank (context_parallel_size 1): groups differ between data-parallel ranks, so
  with FSDP2's per-call unshard/reshard (and a reduce-scatter per backward) the ranks would
  issue different numbers of collectives and hang. Inside `held_unsharded` every FSDP module is
  all-gathered once, in the same order on every rank; no forward/backward issues a collective.
  `sync_gradients` then reduce-scatters the accumulated gradients with one backward that every
  rank runs identically.
- Context parallel: FSDP2 shards over the CP group only, whose ranks run one group in lockstep,
  so its per-layer all-gathers and per-backward reduce-scatters match and parameters stay
  sharded. CP groups (data-parallel replicas) differ in call counts, so their gradient shards
  are averaged once per step by `average_over_replicas`, outside FSDP2.
"""

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor


def mesh_device(mesh: DeviceMesh) -> torch.device:
    """This rank's device of ``mesh``: its device type at the current index (the host for a CPU mesh)."""
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    return torch.device(mesh.device_type, getattr(torch, mesh.device_type).current_device())


def compute_device(model: nn.Module) -> torch.device:
    """The device ``model`` computes on: its parameters', or where FSDP2 keeps their shards on the host (veRL's
    ``offload_policy``: ``CPUOffloadPolicy``, which gathers each unit onto its mesh's device to run it) that mesh's
    device. What the walk puts its token ids and prompt state on."""
    param = next(model.parameters())
    if isinstance(param, DTensor) and param.device.type == "cpu":
        return mesh_device(param.device_mesh)
    return param.device


def verl_wrap_targets(model: nn.Module) -> list[nn.Module]:
    """The modules veRL's FSDP2 wrapping shards on their own, in ``named_modules`` order: each module whose class is
    one of ``model._no_split_modules`` (the decoder layers), and the input embedding and ``lm_head`` unless the
    model ties them. veRL 0.9.1's ``verl.utils.fsdp_utils._select_fsdp2_wrap_targets`` with veRL's default wrap
    policy, restated for the dry run, which runs without veRL (tests/parallel/test_fsdp2.py pins the two equal)."""
    layer_classes = set(getattr(model, "_no_split_modules", None) or ())
    if not layer_classes:
        raise ValueError(f"{type(model).__name__} names no _no_split_modules: veRL's FSDP2 wrapping needs the "
                         "decoder layer class (veRL's fsdp_config.wrap_policy.transformer_layer_cls_to_wrap)")
    by_name = set() if getattr(model.config, "tie_word_embeddings", False) else {"embed_tokens", "lm_head"}
    return [module for name, module in model.named_modules()
            if type(module).__name__ in layer_classes
            or (isinstance(module, nn.Embedding) and by_name)
            or (name.rsplit(".", 1)[-1] in by_name and hasattr(module, "weight"))]


def shard_as_verl(model: nn.Module, mesh: DeviceMesh, param_dtype: torch.dtype, reduce_dtype: torch.dtype,
                  offload: bool) -> nn.Module:
    """``model`` ``fully_shard``-ed over ``mesh`` as veRL's FSDP2 engine does it (``apply_fsdp2``): each of
    ``verl_wrap_targets``, then the root; mixed precision computing in ``param_dtype``, reducing gradients in
    ``reduce_dtype`` (forward inputs cast); resharded after forward (veRL's default); ``offload``: veRL's
    ``offload_policy``, the shards, their gradients and the optimizer step on pinned host memory. In place."""
    kwargs = {"mesh": mesh, "reshard_after_forward": True,
              "mp_policy": MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype,
                                                cast_forward_inputs=True)}
    if offload:
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=True)
    for module in verl_wrap_targets(model):
        fully_shard(module, **kwargs)
    return fully_shard(model, **kwargs)


def _fsdp_modules(root: nn.Module) -> list[FSDPModule]:
    return [m for m in root.modules() if isinstance(m, FSDPModule)]


@dataclass(frozen=True)
class ShardingSettings:
    """One FSDP2 module's settings, as its public setters take them."""

    reshard_after_forward: bool
    reshard_after_backward: bool
    requires_gradient_sync: bool

    def apply(self, module: FSDPModule) -> None:
        """Set them on `module` alone (not its FSDP submodules) through FSDP2's public setters."""
        module.set_reshard_after_forward(self.reshard_after_forward, recurse=False)
        module.set_reshard_after_backward(self.reshard_after_backward, recurse=False)
        module.set_requires_gradient_sync(self.requires_gradient_sync, recurse=False)


HELD = ShardingSettings(reshard_after_forward=False, reshard_after_backward=False, requires_gradient_sync=False)


def sharding_settings(root: nn.Module) -> dict[FSDPModule, ShardingSettings]:
    """Each FSDP2 module of `root` (the module fully_shard was applied to last) with its current settings.

    The one place that reads FSDP2's private state: FSDP2 has setters for these settings but
    no getters, and the root settles its own reshard-after-forward at its lazy initialization
    (normally its first forward), which this runs first. tests/parallel/test_fsdp2.py pins
    the readings against the public setters. A module without parameters reads as `HELD`.
    """
    if isinstance(root, FSDPModule):
        root._get_fsdp_state()._lazy_init()
    settings = {}
    for module in _fsdp_modules(root):
        group = module._get_fsdp_state()._fsdp_param_group
        if group is None:
            settings[module] = HELD
            continue
        if group.post_forward_mesh_info not in (None, group.mesh_info):
            raise ValueError(
                f"{type(module).__name__} reshards to a smaller mesh after forward (an int reshard_after_forward); "
                "LongStraw restores FSDP2 settings through the public bool setter: use a bool."
            )
        settings[module] = ShardingSettings(
            reshard_after_forward=group.post_forward_mesh_info is not None,
            reshard_after_backward=group.reshard_after_backward,
            requires_gradient_sync=group.reduce_grads,
        )
    return settings


@contextmanager
def held_unsharded(root: nn.Module) -> Iterator[None]:
    """All-gather every FSDP2 module of `root` once; keep them unsharded and gradient sync off.

    On exit restores each module's settings as they were on entry and reshards. Gradients
    accumulate unsharded until `sync_gradients`.
    """
    saved = sharding_settings(root)
    for module in saved:
        HELD.apply(module)
    try:
        for module in saved:
            module.unshard()
        yield
    finally:
        for module, settings in saved.items():
            settings.apply(module)
        for module in saved:
            module.reshard()


def sync_gradients(root: nn.Module, device: str, autocast_dtype: torch.dtype) -> None:
    """Reduce-scatter the gradients accumulated inside `held_unsharded` (call it inside).

    Runs a one-token forward whose loss is multiplied by zero, with gradient sync on: every
    parameter group's post-backward hook reduce-scatters its accumulated gradient (plus zeros).
    The call is identical on every rank, so the collectives match.
    """
    modules = _fsdp_modules(root)
    if not modules:
        return
    for m in modules:
        m.set_requires_gradient_sync(True, recurse=False)
    ids = torch.zeros(1, 1, dtype=torch.long, device=device)
    device_type = device.split(":")[0]
    ctx = (
        torch.autocast(device_type=device_type, dtype=autocast_dtype)
        if autocast_dtype != torch.float32
        else torch.autocast(device_type=device_type, enabled=False)
    )
    with torch.enable_grad(), ctx:
        logits = root(input_ids=ids, use_cache=False).logits
    (logits.float().sum() * 0.0).backward()
    for m in modules:
        m.set_requires_gradient_sync(False, recurse=False)


def average_over_replicas(root: nn.Module, group: dist.ProcessGroup) -> None:
    """Average each parameter's local gradient shard over ``group`` (the ranks holding the same shard
    in the other CP groups), in place, one all-reduce per parameter in registration order.

    Every parameter takes part (zeros where this replica has no gradient), so the calls are the same
    on every rank; a parameter without a gradient gets the average."""
    replicas = dist.get_world_size(group)
    for p in root.parameters():
        grad = _local(p.grad) if p.grad is not None else torch.zeros_like(_local(p.data))
        dist.all_reduce(grad, group=group)
        grad /= replicas
        if p.grad is None:
            p.grad = _as_param_like(p, grad)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _as_param_like(p: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    if isinstance(p, DTensor):
        return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False)
    return local
