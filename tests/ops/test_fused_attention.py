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

from verl_longstraw.memory import AllocationMeter
from verl_longstraw.ops.attention import fused as fused_ops
from verl_longstraw.ops.attention import prefix as attention_ops
from verl_longstraw.ops.attention.blocked import OWN_SEGMENT, prefix_causal_attention_blocked
from verl_longstraw.ops.attention.fused import fused_dtype, prefix_causal_attention_fused
from verl_longstraw.ops.attention.prefix import prefix_causal_attention, prefix_causal_attention_reference

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


# (B, Hq, Hk, T, P, D, prefix keys per backward kernel call): the last block uneven in each
BLOCKED = {
    "gqa": (2, 4, 2, 5, 23, 16, 4),
    "mqa": (2, 4, 1, 6, 50, 24, 7),
    "shared": (3, 4, 2, 5, 23, 16, 5),
    "detached": (2, 4, 2, 5, 23, 16, 6),
}


def force_key_rows(monkeypatch, rows: int, dtype: torch.dtype, key_batch: int, q_heads: int, kv_heads: int,
                   dim: int) -> None:
    """Make the prefix backward take ``rows`` keys per kernel call (``BACKWARD_BLOCK_BYTES`` of exactly that many)."""
    per_key = fused_ops._key_row_bytes("cpu", dtype, q_heads, kv_heads, dim)
    monkeypatch.setattr(fused_ops, "BACKWARD_BLOCK_BYTES", rows * key_batch * per_key)
    assert fused_ops.backward_key_rows("cpu", dtype, key_batch, q_heads, kv_heads, dim) == rows


@pytest.mark.parametrize("case", list(BLOCKED))
def test_key_blocked_backward_matches_reference(case: str, monkeypatch) -> None:
    """The prefix part's backward over several key blocks (uneven last block; GQA, MQA, a batch-1 prefix shared by
    3 sequences, a detached prefix): output and every gradient equal the SDPA reference's (float64)."""
    batch, q_heads, kv_heads, seg_len, prefix_len, dim, rows = BLOCKED[case]
    inputs = make_inputs(batch, q_heads, kv_heads, seg_len, prefix_len, dim, dim, torch.float64)
    key_batch = batch
    if case == "shared":
        inputs["k_prefix"], inputs["v_prefix"] = (inputs[n][:1].detach().requires_grad_() for n in NAMES[1:3])
        key_batch = 1
    force_key_rows(monkeypatch, rows, torch.float64, key_batch, q_heads, kv_heads, dim)
    calls = []
    kernel_backward = fused_ops._kernel_backward

    def counted(grad_out, q, k, *rest):
        calls.append(k.shape[-2])
        return kernel_backward(grad_out, q, k, *rest)

    monkeypatch.setattr(fused_ops, "_kernel_backward", counted)
    prefix = {n: inputs[n] for n in NAMES[1:3]}
    if case == "detached":
        prefix = {n: inputs.pop(n).detach() for n in NAMES[1:3]}

    def op(*xs):
        args = dict(zip([n for n in NAMES if n in inputs], xs[:-1], strict=True)) | {
            n: x for n, x in prefix.items() if n not in inputs}
        return fused(*(args[n] for n in NAMES), xs[-1])

    def reference(*xs):
        args = dict(zip([n for n in NAMES if n in inputs], xs[:-1], strict=True)) | {
            n: x for n, x in prefix.items() if n not in inputs}
        k_prefix, v_prefix = (args[n].expand(batch, *args[n].shape[1:]) for n in NAMES[1:3])
        return prefix_causal_attention_reference(args["q"], k_prefix, v_prefix, args["k_self"], args["v_self"],
                                                 xs[-1])

    out, grads = run_with_grads(op, inputs, dim**-0.5)
    assert calls == [rows] * (prefix_len // rows) + [prefix_len % rows] + [seg_len]  # the blocks, then the own part
    ref_out, ref_grads = run_with_grads(reference, inputs, dim**-0.5)
    torch.testing.assert_close(out, ref_out, atol=1e-10, rtol=0)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], atol=1e-10, rtol=0, msg=name)


def backward_transient(inputs: dict[str, torch.Tensor], needs_prefix_grad: bool = True) -> int:
    """Peak bytes the fused op's backward allocates (``AllocationMeter``) besides the gradients it returns."""
    out = fused(*inputs.values(), 0.25)
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.dtype)
    wanted = [x for n, x in inputs.items() if needs_prefix_grad or "prefix" not in n]
    with AllocationMeter() as meter:
        grads = torch.autograd.grad(out, wanted, weight)
    return meter.peak - sum(g.untyped_storage().nbytes() for g in grads)


def test_backward_transient_bytes_do_not_grow_with_the_prefix(monkeypatch) -> None:
    """bf16 inputs (the CPU kernel computes in float32) over a long prefix in 128-key blocks: the backward's
    transient bytes stay the same when the prefix doubles (before the key blocks they held float32 copies and
    float32 gradient sums of the whole prefix: 4x its gradients' bytes more at the doubled prefix) and are at most
    what ``fused_backward_transient_bytes`` (which the estimate counts) says, and at least 2/3 of it."""
    batch, q_heads, kv_heads, seg_len, dim = 1, 4, 2, 8, 16
    force_key_rows(monkeypatch, 128, torch.bfloat16, batch, q_heads, kv_heads, dim)
    measured = {}
    for prefix_len in (2048, 4096):
        inputs = {n: x.detach().bfloat16().requires_grad_() for n, x in make_inputs(
            batch, q_heads, kv_heads, seg_len, prefix_len, dim, dim, torch.float32).items()}
        measured[prefix_len] = backward_transient(inputs)
        bound = fused_ops.fused_backward_transient_bytes("cpu", torch.bfloat16, batch, q_heads, kv_heads, dim,
                                                         seg_len, prefix_len, seg_len)
        assert 2 / 3 * bound <= measured[prefix_len] <= bound, (prefix_len, measured, bound)
    prefix_grad_bytes = 2 * batch * kv_heads * 2048 * dim * 2  # dK/dV of the shorter prefix, bf16
    assert abs(measured[4096] - measured[2048]) < prefix_grad_bytes / 8, (measured, prefix_grad_bytes)


def test_detached_prefix_allocates_no_prefix_gradient(monkeypatch) -> None:
    """A prefix that needs no gradient gets no gradient buffer: the backward's whole allocation stays below the
    size of the prefix's dK/dV (before, it allocated float32 sums for them)."""
    batch, q_heads, kv_heads, seg_len, prefix_len, dim = 1, 4, 2, 8, 4096, 16
    force_key_rows(monkeypatch, 128, torch.float32, batch, q_heads, kv_heads, dim)
    inputs = make_inputs(batch, q_heads, kv_heads, seg_len, prefix_len, dim, dim, torch.float32)
    for name in NAMES[1:3]:
        inputs[name].requires_grad_(False)
    prefix_grad_bytes = 2 * batch * kv_heads * prefix_len * dim * 4
    assert backward_transient(inputs, needs_prefix_grad=False) < prefix_grad_bytes / 2


def test_partial_backward_returns_float32_query_gradient() -> None:
    """For bf16 inputs ``fused_partial_backward`` returns d(q) in float32 (the callers sum other shares before the one
    rounding) and the K/V gradients in bf16, also with bf16 kernel arithmetic (what CUDA runs; the CPU kernel takes
    bf16 too), where each kernel call's dq comes out rounded to bf16; None where a gradient is not needed."""
    xs = [x.detach().bfloat16() for x in make_inputs(1, 4, 2, 5, 23, 16, 16, torch.float32).values()]
    for dtype in (torch.float32, torch.bfloat16):
        out, lse, extras = fused_ops.fused_partial_forward(*xs, 0.25, dtype)
        grad_out = torch.ones_like(out, dtype=torch.bfloat16)
        grads = fused_ops.fused_partial_backward(grad_out, *xs, out, lse, 0.25, dtype, OWN_SEGMENT, extras)
        assert [g.dtype for g in grads] == [torch.float32] + [torch.bfloat16] * 4, dtype
        detached = fused_ops.fused_partial_backward(grad_out, *xs, out, lse, 0.25, dtype, OWN_SEGMENT, extras,
                                                    (True, False, False, True, True))
        assert detached[1] is None and detached[2] is None
        for grad, same in zip(detached, grads, strict=True):
            assert grad is None or torch.equal(grad, same)


def test_bf16_kernel_arithmetic_over_key_blocks_no_worse_than_sdpa(monkeypatch) -> None:
    """The op with bf16 kernel arithmetic (CUDA's: each call's dq, dk, dv rounded to bf16) and the prefix backward
    in 64-key blocks under CPU bf16 autocast: output and gradients within SDPA's own bf16 error
    (``check_bf16_autocast_no_worse_than_sdpa``; the query gradient summed over the blocks in float32)."""
    force_key_rows(monkeypatch, 64, torch.bfloat16, 1, 4, 2, 32)

    def op(*args):
        return prefix_causal_attention_fused(*args, torch.bfloat16)

    check_bf16_autocast_no_worse_than_sdpa(op, backward_in_autocast=False)


def test_flash_accepts_checks_head_dim_and_asks_under_grad_mode(monkeypatch) -> None:
    """``_flash_accepts`` refuses head dims that are not a multiple of 8 without asking (the kernels reject them;
    SDPA pads them, this module does not), and asks ``can_use_flash_attention`` on stand-ins that require gradients
    under grad mode even when first called under no_grad (its answer is cached per arguments, and the training
    limits apply only in grad mode)."""
    asked = []

    def can_use(params) -> bool:
        asked.append((torch.is_grad_enabled(), params.query.requires_grad, params.key.requires_grad))
        return True

    monkeypatch.setattr(fused_ops, "can_use_flash_attention", can_use)
    fused_ops._flash_accepts.cache_clear()
    try:
        with torch.no_grad():
            assert not fused_ops._flash_accepts(torch.device("cpu"), torch.bfloat16, 4, 2, 12)
            assert fused_ops._flash_accepts(torch.device("cpu"), torch.bfloat16, 4, 2, 16)
    finally:
        fused_ops._flash_accepts.cache_clear()
    assert asked == [(True, True, True)] * 2  # causal and not, for dim 16 only


def test_partial_forward_merges_its_parts_in_place() -> None:
    """``fused_partial_forward`` over a prefix and its own keys (two kernel calls) holds at most 3 query tensors at
    once (its float32 output, the contiguous queries a kernel call takes and that call's output; the logsumexps
    besides): the merge of a part into the output makes no [B, Hq, N, D] float32 temporaries (it made 2 more before;
    pass-Q merges the gathered queries of every rank: 1.5 GiB each at 64K queries of the 27B's attention)."""
    batch, q_heads, kv_heads, seg_len, prefix_len, dim = 1, 4, 2, 512, 64, 32
    xs = [x.detach() for x in make_inputs(batch, q_heads, kv_heads, seg_len, prefix_len, dim, dim,
                                          torch.float32).values()]
    query_tensor = batch * q_heads * seg_len * dim * 4
    with AllocationMeter() as meter:
        out, lse, extras = fused_ops.fused_partial_forward(*xs, 0.25, torch.float32)
    assert out.shape == (batch, q_heads, seg_len, dim)
    assert meter.peak < 3.5 * query_tensor, (meter.peak, query_tensor)
