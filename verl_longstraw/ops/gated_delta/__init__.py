"""The gated delta rule (Gated DeltaNet, ``mixers.gated_delta``): ``rule.py`` the chunked rule (flash-linear-attention's
kernel or the plain chunked form), its token-by-token reference and saved bytes; ``cp.py`` its context-parallel form
(the affine merge, and the sequential chain it is checked against)."""
