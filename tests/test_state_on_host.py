"""``state_on_host`` (``state.stream``): the prompt state in host memory (rows, fixed-size states and their
chunk-boundary copies), brought to the device a layer at a time. On CPU the copies are made all the same (new
storage), so the walk must equal the resident one bit for bit; float64 parity for every family; CP at R = 2 and 3;
trees; LoRA; at most two layers' state resident at once."""

import pytest
import torch
import torch.distributed as dist
from peft import LoraConfig, get_peft_model
from test_tree import random_tree

from verl_longstraw import Knobs, capture_prompt, group_backward, group_log_probs, tree_backward
from verl_longstraw.adapters import adapter_for
from verl_longstraw.estimate import estimate_memory, streamed_moments
from verl_longstraw.parallel.launch import run_ranks
from verl_longstraw.preflight import check_budget, check_host_budget
from verl_longstraw.state import stream
from verl_longstraw.testing.compare import (
    float64_throughout,
    full_log_probs,
    grads_of,
    make_group,
    max_abs_error,
    relative_error,
    standard_grads,
    weighted_loss,
)
from verl_longstraw.tiny import FAMILIES, VARIANTS, VOCAB, tiny_model, unavailable

FLOAT64_TOL = 1e-10  # as tests/test_core_equivalence.py


def _backward(model, prompt, responses, **knobs):
    """group_backward from zero gradients: (result, gradients)."""
    model.zero_grad(set_to_none=True)
    result = group_backward(model, prompt, responses, weighted_loss, with_entropy=False,
                            knobs=Knobs(chunk_size=40, replay_tokens=16, **knobs))
    return result, grads_of(model)


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _equal_grads(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)


def _assert_bitwise(resident, streamed):
    (a, grads_a), (b, grads_b) = resident, streamed
    assert torch.equal(a.losses, b.losses)
    assert _equal(a.log_probs, b.log_probs)
    assert _equal_grads(grads_a, grads_b)


# GQA attention, MLA, sliding windows with sinks; the fixed-size states and their chunk-boundary copies of Gated
# DeltaNet, Mamba2, the gated short convolution and Kimi Delta Attention
@pytest.mark.parametrize("family, mode, grad_on_host", [
    ("qwen3", "exact", False), ("qwen3", "detached", False), ("qwen3_5", "exact", True),
    ("deepseek_v3", "exact", False), ("gpt_oss", "exact", True), ("gpt_oss", "detached", False),
    ("nemotron_h", "exact", False), ("lfm2", "exact", True), ("kimi_linear", "detached", False),
])
def test_streamed_walk_is_the_resident_walk(family, mode, grad_on_host):
    """Losses, log-probs and gradients bitwise equal to the resident walk's (chunked prompt, several replay
    batches); the whole state held on the host, the chunk-boundary copies included; at most two layers' state on the
    device at once, none after the walk."""
    model = tiny_model(family)
    prompt, responses = make_group(VOCAB, 97, (9, 3, 5))
    knobs = dict(prompt_grad=mode, state_grad_on_host=grad_on_host)
    resident = _backward(model, prompt, responses, **knobs)
    stream.resident.reset_peak()
    streamed = _backward(model, prompt, responses, state_on_host=True, **knobs)
    _assert_bitwise(resident, streamed)
    assert 0 < streamed[0].stats.prompt_state_host_bytes == streamed[0].stats.prompt_state_bytes
    assert resident[0].stats.prompt_state_host_bytes == 0
    assert 1 <= stream.resident.peak <= 2
    assert not stream.resident.live


def test_at_most_two_layers_resident():
    """Six attention layers: the replays' and recomputes' backward (which reads every layer's saved K/V) and the
    captures hold at most two layers' rows on the device at once, and the walk equals the resident one."""
    model = tiny_model("qwen3", num_hidden_layers=6, layer_types=6 * ["full_attention"])
    prompt, responses = make_group(VOCAB, 57, (5, 3))
    resident = _backward(model, prompt, responses)
    stream.resident.reset_peak()
    streamed = _backward(model, prompt, responses, state_on_host=True)
    _assert_bitwise(resident, streamed)
    assert stream.resident.peak == 2 and not stream.resident.live


DSA_SELECTING = dict(index_topk=24, index_n_heads=16)  # top-k below the prompt: the selection runs


@pytest.mark.parametrize("family, overrides, checkpointed", [
    ("deepseek_v32", {}, False),
    # two indexer layers, each followed by a layer reusing its selection: under checkpointing the backward
    # recomputes a shared layer after the later indexer layer, so its selection is made again (its prefix keys
    # read from the path again)
    ("glm_moe_dsa", dict(num_hidden_layers=4, indexer_types=["full", "shared", "full", "shared"],
                         mlp_layer_types=["dense"] * 4), True),
])
def test_dsa_indexer_keys_stream(family, overrides, checkpointed):
    """DSA with its selection running: the indexer keys stream as the other rows (the selection keeps no copy of
    them), so at most two layers' rows are on the device, under checkpointing too (the backward's recompute of a
    layer reads the layers from the top down, and the copy issued beside it is the one below); bitwise equal to the
    resident walk."""
    model = tiny_model(family, **DSA_SELECTING, **overrides)
    if checkpointed:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    prompt, responses = make_group(VOCAB, 60, (9, 4))
    resident = _backward(model, prompt, responses)
    stream.resident.reset_peak()
    streamed = _backward(model, prompt, responses, state_on_host=True)
    _assert_bitwise(resident, streamed)
    assert 1 <= stream.resident.peak <= 2 and not stream.resident.live


def test_captured_state_serves_log_probs_and_backward():
    """A ``capture_prompt`` state kept on the host serves ``group_log_probs`` and then ``group_backward``."""
    model = tiny_model("qwen3")
    prompt, responses = make_group(VOCAB, 97, (9, 3))
    out = []
    for on_host in (False, True):
        knobs = Knobs(chunk_size=40, state_on_host=on_host)
        state = capture_prompt(model, prompt, knobs=knobs)
        assert (state.store.host_nbytes() > 0) == on_host
        log_probs = group_log_probs(model, prompt, responses, state=state, knobs=knobs).log_probs
        model.zero_grad(set_to_none=True)
        result = group_backward(model, prompt, responses, weighted_loss, state=state, knobs=knobs)
        out.append((log_probs, result.losses, grads_of(model)))
    (lp_a, loss_a, grads_a), (lp_b, loss_b, grads_b) = out
    assert _equal(lp_a, lp_b) and _equal_grads(grads_a, grads_b) and torch.equal(loss_a, loss_b)


def test_lora_streamed_is_the_resident_walk():
    model = get_peft_model(tiny_model("qwen3_5"), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                                             init_lora_weights=False)).train()
    prompt, responses = make_group(VOCAB, 97, (9, 4))
    _assert_bitwise(_backward(model, prompt, responses), _backward(model, prompt, responses, state_on_host=True))


@pytest.mark.parametrize("family", [f for f in FAMILIES + VARIANTS if unavailable(f) is None])
def test_streamed_gradient_float64(family):
    """Float64 models computing in float64 throughout: the streamed walk's gradient and log-probs within
    FLOAT64_TOL of the standard path's, chunked."""
    model = tiny_model(family, dtype=torch.float64)
    prompt, responses = make_group(VOCAB, 57, (5, 3))
    with float64_throughout():
        expected = standard_grads(model, prompt, responses, weighted_loss)
        with torch.no_grad():
            expected_lp = [full_log_probs(model, prompt, r)[0] for r in responses]
        model.zero_grad(set_to_none=True)
        result = group_backward(model, prompt, responses, weighted_loss,
                                knobs=Knobs(chunk_size=20, state_on_host=True))
    assert relative_error(grads_of(model), expected) < FLOAT64_TOL
    assert max_abs_error(result.log_probs, expected_lp) < FLOAT64_TOL


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_streamed_tree_is_the_resident_tree(family):
    """A prefix tree (depth 3, chunked segments and responses): the path's segments stream; bitwise equal."""
    model = tiny_model(family)
    tree = random_tree(12, 3)
    out = []
    for on_host in (False, True):
        model.zero_grad(set_to_none=True)
        result = tree_backward(model, tree.sequences, tree.score_starts, tree.loss, with_entropy=True,
                               knobs=Knobs(chunk_size=5, response_chunk_size=3, state_on_host=on_host))
        out.append((result, grads_of(model)))
    assert _equal(out[0][0].entropies, out[1][0].entropies)
    _assert_bitwise(*out)


def _cp_worker(rank: int, world: int) -> list[tuple]:
    """Per case: whether this rank's log-probs, losses and gradients with ``state_on_host`` equal its resident
    ones bit for bit (CP: each rank streams its own shard)."""
    group = dist.new_group(list(range(world)))
    out = []
    for family, mode in (("qwen3", "exact"), ("qwen3_5", "exact"), ("deepseek_v3", "detached")):
        model = tiny_model(family, seed=world)
        prompt, responses = make_group(VOCAB, 101, (7, 3, 5))
        results = []
        for on_host in (False, True):
            model.zero_grad(set_to_none=True)
            result = group_backward(model, prompt, responses, weighted_loss, cp_group=group,
                                    knobs=Knobs(prompt_grad=mode, chunk_size=29, state_on_host=on_host))
            results.append((result, grads_of(model)))
        (a, grads_a), (b, grads_b) = results
        out.append((family, mode, torch.equal(a.losses, b.losses),
                    _equal(a.log_probs, b.log_probs) and _equal_grads(grads_a, grads_b),
                    0 < b.stats.prompt_state_host_bytes == b.stats.prompt_state_bytes))
        dist.barrier(group)
    return out


def test_cp_streams_each_ranks_shard():
    """R = 2 and 3: every rank's streamed walk equals its resident one bit for bit."""
    for world in (2, 3):
        for rank_cases in run_ranks(_cp_worker, world, timeout_s=600):
            for family, mode, losses_equal, values_equal, on_host in rank_cases:
                assert losses_equal and values_equal and on_host, (world, family, mode)


@pytest.mark.parametrize("family, overrides", [
    ("qwen3", {}), ("qwen3_5", {}), ("glm_moe_dsa", DSA_SELECTING), ("deepseek_v32", DSA_SELECTING),
])
def test_estimate_counts_the_resident_window_and_the_host_rows(family, overrides):
    """With the knob the estimate's host figure is the measured host state (the Gated DeltaNet hybrid's chunk-boundary
    copies among it), its device state what a segment reads of the two largest layers (DSA's indexer keys among
    them); the device total shrinks by the rest, and the walk held no more layers than the window counts."""
    model = tiny_model(family, **overrides)
    prompt_len = 97
    prompt, responses = make_group(VOCAB, prompt_len, (9,))
    resident = estimate_memory(model.config, prompt_len, 1, 9, 40, "exact", torch.float32, device_type="cpu")
    streamed = estimate_memory(model.config, prompt_len, 1, 9, 40, "exact", torch.float32, device_type="cpu",
                               state_on_host=True)
    model.zero_grad(set_to_none=True)
    stream.resident.reset_peak()
    stats = group_backward(model, prompt, responses, weighted_loss,
                           knobs=Knobs(chunk_size=40, state_on_host=True)).stats
    assert stream.resident.peak <= 2
    assert streamed.host_state_bytes == stats.prompt_state_host_bytes > 0
    assert streamed.host_bytes == streamed.host_state_bytes and resident.host_bytes == 0
    layers = [sum(s.nbytes(prompt_len - 1, torch.float32) for s in layer) for layer in adapter_for(model).specs()]
    window = sum(sorted(layers, reverse=True)[:2])
    assert streamed.state_bytes == resident.state_bytes - streamed.host_state_bytes + window
    assert streamed.total_bytes == resident.total_bytes - streamed.host_state_bytes + window


def test_checkpointed_backward_holds_the_layers_the_estimate_counts(monkeypatch):
    """Under checkpointing each layer's backward recompute brings its state over and issues the copy below it,
    dropping the others: the layers ``streamed_moments`` counts at that layer's moments (each layer's read weighted
    2^l, so the count names the layers)."""
    model = tiny_model("qwen3", num_hidden_layers=6, layer_types=6 * ["full_attention"])
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    prompt, responses = make_group(VOCAB, 57, (5, 3))
    held_after_take = []
    take = stream.StreamedPath._take

    def recording_take(self, idx, forward):
        copies = take(self, idx, forward)
        held_after_take.append((idx, forward, sorted(self.copies)))
        return copies

    monkeypatch.setattr(stream.StreamedPath, "_take", recording_take)
    _backward(model, prompt, responses, state_on_host=True)
    counted = streamed_moments([2**layer for layer in range(6)], checkpointed=True).layers
    going_down = [(idx, held) for idx, forward, held in held_after_take if not forward]
    assert {idx for idx, _ in going_down} == set(range(5)), held_after_take  # every layer's recompute but the top's
    assert all(sum(2**layer for layer in held) == counted[idx] for idx, held in going_down), going_down


def test_streamed_moments_count_each_layer_and_the_one_below():
    """Checkpointed: at layer j the lowest streamed layer at or above j and the streamed layer below it (a layer
    without state streams nothing); the scoring and every moment without checkpointing: the two largest."""
    reads = [4, 0, 1, 2]
    assert streamed_moments(reads, checkpointed=True) == (6, [4, 5, 5, 3])
    assert streamed_moments(reads, checkpointed=False) == (6, [6, 6, 6, 6])


def test_host_budget_names_the_knob():
    """The pre-flight's host check: the node's ranks' host bytes against its available memory, naming the field."""
    estimate = estimate_memory(tiny_model("qwen3").config, 97, 1, 9, 40, "exact", torch.float32, device_type="cpu",
                               state_on_host=True)
    check_host_budget(estimate, estimate.host_bytes * 2, ranks_per_host=2)
    with pytest.raises(MemoryError, match="state_on_host keeps"):
        check_host_budget(estimate, estimate.host_bytes * 2 - 1, ranks_per_host=2)


def test_device_budget_names_the_knob_where_it_fits():
    """The pre-flight's device check: a budget the resident walk exceeds and the streamed one meets names
    ``state_on_host=True`` with what it saves and the host figure; with the knob on it is not named again."""
    config = tiny_model("qwen3", num_hidden_layers=6, layer_types=6 * ["full_attention"]).config  # rows to move
    resident, streamed = (estimate_memory(config, 97, 1, 9, 40, "exact", torch.float32, device_type="cpu",
                                          state_on_host=on) for on in (False, True))
    assert resident.streamed_total_bytes == streamed.total_bytes == streamed.streamed_total_bytes < resident.total_bytes
    assert resident.streamed_host_state_bytes == streamed.host_state_bytes > 0 == resident.host_state_bytes
    with pytest.raises(MemoryError, match=r"actor_rollout_ref\.actor\.longstraw\.state_on_host=True \(-.* GiB, fits: "
                                          r"the prompt state's rows, .* GiB a rank, in host memory"):
        check_budget(resident, streamed.total_bytes)
    check_budget(streamed, streamed.total_bytes)
    with pytest.raises(MemoryError) as raised:
        check_budget(streamed, streamed.total_bytes - 1)
    assert "state_on_host" not in str(raised.value)


def test_knob_must_be_a_bool():
    with pytest.raises(ValueError, match="state_on_host must be True or False"):
        Knobs(state_on_host=1)


def test_a_saved_tensor_is_a_row_reference_only_when_it_views_a_row_copy_on_fake_cuda():
    """What autograd saves in a streamed walk is packed as a reference to a layer's device copy only when it views
    that copy's storage: told by the storage's identity, which fake CUDA tensors (the dry run's, every storage at
    address 0) keep; by address every saved tensor of the copy's dtype was taken for a view of it, and the dry run
    of a streamed step counted none of them."""
    from verl_longstraw import fake_cuda

    with fake_cuda.fake_cuda_runtime(), fake_cuda.FakeCuda(fake_cuda.DeviceBytes()):
        path = stream.StreamedPath([(stream.HostRows(torch.empty(1, 2, 16, 8)),)], torch.device("cuda", 0))
        (copy,) = path[0]
        other = torch.empty_like(copy)
        assert isinstance(path._pack(copy[..., :4, :]), stream._SavedRows)
        assert isinstance(path._pack(other), torch.Tensor)
