"""Model families: one module each, registered in :data:`FAMILIES`.

A family module holds everything that names its family: the Hugging Face ``model_type``
values it reads, its Hugging Face config in (:func:`from_hf_config`) and out
(:func:`to_hf_config`), its checkpoints' key rules (:mod:`specjax.families.rules`, applied
by :mod:`specjax.checkpoints_tools.keymap`), its GGUF architectures with their tensor names
and metadata (read by :mod:`specjax.checkpoints_tools.gguf_loader`), and the features of
:class:`~specjax.config.ModelConfig` it switches on for the shared decoder
(:mod:`specjax.models.decoder`). Its module-level ``FAMILY`` (a
:class:`~specjax.families.common.Family`) is what the registry reads; code outside the
family modules dispatches through the registry and never on a family's name.

Adding a family whose features the decoder has is one new module here, its import and its
entry in :data:`FAMILIES` below, and its tests.
"""

from __future__ import annotations

from typing import Any, Mapping

from specjax.config import ModelConfig
from specjax.errors import InvalidArgumentError
from specjax.families import bigcode, cohere, extended, gpt2, llama, neox, phi, starcoder2
from specjax.families.common import Family

# The registry, in the order the unsupported-model_type message lists the families.
FAMILIES: tuple[Family, ...] = tuple(module.FAMILY for module in (
    gpt2, bigcode, neox, phi, starcoder2, cohere, llama, extended))

_BY_MODEL_TYPE = {model_type: family for family in FAMILIES for model_type in family.model_types}
_BY_CONFIG = {name: family for family in FAMILIES for name in family.configs}
# Model types whose checkpoints' auto_map is ignored (see Family.native_despite_auto_map).
NATIVE_DESPITE_AUTO_MAP = frozenset(
    model_type for family in FAMILIES for model_type in family.native_despite_auto_map)


def family_of(config: ModelConfig) -> Family:
    """The family that wrote ``config`` (by ``config.family``, else its architecture).

    Raises:
      InvalidArgumentError: no family registers it.
    """
    family = _BY_CONFIG.get(config.family or config.architecture)
    if family is None:
        raise InvalidArgumentError(f"no model family registers family {config.family!r}")
    return family


def from_hf_config(cfg: Mapping[str, Any] | Any) -> ModelConfig:
    """Builds a :class:`~specjax.config.ModelConfig` from a Hugging Face config (a dict or a
    ``transformers`` config object).

    Raises:
      InvalidArgumentError: the model type is not supported, or the config describes what
        its family does not run.
    """
    if not isinstance(cfg, Mapping):
        cfg = cfg.to_dict()
    model_type = cfg.get("model_type")
    family = _BY_MODEL_TYPE.get(model_type)
    if family is None:
        *names, last = _BY_MODEL_TYPE
        raise InvalidArgumentError(
            f"unsupported model_type {model_type!r}; specjax supports {', '.join(names)} "
            f"and {last}")
    config = family.from_hf(model_type, cfg)
    # A family may hand back the config of the model it wraps (a multimodal checkpoint's
    # text tower): that config is read in turn.
    return config if isinstance(config, ModelConfig) else from_hf_config(config)


def to_hf_config(config: ModelConfig) -> dict[str, Any]:
    """A Hugging Face ``config.json`` dict describing the same model as ``config`` (what
    :func:`from_hf_config` reads back to an equal config).

    Raises:
      InvalidArgumentError: ``config`` is a feature draft or has a reduced-vocabulary head,
        which have no Hugging Face equivalent.
    """
    if config.feature_input or config.draft_vocab_size:
        raise InvalidArgumentError(
            "a feature draft or a reduced-vocabulary head has no Hugging Face equivalent")
    return family_of(config).to_hf(config)
