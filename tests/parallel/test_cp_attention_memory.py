"""The blocked pass-Q's transients (``ops.attention.cp.sharded_blocked_transient_bytes``, the estimate's count of
what MLA and DSA layers allocate under CP) bound what the op allocates on fake CUDA tensors, by at most 10%: a no-grad
forward (a capture) and the backward, over ranks of unequal sizes, long and short key sets, half and float32 inputs."""

from __future__ import annotations

import pytest
import torch

from verl_longstraw import fake_cuda
from verl_longstraw.ops.attention.cp import sharded_blocked_transient_bytes, sharded_prefix_attention

pytestmark = pytest.mark.usefixtures("no_default_group")  # conftest: these tests make the fake group

CASES = [  # query sizes, rank, prefix rows per rank, query heads, dtype
    ([1024] * 4, 0, 2048, 64, torch.bfloat16),
    ([300, 256, 200], 1, 1000, 64, torch.bfloat16),
    ([64, 48], 0, 4096, 8, torch.bfloat16),
    ([40] * 5, 3, 100, 16, torch.bfloat16),
    ([300, 256, 200], 2, 1000, 16, torch.float32),
]


def _measured(sizes, rank, prefix_rows, heads, dtype, qk_dim=576, v_dim=512) -> tuple[int, int]:
    """(no-grad forward, backward) bytes the op allocates beyond its inputs, its output and what it saves."""
    meter = fake_cuda.DeviceBytes()
    found = []
    with fake_cuda.fake_cuda_runtime(), fake_cuda.fake_process_group(len(sizes), rank) as group, \
            fake_cuda.FakeCuda(meter):
        for grad in (False, True):
            q = torch.empty(1, heads, sizes[rank], qk_dim, device=fake_cuda.CUDA, dtype=dtype, requires_grad=grad)
            prefix = torch.empty(1, 1, prefix_rows, qk_dim, device=fake_cuda.CUDA, dtype=dtype)
            own = torch.empty(1, 1, sizes[rank], qk_dim, device=fake_cuda.CUDA, dtype=dtype, requires_grad=grad)
            before = meter.current
            meter.reset_peak()
            with torch.set_grad_enabled(grad):
                out = sharded_prefix_attention(q, prefix, prefix[..., :v_dim], own, own[..., :v_dim], 0.1, group,
                                               sizes, [prefix_rows] * len(sizes), True)
            if not grad:
                found.append(meter.peak - before - out.untyped_storage().nbytes())
                continue
            grad_out = torch.empty_like(out)
            before = meter.current
            meter.reset_peak()
            out.backward(grad_out)
            found.append(meter.peak - before)
    return found[0], found[1]


@pytest.mark.parametrize("sizes, rank, prefix_rows, heads, dtype", CASES)
def test_blocked_pass_q_transients_bound_the_op(sizes, rank, prefix_rows, heads, dtype):
    forward, backward = _measured(sizes, rank, prefix_rows, heads, dtype)
    counted = sharded_blocked_transient_bytes("cuda", dtype, 1, heads, 1, 576, 512, sizes, rank, prefix_rows)
    assert forward <= counted.forward <= 1.1 * forward
    assert backward <= counted.backward <= 1.1 * backward
