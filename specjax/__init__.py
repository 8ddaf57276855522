"""specjax: lossless speculative decoding in JAX.

The public API::

    model = specjax.load("smollm2-135m")
    result = specjax.generate(model, "def add(a, b):", max_new_tokens=64)
    result = specjax.generate(model, "def add(a, b):", method="tree", tree_budget=8)
    result = specjax.generate(model, "def add(a, b):",
                              method=specjax.StagedOptions(tree_budget=8))
"""

from specjax.api import GenerationResult, generate, stream_generate
from specjax.config import ModelConfig, from_hf_config
from specjax.errors import (CheckpointError, InvalidArgumentError, ModelNotFoundError,
                            NumericalError, SpecjaxError)
from specjax.loading import load
from specjax.methods import (ArOptions, MethodOptions, NgramOptions, SpecOptions,
                             StagedOptions, TreeOptions)
from specjax.model import Model

__version__ = "0.1.0"

__all__ = [
    "ArOptions", "CheckpointError", "GenerationResult", "InvalidArgumentError",
    "MethodOptions", "Model", "ModelConfig", "ModelNotFoundError", "NgramOptions",
    "NumericalError", "SpecOptions", "SpecjaxError", "StagedOptions", "TreeOptions",
    "from_hf_config", "generate", "load", "stream_generate",
]
