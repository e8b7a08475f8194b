"""The CP star plan's prompt chain: chunks tile the captured prompt, each split over the R ranks with a token for
every rank; a last chunk shorter than R merges into the one before.
The CP star plan's replay rounds: response round * R + r on rank r, a one-token dummy where none is left."""

import pytest

from verl_longstraw import Knobs
from verl_longstraw.plan import Replay, star_plan


@pytest.mark.parametrize("world", [2, 3, 4])
def test_chunks_tile_the_prompt_and_every_rank_gets_a_token_of_each(world):
    for length in range(world, 80):
        for chunk_size in [None, *range(world, 40)]:
            knobs = Knobs(chunk_size=chunk_size)
            plans = [star_plan(length + 1, [1], knobs, world=world, rank=r) for r in range(world)]
            chain = plans[0].captured
            chunks = [(plans[0].segments[k].start, plans[0].segments[k].end) for k in chain]
            assert chunks[0][0] == 0 and chunks[-1][1] == length, (length, chunk_size)
            assert all(a[1] == b[0] for a, b in zip(chunks, chunks[1:], strict=False)), (length, chunk_size, chunks)
            assert all(world <= e - s <= (chunk_size or length) + world - 1 for s, e in chunks), (length, chunk_size)
            for k in chain:
                assert min(plans[0].rank_tokens(k)) >= 1
                owns = [(p.segments[k].own_start, p.segments[k].own_end) for p in plans]  # contiguous, in rank order
                assert owns[0][0] == plans[0].segments[k].start and owns[-1][1] == plans[0].segments[k].end
                assert all(a[1] == b[0] for a, b in zip(owns, owns[1:], strict=False))
            assert sum(p.capacity for p in plans) == length


def _chunks(length: int, chunk_size: int, world: int) -> tuple[tuple[int, int], ...]:
    plan = star_plan(length + 1, [1], Knobs(chunk_size=chunk_size), world=world)
    return tuple((plan.segments[k].start, plan.segments[k].end) for k in plan.captured)


def test_short_last_chunk_merges_into_the_one_before():
    assert _chunks(33, 16, 2) == ((0, 16), (16, 33))
    assert _chunks(17, 16, 2) == ((0, 17),)
    assert _chunks(34, 16, 2) == ((0, 16), (16, 32), (32, 34))


@pytest.mark.parametrize("world", [2, 3, 4])
def test_replay_rounds_give_rank_r_response_round_times_r_plus_r(world):
    for num_responses in range(1, 2 * world + 2):
        lengths = [3 + i for i in range(num_responses)]
        rounds = -(-num_responses // world)
        for rank in range(world):
            plan = star_plan(41, lengths, Knobs(chunk_size=16), world=world, rank=rank)
            for mode in ("log_probs", "exact"):
                replays = [step for step in plan.steps(mode) if isinstance(step, Replay)]
                assert len(replays) == rounds, (num_responses, rank, mode)
                for j, step in enumerate(replays):
                    responses = [j * world + r if j * world + r < num_responses else None for r in range(world)]
                    rows = [None if i is None else plan.segments[i].row for i in step.round]
                    assert rows == responses, (num_responses, rank, j, rows)
                    assert step.segments == (step.round[rank],)
                    assert step.split.query_sizes == tuple(1 if i is None else lengths[i] for i in responses)
