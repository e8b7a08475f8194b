"""PEFT LoRA models (veRL's ``actor_rollout_ref.model.lora_rank > 0``): the one module that reads peft's layout.

The adapters run a LoRA model through its own modules, so every LoRA layer they call (``q_proj(x)`` ...) applies
its adapters, or not while veRL's ``disable_adapter()`` is active (reference log-probs). Three things need peft's
attributes, all here (``tests/test_lora.py`` pins them): the model under the ``PeftModel`` wrapper
(``base_model``), the weight a LoRA Linear applies where an adapter reads a weight instead of calling the layer
(``linear_weights``: MLA's absorbed ``kv_b_proj``), and the LoRA configurations the replay cannot reproduce
exactly (``check_lora``: e.g. LoRA on the LM head, whose weight the chunked scoring reads).
"""

from __future__ import annotations

import torch
from torch import nn

from .errors import UnsupportedModelError


def base_model(model: nn.Module) -> nn.Module:
    """The transformers model inside a ``peft.PeftModel`` (its LoRA layers injected in place), else ``model``."""
    return model.get_base_model() if hasattr(model, "peft_config") and hasattr(model, "get_base_model") else model


def is_lora_layer(module: nn.Module) -> bool:
    """Whether ``module`` is a peft LoRA layer (it wraps a ``base_layer`` with ``lora_A`` / ``lora_B``)."""
    return hasattr(module, "lora_A") and hasattr(module, "base_layer")


def linear_weights(linear: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight [out, in], bias [out] or None) that ``linear(x)`` applies: an ``nn.Linear``'s own; a peft LoRA
    Linear's base weight plus each active adapter's scaling x B @ A (differentiable in A and B), none while its
    adapters are disabled or merged into the base weight; in the base weight's dtype, as peft's forward returns
    the base layer's (its adapters stay float32 on a half-precision base: ``autocast_adapter_dtype``)."""
    if not is_lora_layer(linear):
        return linear.weight, linear.bias
    base = linear.get_base_layer()
    weight = base.weight
    if not (linear.disable_adapters or linear.merged):
        for name in linear.active_adapters:
            if name in linear.lora_A:
                weight = weight + linear.get_delta_weight(name)
    return weight.to(base.weight.dtype), base.bias  # peft's float32 adapters on a half base: the base's dtype


def check_lora(model: nn.Module, weights_read: tuple[str, ...]) -> None:
    """UnsupportedModelError for LoRA layers of ``model`` the replay cannot reproduce exactly, naming the field:

    - LoRA on a module whose weight an adapter reads without calling it or ``linear_weights`` (its
      ``weights_read``, e.g. Gated DeltaNet's ``conv1d``), or on a parameter (``target_parameters``) of a
      module whose forward the adapter does not call (anything outside the MLP/MoE blocks);
    - dropout on the adapters' input in train mode (``lora_dropout``: the two paths would draw different masks);
    - DoRA (``use_dora``), whose magnitude ``linear_weights`` does not compute.
    """
    for name, module in base_model(model).named_modules():
        if not is_lora_layer(module):
            continue
        on_parameter = hasattr(module, "parameter_name")  # peft's ParamWrapper: LoRA on an nn.Parameter
        if name.rsplit(".", 1)[-1] in weights_read or (on_parameter and ".mlp" not in f".{name}"):
            raise UnsupportedModelError(
                f"LoRA on {name}: LongStraw does not run that module's forward; leave it out of "
                "actor_rollout_ref.model.target_modules / target_parameters (or list it in exclude_modules)"
            )
        for adapter, dropout in module.lora_dropout.items():
            if model.training and isinstance(dropout, nn.Dropout) and dropout.p > 0:
                raise UnsupportedModelError(
                    f"LoRA adapter {adapter!r} on {name}: lora_dropout={dropout.p} in train mode; replay computes "
                    "without dropout. Set lora_dropout=0."
                )
            if module.use_dora.get(adapter, False):
                raise UnsupportedModelError(f"LoRA adapter {adapter!r} on {name}: use_dora is not supported")
