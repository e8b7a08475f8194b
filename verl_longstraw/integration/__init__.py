"""veRL 0.9.1 integration: the `longstraw` engine backend, its config, a CPU platform and a trainer mode.

Imported by veRL through the `verl.plugins` entry point (``plugin``); the core package never imports it.
"""
