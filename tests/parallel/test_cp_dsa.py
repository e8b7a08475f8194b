"""DSA sparse top-k selection over a context-parallel prefix against one process, on R = 2 and 3 gloo ranks
(one spawned run per R): the op (``ops.dsa.cp``) selects the keys ``ops.dsa.topk.dsa_topk_mask`` selects,
on tie-free and on tied inputs, for capture chunks and replayed responses, with the same collectives on every
rank and a threshold search whose traffic does not grow with R or top-k; ``kth_largest`` against ``topk`` on
values of both signs and the int64 extremes; and the glm_moe_dsa core with ``index_topk`` below the prompt
length (a shared-indexer layer included), chunked and unchunked, gives the single-process log-probs and exact
gradients."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from verl_longstraw import Knobs, capture_prompt, group_backward, group_log_probs
from verl_longstraw.ops.dsa.cp import kth_largest, selection_collective_bytes, sharded_dsa_topk_mask
from verl_longstraw.ops.dsa.topk import dsa_topk_mask
from verl_longstraw.parallel.comm import trace_collectives
from verl_longstraw.parallel.launch import run_ranks
from verl_longstraw.plan import Split, split_evenly, star_plan
from verl_longstraw.testing.compare import make_group, weighted_loss
from verl_longstraw.tiny import VOCAB, tiny_model

HEADS, DIM = 4, 16
SCALE = DIM**-0.5  # a power of two, as the weights' HEADS**-0.5: integer inputs give exact scores in any order
PREFIX, PREFIX_CHUNK, TOPK = 61, 13, 9  # prefix rows spread over the ranks in interleaved chunk sub-slices


def _inputs(tokens: int, seed: int, tied: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Integer-valued indexer queries [n, H, D], weights [n, H] (x 0.5) and keys [n, D]. ``tied``: values in
    {-1, 0, 1} and weights of both signs (most scores tie, many at 0); else values up to +-40, positive weights."""
    g = torch.Generator().manual_seed(seed)
    levels, weight_range = (1, (-2, 3)) if tied else (40, (1, 5))
    q = torch.randint(-levels, levels + 1, (tokens, HEADS, DIM), generator=g).float()
    weights = torch.randint(*weight_range, (tokens, HEADS), generator=g).float() * HEADS**-0.5
    keys = torch.randint(-levels, levels + 1, (tokens, DIM), generator=g).float()
    return q, weights, keys


def _has_boundary_tie(q, weights, keys) -> bool:
    """Whether some query's TOPK-th best visible key ties with the next one (``keys`` [P + S, D])."""
    scores = torch.einsum("sh,sht->st", weights, torch.relu(torch.einsum("shd,td->sht", q, keys) * SCALE))
    prefix = keys.shape[0] - q.shape[0]
    rows = [scores[s, : prefix + s + 1].sort(descending=True).values for s in range(q.shape[0])]
    return any(bool(row[TOPK - 1] == row[TOPK]) for row in rows if len(row) > TOPK)


def _op_case(rank: int, world: int, group, consecutive: bool, tied: bool, seed: int) -> dict:
    """This rank's distributed mask against the columns of the single-process masks it should equal."""
    plan = star_plan(PREFIX + 1, [1], Knobs(chunk_size=PREFIX_CHUNK), world=world, rank=rank)
    spans = tuple((plan.segments[k].own_start, plan.segments[k].own_end) for k in plan.captured)
    rows = torch.cat([torch.arange(start, end) for start, end in spans])
    query_sizes = tuple(split_evenly(23, world)) if consecutive else tuple(4 + 3 * r for r in range(world))
    split = Split(query_sizes, plan.rank_rows_after(plan.captured[-1]), consecutive, spans)
    # every rank draws every rank's tokens: one sequence (prefix ++ segment) or a response per rank
    if consecutive:
        sequences = [_inputs(PREFIX + sum(query_sizes), seed, tied)]
    else:  # the responses share the prefix keys
        sequences = [_inputs(PREFIX + size, seed + j, tied) for j, size in enumerate(query_sizes)]
        sequences = [(q, w, torch.cat([sequences[0][2][:PREFIX], k[PREFIX:]])) for q, w, k in sequences]
    references, ties = [], False
    for q, w, keys in sequences:
        references.append(dsa_topk_mask(q[PREFIX:], w[PREFIX:], keys, SCALE, TOPK))
        ties |= _has_boundary_tie(q[PREFIX:], w[PREFIX:], keys)
    before, own = sum(query_sizes[:rank]), query_sizes[rank]
    if consecutive:
        q, w, keys = sequences[0]
        mine = slice(PREFIX + before, PREFIX + before + own)
        own_columns = torch.arange(PREFIX + before, PREFIX + before + own)
        expected = references[0][:, torch.cat([rows, own_columns])]
    else:
        q, w, keys = sequences[rank]
        mine = slice(PREFIX, PREFIX + own)
        expected = torch.cat([
            torch.cat([ref[:, rows], ref[:, PREFIX:] if j == rank else ref.new_zeros(len(ref), own)], dim=1)
            for j, ref in enumerate(references)
        ])
    with trace_collectives() as trace:
        got = sharded_dsa_topk_mask(q[mine], w[mine], keys[rows], keys[mine], SCALE, TOPK, split, group,
                                    key_block=7, query_block=5)
    return {"equal": torch.equal(got, expected), "ties": ties, "trace": trace, "queries": sum(query_sizes)}


def _model_case(group, chunk: int | None, num_responses: int, seed: int) -> dict:
    """glm_moe_dsa with index_topk < prompt: (log-probs, losses, all-reduced flat gradient) under ``group``."""
    model = tiny_model("glm_moe_dsa", torch.float32, seed=seed, index_topk=16,
                       indexer_types=["full", "full", "shared"])
    prompt, responses = make_group(VOCAB, 97, [3 + (5 * i + seed) % 11 for i in range(num_responses)], seed=seed)
    state = capture_prompt(model, prompt, for_backward=True, cp_group=group, knobs=Knobs(chunk_size=chunk))
    log_probs = group_log_probs(model, prompt, responses, state=state, cp_group=group,
                                knobs=Knobs(chunk_size=chunk)).log_probs
    losses = group_backward(model, prompt, responses, weighted_loss, state=state, cp_group=group,
                            knobs=Knobs(chunk_size=chunk)).losses
    grad = torch.cat([p.grad.flatten() if p.grad is not None else torch.zeros(p.numel()) for p in model.parameters()])
    if group is not None:
        dist.all_reduce(grad, group=group)
    return {"log_probs": log_probs, "losses": losses, "grad": grad}


def _worker(rank: int, world: int) -> dict:
    group = dist.new_group(list(range(world)))
    ops = {
        (consecutive, tied): _op_case(rank, world, group, consecutive, tied, seed=world)
        for consecutive in (True, False)
        for tied in (True, False)
    }
    models = {}
    for chunk in (None, 24):
        cp = _model_case(group, chunk, world + 1, seed=world)
        reference = _model_case(None, chunk, world + 1, seed=world) if rank == 0 else None
        models[chunk] = (cp, reference)
    return {"ops": ops, "models": models}


@pytest.mark.parametrize("world", [2, 3])
def test_cp_dsa_selection_matches_single_process(world):
    results = run_ranks(_worker, world, timeout_s=600)
    for (consecutive, tied), case in results[0]["ops"].items():
        assert case["ties"] == tied, (consecutive, tied)  # ties at the top-k boundary, or none
        for other in results:
            assert other["ops"][consecutive, tied]["equal"], (consecutive, tied)
            assert other["ops"][consecutive, tied]["trace"] == case["trace"]  # lockstep
        # the threshold's traffic: int32 histograms, as many bytes per query whatever R and TOPK; the only
        # gathers are the indexer queries' and weights'
        summed = [numel for op, _, numel, dtype in case["trace"] if op == "all_reduce" and dtype == "int32"]
        assert 4 * sum(summed) == selection_collective_bytes(case["queries"]), (consecutive, tied)
        assert [op for op, *_ in case["trace"]].count("all_gather") == 2
    for chunk, (cp, reference) in results[0]["models"].items():
        lp_err = max(float((a - b).abs().max()) for a, b in zip(cp["log_probs"], reference["log_probs"], strict=True))
        grad_err = float((cp["grad"] - reference["grad"]).norm() / reference["grad"].norm())
        assert lp_err < 1e-5, (chunk, lp_err)
        assert float((cp["losses"] - reference["losses"]).abs().max()) < 1e-5, chunk
        assert grad_err < 1e-5, (chunk, grad_err)


@pytest.mark.parametrize("index_topk, projects", [(64, False), (8, True)])
def test_indexer_queries_projected_only_when_topk_selects(index_topk, projects):
    """One process, glm_moe_dsa: where top-k keeps every key (prefix + segment <= index_topk) the indexer's query
    projection never runs (nor the float32 copy of the prefix indexer keys behind it); below, it does."""
    model = tiny_model("glm_moe_dsa", index_topk=index_topk)
    indexers = [layer.self_attn.indexer for layer in model.model.layers if layer.self_attn.indexer is not None]
    calls = []
    for indexer in indexers:
        indexer.wq_b.register_forward_hook(lambda *_: calls.append(1))
    prompt, responses = make_group(VOCAB, 40, (8,))
    group_log_probs(model, prompt, responses, knobs=Knobs(chunk_size=16))
    assert bool(calls) == projects, len(calls)


def test_kth_largest_is_topks_kth_value_over_the_int64_range():
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        width = int(torch.randint(1, 40, (1,), generator=g))
        values = (torch.randperm(10**6, generator=g)[: 3 * width].reshape(3, width) - 500_000) * 2**40 \
            + torch.randint(0, 2**20, (3, width), generator=g)
        k = int(torch.randint(1, width + 1, (1,), generator=g))
        assert torch.equal(kth_largest(values, k, None), values.topk(k, dim=1).values[:, -1:])
    extremes = torch.tensor([[-(2**63), 2**63 - 1, 0, -1, 1]])
    assert [int(kth_largest(extremes, k, None)) for k in range(1, 6)] == [2**63 - 1, 1, 0, -1, -(2**63)]
