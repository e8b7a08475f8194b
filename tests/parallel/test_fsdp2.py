"""FSDP2 control (parallel/fsdp2.py) on a tiny fully_shard model: settings read back as the public
setters wrote them, held unsharded inside `held_unsharded`, restored as found on exit; the dry run's restatement of
veRL's FSDP2 wrap targets equals veRL's."""

import pytest
import torch
import transformers
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from verl_longstraw.model_terms import Lora, ParameterCounts, unsharded_bytes, unsharded_moments
from verl_longstraw.parallel.fsdp2 import HELD, ShardingSettings, held_unsharded, sharding_settings, verl_wrap_targets
from verl_longstraw.parallel.launch import free_port
from verl_longstraw.tiny import tiny_config


@pytest.fixture(scope="module")
def dist() -> None:
    """A world-size-1 gloo group (torch only: these helpers must import and run without veRL)."""
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                                             world_size=1)


@pytest.fixture
def model(dist) -> nn.Sequential:
    """Two FSDP2 layers and a root that owns the last layer's parameters (default settings)."""
    mesh = init_device_mesh("cpu", (1,))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(8, 2))
    for layer in model[:2]:
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _sharded(model: nn.Module) -> list[bool]:
    return [isinstance(p, DTensor) for p in model.parameters()]


def test_settings_read_back_what_the_public_setters_set(model):
    # fully_shard's default: the root keeps its parameters after forward once initialized, the others reshard
    defaults = ShardingSettings(reshard_after_forward=True, reshard_after_backward=True, requires_gradient_sync=True)
    root = ShardingSettings(reshard_after_forward=False, reshard_after_backward=True, requires_gradient_sync=True)
    assert sharding_settings(model) == {model: root, model[0]: defaults, model[1]: defaults}
    for forward in (False, True):
        for backward in (False, True):
            for sync in (False, True):
                settings = ShardingSettings(forward, backward, sync)
                settings.apply(model[1])
                assert sharding_settings(model)[model[1]] == settings


def test_held_unsharded_holds_then_restores_as_found(model):
    ShardingSettings(True, False, True).apply(model[0])
    ShardingSettings(False, True, False).apply(model[1])
    ShardingSettings(True, True, False).apply(model)
    before = sharding_settings(model)
    with held_unsharded(model):
        assert set(sharding_settings(model).values()) == {HELD}
        model(torch.randn(3, 4)).sum().backward()
        model(torch.randn(3, 4)).sum().backward()
        assert not any(_sharded(model)), "a forward or backward resharded inside held_unsharded"
    assert sharding_settings(model) == before
    assert all(_sharded(model))


@pytest.mark.parametrize("family, tied, lora", [("qwen3", False, False), ("qwen3", True, False),
                                                ("qwen3_5", False, True), ("deepseek_v3", False, False)])
def test_the_dry_runs_wrap_targets_are_verls(family, tied, lora):
    """``verl_wrap_targets`` (the dry run's restatement) selects what veRL 0.9.1's FSDP2 wrapping selects."""
    fsdp_utils = pytest.importorskip("verl.utils.fsdp_utils")
    config = tiny_config(family)
    config.tie_word_embeddings = tied
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    model = Lora(4 if lora else 0).wrap(model)
    ours = verl_wrap_targets(model)
    assert ours == fsdp_utils._select_fsdp2_wrap_targets(model, model._no_split_modules)
    assert len(ours) == config.num_hidden_layers + (0 if tied else 2)


def test_the_backward_keeps_one_reduce_scatter_input_of_the_unit_before(model):
    """``model_terms.unsharded_bytes``' gradient peak reads FSDP2's backward so: while a unit's gradients grow, the
    reduce-scatter input of the unit whose backward ran before it is kept (one, in the reduce dtype, sized as that
    unit's parameters), until this unit's post-backward drops it. Pinned on the installed torch (2.11 keeps it in
    ``comm_ctx.reduce_scatter_state``, 2.13 in the list ``comm_ctx.reduce_scatter_states``)."""
    kept: list[list[torch.Tensor]] = []

    def inputs_kept(*_) -> None:
        ctx = model._get_fsdp_state()._comm_ctx
        states = getattr(ctx, "reduce_scatter_states", None)
        states = states if states is not None else [s for s in [ctx.reduce_scatter_state] if s is not None]
        kept.append([state.reduce_scatter_input for state in states])

    model[0].register_full_backward_pre_hook(inputs_kept)  # the first layer's backward: the last unit to run
    model(torch.randn(3, 4)).sum().backward()
    (inputs,) = kept
    second_unit = sum(p.numel() for p in model[1].parameters())
    assert [(t.numel(), t.dtype) for t in inputs] == [(second_unit, torch.float32)]


def test_the_gradient_peak_is_the_largest_units_copy_in():
    """Units (10, 30, 20) in forward order: the backward runs 20, 30, 10. At each unit's copy-in its gradients (2 B
    each) and its input (4 B each) exist; between, a unit's gradients grow beside the input kept of the one before
    (20's beside nothing, 30's beside 20's, 10's beside 30's): counted by hand, the peak is 30's copy-in."""
    from verl_longstraw.model_terms import _gradient_peak

    moments = [6 * 20, 2 * 30 + 4 * 20, 6 * 30, 2 * 10 + 4 * 30, 6 * 10]
    assert _gradient_peak([10, 30, 20], 2, 4) == max(moments) == 180


def test_the_moments_pair_each_layer_with_the_units_fsdp2_holds_then():
    """``model_terms.unsharded_moments`` of units (embedding 50, layers 10, 30, 20, lm_head 40) over 2 ranks, bf16
    gradients reduced in float32, counted by hand: at layer j's backward FSDP2 holds its unit and the one it prefetches
    (the unit before; layer 0's: the embedding), and the layer's gradients beside the input kept of the unit after
    it (after the last layer the lm_head's, only in a backward that scored) or its own copy-in; the ends and a
    no-grad forward: ``unsharded_bytes``' largest pair and gradient peak. On one rank every unit is held at every
    moment."""
    counts = ParameterCounts(units=(50, 10, 30, 20, 40), root=0, experts=(0,) * 5)
    moments = unsharded_moments(counts, 3, 2, torch.bfloat16, torch.float32)
    assert moments.layers == ((2 * 60, max(2 * 10 + 4 * 30, 6 * 10)), (2 * 40, max(2 * 30 + 4 * 20, 6 * 30)),
                              (2 * 50, max(2 * 20 + 4 * 40, 6 * 20)))
    assert moments.unscored_layers == (*moments.layers[:2], (2 * 50, 6 * 20))
    params, grads = unsharded_bytes(counts, 2, torch.bfloat16, torch.float32, training=True)
    assert moments.ends == (params, grads) and moments.forward == (params, 0)
    one_rank = unsharded_moments(counts, 3, 1, torch.bfloat16, torch.float32)
    assert set(one_rank.layers) == set(one_rank.unscored_layers) == {unsharded_bytes(counts, 1, torch.bfloat16,
                                                                                     torch.float32, training=True)}
    with pytest.raises(ValueError, match="5 FSDP2 units for 4 decoder layers"):
        unsharded_moments(counts, 4, 2, torch.bfloat16, torch.float32)
