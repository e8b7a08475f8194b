"""Memory stays flat in G, state formats have the promised size, bad input fails loudly."""

import dataclasses

import pytest
import torch

from verl_longstraw import (
    Knobs,
    UnsupportedModelError,
    api,
    capture_prompt,
    group_backward,
    group_log_probs,
    tree_log_probs,
)
from verl_longstraw.adapters import adapter_for, adapter_on_meta
from verl_longstraw.memory import parameter_meter
from verl_longstraw.mixers import NoMixer
from verl_longstraw.plan import star_plan
from verl_longstraw.state.kinds import Fixed, Window
from verl_longstraw.testing.compare import (
    full_log_probs,
    grads_of,
    make_group,
    relative_error,
    standard_grads,
    weighted_loss,
)
from verl_longstraw.tiny import DENSE_VARIANTS, REPRESENTATIVES, VARIANTS, VOCAB, tiny_config, tiny_model, unavailable


def _peak_saved_bytes(model, group_size: int, prompt_grad: str, chunk_size=None) -> int:
    """Peak bytes saved for backward of one group of 32-token responses at a fixed budget of two responses."""
    prompt, responses = make_group(VOCAB, 512, [32] * group_size)
    with parameter_meter(model) as meter:
        group_backward(model, prompt, responses, weighted_loss,
                       knobs=Knobs(prompt_grad=prompt_grad, chunk_size=chunk_size, replay_tokens=64))
    return meter.peak


@pytest.mark.parametrize("family", ["qwen3", "qwen3_next", "deepseek_v3"])
@pytest.mark.parametrize("prompt_grad, chunk_size", [("exact", None), ("exact", 128), ("detached", None)])
def test_memory_flat_in_group_size(family, prompt_grad, chunk_size):
    model = tiny_model(family)
    small = _peak_saved_bytes(model, 2, prompt_grad, chunk_size)
    large = _peak_saved_bytes(model, 8, prompt_grad, chunk_size)
    assert large <= 1.05 * small, (small, large)


@pytest.mark.parametrize("response_lens", [(12, 5), (12,)])
@pytest.mark.parametrize("family", DENSE_VARIANTS + VARIANTS)
def test_dense_variants_match_standard(family, response_lens):
    """The other dense model types and ``tiny.VARIANTS`` (MoE variants, DeepSeek-V3.2; one and several responses,
    chunked): log-probs and the exact gradient of the standard path."""
    model = tiny_model(family)
    prompt, responses = make_group(VOCAB, 150, response_lens)
    lp = group_log_probs(model, prompt, responses, knobs=Knobs(chunk_size=64)).log_probs
    with torch.no_grad():
        errors = [(a - full_log_probs(model, prompt, r)[0]).abs().max() for a, r in zip(lp, responses, strict=True)]
    assert max(errors) < 1e-5
    expected = standard_grads(model, prompt, responses, weighted_loss)
    model.zero_grad(set_to_none=True)
    group_backward(model, prompt, responses, weighted_loss, knobs=Knobs(chunk_size=64))
    assert relative_error(grads_of(model), expected) < 1e-5


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_qwen3_5_vision_language_checkpoint_on_text(family):
    """model_type qwen3_5 / qwen3_5_moe (the vision-language classes real checkpoints use): the text stack replays
    exactly."""
    import transformers

    from verl_longstraw.tiny import use_reference_kernels

    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)
    config_class, model_class = {
        "qwen3_5": (transformers.Qwen3_5Config, transformers.Qwen3_5ForConditionalGeneration),
        "qwen3_5_moe": (transformers.Qwen3_5MoeConfig, transformers.Qwen3_5MoeForConditionalGeneration),
    }[family]
    config = use_reference_kernels(config_class(text_config=tiny_config(family).to_dict(), vision_config=vision))
    model = model_class(config).train()
    prompt, responses = make_group(VOCAB, 50, (7, 3))
    expected = standard_grads(model, prompt, responses, weighted_loss)
    model.zero_grad(set_to_none=True)
    group_backward(model, prompt, responses, weighted_loss, knobs=Knobs(chunk_size=16))
    assert relative_error(grads_of(model), expected) < 1e-5


@pytest.mark.parametrize("family", ["deepseek_v3", "glm_moe_dsa", "deepseek_v32"])
def test_mla_state_is_latent_only(family):
    model = tiny_model(family)
    config = model.config
    prompt_len = 50
    state = capture_prompt(model, torch.randint(0, VOCAB, (prompt_len + 1,)), for_backward=False,
                           knobs=Knobs(chunk_size=16))
    elements = sum(t.numel() for t in state.tensors())
    latent = (config.kv_lora_rank + config.qk_rope_head_dim) * config.num_hidden_layers * prompt_len
    indexer = config.index_head_dim * config.num_hidden_layers * prompt_len if family != "deepseek_v3" else 0
    assert elements == latent + indexer


def _recurrent_layers() -> list[tuple[str, int]]:
    """(family, its first layer whose state is fixed-size and not a window) of each adapter that has one."""
    cases = []
    for family in REPRESENTATIVES:
        if unavailable(family) is None:
            ops = adapter_on_meta(tiny_config(family)).ops
            cases += [(family, idx) for idx, op in enumerate(ops)
                      if op.kinds and all(isinstance(k, Fixed) and not isinstance(k, Window) for k in op.kinds)][:1]
    return cases


@pytest.mark.parametrize("family, layer", _recurrent_layers())
def test_hybrid_state_is_fixed_size_for_linear_layers(family, layer):
    """A recurrent layer (Gated DeltaNet, Mamba1, Mamba2, Kimi Delta Attention, a short conv) keeps its state kinds'
    tensors (conv + recurrent state; a short conv's conv state alone) whose size is independent of the prompt's
    length, in storage of that size (no view of a longer buffer); layers without a mixer (nemotron_h's MLP and MoE
    blocks) keep none."""
    model = tiny_model(family)
    ops = adapter_for(model).ops
    sizes = []
    for n in (10, 90):
        store = capture_prompt(model, torch.randint(0, VOCAB, (n,)), for_backward=False).store
        tensors = [t for kind, storage in zip(store.kinds[layer], store.storage[layer], strict=True)
                   for t in kind.tensors(storage)]
        assert all(t.untyped_storage().nbytes() == t.numel() * t.element_size() for t in tensors)
        sizes.append([t.numel() for t in tensors])
        assert all(len(store.kinds[idx]) == 0 for idx, op in enumerate(ops) if isinstance(op, NoMixer))
    assert len(sizes[0]) == len(ops[layer].kinds)
    assert sizes[0] == sizes[1]


def test_single_token_prompt():
    """P = 1: nothing to capture; the response is scored from the prompt token alone."""
    model = tiny_model("qwen3_5")
    prompt, responses = make_group(VOCAB, 1, (6, 2))
    expected = standard_grads(model, prompt, responses, weighted_loss)
    model.zero_grad(set_to_none=True)
    group_backward(model, prompt, responses, weighted_loss)
    assert relative_error(grads_of(model), expected) < 1e-5


def test_gradient_checkpointing_keeps_prompt_state():
    model = tiny_model("qwen3_next")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    prompt, responses = make_group(VOCAB, 120, (7, 11))
    model.gradient_checkpointing_disable()
    expected = standard_grads(model, prompt, responses, weighted_loss)
    with torch.no_grad():
        expected_lp = full_log_probs(model, prompt, responses[0])[0]
    for reentrant in (False, True):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        assert model.training
        assert (group_log_probs(model, prompt, responses[:1]).log_probs[0] - expected_lp).abs().max() < 1e-5
        model.zero_grad(set_to_none=True)
        group_backward(model, prompt, responses, weighted_loss, knobs=Knobs(chunk_size=50))
        assert relative_error(grads_of(model), expected) < 1e-5


@pytest.mark.parametrize("family", ["glm_moe_dsa", "deepseek_v32"])
def test_sparse_dsa_selection_matches_full_forward(family):
    """GLM-MoE-DSA and DeepSeek-V3.2 (split-half rope in its indexer) with index_topk below the sequence length:
    replay selects the same keys, so log-probs and the exact gradient are the standard path's.

    Index scores are ReLU'd per indexer head, so with few heads many keys tie at exactly 0
    and top-k may break those ties differently for different query lengths (in the model
    itself too). Sixteen indexer heads make exact ties improbable.
    """
    model = tiny_model(family, index_topk=24, index_n_heads=16)
    prompt, responses = make_group(VOCAB, 60, (9, 4))
    lp = group_log_probs(model, prompt, responses, knobs=Knobs(chunk_size=25)).log_probs
    with torch.no_grad():
        expected = [full_log_probs(model, prompt, r)[0] for r in responses]
    assert max(float((a - b).abs().max()) for a, b in zip(lp, expected, strict=True)) < 1e-5
    reference = standard_grads(model, prompt, responses, weighted_loss)
    model.zero_grad(set_to_none=True)
    group_backward(model, prompt, responses, weighted_loss, knobs=Knobs(chunk_size=25))
    assert relative_error(grads_of(model), reference) < 1e-5


def test_shared_dsa_layers_keep_their_selection_under_checkpointing():
    """GLM-MoE-DSA with two indexer layers, each followed by a layer that reuses its selection ("shared"), and
    activation checkpointing: the backward recomputes the layers last to first, so the first shared layer is
    recomputed after the second indexer layer selected. It must still attend with the first indexer layer's keys
    (``mixers.mla.DsaSelections``): the gradient is the standard path's to the same 1e-7 as without checkpointing
    (float64 here). Before, it read the last selection made: a relative error of 0.2."""
    model = tiny_model("glm_moe_dsa", torch.float64, index_topk=24, index_n_heads=16, num_hidden_layers=4,
                       indexer_types=["full", "shared", "full", "shared"], mlp_layer_types=["dense"] * 4)
    prompt, responses = make_group(VOCAB, 60, (9, 4))
    reference = standard_grads(model, prompt, responses, weighted_loss)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.zero_grad(set_to_none=True)
    group_backward(model, prompt, responses, weighted_loss, knobs=Knobs(chunk_size=25))
    assert relative_error(grads_of(model), reference) < 1e-6


@pytest.fixture(scope="module")
def qwen3():
    return tiny_model("qwen3")


def _loss(i, lp):
    return -lp.sum()


BAD_INPUTS = [
    (dict(prompt_ids=torch.tensor([], dtype=torch.long)), "prompt_ids is empty"),
    (dict(prompt_ids=torch.ones(2, 3, dtype=torch.long)), "prompt_ids must be 1-D"),
    (dict(prompt_ids=torch.ones(4)), "prompt_ids must be a LongTensor"),
    (dict(prompt_ids=torch.tensor([1, VOCAB])), r"prompt_ids has token ids in \[1, 128\], outside"),
    (dict(responses=[torch.tensor([1]), torch.tensor([], dtype=torch.long)]), r"responses\[1\] is empty"),
    (dict(responses=[]), "responses must be a non-empty list"),
    (dict(responses=[torch.tensor([-1, 2])]), r"responses\[0\] has token ids"),
    (dict(responses=[torch.ones(4096, dtype=torch.long)]), "exceeds max_position_embeddings=4096"),
    (dict(chunk_size=0), "chunk_size must be a positive int"),
    (dict(prompt_grad="biased"), "prompt_grad must be one of"),
]


@pytest.mark.parametrize("override, message", BAD_INPUTS)
def test_bad_input_raises_clear_error(qwen3, override, message):
    args = dict(
        prompt_ids=torch.tensor([1, 2, 3]), responses=[torch.tensor([4, 5])], prompt_grad="exact", chunk_size=None
    )
    args.update(override)
    with pytest.raises(ValueError, match=message):
        group_backward(qwen3, args["prompt_ids"], args["responses"], _loss,
                       knobs=Knobs(prompt_grad=args["prompt_grad"], chunk_size=args["chunk_size"]))


BAD_KNOBS = [
    (dict(chunk_size=0), "chunk_size must be a positive int"),
    (dict(chunk_size=8.0), "chunk_size must be a positive int"),
    (dict(response_chunk_size=-1), "response_chunk_size must be a positive int"),
    (dict(min_shared_tokens=0), "min_shared_tokens must be a positive int"),
    (dict(replay_tokens=True), "replay_tokens must be a positive int"),
    (dict(prompt_grad="biased"), "prompt_grad must be one of"),
    (dict(state_grad_on_host=1), "state_grad_on_host must be True or False"),
]


@pytest.mark.parametrize("override, message", BAD_KNOBS)
def test_knobs_name_the_bad_field(override, message):
    """``Knobs`` refuses a bad value when built, naming the field; it is frozen (one value per call)."""
    with pytest.raises(ValueError, match=message):
        Knobs(**override)
    with pytest.raises(dataclasses.FrozenInstanceError):
        Knobs().chunk_size = 4


def test_entry_points_take_a_knobs_value(qwen3):
    """``knobs=`` is a ``Knobs``, not a mapping of its fields: a ValueError naming ``knobs`` otherwise."""
    prompt, responses = torch.tensor([1, 2, 3]), [torch.tensor([4, 5])]
    with pytest.raises(ValueError, match="knobs must be a verl_longstraw.Knobs"):
        group_log_probs(qwen3, prompt, responses, knobs={"chunk_size": 2})
    with pytest.raises(ValueError, match="knobs must be a verl_longstraw.Knobs"):
        tree_log_probs(qwen3, [torch.cat([prompt, responses[0]])], [3], knobs={"chunk_size": 2})


def test_group_walks_the_plan_passed_in(qwen3, monkeypatch):
    """``plan=`` (a ``star_plan`` of the group's lengths and knobs) is the plan walked, not built again, budget
    check included; one of other lengths or knobs is a ValueError naming ``plan``, before anything is computed."""
    prompt, responses = make_group(VOCAB, 40, (5, 7))
    knobs = Knobs(chunk_size=16)
    plan = star_plan(len(prompt), [len(r) for r in responses], knobs)
    own = group_log_probs(qwen3, prompt, responses, knobs=knobs).log_probs

    def no_build(*args, **kwargs):
        raise AssertionError("a plan passed in is built again")

    monkeypatch.setattr(api, "star_plan", no_build)
    given = group_log_probs(qwen3, prompt, responses, knobs=knobs, plan=plan).log_probs
    assert all(torch.equal(a, b) for a, b in zip(own, given, strict=True))
    qwen3.zero_grad(set_to_none=True)
    for other_responses, other_knobs in ((responses[:1], knobs), (responses, Knobs(chunk_size=8))):
        with pytest.raises(ValueError, match="plan is not plan.star_plan's"):
            group_backward(qwen3, prompt, other_responses, _loss, knobs=other_knobs, plan=plan)
    assert all(p.grad is None for p in qwen3.parameters())
    group_backward(qwen3, prompt, responses, _loss, knobs=knobs, plan=plan, memory_budget_bytes=2**40)
    assert any(p.grad is not None for p in qwen3.parameters())


def test_loss_fn_must_return_scalar(qwen3):
    with pytest.raises(ValueError, match="loss_fn must return a scalar"):
        group_backward(qwen3, torch.tensor([1, 2]), [torch.tensor([3, 4])], lambda i, lp: lp)


def test_unsupported_model_type_names_supported_ones():
    import transformers

    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=VOCAB)
    model = transformers.GPT2LMHeadModel(config)
    with pytest.raises(UnsupportedModelError, match=r"model_type 'gpt2' has no LongStraw adapter; supported: .*qwen3"):
        group_log_probs(model, torch.tensor([1, 2]), [torch.tensor([3])])


def test_unsupported_feature_is_refused():
    model = tiny_model("qwen3", attention_dropout=0.1)
    with pytest.raises(UnsupportedModelError, match="attention_dropout=0.1 in train mode"):
        group_log_probs(model, torch.tensor([1, 2]), [torch.tensor([3])])
    model.eval()  # dropout is off in eval mode, so the same model is fine there
    group_log_probs(model, torch.tensor([1, 2]), [torch.tensor([3])])


def test_granite_without_its_mamba_mixer_is_refused():
    """A Granite model whose linear-attention layer has no Mamba2 mixer (what transformers < 5.17 builds from these
    layer type names) or whose LM head has a bias (logits_scaling is applied before the head) is refused by field."""
    model = tiny_model("granitemoehybrid")
    model.lm_head.bias = torch.nn.Parameter(torch.zeros(VOCAB))
    with pytest.raises(UnsupportedModelError, match=r"lm_head.bias"):
        group_log_probs(model, torch.tensor([1, 2]), [torch.tensor([3])])
    model = tiny_model("granitemoehybrid")
    model.model.layers[0].mamba = None
    with pytest.raises(UnsupportedModelError, match=r"config.layer_types\[0\] is 'linear_attention'"):
        group_log_probs(model, torch.tensor([1, 2]), [torch.tensor([3])])


@pytest.mark.parametrize("family", ["qwen3", "qwen3_next", "deepseek_v3"])
@pytest.mark.parametrize("prompt_grad, chunk_size", [("exact", None), ("exact", 40), ("detached", 40)])
def test_shared_capture_equals_fresh_capture(family, prompt_grad, chunk_size):
    """One capture_prompt state serves group_log_probs and then group_backward (a training step's
    two passes) with the results of two fresh captures."""
    model = tiny_model(family)
    prompt, responses = make_group(VOCAB, 130, (11, 1, 30))
    expected_lp = group_log_probs(model, prompt, responses, knobs=Knobs(chunk_size=chunk_size)).log_probs
    model.zero_grad(set_to_none=True)
    group_backward(model, prompt, responses, weighted_loss, knobs=Knobs(prompt_grad=prompt_grad, chunk_size=chunk_size))
    expected = grads_of(model)

    state = capture_prompt(model, prompt, for_backward=prompt_grad == "exact", knobs=Knobs(chunk_size=chunk_size))
    lp = group_log_probs(model, prompt, responses, state=state, knobs=Knobs(chunk_size=chunk_size)).log_probs
    model.zero_grad(set_to_none=True)
    group_backward(model, prompt, responses, weighted_loss, state=state,
                   knobs=Knobs(prompt_grad=prompt_grad, chunk_size=chunk_size))
    assert all(torch.equal(a, b) for a, b in zip(lp, expected_lp, strict=True))
    assert relative_error(grads_of(model), expected) == 0.0


def test_shared_capture_mismatch_is_refused(qwen3):
    prompt, responses = make_group(VOCAB, 60, (5,))
    state = capture_prompt(qwen3, prompt, for_backward=False, knobs=Knobs(chunk_size=16))
    with pytest.raises(ValueError, match="this rank needs 58"):
        group_log_probs(qwen3, prompt[:-1], responses, state=state, knobs=Knobs(chunk_size=16))
    with pytest.raises(ValueError, match="captured with chunk_size=16, not 32"):
        group_log_probs(qwen3, prompt, responses, state=state, knobs=Knobs(chunk_size=32))
    with pytest.raises(ValueError, match="needs a state captured with for_backward=True"):
        group_backward(qwen3, prompt, responses, _loss, state=state, knobs=Knobs(chunk_size=16))


def test_every_family_builds_on_recent_transformers():
    """``tiny.unavailable`` skips a family only on a release older than ``EVERY_FAMILY_SINCE``, so a broken tiny
    config cannot pass as a skipped test on the releases CI and the GPU image run."""
    import transformers
    from packaging.version import Version

    from verl_longstraw.tiny import EVERY_FAMILY_SINCE, FAMILIES

    missing = {family: unavailable(family) for family in (*FAMILIES, *DENSE_VARIANTS, *VARIANTS)
               if unavailable(family)}
    if Version(transformers.__version__) >= Version(EVERY_FAMILY_SINCE):
        assert not missing
    else:
        assert set(missing) <= {"kimi_linear", "deepseek_v32", "nemotron_h"}, missing


def test_every_adapter_has_a_tiny_family_the_tests_run():
    """Each registered adapter class declares its own tiny models (``Adapter.tiny``), each building a model type the
    adapter serves; ``tiny.TINY_CONFIGS`` is all of them and exactly what the family-parametrized tests enumerate
    (``FAMILIES``, ``DENSE_VARIANTS``, ``VARIANTS``), so a new family is tested without a list to edit."""
    from verl_longstraw.adapters.base import registered_adapters
    from verl_longstraw.tiny import FAMILIES, TINY_CONFIGS

    assert sorted((*FAMILIES, *DENSE_VARIANTS, *VARIANTS)) == sorted(TINY_CONFIGS)
    for cls in registered_adapters():
        for family in cls.tiny:
            if unavailable(family) is None:
                assert tiny_config(family).model_type in cls.model_types, (cls.__name__, family)
    assert sum(len(cls.tiny) for cls in registered_adapters()) == len(TINY_CONFIGS)  # no family declared twice


def test_an_adapter_without_tiny_models_or_a_table_row_is_refused():
    """``register`` refuses a class that declares no tiny model or no docs row of its own (a base's do not count)."""
    from verl_longstraw.adapters.base import register
    from verl_longstraw.adapters.dense import DenseAttentionAdapter

    class Undeclared(DenseAttentionAdapter):
        model_types = ("not_a_model_type",)

    with pytest.raises(TypeError, match="Undeclared declares no tiny and no doc"):
        register(Undeclared)
    Undeclared.tiny = DenseAttentionAdapter.tiny
    with pytest.raises(TypeError, match="Undeclared declares no doc"):
        register(Undeclared)


def test_a_replay_frees_its_leaves_state_before_the_backward(monkeypatch):
    """A replayed leaf's segment state (each layer's new K/V rows) is never read. Under activation checkpointing
    nothing else holds it, so it must be gone when the replay's backward starts: at 64 layers and 8192 tokens that
    was 0.65 GiB of the 27B-class dry run's replay peak."""
    import weakref

    from verl_longstraw import execute

    model = tiny_model("qwen3", torch.float32)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    prompt, responses = make_group(VOCAB, 40, (6, 5))
    states: list[weakref.ref] = []
    alive_at_backward: list[int] = []
    run_segment, backward = execute.run_segment, torch.autograd.backward

    def recording_run_segment(*args, **kwargs):
        out = run_segment(*args, **kwargs)
        states.extend(weakref.ref(t) for layer in out.states for t in layer)
        return out

    def checking_backward(*args, **kwargs):
        alive_at_backward.append(sum(ref() is not None for ref in states))
        states.clear()
        return backward(*args, **kwargs)

    monkeypatch.setattr(execute, "run_segment", recording_run_segment)
    monkeypatch.setattr(execute.torch.autograd, "backward", checking_backward)
    group_backward(model, prompt, responses, weighted_loss, knobs=Knobs(prompt_grad="detached", replay_tokens=1))
    assert alive_at_backward == [0, 0]  # two replays (one response each), nothing of their states left
