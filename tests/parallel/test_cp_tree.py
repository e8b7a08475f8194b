"""Prefix trees under context parallelism against the same trees in one process: every family on R = 2 and 3 gloo ranks
(one spawned group per R), float64 models (float32 scoring and norms: bounds below), exact and detached, chunked and
unchunked (R = 2; R = 3 chunked only), response segments on and off; the trees hold a shared system prompt, shared
scored response tokens, rows that extend another (one scored from inside its leaf: fewer than R unscored positions
before), identical rows and a lone row shorter than R (replayed at the root); each one-process reference is computed
once, in the pytest process. Ranks given different trees raise on every rank."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist

from verl_longstraw import Knobs, tree_backward, tree_log_probs
from verl_longstraw.parallel.launch import run_ranks
from verl_longstraw.testing.compare import float64_throughout, value_error_message
from verl_longstraw.tiny import FAMILIES, VOCAB, tiny_model

CONFIGS = ((None, None, "exact"), (8, 3, "exact"), (5, None, "detached"))  # chunk_size, response_chunk_size, mode


def _configs(world: int) -> tuple[tuple, ...]:
    """The configurations run at ``world`` ranks: all at R = 2; at R = 3 the chunked ones (its uneven shards)."""
    return CONFIGS if world == 2 else CONFIGS[1:]
# Float64 models computing in float64 throughout (``testing.compare.float64_throughout``): values relative to their
# magnitude and gradients relative L2, against one process (measured at R = 2, 3, AMD EPYC Zen 4: <= 7.3e-16)
FLOAT64_TOL = 1e-10


def _tree(seed: int, scored_inside: bool = True) -> tuple[list[torch.Tensor], list[int]]:
    """Rows and their first scored token: 2 groups x 3 responses after one system prompt, each group's responses
    sharing their first 5 tokens; a per-turn row extending row 0; a copy of row 1 scored from a later token; a
    lone 3-token row; with ``scored_inside`` a row extending row 3 scored from the second token after it (left out
    of detached walks: one process captures that unscored token, so its state is a constant there, while under CP
    the leaf replays it with autograd; the paper's detached gradient depends on where the prompt ends)."""
    gen = torch.Generator().manual_seed(seed)
    system = torch.randint(0, VOCAB, (30,), generator=gen)
    rows, starts = [], []
    for _ in range(2):
        prompt = torch.cat([system, torch.randint(0, VOCAB, (7,), generator=gen)])
        shared = torch.randint(0, VOCAB, (5,), generator=gen)
        for j in range(3):
            rows.append(torch.cat([prompt, shared, torch.randint(0, VOCAB, (2 + j,), generator=gen)]))
            starts.append(len(prompt))
    rows.append(torch.cat([rows[0], torch.randint(0, VOCAB, (6,), generator=gen)]))
    starts.append(len(rows[0]) + 2)
    rows.append(rows[1].clone())
    starts.append(starts[1] + 1)
    rows.append(torch.randint(0, VOCAB, (3,), generator=gen))
    starts.append(1)
    if scored_inside:  # scored from its leaf's second position: under CP the leaf starts with fewer than R unscored
        rows.append(torch.cat([rows[3], torch.randint(0, VOCAB, (5,), generator=gen)]))  # positions
        starts.append(len(rows[3]) + 1)
    return rows, starts


def _loss(i: int, lp: torch.Tensor, ent: torch.Tensor) -> torch.Tensor:
    weights = torch.linspace(0.5, 1.5, len(lp), dtype=lp.dtype) * (i - 3.5)
    return (weights * lp).sum() + 0.01 * ent.sum()


def _run(model, rows, starts, config, group):
    """(backward result, log-prob result, flat parameter gradient summed over the group)."""
    chunk, response_chunk, mode = config
    knobs = Knobs(chunk_size=chunk, response_chunk_size=response_chunk, prompt_grad=mode)
    model.zero_grad(set_to_none=True)
    result = tree_backward(model, rows, starts, _loss, with_entropy=True, cp_group=group, knobs=knobs)
    log_probs = tree_log_probs(model, rows, starts, return_entropy=True, cp_group=group, knobs=knobs)
    grad = torch.cat([p.grad.flatten() if p.grad is not None else torch.zeros(p.numel(), dtype=p.dtype)
                      for p in model.parameters()])
    if group is not None:
        dist.all_reduce(grad, group=group)
    return result, log_probs, grad


def _max_error(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """Largest difference of ``a`` from ``b``, relative to ``b``'s largest magnitude (at least 1)."""
    scale = max(1.0, *(float(y.abs().max()) for y in b))
    return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True)) / scale


@functools.cache
def _reference(family: str, config: tuple) -> tuple:
    """``_run`` in one process, on one thread as a spawned rank runs it (more threads than a 2-core machine has
    free spin): computed once per module, shared by R = 2 and 3."""
    index = FAMILIES.index(family)
    model = tiny_model(family, torch.float64, seed=index)
    rows, starts = _tree(index, scored_inside=config[2] == "exact")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with float64_throughout():
            return _run(model, rows, starts, config, None)
    finally:
        torch.set_num_threads(threads)


def _compare_worker(rank: int, world: int) -> list[dict]:
    """Every case's CP walk: each rank's values and losses, and on rank 0 what the test compares with one process."""
    group = dist.new_group(list(range(world)))
    out = []
    for index, family in enumerate(FAMILIES):
        model = tiny_model(family, torch.float64, seed=index)
        for config in _configs(world):
            rows, starts = _tree(index, scored_inside=config[2] == "exact")
            with float64_throughout():
                result, log_probs, grad = _run(model, rows, starts, config, group)
            record = {"case": (family, *config), "log_probs": result.log_probs, "losses": result.losses}
            if rank == 0:
                record.update(tree_log_probs=log_probs.log_probs, entropies=log_probs.entropies, grad=grad)
            out.append(record)
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_cp_trees_match_one_process(world):
    results = run_ranks(_compare_worker, world, timeout_s=900)
    assert [r["case"] for r in results[0]] == [(f, *c) for f in FAMILIES for c in _configs(world)]
    for index, record in enumerate(results[0]):
        case = record["case"]
        ref, ref_log_probs, ref_grad = _reference(case[0], case[1:])
        log_prob_error = max(_max_error(record["log_probs"], ref.log_probs),
                             _max_error(record["tree_log_probs"], ref_log_probs.log_probs),
                             _max_error(record["entropies"], ref_log_probs.entropies))
        loss_error = _max_error([record["losses"]], [ref.losses])
        grad_error = float((record["grad"] - ref_grad).norm() / ref_grad.norm())
        assert log_prob_error < FLOAT64_TOL, (case, log_prob_error)
        assert loss_error < FLOAT64_TOL, (case, loss_error)
        assert grad_error < FLOAT64_TOL, (case, grad_error)
        for other in results[1:]:  # every rank ends with every row's values and losses
            assert all(torch.equal(a, b) for a, b in zip(other[index]["log_probs"], record["log_probs"],
                                                         strict=True))
            assert torch.equal(other[index]["losses"], record["losses"])


def _bad_input_worker(rank: int, world: int) -> list[str]:
    group = dist.new_group(list(range(world)))
    model = tiny_model("qwen3", torch.float32)
    rows, starts = _tree(0)
    messages = []

    def expect_error(fn):
        messages.append(value_error_message(fn))

    other = [r.clone() for r in rows]
    other[2][-1] = (other[2][-1] + rank) % VOCAB  # a different tree on each rank
    expect_error(lambda: tree_log_probs(model, other, starts, cp_group=group))
    expect_error(lambda: tree_log_probs(model, rows, [s + (rank == 1) for s in starts], cp_group=group))
    expect_error(lambda: tree_log_probs(model, rows, starts, cp_group=group, knobs=Knobs(min_shared_tokens=4 + rank)))
    # a bad knob cannot reach a collective (``Knobs`` refuses it when built); ranks passing different ones
    expect_error(lambda: tree_log_probs(model, rows, starts, cp_group=group, knobs=Knobs(response_chunk_size=4 + rank)))
    expect_error(lambda: tree_log_probs(model, rows, starts, cp_group=group, knobs=Knobs(chunk_size=world - 1)))
    return messages


def test_cp_tree_bad_input_raises_on_every_rank():
    results = run_ranks(_bad_input_worker, 3, timeout_s=300)
    expected = ["different sequences", "different score_starts", "different min_shared_tokens",
                "response_chunk_size", "chunk_size"]
    for messages in results:
        assert len(messages) == len(expected)
        for message, fragment in zip(messages, expected, strict=True):
            assert fragment in message, (fragment, message)
