"""The `longstraw/*` metrics of one `forward_backward_batch` call on this rank; seconds, tokens and bytes moved sum
over calls, sizes held take the max.

Of the walk (``walk_metrics``, read off its ``GroupStats``, counted where the walk runs): `prompt_state_bytes` (of which
`prompt_state_host_bytes` in host memory, `state_on_host`) and `state_grad_*_bytes` are this rank's (1/R of a group
under context parallelism); `cp_collective_bytes` the tensors this rank passed to the CP collectives
(`verl_longstraw.parallel.comm`), `ep_collective_bytes` the token tensors it passed to the experts' all-to-alls, forward
and backward (`experts.trace_all_to_all`; 0 without expert parallelism). `peak_memory_gb` is the device's peak allocated
memory since `forward_backward_batch` started (on the CPU platform: the process's peak resident set size over the same
span). `tokens_forwarded`: tokens this rank ran through the model (captures, replays, recomputes;
`GroupStats.tokens_forwarded`); `tree_segments`: segments of the plans walked (each walk of a unit counts its plan's);
`model_flops`: the FLOPs those calls ran, forward, backward and recompute (`verl_longstraw.flops`); `fragments`: the
units walked; `single_forward`: 1 when training replayed each response once, 0 for two passes (not logged forward only).

Of the call (``call_metrics``): `mfu`, `model_flops` over the call's seconds and the device's peak (`flops.mfu`; not
logged where no peak is known, e.g. on CPU); `star_tokens_forwarded`, what the star path (one plan per GRPO group
of each micro-batch) runs for the same walks (``star_tokens_forwarded``), the baseline `tokens_forwarded` is
compared with; `unshared_tokens_forwarded`, the call's tokens (what veRL's stock engine forwards for it); `groups`,
the call's distinct uids; `estimated_peak_gb`, the pre-flight estimate of the step's device memory.
"""

from typing import Any, Optional, Sequence

import torch
from tensordict import TensorDict
from verl.utils.device import get_device_name, get_torch_device
from verl.utils.metric import AggregationType, Metric

from verl_longstraw import GroupStats, Knobs
from verl_longstraw.estimate import GIB
from verl_longstraw.flops import mfu
from verl_longstraw.plan import star_plan

from .regroup import WalkRows, grpo_groups, prompt_lengths


def walk_metrics(stats: GroupStats, units: int, single_forward: Optional[bool],
                 collectives: list[tuple[str, int, int, str]], expert_bytes: list[int]) -> dict[str, Metric]:
    """The walk's metrics (the module docstring): ``units`` walked; ``single_forward`` None forward only;
    ``collectives`` as ``comm.trace_collectives`` records them, ``expert_bytes`` as ``experts.trace_all_to_all``.
    Reads the device's peak memory now."""
    moved = sum(numel * getattr(torch, dtype).itemsize for _, _, numel, dtype in collectives)
    metrics = {"longstraw/fragments": Metric(AggregationType.SUM, float(units))}
    if single_forward is not None:
        metrics["longstraw/single_forward"] = Metric(AggregationType.MEAN, float(single_forward))
    return {
        **metrics,
        "longstraw/prompt_state_bytes": Metric(AggregationType.MAX, float(stats.prompt_state_bytes)),
        "longstraw/prompt_state_host_bytes": Metric(AggregationType.MAX, float(stats.prompt_state_host_bytes)),
        "longstraw/state_grad_device_bytes": Metric(AggregationType.MAX, float(stats.state_grad_device_bytes)),
        "longstraw/state_grad_host_bytes": Metric(AggregationType.MAX, float(stats.state_grad_host_bytes)),
        "longstraw/cp_collective_bytes": Metric(AggregationType.SUM, float(moved)),
        "longstraw/ep_collective_bytes": Metric(AggregationType.SUM, float(sum(expert_bytes))),
        "longstraw/capture_seconds": Metric(AggregationType.SUM, stats.capture_s),
        "longstraw/replay_seconds": Metric(AggregationType.SUM, stats.replay_s),
        "longstraw/prompt_backward_seconds": Metric(AggregationType.SUM, stats.prompt_backward_s),
        "longstraw/tokens_forwarded": Metric(AggregationType.SUM, float(stats.tokens_forwarded)),
        "longstraw/tree_segments": Metric(AggregationType.SUM, float(stats.segments)),
        "longstraw/model_flops": Metric(AggregationType.SUM, stats.model_flops),
        "longstraw/peak_memory_gb": Metric(AggregationType.MAX, get_torch_device().max_memory_allocated() / 2**30),
    }


def star_tokens_forwarded(micro_batches: Sequence[TensorDict], modes: tuple[str, ...], knobs: Knobs, cp_size: int,
                          rank: int) -> int:
    """Tokens the star path runs on CP rank ``rank`` of ``cp_size`` for the walks ``modes`` (``LossStrategy.modes``):
    the sum over every GRPO group of each micro-batch (``grpo_groups``) of its star plan's (``plan.star_plan`` with
    ``knobs``; a two-pass step captures each prompt once)."""
    total = 0
    for data in micro_batches:
        prompts = prompt_lengths(data).tolist()
        lengths = data["input_ids"].offsets().diff().tolist()
        for rows in grpo_groups(data):
            plan = star_plan(int(prompts[rows[0]]), [int(lengths[r] - prompts[r]) for r in rows], knobs, cp_size, rank)
            total += sum(plan.tokens_forwarded(mode) for mode in modes) - plan.captured_tokens * (len(modes) - 1)
    return total


def call_metrics(walk: WalkRows, uids: Optional[list[Any]], model_flops: float, seconds: float, star_tokens: int,
                 estimated_bytes: int) -> dict[str, Metric]:
    """The call's metrics (the module docstring): ``model_flops`` run in ``seconds`` of walking, ``star_tokens``
    (``star_tokens_forwarded``), the pre-flight's ``estimated_bytes``."""
    metrics = {}
    utilisation = mfu(model_flops, seconds, _device_model())
    if utilisation is not None:
        metrics["longstraw/mfu"] = Metric(AggregationType.MEAN, utilisation)
    unshared = sum(int(mb["input_ids"].offsets()[-1]) for mb in walk.micro_batches)
    return {
        **metrics,
        "longstraw/star_tokens_forwarded": Metric(AggregationType.SUM, float(star_tokens)),
        "longstraw/unshared_tokens_forwarded": Metric(AggregationType.SUM, float(unshared)),
        "longstraw/groups": Metric(AggregationType.SUM, float(len(set(uids or [])))),
        "longstraw/estimated_peak_gb": Metric(AggregationType.MAX, estimated_bytes / GIB),
    }


def _device_model() -> str:
    """The accelerator's model name (e.g. "NVIDIA H200"), what ``flops.mfu`` looks up; the device type elsewhere."""
    return get_torch_device().get_device_name() if get_device_name() == "cuda" else get_device_name()
