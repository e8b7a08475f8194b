"""Mamba1's selective scan: the model's token loop (``selective_scan``), its plain reference, its saved bytes
(``scan``) and its context-parallel form (``sharded``)."""

from .scan import scan_decay, selective_scan, selective_scan_reference, selective_scan_saved_bytes
from .sharded import sharded_selective_scan

__all__ = ["scan_decay", "selective_scan", "selective_scan_reference", "selective_scan_saved_bytes",
           "sharded_selective_scan"]
