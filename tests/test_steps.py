"""The plan's typed steps (``plan.STEP_TYPES``): every step a plan yields is one of them, and the walk (``execute``,
the one interpreter of the plan) has a handler for each."""

from __future__ import annotations

import torch

import verl_longstraw.execute as execute
from verl_longstraw.knobs import Knobs
from verl_longstraw.plan import MODES, STEP_TYPES, Release, star_plan, tree_plan


def test_every_step_is_one_of_the_types_and_the_interpreter_handles_each():
    assert set(execute._HANDLERS) == set(STEP_TYPES)
    assert all(callable(getattr(execute._Walk, handler)) for handler, _ in execute._HANDLERS.values())
    rows = [torch.tensor([1, 2, 3, 4, 5, 6]), torch.tensor([1, 2, 3, 4, 7, 8]), torch.tensor([1, 2, 9])]
    plans = [star_plan(41, [3, 5, 4], Knobs(chunk_size=16, replay_tokens=8)),
             star_plan(41, [3, 5, 4], Knobs(chunk_size=16), world=2, rank=1),
             tree_plan(rows, [4, 4, 2], Knobs(min_shared_tokens=2))]
    seen = set()
    for plan in plans:
        for mode in MODES:
            for step in plan.steps(mode):
                assert type(step) in STEP_TYPES, step
                assert (step.call is None) == isinstance(step, Release), step  # every other step calls the model
                seen.add(type(step))
    assert seen == set(STEP_TYPES)
