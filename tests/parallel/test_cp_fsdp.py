"""The core under FSDP2, wrapped the way veRL's ``apply_fsdp2`` wraps a model (each decoder layer and
an untied embedding, then the root):

- context parallel on 2 ranks in lockstep: the same gradients as one process; identical per-rank
  traces of collectives (the CP ops' and FSDP2's own all-gathers / reduce-scatters); never more
  than two decoder layers' parameters unsharded; no unsharded gradient kept after a backward;
- bf16 mixed precision with ``cast_forward_inputs=True`` (veRL's policy): the Gated DeltaNet
  recurrent state a layer sees stays float32.

FSDP2 internals are observed through ``verl_longstraw.testing.fsdp_probe`` (test-only instrumentation).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from verl_longstraw import Knobs, capture_prompt, group_backward, group_log_probs
from verl_longstraw.mixers import GatedDelta
from verl_longstraw.parallel import comm
from verl_longstraw.parallel.launch import run_ranks
from verl_longstraw.testing.fsdp_probe import FsdpRecorder
from verl_longstraw.tiny import VOCAB, tiny_model


def _wrap(model, mp_policy: MixedPrecisionPolicy | None = None):
    """fully_shard per decoder layer and the untied embedding, then the root (veRL 0.9.1 ``apply_fsdp2``)."""
    kwargs = {"mp_policy": mp_policy} if mp_policy is not None else {}
    backbone = model.model
    for layer in backbone.layers:
        fully_shard(layer, **kwargs)
    fully_shard(backbone.embed_tokens, **kwargs)
    fully_shard(model, **kwargs)
    return model


def _loss(i: int, lp: torch.Tensor) -> torch.Tensor:
    return (torch.linspace(-1.0, 1.0, len(lp)) * (i + 1) * lp).sum()


def _lockstep_worker(rank: int, world: int, family: str) -> dict:
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, VOCAB, (157,), generator=gen)
    responses = [torch.randint(0, VOCAB, (n,), generator=gen) for n in (6, 11, 4)]
    reference = tiny_model(family, torch.float32)
    model = _wrap(tiny_model(family, torch.float32))
    group = dist.new_group(list(range(world)))

    ref_lps = group_log_probs(reference, prompt, responses, knobs=Knobs(chunk_size=48)).log_probs
    group_backward(reference, prompt, responses, _loss, knobs=Knobs(chunk_size=48))

    with FsdpRecorder(list(model.model.layers)) as recorder, comm.trace_collectives() as cp_trace:
        state = capture_prompt(model, prompt, cp_group=group, knobs=Knobs(chunk_size=48))
        lps = group_log_probs(model, prompt, responses, state=state, cp_group=group,
                              knobs=Knobs(chunk_size=48)).log_probs
        group_backward(model, prompt, responses, _loss, state=state, cp_group=group, knobs=Knobs(chunk_size=48))
        kept_unsharded_grad = recorder.kept_unsharded_grad()
    # FSDP averages the ranks' partial gradients over the shard group: x world gives their sum
    grad_errors = []
    for (name, p), ref in zip(model.named_parameters(), reference.parameters(), strict=True):
        full = p.grad.full_tensor() * world
        grad_errors.append((name, float((full - ref.grad).norm()), float(ref.grad.norm())))
    total_err = sum(e**2 for _, e, _ in grad_errors) ** 0.5 / sum(n**2 for _, _, n in grad_errors) ** 0.5
    return {
        "lp_err": max(float((a - b).abs().max()) for a, b in zip(lps, ref_lps, strict=True)),
        "grad_err": total_err,
        "trace": recorder.trace + [tuple(r) for r in cp_trace],
        "fsdp_collectives": len(recorder.trace),
        "max_layers_unsharded": recorder.max_layers_unsharded,
        "kept_unsharded_grad": kept_unsharded_grad,
    }


def test_cp_lockstep_under_fully_shard():
    for family in ("qwen3_5", "deepseek_v3"):
        results = run_ranks(_lockstep_worker, 2, family, timeout_s=600, env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"})
        for result in results:
            assert result["lp_err"] < 1e-5, (family, result["lp_err"])
            assert result["grad_err"] < 1e-5, (family, result["grad_err"])
            assert result["fsdp_collectives"] > 0
            assert 1 <= result["max_layers_unsharded"] <= 2, (family, result["max_layers_unsharded"])
            assert not result["kept_unsharded_grad"]
        assert results[0]["trace"] == results[1]["trace"], family


def _mixed_precision_worker(rank: int, world: int) -> list[str]:
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=True)
    model = _wrap(tiny_model("qwen3_5", torch.float32), policy)
    seen: list[str] = []
    original = GatedDelta.forward

    def spy(op, x, ctx, past, need_output):
        seen.append(str(past[1].dtype))
        return original(op, x, ctx, past, need_output)

    GatedDelta.forward = spy
    try:
        prompt = torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(0))
        responses = [torch.randint(0, VOCAB, (5,), generator=torch.Generator().manual_seed(1))]
        group_backward(model, prompt, responses, _loss, knobs=Knobs(chunk_size=16))
    finally:
        GatedDelta.forward = original
    return seen


def test_float32_recurrent_state_survives_bf16_cast_forward_inputs():
    seen = run_ranks(_mixed_precision_worker, 1, timeout_s=300)[0]
    assert seen and set(seen) == {"torch.float32"}, seen
