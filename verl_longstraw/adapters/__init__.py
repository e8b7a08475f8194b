"""Architecture adapters, one module per family; importing this package registers them all."""

from . import bamba, deepseek, dense, gpt_oss, granite, jamba, kimi_linear, lfm2, nemotron_h, qwen3_next  # noqa: F401  (registration)
from .base import Adapter, adapter_for, adapter_on_meta, model_on_meta, supported_model_types

__all__ = ["Adapter", "adapter_for", "adapter_on_meta", "model_on_meta", "supported_model_types"]
