"""Architecture adapters, one module per family; importing this package registers them all."""

from . import dense, hybrid, mla  # noqa: F401  (registration)
from .base import Adapter, adapter_for, supported_model_types

__all__ = ["Adapter", "adapter_for", "supported_model_types"]
