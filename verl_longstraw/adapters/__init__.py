"""Architecture adapters, one module per family; importing this package registers them all."""

from . import bamba, dense, gpt_oss, granite, hybrid, jamba, kda, lfm2, mamba2, mla  # noqa: F401  (registration)
from .base import Adapter, adapter_for, adapter_on_meta, model_on_meta, supported_model_types

__all__ = ["Adapter", "adapter_for", "adapter_on_meta", "model_on_meta", "supported_model_types"]
