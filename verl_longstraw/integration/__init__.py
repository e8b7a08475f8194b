"""veRL 0.9.1 integration: the `longstraw` engine backend, its config, a CPU platform and a trainer mode.

veRL imports ``plugin`` through the `verl.plugins` entry point; the core package never imports this one.
Importing any module of it first imports veRL (which loads the entry point while none of this
package's modules is half-initialized) and then ``plugin`` itself (for processes where
``VERL_USE_EXTERNAL_PLUGINS`` leaves it out), so the engine is registered whatever is imported first.
"""

import verl  # noqa: F401  (loads the verl.plugins entry point)

from . import plugin  # noqa: F401  (registers the platform, engine and trainer mode; idempotent)
