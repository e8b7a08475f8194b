"""Mamba1's selective scan (Jamba's Mamba layers): the model's token loop, its plain reference and saved bytes
(``scan``), its context-parallel form (``cp``); bound to a layer by ``mixers.mamba1``."""
