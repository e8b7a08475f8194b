"""The estimate under expert parallelism against what 2 gloo ranks hold and send (one spawned group, tiny deepseek_v3
with 4 routed experts: a dense first layer, then MoE layers): each rank's resident routed-expert shards and their
gradients to the byte, the FSDP2 shards of the rest summed over the group to the byte, what FSDP2 unshards per unit
(the unit less its experts, in the mixed-precision dtype) to the byte, and the token all-to-alls of a chunked walk:
the largest call's pairs to the byte, dispatch plus combine summed over the group to the byte."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import transformers
from packaging.version import Version
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from verl_longstraw import Knobs, group_backward, group_log_probs
from verl_longstraw.adapters import adapter_on_meta
from verl_longstraw.estimate import estimate_memory
from verl_longstraw.feed_forward import largest_exchange
from verl_longstraw.model_terms import count_units, expert_shard_bytes, parameter_counts, unsharded_bytes
from verl_longstraw.parallel import experts as ep
from verl_longstraw.parallel.launch import run_ranks
from verl_longstraw.parallel.transformers_ep import MIN_TRANSFORMERS
from verl_longstraw.testing.compare import make_group, weighted_loss
from verl_longstraw.tiny import VOCAB, tiny_config, tiny_model

needs_plan = pytest.mark.skipif(Version(transformers.__version__) < MIN_TRANSFORMERS,
                                reason=f"transformers {transformers.__version__} has no ep_dispatch_experts plan")
FAMILY, WORLD = "deepseek_v3", 2
PROMPT_LEN, CHUNK, RESPONSE_LEN = 65, 32, 20  # 16 chunk tokens per rank; a 20-token response per rank is the largest
MIXED = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def _fsdp_units(model) -> list[torch.nn.Module]:
    """The units veRL's FSDP2 wrapping shards on their own, as ``model_terms.count_units`` counts them."""
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    return [embed, *model.get_decoder().layers, head] if head.weight is not embed.weight else [
        *model.get_decoder().layers]


def _worker(rank: int, world: int) -> dict:
    """On one rank: the bytes each token all-to-all call was given in a chunked no-grad walk of the EP model
    (``parallel.experts.trace_all_to_all``: dispatch and combine alternate), its expert shards and their gradients
    after an exact walk, then under FSDP2 (experts ignored) its dense shards and what each unit holds unsharded."""
    model = tiny_model(FAMILY)
    experts = ep.apply_expert_parallel(model, dist.group.WORLD)
    prompt, responses = make_group(VOCAB, PROMPT_LEN, [RESPONSE_LEN] * world)
    with torch.no_grad(), ep.trace_all_to_all() as sent:  # no grad: the forward's exchanges only
        group_log_probs(model, prompt, responses, cp_group=dist.group.WORLD, knobs=Knobs(chunk_size=CHUNK))
    group_backward(model, prompt, responses, weighted_loss, cp_group=dist.group.WORLD,
                   knobs=Knobs(prompt_grad="exact", chunk_size=CHUNK))
    out = {
        "sent": sent,
        "counts": count_units(model),
        "experts": sum(p.to_local().numel() * p.element_size() for p in experts),
        "expert_grads": sum(p.grad.to_local().numel() * p.grad.element_size() for p in experts),
    }
    units = _fsdp_units(model)
    for unit in units:
        fully_shard(unit, ignored_params=set(experts), mp_policy=MIXED)
    fully_shard(model, ignored_params=set(experts), mp_policy=MIXED)
    out["dense"] = sum(p.to_local().numel() * p.element_size() for p in model.parameters() if p not in experts)
    unsharded = []
    for unit in units:
        unit.unshard()
        unsharded.append(sum(p.numel() * p.element_size() for p in unit.parameters() if not isinstance(p, DTensor)))
        unit.reshard()
    out["unsharded"] = unsharded
    return out


@needs_plan
def test_expert_parallel_estimate_matches_what_the_ranks_hold_and_send():
    results = run_ranks(_worker, WORLD, timeout_s=300)
    config = tiny_config(FAMILY)
    counts = parameter_counts(config)  # on the meta device
    assert counts.expert_total > 0 and counts.experts[0] == 0  # the dense first layer holds no routed experts
    shards = expert_shard_bytes(counts, WORLD, torch.float32)
    feed_forwards = adapter_on_meta(config).feed_forwards
    estimates = [estimate_memory(config, PROMPT_LEN, WORLD, RESPONSE_LEN, CHUNK, "exact", torch.float32,
                                 cp_size=WORLD, rank=rank, device_type="cpu", expert_parallel=True)
                 for rank in range(WORLD)]
    for rank, (result, estimate) in enumerate(zip(results, estimates, strict=True)):
        assert result["counts"] == counts, rank  # the EP model, DTensors and all, counts as the meta one
        assert (result["experts"], result["expert_grads"]) == (shards.parameters, shards.gradients), rank
        exchange = largest_exchange(feed_forwards, estimate.layer_call_tokens, torch.float32)
        dispatched = result["sent"][0::2]
        assert estimate.layer_call_tokens == RESPONSE_LEN and max(dispatched) == exchange.pair_bytes, rank
        assert estimate.all_to_all_bytes == exchange.transient_bytes == 2 * exchange.pair_bytes
        assert estimate.transient_bytes >= estimate.all_to_all_bytes
        # what FSDP2 unshards: each unit less its routed experts, in the mixed-precision dtype
        dense_units = [unit - experts for unit, experts in zip(counts.units, counts.experts, strict=True)]
        assert result["unsharded"] == [2 * n for n in dense_units], rank
        pairs = [a + b for a, b in zip(result["unsharded"][:-1], result["unsharded"][1:], strict=True)]
        params, _ = unsharded_bytes(counts, WORLD, torch.bfloat16, torch.float32, False, expert_parallel=True)
        assert params == max(pairs) < unsharded_bytes(counts, WORLD, torch.bfloat16, torch.float32, False)[0]
    # the FSDP2 shards of everything but the experts, over the group
    assert sum(result["dense"] for result in results) == 4 * (counts.total - counts.expert_total)
    # the largest call's dispatch and combine over the group: the estimate's collective bytes of each rank
    calls = [result["sent"] for result in results]
    assert len({len(sent) for sent in calls}) == 1  # every rank called every MoE layer in lockstep
    largest = max(range(0, len(calls[0]), 2), key=lambda i: sum(sent[i] for sent in calls))
    moved = sum(sent[largest] + sent[largest + 1] for sent in calls)
    assert moved == WORLD * largest_exchange(feed_forwards, RESPONSE_LEN, torch.float32).collective_bytes


def test_a_dense_model_has_no_routed_experts():
    """Without an expert-parallel plan nothing is kept out of FSDP2: the pair without experts is the pair."""
    counts = parameter_counts(tiny_config("qwen3"))
    assert counts.expert_total == 0 and counts.largest_pair_without_experts == counts.largest_pair
