"""Scale paths equal their references: absorbed MLA vs decompressed K/V, blocked attention vs SDPA,
MLA replay never saves per-head K/V of the prompt, and bfloat16 replay stays as close to the
float32 standard path as the bfloat16 standard path is.
"""

from __future__ import annotations

import pytest
import torch

import verl_longstraw.ops.attention.prefix as attention_ops
from verl_longstraw import Knobs, group_backward, group_log_probs
from verl_longstraw.mixers import LatentAttention
from verl_longstraw.ops.mla.reference import decompressed_latent_attention
from verl_longstraw.state import PathState, Rows
from verl_longstraw.testing.compare import (
    full_log_probs,
    grads_of,
    make_group,
    no_worse_than_standard,
    relative_error,
    replay_errors,
    standard_grads,
    weighted_loss,
)
from verl_longstraw.tiny import FAMILIES, VARIANTS, VOCAB, tiny_model

PROMPT_LEN = 130
RESPONSE_LENS = (11, 1, 30)
CHUNK = 48
# Sanity bound on bf16 errors against the float32 standard path (max |log p| error and gradient
# relative L2), for any CPU: the largest measured is 0.057 (deepseek_v3, standard and, on AVX2
# only, replay alike; 0.002-0.008 for the other families, AVX2 and AVX-512/AMX).
BF16_SANITY_BOUND = 0.2


def _decompressed(op: LatentAttention, ctx, q_nope, q_rope, prefix, segment, w_k, w_v, mask) -> torch.Tensor:
    """``LatentAttention.attend_latent`` on the reference (one process only)."""
    assert ctx.split is None
    return decompressed_latent_attention(q_nope, q_rope, prefix, segment, w_k, w_v, op.module.scaling, mask)


def _run(model, prompt, responses, chunk_size):
    """(log-probs [G] of [T_i], exact gradients by parameter name)."""
    log_probs = group_log_probs(model, prompt, responses, knobs=Knobs(chunk_size=chunk_size)).log_probs
    model.zero_grad(set_to_none=True)
    group_backward(model, prompt, responses, weighted_loss, knobs=Knobs(prompt_grad="exact", chunk_size=chunk_size))
    return log_probs, grads_of(model)


@pytest.mark.parametrize(
    "family, overrides", [("deepseek_v3", {}), ("glm_moe_dsa", {}), ("glm_moe_dsa", {"index_topk": 64})]
)
def test_absorbed_mla_equals_decompressed(family, overrides, monkeypatch):
    """Absorbed latent attention = per-head decompressed K/V (dense and, for DSA, sparse top-k masks)."""
    model = tiny_model(family, **overrides)
    prompt, responses = make_group(VOCAB, PROMPT_LEN, RESPONSE_LENS)
    absorbed_lp, absorbed_grads = _run(model, prompt, responses, CHUNK)
    monkeypatch.setattr(LatentAttention, "attend_latent", _decompressed)
    ref_lp, ref_grads = _run(model, prompt, responses, CHUNK)
    for a, b in zip(absorbed_lp, ref_lp, strict=True):
        assert (a - b).abs().max() < 1e-5
    assert relative_error(absorbed_grads, ref_grads) < 1e-5


@pytest.mark.parametrize(
    "family, overrides",
    [("qwen3", {}), ("qwen3_5", {}), ("deepseek_v3", {}), ("glm_moe_dsa", {"index_topk": 24, "index_n_heads": 16})],
)
def test_blocked_attention_equals_standard(family, overrides, monkeypatch):
    """With every prefix attention on the blocked op (for DSA with its sparse top-k key mask),
    log-probs and chunked exact gradients equal the standard path."""
    model = tiny_model(family, **overrides)
    prompt, responses = make_group(VOCAB, PROMPT_LEN, RESPONSE_LENS)
    expected = standard_grads(model, prompt, responses, weighted_loss)
    with torch.no_grad():
        expected_lp = [full_log_probs(model, prompt, r)[0] for r in responses]
    calls = []
    blocked = attention_ops.prefix_causal_attention_blocked
    monkeypatch.setattr(attention_ops, "MASK_BYTES_LIMIT", 0)
    monkeypatch.setattr(attention_ops, "fused_dtype", lambda *args: None)  # the fused kernels refuse every call

    def counted(*args, **kwargs):
        calls.append(1)
        return blocked(*args, **kwargs)

    monkeypatch.setattr(attention_ops, "prefix_causal_attention_blocked", counted)
    log_probs, grads = _run(model, prompt, responses, CHUNK)
    assert calls, "the blocked op was never dispatched"
    for lp, ref in zip(log_probs, expected_lp, strict=True):
        assert (lp - ref).abs().max() < 1e-5
    assert relative_error(grads, expected) < 1e-5


def _per_head_saved(model, prompt, responses, chunk_size) -> list[tuple[int, ...]]:
    """Shapes of tensors saved for backward that hold per-head K/V-sized data over the prompt:
    [..., heads, >= P - 1 rows, head_dim-like]."""
    config = model.config
    heads = config.num_attention_heads
    head_dims = {config.qk_nope_head_dim, config.qk_nope_head_dim + config.qk_rope_head_dim, config.v_head_dim}
    found = []

    def pack(t: torch.Tensor):
        s = t.shape
        if t.dim() >= 3 and s[-3] == heads and s[-2] >= len(prompt) - 1 and s[-1] in head_dims:
            found.append(tuple(s))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.zero_grad(set_to_none=True)
        group_backward(model, prompt, responses, weighted_loss, knobs=Knobs(chunk_size=chunk_size))
    return found


@pytest.mark.parametrize("family", ("deepseek_v3", "glm_moe_dsa"))
def test_mla_replay_saves_no_per_head_prompt_kv(family, monkeypatch):
    model = tiny_model(family)
    prompt, responses = make_group(VOCAB, PROMPT_LEN, RESPONSE_LENS)
    assert _per_head_saved(model, prompt, responses, CHUNK) == []
    monkeypatch.setattr(LatentAttention, "attend_latent", _decompressed)
    assert _per_head_saved(model, prompt, responses, CHUNK), "detector misses the decompressed path"


# gpt_oss's bf16 error is its router's luck: a bf16 rounding that flips one token's top-2 of 4 experts moves its
# log-prob by far more than rounding does, on either path (AMD EPYC, P = 301, seeds 0-2: replay / standard max
# log-prob error 0.084 / 0.066, 0.062 / 0.029, 0.004 / 0.102); with every expert routed the two agree (0.003 /
# 0.004, 0.003 / 0.003, 0.003 / 0.003). Routing exactness is the float32 tests'; this one compares arithmetic.
BF16_OVERRIDES = {"gpt_oss": {"num_experts_per_tok": 4}}


@pytest.mark.parametrize("family", FAMILIES + VARIANTS)
def test_bfloat16_matches_float32_standard(family, record_property):
    """bf16 replay (chunked exact) vs the fp32 standard path: no worse than the bf16 standard path
    on the same machine (its error depends on the CPU's bf16 kernels), and sane in absolute terms."""
    model = tiny_model(family, **BF16_OVERRIDES.get(family, {}))
    errors = replay_errors(model, torch.bfloat16, *make_group(VOCAB, PROMPT_LEN, RESPONSE_LENS), weighted_loss, CHUNK)
    for name, value in errors.items():
        record_property(f"bf16_{name}_error", value)
    assert no_worse_than_standard(errors, torch.bfloat16), errors
    assert max(errors.values()) < BF16_SANITY_BOUND, errors


def test_state_gradients_accumulate_in_float32():
    """Summing many small bf16 state gradients: a bf16 sum stalls at 1.0 (spacing 2**-7), the fp32 sum does not."""
    store = PathState([(Rows((1, 2, 1, 8)),)], capacity=4)
    store.write(0, 0, [(torch.zeros(1, 2, 4, 8, dtype=torch.bfloat16),)])  # 4 rows of one Rows kind
    for step in range(101):
        [(leaf,)] = store.leaves(0, 4, requires_grad=True)
        (leaf * (1.0 if step == 0 else 1e-3)).sum().backward()
    sums = store.grads_for(0, 0, 4)[0][0]
    assert leaf.grad is None and sums.dtype == torch.float32
    torch.testing.assert_close(sums, torch.full_like(sums, 1.1), rtol=1e-3, atol=0)
