"""Memory is counted by storage: a view keeps its whole storage alive, so PromptState.nbytes() and
SavedTensorMeter count whole storages, once each, and the prompt state keeps no more than its own
tensors (a Gated DeltaNet conv state sliced from the chunk's conv input would keep that whole input
alive at every kept chunk boundary)."""

from __future__ import annotations

import pytest
import torch

from verl_longstraw import Knobs, capture_prompt
from verl_longstraw.memory import SavedTensorMeter
from verl_longstraw.state import Fixed
from verl_longstraw.tiny import VOCAB, tiny_model

PROMPT_LEN, CHUNK = 200, 48


def _fixed_tensors(state) -> list[torch.Tensor]:
    """The fixed-size tensors the state holds: every ``Fixed`` kind's end value of each chunk (the last chunk's
    is the current one, the others are kept at chunk boundaries)."""
    store = state.store
    return [t for kinds, storages in zip(store.kinds, store.storage, strict=True)
            for kind, storage in zip(kinds, storages, strict=True) if isinstance(kind, Fixed)
            for t in kind.tensors(storage)]


def _fixed_kinds(state) -> int:
    """Fixed-size tensors per chunk end, over all layers."""
    return sum(isinstance(kind, Fixed) for kinds in state.store.kinds for kind in kinds)


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5"])
def test_prompt_state_holds_only_its_own_bytes(family):
    """Every kept conv and recurrent state owns a storage of exactly its size, so the state's bytes are
    the sum of its tensors' bytes, boundaries included (5 chunks: 5 copies of each fixed tensor)."""
    model = tiny_model(family)
    prompt = torch.randint(0, VOCAB, (PROMPT_LEN,), generator=torch.Generator().manual_seed(0))
    state = capture_prompt(model, prompt, for_backward=True, knobs=Knobs(chunk_size=CHUNK))
    fixed = _fixed_tensors(state)
    assert len(fixed) == 5 * _fixed_kinds(state) > 0
    for t in fixed:
        assert t.untyped_storage().nbytes() == t.numel() * t.element_size(), tuple(t.shape)
    growing = [t for t in state.tensors() if all(t is not f for f in fixed)]
    assert state.nbytes() == sum(t.numel() * t.element_size() for t in growing + fixed)


def test_prompt_state_counts_the_storage_behind_a_view():
    """A fixed tensor that is a view into a larger tensor is counted with the whole storage it keeps alive;
    two tensors on one storage are counted once."""
    model = tiny_model("qwen3_next")
    state = capture_prompt(model, torch.randint(0, VOCAB, (PROMPT_LEN,)), for_backward=False)
    before = state.nbytes()
    storage = state.store.storage  # linear-attention layers 0 and 2: tensor 0 is the conv state, by chunk
    (chunk, conv), = storage[0][0].items()  # [1, conv_dim, kernel - 1] after the one chunk
    base = torch.zeros(*conv.shape[:-1], 1000, dtype=conv.dtype)
    storage[0][0][chunk] = base[..., : conv.shape[-1]]
    storage[2][0][chunk] = base[..., -conv.shape[-1] :]
    leaked = 2 * conv.numel() * conv.element_size()
    assert state.nbytes() == before - leaked + base.numel() * base.element_size()


def test_meter_counts_whole_storages_once():
    """Two small views of one activation saved for backward count as that activation's storage, once."""
    x = torch.randn(1000, requires_grad=True)
    activation = x * 2
    with SavedTensorMeter(exclude=[x]) as meter:
        y = activation[:10] * activation[-10:]
    assert meter.peak == activation.numel() * activation.element_size()
    del y
    assert meter.current == 0
