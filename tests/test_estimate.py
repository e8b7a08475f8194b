"""The pre-flight estimate: prompt-state bytes exactly (those PromptState.nbytes measures, kept
boundary states included; state-gradient bytes those of the differentiable state tensors), peak
saved-for-backward bytes within 20% of SavedTensorMeter on CPU, and an early budget error from
group_backward.

Measured estimate/meter ratios (tiny models, fp32 and bf16, P 1024-2048, chunk 128/512/None,
exact and detached): 0.85-1.19.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from verl_longstraw import GroupStats, capture_prompt, group_backward
from verl_longstraw.estimate import estimate_memory
from verl_longstraw.memory import parameter_meter
from verl_longstraw.testing import make_group, weighted_loss
from verl_longstraw.tiny import FAMILIES, VOCAB, tiny_model

RESPONSE_LEN = 32
CASES = (
    (torch.float32, 1024, 128, "exact"), (torch.bfloat16, 1024, 256, "exact"), (torch.float32, 1024, None, "detached")
)


@pytest.mark.parametrize("family", FAMILIES)
def test_estimate_matches_meter(family, record_property):
    for dtype, prompt_len, chunk_size, mode in CASES:
        model = tiny_model(family, dtype=dtype)
        prompt, responses = make_group(VOCAB, prompt_len, (RESPONSE_LEN, RESPONSE_LEN))
        stats = GroupStats()
        with parameter_meter(model) as meter:
            group_backward(model, prompt, responses, weighted_loss, mode, chunk_size, stats=stats)
        estimate = estimate_memory(model.config, prompt_len, 2, RESPONSE_LEN, chunk_size, mode, dtype)
        ratio = estimate.saved_peak_bytes / meter.peak
        record_property(f"ratio_{dtype}_{chunk_size}_{mode}", ratio)
        assert estimate.state_bytes == stats.prompt_state_bytes
        assert 0.8 <= ratio <= 1.2, (dtype, chunk_size, mode, ratio)
        assert estimate.state_grad_bytes == (_state_grad_bytes(model, prompt, chunk_size) if mode == "exact" else 0)


def _state_grad_bytes(model, prompt, chunk_size) -> int:
    """Bytes of the float32 (or wider) gradient sums of the captured state's differentiable tensors."""
    state = capture_prompt(model, prompt, chunk_size, for_backward=True)
    return sum(
        t.numel() * torch.promote_types(t.dtype, torch.float32).itemsize
        for specs, layer in zip(state.specs, state.current(), strict=True)
        for spec, t in zip(specs, layer, strict=True)
        if spec.differentiable
    )


SHARED_INDEXER = ["full", "shared", "shared"]


@pytest.mark.parametrize("chunk_size, mode", [(None, "detached"), (40, "exact")])
def test_estimate_counts_indexer_keys_of_indexer_layers_only(chunk_size, mode):
    """GLM-MoE-DSA layers that reuse an earlier layer's top-k selection (indexer_types "shared") hold no
    indexer keys: the estimate matches the measured state, latent rows on every layer and indexer rows
    on the one layer that runs its indexer."""
    model = tiny_model("glm_moe_dsa", indexer_types=SHARED_INDEXER, index_topk=32)
    assert [layer.self_attn.indexer is None for layer in model.model.layers] == [False, True, True]
    config, prompt_len = model.config, 100
    prompt, responses = make_group(VOCAB, prompt_len, (8,))
    state = capture_prompt(model, prompt, chunk_size, for_backward=mode == "exact")
    estimate = estimate_memory(config, prompt_len, 1, 8, chunk_size, mode, torch.float32)
    rows = 3 * (config.kv_lora_rank + config.qk_rope_head_dim) + config.index_head_dim
    assert state.nbytes() == (prompt_len - 1) * rows * 4
    assert estimate.state_bytes == state.nbytes()


def test_budget_fails_early_with_advice():
    model = tiny_model("qwen3")
    prompt, responses = make_group(VOCAB, 512, (8, 8))
    estimate = estimate_memory(model.config, 512, 2, 8, None, "exact", torch.float32)
    with pytest.raises(MemoryError, match=r"estimated .* GiB > budget .* GiB.*chunk_size="):
        group_backward(model, prompt, responses, weighted_loss, memory_budget_bytes=estimate.total_bytes // 2)
    assert all(p.grad is None for p in model.parameters())
    group_backward(model, prompt, responses, weighted_loss, memory_budget_bytes=estimate.total_bytes)
    assert any(p.grad is not None for p in model.parameters())


def test_estimate_scales_to_real_configs():
    """A GLM-5-like MLA config at 1M tokens, from the config alone: latent (512 + 64) x 2 bytes per token
    on every layer, indexer keys (128 x 2 bytes) on the layers that run their indexer; float32
    gradients of the latent only (indexer keys get none)."""
    config = transformers.GlmMoeDsaConfig(
        hidden_size=6144, num_hidden_layers=4, num_attention_heads=64, kv_lora_rank=512, qk_rope_head_dim=64,
        qk_nope_head_dim=192, v_head_dim=256, q_lora_rank=2048, index_head_dim=128, vocab_size=1024,
        indexer_types=["full", "shared", "full", "shared"],
    )
    tokens = 2**20
    estimate = estimate_memory(config, tokens + 1, 8, 1024, 4096, "exact", torch.bfloat16)
    assert estimate.state_bytes == tokens * (4 * (512 + 64) + 2 * 128) * 2
    assert estimate.state_grad_bytes == tokens * 4 * (512 + 64) * 4
