"""specjax: lossless speculative decoding in JAX.

The public API::

    model = specjax.load("smollm2-135m")
    result = specjax.generate(model, "def add(a, b):", max_new_tokens=64)
    result = specjax.generate(model, "def add(a, b):", method="tree", tree_budget=8)
    result = specjax.generate(model, "def add(a, b):",
                              method=specjax.StagedOptions(tree_budget=8))

The names below load on first use (PEP 562), so that ``import specjax.launch`` (the
``specjax`` command) can take over Ctrl-C before jax is imported.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

# Public name -> the module that defines it.
_EXPORTS = {
    "GenerationResult": "specjax.api", "generate": "specjax.api",
    "stream_generate": "specjax.api",
    "ModelConfig": "specjax.config", "from_hf_config": "specjax.families",
    "CheckpointError": "specjax.errors", "InvalidArgumentError": "specjax.errors",
    "ModelNotFoundError": "specjax.errors", "NumericalError": "specjax.errors",
    "SpecjaxError": "specjax.errors", "PerformanceWarning": "specjax.errors",
    "load": "specjax.api",
    "BatchOptions": "specjax.batch_options", "KernelOptions": "specjax.kernel_options",
    "ArOptions": "specjax.methods", "MethodOptions": "specjax.methods",
    "NgramOptions": "specjax.methods", "SpecOptions": "specjax.methods",
    "StagedOptions": "specjax.methods", "TreeOptions": "specjax.methods",
    "Model": "specjax.loaded_model",
    "JsonSchema": "specjax.constraints", "Regex": "specjax.constraints",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from specjax.api import GenerationResult, generate, stream_generate
    from specjax.api import load
    from specjax.batch_options import BatchOptions
    from specjax.config import ModelConfig
    from specjax.constraints import JsonSchema, Regex
    from specjax.errors import (CheckpointError, InvalidArgumentError, ModelNotFoundError,
                                NumericalError, PerformanceWarning, SpecjaxError)
    from specjax.families import from_hf_config
    from specjax.kernel_options import KernelOptions
    from specjax.loaded_model import Model
    from specjax.methods import (ArOptions, MethodOptions, NgramOptions, SpecOptions,
                                 StagedOptions, TreeOptions)


def __getattr__(name: str):
    """A public name, or a submodule (``specjax.loading``), imported on first use."""
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
    else:
        try:
            value = importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as error:
            if error.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module 'specjax' has no attribute {name!r}") from None
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
