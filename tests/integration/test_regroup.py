"""Grouping a veRL micro-batch's rows into GRPO groups (integration/regroup.py: ``grpo_groups``)."""

import pytest

from verl_longstraw.integration import regroup as rg
from verl_longstraw.testing.verl_harness import make_batch


def _reference(td) -> dict[tuple, list[int]]:
    """Rows with response tokens grouped by (uid, prompt tokens) on the host, first-seen order."""
    offsets = td["input_ids"].offsets().tolist()
    values = td["input_ids"].values()
    groups: dict[tuple, list[int]] = {}
    for row, (uid, p) in enumerate(zip(rg.sample_uids(td), rg.prompt_lengths(td).tolist(), strict=True)):
        if offsets[row + 1] - offsets[row] > p:
            groups.setdefault((uid, tuple(values[offsets[row] : offsets[row] + p].tolist())), []).append(row)
    return groups


def _described(groups: list[list[int]], td) -> dict[tuple, list[int]]:
    uids, lengths = rg.sample_uids(td), rg.prompt_lengths(td).tolist()
    offsets, values = td["input_ids"].offsets().tolist(), td["input_ids"].values()
    return {(uids[rows[0]], tuple(values[offsets[rows[0]] : offsets[rows[0]] + lengths[rows[0]]].tolist())): rows
            for rows in groups}


def test_groups_are_the_rows_grouped_by_uid_and_prompt():
    td = make_batch(n_groups=4, group_size=3, seed=11, empty_responses=4)
    groups = rg.grpo_groups(td)
    assert _described(groups, td) == _reference(td)
    assert sum(len(rows) for rows in groups) == len(td) - 4  # rows without response tokens: no group


def test_equal_prompts_have_equal_checksums_and_distinct_prompts_differ():
    td = make_batch(n_groups=6, group_size=2, seed=12, prompt_len=(5, 6))
    checksums = rg.prompt_checksums(td, rg.prompt_lengths(td)).tolist()
    by_prompt = {prompt: {checksums[row] for row in rows} for (_, prompt), rows in _reference(td).items()}
    assert all(len(sums) == 1 for sums in by_prompt.values())
    assert len(set.union(*by_prompt.values())) == len(by_prompt) == 6


def test_checksum_collisions_are_split_by_comparing_tokens(monkeypatch):
    """Rows whose uid, prompt length and checksum coincide but whose prompts differ stay apart."""
    td = make_batch(n_groups=3, group_size=2, seed=13, prompt_len=(5, 6))
    expected = sorted(_reference(td).values())
    monkeypatch.setattr(rg, "prompt_checksums", lambda data, lengths: lengths * 0)
    monkeypatch.setattr(rg, "sample_uids", lambda data: ["same"] * len(data))
    assert sorted(rg.grpo_groups(td)) == expected


def test_a_row_without_prompt_tokens_is_refused(monkeypatch):
    td = make_batch(n_groups=1, group_size=2, seed=14)
    lengths = rg.prompt_lengths(td)
    lengths[1] = 0
    monkeypatch.setattr(rg, "prompt_lengths", lambda data: lengths)
    with pytest.raises(ValueError, match="sample 1 has no prompt tokens"):
        rg.grpo_groups(td)
