"""The one seam between LongStraw's expert parallelism and transformers' (``parallel.experts`` calls only this).

transformers' expert-parallel entry point has changed shape three times since its ``ep_dispatch_experts`` plan came
(5.19), so each generation is a row of ``GENERATIONS``, read in the released wheels:

=========  ===============================  ===============================  =====  =========  =========================
since      ``transformers.distributed.``    token all-to-all it calls        plan   tp_mesh    dispatcher class
=========  ===============================  ===============================  =====  =========  =========================
5.19.0     ``tensor_parallel``              ``all_to_all_single``            ``*``  None       EpDispatchExpertsParallel
5.21.0     ``tensor_parallel``              ``all_to_all_single_autograd``   ``*``  None       EpDispatchExpertsParallel
5.22.0     ``expert_parallel``              ``all_to_all_single_autograd``   ``*``  None       EpDispatchExpertsParallel
5.23.0     ``expert_parallel``              ``all_to_all_single_autograd``   names  size 1     AllToAllEP
=========  ===============================  ===============================  =====  =========  =========================

- ``transformers.distributed.``: the module holding ``apply_expert_parallelism`` and the dispatcher.
- plan ``*``: each module and parameter name is matched against the plan with its layer numbers made ``*``; a
  concrete name matches nothing (nothing is sharded, silently). Plan "names": each plan key is looked up literally in
  ``named_modules()`` / ``named_parameters()`` (a ``*`` key raises KeyError), so the plan is expanded here to the
  model's concrete names (``concrete_plan``).
- dispatcher class: its ``_dispatch_tokens(self, hidden_states, top_k_index, ...)`` sends each (token, expert)
  pair to its owner and holds the layer's one host sync (the split sizes; the dry run answers it, ``token_dispatch``).
  From 5.23 it is the "all_to_all" implementation the plan is applied with.
- ``tp_mesh``: the ranks holding the same batch. Before 5.23 None means "no TP"; from 5.23 the dispatcher reads its
  size and its group, so each rank passes a mesh of itself alone, and names the ``all_to_all`` implementation (the
  one that differentiates through the exchange; "auto" picks it too when the batches differ, as under CP).

A release newer than ``NEWEST_TESTED`` runs on the newest row; if its entry point is gone, or applying the plan fails
or leaves an expert weight unsharded, ``apply`` raises UnsupportedModelError naming the release and the fix.
tests/parallel/test_transformers_ep.py pins each generation's calling convention against a stand-in with its lookup
rules, and the installed release's against the real one.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from dataclasses import dataclass
from typing import Callable

import torch.distributed as dist
from packaging.version import Version
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from ..errors import UnsupportedModelError

DISPATCH, SHARDED = "ep_dispatch_experts", "grouped_gemm"  # transformers' plan styles: the module, its weights


@dataclass(frozen=True)
class Generation:
    """How one run of transformers releases exposes expert parallelism (module docstring's table)."""

    since: Version
    module: str  # where ``apply_expert_parallelism`` and the dispatcher live
    all_to_all: str  # the name in ``module`` the dispatcher sends its tokens with (torch's functional collective)
    literal_plan: bool  # the 5.23 call: plan keys looked up literally, a one-rank ``tp_mesh``, ``ep_implementation``;
    # else plan keys matched with ``*`` layer numbers and ``tp_mesh`` None
    dispatcher: str  # the class in ``module`` whose ``_dispatch_tokens`` sends the (token, expert) pairs

    @property
    def name(self) -> str:
        return f"transformers>={self.since}"


GENERATIONS = (
    Generation(Version("5.19.0"), "transformers.distributed.tensor_parallel", "all_to_all_single", False,
               "EpDispatchExpertsParallel"),
    Generation(Version("5.21.0"), "transformers.distributed.tensor_parallel", "all_to_all_single_autograd", False,
               "EpDispatchExpertsParallel"),
    Generation(Version("5.22.0"), "transformers.distributed.expert_parallel", "all_to_all_single_autograd", False,
               "EpDispatchExpertsParallel"),
    Generation(Version("5.23.0"), "transformers.distributed.expert_parallel", "all_to_all_single_autograd", True,
               "AllToAllEP"),
)
MIN_TRANSFORMERS = GENERATIONS[0].since  # the first release with the ep_dispatch_experts plan
NEWEST_TESTED = Version("5.25.0")  # the newest release the EP parity tests ran on (.ci/run's newest-releases check)


def installed_release() -> Version:
    return Version(importlib.metadata.version("transformers"))


def generation(release: Version | None = None) -> Generation:
    """The row of ``GENERATIONS`` for ``release`` (default: the installed transformers); UnsupportedModelError
    naming the release needed for one older than ``MIN_TRANSFORMERS``."""
    release = installed_release() if release is None else release
    if release < MIN_TRANSFORMERS:
        raise UnsupportedModelError(
            f"expert_parallel needs transformers>={MIN_TRANSFORMERS} (its ep_dispatch_experts plan); transformers "
            f"{release} is installed: pip install 'transformers>={MIN_TRANSFORMERS}' or set expert_parallel: false")
    return [row for row in GENERATIONS if row.since <= release][-1]


def _untested(release: Version, what: str) -> UnsupportedModelError:
    return UnsupportedModelError(
        f"expert_parallel: transformers {release} {what}; LongStraw's expert parallelism is tested on "
        f"transformers {MIN_TRANSFORMERS} to {NEWEST_TESTED}: pip install 'transformers>={MIN_TRANSFORMERS},"
        f"<={NEWEST_TESTED}', or set expert_parallel: false")


def _import(name: str):
    """``importlib.import_module`` (the tests stand a generation's module in here)."""
    return importlib.import_module(name)


def dispatcher_module(release: Version | None = None) -> tuple[Generation, object]:
    """(the row of ``release``, default the installed transformers; the transformers module holding its
    ``apply_expert_parallelism`` and dispatcher); UnsupportedModelError when a release newer than tested moved it."""
    release = installed_release() if release is None else release
    row = generation(release)
    try:
        module = _import(row.module)
    except ImportError:
        module = None
    if module is None or not hasattr(module, "apply_expert_parallelism") or not hasattr(module, row.all_to_all):
        raise _untested(release, f"has no {row.module}.apply_expert_parallelism / .{row.all_to_all} "
                                 f"(the {row.name} entry point)")
    return row, module


def matches(pattern: str, name: str) -> bool:
    """Whether ``name`` (a module or parameter name) is ``pattern`` with each ``*`` a layer number."""
    parts, names = pattern.split("."), name.split(".")
    return len(parts) == len(names) and all(p == "*" and n.isdigit() or p == n
                                            for p, n in zip(parts, names, strict=True))


def concrete_plan(model: nn.Module, plan: dict[str, str]) -> dict[str, str]:
    """``plan`` (names with ``*`` for layer numbers) expanded to ``model``'s concrete module and parameter names, in
    the model's order: parameters first, then modules (a weight is sharded before its module's forward is
    replaced). A pattern naming nothing of this model is dropped (a family's plan may name layers it lacks)."""
    parameters = {name: style for name, _ in model.named_parameters()
                  for pattern, style in plan.items() if matches(pattern, name)}
    modules = {name: style for name, _ in model.named_modules()
               for pattern, style in plan.items() if matches(pattern, name)}
    return {**parameters, **modules}


_OWN_MESHES: dict[tuple[int, str], tuple[dist.ProcessGroup, DeviceMesh]] = {}  # (rank, device) -> (its world, mesh)


def _own_mesh(rank: int, device_type: str) -> DeviceMesh:
    """A one-rank mesh of ``rank`` (the process's global rank), made once per default process group (a process that
    makes a new one, as successive dry runs do, gets a new mesh): transformers' "no TP"."""
    world = dist.group.WORLD
    made = _OWN_MESHES.get((rank, device_type))
    if made is None or made[0] is not world:
        made = world, DeviceMesh.from_group(dist.new_group([rank], use_local_synchronization=True), device_type)
        _OWN_MESHES[rank, device_type] = made
    return made[1]


def apply(model: nn.Module, ep_mesh: DeviceMesh, plan: dict[str, str]) -> None:
    """Apply ``plan`` (``*`` layer numbers; ``parallel.experts.expert_plan``) to ``model`` (a transformers model) on
    ``ep_mesh`` through the installed release's ``apply_expert_parallelism``: each ``grouped_gemm`` weight becomes a
    ``Shard(0)`` DTensor over the mesh, each ``ep_dispatch_experts`` module's forward exchanges its tokens by
    all-to-all. Afterwards every planned expert weight must be a DTensor, else UnsupportedModelError naming the
    release (a silent no-op is the failure a changed lookup rule would cause)."""
    release = installed_release()
    row, module = dispatcher_module(release)
    expanded = concrete_plan(model, plan)
    try:
        if row.literal_plan:
            tp_mesh = _own_mesh(dist.get_rank(), ep_mesh.device_type)
            module.apply_expert_parallelism(model, ep_mesh, tp_mesh, expanded, ep_implementation="all_to_all")
        else:
            module.apply_expert_parallelism(model, ep_mesh, None, plan)
    except (KeyError, TypeError, AttributeError) as error:
        raise _untested(release, f"rejected the expert plan ({type(error).__name__}: {error})") from error
    unsharded = [name for name, param in model.named_parameters()
                 if expanded.get(name) == SHARDED and not isinstance(param, DTensor)]
    if unsharded:
        raise _untested(release, f"left {len(unsharded)} planned expert weights unsharded (e.g. {unsharded[0]})")


def token_all_to_all() -> tuple[object, str, Callable]:
    """(module, attribute, function): the name the installed release's dispatcher sends tokens with, for a tracer to
    wrap (``parallel.experts.trace_all_to_all``)."""
    row, module = dispatcher_module()
    return module, row.all_to_all, getattr(module, row.all_to_all)


def token_dispatch() -> tuple[type, str]:
    """(class, attribute): the installed release's dispatcher method that sends each (token, expert) pair to the
    expert's owner, ``_dispatch_tokens(self, hidden_states, top_k_index, ...)`` of the row's ``dispatcher`` in every
    generation (the rest of its parameters differ), for a stand-in to wrap (the dry run's routing: it holds the layer's
    one host sync, the per-rank split sizes). UnsupportedModelError naming the release where it is gone."""
    row, module = dispatcher_module()
    dispatcher = getattr(module, row.dispatcher, None)
    if dispatcher is None or not hasattr(dispatcher, "_dispatch_tokens"):
        raise _untested(installed_release(), f"has no {row.module}.{row.dispatcher}._dispatch_tokens")
    return dispatcher, "_dispatch_tokens"
