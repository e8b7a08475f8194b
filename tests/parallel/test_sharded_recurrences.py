"""Sharded Mamba2 scan (``ops.mamba2.cp``) and Kimi Delta Attention (``ops.kda.cp``) on 2 and 3 gloo ranks against
the single-process op.

One ``run_ranks`` call of 3 processes serves every case (as ``test_sharded_gated_delta``): 3-rank cases on the whole
world, 2-rank cases on the subgroup of global ranks [1, 2]. Rank r holds a consecutive slice of one sequence; its loss
weights its own outputs and puts its own terminal weight on the replicated final state, so the single-process loss is
the sum of the ranks' and its gradients equal each rank's gradients of its own tokens and the SUM over ranks of the
replicated inputs' partial gradients (the initial state; the scan's A and D).

Two kernels per op. ``float64``: a token-by-token recurrence in float64 (``ops.mamba2.ssd.reference_chunk_scan``;
for KDA ``ops.kda.rule.kda_reference``, checked against the model's rule), so the merge algebra is exact: agreement
< 1e-10. ``model``: the model's own chunked kernel, which computes in float32 whatever its inputs (transformers'
mamba2_chunk_scan and chunk_kimi_delta_attention cast them), so the sharded run differs from one run by float32
roundings in another order: 40 float32 eps relative L2, the bound ``tests/ops`` holds these kernels to against their
references.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from verl_longstraw.ops.kda.cp import sharded_kda_rule
from verl_longstraw.ops.kda.rule import kda_reference
from verl_longstraw.ops.mamba2.cp import sharded_ssd_scan
from verl_longstraw.ops.mamba2.ssd import reference_chunk_scan
from verl_longstraw.parallel.comm import trace_collectives
from verl_longstraw.parallel.launch import run_ranks
from verl_longstraw.tiny import unavailable

TOL = {"float64": 1e-10, "model": 40 * torch.finfo(torch.float32).eps}
SSD_CHUNK = 16
SSD_TOKENS = ("x", "dt", "B", "C")
SSD_REPLICATED = ("A", "D", "initial_state")
KDA_TOKENS = ("q", "k", "v", "g", "beta")


def kda_float64(q, k, v, g, beta, initial_state, output_final_state=True, use_qk_l2norm_in_kernel=True):
    """``ops.kda.rule.kda_reference`` (the recurrence in the inputs' dtype) under the model rule's signature as
    ``ops.kda.rule.kda_rule`` calls it: (output [B, S, H, Dv], final state [B, H, Dk, Dv])."""
    return kda_reference(q, k, v, g, beta, initial_state=initial_state, output_final_state=True,
                         use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)


# the models' kernels where this transformers has the model (5.10 has neither): their cases run only then
NEMOTRON_H_MISSING, KIMI_LINEAR_MISSING = unavailable("nemotron_h"), unavailable("kimi_linear")
KERNELS = {("ssd", "float64"): reference_chunk_scan, ("kda", "float64"): kda_float64}
if not NEMOTRON_H_MISSING:
    from transformers.models.nemotron_h import modeling_nemotron_h

    KERNELS["ssd", "model"] = modeling_nemotron_h.mamba2_chunk_scan
if not KIMI_LINEAR_MISSING:
    from transformers.models.kimi_linear import modeling_kimi_linear

    KERNELS["kda", "model"] = modeling_kimi_linear.chunk_kimi_delta_attention


def _case(op: str, kernel: str, seed: int, sizes: tuple[int, ...]) -> dict:
    return dict(op=op, kernel=kernel, seed=seed, sizes=list(sizes), ranks=[0, 1, 2] if len(sizes) == 3 else [1, 2])


# SSD chunks of 16: a 1-token slice, slices crossing a chunk boundary and one ending on it; KDA's 64-token chunks: a
# 70-token slice crosses one. 3 ranks: a middle slice of 1 token.
CASES = [
    *(_case("ssd", kernel, seed, sizes) for kernel in ("model", "float64") if ("ssd", kernel) in KERNELS
      for seed, sizes in ((1, (1, 20)), (2, (16, 9)), (3, (5, 1, 23)))),
    *(() if KIMI_LINEAR_MISSING else (_case("kda", "model", 4, (70, 5)), _case("kda", "model", 5, (3, 1, 9)))),
    _case("kda", "float64", 6, (1, 12)), _case("kda", "float64", 7, (3, 1, 9)),
]


def _inputs(case: dict) -> dict[str, torch.Tensor]:
    """Full-sequence inputs and loss weights of ``case`` (the same in every process: seeded generator); float64, or
    float32 for the model's KDA rule (its state is float32)."""
    gen = torch.Generator().manual_seed(case["seed"])
    world, length, batch = len(case["sizes"]), sum(case["sizes"]), 2

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    if case["op"] == "ssd":
        heads, head_dim, groups, state = 4, 3, 2, 5
        tensors = dict(x=randn(batch, length, heads, head_dim), dt=F.softplus(randn(batch, length, heads)),
                       B=randn(batch, length, groups, state), C=randn(batch, length, groups, state),
                       A=-2 * torch.rand(heads, generator=gen, dtype=torch.float64), D=randn(heads),
                       initial_state=randn(batch, heads, head_dim, state))
        out_shape = (batch, length, heads, head_dim)
    else:
        heads, k_dim, v_dim = 2, 8, 4
        tensors = dict(q=randn(batch, length, heads, k_dim), k=randn(batch, length, heads, k_dim),
                       v=randn(batch, length, heads, v_dim), g=F.logsigmoid(randn(batch, length, heads, k_dim)),
                       beta=torch.rand(batch, length, heads, generator=gen, dtype=torch.float64),
                       initial_state=randn(batch, heads, k_dim, v_dim))
        if case["kernel"] == "model":
            tensors = {name: x.float() for name, x in tensors.items()}
        out_shape = (batch, length, heads, v_dim)
    dtype, final_shape = tensors["initial_state"].dtype, tensors["initial_state"].shape
    return tensors | dict(out_weight=randn(*out_shape).to(dtype), final_weight=randn(world, *final_shape).to(dtype))


def _bounds(sizes: list[int]) -> list[tuple[int, int]]:
    """Global [start, end) of every rank's tokens."""
    starts = [sum(sizes[:r]) for r in range(len(sizes))]
    return [(s, s + n) for s, n in zip(starts, sizes, strict=True)]


def _names(op: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(per-token inputs, replicated inputs) of ``op``."""
    return (SSD_TOKENS, SSD_REPLICATED) if op == "ssd" else (KDA_TOKENS, ("initial_state",))


def _call(case: dict, tensors: dict[str, torch.Tensor], group):
    """The sharded op of ``case`` (``group`` None: one process over the whole sequence): (output, final state)."""
    op, kernel, sizes = case["op"], KERNELS[case["op"], case["kernel"]], case["sizes"]
    if op == "ssd":
        return sharded_ssd_scan(kernel, *(tensors[n] for n in ("x", "dt", "A", "B", "C", "D", "initial_state")),
                                SSD_CHUNK, group, sizes)
    return sharded_kda_rule(kernel, *(tensors[n] for n in (*KDA_TOKENS, "initial_state")), group, sizes)


def _on_rank(case: dict, group: dist.ProcessGroup, rank: int) -> dict:
    """This rank's outputs, replicated final state and gradients, and the collectives it issued."""
    full, (token_names, replicated) = _inputs(case), _names(case["op"])
    lo, hi = _bounds(case["sizes"])[rank]
    leaves = {n: full[n][:, lo:hi].clone().requires_grad_() for n in token_names}
    leaves |= {n: full[n].clone().requires_grad_() for n in replicated}
    with trace_collectives() as trace:
        out, final = _call(case, leaves, group)
        ((out * full["out_weight"][:, lo:hi]).sum() + (final * full["final_weight"][rank]).sum()).backward()
    return dict(out=out.detach(), final=final.detach(), grads={n: x.grad for n, x in leaves.items()}, trace=trace)


def _rank_cases(global_rank: int, world: int, cases: list[dict]) -> list[dict | None]:
    """This process's results for every case (None where it is not in the case's group)."""
    torch.set_num_threads(1)
    groups = {ranks: dist.new_group(list(ranks)) for ranks in dict.fromkeys(tuple(c["ranks"]) for c in cases)}
    results = []
    for case in cases:
        group = groups[tuple(case["ranks"])]
        results.append(_on_rank(case, group, dist.get_rank(group)) if global_rank in case["ranks"] else None)
    return results


@pytest.fixture(scope="module")
def per_rank() -> list[list[dict | None]]:
    return run_ranks(_rank_cases, 3, CASES, timeout_s=240, env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"})


def _reference(case: dict) -> dict:
    """The single-process op on the whole sequence, loss = the sum of the ranks' losses."""
    full, (token_names, replicated) = _inputs(case), _names(case["op"])
    leaves = {n: full[n].clone().requires_grad_() for n in (*token_names, *replicated)}
    out, final = _call(case, leaves, None)
    ((out * full["out_weight"]).sum() + (final * full["final_weight"].sum(0)).sum()).backward()
    return dict(out=out.detach(), final=final.detach(), grads={n: x.grad for n, x in leaves.items()})


def _error(got: torch.Tensor, expected: torch.Tensor) -> float:
    """Relative L2 difference (absolute where ``expected`` is 0)."""
    return float((got - expected).norm() / max(float(expected.norm()), 1.0))


@pytest.mark.parametrize("index", range(len(CASES)), ids=[f"{c['op']}-{c['kernel']}-{c['sizes']}" for c in CASES])
def test_ranks_match_single_process(per_rank, index):
    """Every rank's outputs and own-token gradients, the replicated final state on every rank, the sum over ranks of
    the replicated inputs' gradients; the same collectives on every rank."""
    case = CASES[index]
    tol = TOL[case["kernel"]]
    results = [per_rank[global_rank][index] for global_rank in case["ranks"]]
    ref, (token_names, replicated) = _reference(case), _names(case["op"])
    errors = {}
    for rank, ((lo, hi), got) in enumerate(zip(_bounds(case["sizes"]), results, strict=True)):
        errors[f"out {rank}"] = _error(got["out"], ref["out"][:, lo:hi])
        errors[f"final {rank}"] = _error(got["final"], ref["final"])
        errors |= {f"d{n} {rank}": _error(got["grads"][n], ref["grads"][n][:, lo:hi]) for n in token_names}
    errors |= {f"d{n}": _error(sum(got["grads"][n] for got in results), ref["grads"][n]) for n in replicated}
    assert max(errors.values()) < tol, (case, errors)
    collectives = [[r for r in got["trace"] if r[0] not in ("send", "recv")] for got in results]
    assert collectives[0] and all(c == collectives[0] for c in collectives), (case, collectives)


@pytest.mark.skipif(bool(KIMI_LINEAR_MISSING), reason=str(KIMI_LINEAR_MISSING))
def test_kda_float64_is_the_models_rule():
    """The float64 KDA recurrence above computes what the model's chunked rule does (float32, its own bound)."""
    full = _inputs(_case("kda", "model", 8, (70,)))
    args = [full[n] for n in (*KDA_TOKENS, "initial_state")]
    out, final = KERNELS["kda", "model"](
        *args[:3], g=args[3], beta=args[4], initial_state=args[5], output_final_state=True,
        use_qk_l2norm_in_kernel=True)
    ref_out, ref_final = kda_float64(*(x.double() for x in args))
    assert _error(out.double(), ref_out) < TOL["model"] and _error(final.double(), ref_final) < TOL["model"]
