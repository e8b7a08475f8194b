"""The pre-flight estimate: prompt-state bytes exactly (those PromptState.nbytes measures, kept
boundary states included; state-gradient bytes those of the differentiable state tensors), peak
saved-for-backward bytes within 20% of SavedTensorMeter on CPU, and an early budget error from
group_backward; the same per rank of a context-parallel group (R in {1, 2, 4} gloo ranks, one
spawned run per R), where a too small budget raises the same MemoryError on every rank.

Measured estimate/meter ratios (tiny models, fp32 and bf16, P 1024-2048, chunk 128/512/None,
exact and detached): 0.85-1.19. Per rank (fp32, chunked exact, P 1024-2048, chunk 128-512, R 2 and 4;
(saved + state) / (measured saved + state)): qwen3 0.91-1.06, qwen3_5 0.97-1.04, qwen3_next 0.94-1.00,
deepseek_v3 0.94-0.95. SavedTensorMeter keeps the saved tensors of graph branches that no backward runs
(the last layer's query path in each recomputed chunk: the meter's packed tensor refers back to its node);
without that artifact these ratios are 1.00-1.07.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
import torch.distributed as dist
import transformers

import verl_longstraw.execute as execute
from verl_longstraw import GroupStats, Knobs, capture_prompt, group_backward, tree_backward
from verl_longstraw.errors import UnsupportedModelError
from verl_longstraw.estimate import estimate_memory, estimate_plan
from verl_longstraw.memory import AllocationMeter, parameter_meter
from verl_longstraw.ops.attention.cp import sharded_blocked_transient_bytes, sharded_fused_backward_transient_bytes
from verl_longstraw.ops.attention.fused import fused_backward_transient_bytes
from verl_longstraw.parallel.launch import run_ranks
from verl_longstraw.plan import star_plan, tree_plan
from verl_longstraw.preflight import check_budget
from verl_longstraw.state import PathState
from verl_longstraw.testing.compare import make_group, weighted_loss
from verl_longstraw.tiny import FAMILIES, VARIANTS, VOCAB, tiny_config, tiny_model, unavailable

RESPONSE_LEN = 32
CASES = (
    (torch.float32, 1024, 128, "exact"), (torch.bfloat16, 1024, 256, "exact"), (torch.float32, 1024, None, "detached")
)


@pytest.mark.parametrize("family", FAMILIES + VARIANTS)
def test_estimate_matches_meter(family, record_property):
    for dtype, prompt_len, chunk_size, mode in CASES:
        model = tiny_model(family, dtype=dtype)
        prompt, responses = make_group(VOCAB, prompt_len, (RESPONSE_LEN, RESPONSE_LEN))
        stats = GroupStats()
        with parameter_meter(model) as meter:
            group_backward(model, prompt, responses, weighted_loss, stats=stats,
                           knobs=Knobs(prompt_grad=mode, chunk_size=chunk_size))
        estimate = estimate_memory(model.config, prompt_len, 2, RESPONSE_LEN, chunk_size, mode, dtype,
                                   device_type="cpu")  # the kernels the meter measured
        ratio = estimate.saved_peak_bytes / meter.peak
        record_property(f"ratio_{dtype}_{chunk_size}_{mode}", ratio)
        assert estimate.state_bytes == stats.prompt_state_bytes
        assert 0.8 <= ratio <= 1.2, (dtype, chunk_size, mode, ratio)
        assert estimate.state_grad_bytes == stats.state_grad_device_bytes  # 0 in detached mode


SHARED_INDEXER = ["full", "shared", "shared"]


@pytest.mark.parametrize("chunk_size, mode", [(None, "detached"), (40, "exact")])
def test_estimate_counts_indexer_keys_of_indexer_layers_only(chunk_size, mode):
    """GLM-MoE-DSA layers that reuse an earlier layer's top-k selection (indexer_types "shared") hold no
    indexer keys: the estimate matches the measured state, latent rows on every layer and indexer rows
    on the one layer that runs its indexer."""
    model = tiny_model("glm_moe_dsa", indexer_types=SHARED_INDEXER, index_topk=32)
    assert [layer.self_attn.indexer is None for layer in model.model.layers] == [False, True, True]
    config, prompt_len = model.config, 100
    prompt, responses = make_group(VOCAB, prompt_len, (8,))
    state = capture_prompt(model, prompt, for_backward=mode == "exact", knobs=Knobs(chunk_size=chunk_size))
    estimate = estimate_memory(config, prompt_len, 1, 8, chunk_size, mode, torch.float32)
    rows = 3 * (config.kv_lora_rank + config.qk_rope_head_dim) + config.index_head_dim
    assert state.nbytes() == (prompt_len - 1) * rows * 4
    assert estimate.state_bytes == state.nbytes()


def test_budget_fails_early_with_advice():
    model = tiny_model("qwen3")
    prompt, responses = make_group(VOCAB, 512, (8, 8))
    estimate = estimate_memory(model.config, 512, 2, 8, None, "exact", torch.float32, device_type="cpu")
    with pytest.raises(MemoryError, match=r"estimated .* GiB > budget .* GiB.*chunk_size="):
        group_backward(model, prompt, responses, weighted_loss, memory_budget_bytes=estimate.total_bytes // 2)
    assert all(p.grad is None for p in model.parameters())
    group_backward(model, prompt, responses, weighted_loss, memory_budget_bytes=estimate.total_bytes)
    assert any(p.grad is not None for p in model.parameters())


def test_estimate_scales_to_real_configs():
    """A GLM-5-like MLA config at 1M tokens, from the config alone: latent (512 + 64) x 2 bytes per token
    on every layer, indexer keys (128 x 2 bytes) on the layers that run their indexer; float32
    gradients of the latent only (indexer keys get none)."""
    config = transformers.GlmMoeDsaConfig(
        hidden_size=6144, num_hidden_layers=4, num_attention_heads=64, kv_lora_rank=512, qk_rope_head_dim=64,
        qk_nope_head_dim=192, v_head_dim=256, q_lora_rank=2048, index_head_dim=128, vocab_size=1024,
        indexer_types=["full", "shared", "full", "shared"],
    )
    tokens = 2**20
    estimate = estimate_memory(config, tokens + 1, 8, 1024, 4096, "exact", torch.bfloat16)
    assert estimate.state_bytes == tokens * (4 * (512 + 64) + 2 * 128) * 2
    assert estimate.state_grad_bytes == tokens * 4 * (512 + 64) * 4


CP_CASES = (("qwen3", 1024, 256), ("qwen3_5", 1024, 256))  # (family, P, chunk): dense and hybrid, chunked exact
CP_BUDGET_PROMPT_LEN, CP_BUDGET_CHUNK = 257, 64


@contextmanager
def state_leaf_grad_meter() -> Iterator[list[int]]:
    """Bytes of the gradients one layer's backward hands its state leaves while a response replays (one entry per
    replay step and layer: one response per rank under CP), read where each leaf adds its gradient into the float32
    sums (``PathState._hand_grad``, called from the leaves' post-accumulate-grad hooks inside
    ``execute._Walk._replay``; a recompute's are not counted)."""
    replay, hand_grad, sizes, replaying = execute._Walk._replay, PathState._hand_grad, [], []

    def metered_replay(self, step):
        replaying.append({})
        try:
            return replay(self, step)
        finally:
            sizes.extend(replaying.pop().values())

    def metered_hand_grad(self, layer, j, parent, row_end, grad):
        if replaying:
            per_layer = replaying[-1]
            per_layer[layer] = per_layer.get(layer, 0) + grad.untyped_storage().nbytes()
        return hand_grad(self, layer, j, parent, row_end, grad)

    execute._Walk._replay, PathState._hand_grad = metered_replay, metered_hand_grad
    try:
        yield sizes
    finally:
        execute._Walk._replay, PathState._hand_grad = replay, hand_grad


def _cp_measure(rank: int, world: int, cases=CP_CASES, budget: bool = True) -> dict:
    """On one rank of ``world`` (1: one process, no group): per case of ``cases`` the peak saved bytes, the state
    bytes and the largest state-gradient handed back by one response's backward of ``group_backward``; with
    ``world`` 2 and ``budget`` also the budget check's outcome without and with the state gradient on the host."""
    torch.set_num_threads(1)
    group = dist.new_group(list(range(world))) if world > 1 else None
    out = {"cases": []}
    for family, prompt_len, chunk in cases:
        model = tiny_model(family)
        prompt, responses = make_group(VOCAB, prompt_len, [RESPONSE_LEN] * world)  # G = R: one full round
        stats = GroupStats()
        with parameter_meter(model) as meter, state_leaf_grad_meter() as leaf_grads:
            group_backward(model, prompt, responses, weighted_loss, stats=stats, cp_group=group,
                           knobs=Knobs(prompt_grad="exact", chunk_size=chunk))
        out["cases"].append({"saved": meter.peak, "state": stats.prompt_state_bytes, "leaf_grads": max(leaf_grads)})
    if world == 2 and budget:
        out["budget"] = _cp_budget(group, world)
    return out


def _cp_budget(group, world: int) -> dict:
    """A budget between the device bytes with and without the state gradient on the host: MemoryError without
    (nothing computed), success with ``state_grad_on_host=True``."""
    model = tiny_model("qwen3")
    prompt, responses = make_group(VOCAB, CP_BUDGET_PROMPT_LEN, [8] * world)
    estimate = estimate_memory(model.config, CP_BUDGET_PROMPT_LEN, world, 8, CP_BUDGET_CHUNK, "exact",
                               torch.float32, cp_size=world, device_type="cpu")  # as group_backward's pre-flight
    budget = estimate.total_bytes - estimate.state_grad_bytes // 2
    message = None
    try:
        group_backward(model, prompt, responses, weighted_loss, memory_budget_bytes=budget, cp_group=group,
                       knobs=Knobs(chunk_size=CP_BUDGET_CHUNK))
    except MemoryError as exc:
        message = str(exc)
    untouched = all(p.grad is None for p in model.parameters())
    group_backward(model, prompt, responses, weighted_loss, memory_budget_bytes=budget, cp_group=group,
                   knobs=Knobs(chunk_size=CP_BUDGET_CHUNK, state_grad_on_host=True))
    return {"message": message, "untouched": untouched, "ran_offloaded": any(p.grad is not None
                                                                                for p in model.parameters())}


@pytest.mark.parametrize("world", [1, 2, 4])
def test_estimate_per_rank_matches_meter(world, record_property):
    """Per rank of R ranks, chunked exact: prompt-state bytes and the state gradients one backward hands back
    exactly, peak saved-for-backward + state bytes within 20 % (rank r's own estimate)."""
    results = [_cp_measure(0, 1)] if world == 1 else run_ranks(_cp_measure, world, timeout_s=600)
    _check_per_rank(results, CP_CASES, world, record_property)
    if world == 2:
        budgets = [result["budget"] for result in results]
        assert all(b["untouched"] and b["ran_offloaded"] for b in budgets), budgets
        messages = {b["message"] for b in budgets}
        assert len(messages) == 1, messages  # every rank raised the same error
        message = messages.pop()
        assert message is not None and "R=2" in message
        for knob in ("chunk_size=", "context-parallel size R=4", "state_grad_on_host=True (-", "fits",
                     "prompt_grad='detached'"):
            assert knob in message, (knob, message)


def _check_per_rank(results: list[dict], cases, world: int, record_property) -> None:
    """Each rank's own estimate against what it measured (``_cp_measure``): prompt-state bytes and the state
    gradients one backward hands back exactly, peak saved-for-backward + state bytes within 20 %."""
    for rank, result in enumerate(results):
        for (family, prompt_len, chunk), measured in zip(cases, result["cases"], strict=True):
            model = tiny_model(family)
            estimate = estimate_memory(model.config, prompt_len, world, RESPONSE_LEN, chunk, "exact", torch.float32,
                                       cp_size=world, rank=rank, device_type="cpu")
            ratio = (estimate.saved_peak_bytes + estimate.state_bytes) / (measured["saved"] + measured["state"])
            record_property(f"ratio_{family}_rank{rank}", ratio)
            assert estimate.state_bytes == measured["state"], (family, rank)
            assert estimate.state_leaf_grad_bytes == measured["leaf_grads"], (family, rank)
            assert 0.8 <= ratio <= 1.2, (family, rank, ratio)


def test_estimate_per_rank_matches_meter_for_every_cp_family(record_property):
    """``test_estimate_per_rank_matches_meter`` at R = 2 for every family with a CP form (all but gpt_oss), in one
    spawn: chunked exact, a shorter prompt."""
    cases = tuple((f, 512, 128) for f in (*FAMILIES, *VARIANTS) if f != "gpt_oss" and unavailable(f) is None)
    results = run_ranks(_cp_measure, 2, cases, False, timeout_s=900)
    _check_per_rank(results, cases, 2, record_property)


def test_state_grad_on_host_moves_bytes_to_host():
    """With the state gradient on the host its float32 sums leave the device total for the host total, beside a
    staging buffer of the largest state tensor (on the device, that tensor while its copy is in flight)."""
    config = tiny_config("qwen3_5")
    device = estimate_memory(config, 4097, 8, 64, 512, "exact", torch.bfloat16, cp_size=4)
    host = estimate_memory(config, 4097, 8, 64, 512, "exact", torch.bfloat16, cp_size=4, state_grad_on_host=True)
    assert device.host_bytes == 0 and host.state_grad_bytes == device.state_grad_bytes > 0
    assert host.host_bytes == host.state_grad_bytes + host.staging_bytes  # the sums and their staging buffer
    # the device keeps the gradient whose copy to the host is in flight
    assert device.total_bytes - host.total_bytes == host.state_grad_bytes - host.staging_bytes


@pytest.mark.parametrize("knob", ["state_grad_on_host=True", "prompt_grad='detached'"])
def test_budget_error_says_which_knob_fits(knob):
    """A budget that exactly fits the estimate with one knob turned: the error names that knob as fitting, with
    the bytes it saves; one byte less and it is not enough alone."""
    config = tiny_config("qwen3_5")
    args = (config, 4097, 8, 64, 512)
    exact = estimate_memory(*args, "exact", torch.bfloat16, cp_size=4)
    turned = estimate_memory(*args, "exact", torch.bfloat16, cp_size=4, state_grad_on_host=True)
    if knob == "prompt_grad='detached'":
        turned = estimate_memory(*args, "detached", torch.bfloat16, cp_size=4)
    saved = f"{(exact.total_bytes - turned.total_bytes) / 2**30:.3g} GiB"
    for budget, verdict in ((turned.total_bytes, "fits"), (turned.total_bytes - 1, "not enough alone")):
        with pytest.raises(MemoryError, match=r"per rank \(R=4\)") as error:
            check_budget(exact, budget)
        assert f"{knob} (-{saved}, {verdict}" in str(error.value)
    check_budget(turned, turned.total_bytes)


def test_budget_error_names_replay_tokens_when_the_batched_replay_is_the_peak():
    """A replay batch of k responses that is the saved-for-backward peak: the error offers a smaller replay_tokens,
    and does not when one response replays at a time."""
    config = tiny_config("qwen3")
    batched = estimate_memory(config, 512, 8, 64, None, "exact", torch.float32, replay_tokens=512)
    alone = estimate_memory(config, 512, 8, 64, None, "exact", torch.float32, replay_tokens=64)
    assert batched.replay_batch == 8 and alone.replay_batch == 1
    assert batched.replay_saved_bytes > batched.prompt_backward_saved_bytes
    assert alone.total_bytes < batched.total_bytes
    with pytest.raises(MemoryError, match=r"replay_tokens smaller \(now 8 responses replay together"):
        check_budget(batched, alone.total_bytes)
    with pytest.raises(MemoryError) as error:
        check_budget(alone, alone.total_bytes - 1)
    assert "replay_tokens" not in str(error.value)


@pytest.mark.parametrize("family, cp_size", [("qwen3_5", 1), ("qwen3_5", 4), ("deepseek_v3", 4)])
def test_checkpointed_estimate_changes_only_the_saved_terms(family, cp_size):
    """estimate_memory(checkpointed=True): the same state and state-gradient bytes as without; the saved peaks are
    the layer inputs plus one layer's saves, so less than every layer's for a multi-layer model, and more
    than the layer inputs alone."""
    config = tiny_config(family)
    args = (config, 4097, 8, 64, 512, "exact", torch.bfloat16)
    plain = estimate_memory(*args, cp_size=cp_size)
    checkpointed = estimate_memory(*args, cp_size=cp_size, checkpointed=True)
    same = ("state_bytes", "boundary_bytes", "state_grad_bytes", "state_leaf_grad_bytes")
    assert [getattr(checkpointed, f) for f in same] == [getattr(plain, f) for f in same]
    inputs = config.num_hidden_layers * config.hidden_size * torch.bfloat16.itemsize
    assert 64 * inputs < checkpointed.replay_saved_bytes < plain.replay_saved_bytes
    assert 512 // cp_size * inputs < checkpointed.prompt_backward_saved_bytes < plain.prompt_backward_saved_bytes
    # pass-Q: the largest layer's (0 when it is a Gated DeltaNet layer, and in one process)
    assert checkpointed.pass_q_bytes <= plain.pass_q_bytes and (cp_size > 1 or checkpointed.pass_q_bytes == 0)


def test_allocation_meter_counts_new_storages_until_freed():
    """``memory.AllocationMeter`` (a TorchDispatchMode): a storage an op returns counts until freed, once however
    many views refer to it; views and in-place results of existing storages are not new; ``peak`` keeps the most."""
    before = torch.zeros(10)
    with AllocationMeter() as meter:
        a = torch.empty(1000)  # 4000 bytes
        view = a[10:]
        a.add_(1.0)
        before.mul_(2.0)
        c = torch.empty(500)  # 2000 bytes
        del c
        d = view * 2  # 3960 bytes
    assert (meter.peak, meter.current) == (4000 + max(2000, 3960), 4000 + 3960), (meter.peak, meter.current)
    del a, view, d
    assert meter.current == 0


def test_a_checkpointed_backward_holds_only_the_inputs_of_the_layers_not_yet_run():
    """Checkpointed, a layer keeps its input until its backward has run, so at layer j's moments only the inputs of
    layers 0..j are held: in a model of identical layers each layer's peak in a recompute (a step that does not
    score) is one layer input above the one below it (the last layer, whose output no one reads, saves less). The
    peak is the largest of the per-moment figures, which ``gpu_table`` pairs with FSDP2's units."""
    layers, chunk = 5, 512
    config = tiny_config("qwen3", num_hidden_layers=layers, layer_types=["full_attention"] * layers)
    e = estimate_memory(config, 4 * chunk + 1, 4, RESPONSE_LEN, chunk, "exact", torch.float32, checkpointed=True)
    recompute = e.unscored_layer_peak_bytes
    layer_input = chunk * config.hidden_size * 4
    steps = [above - below for below, above in zip(recompute[:-2], recompute[1:-1], strict=True)]
    assert steps == [layer_input] * (layers - 2)
    assert recompute[-1] < recompute[-2]
    assert len(e.layer_peak_bytes) == layers
    assert e.backward_bytes == max(*e.layer_peak_bytes, *recompute, e.ends_peak_bytes)


@pytest.mark.parametrize("cp_size", [1, 4])
def test_estimate_counts_the_fused_attention_backward(cp_size):
    """The transient of one attention layer's fused backward comes from the op modules' own cost functions, for the
    device kind asked (CUDA by default), and counts in the total when it is the largest transient; MLA layers take
    the blocked op (no fused backward)."""
    config = tiny_config("qwen3")
    heads, kv_heads, dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    prompt_len, response_len, chunk = 4097, 64, 1024
    for device_type in ("cuda", "cpu"):
        e = estimate_memory(config, prompt_len, 8, response_len, chunk, "exact", torch.bfloat16, cp_size=cp_size,
                            device_type=device_type)
        plan = star_plan(prompt_len, [response_len] * 8, Knobs(chunk_size=chunk), world=cp_size)
        last = plan.captured[-1]
        if cp_size == 1:
            replay = fused_backward_transient_bytes(device_type, torch.bfloat16, e.replay_batch, heads, kv_heads,
                                                    dim, response_len, prompt_len - 1, response_len,
                                                    shared_prefix=e.replay_batch > 1)
            prompt = fused_backward_transient_bytes(device_type, torch.bfloat16, 1, heads, kv_heads, dim, chunk,
                                                    plan.segments[last].rank_rows[0], chunk)
        else:
            replay = sharded_fused_backward_transient_bytes(device_type, torch.bfloat16, 1, heads, kv_heads, dim,
                                                            [response_len] * cp_size, 0, plan.capacity, False)
            prompt = sharded_fused_backward_transient_bytes(device_type, torch.bfloat16, 1, heads, kv_heads, dim,
                                                            plan.rank_tokens(last), 0,
                                                            plan.segments[last].rank_rows[0], True)
        assert (e.replay_backward_transient_bytes, e.prompt_backward_transient_bytes) == (replay, prompt)
        assert e.transient_bytes == max(e.score_block_bytes, replay, prompt)
        # the backward peak: the state, the gradients held then, that step's saves less the state buffers it saves
        # as views (already in the state) and the transient of its largest moment; the total: it or a no-grad
        # capture's peak
        assert e.backward_bytes == (e.state_bytes + e.backward_grad_bytes + e.backward_peak_saved_bytes
                                    - e.saved_state_bytes + e.backward_peak_transient_bytes)
        # the sums, a layer's leaf gradient and a recompute's gradients for its own state rows (at most the state)
        assert e.backward_grad_bytes <= e.device_state_grad_bytes + e.state_leaf_grad_bytes + e.state_bytes
        assert e.total_bytes == max(e.backward_bytes, e.capture_peak_bytes)
    mla_config = tiny_config("deepseek_v3")
    mla = estimate_memory(mla_config, prompt_len, 8, response_len, chunk, "exact", torch.bfloat16, cp_size=cp_size)
    if cp_size == 1:
        assert mla.replay_backward_transient_bytes == mla.prompt_backward_transient_bytes == 0
        return
    # under CP the blocked pass-Q's backward (its own count, pinned against the fake-CUDA meter)
    heads, rank, rope = mla_config.num_attention_heads, mla_config.kv_lora_rank, mla_config.qk_rope_head_dim
    replay = sharded_blocked_transient_bytes("cuda", torch.bfloat16, 1, heads, 1, rank + rope, rank,
                                             [response_len] * cp_size, 0, plan.capacity)
    prompt = sharded_blocked_transient_bytes("cuda", torch.bfloat16, 1, heads, 1, rank + rope, rank,
                                             plan.rank_tokens(last), 0, plan.segments[last].rank_rows[0])
    assert (mla.replay_backward_transient_bytes, mla.prompt_backward_transient_bytes) == (replay.backward,
                                                                                          prompt.backward)


def _agent_tree(seed: int = 0) -> tuple[list[torch.Tensor], list[int]]:
    """Rows of a prefix tree: 2 groups x 3 responses after one 600-token system prompt + a 40-token group prompt,
    each group's responses sharing a scored 24-token prefix; a per-turn row extending row 0 by 200 tokens."""
    gen = torch.Generator().manual_seed(seed)
    system = torch.randint(0, VOCAB, (600,), generator=gen)
    rows, starts = [], []
    for _ in range(2):
        prompt = torch.cat([system, torch.randint(0, VOCAB, (40,), generator=gen)])
        shared = torch.randint(0, VOCAB, (24,), generator=gen)
        for _ in range(3):
            rows.append(torch.cat([prompt, shared, torch.randint(0, VOCAB, (RESPONSE_LEN,), generator=gen)]))
            starts.append(len(prompt))
    rows.append(torch.cat([rows[0], torch.randint(0, VOCAB, (200,), generator=gen)]))
    starts.append(len(rows[0]) + 8)
    return rows, starts


@pytest.mark.parametrize("family", FAMILIES + VARIANTS)
def test_estimate_of_a_tree_matches_meter(family, record_property):
    """The estimate of a prefix tree's plan (``estimate_plan``: chunked, response segments, exact): the path state
    and its gradient sums the walk held at their largest exactly, the saved-for-backward peak within 20 %."""
    model = tiny_model(family)
    rows, starts = _agent_tree()
    knobs = Knobs(chunk_size=256, response_chunk_size=64, min_shared_tokens=16)
    plan = tree_plan(rows, starts, knobs)
    assert len(plan.captured) > 4 and max(len(plan.path(i)) for i in range(len(plan.segments))) >= 4
    stats = GroupStats()
    with parameter_meter(model) as meter:
        tree_backward(model, rows, starts, weighted_loss, stats=stats, knobs=knobs)
    estimate = estimate_plan(model.config, plan, "exact", torch.float32, device_type="cpu")
    ratio = estimate.saved_peak_bytes / meter.peak
    record_property("ratio", ratio)
    assert estimate.state_bytes == stats.prompt_state_bytes
    assert estimate.state_grad_bytes == stats.state_grad_device_bytes
    assert 0.8 <= ratio <= 1.2, ratio


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_unknown_layer_type_is_an_error_naming_it(family):
    """A layer type of config.layer_types the adapter does not run is an error naming it, from the estimate too
    (never counted as another kind)."""
    layers = tiny_config(family).num_hidden_layers
    config = tiny_config(family, layer_types=["full_attention"] * (layers - 1) + ["chunked_attention"])
    with pytest.raises(UnsupportedModelError, match=r"layer type\(s\) \['chunked_attention'\] of config.layer_types"):
        estimate_memory(config, 64, 2, 8, None, "exact", torch.float32)


@pytest.mark.parametrize("family", FAMILIES)
def test_adapter_mixers_are_the_calls_the_layers_make(family, monkeypatch):
    """``Adapter.ops`` (what the estimate reads of each layer) matches the model: the attention op's call shape
    in every attention layer of a replay, in layer order, and a Gated DeltaNet op exactly for the linear layers."""
    import verl_longstraw.mixers.attention as attention_mixers
    from verl_longstraw import group_log_probs
    from verl_longstraw.adapters import adapter_for
    from verl_longstraw.mixers import GatedDelta, RowAttention

    model = tiny_model(family)
    ops = adapter_for(model).ops
    types = getattr(model.config.get_text_config(), "layer_types", None) or []
    assert [isinstance(op, GatedDelta) for op in ops] == [t == "linear_attention" for t in types or [None] * len(ops)]
    prompt, responses = make_group(VOCAB, 24, (5,))
    state = capture_prompt(model, prompt)
    calls = []
    real = attention_mixers.prefix_causal_attention

    def recording(q, k_prefix, v_prefix, k_self, v_self, *args, **kwargs):
        calls.append((q.shape[1], k_self.shape[1], q.shape[-1], v_self.shape[-1]))
        return real(q, k_prefix, v_prefix, k_self, v_self, *args, **kwargs)

    monkeypatch.setattr(attention_mixers, "prefix_causal_attention", recording)
    with torch.no_grad():
        group_log_probs(model, prompt, responses, state=state)
    attending = [op for op in ops if isinstance(op, RowAttention)]
    assert calls == [(m.q_heads, m.kv_heads, m.qk_dim, m.v_dim) for m in attending]
    gated = [m.gated_output for m in attending if m.kind == "attention"]
    assert gated == [model.config.model_type in ("qwen3_next", "qwen3_5", "qwen3_5_text")] * len(gated)


def test_glm_5_2_shared_indexer_state_per_token():
    """GLM-5.2's layout (GLM-5 dims, the DSA indexer on 21 of the 78 layers, the others reusing its top-k; which
    21 does not change the bytes): 93.0 KiB of prompt state per token in bf16 (the latent and rope key on every
    layer, indexer keys on 21), against GLM-5's 107.25 KiB with an indexer on every layer."""
    full = transformers.GlmMoeDsaConfig(max_position_embeddings=1 << 20)
    shared = transformers.GlmMoeDsaConfig(max_position_embeddings=1 << 20,
                                          indexer_types=(["full"] + ["shared"] * 3) * 19 + ["full"] * 2)
    assert shared.indexer_types.count("full") == 21 and len(shared.indexer_types) == 78
    per_token = {name: estimate_memory(c, 4097, 1, 8, None, "exact", torch.bfloat16).state_bytes / 4096 / 1024
                 for name, c in (("glm5", full), ("glm5.2", shared))}
    assert per_token == {"glm5": 107.25, "glm5.2": 93.0}


@pytest.mark.parametrize("chunk_size", [None, 64])
def test_capture_peak_and_step_total_match_allocation_meter(chunk_size):
    """``capture_peak_bytes`` is the no-grad capture's peak as ``memory.AllocationMeter`` counts it, exactly (the
    rotary tables, the layers' returned state rows, the MLP half's hidden-wide tensors; with chunks the store
    opened by the first chunk's write); and a whole step's peak (capture, then ``group_backward`` on its state) is
    within 20 % of ``total_bytes``, which counts the state buffers the attention saves as views only once."""
    model = tiny_model("qwen3")
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    prompt_len = 257
    prompt, responses = make_group(VOCAB, prompt_len, (RESPONSE_LEN, RESPONSE_LEN))
    for mode in ("detached", "exact"):
        estimate = estimate_memory(model.config, prompt_len, 2, RESPONSE_LEN, chunk_size, mode, torch.float32,
                                   replay_tokens=RESPONSE_LEN, device_type="cpu")
        with AllocationMeter() as capture_meter:
            state = capture_prompt(model, prompt, for_backward=mode == "exact", knobs=Knobs(chunk_size=chunk_size))
        assert capture_meter.peak == estimate.capture_peak_bytes, (mode, capture_meter.peak)
        del state
        with AllocationMeter() as step_meter:
            state = capture_prompt(model, prompt, for_backward=mode == "exact", knobs=Knobs(chunk_size=chunk_size))
            group_backward(model, prompt, responses, weighted_loss, state=state,
                           knobs=Knobs(prompt_grad=mode, chunk_size=chunk_size, replay_tokens=RESPONSE_LEN))
        ratio = estimate.total_bytes / step_meter.peak
        assert 0.8 <= ratio <= 1.2, (mode, ratio)
