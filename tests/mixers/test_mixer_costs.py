"""Each mixer op's saved bytes (``MixerOp.saves``) against ``memory.SavedTensorMeter`` on one layer's forward, for
every op kind of the tiny families: a replay batch over a shared prefix, within the whole-layer estimate's bounds
(tests/test_estimate.py: the projections' per-token coefficients are calibrated), and a segment whose output is not
needed (the last layer of an unscored chunk), whose count bounds what it saves."""

from __future__ import annotations

import pytest
import torch

from verl_longstraw.adapters import adapter_for
from verl_longstraw.memory import SavedTensorMeter
from verl_longstraw.mixers import LayerCall, NoMixer
from verl_longstraw.mixers.base import saved_row_bytes, upcast_row_bytes
from verl_longstraw.tiny import first_layer_of_each_op, mixer_class, tiny_model

PREFIX, TOKENS, BATCH = 96, 24, 3

# (family, index of a layer whose op is of the kind): the first layer of each op class the tiny families declare, and
# the features an op class takes from its module
CASES = {
    **first_layer_of_each_op(lambda op: not isinstance(op, NoMixer)),
    "Attention (output gate)": ("qwen3_5", 1),
    "WindowAttention (window)": ("gpt_oss", 0),
    "WindowAttention (sinks)": ("gpt_oss", 1),
    "LatentAttention (DSA indexer)": ("glm_moe_dsa", 0),
}


def _layer(family: str, idx: int):
    model = tiny_model(family)
    adapter = adapter_for(model)
    return adapter, adapter.ops[idx]


def _prefix_state(adapter, op, hidden: int) -> tuple[torch.Tensor, ...]:
    """The state ``op`` returns for a ``PREFIX``-token segment, as leaves that take gradients (exact mode)."""
    x = torch.randn(1, PREFIX, hidden)
    empty = tuple(kind.empty(x) for kind in op.kinds)
    with torch.no_grad():
        _, state = op.forward(x, adapter.context(x, 0), empty, True)
    return tuple(t.detach().requires_grad_(kind.differentiable) for t, kind in zip(state, op.kinds, strict=True))


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("need_output", [True, False])
def test_saves_match_meter(case, need_output):
    family, idx = CASES[case]
    adapter, op = _layer(family, idx)
    hidden = adapter.config.hidden_size
    past = _prefix_state(adapter, op, hidden)
    batch = BATCH if need_output else 1
    x = torch.randn(batch, TOKENS, hidden, requires_grad=True)
    ctx = adapter.context(x, PREFIX)
    with SavedTensorMeter(exclude=[x, *past, *adapter.model.parameters()]) as meter:
        out, _ = op.forward(x, ctx, past, need_output)
    rows = max((t.shape[-2] for t, kind in zip(past, op.kinds, strict=True) if kind.row_nbytes(x.dtype)), default=0)
    call = LayerCall(batch, TOKENS, rows, rows, need_output, (TOKENS,), 0, 1, False, x.dtype, "cpu", rows)
    saves = op.saves(call)
    counted = saves.own + saves.shared - saves.state_views  # the prefix state is a leaf the meter excludes
    assert saves.gathered == 0
    if need_output:
        assert 0.7 <= counted / meter.peak <= 1.3, (case, counted, meter.peak)
    else:
        assert meter.peak <= counted, (case, counted, meter.peak)
    assert (out is None) == (not need_output)


def test_mamba2_summary_scan_saves_match_meter():
    """What the CP summary scan of a Mamba2 layer keeps once its output is dropped (``ops.mamba2.cp``: the scan from
    zero, its final state alone read) against ``mamba2.SUMMARY_SAVES`` of the scan's saves, over short and long
    segments."""
    from verl_longstraw.mixers.mamba2 import SUMMARY_SAVES
    from verl_longstraw.ops.mamba2.ssd import ssd_torch_saved_bytes

    _, op = _layer("nemotron_h", 0)
    heads, p, n, groups = op.heads, op.head_dim, op.state_size, op.groups
    for tokens in (16, 50, 200):
        shapes = ((1, tokens, heads, p), (1, tokens, heads), (1, tokens, groups, n), (1, tokens, groups, n))
        leaves = [torch.rand(shape, requires_grad=True) for shape in shapes]
        with SavedTensorMeter(exclude=leaves) as meter:
            x, dt, b, c = (t * 1.0 for t in leaves)  # inputs computed in the graph, as in a layer
            out, final = op.scan(x, dt, -torch.rand(heads), b, c, op.scan_chunk, D=None,
                                 initial_states=torch.zeros(1, heads, p, n), return_final_states=True)
            del out
            kept = meter.current
        counted = SUMMARY_SAVES * ssd_torch_saved_bytes(1, tokens, heads, p, n, op.scan_chunk, torch.float32)
        assert 0.8 <= counted / kept <= 1.3, (tokens, counted, kept)
        assert final.requires_grad


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3"])
def test_norm_saves_on_meta_match_the_meter_and_their_half_precision_copies(family):
    """``saved_row_bytes`` counts on the meta device what ``SavedTensorMeter`` sees a norm save on CPU (its float32
    copies in bfloat16 included); ``upcast_row_bytes`` is 0 for float32 and, in bfloat16, what the norm saves beyond
    its float32 figure at bfloat16 sizes."""
    model = tiny_model(family)
    norm = model.model.layers[0].input_layernorm
    width = model.config.hidden_size
    for dtype in (torch.float32, torch.bfloat16):
        with torch.no_grad():
            weights = {name: p.to(dtype).requires_grad_() for name, p in norm.named_parameters()}
        peaks = []
        for rows in (32, 64):
            x = torch.randn(rows, width, dtype=dtype, requires_grad=True)
            with SavedTensorMeter(exclude=weights.values()) as meter:
                out = torch.func.functional_call(norm, weights, (x,))
            peaks.append(meter.peak)
            del out
        assert saved_row_bytes(norm, width, dtype) == (peaks[1] - peaks[0]) / 32 > 0, (dtype, peaks)
    assert upcast_row_bytes(norm, width, torch.float32) == 0
    half = saved_row_bytes(norm, width, torch.bfloat16) - saved_row_bytes(norm, width, torch.float32) / 2
    assert upcast_row_bytes(norm, width, torch.bfloat16) == max(half, 0)
    if family == "qwen3_5":  # its norm computes in float32 and scales by (1 + weight) in float32: copies it keeps
        assert half > 0


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_norm_saves_are_counted_whatever_the_grad_mode(mode):
    """The engine's pre-flight estimate runs inside veRL's no_grad log-prob call, and the count is cached for the
    process: counted there, a norm's saves are what the meter sees with autograd on (once 0: the Mamba1 estimate
    then fell short of the meter after an engine test)."""
    width = 40 if mode is torch.no_grad else 44  # a width no other test counts first
    norm = torch.nn.LayerNorm(width)
    with mode():
        counted = saved_row_bytes(norm, width, torch.float32)
    peaks = []
    for rows in (32, 64):
        x = torch.randn(rows, width, requires_grad=True)
        with SavedTensorMeter(exclude=norm.parameters()) as meter:
            out = norm(x)
        peaks.append(meter.peak)
        del out
    assert counted == (peaks[1] - peaks[0]) / 32 > 0, (counted, peaks)


def _subclasses(cls: type) -> set[type]:
    return {sub for direct in cls.__subclasses__() for sub in (direct, *_subclasses(direct))}


def test_every_op_kind_of_every_family_has_a_case():
    """A contract: every mixer op class a tiny family's adapter declares is measured here (``CASES``, keyed by the
    class name; an adapter's subclass naming its modules counts as its base: ``tiny.first_layer_of_each_op``), each
    case's layer is of its class, and every concrete op class of ``verl_longstraw.mixers`` is declared by some family
    (a new op is measured once a family declares it). ``NoMixer`` saves nothing."""
    import inspect

    from verl_longstraw import mixers
    from verl_longstraw.adapters import adapter_on_meta
    from verl_longstraw.tiny import TINY_CONFIGS, tiny_config, unavailable

    used = {mixer_class(op) for family in TINY_CONFIGS if unavailable(family) is None
            for op in adapter_on_meta(tiny_config(family)).ops} - {mixers.NoMixer}
    cased = {case.split(" (")[0] for case in CASES}
    assert {cls.__name__ for cls in used} == cased
    for case, (family, idx) in CASES.items():
        if unavailable(family) is None:
            assert mixer_class(adapter_on_meta(tiny_config(family)).ops[idx]).__name__ == case.split(" (")[0], case
    concrete = {cls for cls in _subclasses(mixers.MixerOp) if not inspect.isabstract(cls)
                and cls.__module__.startswith("verl_longstraw.mixers")} - {mixers.NoMixer}
    assert concrete <= used, sorted(cls.__name__ for cls in concrete - used)


# the attention ops with a transient to count (a sliding window's op has none): fused kernels, pass-Q under CP
@pytest.mark.parametrize("case", ["Attention", "Attention (output gate)", "WindowAttention (sinks)", "LatentAttention",
                                  "LatentAttention (DSA indexer)"])
def test_attention_without_output_has_no_attention_transient(case):
    """The last layer of an unscored segment computes its state only (no queries, no attention): an attention op's
    backward transient and score block are 0 for such a call, in one process and under CP, on CUDA in bfloat16,
    where the same call with its output needed has a fused backward or a key block to count."""
    family, idx = CASES[case]
    _, op = _layer(family, idx)
    counted = {}
    for need_output in (True, False):
        for sizes, rank in (((TOKENS,), 0), ((TOKENS, TOKENS), 1)):
            if len(sizes) > 1 and "Window" in case:
                continue  # sliding windows have no CP form
            call = LayerCall(1, TOKENS, PREFIX, PREFIX, need_output, sizes, rank, len(sizes), True, torch.bfloat16,
                             "cuda", PREFIX * len(sizes))
            counted[need_output, len(sizes)] = op.transient_bytes(call) + op.score_block_bytes(call)
    assert all(counted[False, world] == 0 for _, world in counted), (case, counted)
    assert any(counted[True, world] > 0 for _, world in counted), (case, counted)
