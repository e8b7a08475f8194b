"""The arithmetic dtype of the package's ops and collectives, one home below ``ops`` and ``parallel``."""

from __future__ import annotations

import torch


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """What inputs of ``dtype`` are summed and accumulated in: float32 for half/bfloat16/float32, float64 for
    float64 (the attention ops' scores and partials, the collectives' gradient sums)."""
    return torch.promote_types(dtype, torch.float32)
