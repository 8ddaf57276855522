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

The files are data, never code: a safetensors header is checked against the file's size
before anything is read for it; a shard index may only name files inside the checkpoint
directory; a model whose ``config.json`` asks for its own Python code (``auto_map``) is
refused, and ``trust_remote_code`` is never turned on; a chat template that reaches for
Python internals is refused when the tokenizer loads (transformers renders templates in
jinja2's sandbox, which refuses them again at run time).
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import os
import struct
import sys
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import ml_dtypes
import numpy as np

from specjax import progress as progress_lib
from specjax.checkpoints_tools import keymap
from specjax.config import ModelConfig
from specjax.families import NATIVE_DESPITE_AUTO_MAP, from_hf_config, to_hf_config
from specjax.errors import CheckpointError, InvalidArgumentError, ModelNotFoundError
from specjax.models import HEAD_SUBSET, check_params

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
    """The :class:`ModelConfig` of the HF directory ``path`` (from its ``config.json``).

    Raises:
      ModelNotFoundError: no ``config.json``.
      CheckpointError: the file is unreadable, malformed, or asks for custom code.
      InvalidArgumentError: the model type is not supported.
    """
    file = Path(path) / "config.json"
    if not file.is_file():
        raise ModelNotFoundError(f"{path}: no config.json, so not a Hugging Face model directory")
    raw = read_json_object(file)
    refuse_custom_code(raw, file)
    try:
        return from_hf_config(raw)
    except InvalidArgumentError as error:
        raise InvalidArgumentError(f"{file}: {error}") from None
    except (KeyError, TypeError, ValueError, ZeroDivisionError, AttributeError,
            OverflowError) as error:  # a missing or mistyped field
        raise CheckpointError(f"{file}: invalid model config ({one_line(error)})") from error


def refuse_custom_code(raw: dict, file: Path) -> None:
    """Raises when a ``config.json`` asks for the model's own Python code (``auto_map``).

    Such a model's architecture is defined by code shipped with the checkpoint, which
    specjax never runs (and would not match the architectures it implements anyway); a
    family's model types that name it only for history are let through
    (:data:`specjax.families.NATIVE_DESPITE_AUTO_MAP`).
    """
    auto_map = raw.get("auto_map")
    if not isinstance(auto_map, dict) or raw.get("model_type") in NATIVE_DESPITE_AUTO_MAP:
        return
    classes = {key: value for key, value in auto_map.items()
               if isinstance(key, str) and (key == "AutoConfig" or key.startswith("AutoModel"))}
    if classes:
        key, value = next(iter(classes.items()))
        raise CheckpointError(
            f"{file}: this model needs its own Python code (auto_map {key} -> {value!r:.80}); "
            "specjax never runs code from a checkpoint (trust_remote_code stays off), so it "
            "cannot load it")


# JSON metadata files (config, shard index, draft record) are small; anything bigger than
# this is not one, and is refused before it is read into memory.
MAX_JSON_BYTES = 64 << 20


def read_json_object(file: Path) -> dict:
    """Parses a JSON object file; any failure is a one-line :class:`CheckpointError`."""
    try:
        size = file.stat().st_size
        if size > MAX_JSON_BYTES:
            raise CheckpointError(f"{file}: {size} bytes is too large for a JSON metadata file "
                                  f"(at most {MAX_JSON_BYTES})")
        raw = json.loads(file.read_bytes().decode("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as error:
        raise CheckpointError(f"{file}: unreadable ({one_line(error)})") from error
    if not isinstance(raw, dict):
        raise CheckpointError(f"{file}: expected a JSON object")
    return raw


# safetensors dtype -> bytes per item (the types numpy and ml_dtypes can hold).
_SAFETENSORS_ITEM_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2,
                           "U16": 2, "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4,
                           "I64": 8, "U64": 8, "F64": 8}
_MAX_SAFETENSORS_HEADER = 100_000_000  # the safetensors library's own limit


def _unique_keys(pairs: list) -> dict:
    out = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"key {key[:80]!r} appears twice")
        out[key] = value
    return out


def _natural(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def check_safetensors_header(file: Path) -> dict[str, dict]:
    """Validates a safetensors file's header against its size; returns the tensor entries.

    The header must be a JSON object no longer than the file, naming each tensor once, with
    a known dtype, a shape of non-negative integers and ``data_offsets`` whose span holds
    exactly that shape; the spans must tile the data section (no overlap, no gap, nothing
    past the end), as the format requires. Only the header is read.

    Raises:
      CheckpointError: naming the file and the first problem found.
    """
    try:
        size = file.stat().st_size
        with open(file, "rb") as handle:
            head = handle.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{file}: {size} bytes is too short for a safetensors "
                                      "file (truncated?)")
            (length,) = struct.unpack("<Q", head)
            if length > min(size - 8, _MAX_SAFETENSORS_HEADER):
                raise CheckpointError(
                    f"{file}: the safetensors header claims {length} bytes, but the file has "
                    f"{size - 8} after the length field and headers are at most "
                    f"{_MAX_SAFETENSORS_HEADER} (truncated or corrupt)")
            raw = handle.read(length)
    except OSError as error:
        raise CheckpointError(f"{file}: unreadable ({one_line(error)})") from error
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_unique_keys)
    except (UnicodeDecodeError, ValueError, RecursionError) as error:
        raise CheckpointError(f"{file}: the safetensors header is not valid JSON "
                              f"({one_line(error)})") from error
    if not isinstance(header, dict):
        raise CheckpointError(f"{file}: the safetensors header is not a JSON object")
    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(
            isinstance(value, str) for value in metadata.values()):
        raise CheckpointError(f"{file}: __metadata__ must map strings to strings")
    data_size = size - 8 - length
    spans = []
    for name, entry in header.items():
        if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
            raise CheckpointError(f"{file}: the entry of tensor {name!r:.80} is not "
                                  "{dtype, shape, data_offsets}")
        dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        item_bytes = _SAFETENSORS_ITEM_BYTES.get(dtype) if isinstance(dtype, str) else None
        if item_bytes is None:
            raise CheckpointError(f"{file}: tensor {name!r:.80} has unsupported dtype "
                                  f"{dtype!r:.40}")
        if not isinstance(shape, list) or not all(_natural(n) for n in shape):
            raise CheckpointError(f"{file}: tensor {name!r:.80} has a malformed shape "
                                  f"{shape!r:.80}")
        if (not isinstance(offsets, list) or len(offsets) != 2
                or not all(_natural(n) for n in offsets) or offsets[0] > offsets[1]):
            raise CheckpointError(f"{file}: tensor {name!r:.80} has malformed data_offsets "
                                  f"{offsets!r:.80}")
        begin, end = offsets
        if end > data_size:
            raise CheckpointError(
                f"{file}: tensor {name!r:.80} data_offsets [{begin}, {end}] run past the "
                f"{data_size} data bytes of the file (truncated or corrupt)")
        needed = math.prod(shape) * item_bytes
        if needed != end - begin:
            raise CheckpointError(
                f"{file}: tensor {name!r:.80} is {dtype} {shape} ({needed} bytes) but its "
                f"data_offsets span {end - begin} bytes")
        spans.append((begin, end, name))
    spans.sort()
    covered, previous = 0, None
    for begin, end, name in spans:
        if begin < covered:
            raise CheckpointError(f"{file}: tensors {previous!r:.80} and {name!r:.80} overlap")
        if begin > covered:
            raise CheckpointError(f"{file}: data bytes {covered}..{begin} belong to no tensor")
        covered, previous = end, name
    if covered != data_size:
        raise CheckpointError(f"{file}: the tensors cover {covered} of the {data_size} data "
                              "bytes")
    return header


def _read_safetensors(file: Path, into: dict[str, np.ndarray], origin: dict[str, str],
                      bar=None) -> None:
    """Adds every tensor of one safetensors file to ``into``; rejects names seen before."""
    from safetensors import SafetensorError, safe_open

    check_safetensors_header(file)
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


def _shard_file(index: Path, shard: str) -> Path:
    """The file a shard index names, which must lie inside the checkpoint directory.

    A name is a relative path without ``..``; the file it names, links followed, must stay
    inside the directory. The one exception is the Hugging Face cache, whose snapshot
    directories hold links into their repository's ``blobs/``.
    """
    if not shard:
        raise CheckpointError(f"{index}: a shard name is empty")
    if Path(shard).is_absolute() or ".." in Path(shard).parts or "\\" in shard:
        raise CheckpointError(f"{index}: shard {shard!r:.80} is outside the checkpoint "
                              "directory; an index may only name files inside it")
    root = index.parent.resolve()
    allowed = [root]
    if root.parent.name == "snapshots":
        allowed.append(root.parent.parent / "blobs")
    file = index.parent / shard
    try:
        real = file.resolve()
    except (OSError, RuntimeError) as error:  # a link loop
        raise CheckpointError(f"{index}: shard {shard!r:.80} cannot be resolved "
                              f"({one_line(error)})") from error
    if not any(real.is_relative_to(place) for place in allowed):
        raise CheckpointError(f"{index}: shard {shard!r:.80} links to {real}, outside the "
                              "checkpoint directory; copy the file into the directory")
    if not real.is_file():
        raise CheckpointError(f"{index}: shard {shard} is missing")
    return file


def _read_sharded(index: Path, reader, bar=None) -> dict[str, np.ndarray]:
    """Reads the shards an ``*.index.json`` names and checks them against its weight map."""
    weight_map = read_json_object(index).get("weight_map")
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{index}: unreadable shard index (no weight_map object)")
    for name, shard in weight_map.items():
        if not isinstance(shard, str):
            raise CheckpointError(f"{index}: tensor {name!r:.80} is mapped to {shard!r:.80}, "
                                  "not a file name")
    files = {shard: _shard_file(index, shard) for shard in set(weight_map.values())}
    tensors: dict[str, np.ndarray] = {}
    origin: dict[str, str] = {}
    for shard in sorted(files):
        reader(files[shard], tensors, origin, bar)
    for name, shard in weight_map.items():
        if origin.get(name) != shard:
            where = f"found in {origin[name]}" if name in origin else "not found in any shard"
            raise CheckpointError(f"{index}: tensor {name!r} is listed in {shard} but {where}")
    return tensors


def weights_file(path: str | os.PathLike) -> Path:
    """The file that holds (or, for an index, lists) the weights of the HF directory ``path``.

    Raises:
      CheckpointError: the directory has none of the weight files.
    """
    path = Path(path)
    for name in (SAFETENSORS_FILE, SAFETENSORS_INDEX, TORCH_FILE, TORCH_INDEX):
        if (path / name).is_file():
            return path / name
    raise CheckpointError(
        f"{path}: no weights found (expected {SAFETENSORS_FILE}, {SAFETENSORS_INDEX} or "
        f"{TORCH_FILE})")


def read_hf_tensors(path: str | os.PathLike, progress: bool = False) -> dict[str, np.ndarray]:
    """Every weight tensor of the HF directory ``path``, by HF name, as numpy arrays."""
    file = weights_file(path)
    tensors: dict[str, np.ndarray] = {}
    origin: dict[str, str] = {}
    # A bar on a terminal only: elsewhere "reading tensors: 0tensor" would be noise.
    with progress_lib.terminal_bar(desc="reading tensors", unit="tensor", progress=progress,
                                   leave=False) as bar:
        if file.name == SAFETENSORS_FILE:
            _read_safetensors(file, tensors, origin, bar)
        elif file.name == SAFETENSORS_INDEX:
            tensors = _read_sharded(file, _read_safetensors, bar)
        elif file.name == TORCH_FILE:
            _read_torch(file, tensors, origin, bar)
        else:
            tensors = _read_sharded(file, _read_torch, bar)
    return tensors


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
    # a tensor problem names the weight file (or the index that lists the shards)
    params = keymap.params_from_hf_tensors(config, tensors, source=str(weights_file(path)),
                                           dtype=as_numpy_dtype(dtype))
    return config, params


# transformers' "advisory" warnings (logger.warning_advice) print nothing while it is set.
_NO_ADVICE = "TRANSFORMERS_NO_ADVISORY_WARNINGS"


@contextlib.contextmanager
def quiet_transformers_import():
    """Imports inside the block do not print transformers' "PyTorch was not found"
    advice: specjax uses its tokenizers only, which need no torch, and the line came on
    every load where torch is absent. Its other warnings and errors are untouched."""
    if "transformers" in sys.modules or os.environ.get(_NO_ADVICE):
        yield  # imported already (the advice is printed once, at import), or silenced
        return
    os.environ[_NO_ADVICE] = "1"
    try:
        yield
    finally:
        os.environ.pop(_NO_ADVICE, None)


def has_tokenizer(path: str | os.PathLike) -> bool:
    """Whether the directory ``path`` carries tokenizer files."""
    return any((Path(path) / name).is_file() for name in TOKENIZER_FILES)


def load_hf_tokenizer(path: str | os.PathLike):
    """The tokenizer saved in ``path`` (``AutoTokenizer``), or ``None`` when there is none.

    ``trust_remote_code=False`` is passed explicitly: left unset, transformers asks on the
    terminal whether to run a tokenizer's own code. Chat templates are checked with
    :func:`check_chat_template`.

    Raises:
      CheckpointError: the tokenizer files are unreadable, or a chat template reaches for
        Python internals.
    """
    if not has_tokenizer(path):
        return None
    with quiet_transformers_import():
        from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)
    except Exception as error:  # transformers raises OSError, ValueError, JSON errors...
        if _tokenizer_asks_for_code(Path(path)):
            raise CheckpointError(
                f"{path}: this tokenizer needs its own Python code (auto_map in "
                "tokenizer_config.json); specjax never runs code from a checkpoint "
                "(trust_remote_code stays off), so it cannot load it") from error
        raise CheckpointError(f"{path}: unreadable tokenizer ({one_line(error)})") from error
    templates = getattr(tokenizer, "chat_template", None)
    if isinstance(templates, dict):  # several named templates
        for name, template in templates.items():
            check_chat_template(template, f"{path}: chat template {name!r:.40}")
    elif templates is not None:
        check_chat_template(templates, f"{path}: chat template")
    return tokenizer


def _tokenizer_asks_for_code(path: Path) -> bool:
    try:
        return "auto_map" in read_json_object(path / "tokenizer_config.json")
    except CheckpointError:
        return False


def check_chat_template(template: Any, source: str) -> None:
    """Refuses a chat template that reaches for Python internals, before anything renders it.

    A chat template is data from the checkpoint. transformers renders templates in
    jinja2's ``ImmutableSandboxedEnvironment``, which refuses any attribute whose name
    starts with ``_`` when the template runs. This check finds such access when the model
    loads (``x.__class__``, ``x._private``, ``x['__globals__']``, ``x|attr('__init__')``),
    so the load fails in one line naming the file, not the first chat prompt. A name built
    at run time (``x['__cla' ~ 'ss__']``) passes here and is refused by the sandbox; a
    template that does not parse is left for the renderer to report.

    Args:
      template: the template text.
      source: where it came from, for the message (file and field).
    Raises:
      CheckpointError: the template is not a string or reads an underscore attribute.
    """
    from jinja2 import nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    if not isinstance(template, str):
        raise CheckpointError(f"{source} is {type(template).__name__}, not a string")
    environment = ImmutableSandboxedEnvironment(
        extensions=[_GenerationBlock, "jinja2.ext.loopcontrols"])
    try:
        tree = environment.parse(template)
    except jinja2.TemplateSyntaxError:
        return
    for node in tree.find_all((nodes.Getattr, nodes.Getitem, nodes.Filter)):
        if isinstance(node, nodes.Getattr):
            name = node.attr
        elif isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Const):
            name = node.arg.value if _is_dunder(node.arg.value) else None
        elif isinstance(node, nodes.Filter) and node.name == "attr" and node.args and \
                isinstance(node.args[0], nodes.Const):
            name = node.args[0].value
        else:
            continue
        if isinstance(name, str) and name.startswith("_"):
            raise CheckpointError(
                f"{source} reads {name!r:.40} (line {node.lineno}), a Python internal; "
                "templates are data, not code, so this one is refused")


def _is_dunder(value) -> bool:
    return isinstance(value, str) and value.startswith("__")


class _GenerationBlock(jinja2.ext.Extension):
    """Parses transformers' ``{% generation %}...{% endgeneration %}`` as a plain block."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


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

    # A restricted draft head is a specjax runtime option, not part of the architecture.
    params = {k: v for k, v in params.items() if k != HEAD_SUBSET}
    check_params(config, params, source="params")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = keymap.hf_tensors_from_params(config, params)
    hf_config = to_hf_config(config)
    hf_config["dtype"] = _dtype_name(params)
    (path / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    # transformers refuses safetensors files without a "format" entry in their metadata.
    save_file(tensors, str(path / SAFETENSORS_FILE), metadata={"format": "pt"})
    if tokenizer is not None:
        tokenizer.save_pretrained(str(path))
    return path
