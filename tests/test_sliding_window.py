"""Sliding-window layers (``state.Window``, ``ops.attention.window``) and gpt-oss's sinks against the standard path.

The window is 8 keys (7 kept rows): prompts shorter and longer than it, capture chunks that end inside a window,
at its edge (7, 8 tokens) and every few tokens, one and three responses; models with windows on some layers
(gpt_oss, qwen3 through ``config.layer_types``) and on every layer (mistral and qwen3_moe without ``layer_types``).
"""

import pytest
import torch

from verl_longstraw import Knobs, UnsupportedModelError, capture_prompt, group_backward, group_log_probs
from verl_longstraw.adapters import adapter_for
from verl_longstraw.memory import parameter_meter
from verl_longstraw.state import Rows, Window
from verl_longstraw.testing.compare import (
    full_log_probs,
    grads_of,
    make_group,
    relative_error,
    standard_grads,
    weighted_loss,
)
from verl_longstraw.tiny import VOCAB, tiny_model

WINDOW = 8
CASES = {
    "gpt_oss": ("gpt_oss", {}),  # sliding and full layers, sinks on both
    "qwen3_layer_types": ("qwen3", dict(use_sliding_window=True, sliding_window=WINDOW,
                                        layer_types=["full_attention", "sliding_attention"])),
    "mistral": ("mistral", dict(sliding_window=WINDOW)),  # every layer
    "qwen3_moe": ("qwen3_moe", dict(use_sliding_window=True, sliding_window=WINDOW)),  # every layer
}


def _model(case: str, dtype: torch.dtype = torch.float32):
    family, fields = CASES[case]
    model = tiny_model(family, dtype, **fields)
    for name, p in model.named_parameters():
        if name.endswith("sinks"):  # sinks of either sign, so that they change the attention
            with torch.no_grad():
                p.copy_(torch.randn(p.shape, dtype=p.dtype))
    return model


@pytest.fixture(scope="module", params=list(CASES))
def case(request):
    return request.param


@pytest.fixture(scope="module")
def model(case):
    return _model(case)


@pytest.mark.parametrize("prompt_len, group, chunks", [(5, (6,), (None, 3)), (30, (9, 4, 12), (None, 7, 8, 11))])
def test_window_layers_match_standard(model, prompt_len, group, chunks):
    """Log-probs < 1e-5 and exact gradients (sinks included) < 1e-5 relative L2 against one standard forward and
    backward per response, whatever the capture chunking; the sinks' gradient is part of it and not zero."""
    prompt, responses = make_group(VOCAB, prompt_len, group)
    expected = standard_grads(model, prompt, responses, weighted_loss)
    with torch.no_grad():
        reference = [full_log_probs(model, prompt, r)[0] for r in responses]
    for chunk in chunks:
        log_probs = group_log_probs(model, prompt, responses, knobs=Knobs(chunk_size=chunk)).log_probs
        assert max((a - b).abs().max().item() for a, b in zip(log_probs, reference, strict=True)) < 1e-5, chunk
        model.zero_grad(set_to_none=True)
        group_backward(model, prompt, responses, weighted_loss, knobs=Knobs(chunk_size=chunk))
        assert relative_error(grads_of(model), expected) < 1e-5, chunk
    sinks = [p.grad for name, p in model.named_parameters() if name.endswith("sinks")]
    assert all(g.abs().sum() > 0 for g in sinks)


def test_detached_is_biased(model):
    """Detached windows drop the gradient through the prompt's last W - 1 rows: biased as on full layers."""
    prompt, responses = make_group(VOCAB, 30, (9, 4))
    expected = standard_grads(model, prompt, responses, weighted_loss)
    model.zero_grad(set_to_none=True)
    group_backward(model, prompt, responses, weighted_loss, knobs=Knobs(prompt_grad="detached"))
    assert 1e-3 < relative_error(grads_of(model), expected) < 1.0


def test_float64_gpt_oss():
    """In float64 (gpt-oss's eager attention computes in the model's dtype) the exact gradient is exact: < 1e-7."""
    model = _model("gpt_oss", torch.float64)
    prompt, responses = make_group(VOCAB, 37, (9, 3))
    expected = standard_grads(model, prompt, responses, weighted_loss)
    model.zero_grad(set_to_none=True)
    group_backward(model, prompt, responses, weighted_loss, knobs=Knobs(chunk_size=8))
    assert relative_error(grads_of(model), expected) < 1e-7


def test_window_state_keeps_window_rows():
    """A captured prompt of 40 tokens keeps W - 1 = 7 rows per chunk end on a sliding layer and all 39 on a full
    one; the kinds say so, and so do the stored tensors."""
    model = _model("gpt_oss")
    adapter = adapter_for(model)
    prompt, _ = make_group(VOCAB, 40, (1,))
    state = capture_prompt(model, prompt, knobs=Knobs(chunk_size=13))
    for layer, kinds, storages in zip(model.config.layer_types, adapter.specs(), state.store.storage, strict=True):
        for kind, storage in zip(kinds, storages, strict=True):
            if layer == "sliding_attention":
                assert isinstance(kind, Window) and kind.rows_kept == WINDOW - 1
                assert storage and all(t.shape[-2] == WINDOW - 1 for t in storage.values())
                assert kind.nbytes(39, torch.float32) == kind.nbytes(WINDOW - 1, torch.float32)
            else:
                assert isinstance(kind, Rows) and storage.shape[-2] >= 39


def test_window_replay_memory_is_flat_in_the_prompt():
    """With windows on every layer the replay attends over W - 1 rows whatever the prompt. Detached: the peak
    saved bytes after a 129- and a 1025-token prompt are equal. Exact (64-token chunks, one recomputed at a time):
    the peak grows by at most one held window state per extra chunk boundary, not with the prompt's tokens (a
    full-attention state would add 896 rows per layer)."""
    model = _model("mistral")
    window_state = sum(kind.nbytes(1025, torch.float32) for kinds in adapter_for(model).specs() for kind in kinds)
    peaks = {}
    for prompt_grad in ("detached", "exact"):
        for prompt_len in (129, 1025):
            prompt, responses = make_group(VOCAB, prompt_len, (16, 16))
            with parameter_meter(model) as meter:
                group_backward(model, prompt, responses, weighted_loss,
                               knobs=Knobs(prompt_grad=prompt_grad, chunk_size=64))
            peaks[prompt_grad, prompt_len] = meter.peak
    assert peaks["detached", 1025] == peaks["detached", 129], peaks
    extra_chunks = (1025 - 129) // 64
    assert 0 <= peaks["exact", 1025] - peaks["exact", 129] <= extra_chunks * window_state, (peaks, window_state)


def test_context_parallel_is_refused_naming_the_knob():
    adapter = adapter_for(_model("gpt_oss"))
    adapter.check_context_parallel(1)
    with pytest.raises(UnsupportedModelError, match="context_parallel_size=2 is not supported"):
        adapter.check_context_parallel(2)
