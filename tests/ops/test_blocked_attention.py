"""Blocked prefix + causal-segment attention against the SDPA reference; the partial (output, logsumexp) op's
blocked path against its dense reference."""

from __future__ import annotations

from functools import partial

import pytest
import torch

from verl_longstraw.memory import AllocationMeter
from verl_longstraw.ops.attention import blocked as blocked_ops
from verl_longstraw.ops.attention import prefix as attention_ops
from verl_longstraw.ops.attention.blocked import OwnKeyRule, partial_attention_blocked, prefix_causal_attention_blocked
from verl_longstraw.ops.attention.prefix import (
    partial_attention,
    partial_attention_reference,
    prefix_causal_attention_reference,
)
from verl_longstraw.testing.compare import no_worse_than_standard

NAMES = ("q", "k_prefix", "v_prefix", "k_self", "v_self")
TOL = {torch.float64: 1e-10, torch.float32: 1e-5}
# (B, Hq, Hk, T, P, D, Dv, block_size)
CASES = {
    "gqa": (2, 4, 2, 5, 23, 16, 16, 7),
    "mqa_mla_dv": (2, 4, 1, 6, 50, 24, 16, 16),
    "single_query": (1, 4, 2, 1, 10, 8, 8, 4),
    "no_prefix": (2, 4, 2, 9, 0, 8, 8, 4),
    "block_over_prefix": (1, 2, 2, 3, 5, 8, 12, 64),
    "mha_blocks_divide": (1, 3, 3, 8, 32, 8, 8, 8),
}


def make_inputs(
    batch: int, q_heads: int, kv_heads: int, seg_len: int, prefix_len: int, dim: int, v_dim: int, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    shapes = {
        "q": (batch, q_heads, seg_len, dim),
        "k_prefix": (batch, kv_heads, prefix_len, dim),
        "v_prefix": (batch, kv_heads, prefix_len, v_dim),
        "k_self": (batch, kv_heads, seg_len, dim),
        "v_self": (batch, kv_heads, seg_len, v_dim),
    }
    return {name: torch.randn(shape, generator=gen, dtype=dtype).requires_grad_() for name, shape in shapes.items()}


def run_with_grads(fn, inputs: dict[str, torch.Tensor], scale: float, **kwargs) -> tuple[torch.Tensor, dict]:
    out = fn(*inputs.values(), scale, **kwargs)
    gen = torch.Generator().manual_seed(1)
    loss = (out * torch.randn(out.shape, generator=gen, dtype=out.dtype)).sum()
    grads = torch.autograd.grad(loss, list(inputs.values()))
    return out.detach(), dict(zip(inputs, grads, strict=True))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("case", list(CASES))
def test_matches_reference(case: str, dtype: torch.dtype) -> None:
    batch, q_heads, kv_heads, seg_len, prefix_len, dim, v_dim, block_size = CASES[case]
    inputs = make_inputs(batch, q_heads, kv_heads, seg_len, prefix_len, dim, v_dim, dtype)
    scale = dim**-0.5
    out, grads = run_with_grads(prefix_causal_attention_blocked, inputs, scale, block_size=block_size)
    ref_out, ref_grads = run_with_grads(prefix_causal_attention_reference, inputs, scale)
    assert out.dtype == dtype and out.shape == (batch, q_heads, seg_len, v_dim)
    torch.testing.assert_close(out, ref_out, atol=TOL[dtype], rtol=0)
    for name in NAMES:
        assert grads[name].shape == inputs[name].shape and grads[name].dtype == dtype
        torch.testing.assert_close(grads[name], ref_grads[name], atol=TOL[dtype], rtol=0, msg=name)


def sparse_key_mask(seg_len: int, prefix_len: int, keep: float, hide_first_block_rows: int = 0) -> torch.Tensor:
    """Random bool selection [T, P + T] that keeps each query's own position; the first
    ``hide_first_block_rows`` queries see no prefix key at all (blocks with no visible key)."""
    gen = torch.Generator().manual_seed(2)
    mask = torch.rand(seg_len, prefix_len + seg_len, generator=gen) < keep
    mask[torch.arange(seg_len), prefix_len + torch.arange(seg_len)] = True
    mask[:hide_first_block_rows, :prefix_len] = False
    return mask


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("case", ["gqa", "mqa_mla_dv", "mha_blocks_divide"])
def test_sparse_key_mask_matches_reference(case: str, dtype: torch.dtype) -> None:
    """DSA-style top-k selection: blocked op with a bool key mask == SDPA with the additive mask."""
    batch, q_heads, kv_heads, seg_len, prefix_len, dim, v_dim, block_size = CASES[case]
    inputs = make_inputs(batch, q_heads, kv_heads, seg_len, prefix_len, dim, v_dim, dtype)
    key_mask = sparse_key_mask(seg_len, prefix_len, keep=0.4, hide_first_block_rows=2)
    out, grads = run_with_grads(
        prefix_causal_attention_blocked, inputs, dim**-0.5, block_size=block_size, key_mask=key_mask
    )
    ref_out, ref_grads = run_with_grads(prefix_causal_attention_reference, inputs, dim**-0.5, key_mask=key_mask)
    torch.testing.assert_close(out, ref_out, atol=TOL[dtype], rtol=0)
    for name in NAMES:
        torch.testing.assert_close(grads[name], ref_grads[name], atol=TOL[dtype], rtol=0, msg=name)


def test_key_mask_shape_is_checked() -> None:
    inputs = make_inputs(*CASES["gqa"][:7], torch.float32)
    with pytest.raises(ValueError, match=r"key_mask must be a bool tensor \[queries, prefix \+ own keys\] = \[5, 28\]"):
        prefix_causal_attention_blocked(*inputs.values(), 0.25, key_mask=torch.ones(5, 23, dtype=torch.bool))


def test_gradcheck() -> None:
    inputs = make_inputs(1, 4, 2, 3, 5, 4, 3, torch.float64)
    blocked = lambda *xs: prefix_causal_attention_blocked(*xs, 0.5, block_size=2)  # noqa: E731
    assert torch.autograd.gradcheck(blocked, tuple(inputs.values()), fast_mode=True)


def test_bfloat16_inputs() -> None:
    """bf16 output about as close to the float32 result as SDPA's in bf16 on the same machine."""
    inputs = {n: x.detach().bfloat16() for n, x in make_inputs(*CASES["gqa"][:7], torch.float32).items()}
    out = prefix_causal_attention_blocked(*inputs.values(), 0.25, block_size=7)
    standard = prefix_causal_attention_reference(*inputs.values(), 0.25)
    ref = prefix_causal_attention_reference(*(x.float() for x in inputs.values()), 0.25)
    assert out.dtype == torch.bfloat16
    errors = {"out": float((out.float() - ref).abs().max()),
              "standard_out": float((standard.float() - ref).abs().max())}
    assert no_worse_than_standard(errors, torch.bfloat16), errors


def saved_numels(fn, inputs: dict[str, torch.Tensor], scale: float, **kwargs) -> list[int]:
    """Element counts of every tensor autograd saves for backward while ``fn`` runs."""
    numels: list[int] = []

    def pack(x: torch.Tensor) -> torch.Tensor:
        numels.append(x.numel())
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        fn(*inputs.values(), scale, **kwargs)
    return numels


def test_saves_no_score_matrix() -> None:
    """Only inputs + output + logsumexp are saved for backward; nothing of size Hq*T*P."""
    batch, q_heads, kv_heads, seg_len, prefix_len, dim, v_dim = 1, 4, 2, 16, 256, 8, 8
    inputs = make_inputs(batch, q_heads, kv_heads, seg_len, prefix_len, dim, v_dim, torch.float32)
    score_numel = q_heads * seg_len * prefix_len

    numels = saved_numels(prefix_causal_attention_blocked, inputs, 0.3, block_size=32)
    expected = [x.numel() for x in inputs.values()] + [batch * q_heads * seg_len * v_dim, batch * q_heads * seg_len]
    assert sorted(numels) == sorted(expected)
    assert max(numels) < score_numel

    key_mask = sparse_key_mask(seg_len, prefix_len, keep=0.5)  # the only extra saved tensor
    numels = saved_numels(prefix_causal_attention_blocked, inputs, 0.3, block_size=32, key_mask=key_mask)
    assert sorted(numels) == sorted(expected + [key_mask.numel()])


def partial_grads(
    fn, inputs: dict[str, torch.Tensor], scale: float, **kwargs
) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Output, logsumexp and input gradients of a loss that uses both outputs (logsumexp only where finite)."""
    out, logsumexp = fn(*inputs.values(), scale, **kwargs)
    gen = torch.Generator().manual_seed(1)
    out_weight = torch.randn(out.shape, generator=gen, dtype=out.dtype)
    logsumexp_weight = torch.randn(logsumexp.shape, generator=gen, dtype=out.dtype)
    loss = (out * out_weight).sum() + (logsumexp.where(logsumexp.isfinite(), 0.0) * logsumexp_weight).sum()
    grads = torch.autograd.grad(loss, list(inputs.values()))
    return out.detach(), logsumexp.detach(), dict(zip(inputs, grads, strict=True))


# query rows N, own keys T, rule: the context-parallel uses (rows of other ranks before and after the own segment)
RULES = {
    "own_segment": (6, 6, OwnKeyRule()),
    "later_rows_see_all": (11, 4, OwnKeyRule(start=3, later_rows_see_all=True)),
    "only_own_rows": (11, 4, OwnKeyRule(start=3, later_rows_see_all=False)),
    "first_rank_of_three": (9, 2, OwnKeyRule(start=0, later_rows_see_all=False)),
}


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("heads", ["gqa", "mqa_mla_dv"])
@pytest.mark.parametrize("rule", list(RULES))
def test_partial_blocked_matches_reference(rule: str, heads: str, dtype: torch.dtype, masked: bool) -> None:
    """(output, logsumexp) and gradients through both, for every own-key rule; rows that see no key included."""
    batch, q_heads, kv_heads, _, prefix_len, dim, v_dim, block_size = CASES[heads]
    rows, own_len, own_keys = RULES[rule]
    inputs = make_inputs(batch, q_heads, kv_heads, own_len, prefix_len, dim, v_dim, dtype)
    gen = torch.Generator().manual_seed(3)
    inputs["q"] = torch.randn(batch, q_heads, rows, dim, dtype=dtype, generator=gen).requires_grad_()
    key_mask = torch.rand(rows, prefix_len + own_len, generator=gen) < 0.4 if masked else None
    if masked:
        key_mask[0] = False  # a row that sees no key at all
    kwargs = {"own_keys": own_keys, "key_mask": key_mask}
    out, logsumexp, grads = partial_grads(partial_attention_blocked, inputs, dim**-0.5, block_size=block_size, **kwargs)
    ref_out, ref_logsumexp, ref_grads = partial_grads(partial_attention_reference, inputs, dim**-0.5, **kwargs)
    assert out.dtype == logsumexp.dtype == dtype and out.shape == (batch, q_heads, rows, v_dim)
    if masked:
        assert (logsumexp[:, :, 0] == float("-inf")).all() and (out[:, :, 0] == 0).all()
    torch.testing.assert_close(logsumexp, ref_logsumexp, atol=TOL[dtype], rtol=0)
    torch.testing.assert_close(out, ref_out, atol=TOL[dtype], rtol=0)
    for name in NAMES:
        assert grads[name].isfinite().all(), name
        torch.testing.assert_close(grads[name], ref_grads[name], atol=TOL[dtype], rtol=0, msg=name)


@pytest.mark.parametrize("path", ["dense", "blocked"])
def test_partials_merge_to_full_attention(path: str) -> None:
    """Two partials over disjoint keys (half the prefix; the other half and the own keys), merged by their
    logsumexps, equal SDPA over all keys, outputs and gradients (what the context-parallel op relies on)."""
    batch, q_heads, kv_heads, seg_len, prefix_len, dim, v_dim, _ = CASES["gqa"]
    inputs = make_inputs(batch, q_heads, kv_heads, seg_len, prefix_len, dim, v_dim, torch.float64)
    fn = partial_attention_reference if path == "dense" else partial(partial_attention_blocked, block_size=4)

    def merged(q, k_prefix, v_prefix, k_self, v_self, scale):
        half = prefix_len // 2
        no_keys = k_self[..., :0, :], v_self[..., :0, :]
        out_a, lse_a = fn(q, k_prefix[..., :half, :], v_prefix[..., :half, :], *no_keys, scale)
        out_b, lse_b = fn(q, k_prefix[..., half:, :], v_prefix[..., half:, :], k_self, v_self, scale)
        total = torch.logaddexp(lse_a, lse_b)
        return out_a * (lse_a - total).exp().unsqueeze(-1) + out_b * (lse_b - total).exp().unsqueeze(-1)

    out, grads = run_with_grads(merged, inputs, dim**-0.5)
    ref_out, ref_grads = run_with_grads(prefix_causal_attention_reference, inputs, dim**-0.5)
    torch.testing.assert_close(out, ref_out, atol=1e-10, rtol=0)
    for name in NAMES:
        torch.testing.assert_close(grads[name], ref_grads[name], atol=1e-10, rtol=0, msg=name)


def test_partial_attention_dispatch(monkeypatch) -> None:
    """Dense while the scores fit in SCORES_BYTES_LIMIT, blocked beyond it or when a block size is given."""
    inputs = make_inputs(*CASES["gqa"][:7], torch.float64)
    calls = []
    blocked = attention_ops.partial_attention_blocked
    monkeypatch.setattr(
        attention_ops, "partial_attention_blocked", lambda *a, **k: calls.append(a[-1]) or blocked(*a, **k)
    )
    partial_attention(*inputs.values(), 0.25)
    assert calls == []
    partial_attention(*inputs.values(), 0.25, block_size=7)
    monkeypatch.setattr(attention_ops, "SCORES_BYTES_LIMIT", 0)
    partial_attention(*inputs.values(), 0.25)
    assert calls == [7, attention_ops.PARTIAL_BLOCK_SIZE]


def relative_l2(value: torch.Tensor, reference: torch.Tensor) -> float:
    return float((value.double() - reference).norm() / reference.norm())


def check_bf16_autocast_no_worse_than_sdpa(op, backward_in_autocast: bool) -> None:
    """Under CPU bf16 autocast, ``op``'s output and every input gradient (bf16, like its inputs) are as close to a
    float64 reference on the same bf16 inputs as SDPA's (the standard path) on the same machine."""
    batch, q_heads, kv_heads, seg_len, prefix_len, dim = 1, 4, 2, 32, 256, 32
    inputs = {n: x.detach().bfloat16() for n, x in make_inputs(
        batch, q_heads, kv_heads, seg_len, prefix_len, dim, dim, torch.float32).items()}
    inputs["q"] = (inputs["q"].float() * 4).bfloat16()  # peaked attention, as in trained models
    weight = torch.randn(batch, q_heads, seg_len, dim, generator=torch.Generator().manual_seed(1), dtype=torch.float64)

    def run(fn, dtype: torch.dtype, autocast: bool) -> dict[str, torch.Tensor]:
        xs = [x.to(dtype).requires_grad_() for x in inputs.values()]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = fn(*xs, dim**-0.5)
            loss = (out.double() * weight).sum()
            if backward_in_autocast:
                grads = torch.autograd.grad(loss, xs)
        if not backward_in_autocast:
            grads = torch.autograd.grad(loss, xs)
        return {"out": out.detach(), **dict(zip(NAMES, grads, strict=True))}

    reference = run(prefix_causal_attention_reference, torch.float64, False)
    result = run(op, torch.bfloat16, True)
    standard = run(prefix_causal_attention_reference, torch.bfloat16, True)
    errors = {name: relative_l2(result[name], reference[name]) for name in reference}
    errors |= {f"standard_{name}": relative_l2(standard[name], reference[name]) for name in reference}
    assert result["out"].dtype == torch.bfloat16 and all(result[n].dtype == torch.bfloat16 for n in NAMES)
    assert no_worse_than_standard(errors, torch.bfloat16), errors


@pytest.mark.parametrize("operand_dtype", [None, torch.bfloat16], ids=["float32_operands", "bf16_operands"])
@pytest.mark.parametrize("backward_in_autocast", [False, True])
def test_bf16_autocast_gradients_no_worse_than_sdpa(backward_in_autocast: bool, operand_dtype) -> None:
    """The blocked op under CPU bf16 autocast (``check_bf16_autocast_no_worse_than_sdpa``). Before the op pinned its
    compute dtype, its forward scored in bf16 and its backward in float32: 2.5-7x SDPA's error. bf16 operands
    (what CUDA runs for half inputs, float32 sums) stay within SDPA's error too (they did not while the queries
    were scaled before rounding: 1.9x)."""
    op = partial(prefix_causal_attention_blocked, block_size=64, operand_dtype=operand_dtype)
    check_bf16_autocast_no_worse_than_sdpa(op, backward_in_autocast)


def test_matmul_operands() -> None:
    """float32 operands on CPU (no float32-output half matmul there); what CUDA's half path calls, pinned:
    ``torch.bmm(..., out_dtype=torch.float32)`` for bf16 operands returns float32 (checked on the meta device)."""
    assert blocked_ops.matmul_dtype(torch.zeros(1, dtype=torch.bfloat16)) == torch.float32
    assert blocked_ops.matmul_dtype(torch.zeros(1, dtype=torch.float64)) == torch.float64
    a = torch.empty(3, 4, 5, dtype=torch.bfloat16, device="meta")
    assert torch.bmm(a, a.transpose(-1, -2), out_dtype=torch.float32).dtype == torch.float32
    assert str(torch.ops.aten.bmm.dtype._schema) == (
        "aten::bmm.dtype(Tensor self, Tensor mat2, ScalarType out_dtype) -> Tensor"
    )


def test_backward_writes_prefix_gradients_in_place() -> None:
    """The backward's peak allocation is its input gradients plus block- and query-sized temporaries: each
    key block's dK/dV goes straight into its rows of the gradient, no per-block lists + cat (which peaked
    at 2x the prefix gradients)."""
    inputs = make_inputs(1, 4, 2, 8, 4096, 16, 16, torch.float32)
    out = prefix_causal_attention_blocked(*inputs.values(), 0.25, block_size=128)
    with AllocationMeter() as memory:
        grads = torch.autograd.grad(out.sum(), list(inputs.values()))
    grad_bytes = sum(g.nbytes for g in grads)
    prefix_grad_bytes = grads[1].nbytes + grads[2].nbytes  # 1 MiB
    assert memory.peak - grad_bytes < prefix_grad_bytes / 4, (memory.peak, grad_bytes, prefix_grad_bytes)

    # a prefix that needs no gradient (prompt_grad: detached) costs no dK/dV at all
    out = prefix_causal_attention_blocked(*(x.detach() if "prefix" in n else x for n, x in inputs.items()), 0.25,
                                          block_size=128)
    with AllocationMeter() as memory:
        grads = torch.autograd.grad(out.sum(), [x for n, x in inputs.items() if "prefix" not in n])
    assert memory.peak - sum(g.nbytes for g in grads) < prefix_grad_bytes / 4, memory.peak


def test_detached_prefix_gets_no_gradient() -> None:
    """A prefix that needs no gradient (prompt_grad: detached) gets none and costs no dK/dV; the others are
    unchanged."""
    inputs = make_inputs(*CASES["gqa"][:7], torch.float64)
    _, grads = run_with_grads(prefix_causal_attention_blocked, inputs, 0.25, block_size=7)
    inputs["k_prefix"].requires_grad_(False)
    inputs["v_prefix"].requires_grad_(False)
    partial_inputs = {n: x for n, x in inputs.items() if x.requires_grad}

    def blocked(q, k_self, v_self, scale):
        return prefix_causal_attention_blocked(q, inputs["k_prefix"], inputs["v_prefix"], k_self, v_self, scale,
                                               block_size=7)

    _, detached_grads = run_with_grads(blocked, partial_inputs, 0.25)
    for name, grad in detached_grads.items():
        torch.testing.assert_close(grad, grads[name], atol=0, rtol=0)


def test_key_block_bounds_the_score_block_bytes():
    """Long query chunks score fewer keys at a time: scores and probabilities of a block stay within
    SCORE_BLOCK_BYTES (24 heads x 131072 queries in float32: 1024 keys would be 24 GiB), never below the minimum."""
    limit = attention_ops.SCORE_BLOCK_BYTES
    assert attention_ops.key_block_size(4 * 512, 4) == attention_ops.PARTIAL_BLOCK_SIZE
    for rows in (24 * 8192, 24 * 131072, 64 * 65536):
        block = attention_ops.key_block_size(rows, 4)
        assert 2 * rows * block * 4 <= limit < 2 * rows * (block + 1) * 4 or block == attention_ops.MIN_KEY_BLOCK
    assert attention_ops.key_block_size(10**9, 4) == attention_ops.MIN_KEY_BLOCK
