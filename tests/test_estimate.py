"""The pre-flight estimate: prompt-state bytes exactly, peak saved-for-backward bytes within 20%
of SavedTensorMeter on CPU, and an early budget error from group_backward.

Measured estimate/meter ratios (tiny models, fp32 and bf16, P 1024-2048, chunk 128/512/None,
exact and detached): 0.85-1.19.
"""

from __future__ import annotations

import pytest
import torch

from verl_longstraw import GroupStats, group_backward
from verl_longstraw.estimate import estimate_memory
from verl_longstraw.memory import parameter_meter
from verl_longstraw.testing import make_group, weighted_loss
from verl_longstraw.tiny import FAMILIES, VOCAB, tiny_model

RESPONSE_LEN = 32
CASES = ((torch.float32, 1024, 128, "exact"), (torch.bfloat16, 1024, 256, "exact"), (torch.float32, 1024, None, "detached"))


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
        assert estimate.state_grad_bytes == (estimate.state_bytes * 4 // dtype.itemsize if mode == "exact" else 0)


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
    """A GLM-5-like MLA config at 1M tokens: latent state (512 + 64 + 128 indexer) x 2 bytes per token per layer."""
    import transformers

    config = transformers.GlmMoeDsaConfig(
        hidden_size=6144, num_hidden_layers=4, num_attention_heads=64, kv_lora_rank=512, qk_rope_head_dim=64,
        qk_nope_head_dim=192, v_head_dim=256, q_lora_rank=2048, index_head_dim=128, vocab_size=1024,
    )
    tokens = 2**20
    estimate = estimate_memory(config, tokens + 1, 8, 1024, 4096, "exact", torch.bfloat16)
    assert estimate.state_bytes == 4 * tokens * (512 + 64 + 128) * 2
    assert estimate.state_grad_bytes == 2 * estimate.state_bytes
