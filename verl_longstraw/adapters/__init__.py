"""Architecture adapters, one module per family; importing this package registers them all.

The modules are imported in the order the families landed, which is the registry's order (``base.registered_adapters``:
the docs table, ``tiny.VARIANTS``, gpu_check's newest-first cases): a new family appends its import.
"""
# isort: skip_file

from . import (  # noqa: F401  (registration)
    dense, qwen3_next, deepseek, nemotron_h, kimi_linear, gpt_oss, granite, bamba, lfm2, jamba,
)
from .base import Adapter, adapter_for, adapter_on_meta, model_on_meta, supported_model_types

__all__ = ["Adapter", "adapter_for", "adapter_on_meta", "model_on_meta", "supported_model_types"]
