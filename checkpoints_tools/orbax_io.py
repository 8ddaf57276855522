"""specjax's own checkpoint format: an orbax parameter tree beside a JSON config.

Layout of a checkpoint directory::

    specjax_config.json   every ModelConfig field (rope_scaling nested), plus
                          "specjax_format_version"
    params/               the parameter tree, written by orbax's StandardCheckpointer
    tokenizer.json ...    the tokenizer, when there is one (``save_pretrained`` files)
    specjax_origin.json   optional: what the checkpoint was made from (a JSON object, e.g.
                          ``specjax convert``'s {"source", "known_model", "dtype", ...})

The origin lives in a file of its own so that checkpoints without it (written before it
existed) still read, and specjax versions that do not know it still load checkpoints
that have it (they would reject an unknown field in the config).

Loading checks the restored tree against the config (shapes, missing and extra leaves),
so a checkpoint that does not describe the model it claims to is rejected by name.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import sys
from pathlib import Path
from typing import Any

import jax
import numpy as np

from specjax.checkpoints_tools.hf import (as_numpy_dtype, has_tokenizer, load_hf_tokenizer, one_line,
                                          read_json_object)
from specjax.config import ModelConfig
from specjax.rope_scaling import RopeScaling
from specjax.errors import CheckpointError, InvalidArgumentError, ModelNotFoundError
from specjax.models import check_params

CONFIG_FILE = "specjax_config.json"
PARAMS_DIR = "params"
ORIGIN_FILE = "specjax_origin.json"
FORMAT_VERSION = 1
_VERSION_KEY = "specjax_format_version"


def config_to_dict(config: ModelConfig) -> dict[str, Any]:
    """All fields of ``config`` as JSON-ready values (``rope_scaling`` as a nested dict);
    ``feature_input``, ``feature_layers``, ``draft_vocab_size`` and the optional family
    fields only when set, so plain models read in versions without them."""
    out = dataclasses.asdict(config)
    out["eos_token_ids"] = list(config.eos_token_ids)
    out["layer_windows"] = list(config.layer_windows)
    for name in ("feature_input", "feature_layers", "draft_vocab_size"):
        if not out[name]:
            out.pop(name)
    if "feature_layers" in out:
        out["feature_layers"] = list(config.feature_layers)
    for field in dataclasses.fields(ModelConfig):
        if field.name in _FAMILY_FIELDS and getattr(config, field.name) == field.default:
            out.pop(field.name)
    if config.rope_scaling is not None:
        # Only the fields its kind uses (the others at their defaults), so that a linear or
        # Llama 3 scaling reads in versions without YaRN and LongRoPE.
        out["rope_scaling"] = {
            field.name: getattr(config.rope_scaling, field.name)
            for field in dataclasses.fields(RopeScaling)
            if field.name in ("kind", "factor")
            or getattr(config.rope_scaling, field.name) != field.default}
        for name in ("short_factor", "long_factor"):
            if name in out["rope_scaling"]:
                out["rope_scaling"][name] = list(out["rope_scaling"][name])
    if "no_rope_layers" in out:
        out["no_rope_layers"] = list(config.no_rope_layers)
    return out


# ModelConfig's optional fields of the families on the llama forward (Qwen3, Gemma, Phi-3,
# SmolLM3, Granite, OLMo), written only when set.
_FAMILY_FIELDS = ("family", "qk_norm", "qk_norm_whole", "norm_plus_one", "hidden_act",
                  "embed_scale", "sandwich_norms", "pre_norms", "query_scale", "attn_softcap",
                  "final_softcap", "layer_windows", "local_rope_theta", "rotary_dim",
                  "no_rope_layers", "embed_multiplier", "residual_multiplier",
                  "logits_divisor", "num_experts", "experts_per_token",
                  "normalize_expert_weights", "shared_expert_size", "shared_input_norm",
                  "head_bias", "learned_positions")


def config_from_dict(raw: dict[str, Any], source: str = "config") -> ModelConfig:
    """Inverse of :func:`config_to_dict`.

    Raises:
      CheckpointError: a field is unknown, missing or of the wrong kind.
    """
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(raw) - fields)
    if unknown:
        raise CheckpointError(f"{source}: unknown config field {unknown[0]!r}")
    values = dict(raw)
    try:
        if values.get("rope_scaling") is not None:
            values["rope_scaling"] = RopeScaling(**values["rope_scaling"])
        values["eos_token_ids"] = tuple(int(t) for t in values.get("eos_token_ids", ()))
        if "feature_layers" in values:
            values["feature_layers"] = tuple(values["feature_layers"])
        values["layer_windows"] = tuple(values.get("layer_windows", ()))
        return ModelConfig(**values)
    except (TypeError, ValueError) as error:  # InvalidArgumentError is a ValueError
        raise CheckpointError(f"{source}: invalid model config ({one_line(error)})") from error


def _to_numpy(tree):
    if isinstance(tree, dict):
        return {key: _to_numpy(value) for key, value in tree.items()}
    return np.asarray(tree)


def save_orbax(path: str | os.PathLike, config: ModelConfig, params: dict,
               tokenizer: Any = None, origin: dict[str, Any] | None = None) -> Path:
    """Writes a specjax checkpoint directory (see the module docstring).

    Args:
      path: directory to create; it may exist only if empty.
      config: the model config.
      params: parameter tree (numpy or jax arrays), checked against ``config``.
      tokenizer: a transformers tokenizer to save alongside, or ``None``.
      origin: what the checkpoint was made from, a JSON-serialisable dict stored as
        ``specjax_origin.json`` (read back by :func:`read_origin`); ``None`` stores none.
    Returns:
      ``path`` as an absolute :class:`~pathlib.Path`.
    Raises:
      InvalidArgumentError: ``path`` exists and is not an empty directory, or ``origin``
        is not a JSON-serialisable dict.
      CheckpointError: ``params`` does not match ``config``.
    """
    import orbax.checkpoint as ocp

    path = Path(path).absolute()
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise InvalidArgumentError(f"{path} already exists and is not an empty directory")
    check_params(config, params, source="params")
    origin_text = None if origin is None else _origin_json(origin)
    path.mkdir(parents=True, exist_ok=True)
    record = {_VERSION_KEY: FORMAT_VERSION, **config_to_dict(config)}
    (path / CONFIG_FILE).write_text(json.dumps(record, indent=2) + "\n")
    if origin_text is not None:
        (path / ORIGIN_FILE).write_text(origin_text)
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(path / PARAMS_DIR, _to_numpy(params))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(path))
    return path


def _origin_json(origin: dict[str, Any]) -> str:
    if not isinstance(origin, dict):
        raise InvalidArgumentError(f"origin must be a dict, got {type(origin).__name__}")
    try:
        return json.dumps(origin, indent=2, sort_keys=True, allow_nan=False) + "\n"
    except (TypeError, ValueError) as error:  # a non-JSON value, NaN, a cycle
        raise InvalidArgumentError(f"origin is not JSON-serialisable ({one_line(error)})"
                                   ) from error


def read_origin(path: str | os.PathLike) -> dict[str, Any] | None:
    """What the checkpoint directory ``path`` was made from, as given to :func:`save_orbax`.

    Args:
      path: a checkpoint directory.
    Returns:
      the stored dict, or ``None`` when the checkpoint records no origin (one written
      before origins were stored, or without one).
    Raises:
      CheckpointError: ``specjax_origin.json`` exists but is not a readable JSON object
        (the message names the file).
    """
    file = Path(path) / ORIGIN_FILE
    if not file.exists():
        return None
    return read_json_object(file)


def read_orbax_config(path: str | os.PathLike) -> ModelConfig:
    """The :class:`ModelConfig` stored in the checkpoint directory ``path``."""
    file = Path(path) / CONFIG_FILE
    if not file.is_file():
        raise CheckpointError(f"{path}: {CONFIG_FILE} is missing")
    raw = read_json_object(file)
    version = raw.pop(_VERSION_KEY, None)
    if version != FORMAT_VERSION:
        raise CheckpointError(
            f"{file}: {_VERSION_KEY} is {version!r}; this specjax reads version {FORMAT_VERSION}")
    return config_from_dict(raw, source=str(file))


def load_orbax(path: str | os.PathLike, dtype=None) -> tuple[ModelConfig, dict, Any]:
    """Loads a specjax checkpoint directory written by :func:`save_orbax`.

    Args:
      path: the checkpoint directory.
      dtype: cast every parameter to this dtype; ``None`` keeps the stored dtype.
    Returns:
      (config, params, tokenizer): params is a nested dict of numpy arrays; tokenizer is
      ``None`` when the checkpoint has none.
    Raises:
      ModelNotFoundError: ``path`` does not exist.
      CheckpointError: the config or parameters are missing, unreadable or inconsistent
        (the message names which).
    """
    path = Path(path).absolute()
    if not path.is_dir():
        raise ModelNotFoundError(f"{path}: no such checkpoint directory")
    config = read_orbax_config(path)
    params_dir = path / PARAMS_DIR
    if not params_dir.is_dir():
        raise CheckpointError(f"{path}: the parameter directory {PARAMS_DIR}/ is missing")
    _silence_late_loop_errors()
    # Before the restore: a failed read can be collected, and reported, while orbax is
    # still failing (seen in CI: the report came before the error it belongs to).
    # After a CheckpointError the filter stays: more failed reads may be freed later.
    added = _drop_orphaned_read_reports(params_dir)
    params = _restore(params_dir, config)
    if added is not None:  # nothing failed: no report to drop
        logging.getLogger("asyncio").removeFilter(added)
    if not isinstance(params, dict):
        raise CheckpointError(
            f"{params_dir}: expected a tree of dicts, found {type(params).__name__}")
    params = _to_numpy(params)
    check_params(config, params, source=str(params_dir))
    target = as_numpy_dtype(dtype)
    if target is not None:
        params = _cast(params, target)
    tokenizer = load_hf_tokenizer(path) if has_tokenizer(path) else None
    return config, params, tokenizer


def _restore(params_dir: Path, config: ModelConfig):
    """The parameter tree orbax restores from ``params_dir``, its declared arrays checked
    first; any failure is a one-line :class:`CheckpointError`."""
    import orbax.checkpoint as ocp

    try:
        # orbax logs a warning of its own when the metadata is unreadable; the error below
        # says it in one line.
        with _quiet_absl(), ocp.StandardCheckpointer() as checkpointer:
            stored = checkpointer.metadata(params_dir)
    except Exception as error:  # orbax/tensorstore raise many types for damaged files
        raise CheckpointError(
            f"{params_dir}: corrupt or incomplete orbax checkpoint ({one_line(error)})") from error
    item = getattr(stored, "item_metadata", stored)  # orbax >= 0.12 wraps the tree
    _check_stored_arrays(getattr(item, "tree", item), config, params_dir)
    try:
        with ocp.StandardCheckpointer() as checkpointer:
            return checkpointer.restore(params_dir)
    except Exception as error:  # orbax/tensorstore raise many types for damaged files
        raise CheckpointError(
            f"{params_dir}: corrupt or incomplete orbax checkpoint ({one_line(error)})") from error


# Stored arrays may declare this many times the bytes params/ holds on disk (compression,
# chunks of zeros that tensorstore does not write) plus a fixed allowance; more would
# allocate memory that the files do not justify.
_MAX_DECLARED_RATIO = 64
_DECLARED_ALLOWANCE = 256 << 20


def _check_stored_arrays(tree, config: ModelConfig, params_dir: Path) -> None:
    """Checks the arrays a checkpoint declares (shapes, dtypes, total size) before any is
    restored: restoring allocates each declared array first."""
    if not isinstance(tree, dict):
        raise CheckpointError(f"{params_dir}: corrupt or incomplete orbax checkpoint (its "
                              f"metadata holds {type(tree).__name__}, not a parameter tree)")
    check_params(config, tree, source=str(params_dir))
    declared = 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        try:
            dtype = np.dtype(leaf.dtype)
        except TypeError:
            dtype = None
        integer_map = jax.tree_util.keystr(path) == "['draft_vocab']" and dtype == np.int32
        if (dtype is None or not np.issubdtype(dtype, np.floating) and dtype.name != "bfloat16"
                and not integer_map):  # a reduced head's id map is the one int32 array
            raise CheckpointError(f"{params_dir}: parameter {jax.tree_util.keystr(path)} has "
                                  f"dtype {getattr(leaf, 'dtype', None)}, not floating-point")
        declared += math.prod(leaf.shape) * dtype.itemsize
    on_disk = sum(file.stat().st_size for file in params_dir.rglob("*") if file.is_file())
    if declared > _MAX_DECLARED_RATIO * on_disk + _DECLARED_ALLOWANCE:
        raise CheckpointError(
            f"{params_dir}: the stored arrays declare {declared} bytes but the directory holds "
            f"{on_disk}; refusing to allocate memory the files do not justify")


@contextlib.contextmanager
def _quiet_absl():
    """Hides absl's (orbax's) log records below ERROR for the duration of the block."""
    logger = logging.getLogger("absl")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _is_closed_loop_error(exc) -> bool:
    return isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed"


def _silence_late_loop_errors() -> None:
    """Keeps a failed restore's leftovers from printing tracebacks around our error.

    When a restore fails, tensorstore still completes the reads orbax had scheduled; their
    callbacks then target orbax's event loop, which is already closed, and Python reports
    ``RuntimeError: Event loop is closed`` from tensorstore's threads, through
    :data:`sys.unraisablehook` or :data:`sys.excepthook`. These hooks drop exactly that
    report and pass every other one to the hook they replace.
    """
    if not getattr(sys.unraisablehook, "_specjax_filter", False):
        previous_unraisable = sys.unraisablehook

        def unraisable_hook(unraisable):
            if not _is_closed_loop_error(unraisable.exc_value):
                previous_unraisable(unraisable)

        unraisable_hook._specjax_filter = True
        sys.unraisablehook = unraisable_hook
    if not getattr(sys.excepthook, "_specjax_filter", False):
        previous_except = sys.excepthook

        def except_hook(exc_type, exc, tb):
            if not _is_closed_loop_error(exc):
                previous_except(exc_type, exc, tb)

        except_hook._specjax_filter = True
        sys.excepthook = except_hook


class _OrphanedReadFilter(logging.Filter):
    """Drops asyncio's "exception was never retrieved" reports about reads of one directory."""

    def __init__(self, directory: Path):
        super().__init__()
        self.directory = str(directory)

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if "exception was never retrieved" not in message.partition("\n")[0]:
            return True
        exc = record.exc_info[1] if record.exc_info else None
        return self.directory not in message and self.directory not in str(exc)


def _drop_orphaned_read_reports(params_dir: Path) -> logging.Filter | None:
    """Keeps a damaged checkpoint's failed reads from being reported after our error.

    When orbax gives up on a damaged checkpoint, some of the reads it started (asyncio tasks
    wrapping tensorstore futures) have failed without anyone awaiting them. Whenever the
    garbage collector frees them, maybe at exit, asyncio logs "Task exception was never
    retrieved" with the tensorstore error: several lines after the one-line error. This
    filter drops those reports for ``params_dir`` only; every other asyncio report passes.
    Returns the filter it added, or None when one for ``params_dir`` was there already.
    """
    logger = logging.getLogger("asyncio")
    if any(isinstance(f, _OrphanedReadFilter) and f.directory == str(params_dir)
           for f in logger.filters):
        return None
    added = _OrphanedReadFilter(params_dir)
    logger.addFilter(added)
    return added


def _cast(tree, dtype):
    """The floating-point arrays of ``tree`` cast to ``dtype`` (integer ones kept)."""
    if isinstance(tree, dict):
        return {key: _cast(value, dtype) for key, value in tree.items()}
    return tree if np.issubdtype(np.dtype(tree.dtype), np.integer) else tree.astype(dtype)
