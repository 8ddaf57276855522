"""Loading models and the resources methods decode with: drafts and n-gram tables.

* :func:`load` -- a model by name, path or hub id.
* :func:`resolve_draft` -- what ``draft=`` / ``--draft`` accept: a :class:`Model`, a
  shipped draft by name (``smollm2-135m-draft``), ``first-layers:K``, a draft asset
  folder, or any model :func:`load` accepts.
* :func:`resolve_ngram` -- n-gram tables: given, a path, or those shipped for the model.
* :func:`choose_default_method` -- the method when none is named: the fastest measured
  for the backend and temperature (:mod:`specjax.methods.choice`); the API and the CLI
  share it.

A known model (``smollm2-135m``) ships a draft and n-gram tables in ``specjax/assets``;
a model loaded from it, from its file, or from a checkpoint converted from it carries
``Model.assets`` naming them.
"""

from __future__ import annotations

import functools
import os
import weakref
from pathlib import Path

import jax
import jax.numpy as jnp

from specjax import models, sharding
from specjax.checkpoints_tools import sources
from specjax.drafters import ngram as ngram_lib
from specjax.errors import InvalidArgumentError, ModelNotFoundError
from specjax.loaded_model import Model, check_draft_compatible, pad_draft_vocabulary, resolve_dtype
from specjax.methods import MethodOptions, choice

DRAFT_SUFFIX = "-draft"
FIRST_LAYERS = "first-layers:"


def load(name_or_path: str | os.PathLike, dtype=None, *, progress: bool = False,
         mesh=None) -> Model:
    """Loads a model by name, path or hub id.

    Args:
      name_or_path: ``smollm2-135m`` (the embedded default), a GGUF file, a Hugging Face
        directory, an orbax directory written by ``specjax convert``, or a hub id.
      dtype: parameter dtype (``"float32"``, ``"bfloat16"`` or a jnp dtype); default:
        float32.
      progress: show a progress bar while reading weights.
      mesh: a ``("data", "model")`` :class:`jax.sharding.Mesh`
        (:func:`specjax.sharding.make_mesh`): the parameters are split over its ``model``
        axis (tensor parallel) and replicated over ``data``; :func:`specjax.generate` then
        runs on the mesh. Default: one device.
    Returns:
      A :class:`Model`; ``model.assets`` names the known model whose shipped draft and
      n-gram tables apply to it, if any.
    Raises:
      InvalidArgumentError: with ``mesh``, heads or MLP width that do not divide its
        ``model`` axis.
    """
    if mesh is not None:
        sharding.check_mesh(mesh)
    dtype = resolve_dtype(dtype) or jnp.float32
    config, params, tokenizer = sources.resolve_and_load(name_or_path, dtype=None,
                                                         progress=progress)
    if mesh is not None:
        sharding.check_divisible(config, mesh)  # before copying any weight to a device
    model = Model.from_params(config, params, tokenizer, name=os.fspath(name_or_path),
                              dtype=dtype, assets=sources.known_origin(name_or_path))
    return model if mesh is None else sharding.shard_model(model, mesh)


# ----------------------------------------------------------------------------- shipped assets


def shipped_assets(assets: str | None) -> Path | None:
    """The asset folder of a known model, or ``None``."""
    if assets is None:
        return None
    folder = sources.assets_dir() / assets
    return folder if folder.is_dir() else None


def shipped_draft_name(assets: str | None) -> str | None:
    """The name of the draft shipped for a known model (``smollm2-135m-draft``), or None."""
    folder = shipped_assets(assets)
    if folder is None or not (folder / sources.DRAFT_TENSORS).is_file():
        return None
    return assets + DRAFT_SUFFIX


def has_shipped_ngram(assets: str | None) -> bool:
    folder = shipped_assets(assets)
    return folder is not None and (folder / "ngram.npz").is_file()


def shipped_draft_names() -> list[str]:
    """Every shipped draft's name."""
    return [name for name in map(shipped_draft_name, sources.KNOWN_MODELS) if name]


def shipped_resources(assets: str | None) -> frozenset[str]:
    """What is shipped for a known model: a subset of ``{"draft", "ngram"}``."""
    return frozenset(name for name, shipped in (("draft", shipped_draft_name(assets)),
                                                ("ngram", has_shipped_ngram(assets)))
                     if shipped)


def choose_default_method(assets: str | None, backend: str = "cpu",
                          temperature: float = 0.0,
                          constrained: bool = False) -> tuple[str, str]:
    """The method used when none is named, and why (one line): the fastest measured on
    ``backend`` at ``temperature`` among those the shipped assets allow, ``ar`` where
    none beat it (:func:`specjax.methods.choice.choose_method`).

    Args:
      assets: ``Model.assets`` (or :func:`sources.known_origin` of a model argument, so
        that the CLI decides before loading).
      backend: ``cpu``, ``gpu`` or ``tpu``.
      temperature: the sampling temperature.
      constrained: the request decodes under a constraint (its own table:
        :data:`specjax.methods.choice.MEASURED_CONSTRAINED`).
    """
    return choice.choose_method(backend, temperature, shipped_resources(assets),
                                constrained=constrained)


def default_method(assets: str | None, backend: str = "cpu", temperature: float = 0.0) -> str:
    """The name :func:`choose_default_method` chooses."""
    return choose_default_method(assets, backend, temperature)[0]


def describe_defaults(assets: str | None) -> str:
    """One line on what a model decodes with by default (for ``--help``)."""
    if not shipped_resources(assets):
        return "ar (no shipped draft or n-gram tables)"
    per_backend = "; ".join(
        f"{backend}: {default_method(assets, backend, 0.0)} at T=0, "
        f"{default_method(assets, backend, 1.0)} at T>0"
        + ("" if (backend, "greedy") in choice.MEASURED else " (not measured)")
        for backend in ("cpu", "gpu", "tpu"))
    timed = []
    for backend, kind in sorted(choice.MEASURED_CONSTRAINED):
        greedy = kind == "greedy"
        method = choose_default_method(assets, backend, 0.0 if greedy else 1.0,
                                       constrained=True)[0]
        timed.append(f"{method} on the {backend} at {'T=0' if greedy else 'T>0'}")
    constrained = ", ".join(timed)
    return (f"the method measured fastest on the backend at the temperature, ar where "
            f"none beat it ({per_backend}; under a --regex or --json-schema: {constrained}, "
            f"ar where not timed; on a CPU, scaled by its own step costs, timed "
            f"once: SPECJAX_CALIBRATION); spec, tree and staged use the shipped draft "
            f"{shipped_draft_name(assets)!r}, ngram and staged the shipped n-gram tables")


# ----------------------------------------------------------------------------- resources


def check_draft_spec(draft) -> None:
    """Rejects a ``draft`` argument that cannot name a draft, without loading anything
    (the CLI checks it before the target loads)."""
    if draft is None or isinstance(draft, Model):
        return
    text = os.fspath(draft)
    if text.startswith(FIRST_LAYERS):
        if not text[len(FIRST_LAYERS):].isdigit():
            raise InvalidArgumentError(f"draft {text!r}: expected {FIRST_LAYERS}K with an "
                                       "integer K")
        if int(text[len(FIRST_LAYERS):]) < 1:
            raise InvalidArgumentError(f"draft {text!r}: K must be at least 1 (and at most "
                                       "the target's layer count, known once it loads)")
    elif text in shipped_draft_names() or Path(text).expanduser().exists():
        return
    else:
        try:
            sources.classify_model_argument(text)
        except ModelNotFoundError:
            shipped = ", ".join(shipped_draft_names()) or "none"
            raise InvalidArgumentError(
                f"no draft {text!r}: not a shipped draft ({shipped}), {FIRST_LAYERS}K, an "
                f"existing path, a known model or a hub id") from None


def resolve_draft(model: Model, draft=None, *, dtype=None, progress: bool = False) -> Model:
    """The draft model for ``model``.

    Args:
      model: the target.
      draft: ``None`` (the draft shipped for the target), a :class:`Model`, a shipped
        draft's name (``smollm2-135m-draft``), ``first-layers:K`` (the target's first K
        layers: untrained, exact but slow; for tests), a draft asset folder (``draft.json``
        + ``draft.safetensors``, e.g. written by ``specjax train-draft``), or anything
        :func:`load` accepts.
      dtype: dtype of a draft loaded from a path (default: the target's).
    Returns:
      The draft, checked to share the target's tokenizer.
    Raises:
      InvalidArgumentError: no draft given and none shipped; a draft that does not fit.
    """
    if draft is not None and not isinstance(draft, Model):
        check_draft_spec(draft)
    if draft is None:
        draft = _draft_asset(model, None)
    elif isinstance(draft, str) and draft.startswith(FIRST_LAYERS):
        count = int(draft[len(FIRST_LAYERS):])
        if not 1 <= count <= model.config.num_layers:
            raise InvalidArgumentError(
                f"draft {draft!r}: K must be in [1, {model.config.num_layers}], the layers "
                f"of {model.name}")
        draft = model.first_layers(count)
    elif isinstance(draft, str) and draft in shipped_draft_names() \
            and not Path(draft).exists():
        draft = _draft_asset(model, shipped_assets(draft[: -len(DRAFT_SUFFIX)]))
    elif isinstance(draft, (str, os.PathLike)):
        path = Path(draft).expanduser()
        if path.is_dir() and (path / sources.DRAFT_CONFIG).is_file():
            draft = _draft_asset(model, path)
        else:
            draft = _same_layout(model, load(draft, dtype=dtype or model.dtype,
                                             progress=progress))
    elif not isinstance(draft, Model):
        raise InvalidArgumentError(f"draft must be a Model, a name or a path, got "
                                   f"{type(draft).__name__}")
    check_draft_compatible(model, draft)
    return _with_target_vocabulary(model, draft)


# Drafts padded to a target's vocabulary (pad_draft_vocabulary), per draft object: a
# generate() call would otherwise copy the draft's embedding and head each time.
_PADDED_DRAFTS: "weakref.WeakKeyDictionary[Model, dict]" = weakref.WeakKeyDictionary()


def _with_target_vocabulary(model: Model, draft: Model) -> Model:
    size = model.config.vocab_size
    if draft.config.vocab_size == size:
        return draft
    entries = _PADDED_DRAFTS.setdefault(draft, {})
    if size not in entries:
        entries[size] = pad_draft_vocabulary(draft, size)
    return entries[size]


def _same_layout(model: Model, draft: Model) -> Model:
    """A draft this module loaded, in the target's projection layout (fused q|k|v and
    gate|up when the target's are: :meth:`Model.with_fused_projections`)."""
    return draft.with_fused_projections() if models.projections_fused(model.params) else draft


# Draft assets read for a target, per target object: reading one and checking its
# fingerprint (a hash of the target's whole embedding) took 0.18 s for SmolLM2-135M, paid by
# every generate() call that names no draft object, and the shipped tables 0.06 s. An entry
# is used again only while the asset's files and the target's embedding and head arrays are
# the ones it was built from; it goes with the target.
_DRAFT_ASSETS: "weakref.WeakKeyDictionary[Model, dict]" = weakref.WeakKeyDictionary()


def _file_signature(*paths: Path) -> tuple | None:
    """(path, modification time, size) of each file; None if one is missing."""
    try:
        return tuple((str(p.resolve()), p.stat().st_mtime_ns, p.stat().st_size) for p in paths)
    except OSError:
        return None


def _draft_asset(model: Model, directory: Path | None) -> Model:
    """:func:`sources.load_bundled_draft`, reused for the same target and files."""
    folder = directory
    if folder is None and model.assets is not None:
        folder = sources.assets_dir() / model.assets
    signature = None if folder is None else _file_signature(
        Path(folder) / sources.DRAFT_TENSORS, Path(folder) / sources.DRAFT_CONFIG)
    if signature is None:  # nothing to reuse: let the loader say what is missing
        return _same_layout(model, sources.load_bundled_draft(model, directory))
    shared = (model.params.get("embed"), model.params.get("lm_head"))
    entries = _DRAFT_ASSETS.setdefault(model, {})
    key = (signature, models.projections_fused(model.params))
    entry = entries.get(key)
    if entry is not None and all(a is b for a, b in zip(entry[0], shared)):
        return entry[1]
    draft = _same_layout(model, sources.load_bundled_draft(model, directory))
    entries[key] = (shared, draft)
    return draft


@functools.lru_cache(maxsize=4)
def _tables_file(path: str, version: tuple, vocab_size: int) -> ngram_lib.NgramTables:
    """An n-gram file's tables on the device, read once per ``version`` (mtime, size)."""
    return jax.tree.map(jnp.asarray, ngram_lib.load_ngram(path, vocab_size=vocab_size))


def resolve_ngram(model: Model, ngram=None) -> ngram_lib.NgramTables:
    """N-gram tables for ``model``: ``ngram`` (tables or a path), else the shipped ones.

    Returns:
      The tables as device arrays, checked against the model's vocabulary.
    """
    if ngram is None:
        if not has_shipped_ngram(model.assets):
            raise InvalidArgumentError(
                f"no n-gram tables are shipped for model {model.name!r}: pass ngram=PATH "
                "(--ngram), built with 'specjax build-ngram'")
        ngram = shipped_assets(model.assets) / "ngram.npz"
    if isinstance(ngram, ngram_lib.NgramTables):
        tables = ngram
        if tables.vocab_size != model.config.vocab_size:
            raise InvalidArgumentError(
                f"n-gram tables have vocabulary size {tables.vocab_size}, the model "
                f"{model.config.vocab_size}")
    else:
        signature = _file_signature(Path(ngram).expanduser())
        if signature is not None:  # device arrays are immutable: one copy serves every call
            (path, *version), = signature
            return _tables_file(path, tuple(version), model.config.vocab_size)
        tables = ngram_lib.load_ngram(ngram, vocab_size=model.config.vocab_size)
    return jax.tree.map(jnp.asarray, tables)


def check_resources(options: MethodOptions, draft=None, ngram=None) -> None:
    """Rejects a draft or tables given to a method that takes none (before any loading)."""
    if draft is not None and not options.uses_draft:
        raise InvalidArgumentError(f"method {options.name!r} takes no draft model "
                                   f"(methods with a draft: spec, tree, staged)")
    if ngram is not None and not options.uses_ngram:
        raise InvalidArgumentError(f"method {options.name!r} takes no n-gram tables "
                                   f"(methods with tables: ngram, staged)")
