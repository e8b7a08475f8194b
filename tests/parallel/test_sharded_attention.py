"""Pass-Q sharded prefix attention on 2 and 3 gloo ranks against the single-process op on the concatenation.

Every rank builds the same global inputs, runs the single-process reference on the concatenation
itself and the sharded op on its own slices, and reports the largest differences (float64) and its
collective trace. All cases of one world size share one set of spawned ranks.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from verl_longstraw.memory import AllocationMeter
from verl_longstraw.ops.attention import fused as fused_ops
from verl_longstraw.ops.attention.cp import (
    sharded_attention_path,
    sharded_fused_backward_transient_bytes,
    sharded_prefix_attention,
)
from verl_longstraw.ops.attention.prefix import (
    ATTENTION_PATHS,
    prefix_causal_attention,
    prefix_causal_attention_reference,
)
from verl_longstraw.parallel.comm import trace_collectives
from verl_longstraw.parallel.launch import run_ranks

BATCH = 2
# name -> (Hq, Hk, D, Dv, values are a slice of the keys (MLA latent))
HEADS = {"gqa": (4, 2, 8, 8, False), "mla": (4, 1, 12, 8, True)}
# world -> (query_sizes, prefix_sizes): uneven, one rank without prefix rows
SIZES = {2: ((3, 5), (0, 7)), 3: ((4, 2, 5), (6, 0, 9))}
CASES = list(itertools.product(["causal_across_ranks", "own_sequences"], HEADS, [False, True], [None, 3]))
# per path, forward: queries, logsumexps, weighted outputs; backward: (blocked) d(outputs), d(logsumexps), d(queries),
# (fused) d(outputs) with the outputs, d(queries)
COLLECTIVES = {
    "sharded_blocked": ["all_gather", "all_gather", "reduce_scatter", "all_gather", "reduce_scatter", "reduce_scatter"],
    "sharded_fused_flash_cpu": ["all_gather", "all_gather", "reduce_scatter", "all_gather", "reduce_scatter"],
}


def expected_path(heads: str, masked: bool, block_size: int | None) -> str:
    """The fused kernels take what has value dim == key dim, no key mask and no forced block size."""
    fused = not HEADS[heads][4] and HEADS[heads][2] == HEADS[heads][3] and not masked and block_size is None
    return "sharded_fused_flash_cpu" if fused else "sharded_blocked"


def offsets(sizes: tuple[int, ...]) -> list[int]:
    return [sum(sizes[:r]) for r in range(len(sizes) + 1)]


def global_inputs(heads: str, query_sizes: tuple[int, ...], prefix_sizes: tuple[int, ...], masked: bool, seed: int):
    """Leaves of the concatenation (queries and own keys in rank order, prefix rows in rank order), the
    upstream gradient, and each rank's key mask [N, P_r + T_r] (None unmasked)."""
    q_heads, kv_heads, dim, v_dim, latent = HEADS[heads]
    gen = torch.Generator().manual_seed(seed)
    n, p = sum(query_sizes), sum(prefix_sizes)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen, dtype=torch.float64)

    leaves = {
        "q": randn(BATCH, q_heads, n, dim),
        "k_self": randn(BATCH, kv_heads, n, dim),
        "k_prefix": randn(BATCH, kv_heads, p, dim),
    }
    if not latent:
        leaves |= {"v_self": randn(BATCH, kv_heads, n, v_dim), "v_prefix": randn(BATCH, kv_heads, p, v_dim)}
    upstream = randn(BATCH, q_heads, n, v_dim)
    masks = None
    if masked:
        q_at = offsets(query_sizes)
        masks = [torch.rand(n, prefix_sizes[r] + query_sizes[r], generator=gen) < 0.5 for r in range(len(query_sizes))]
        for r, mask in enumerate(masks):  # every query keeps its own position, so it sees some key overall
            rows = torch.arange(query_sizes[r])
            mask[q_at[r] + rows, prefix_sizes[r] + rows] = True
    return leaves, upstream, masks


def attention_args(leaves: dict[str, torch.Tensor], heads: str) -> tuple[torch.Tensor, ...]:
    """(q, k_prefix, v_prefix, k_self, v_self); for MLA the values are the first Dv latent channels."""
    v_dim = HEADS[heads][3]
    if HEADS[heads][4]:
        latent_prefix, latent_self = leaves["k_prefix"], leaves["k_self"]
        return leaves["q"], latent_prefix, latent_prefix[..., :v_dim], latent_self, latent_self[..., :v_dim]
    return leaves["q"], leaves["k_prefix"], leaves["v_prefix"], leaves["k_self"], leaves["v_self"]


def reference(mode: str, heads: str, leaves, upstream, masks, query_sizes, prefix_sizes, scale: float):
    """Single-process output [B, Hq, N, Dv] and leaf gradients of sum(output * upstream)."""
    leaves = {name: x.clone().requires_grad_() for name, x in leaves.items()}
    q, k_prefix, v_prefix, k_self, v_self = attention_args(leaves, heads)
    q_at = offsets(query_sizes)

    def mask_of(rows: slice, own_ranks: list[int]) -> torch.Tensor | None:
        """Global [rows, P + own keys] mask: every rank's prefix columns, then the own-key columns of ``own_ranks``."""
        if masks is None:
            return None
        return torch.cat([m[rows, : prefix_sizes[r]] for r, m in enumerate(masks)]
                         + [masks[r][rows, prefix_sizes[r] :] for r in own_ranks], dim=-1)

    if mode == "causal_across_ranks":
        out = prefix_causal_attention_reference(
            q, k_prefix, v_prefix, k_self, v_self, scale, mask_of(slice(None), list(range(len(query_sizes))))
        )
    else:
        parts = []
        for r in range(len(query_sizes)):
            seg = slice(q_at[r], q_at[r + 1])
            parts.append(prefix_causal_attention_reference(
                q[..., seg, :], k_prefix, v_prefix, k_self[..., seg, :], v_self[..., seg, :], scale, mask_of(seg, [r])
            ))
        out = torch.cat(parts, dim=-2)
    (out * upstream).sum().backward()
    return out.detach(), {name: x.grad for name, x in leaves.items()}


def local_slices(leaves: dict[str, torch.Tensor], rank: int, query_sizes, prefix_sizes) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s rows of every leaf: its queries / own keys, its prefix rows."""
    q_at, p_at = offsets(query_sizes), offsets(prefix_sizes)
    rows = {"q": slice(q_at[rank], q_at[rank + 1]), "prefix": slice(p_at[rank], p_at[rank + 1])}
    return {name: x[..., rows["prefix" if "prefix" in name else "q"], :] for name, x in leaves.items()}


def max_difference(x: torch.Tensor, expected: torch.Tensor) -> float:
    assert x.shape == expected.shape, (x.shape, expected.shape)
    return (x - expected).abs().max().item() if x.numel() else 0.0


def sharded_case(rank: int, world: int, mode: str, heads: str, masked: bool, block_size: int | None, seed: int):
    """Largest absolute differences of this rank's output and local gradients vs the reference, its trace and the
    path the op took."""
    query_sizes, prefix_sizes = SIZES[world]
    scale = HEADS[heads][2] ** -0.5
    leaves, upstream, masks = global_inputs(heads, query_sizes, prefix_sizes, masked, seed)
    ref_out, ref_grads = reference(mode, heads, leaves, upstream, masks, query_sizes, prefix_sizes, scale)
    local = local_slices(leaves, rank, query_sizes, prefix_sizes)
    local = {name: x.clone().requires_grad_() for name, x in local.items()}
    mine = slice(offsets(query_sizes)[rank], offsets(query_sizes)[rank + 1])
    ATTENTION_PATHS.clear()
    with trace_collectives() as trace:
        out = sharded_prefix_attention(
            *attention_args(local, heads), scale, torch.distributed.group.WORLD, query_sizes, prefix_sizes,
            mode == "causal_across_ranks", key_mask=None if masks is None else masks[rank], block_size=block_size,
        )
        (out * upstream[..., mine, :]).sum().backward()
    errors = {"out": max_difference(out.detach(), ref_out[..., mine, :])}
    ref_local = local_slices(ref_grads, rank, query_sizes, prefix_sizes)
    for name, x in local.items():
        assert x.grad is not None and x.grad.isfinite().all(), name
        errors[name] = max_difference(x.grad, ref_local[name])
    (path,) = ATTENTION_PATHS
    return errors, trace, path


def bfloat16_errors(rank: int, world: int) -> dict[int | None, tuple[float, float]]:
    """Per partial path (block size None: fused, 3: blocked): largest error of this rank's bf16 sharded output and
    of the single-process op run in bf16 on the concatenation, both against the float64 single-process output."""
    query_sizes, prefix_sizes = SIZES[world]
    leaves, _, _ = global_inputs("gqa", query_sizes, prefix_sizes, False, seed=99)
    mine = slice(offsets(query_sizes)[rank], offsets(query_sizes)[rank + 1])
    exact = prefix_causal_attention_reference(*attention_args(leaves, "gqa"), 0.3)[..., mine, :]
    standard = prefix_causal_attention(*(x.bfloat16() for x in attention_args(leaves, "gqa")), 0.3)[..., mine, :]
    bf16_leaves = {name: x.bfloat16() for name, x in leaves.items()}
    local = attention_args(local_slices(bf16_leaves, rank, query_sizes, prefix_sizes), "gqa")
    errors = {}
    for block_size in (None, 3):
        group = torch.distributed.group.WORLD
        out = sharded_prefix_attention(*local, 0.3, group, query_sizes, prefix_sizes, True, block_size=block_size)
        assert out.dtype == torch.bfloat16
        errors[block_size] = (max_difference(out.double(), exact), max_difference(standard.double(), exact))
    return errors


def bfloat16_query_grad_wire(rank: int, world: int) -> dict[int | None, tuple[str, str]]:
    """Per partial path (block size None: fused, 3: blocked), for bf16 inputs: the dtype the backward's last collective
    (the reduce-scatter of d(queries)) sends, and the dtype of the query gradient this rank gets."""
    query_sizes, prefix_sizes = SIZES[world]
    leaves, upstream, _ = global_inputs("gqa", query_sizes, prefix_sizes, False, seed=98)
    mine = slice(offsets(query_sizes)[rank], offsets(query_sizes)[rank + 1])
    local = {n: x.bfloat16().requires_grad_() for n, x in local_slices(leaves, rank, query_sizes, prefix_sizes).items()}
    wire = {}
    for block_size in (None, 3):
        out = sharded_prefix_attention(*attention_args(local, "gqa"), 0.3, torch.distributed.group.WORLD, query_sizes,
                                       prefix_sizes, True, block_size=block_size)
        with trace_collectives() as trace:
            (out.float() * upstream[..., mine, :]).sum().backward()
        op, _, _, dtype = trace[-1]
        assert op == "reduce_scatter", trace
        wire[block_size] = (dtype, str(local["q"].grad.dtype))
    return wire


def fused_backward_transient(rank: int, world: int) -> tuple[int, int]:
    """(measured, counted): peak bytes the fused pass-Q backward allocates on this rank (``AllocationMeter``) besides
    the local gradients it returns, bf16 inputs over 512 prefix rows per rank in 64-key blocks, and what
    ``sharded_fused_backward_transient_bytes`` counts for it."""
    query_sizes, prefix_sizes = (8,) * world, (512,) * world
    q_heads, kv_heads, dim, _, _ = HEADS["gqa"]
    leaves, upstream, _ = global_inputs("gqa", query_sizes, prefix_sizes, False, seed=97)
    mine = slice(offsets(query_sizes)[rank], offsets(query_sizes)[rank + 1])
    local = {n: x.bfloat16().requires_grad_() for n, x in local_slices(leaves, rank, query_sizes, prefix_sizes).items()}
    out = sharded_prefix_attention(*attention_args(local, "gqa"), 0.3, torch.distributed.group.WORLD, query_sizes,
                                   prefix_sizes, True)
    weight = upstream[..., mine, :].bfloat16()
    default = fused_ops.BACKWARD_BLOCK_BYTES
    fused_ops.BACKWARD_BLOCK_BYTES = 64 * BATCH * fused_ops._key_row_bytes("cpu", torch.bfloat16, q_heads, kv_heads,
                                                                         dim)
    try:
        with AllocationMeter() as meter:
            grads = torch.autograd.grad(out, list(local.values()), weight)
        counted = sharded_fused_backward_transient_bytes("cpu", torch.bfloat16, BATCH, q_heads, kv_heads, dim,
                                                         query_sizes, rank, prefix_sizes[rank], True)
    finally:
        fused_ops.BACKWARD_BLOCK_BYTES = default
    return meter.peak - sum(g.untyped_storage().nbytes() for g in grads), counted


def all_cases(rank: int, world: int) -> dict:
    """Every case on this rank, the bf16 errors, and the error raised for sizes that disagree with the tensors."""
    results = {case: sharded_case(rank, world, *case, seed=i) for i, case in enumerate(CASES)}
    results["bfloat16"] = bfloat16_errors(rank, world)
    results["bfloat16_query_grad_wire"] = bfloat16_query_grad_wire(rank, world)
    results["fused_backward_transient"] = fused_backward_transient(rank, world)
    query_sizes, prefix_sizes = SIZES[world]
    q = torch.zeros(1, 2, query_sizes[rank], 4, dtype=torch.float64)
    k = torch.zeros(1, 1, prefix_sizes[rank] + 1, 4, dtype=torch.float64)
    try:
        group = torch.distributed.group.WORLD
        sharded_prefix_attention(q, k, k, q[:, :1], q[:, :1], 0.5, group, query_sizes, prefix_sizes, True)
        results["bad_prefix_sizes"] = None
    except ValueError as exc:
        results["bad_prefix_sizes"] = str(exc)
    return results


@pytest.fixture(scope="module", params=[2, 3])
def rank_results(request) -> tuple[int, list[dict]]:
    """All cases on ``world`` spawned ranks; world 2 under TORCH_DISTRIBUTED_DEBUG=DETAIL (gloo checks every
    collective's consistency across ranks)."""
    world = request.param
    env = {"TORCH_DISTRIBUTED_DEBUG": "DETAIL"} if world == 2 else None
    return world, run_ranks(all_cases, world, timeout_s=240, env=env)


@pytest.mark.parametrize("case", CASES, ids=["-".join(map(str, c)) for c in CASES])
def test_matches_single_process(rank_results, case) -> None:
    """Output and gradients (q, own keys/values, local prefix rows) of every rank equal the single-process op's."""
    world, results = rank_results
    for rank in range(world):
        errors, _, path = results[rank][case]
        assert path == expected_path(*case[1:]), (rank, path)
        assert max(errors.values()) < 1e-10, (rank, errors)


@pytest.mark.parametrize("case", CASES, ids=["-".join(map(str, c)) for c in CASES])
def test_same_collectives_on_every_rank(rank_results, case) -> None:
    world, results = rank_results
    traces = [results[rank][case][1] for rank in range(world)]
    assert all(trace == traces[0] for trace in traces)
    assert [op for op, *_ in traces[0]] == COLLECTIVES[expected_path(*case[1:])]


def test_bfloat16_within_standard_error(rank_results) -> None:
    """bf16 inputs (float32 arithmetic, bf16 output): error vs float64 at most twice the single-process bf16 op's."""
    world, results = rank_results
    for rank in range(world):
        for block_size, (sharded, standard) in results[rank]["bfloat16"].items():
            assert sharded <= 2 * standard, (rank, block_size, sharded, standard)


def test_bfloat16_query_gradients_reduce_scattered_in_float32(rank_results) -> None:
    """bf16 inputs: both paths sum the ranks' shares of d(queries) in float32 on the wire and round once after (the
    gradient each rank gets is bf16, like its queries)."""
    world, results = rank_results
    for rank in range(world):
        for block_size, wire in results[rank]["bfloat16_query_grad_wire"].items():
            assert wire == ("float32", "torch.bfloat16"), (rank, block_size, wire)


def test_fused_backward_transient_bytes_as_counted(rank_results) -> None:
    """The fused pass-Q backward's peak transient bytes on every rank (bf16 inputs, prefix in 64-key blocks) are at
    most what ``sharded_fused_backward_transient_bytes`` (the estimate's figure) counts, and at least 2/3 of it."""
    world, results = rank_results
    for rank in range(world):
        measured, counted = results[rank]["fused_backward_transient"]
        assert 2 / 3 * counted <= measured <= counted, (rank, measured, counted)


def test_sizes_disagreeing_with_tensors_raise(rank_results) -> None:
    world, results = rank_results
    for rank in range(world):
        message = results[rank]["bad_prefix_sizes"]
        assert message is not None and f"k_prefix has {SIZES[world][1][rank] + 1} rows, prefix_sizes[{rank}]" in message


def test_without_group_is_the_single_process_op() -> None:
    gen = torch.Generator().manual_seed(0)
    q, k_self, v_self = (torch.randn(1, 2, 5, 4, generator=gen) for _ in range(3))
    k_prefix, v_prefix = (torch.randn(1, 2, 7, 4, generator=gen) for _ in range(2))
    args = (q, k_prefix, v_prefix, k_self, v_self, 0.5)
    assert torch.equal(sharded_prefix_attention(*args, None, (5,), (7,), True), prefix_causal_attention(*args))


def test_pass_q_takes_the_fused_kernels_only_without_a_reason_not_to() -> None:
    """``sharded_attention_path``, the one decision the op and the layer's costs share: fused where the kernels take
    the inputs, blocked for a key mask, a forced block size, inputs the kernels refuse, or no queries."""
    assert sharded_attention_path(torch.float32, 8) == "fused"
    assert sharded_attention_path(torch.float32, 8, masked=True) == "blocked"
    assert sharded_attention_path(torch.float32, 8, block_size=4) == "blocked"
    assert sharded_attention_path(None, 8) == "blocked"
    assert sharded_attention_path(torch.float32, 0) == "blocked"
