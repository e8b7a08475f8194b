"""Fused prefix-causal attention (two flash-attention kernel calls merged by logsumexp) against the SDPA
reference and the blocked op; the private aten ops it calls, pinned; which path the dispatch takes."""

from __future__ import annotations

from functools import partial

import pytest
import torch
from test_blocked_attention import (
    NAMES,
    TOL,
    check_bf16_autocast_no_worse_than_sdpa,
    make_inputs,
    run_with_grads,
    saved_numels,
)

from verl_longstraw.ops import attention as attention_ops
from verl_longstraw.ops.attention import prefix_causal_attention, prefix_causal_attention_reference
from verl_longstraw.ops.blocked_attention import prefix_causal_attention_blocked
from verl_longstraw.ops.fused_attention import fused_dtype, prefix_causal_attention_fused

# (B, Hq, Hk, T, P, D)
CASES = {
    "gqa": (2, 4, 2, 5, 23, 16),
    "mqa": (2, 4, 1, 6, 50, 24),
    "mha_uneven": (1, 3, 3, 13, 7, 8),
    "single_query": (1, 4, 2, 1, 10, 8),
    "prefix_of_one": (2, 2, 1, 4, 1, 8),
    "no_prefix": (2, 4, 2, 9, 0, 8),
    "one_query_no_prefix": (1, 2, 2, 1, 0, 4),
}


def fused(*args) -> torch.Tensor:
    """The fused op on (q, k_prefix, v_prefix, k_self, v_self, scale) in its own arithmetic dtype."""
    return prefix_causal_attention_fused(*args, fused_dtype(*args[:5]))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("case", list(CASES))
def test_matches_reference_and_blocked(case: str, dtype: torch.dtype) -> None:
    """Output and the gradients of q and of both the prefix and the own K/V equal the SDPA reference's
    and the blocked op's."""
    batch, q_heads, kv_heads, seg_len, prefix_len, dim = CASES[case]
    inputs = make_inputs(batch, q_heads, kv_heads, seg_len, prefix_len, dim, dim, dtype)
    out, grads = run_with_grads(fused, inputs, dim**-0.5)
    assert out.dtype == dtype and out.shape == (batch, q_heads, seg_len, dim)
    for ref_fn in (prefix_causal_attention_reference, partial(prefix_causal_attention_blocked, block_size=4)):
        ref_out, ref_grads = run_with_grads(ref_fn, inputs, dim**-0.5)
        torch.testing.assert_close(out, ref_out, atol=TOL[dtype], rtol=0)
        for name in NAMES:
            assert grads[name].shape == inputs[name].shape and grads[name].dtype == dtype
            torch.testing.assert_close(grads[name], ref_grads[name], atol=TOL[dtype], rtol=0, msg=name)


@pytest.mark.parametrize("case", ["gqa", "mqa", "mha_uneven"])
def test_shared_prefix_equals_a_copy_per_sequence(case: str) -> None:
    """A batch-1 prefix shared by B sequences (batched replay) gives the outputs and gradients of a prefix
    copied per sequence; the prefix's gradient is the sum over the sequences."""
    batch, q_heads, kv_heads, seg_len, prefix_len, dim = CASES[case]
    batch = 3
    inputs = make_inputs(batch, q_heads, kv_heads, seg_len, prefix_len, dim, dim, torch.float64)
    inputs["k_prefix"], inputs["v_prefix"] = inputs["k_prefix"][:1], inputs["v_prefix"][:1]
    out, grads = run_with_grads(fused, inputs, dim**-0.5)

    def copied(q, k_prefix, v_prefix, k_self, v_self, scale):
        expand = (batch, *k_prefix.shape[1:])
        return prefix_causal_attention_reference(q, k_prefix.expand(expand), v_prefix.expand(expand), k_self,
                                                 v_self, scale)

    ref_out, ref_grads = run_with_grads(copied, inputs, dim**-0.5)
    torch.testing.assert_close(out, ref_out, atol=TOL[torch.float64], rtol=0)
    for name in NAMES:
        torch.testing.assert_close(grads[name], ref_grads[name], atol=TOL[torch.float64], rtol=0, msg=name)


def test_gradcheck() -> None:
    inputs = make_inputs(1, 4, 2, 3, 5, 4, 4, torch.float64)
    assert torch.autograd.gradcheck(lambda *xs: fused(*xs, 0.5), tuple(inputs.values()), fast_mode=True)


def test_detached_prefix() -> None:
    """A prefix that needs no gradient (prompt_grad: detached) leaves the other gradients unchanged."""
    inputs = make_inputs(*CASES["gqa"], CASES["gqa"][-1], torch.float64)
    _, grads = run_with_grads(fused, inputs, 0.25)
    k_prefix, v_prefix = inputs.pop("k_prefix").detach(), inputs.pop("v_prefix").detach()
    _, detached = run_with_grads(lambda q, k, v, s: fused(q, k_prefix, v_prefix, k, v, s), inputs, 0.25)
    for name, grad in detached.items():
        torch.testing.assert_close(grad, grads[name], atol=0, rtol=0)


def test_saves_inputs_output_and_logsumexp() -> None:
    """Saved for backward: the inputs, the output and the logsumexp [B, Hq, T]; nothing score-sized."""
    batch, q_heads, kv_heads, seg_len, prefix_len, dim = 1, 4, 2, 16, 256, 8
    inputs = make_inputs(batch, q_heads, kv_heads, seg_len, prefix_len, dim, dim, torch.float32)
    expected = [x.numel() for x in inputs.values()] + [batch * q_heads * seg_len * dim, batch * q_heads * seg_len]
    assert sorted(saved_numels(fused, inputs, 0.3)) == sorted(expected)


@pytest.mark.parametrize("backward_in_autocast", [False, True])
def test_bf16_autocast_gradients_no_worse_than_sdpa(backward_in_autocast: bool) -> None:
    """The fused op (float32 arithmetic) under CPU bf16 autocast: output and every input gradient no further from a
    float64 reference than SDPA's on the same machine (``check_bf16_autocast_no_worse_than_sdpa``)."""
    check_bf16_autocast_no_worse_than_sdpa(fused, backward_in_autocast)


def test_private_cpu_ops_pinned() -> None:
    """What fused_attention relies on: the CPU flash op's signature; its logsumexp [B, Hq, N] is the natural
    log of the summed exp-scores, in float32 for bf16 inputs (float64 for float64); it shares key heads
    (Hq != Hk) and rejects value dim != key dim; is_causal is top-left aligned; the backward, given an output
    and logsumexp, returns (dq, dk, dv) with dk/dv per key head."""
    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
    assert str(op.default._schema) == (
        "aten::_scaled_dot_product_flash_attention_for_cpu(Tensor query, Tensor key, Tensor value, "
        "float dropout_p=0., bool is_causal=False, *, Tensor? attn_mask=None, float? scale=None) "
        "-> (Tensor output, Tensor logsumexp)"
    )
    assert str(backward.default._schema) == (
        "aten::_scaled_dot_product_flash_attention_for_cpu_backward(Tensor grad_out, Tensor query, Tensor key, "
        "Tensor value, Tensor out, Tensor logsumexp, float dropout_p, bool is_causal, *, Tensor? attn_mask=None, "
        "float? scale=None) -> (Tensor grad_query, Tensor grad_key, Tensor grad_value)"
    )
    for name in ("_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward"):
        assert hasattr(torch.ops.aten, name), name  # the CUDA pair (run by gpu_check)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, n, 8, generator=gen, dtype=torch.float64) for h, n in ((4, 3), (2, 5), (2, 5)))
    visible = torch.ones(3, 5, dtype=torch.bool).tril()  # top-left: query i sees keys 0..i
    scores = (q @ k.repeat_interleave(2, 1).transpose(-1, -2) * 0.5).masked_fill(~visible, float("-inf"))
    for dtype, lse_dtype, tol in ((torch.float64, torch.float64, 1e-12), (torch.bfloat16, torch.float32, 0.05)):
        out, lse = op(q.to(dtype), k.to(dtype), v.to(dtype), 0.0, True, scale=0.5)
        assert out.shape == (2, 4, 3, 8) and out.dtype == dtype and lse.shape == (2, 4, 3) and lse.dtype == lse_dtype
        torch.testing.assert_close(lse.double(), scores.to(dtype).double().logsumexp(-1), atol=tol, rtol=0)
        torch.testing.assert_close(out.double(), scores.softmax(-1) @ v.repeat_interleave(2, 1), atol=tol, rtol=0)
    grads = backward(torch.ones_like(q), q, k, v, *op(q, k, v, 0.0, True, scale=0.5), 0.0, True, scale=0.5)
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
    with pytest.raises(RuntimeError, match="same head size"):
        op(q, k, v[..., :4], 0.0, False, scale=0.5)


def test_dispatch_paths() -> None:
    """Which path runs: SDPA is_causal without prefix; the fused kernels with a prefix (or a single key head);
    SDPA with a mask, or the blocked op beyond MASK_BYTES_LIMIT, for what the kernels do not take (a key
    mask, value dim != key dim as in MLA, no queries)."""
    def path(batch, q_heads, kv_heads, seg_len, prefix_len, dim, v_dim, key_mask=None):
        inputs = make_inputs(batch, q_heads, kv_heads, seg_len, prefix_len, dim, v_dim, torch.float32)
        attention_ops.ATTENTION_PATHS.clear()
        out = prefix_causal_attention(*inputs.values(), 0.3, key_mask=key_mask)
        ref = prefix_causal_attention_reference(*inputs.values(), 0.3, key_mask=key_mask)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
        (name,) = attention_ops.ATTENTION_PATHS
        return name

    assert path(1, 4, 2, 6, 0, 8, 8) == "sdpa_is_causal"
    assert path(1, 4, 1, 6, 0, 8, 8) == "fused_flash_cpu"  # folded heads: would need a mask
    assert path(1, 4, 2, 6, 9, 8, 8) == "fused_flash_cpu"
    assert path(1, 4, 2, 600, 3000, 8, 8) == "fused_flash_cpu"  # its mask would exceed MASK_BYTES_LIMIT
    key_mask = torch.rand(6, 15, generator=torch.Generator().manual_seed(0)) < 0.5
    key_mask[:, 9:] = True
    assert path(1, 4, 2, 6, 9, 8, 8, key_mask) == "sdpa_mask"
    assert path(1, 4, 2, 6, 9, 8, 4) == "sdpa_mask"
    assert path(1, 4, 2, 0, 9, 8, 8) == "sdpa_mask"
    assert path(1, 4, 2, 600, 3000, 8, 4) == "blocked"
