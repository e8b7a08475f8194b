"""``parallel.transformers_ep``, the seam to transformers' expert parallelism: each API generation's calling
convention against a stand-in with that generation's lookup rules (read in the released wheels), the refusals of a
release that changes it again, and the installed release against its row. In one process, on torch's fake process
group (two ranks, no collectives run): the stand-ins shard with real DTensors, as transformers does. The real
dispatcher runs in tests/parallel/test_experts.py, on transformers 5.19 (the suite) and the newest release
(.ci/run's newest-releases check)."""

from __future__ import annotations

import inspect
import re
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import transformers
from packaging.version import Version
from torch.distributed._functional_collectives import all_to_all_single, all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor
from torch.testing._internal.distributed.fake_pg import FakeStore

from verl_longstraw.errors import UnsupportedModelError
from verl_longstraw.parallel import experts as ep
from verl_longstraw.parallel import transformers_ep as seam
from verl_longstraw.tiny import tiny_model

EXPERTS, RANKS = 6, 2
TOKEN_ALL_TO_ALL = {"all_to_all_single": all_to_all_single, "all_to_all_single_autograd": all_to_all_single_autograd}


@pytest.fixture(scope="module")
def mesh():
    """A two-rank CPU mesh on torch's fake process group (this process is rank 0). A default group an earlier test
    left in this process (the in-process veRL engine tests and tests/parallel/test_fsdp2.py keep a one-rank gloo
    group, and make it again where none is) is closed first; this one is closed at the end."""
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", rank=0, world_size=RANKS, store=FakeStore())
    yield DeviceMesh("cpu", list(range(RANKS)))
    dist.destroy_process_group()


def _shard(module, name: str, ep_mesh: DeviceMesh) -> None:
    """What transformers' ``grouped_gemm`` style does to one weight: Shard(0) over the mesh, E / R experts."""
    weight = module._parameters[name]
    module.num_experts = weight.shape[0] // ep_mesh.size()
    module._parameters[name] = torch.nn.Parameter(distribute_tensor(weight, ep_mesh, [Shard(0)], src_data_rank=None))


class PatternsRelease:
    """transformers 5.19-5.22's ``apply_expert_parallelism(model, ep_mesh, tp_mesh, plan)``: every module and
    parameter name has its layer numbers made ``*`` and is looked up in the plan (a concrete key matches nothing)."""

    def __init__(self):
        self.dispatched: list[tuple[str, int]] = []  # (module, its num_experts when its forward is replaced)

    def __call__(self, model, ep_mesh, tp_mesh, plan):
        assert tp_mesh is None  # "no TP" in these releases
        wildcard = lambda name: re.sub(r"\.\d+(\.|$)", lambda m: ".*" + m.group(1), name)  # noqa: E731
        for name, module in model.named_modules():
            for p_name, _ in list(module.named_parameters(recurse=False)):
                if plan.get(wildcard(f"{name}.{p_name}")) == seam.SHARDED:
                    _shard(module, p_name, ep_mesh)
            if plan.get(wildcard(name)) == seam.DISPATCH:
                self.dispatched.append((name, module.num_experts))
        return model


class NamesRelease(PatternsRelease):
    """transformers 5.23+'s ``apply_expert_parallelism(model, ep_mesh, tp_mesh, plan, ep_implementation)``: each
    plan key is looked up literally (KeyError for a ``*`` key), in the plan's order; ``tp_mesh`` is a real mesh."""

    def __call__(self, model, ep_mesh, tp_mesh, plan, ep_implementation="auto"):
        assert tp_mesh.size() == 1 and dist.get_process_group_ranks(tp_mesh.get_group()) == [dist.get_rank()]
        assert ep_implementation == "all_to_all"  # differentiable through the exchange
        modules, parameters = dict(model.named_modules()), dict(model.named_parameters())
        for name, style in plan.items():
            if name in parameters:
                module_name, _, p_name = name.rpartition(".")
                _shard(modules[module_name], p_name, ep_mesh)
            else:
                self.dispatched.append((name, modules[name].num_experts))  # KeyError for a pattern
        return model


def _stand_in(monkeypatch, release: str, apply, module_name: str | None = None, all_to_all: str | None = None):
    """Make ``release`` the installed transformers, its dispatcher module a namespace holding ``apply`` and the
    token all-to-all its generation names (or ``all_to_all``); ``module_name``: the only module importable."""
    row = seam.generation(Version(release))
    attribute = all_to_all or row.all_to_all
    module = SimpleNamespace(apply_expert_parallelism=apply, **{attribute: TOKEN_ALL_TO_ALL.get(attribute)})
    monkeypatch.setattr(seam, "installed_release", lambda: Version(release))

    def stand_in_import(name):
        if name != (module_name or row.module):
            raise ImportError(name)
        return module

    monkeypatch.setattr(seam, "_import", stand_in_import)
    return row


def _moe():
    return tiny_model("qwen3_moe", num_experts=EXPERTS)


def _experts(model) -> list[str]:
    return [name for name, _ in ep.dispatched_experts(model)]


@pytest.mark.parametrize("row", seam.GENERATIONS, ids=lambda row: row.name)
def test_each_generation_gets_its_calling_convention(mesh, monkeypatch, row):
    """Every expert weight sharded E / R, every experts module dispatched after its weights (it reads the local
    expert count), through the generation's entry point; the tracer wraps the generation's token all-to-all."""
    stand_in = NamesRelease() if row.literal_plan else PatternsRelease()
    assert _stand_in(monkeypatch, str(row.since), stand_in) == row
    model = _moe()
    ep.apply_expert_parallel(model, mesh)
    assert stand_in.dispatched == [(name, EXPERTS // RANKS) for name in _experts(model)]
    sharded = [p for p in ep.expert_parameters(model)]
    assert len(sharded) == 2 * len(stand_in.dispatched) and all(p.to_local().shape[0] == EXPERTS // RANKS
                                                                for p in sharded)
    module, attribute, function = seam.token_all_to_all()
    assert attribute == row.all_to_all and function is TOKEN_ALL_TO_ALL[attribute]


def test_the_concrete_plan_names_each_layer_parameters_first():
    model = _moe()
    plan = seam.concrete_plan(model, {**ep.expert_plan(model), "model.layers.*.no_such_module": seam.DISPATCH})
    experts = _experts(model)
    assert list(plan) == [f"{name}.{weight}" for name in experts for weight in ("gate_up_proj", "down_proj")] + experts
    assert set(plan.values()) == {seam.SHARDED, seam.DISPATCH} and "*" not in "".join(plan)


def test_a_release_that_changes_the_seam_again_is_refused_by_name(mesh, monkeypatch):
    """Newer than tested: the entry point moved, the plan rejected (the KeyError 5.23 raised for patterns), or
    applied to nothing: UnsupportedModelError naming the release, the tested range and the fix; never a KeyError."""
    fix = rf"tested on transformers {seam.MIN_TRANSFORMERS} to {seam.NEWEST_TESTED}.*expert_parallel: false"

    _stand_in(monkeypatch, "6.1.0", NamesRelease(), module_name="transformers.distributed.elsewhere")
    with pytest.raises(UnsupportedModelError, match=rf"transformers 6\.1\.0 has no .*apply_expert_parallelism.*{fix}"):
        ep.apply_expert_parallel(_moe(), mesh)

    def literal_patterns(model, ep_mesh, tp_mesh, plan, ep_implementation="auto"):
        raise KeyError("model.layers.*.mlp.experts.gate_up_proj")

    _stand_in(monkeypatch, "6.1.0", literal_patterns)
    with pytest.raises(UnsupportedModelError, match=rf"6\.1\.0 rejected the expert plan \(KeyError.*{fix}"):
        ep.apply_expert_parallel(_moe(), mesh)

    _stand_in(monkeypatch, "6.1.0", lambda model, *args, **kwargs: model)  # a lookup rule that matches nothing
    model = _moe()
    weights = 2 * len(_experts(model))
    with pytest.raises(UnsupportedModelError, match=rf"left {weights} planned expert weights unsharded.*{fix}"):
        ep.apply_expert_parallel(model, mesh)

    _stand_in(monkeypatch, "5.23.0", PatternsRelease().__call__)  # a convention mismatch: TypeError
    with pytest.raises(UnsupportedModelError, match=r"5\.23\.0 rejected the expert plan \(TypeError"):
        ep.apply_expert_parallel(_moe(), mesh)


def test_generations_by_release():
    assert [seam.generation(Version(v)).since for v in ("5.19.0", "5.20.2", "5.21.1", "5.22.2", "5.25.0", "6.0")] == [
        Version(v) for v in ("5.19.0", "5.19.0", "5.21.0", "5.22.0", "5.23.0", "5.23.0")]
    with pytest.raises(UnsupportedModelError, match=r"transformers>=5\.19\.0.*5\.18\.0 is installed"):
        seam.generation(Version("5.18.0"))


@pytest.mark.skipif(Version(transformers.__version__) < seam.MIN_TRANSFORMERS, reason="no ep_dispatch_experts plan")
def test_the_installed_release_is_its_rows_generation():
    """The real module has the entry point with the row's parameters and sends tokens with the function the row
    names (torch's functional collective), so the tracer and the call convention hold on this release."""
    row, module = seam.dispatcher_module()
    parameters = list(inspect.signature(module.apply_expert_parallelism).parameters)
    assert parameters[:4] == ["model", "ep_mesh", "tp_mesh", "plan"]
    assert ("ep_implementation" in parameters) == row.literal_plan
    assert getattr(module, row.all_to_all) is TOKEN_ALL_TO_ALL[row.all_to_all]


@pytest.mark.skipif(Version(transformers.__version__) < seam.MIN_TRANSFORMERS, reason="no ep_dispatch_experts plan")
def test_the_installed_dispatcher_takes_the_tokens_and_their_experts_first():
    """The dry run's routing stand-in (``dryrun.balanced_routing``) wraps the dispatcher's token dispatch and reads
    its first two arguments: the tokens and their top-k expert ids."""
    dispatcher, attribute = seam.token_dispatch()
    parameters = list(inspect.signature(getattr(dispatcher, attribute)).parameters)
    assert parameters[:3] == ["self", "hidden_states", "top_k_index"]
