"""Sharded Gated DeltaNet and conv input on 2 and 3 gloo ranks (float64) against the single-process op.

All cases run in ONE ``run_ranks`` call of 3 processes (spawning dominates the test time), with
gloo's collective-consistency checker on (TORCH_DISTRIBUTED_DEBUG=DETAIL): 3-rank cases on the
whole world, 2-rank cases on the subgroup of global ranks [1, 2], whose group ranks (0, 1) differ
from the global ones. Rank r holds a consecutive slice of one sequence; its loss weights its own
outputs and puts its own terminal gradient on the replicated final state. The single-process loss
is the sum of the ranks' losses, so its gradients must equal each rank's gradients of its own
tokens and the SUM over ranks of the replicated initial state's partial gradients.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from verl_longstraw.ops.causal_conv.cp import sharded_conv_input
from verl_longstraw.ops.gated_delta.cp import sharded_gated_delta_rule
from verl_longstraw.ops.gated_delta.rule import gated_delta_rule
from verl_longstraw.parallel.comm import trace_collectives
from verl_longstraw.parallel.launch import run_ranks

TOL = dict(atol=1e-10, rtol=1e-10)
MODES = ("sequential", "affine")
TOKEN_INPUTS = ("q", "k", "v", "g", "beta")
CONV_HISTORY = 3  # K - 1 of a width-4 conv
CONV_CHANNELS = 3


def _case(
    seed: int, sizes: tuple[int, ...], batch: int, heads: int, dk: int, dv: int, l2norm: bool,
    v_heads: int | None = None,
) -> dict:
    """``heads`` key heads (q, k); ``v_heads`` value heads (v, g, beta, states), a multiple of them (default equal)."""
    ranks = [0, 1, 2] if len(sizes) == 3 else [1, 2]
    v_heads = heads if v_heads is None else v_heads
    return dict(seed=seed, sizes=list(sizes), ranks=ranks, batch=batch, heads=heads, v_heads=v_heads, dk=dk, dv=dv,
                l2norm=l2norm)


# 2 ranks: a 1-token slice shorter than the conv history; a 70-token slice crosses the op's 64-token chunk; Dv > Dk.
# 3 ranks: slices of 2 and 1 tokens, so rank 2's conv history spans the initial conv state and both earlier ranks.
# Grouped value heads (GVA, as Qwen3-Next / Qwen3.5): 2 key heads, 4 or 6 value heads, in one case of each world.
CASES = {
    2: [_case(1, (1, 6), 2, 2, 4, 3, True, v_heads=4), _case(2, (70, 5), 1, 1, 3, 5, False)],
    3: [_case(3, (2, 1, 4), 2, 2, 4, 3, True), _case(4, (5, 3, 7), 1, 2, 4, 4, True, v_heads=6)],
}


def _inputs(case: dict) -> dict[str, torch.Tensor]:
    """Full-sequence inputs and loss weights of ``case`` (the same in every process: seeded generator)."""
    gen = torch.Generator().manual_seed(case["seed"])
    world, length = len(case["sizes"]), sum(case["sizes"])
    b, h, hv, dk, dv = case["batch"], case["heads"], case["v_heads"], case["dk"], case["dv"]

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    def rand(*shape: int) -> torch.Tensor:
        return torch.rand(*shape, generator=gen, dtype=torch.float64)

    return dict(
        q=randn(b, length, h, dk), k=randn(b, length, h, dk), v=randn(b, length, hv, dv),
        g=-0.5 * rand(b, length, hv), beta=rand(b, length, hv), initial_state=randn(b, hv, dk, dv),
        out_weight=randn(b, length, hv, dv), final_weight=randn(world, b, hv, dk, dv),
        x=randn(b, CONV_CHANNELS, length), conv_state=randn(b, CONV_CHANNELS, CONV_HISTORY),
        conv_in_weight=randn(world, b, CONV_CHANNELS, CONV_HISTORY + length),
        conv_final_weight=randn(world, b, CONV_CHANNELS, CONV_HISTORY),
    )


def _bounds(sizes: list[int]) -> list[tuple[int, int]]:
    """Global [start, end) of every rank's tokens."""
    starts = [sum(sizes[:r]) for r in range(len(sizes))]
    return [(s, s + n) for s, n in zip(starts, sizes, strict=True)]


def _bf16(tensors) -> list[torch.Tensor]:
    return [x.detach().to(torch.bfloat16) for x in tensors]


def _gdn_on_rank(case: dict, full: dict, group: dist.ProcessGroup, rank: int, mode: str) -> dict:
    """Forward + backward (with trace), the same forward without autograd, and a bf16 forward."""
    sizes, l2norm = case["sizes"], case["l2norm"]
    lo, hi = _bounds(sizes)[rank]
    own = {name: full[name][:, lo:hi].clone().requires_grad_() for name in TOKEN_INPUTS}
    initial = full["initial_state"].clone().requires_grad_()
    with trace_collectives() as trace:
        out, final = sharded_gated_delta_rule(*own.values(), initial, group, sizes, l2norm, mode)
        ((out * full["out_weight"][:, lo:hi]).sum() + (final * full["final_weight"][rank]).sum()).backward()
    with torch.no_grad():
        out_no_grad, final_no_grad = sharded_gated_delta_rule(*own.values(), initial, group, sizes, l2norm, mode)
        out_bf16, final_bf16 = sharded_gated_delta_rule(
            *_bf16(own.values()), initial.float(), group, sizes, l2norm, mode
        )
        out_zero, final_zero = sharded_gated_delta_rule(*own.values(), None, group, sizes, l2norm, mode)
    with pytest.raises(ValueError, match="sizes"):  # raised on every rank, before any collective
        sharded_gated_delta_rule(*own.values(), initial, group, [hi - lo], l2norm, mode)
    return dict(
        out=out.detach(), final=final.detach(), out_no_grad=out_no_grad, final_no_grad=final_no_grad,
        out_bf16=out_bf16, final_bf16=final_bf16, out_zero=out_zero, final_zero=final_zero,
        grads={name: x.grad for name, x in own.items()},
        initial_grad=initial.grad, trace=trace,
    )


def _conv_on_rank(case: dict, full: dict, group: dist.ProcessGroup, rank: int) -> dict:
    lo, hi = _bounds(case["sizes"])[rank]
    x = full["x"][..., lo:hi].clone().requires_grad_()
    conv_state = full["conv_state"].clone().requires_grad_()
    with trace_collectives() as trace:
        conv_in, final = sharded_conv_input(x, conv_state, group, case["sizes"])
        weight = full["conv_in_weight"][rank][..., : CONV_HISTORY + hi - lo]
        ((conv_in * weight).sum() + (final * full["conv_final_weight"][rank]).sum()).backward()
    return dict(
        conv_in=conv_in.detach(), final=final.detach(), x_grad=x.grad, state_grad=conv_state.grad, trace=trace,
        final_storage_bytes=final.untyped_storage().nbytes(),
    )


def _rank_cases(global_rank: int, world: int, cases: list[dict]) -> list[dict | None]:
    """This process's results for every case (None where it is not in the case's group)."""
    torch.set_num_threads(1)
    groups = {}
    for ranks in dict.fromkeys(tuple(case["ranks"]) for case in cases):  # every process, every group, same order
        groups[ranks] = dist.new_group(list(ranks))
    results = []
    for case in cases:
        if global_rank not in case["ranks"]:
            results.append(None)
            continue
        group = groups[tuple(case["ranks"])]
        rank, full = dist.get_rank(group), _inputs(case)
        result = {mode: _gdn_on_rank(case, full, group, rank, mode) for mode in MODES}
        results.append(result | {"conv": _conv_on_rank(case, full, group, rank)})
    return results


@pytest.fixture(scope="module")
def per_rank() -> list[list[dict | None]]:
    cases = [case for world in CASES for case in CASES[world]]
    return run_ranks(_rank_cases, 3, cases, timeout_s=240, env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"})


def _reference_gdn(case: dict) -> dict:
    """Single-process op on the whole sequence, loss = sum of the ranks' losses; bf16 standard and float64 on bf16."""
    full = _inputs(case)
    leaves = {name: full[name].clone().requires_grad_() for name in (*TOKEN_INPUTS, "initial_state")}
    out, final = gated_delta_rule(*leaves.values(), use_qk_l2norm=case["l2norm"])
    ((out * full["out_weight"]).sum() + (final * full["final_weight"].sum(0)).sum()).backward()
    low, initial = _bf16(full[name] for name in TOKEN_INPUTS), full["initial_state"].float()
    tokens = [full[name] for name in TOKEN_INPUTS]
    groups = case["v_heads"] // case["heads"]
    repeated = [x.repeat_interleave(groups, dim=2) for x in tokens[:2]]  # the old convention: q, k per value head
    old_out, old_final = gated_delta_rule(*repeated, *tokens[2:], full["initial_state"], use_qk_l2norm=case["l2norm"])
    torch.testing.assert_close(out.detach(), old_out, **TOL, msg=f"grouped != repeat-first out {case}")
    torch.testing.assert_close(final.detach(), old_final, **TOL, msg=f"grouped != repeat-first final {case}")
    return dict(
        out=out.detach(), final=final.detach(), grads={name: x.grad for name, x in leaves.items()},
        zero=gated_delta_rule(*tokens, None, use_qk_l2norm=case["l2norm"]),
        standard_bf16=gated_delta_rule(*low, initial, use_qk_l2norm=case["l2norm"]),
        exact_bf16=gated_delta_rule(*(x.double() for x in low), initial.double(), use_qk_l2norm=case["l2norm"]),
    )


def _check_gdn(case: dict, mode: str, results: list[dict], ref: dict) -> None:
    for rank, ((lo, hi), got) in enumerate(zip(_bounds(case["sizes"]), results, strict=True)):
        where = f"{case} {mode} rank {rank}"
        torch.testing.assert_close(got["out"], ref["out"][:, lo:hi], **TOL, msg=f"out {where}")
        torch.testing.assert_close(got["final"], ref["final"], **TOL, msg=f"final {where}")
        torch.testing.assert_close(got["out_no_grad"], got["out"], **TOL, msg=f"no_grad out {where}")
        torch.testing.assert_close(got["final_no_grad"], got["final"], **TOL, msg=f"no_grad final {where}")
        torch.testing.assert_close(got["out_zero"], ref["zero"][0][:, lo:hi], **TOL, msg=f"zero-state out {where}")
        torch.testing.assert_close(got["final_zero"], ref["zero"][1], **TOL, msg=f"zero-state final {where}")
        for name in TOKEN_INPUTS:
            expected = ref["grads"][name][:, lo:hi]
            torch.testing.assert_close(got["grads"][name], expected, **TOL, msg=f"d{name} {where}")
    initial_grad = sum(got["initial_grad"] for got in results)
    torch.testing.assert_close(initial_grad, ref["grads"]["initial_state"], **TOL, msg=f"d initial {case} {mode}")
    collectives = [[r for r in got["trace"] if r[0] not in ("send", "recv")] for got in results]
    assert collectives[0] and all(c == collectives[0] for c in collectives), f"{case} {mode}: {collectives}"
    _check_bf16(case, mode, results, ref)


def _check_bf16(case: dict, mode: str, results: list[dict], ref: dict) -> None:
    """bf16 inputs: bf16 outputs and a float32 final state whose errors (Frobenius, vs float64 arithmetic on the same
    bf16 values) are the size of the standard op's own; a bf16 state would be ~1000x off."""
    (standard_out, standard_final), (exact_out, exact_final) = ref["standard_bf16"], ref["exact_bf16"]
    assert all(got["out_bf16"].dtype == torch.bfloat16 and got["final_bf16"].dtype == torch.float32 for got in results)
    out = torch.cat([got["out_bf16"] for got in results], dim=1)
    out_ratio = (out.double() - exact_out).norm() / (standard_out.double() - exact_out).norm()
    final_error = max((got["final_bf16"] - exact_final).norm() for got in results)
    final_ratio = final_error / (standard_final - exact_final).norm()
    assert out_ratio <= 2, f"bf16 output error {out_ratio:.3g}x the standard op's, {case} {mode}"
    assert final_ratio <= 4, f"bf16-input final state error {final_ratio:.3g}x the standard op's, {case} {mode}"


def _check_conv(case: dict, results: list[dict]) -> None:
    full = _inputs(case)
    x, conv_state = full["x"].clone().requires_grad_(), full["conv_state"].clone().requires_grad_()
    conv_in_full = torch.cat([conv_state, x], dim=-1)
    bounds = _bounds(case["sizes"])
    expected_ins = [conv_in_full[..., lo : CONV_HISTORY + hi] for lo, hi in bounds]
    expected_final = conv_in_full[..., -CONV_HISTORY:]
    loss = sum((c * w[..., : c.shape[-1]]).sum() for c, w in zip(expected_ins, full["conv_in_weight"], strict=True))
    (loss + (expected_final * full["conv_final_weight"].sum(0)).sum()).backward()
    for rank, ((lo, hi), got) in enumerate(zip(bounds, results, strict=True)):
        where = f"{case} rank {rank}"
        torch.testing.assert_close(got["conv_in"], expected_ins[rank], **TOL, msg=f"conv_in {where}")
        torch.testing.assert_close(got["final"], expected_final, **TOL, msg=f"conv final {where}")
        torch.testing.assert_close(got["x_grad"], x.grad[..., lo:hi], **TOL, msg=f"dx {where}")
        final_bytes = got["final"].numel() * got["final"].element_size()
        assert got["final_storage_bytes"] == final_bytes, f"final conv state is a view of a larger buffer, {where}"
        assert got["trace"] == results[0]["trace"] != [], f"conv collectives differ between ranks, {where}"
    state_grad = sum(got["state_grad"] for got in results)
    torch.testing.assert_close(state_grad, conv_state.grad, **TOL, msg=f"d conv_state {case}")


@pytest.mark.parametrize("world", sorted(CASES))
def test_ranks_match_single_process(per_rank, world):
    """Outputs, replicated final states and gradients of both modes (so sequential == affine) and the conv input."""
    offset = sum(len(CASES[w]) for w in CASES if w < world)
    for index, case in enumerate(CASES[world], start=offset):
        results = [per_rank[global_rank][index] for global_rank in case["ranks"]]
        ref = _reference_gdn(case)
        for mode in MODES:
            _check_gdn(case, mode, [got[mode] for got in results], ref)
        for got in results:
            for key in ("out", "final"):
                torch.testing.assert_close(got["sequential"][key], got["affine"][key], **TOL, msg=f"{key} {case}")
        _check_conv(case, [got["conv"] for got in results])


def test_single_process_group_is_the_op():
    full = _inputs(_case(5, (4,), 1, 2, 3, 2, True))
    args = [full[name] for name in (*TOKEN_INPUTS, "initial_state")]
    out, final = sharded_gated_delta_rule(*args, None, [4])
    ref_out, ref_final = gated_delta_rule(*args)
    assert torch.equal(out, ref_out) and torch.equal(final, ref_final)
    conv_in, conv_final = sharded_conv_input(full["x"], full["conv_state"], None, [4])
    assert torch.equal(conv_in, torch.cat([full["conv_state"], full["x"]], dim=-1))
    assert torch.equal(conv_final, full["x"][..., -CONV_HISTORY:])
    with pytest.raises(ValueError, match="mode"):
        sharded_gated_delta_rule(*args, None, [4], mode="ring")
