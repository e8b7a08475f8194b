"""PromptLayout: global chunks tile the captured prompt; a last chunk shorter than R merges into the one before."""

import pytest

from verl_longstraw.parallel.layout import PromptLayout


@pytest.mark.parametrize("world", [2, 3, 4])
def test_chunks_tile_the_prompt_and_every_rank_gets_a_token_of_each(world):
    for length in range(world, 80):
        for chunk_size in [None, *range(world, 40)]:
            layout = PromptLayout(length, chunk_size, world)
            chunks = layout.chunks
            assert chunks[0][0] == 0 and chunks[-1][1] == length, (length, chunk_size)
            assert all(a[1] == b[0] for a, b in zip(chunks, chunks[1:], strict=False)), (length, chunk_size, chunks)
            assert all(world <= e - s <= (chunk_size or length) + world - 1 for s, e in chunks), (length, chunk_size)
            for k in range(len(chunks)):
                assert min(layout.slice_sizes(k)) >= 1
            assert sum(layout.local_length(r) for r in range(world)) == length


def test_short_last_chunk_merges_into_the_one_before():
    assert PromptLayout(33, 16, 2).chunks == ((0, 16), (16, 33))
    assert PromptLayout(17, 16, 2).chunks == ((0, 17),)
    assert PromptLayout(34, 16, 2).chunks == ((0, 16), (16, 32), (32, 34))
