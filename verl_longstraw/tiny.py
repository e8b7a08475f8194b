"""Tiny random-init models of every supported family, built from transformers configs (no hub).

Used by the tests, the benchmarks, the CPU examples and ``python -m verl_longstraw.profile --model tiny:<family>``;
each family's model is declared by its adapter (``Adapter.tiny``) and collected in ``TINY_CONFIGS``.
"""

from __future__ import annotations

import copy
import functools
from typing import Callable

import torch
import transformers

from .adapters import adapter_on_meta
from .adapters.base import TINY_COMMON, TinyModel, registered_adapters
from .mixers import MixerOp

VOCAB = TINY_COMMON["vocab_size"]

# family -> its tiny model, as each adapter declares them (``Adapter.tiny``), in the registry's order. Config class
# names, not classes: a release without the class (kimi_linear and deepseek_v32 in 5.10) still imports this module,
# and ``unavailable`` reports the family.
TINY_CONFIGS: dict[str, TinyModel] = {family: model for cls in registered_adapters()
                                      for family, model in cls.tiny.items()}
# one family per adapter class, its first tiny model: what the per-adapter tests run
REPRESENTATIVES: tuple[str, ...] = tuple(next(iter(cls.tiny)) for cls in registered_adapters())


def tiny_config(family: str, **overrides) -> transformers.PretrainedConfig:
    """Config of a 2-4 layer model of ``family`` (hidden 64, vocab 128; ``TINY_CONFIGS``); ``overrides`` set config
    fields."""
    config = _base_config(family)
    for key, value in overrides.items():
        setattr(config, key, value)
    return use_reference_kernels(config)


def use_reference_kernels(config: transformers.PretrainedConfig) -> transformers.PretrainedConfig:
    """Set the attention and MoE kernels the standard path is compared with; returns ``config``."""
    # transformers 5.10 GLM-MoE-DSA drops the causal mask under sdpa (attends to future tokens): eager there.
    # gpt-oss's sinks: eager (SDPA takes no sink logits)
    config._attn_implementation = "eager" if config.model_type in ("glm_moe_dsa", "gpt_oss") else "sdpa"
    config._experts_implementation = "eager"  # CPU grouped-mm rejects float64
    return config


def _base_config(family: str) -> transformers.PretrainedConfig:
    """``TINY_CONFIGS[family]`` built (AttributeError where the installed transformers lacks its class)."""
    if family not in TINY_CONFIGS:
        raise ValueError(f"unknown tiny family {family!r}; known: {', '.join(TINY_CONFIGS)}")
    model = TINY_CONFIGS[family]
    return getattr(transformers, model.config_class)(**copy.deepcopy(model.fields))  # configs keep the lists given


FAMILIES = ("qwen3", "qwen3_next", "qwen3_5", "deepseek_v3", "glm_moe_dsa")  # one per adapter path
DENSE_VARIANTS = ("llama", "qwen2", "mistral")  # the other dense GQA model types
# every other tiny family (MoE variants of the dense and hybrid adapters, DeepSeek-V3.2, and one or more per hybrid
# adapter), in the registry's order: a family an adapter declares joins the tests that run VARIANTS by itself
VARIANTS = tuple(family for family in TINY_CONFIGS if family not in FAMILIES + DENSE_VARIANTS)


@functools.cache
def unavailable(family: str) -> str | None:
    """Why the installed transformers cannot build ``family``'s tiny model or its adapter serve it, None where it
    can: its config class is absent (kimi_linear, deepseek_v32 in 5.10), refuses the fields of the releases the
    adapter serves (nemotron_h's layer types in 5.10) or builds a model the adapter refuses (granitemoehybrid in
    5.10: other layer type names, no mamba2_chunk_scan). The tests skip such a family with this reason; from
    ``EVERY_FAMILY_SINCE`` on every family builds (``tests/test_core_contract.py``)."""
    try:
        adapter_on_meta(_base_config(family))
    except Exception as error:  # AttributeError: no such class; huggingface_hub's validation error (not a ValueError);
        # UnsupportedModelError: the adapter's refusal
        reason = " ".join(str(error).split())  # one line (validation errors span several)
        return f"transformers {transformers.__version__} cannot build {family} ({type(error).__name__}: {reason})"[:300]
    return None


EVERY_FAMILY_SINCE = "5.17.0"  # the oldest release tested with every tiny family (the GPU image's)


def tiny_model(family: str, dtype: torch.dtype = torch.float32, seed: int = 0, **overrides):
    """A random-init causal LM of ``family`` in train mode, eager attention, eager experts, its weights in ``dtype``
    as transformers builds them (from 5.2x the routers of the DeepSeek-style MoE families stay float32: their
    ``_keep_in_fp32_modules_strict``), except that every parameter of a float64 model is float64: the float64
    comparisons (``testing.compare.float64_throughout``) widen what the parameters meet, and autograd refuses a
    float64 gradient for a float32 leaf. (Buffers stay as built: the mode widens their reads.)"""
    config = tiny_config(family, **overrides)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    if dtype == torch.float64:
        for param in model.parameters():
            param.data = param.data.to(torch.float64)
    return model.train()



def mixer_class(op: MixerOp) -> type[MixerOp]:
    """The ``verl_longstraw.mixers`` class ``op`` is (an adapter's subclass naming its modules counts as its base)."""
    return next(cls for cls in type(op).__mro__ if cls.__module__.startswith("verl_longstraw.mixers"))


def first_layer_of_each_op(
    keep: Callable[[MixerOp], bool] = lambda op: True,
) -> dict[str, tuple[str, int]]:
    """Mixer class name -> (family, layer index) of its first layer that ``keep`` accepts, over the tiny families the
    installed transformers builds, ``FAMILIES`` first, then ``DENSE_VARIANTS`` and ``VARIANTS``: each op class a
    family declares appears once, so the per-op tests take a new family's new op without a list to edit."""
    cases: dict[str, tuple[str, int]] = {}
    for family in (*FAMILIES, *DENSE_VARIANTS, *VARIANTS):
        if unavailable(family) is not None:
            continue
        for idx, op in enumerate(adapter_on_meta(tiny_config(family)).ops):
            if keep(op):
                cases.setdefault(mixer_class(op).__name__, (family, idx))
    return cases
