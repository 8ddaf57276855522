"""Deprecated alias of :mod:`specjax.training.sample_corpus`, kept one release.

Importing it warns and hands back the new module itself (``sys.modules`` points this name
at it), so every name, private ones included, resolves as before.
"""

import sys
import warnings

from specjax.training import sample_corpus as _moved

warnings.warn(f"{__name__} moved to {_moved.__name__}; import it from there (the old path "
              "goes in the next release)", DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved
