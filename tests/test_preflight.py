"""``preflight.choose_units``: the first candidate whose largest unit fits is walked, a later one made only when
needed; no budget walks the first; none fitting raises MemoryError naming the unit, the budget's source and the
knobs."""

import pytest
import torch

from verl_longstraw.estimate import estimate_memory
from verl_longstraw.preflight import Budget, choose_units, over_budget
from verl_longstraw.tiny import tiny_config

CONFIG = tiny_config("qwen3")


def estimate(prompt_len: int):
    return estimate_memory(CONFIG, prompt_len, 2, 16, None, "exact", torch.float32, device_type="cpu")


def against(budget: Budget):
    """``over_budget`` of a unit (a prompt length) against ``budget`` beside 100 bytes of parameters."""
    return lambda unit, estimate: over_budget(estimate, 100, budget, lambda: f"{unit} tokens", "the model",
                                              "knobs here")


def test_choose_units_falls_back_to_the_first_that_fits():
    made = []

    def candidate(lengths):
        def make():
            made.append(lengths)
            return lengths
        return make

    long, short = estimate(4096).total_bytes, estimate(512).total_bytes
    budget = Budget(short + 100 + (long - short) // 2, "a test budget")
    units, total = choose_units([candidate([4096, 512]), candidate([512, 512])], estimate, 100, against(budget))
    assert units == [512, 512] and total == 100 + short and made == [[4096, 512], [512, 512]]
    units, total = choose_units([candidate([4096])], estimate, 100, None)
    assert units == [4096] and total == 100 + long  # no budget: no check


def test_no_candidate_fitting_names_the_unit_budget_and_knobs():
    with pytest.raises(MemoryError) as error:
        choose_units([lambda: [4096]], estimate, 100, against(Budget(1000, "a test budget")))
    message = str(error.value)
    for part in ("before any capture: 4096 tokens does not fit", "a test budget", "gradients of the model",
                 "chunk_size=", "knobs here"):
        assert part in message, (part, message)
