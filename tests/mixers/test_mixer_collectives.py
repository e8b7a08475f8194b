"""Each mixer op's collective bytes under context parallelism (``MixerOp.collective_bytes``) equal the collectives
its forward and backward issue (``comm.trace_collectives``), on 2 gloo ranks, for a prompt chunk split over them
(state flows from rank 0 to rank 1) and for replayed responses (one per rank, each its own sequence)."""

from __future__ import annotations

from collections import Counter

import torch
import torch.distributed as dist

from verl_longstraw.adapters import adapter_for
from verl_longstraw.mixers import LayerCall, NoMixer
from verl_longstraw.parallel import comm
from verl_longstraw.parallel.launch import run_ranks
from verl_longstraw.plan import Split
from verl_longstraw.tiny import first_layer_of_each_op, tiny_model

# (family, index of a layer whose op is of the kind): the first layer of every op with a CP form
CASES = first_layer_of_each_op(lambda op: op.context_parallel and not isinstance(op, NoMixer))
SIZES = (7, 5)  # each rank's tokens


def _bytes(records) -> dict[str, int]:
    out: Counter = Counter()
    for op, _, numel, dtype in records:
        out[op] += numel * getattr(torch, dtype).itemsize
    return dict(out)


def _measure(rank: int, world: int, cases: dict) -> dict:
    torch.set_num_threads(1)
    group = dist.new_group(list(range(world)))
    results = {}
    for case, (family, idx) in cases.items():
        torch.manual_seed(0)
        adapter = adapter_for(tiny_model(family))
        op = adapter.ops[idx]
        hidden = adapter.config.hidden_size
        for consecutive in (True, False):
            inputs = torch.randn(1, sum(SIZES), hidden)
            start = sum(SIZES[:rank]) if consecutive else 0
            x = inputs[:, start : start + SIZES[rank]].clone().requires_grad_()
            split = Split(SIZES, (0,) * world, consecutive, ())
            ctx = adapter.context(x, start, split, group)
            past = tuple(kind.empty(x).requires_grad_(kind.differentiable) for kind in op.kinds)
            with comm.trace_collectives() as forward:
                out, state = op.forward(x, ctx, past, True)
            loss = out.float().square().sum() + sum(t.float().sum() for t in state if t.requires_grad)
            with comm.trace_collectives() as backward:  # the state's gradient flows on every rank, as in a walk
                loss.backward()
            call = LayerCall(1, SIZES[rank], 0, 0, True, SIZES, rank, world, consecutive, x.dtype, "cpu", 0)
            counted_forward, counted_both = op.collective_bytes(call, False), op.collective_bytes(call, True)
            measured_both = Counter(_bytes(forward)) + Counter(_bytes(backward))
            results[case, consecutive] = (_bytes(forward), counted_forward, dict(measured_both), counted_both)
    return results


def test_collective_bytes_match_the_traced_collectives():
    for rank_results in run_ranks(_measure, 2, CASES, timeout_s=600):
        for (case, consecutive), (forward, counted_forward, both, counted_both) in rank_results.items():
            assert forward == counted_forward, (case, consecutive, forward, counted_forward)
            assert both == counted_both, (case, consecutive, both, counted_both)
