"""Kimi Delta Attention (``mixers.kda``): ``rule.py`` the model's chunked rule, its token-by-token reference and saved
bytes; ``cp.py`` its context-parallel form (the gated delta rule's affine merge)."""
