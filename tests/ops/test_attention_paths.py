"""``ops.attention.prefix``'s dispatch by shape (``attention_path``) and what each path reports it saves
(``attention_saved_bytes``, which the memory estimate reads): the path a call takes is the one ``attention_path``
names, and the bytes ``SavedTensorMeter`` measures are the reported ones plus the output and its logsumexp
(exactly on the paths that save their inputs; within the stated bounds where a dense op's intermediates are
approximated)."""

from __future__ import annotations

import pytest
import torch

from verl_longstraw.memory import SavedTensorMeter
from verl_longstraw.ops.attention import prefix as attention_ops
from verl_longstraw.ops.attention.prefix import AttentionCall, attention_path, attention_saved_bytes

# name: (B, Hq, Hk, D, Dv, T, P, shared prefix, module patches, expected path, exact)
CASES = {
    "no_prefix": (2, 4, 2, 16, 16, 16, 0, False, {}, "sdpa_is_causal", True),
    "fused": (1, 4, 2, 16, 16, 16, 64, False, {}, "fused", True),
    "fused_shared_prefix": (3, 4, 2, 16, 16, 16, 64, True, {}, "fused", True),
    "latent_mask": (1, 4, 1, 24, 16, 16, 64, False, {}, "sdpa_mask", False),
    "latent_blocked": (1, 4, 1, 24, 16, 16, 64, False, {"MASK_BYTES_LIMIT": 1024}, "blocked", True),
    "latent_shared_prefix": (3, 4, 1, 24, 16, 16, 64, True, {}, "shared_prefix_partial", False),
    "latent_shared_prefix_blocked": (3, 4, 1, 24, 16, 16, 64, True, {"SCORES_BYTES_LIMIT": 1024},
                                     "shared_prefix_partial", True),
    "unfused_mask": (1, 4, 2, 16, 16, 16, 64, False, {"fused_dtype": None}, "sdpa_mask", True),
    "unfused_folded_mask": (1, 4, 1, 16, 16, 16, 64, False, {"fused_dtype": None}, "sdpa_mask", True),
}
APPROXIMATE = (0.75, 1.35)  # measured / (reported + output + logsumexp) where intermediates are approximated


def inputs(batch: int, q_heads: int, kv_heads: int, dim: int, v_dim: int, tokens: int, prefix: int, shared: bool):
    """(q, k_prefix, v_prefix, k_self, v_self, prefix buffer bytes, own key/value bytes): the prefix keys/values
    views of a longer state buffer (values of a latent buffer when v_dim != dim, as MLA lays them out)."""
    gen = torch.Generator().manual_seed(0)

    def randn(*shape: int, grad: bool = False) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).requires_grad_(grad)

    prefix_batch = 1 if shared else batch
    keys = randn(prefix_batch, kv_heads, prefix + 7, dim)
    own_keys = randn(batch, kv_heads, tokens, dim, grad=True)
    if v_dim == dim:
        values, own_values = randn(prefix_batch, kv_heads, prefix + 7, v_dim), randn(batch, kv_heads, tokens, v_dim,
                                                                                     grad=True)
        buffer, own = keys.nbytes + values.nbytes, own_keys.nbytes + own_values.nbytes
        v_prefix, v_self = values[..., :prefix, :], own_values
    else:
        buffer, own = keys.nbytes, own_keys.nbytes
        v_prefix, v_self = keys[..., :prefix, :v_dim], own_keys[..., :v_dim]
    q = randn(batch, q_heads, tokens, dim, grad=True)
    return q, keys[..., :prefix, :], v_prefix, own_keys, v_self, buffer, own


@pytest.mark.parametrize("name", CASES)
def test_path_and_saved_bytes_as_reported(name, monkeypatch):
    *shape, shared, patches, expected, exact = CASES[name]
    for attribute, value in patches.items():
        monkeypatch.setattr(attention_ops, attribute, (lambda *_: None) if attribute == "fused_dtype" else value)
    q, k_prefix, v_prefix, k_self, v_self, buffer, own = inputs(*shape, shared)
    call = AttentionCall.of(q, k_prefix, v_prefix, k_self, v_self, None)
    assert attention_path(call) == expected
    before = attention_ops.ATTENTION_PATHS.copy()
    with SavedTensorMeter(exclude=[q]) as meter:
        out = attention_ops.prefix_causal_attention(q, k_prefix, v_prefix, k_self, v_self, 0.3, cache={})
    took = attention_ops.ATTENTION_PATHS - before
    assert list(took) == [{"fused": "fused_flash_cpu"}.get(expected, expected)] and sum(took.values()) == 1
    reported = attention_saved_bytes(call, buffer, own)
    logsumexp = 0 if expected == "shared_prefix_partial" else q.shape[:-1].numel() * 4  # float32 [B, Hq, T]
    besides = (0 if expected == "shared_prefix_partial" else out.nbytes) + logsumexp
    if exact:
        assert meter.peak == reported.own + reported.shared + besides
    else:
        low, high = APPROXIMATE
        assert low <= meter.peak / (reported.own + reported.shared + besides) <= high
    assert (reported.shared > 0) == (expected == "sdpa_mask" and call.v_dim == call.qk_dim)
