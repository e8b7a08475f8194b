"""The causal depthwise convolution in front of Gated DeltaNet, KDA and Mamba2 and in lfm2's short conv:
``conv.py`` in one process (the inputs before the segment from the conv state, the conv), ``cp.py`` over a sequence
split across a context-parallel group (each rank reads the last inputs of the ranks before it). A layer composes it
as ``mixers.causal_conv.CausalConv``."""
