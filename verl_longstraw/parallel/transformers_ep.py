"""The one seam between LongStraw's expert parallelism and transformers' (``parallel.experts`` calls only this).

transformers' expert-parallel entry point has changed shape three times since its ``ep_dispatch_experts`` plan came
(5.19), so each generation is a row of ``GENERATIONS``, read in the released wheels:

=========  ======================================  =====================================  ======  ==========
since      ``apply_expert_parallelism`` lives in    token all-to-all it calls               plan    ``tp_mesh``
=========  ======================================  =====================================  ======  ==========
5.19.0     ``distributed.tensor_parallel``          ``all_to_all_single``                  ``*``   None
5.21.0     ``distributed.tensor_parallel``          ``all_to_all_single_autograd``         ``*``   None
5.22.0     ``distributed.expert_parallel``          ``all_to_all_single_autograd``         ``*``   None
5.23.0     ``distributed.expert_parallel``          ``all_to_all_single_autograd``         names   size 1
=========  ======================================  =====================================  ======  ==========

- plan ``*``: each module and parameter name is matched against the plan with its layer numbers made ``*``; a
  concrete name matches nothing (nothing is sharded, silently). Plan "names": each plan key is looked up literally in
  ``named_modules()`` / ``named_parameters()`` (a ``*`` key raises KeyError), so the plan is expanded here to the
  model's concrete names (``concrete_plan``).
- ``tp_mesh``: the ranks holding the same batch. Before 5.23 None means "no TP"; from 5.23 the dispatcher reads its
  size and its group, so each rank passes a mesh of itself alone, and names the ``all_to_all`` implementation (the
  one that differentiates through the exchange; "auto" picks it too when the batches differ, as under CP).

A release newer than ``NEWEST_TESTED`` runs on the newest row; if its entry point is gone, or applying the plan fails
or leaves an expert weight unsharded, ``apply`` raises UnsupportedModelError naming the release and the fix.
tests/parallel/test_transformers_ep.py pins each generation's calling convention against a stand-in with its lookup
rules, and the installed release's against the real one.
"""

from __future__ import annotations

import functools
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

    @property
    def name(self) -> str:
        return f"transformers>={self.since}"


GENERATIONS = (
    Generation(Version("5.19.0"), "transformers.distributed.tensor_parallel", "all_to_all_single", False),
    Generation(Version("5.21.0"), "transformers.distributed.tensor_parallel", "all_to_all_single_autograd", False),
    Generation(Version("5.22.0"), "transformers.distributed.expert_parallel", "all_to_all_single_autograd", False),
    Generation(Version("5.23.0"), "transformers.distributed.expert_parallel", "all_to_all_single_autograd", True),
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


@functools.cache
def _own_mesh(rank: int, device_type: str) -> DeviceMesh:
    """A one-rank mesh of ``rank`` (the process's global rank), made once per process: transformers' "no TP"."""
    return DeviceMesh.from_group(dist.new_group([rank], use_local_synchronization=True), device_type)


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
