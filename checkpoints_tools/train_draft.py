"""Deprecated alias of :mod:`specjax.training.train_draft`, kept one release.

Importing it warns and hands back the new module itself (``sys.modules`` points this name
at it), so every public name resolves as before (its private helpers moved with the split
into the other modules of :mod:`specjax.training`).
"""

import sys
import warnings

from specjax.training import train_draft as _moved

warnings.warn(f"{__name__} moved to {_moved.__name__}; import it from there (the old path "
              "goes in the next release)", DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved
