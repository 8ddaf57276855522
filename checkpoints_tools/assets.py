"""Validation of a shipped draft asset (``draft.json`` + ``draft.safetensors``).

:func:`~specjax.checkpoints_tools.sources.save_draft_asset` writes a draft that shares its
target's embedding as two files:

- ``draft.json``: ``num_layers``, ``embed_fingerprint`` (16 hex digits), ``head_tokens``
  (``null`` or the number of head-subset ids), ``base_config`` (the target's
  ``hidden_size`` and ``vocab_size``), optional ``feature_input`` (``true`` for a feature
  draft, :mod:`~specjax.training.feature_draft`: its tensors include ``fc``),
  optional ``feature_layers`` (the target blocks a multi-layer feature draft reads,
  :mod:`~specjax.training.eagle3`: its tensors include ``feature_fc``), optional
  ``draft_vocab_size`` (a head of its own over that many ids: tensors ``draft_head`` and
  the int32 map ``draft_vocab``), and free-form provenance;
- ``draft.safetensors``: the draft's own parameters, float16, named by their path in the
  parameter tree (``final_norm``, ``layers.wq`` ...), without ``embed`` and ``lm_head``
  (they come from the target), plus an optional int32 ``head_tokens``: sorted, distinct
  ids in ``[0, V)``; ``draft_vocab`` (int32, distinct ids in ``[0, V)``) is the one
  integer parameter.

:func:`check_draft_asset` checks both against the target before a model is built from
them, so a damaged or mismatched asset fails in one line naming the file and the problem.
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from specjax.config import ModelConfig
from specjax.errors import CheckpointError, InvalidArgumentError
from specjax.models import param_shapes

DRAFT_TENSORS = "draft.safetensors"
DRAFT_CONFIG = "draft.json"
HEAD_TOKENS = "head_tokens"
# Parameters the draft takes from its target instead of storing them.
SHARED = ("embed", "lm_head")
_FINGERPRINT = re.compile(r"^[0-9a-f]{16}$")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def flatten_tree(tree: dict, prefix: str = "") -> dict:
    """``{"a": {"b": x}}`` -> ``{"a.b": x}``: the tensor names a draft asset stores."""
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(flatten_tree(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def expected_draft_tensors(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor a draft asset stores for a draft of ``config``."""
    return {name: tuple(shape) for name, shape in flatten_tree(param_shapes(config)).items()
            if name not in SHARED}


# The integer parameter of a reduced-vocabulary head (every other stored tensor is float16).
DRAFT_VOCAB = "draft_vocab"


def draft_config(target_config: ModelConfig, record: Mapping[str, Any]) -> ModelConfig:
    """The config of the draft a (checked) ``draft.json`` describes for ``target_config``."""
    return dataclasses.replace(target_config, num_layers=record["num_layers"],
                               feature_input=bool(record.get("feature_input", False)),
                               feature_layers=tuple(record.get("feature_layers") or ()),
                               draft_vocab_size=int(record.get("draft_vocab_size") or 0))


def check_draft_asset(directory: str | os.PathLike, record: Any, tensors: Mapping[str, Any],
                      target_config: ModelConfig) -> None:
    """Checks a draft asset's record and tensors against the target it is loaded for.

    Args:
      directory: the asset directory (for messages).
      record: the parsed ``draft.json``.
      tensors: the tensors of ``draft.safetensors`` by name (numpy arrays).
      target_config: the config of the model the draft is loaded for.
    Raises:
      CheckpointError: one line naming the file and the first problem: a missing, extra,
        mis-shaped or mis-typed tensor, bad head-subset ids, or a ``draft.json`` field
        that is missing, of the wrong type, or does not match the target.
    """
    directory = Path(directory)
    json_file, tensor_file = directory / DRAFT_CONFIG, directory / DRAFT_TENSORS

    def bad_record(message: str) -> CheckpointError:
        return CheckpointError(f"{json_file}: {message}")

    def bad_tensor(message: str) -> CheckpointError:
        return CheckpointError(f"{tensor_file}: {message}")

    if not isinstance(record, dict):
        raise bad_record(f"expected a JSON object, found {type(record).__name__}")
    num_layers = record.get("num_layers")
    if not _is_int(num_layers) or num_layers < 1:
        raise bad_record(f"num_layers must be a positive integer, found {num_layers!r:.40}")
    fingerprint = record.get("embed_fingerprint")
    if not isinstance(fingerprint, str) or not _FINGERPRINT.match(fingerprint):
        raise bad_record(f"embed_fingerprint must be 16 hex digits, found {fingerprint!r:.40}")
    base = record.get("base_config")
    if not isinstance(base, dict):
        raise bad_record(f"base_config must be an object, found {base!r:.40}")
    for key in ("hidden_size", "vocab_size"):
        want = getattr(target_config, key)
        if not _is_int(base.get(key)) or base[key] != want:
            raise bad_record(f"base_config.{key} is {base.get(key)!r:.40}, but the target "
                             f"model has {want}")
    subset_size = record.get("head_tokens")
    if subset_size is not None and (not _is_int(subset_size) or subset_size < 1):
        raise bad_record(f"head_tokens must be null or a positive integer, found "
                         f"{subset_size!r:.40}")

    feature_input = record.get("feature_input", False)
    if not isinstance(feature_input, bool):
        raise bad_record(f"feature_input must be true or false, found {feature_input!r:.40}")
    layers = record.get("feature_layers", [])
    if (not isinstance(layers, list) or not all(_is_int(i) for i in layers)
            or any(not 0 <= i < target_config.num_layers for i in layers)):
        raise bad_record(f"feature_layers must be a list of the target's block indices (0 to "
                         f"{target_config.num_layers - 1}), found {layers!r:.60}")
    vocab_size = record.get("draft_vocab_size", 0)
    if not _is_int(vocab_size) or not 0 <= vocab_size <= target_config.vocab_size:
        raise bad_record(f"draft_vocab_size must be an integer in [0, "
                         f"{target_config.vocab_size}], found {vocab_size!r:.40}")
    try:
        config = draft_config(target_config, record)
    except InvalidArgumentError as error:
        raise bad_record(str(error)) from None
    expected = expected_draft_tensors(config)
    names = set(tensors)
    for name in sorted(expected):
        if name not in names:
            raise bad_tensor(f"missing tensor {name!r}")
    extra = sorted(names - set(expected) - {HEAD_TOKENS})
    if extra:
        raise bad_tensor(f"unexpected tensor {extra[0]!r:.80}")
    for name, shape in expected.items():
        array = tensors[name]
        if tuple(np.shape(array)) != shape:
            raise bad_tensor(f"tensor {name!r} has shape {tuple(np.shape(array))}, expected "
                             f"{shape} (a {num_layers}-layer draft of this target)")
        want = np.int32 if name == DRAFT_VOCAB else np.float16
        if np.asarray(array).dtype != want:
            raise bad_tensor(f"tensor {name!r} is {np.asarray(array).dtype}, expected "
                             f"{np.dtype(want).name}")
    if DRAFT_VOCAB in expected:
        ids = np.asarray(tensors[DRAFT_VOCAB])
        if (ids.size and (ids.min() < 0 or ids.max() >= target_config.vocab_size)
                or np.unique(ids).size != ids.size):
            raise bad_tensor(f"{DRAFT_VOCAB} must hold distinct ids in [0, "
                             f"{target_config.vocab_size})")

    head_tokens = tensors.get(HEAD_TOKENS)
    if (head_tokens is None) != (subset_size is None):
        raise bad_tensor(f"draft.json says head_tokens {subset_size!r} but the file "
                         f"{'lacks' if head_tokens is None else 'has'} a head_tokens tensor")
    if head_tokens is None:
        return
    head_tokens = np.asarray(head_tokens)
    if head_tokens.dtype != np.int32 or head_tokens.ndim != 1:
        raise bad_tensor(f"head_tokens is {head_tokens.dtype} {head_tokens.shape}, expected a "
                         "1-D int32 array")
    if head_tokens.size != subset_size:
        raise bad_tensor(f"head_tokens holds {head_tokens.size} ids, draft.json says "
                         f"{subset_size}")
    vocab = target_config.vocab_size
    if head_tokens.size and (head_tokens[0] < 0 or head_tokens[-1] >= vocab
                             or np.any(np.diff(head_tokens) <= 0)):
        raise bad_tensor(f"head_tokens must be sorted, distinct ids in [0, {vocab})")
