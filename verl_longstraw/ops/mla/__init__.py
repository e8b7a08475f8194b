"""Multi-head latent attention (``mixers.mla``): it runs in absorbed form on the attention op (``ops.attention``, one
shared key head of the latent); ``reference.py`` is the plain form it is checked against, K/V decompressed per head.
DSA's key selection is ``ops.dsa``."""
