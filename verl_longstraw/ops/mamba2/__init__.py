"""Mamba2's SSD scan (``mixers.mamba2``): ``ssd.py`` the model's chunked scan, its token-by-token reference and saved
bytes; ``cp.py`` its context-parallel form (an affine merge, a scalar decay per head)."""
