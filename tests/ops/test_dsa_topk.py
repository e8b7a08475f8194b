"""Blocked DSA top-k key selection against the plain all-keys reference: the same keys, ties
included, with temporaries bounded by S x (topk + key_block) instead of S x heads x T."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from verl_longstraw.ops.dsa.topk import dsa_topk_mask, dsa_topk_mask_reference, running_top_sort_keys, top_sort_keys

HEADS, DIM = 4, 16
SCALE = DIM**-0.5  # 0.25 and the weights' HEADS**-0.5 = 0.5 are powers of two: with small integer
# inputs every score is exact in float32 whatever the summation order, so ties are exact ties


def _inputs(seg: int, prefix: int, seed: int, levels: int = 3):
    """Integer-valued q [S, H, D], weights [S, H] (x 0.5, signs mixed: relu zeros become -0.0 too), keys [P + S, D],
    with duplicated keys (equal scores at different positions)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-levels, levels + 1, (seg, HEADS, DIM), generator=g).float()
    weights = torch.randint(-2, 3, (seg, HEADS), generator=g).float() * HEADS**-0.5
    keys = torch.randint(-levels, levels + 1, (prefix + seg, DIM), generator=g).float()
    keys[1::5] = keys[0]
    return q, weights, keys


@pytest.mark.parametrize("seg, prefix", [(1, 30), (9, 0), (12, 40), (33, 7)])
@pytest.mark.parametrize("topk", [1, 6, 25])
@pytest.mark.parametrize("key_block", [1, 5, 4096])
def test_blocked_selection_equals_reference(seg, prefix, topk, key_block):
    q, weights, keys = _inputs(seg, prefix, seed=seg * 1000 + prefix + topk)
    expected = dsa_topk_mask_reference(q, weights, keys, SCALE, topk)
    got = dsa_topk_mask(q, weights, keys, SCALE, topk, key_block=key_block)
    assert torch.equal(got, expected)
    visible = torch.ones(seg, prefix + seg, dtype=torch.bool).tril(prefix)
    assert torch.equal(expected.sum(-1), visible.sum(-1).clamp(max=topk))  # topk per query, causal


def test_ties_go_to_the_earlier_key():
    """Inputs in {-1, 0, 1}: most scores tie, many at 0 (from relu zeros times weights of either sign, so
    0.0 and -0.0). With top-k ending inside the largest group of tied keys, each query gets its better
    keys and the earliest of the tied ones."""
    seg, prefix = 6, 50
    q, weights, keys = _inputs(seg, prefix, seed=3, levels=1)
    scores = torch.einsum("sh,sht->st", weights, torch.relu(torch.einsum("shd,td->sht", q, keys) * SCALE))
    for s in range(seg):
        row = scores[s, : prefix + s + 1].tolist()
        tied, count = Counter(row).most_common(1)[0]
        assert count >= 2
        topk = sum(v > tied for v in row) + 1
        got = dsa_topk_mask(q[s : s + 1], weights[s : s + 1], keys[: len(row)], SCALE, topk, key_block=7)
        ranked = sorted(range(len(row)), key=lambda t: (-row[t], t))
        assert got[0].nonzero()[:, 0].tolist() == sorted(ranked[:topk])


class _LargestTensor(TorchDispatchMode):
    """Records the most elements of any non-bool tensor an op returns."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dtype != torch.bool:
                self.largest = max(self.largest, t.numel())
        return out


def test_blocked_selection_temporaries_are_bounded():
    """No temporary beyond S x (topk + key_block) elements, where the reference makes S x heads x T."""
    seg, prefix, topk, key_block = 16, 2000, 32, 64
    q, weights, keys = _inputs(seg, prefix, seed=0)
    with _LargestTensor() as blocked:  # inside the one op top_sort_keys dispatches
        last_visible = torch.arange(prefix, prefix + seg)
        running_top_sort_keys(q, weights, keys, SCALE, topk, None, last_visible, key_block)
    with _LargestTensor() as reference:
        dsa_topk_mask_reference(q, weights, keys, SCALE, topk)
    assert blocked.largest == seg * (topk + key_block)
    assert reference.largest == seg * HEADS * (prefix + seg)


def test_top_sort_keys_is_one_op_with_a_fake_shape_and_flops():
    """On fake CUDA tensors (a dry run) ``top_sort_keys`` dispatches once, returns [S, min(topk, T)] int64 and counts
    the scoring's matmuls; on real tensors it is the loop's result."""
    from verl_longstraw import fake_cuda

    seg, prefix, topk = 16, 200, 32
    q, weights, keys = _inputs(seg, prefix, seed=1)
    last_visible = torch.arange(prefix, prefix + seg)
    expected = running_top_sort_keys(q, weights, keys, SCALE, topk, None, last_visible, 64)
    assert torch.equal(top_sort_keys(q, weights, keys, SCALE, topk, None, last_visible, 64), expected)
    mode = fake_cuda.FakeCuda(fake_cuda.DeviceBytes())
    with fake_cuda.fake_cuda_runtime(), mode:
        to = dict(device=fake_cuda.CUDA)
        best = top_sort_keys(q.to(**to), weights.to(**to), keys.to(**to), SCALE, topk, None, last_visible.to(**to),
                             64)
        assert best.shape == (seg, topk) and best.dtype == torch.int64
        assert mode.flops == 2 * seg * HEADS * q.shape[-1] * (prefix + seg)
