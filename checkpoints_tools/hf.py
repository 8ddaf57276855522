"""Hugging Face checkpoints: load a local directory or a hub id, and export a model as one.

A Hugging Face model directory holds ``config.json`` and its weights in one of

- ``model.safetensors``,
- ``model.safetensors.index.json`` plus the shards it names,
- ``pytorch_model.bin`` (or its ``.index.json`` shards), read only with
  ``torch.load(..., weights_only=True)``; torch is optional and needed only for these.

Tensor names are mapped to specjax parameters by :mod:`specjax.checkpoints_tools.keymap`,
which rejects any unmapped, duplicated, missing or mis-shaped tensor. Every problem with
the files is a :class:`~specjax.errors.CheckpointError` whose one-line message names the
file or tensor. Parameters come back as numpy arrays (bf16 as ``ml_dtypes.bfloat16``);
the caller moves them to a device.
"""

from __future__ import annotations

import json
import re
import os
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from specjax.checkpoints_tools import keymap
from specjax.config import ModelConfig, from_hf_config
from specjax.errors import CheckpointError, InvalidArgumentError, ModelNotFoundError

SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
TORCH_FILE = "pytorch_model.bin"
TORCH_INDEX = "pytorch_model.bin.index.json"

# Files a tokenizer may be saved as; any of them means the directory carries one.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")

# What load_hub downloads: config, safetensors weights and tokenizer, nothing else.
HUB_PATTERNS = (
    "config.json", "generation_config.json", "*.safetensors", SAFETENSORS_INDEX,
    "tokenizer*", "special_tokens_map.json", "vocab.json", "merges.txt", "added_tokens.json",
    "chat_template.jinja", "chat_template.json",
)


def one_line(error: BaseException, limit: int = 240) -> str:
    """An exception as ``Type: message`` on a single line (for wrapping foreign errors).

    Bracketed payloads that some libraries append (tensorstore's JSON specs) are dropped and
    the text is cut at ``limit`` characters, so the line stays readable.
    """
    text = " ".join(str(error).split())
    text = re.sub(r"\s*\[tensorstore_spec=.*$", "", text)
    if len(text) > limit:
        text = text[: limit - 3].rstrip() + "..."
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def as_numpy_dtype(dtype) -> np.dtype | None:
    """Normalises ``"bfloat16"``, ``jnp.bfloat16``, ``np.float32``... to a numpy dtype.

    Raises:
      InvalidArgumentError: the dtype is not a floating-point type.
    """
    if dtype is None:
        return None
    if isinstance(dtype, str) and dtype in ("bfloat16", "bf16"):
        return np.dtype(ml_dtypes.bfloat16)
    try:
        result = np.dtype(dtype)
    except TypeError as error:
        raise InvalidArgumentError(f"unknown dtype {dtype!r}") from error
    if result != np.dtype(ml_dtypes.bfloat16) and not np.issubdtype(result, np.floating):
        raise InvalidArgumentError(f"parameters need a floating-point dtype, got {dtype!r}")
    return result


# ----------------------------------------------------------------------------- reading


def read_hf_config(path: str | os.PathLike) -> ModelConfig:
    """The :class:`ModelConfig` of the HF directory ``path`` (from its ``config.json``)."""
    file = Path(path) / "config.json"
    if not file.is_file():
        raise ModelNotFoundError(f"{path}: no config.json, so not a Hugging Face model directory")
    return from_hf_config(read_json_object(file))


def read_json_object(file: Path) -> dict:
    """Parses a JSON object file; any failure is a one-line :class:`CheckpointError`."""
    try:
        raw = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CheckpointError(f"{file}: unreadable ({one_line(error)})") from error
    if not isinstance(raw, dict):
        raise CheckpointError(f"{file}: expected a JSON object")
    return raw


def _read_safetensors(file: Path, into: dict[str, np.ndarray], origin: dict[str, str],
                      bar=None) -> None:
    """Adds every tensor of one safetensors file to ``into``; rejects names seen before."""
    from safetensors import SafetensorError, safe_open

    try:
        # framework="numpy" yields bf16 tensors as ml_dtypes.bfloat16 arrays.
        with safe_open(str(file), framework="numpy") as handle:
            for name in handle.keys():
                if name in into:
                    raise CheckpointError(
                        f"{file}: duplicated tensor {name!r} (also in {origin[name]})")
                into[name] = handle.get_tensor(name)
                origin[name] = file.name
                if bar is not None:
                    bar.update(1)
    except (SafetensorError, OSError, ValueError, TypeError) as error:
        raise CheckpointError(
            f"{file}: corrupt or truncated safetensors file ({one_line(error)})") from error


def _torch_to_numpy(tensor) -> np.ndarray:
    import torch

    tensor = tensor.detach().cpu()
    if tensor.dtype == torch.bfloat16:  # numpy has no bf16: reinterpret the bits
        return tensor.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return tensor.numpy()


def _read_torch(file: Path, into: dict[str, np.ndarray], origin: dict[str, str],
                bar=None) -> None:
    """Adds every tensor of one ``pytorch_model*.bin`` to ``into`` (needs torch)."""
    try:
        import torch
    except ImportError as error:
        raise CheckpointError(
            f"{file}: reading a pytorch_model.bin needs torch (pip install torch), or convert "
            "the checkpoint to safetensors first") from error
    try:
        state = torch.load(str(file), map_location="cpu", weights_only=True)
    except Exception as error:  # torch raises many types for bad pickles / zips
        raise CheckpointError(
            f"{file}: corrupt or truncated PyTorch checkpoint ({one_line(error)})") from error
    if not isinstance(state, dict):
        raise CheckpointError(f"{file}: expected a state dict, found {type(state).__name__}")
    for name, tensor in state.items():
        if name in into:
            raise CheckpointError(f"{file}: duplicated tensor {name!r} (also in {origin[name]})")
        if not isinstance(tensor, torch.Tensor):
            raise CheckpointError(f"{file}: entry {name!r} is not a tensor")
        into[name] = _torch_to_numpy(tensor)
        origin[name] = file.name
        if bar is not None:
            bar.update(1)


def _read_sharded(index: Path, reader, bar=None) -> dict[str, np.ndarray]:
    """Reads the shards an ``*.index.json`` names and checks them against its weight map."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError("weight_map is not an object")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as error:
        raise CheckpointError(f"{index}: unreadable shard index ({one_line(error)})") from error
    tensors: dict[str, np.ndarray] = {}
    origin: dict[str, str] = {}
    for shard in sorted(set(weight_map.values())):
        file = index.parent / shard
        if not file.is_file():
            raise CheckpointError(f"{index}: shard {shard} is missing")
        reader(file, tensors, origin, bar)
    for name, shard in weight_map.items():
        if origin.get(name) != shard:
            where = f"found in {origin[name]}" if name in origin else "not found in any shard"
            raise CheckpointError(f"{index}: tensor {name!r} is listed in {shard} but {where}")
    return tensors


def read_hf_tensors(path: str | os.PathLike, progress: bool = False) -> dict[str, np.ndarray]:
    """Every weight tensor of the HF directory ``path``, by HF name, as numpy arrays."""
    from tqdm.auto import tqdm

    path = Path(path)
    tensors: dict[str, np.ndarray] = {}
    origin: dict[str, str] = {}
    with tqdm(desc="reading tensors", unit="tensor", disable=not progress) as bar:
        if (path / SAFETENSORS_FILE).is_file():
            _read_safetensors(path / SAFETENSORS_FILE, tensors, origin, bar)
            return tensors
        if (path / SAFETENSORS_INDEX).is_file():
            return _read_sharded(path / SAFETENSORS_INDEX, _read_safetensors, bar)
        if (path / TORCH_FILE).is_file():
            _read_torch(path / TORCH_FILE, tensors, origin, bar)
            return tensors
        if (path / TORCH_INDEX).is_file():
            return _read_sharded(path / TORCH_INDEX, _read_torch, bar)
    raise CheckpointError(
        f"{path}: no weights found (expected {SAFETENSORS_FILE}, {SAFETENSORS_INDEX} or "
        f"{TORCH_FILE})")


def load_hf_directory(path: str | os.PathLike, dtype=None, progress: bool = False
                      ) -> tuple[ModelConfig, dict]:
    """Loads a Hugging Face model directory.

    Args:
      path: directory with ``config.json`` and weights (see the module docstring).
      dtype: cast every parameter to this dtype (``"bfloat16"``, ``np.float32``...);
        ``None`` keeps the stored dtype.
      progress: show a per-tensor progress bar while reading.
    Returns:
      (config, params): params is the nested dict of numpy arrays described by
      :mod:`specjax.models` (``embed`` [V, d], ``layers/wq`` [L, d, H*D], ...).
    Raises:
      ModelNotFoundError: ``path`` has no ``config.json``.
      CheckpointError: a weight file is corrupt or a tensor is unmapped, duplicated, missing
        or mis-shaped (the message names it).
      InvalidArgumentError: the model type is not supported.
    """
    config = read_hf_config(path)
    tensors = read_hf_tensors(path, progress=progress)
    params = keymap.params_from_hf_tensors(config, tensors, source=str(path),
                                           dtype=as_numpy_dtype(dtype))
    return config, params


def has_tokenizer(path: str | os.PathLike) -> bool:
    """Whether the directory ``path`` carries tokenizer files."""
    return any((Path(path) / name).is_file() for name in TOKENIZER_FILES)


def load_hf_tokenizer(path: str | os.PathLike):
    """The tokenizer saved in ``path`` (``AutoTokenizer``), or ``None`` when there is none."""
    if not has_tokenizer(path):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path))
    except Exception as error:  # transformers raises OSError, ValueError, JSON errors...
        raise CheckpointError(f"{path}: unreadable tokenizer ({one_line(error)})") from error


# ----------------------------------------------------------------------------- hub


def _has_weights(path: Path) -> bool:
    return (path / SAFETENSORS_FILE).is_file() or (path / SAFETENSORS_INDEX).is_file()


def hub_snapshot(repo_id: str) -> Path:
    """Local directory holding the config, safetensors weights and tokenizer of a hub repo.

    Uses the local cache when it has the files (no network at all); otherwise downloads
    with a short connection timeout.

    Raises:
      ModelNotFoundError: the repo is not cached and the hub cannot be reached, or the repo
        does not exist.
    """
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (GatedRepoError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError, RevisionNotFoundError)

    patterns = list(HUB_PATTERNS)
    try:
        cached = Path(snapshot_download(repo_id, allow_patterns=patterns, local_files_only=True))
        if _has_weights(cached):
            return cached
    except (LocalEntryNotFoundError, FileNotFoundError):
        pass
    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns, etag_timeout=10))
    except (RepositoryNotFoundError, GatedRepoError, RevisionNotFoundError) as error:
        raise ModelNotFoundError(
            f"hub model {repo_id!r} was not found or is not accessible ({one_line(error)})"
        ) from error
    except Exception as error:  # offline, DNS failure, timeout: all mean "cannot download"
        raise ModelNotFoundError(
            f"hub model {repo_id!r} is not cached and the machine is offline or cannot reach "
            "the hub; download it on a connected machine (or copy it into the HF cache) or "
            "pass a local path") from error


def load_hub(repo_id: str, dtype=None, progress: bool = False) -> tuple[ModelConfig, dict]:
    """Loads a model from the Hugging Face hub (or its local cache) by id ``owner/name``.

    Args:
      repo_id: hub repository id.
      dtype, progress: as in :func:`load_hf_directory`.
    Returns:
      (config, params) as :func:`load_hf_directory`.
    Raises:
      ModelNotFoundError: see :func:`hub_snapshot`.
      CheckpointError: as :func:`load_hf_directory`.
    """
    return load_hf_directory(hub_snapshot(repo_id), dtype=dtype, progress=progress)


# ----------------------------------------------------------------------------- writing


def _dtype_name(params: dict) -> str:
    dtypes = {np.asarray(leaf).dtype for leaf in _leaves(params)}
    if len(dtypes) != 1:
        return "float32"
    dtype = dtypes.pop()
    return "bfloat16" if dtype == np.dtype(ml_dtypes.bfloat16) else dtype.name


def _leaves(tree) -> list:
    if isinstance(tree, dict):
        return [leaf for value in tree.values() for leaf in _leaves(value)]
    return [tree]


def save_hf_directory(config: ModelConfig, params: dict, path: str | os.PathLike,
                      tokenizer: Any = None) -> Path:
    """Writes ``config.json``, ``model.safetensors`` and the tokenizer into ``path``.

    The directory loads with ``transformers.AutoModelForCausalLM.from_pretrained`` and
    with :func:`load_hf_directory`.

    Args:
      config: the model config.
      params: parameter tree (numpy or jax arrays), checked against ``config``.
      path: directory to write (created if missing; existing files are overwritten).
      tokenizer: a transformers tokenizer to save alongside, or ``None``.
    Returns:
      ``path`` as a :class:`~pathlib.Path`.
    """
    from safetensors.numpy import save_file

    from specjax.models import HEAD_SUBSET, check_params

    # A restricted draft head is a specjax runtime option, not part of the architecture.
    params = {k: v for k, v in params.items() if k != HEAD_SUBSET}
    check_params(config, params, source="params")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = keymap.hf_tensors_from_params(config, params)
    hf_config = config.to_hf_config()
    hf_config["dtype"] = _dtype_name(params)
    (path / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    # transformers refuses safetensors files without a "format" entry in their metadata.
    save_file(tensors, str(path / SAFETENSORS_FILE), metadata={"format": "pt"})
    if tokenizer is not None:
        tokenizer.save_pretrained(str(path))
    return path
