"""specjax: lossless speculative decoding in JAX.

The public API::

    model = specjax.load("smollm2-135m")
    result = specjax.generate(model, "def add(a, b):", max_new_tokens=64)
"""

from specjax.api import GenerationResult, Model, generate, load, stream_generate
from specjax.config import ModelConfig, from_hf_config
from specjax.errors import (CheckpointError, InvalidArgumentError, ModelNotFoundError,
                            NumericalError, SpecjaxError)

__version__ = "0.1.0"

__all__ = [
    "CheckpointError", "GenerationResult", "InvalidArgumentError", "Model", "ModelConfig",
    "ModelNotFoundError", "NumericalError", "SpecjaxError", "from_hf_config", "generate",
    "load", "stream_generate",
]
