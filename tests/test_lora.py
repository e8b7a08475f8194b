"""PEFT LoRA models (what veRL builds for ``lora_rank > 0``): exact gradients into the LoRA parameters through the
prompt state, the base frozen; reference log-probs with the adapters disabled; the private peft layout
``lora`` reads, pinned; the LoRA configurations the replay cannot reproduce refused by name."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers
from packaging.version import Version
from peft import LoraConfig, get_peft_model

from verl_longstraw import Knobs, UnsupportedModelError, group_backward, group_log_probs
from verl_longstraw.adapters import adapter_on_meta
from verl_longstraw.lora import linear_weights
from verl_longstraw.testing.compare import (
    full_log_probs,
    grads_of,
    make_group,
    relative_error,
    standard_grads,
    weighted_loss,
)
from verl_longstraw.tiny import REPRESENTATIVES, VARIANTS, VOCAB, tiny_config, tiny_model


def lora_model(family: str, **config):
    """A tiny ``family`` model under random-init LoRA adapters (B != 0, so they change the outputs)."""
    options = dict(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False) | config
    return get_peft_model(tiny_model(family), LoraConfig(**options)).train()


def max_log_prob_error(model, prompt, responses, **kwargs) -> float:
    values = group_log_probs(model, prompt, responses, **kwargs).log_probs
    with torch.no_grad():
        return max(float((v - full_log_probs(model, prompt, r)[0]).abs().max())
                   for v, r in zip(values, responses, strict=True))


# families whose all-linear peft refuses or the absorbed attention reads: the modules given instead
TARGETS = {
    "deepseek_v3": ["kv_b_proj", "q_b_proj", "o_proj"],  # kv_b_proj: read as a weight by the absorbed attention
    # peft refuses out_proj and conv1d of Mamba mixers by name, so "all-linear" cannot build a nemotron_h model
    "nemotron_h": ["in_proj", "q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj"],
}


def _linears(family: str) -> tuple[set[str], set[str]]:
    """The names (last component) of ``family``'s Linear modules but the LM head, and of the weights its ops read
    rather than call (``MixerOp.weights_read``, e.g. Mamba1's ``dt_proj``: refused for LoRA)."""
    adapter = adapter_on_meta(tiny_config(family))
    linear = {name.rsplit(".", 1)[-1] for name, module in adapter.model.named_modules()
              if isinstance(module, torch.nn.Linear) and name != "lm_head"}
    return linear, {name for op in adapter.ops for name in op.weights_read}


def lora_targets(family: str) -> str | list[str]:
    """``TARGETS[family]``, else every Linear but those the adapter refuses (``_linears``), else "all-linear"."""
    if family in TARGETS:
        return TARGETS[family]
    linear, read = _linears(family)
    return sorted(linear - read) if linear & read else "all-linear"


@pytest.mark.parametrize("family", ("qwen3", "qwen3_5", "deepseek_v3", *VARIANTS))
@pytest.mark.parametrize("chunk_size", [None, 32])
def test_lora_gradients_match_standard(family, chunk_size):
    """LoRA (``lora_targets``) on one family per adapter path and every other variant: log-probs, the set of
    parameters given a gradient and the gradients equal the standard path's."""
    if family == "glm4_moe" and Version(transformers.__version__) < Version("5.17.0"):
        pytest.skip("peft's all-linear wraps transformers 5.10's Glm4MoeTopkRouter, whose forward then reads "
                    "e_score_correction_bias off the wrapper: the model fails on either path")
    model = lora_model(family, target_modules=lora_targets(family))
    prompt, responses = make_group(VOCAB, 100, (9, 4, 1))
    assert max_log_prob_error(model, prompt, responses, knobs=Knobs(chunk_size=chunk_size)) < 1e-5
    expected = standard_grads(model, prompt, responses, weighted_loss)
    standard_with_grad = {n for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    group_backward(model, prompt, responses, weighted_loss, knobs=Knobs(chunk_size=chunk_size))
    with_grad = {n for n, p in model.named_parameters() if p.grad is not None}
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert with_grad == standard_with_grad and with_grad <= trainable  # the parameters the standard path trains
    assert all(".lora_" in n for n in trainable) and all(".lora_" in n for n in with_grad)  # the base is frozen
    if family != "deepseek_v32":
        assert with_grad == trainable
    assert relative_error(grads_of(model), expected) < 1e-5


def test_reference_log_probs_with_the_adapters_disabled():
    """veRL's reference log-probs of a LoRA actor run under ``disable_adapter()``: the base model's values."""
    model = lora_model("qwen3_5")
    prompt, responses = make_group(VOCAB, 60, (7, 3))
    base = tiny_model("qwen3_5")
    with model.disable_adapter():
        disabled = group_log_probs(model, prompt, responses, knobs=Knobs(chunk_size=16)).log_probs
    adapted = group_log_probs(model, prompt, responses, knobs=Knobs(chunk_size=16)).log_probs
    with torch.no_grad():
        reference = [full_log_probs(base, prompt, r)[0] for r in responses]
    assert max(float((a - b).abs().max()) for a, b in zip(disabled, reference, strict=True)) < 1e-5
    assert min(float((a - b).abs().max()) for a, b in zip(adapted, reference, strict=True)) > 1e-3


def test_linear_weights_is_what_the_layer_applies():
    """``linear_weights`` of a peft LoRA Linear: base + scaling x B @ A while active (gradients reach A and B),
    the base weight while disabled or merged; an nn.Linear's own weight."""
    model = lora_model("deepseek_v3", target_modules=["kv_b_proj"])
    layer = model.get_base_model().model.layers[0].self_attn.kv_b_proj
    x = torch.randn(5, layer.in_features)
    weight, bias = linear_weights(layer)
    torch.testing.assert_close(F.linear(x, weight, bias), layer(x), rtol=1e-6, atol=1e-5)
    weight.sum().backward()
    assert layer.lora_A["default"].weight.grad is not None and layer.lora_B["default"].weight.grad is not None
    with model.disable_adapter():
        assert linear_weights(layer)[0] is layer.get_base_layer().weight
        torch.testing.assert_close(F.linear(x, *linear_weights(layer)), layer(x), rtol=0, atol=0)
    layer.merge()
    torch.testing.assert_close(F.linear(x, *linear_weights(layer)), layer(x), rtol=1e-6, atol=1e-5)
    plain = torch.nn.Linear(3, 2)
    assert linear_weights(plain) == (plain.weight, plain.bias)
    half = get_peft_model(tiny_model("deepseek_v3", dtype=torch.bfloat16),
                          LoraConfig(r=4, target_modules=["kv_b_proj"]))
    layer = half.get_base_model().model.layers[0].self_attn.kv_b_proj
    assert layer.lora_A["default"].weight.dtype == torch.float32  # peft keeps its adapters in float32
    assert linear_weights(layer)[0].dtype == torch.bfloat16 == layer(x.bfloat16()).dtype


REFUSED = {
    "lm_head": (dict(target_modules=["q_proj", "lm_head"]), "LoRA on lm_head"),
    "conv1d": (dict(target_modules=["conv1d"], r=128), "LoRA on model.layers.0.linear_attn.conv1d"),  # r % groups
    "dropout": (dict(lora_dropout=0.1), "lora_dropout=0.1"),
    "dora": (dict(use_dora=True, target_modules=["q_proj"]), "use_dora"),
}


@pytest.mark.parametrize("name", REFUSED)
def test_lora_the_replay_cannot_reproduce_is_refused(name):
    config, message = REFUSED[name]
    model = lora_model("qwen3_5", **config)
    prompt, responses = make_group(VOCAB, 20, (3,))
    with pytest.raises(UnsupportedModelError, match=message):
        group_backward(model, prompt, responses, weighted_loss)
    assert all(p.grad is None for p in model.parameters())


def test_lora_on_the_short_conv_is_refused():
    """lfm2's short conv runs on its depthwise ``conv`` weight (``mixers.ShortConv``): LoRA there is refused by name
    (peft builds it where the rank is a multiple of the conv's groups, the channels)."""
    model = lora_model("lfm2", target_modules=["conv.conv"], r=64)
    prompt, responses = make_group(VOCAB, 20, (3,))
    with pytest.raises(UnsupportedModelError, match="LoRA on model.layers.0.conv.conv"):
        group_backward(model, prompt, responses, weighted_loss)


def _linears_read_as_weights() -> list[tuple[str, str]]:
    """(family, name) of each Linear an adapter's op reads as a weight (``_linears``; jamba's Mamba1 multiplies by
    ``dt_proj``'s weight, as the model's torch path does), one family per adapter."""
    return [(family, name) for family in REPRESENTATIVES for name in sorted(set.intersection(*_linears(family)))]


@pytest.mark.parametrize("family, name", _linears_read_as_weights())
def test_lora_on_a_linear_read_as_a_weight_is_refused(family, name):
    """LoRA on such a Linear is refused by name (so ``all-linear`` is too: ``lora_targets`` leaves it out)."""
    model = lora_model(family, target_modules=[name])
    prompt, responses = make_group(VOCAB, 20, (3,))
    with pytest.raises(UnsupportedModelError, match=rf"LoRA on model\.layers\.\d+\.\w+\.{name}"):
        group_backward(model, prompt, responses, weighted_loss)


def test_estimate_counts_frozen_base_without_gradients():
    """The estimate's parameter counts of a LoRA model (the engine's ``count_units``, and ``parameter_counts``
    of a config under ``Lora``, as the recipe tables build it): gradients and optimizer state for the adapters only."""
    from verl_longstraw.model_terms import Lora, count_units, parameter_counts, unsharded_bytes
    from verl_longstraw.tiny import tiny_config

    model = lora_model("qwen3_5")
    counts = count_units(model)
    adapters = sum(p.numel() for n, p in model.named_parameters() if ".lora_" in n)
    assert counts.total == sum(p.numel() for p in model.parameters())
    assert counts.trainable.total == adapters < counts.total // 4
    params, grads = unsharded_bytes(counts, 1, torch.bfloat16, torch.float32, training=True)
    assert (params, grads) == (2 * counts.total, (2 + 4) * adapters)
    planned = parameter_counts(tiny_config("qwen3_5"), Lora(4, "all-linear"))
    assert (planned.total, planned.trainable.total) == (counts.total, adapters)
    assert parameter_counts(tiny_config("qwen3_5")).trainable.total == count_units(tiny_model("qwen3_5")).total
