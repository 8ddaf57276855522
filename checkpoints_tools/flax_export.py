"""Writes a Flax model or training state as a specjax checkpoint (the format of
:mod:`specjax.checkpoints_tools.orbax_io`): the loaders' side of :mod:`specjax.flax_modules`.

>>> from specjax.checkpoints_tools.flax_export import save_for_specjax
>>> save_for_specjax("ckpt", module)          # then specjax.load("ckpt")
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from specjax.checkpoints_tools.orbax_io import save_orbax
from specjax.config import ModelConfig
from specjax.flax_modules import flax_params, tokenizer_of


def save_for_specjax(path: str | os.PathLike, source: Any, config: ModelConfig | None = None,
                     tokenizer: Any = None) -> Path:
    """Writes a Flax model or training state as a checkpoint :func:`specjax.load` reads.

    The directory holds ``specjax_config.json`` and the parameter tree under ``params/``
    (orbax ``StandardCheckpointer``), plus the tokenizer's files when one is given: the
    format of :mod:`specjax.checkpoints_tools.orbax_io`. Only parameters are written
    (no optimizer state).

    Args:
      path: a directory that does not exist yet or is empty.
      source, config: see :func:`specjax.flax_modules.flax_params`.
      tokenizer: a transformers tokenizer to store alongside; default: that of the model
        :func:`~specjax.flax_modules.to_flax` made ``source`` from (an NNX module, or the
        linen module), if any.
    Returns:
      The checkpoint directory as an absolute path.
    """
    if tokenizer is None:
        tokenizer = tokenizer_of(source)
    config, params = flax_params(source, config)
    return save_orbax(path, config, params, tokenizer)
