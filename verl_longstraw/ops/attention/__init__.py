"""Softmax attention of a segment over its prefix rows and its own keys: ``prefix.py`` the op in one process (its
dispatch by shape, ``attention_path``; the plain reference; each path's saved bytes), ``fused.py`` the flash kernels,
``blocked.py`` the blocked online softmax, ``window.py`` sliding windows and learned sinks, ``cp.py`` pass-Q over a
context-parallel group (its path, ``sharded_attention_path``, its saves, transients and collectives)."""
