"""Tensor ops used by the walk (capture, replay, recompute), one folder per op: ``attention``, ``gated_delta``, ``kda``,
``mamba2``, ``dsa``, ``mla``, ``causal_conv``. Each holds the op in one process (its fast path and the plain reference
beside it, what it saves), and its context-parallel form (``cp.py``); ``mixers`` binds each to a layer under the same
name."""
